"""The counter bot as a bot worker, the same bot as Turnstile's built-in `counter`: every message
adds one to a conversation counter and replies `count: N`; an `event` named `read` replies the
count without counting; a message whose `value` is `{"pad": B}` keeps B bytes of padding in the
state (for benchmarks).

    python examples/counter.py 0.0.0.0:50062
    turnstile serve --remote-bot counter-py=http://127.0.0.1:50062
"""

import asyncio
import sys

from turnstile_worker import Worker

worker = Worker()


@worker.bot("counter-py")
def counter(turn):
    activity = turn.activity
    if activity.get("type") == "event" and activity.get("name") == "read":
        turn.send(f"count: {turn.conversation.get('count', 0)}")
        return
    if activity.get("type") != "message":
        return
    count = turn.conversation.get("count", 0) + 1
    turn.conversation["count"] = count
    pad = (activity.get("value") or {}).get("pad") if isinstance(activity.get("value"), dict) else None
    if isinstance(pad, int) and pad >= 0:
        pad = min(pad, 64 * 1024)
        if len(turn.conversation.get("pad", "")) != pad:
            turn.conversation["pad"] = "." * pad
    turn.send(f"count: {count}")


if __name__ == "__main__":
    asyncio.run(worker.serve(sys.argv[1] if len(sys.argv) > 1 else "[::]:50062"))
