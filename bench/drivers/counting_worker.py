"""A streaming bot worker that counts its runs, for bench/gateway_streaming.sh: each call of the
bot (every attempt of every turn, on any replica) appends one JSON line to RUNS_FILE before it
does anything else, and another when it has sent its reply, so that the bench can count how often
the bot ran per activity, runs cut short by a killed replica included.

The bot drafts "Thinking…", then writes WORDS words (34, as the `llm` sample bot's answer to a
one-word message) TOKEN_DELAY_MS apart with `turn.stream`, counts its turns in conversation
state, and sends the whole text.

    RUNS_FILE=runs.jsonl TOKEN_DELAY_MS=588 python counting_worker.py 127.0.0.1:50063
"""

import asyncio
import json
import os
import sys
import time

from turnstile_worker import Worker

RUNS_FILE = os.environ["RUNS_FILE"]
WORDS = int(os.environ.get("WORDS", "34"))
DELAY = int(os.environ.get("TOKEN_DELAY_MS", "50")) / 1000

worker = Worker()


def record(event: str, turn) -> None:
    activity = turn.activity
    line = {
        "event": event,
        "id": activity.get("id"),
        "conversation": (activity.get("conversation") or {}).get("id"),
        "attempt": turn.attempt,
        "streaming": turn.streaming,
        "t": time.time(),
    }
    # One write of one line, opened in append mode: lines of concurrent runs never interleave.
    with open(RUNS_FILE, "a", encoding="utf-8") as runs:
        runs.write(json.dumps(line) + "\n")


async def words():
    for i in range(WORDS):
        await asyncio.sleep(DELAY)
        yield f"word{i + 1}" if i == WORDS - 1 else f"word{i + 1} "


@worker.bot(os.environ.get("BOT_NAME", "counted"))
async def counted(turn):
    record("run", turn)
    if turn.activity.get("type") != "message":
        return
    await turn.inform("Thinking…")
    reply = await turn.stream(words())
    turn.conversation["turns"] = turn.conversation.get("turns", 0) + 1
    turn.send(reply)
    record("sent", turn)


if __name__ == "__main__":
    asyncio.run(worker.serve(sys.argv[1]))
