"""A language-model bot as a bot worker, streaming its answer: a stand-in for a model, so that
streaming can be tried anywhere — no network, no model. The fake model yields a canned answer a
word at a time, LLM_TOKEN_DELAY_MS (50) apart; the bot shows "Thinking…", then its reply as it
grows, and sends the whole reply, which is what is delivered once the turn commits. Like a real
agent it keeps the conversation's transcript in conversation state (`transcript`: the user's and
its own messages, in order). Several messages answered at once — a batch under the double-text
policy `coalesce`, or the messages a turn superseded under `interrupt` — are one prompt.

    LLM_TOKEN_DELAY_MS=50 python examples/llm.py 0.0.0.0:50063
    turnstile serve --remote-bot llm-py=http://127.0.0.1:50063

Then `StreamTurn` with `bot: "llm-py"` streams the drafts, and `ProcessTurn` just answers.
"""

import asyncio
import os
import sys

from turnstile_worker import Worker

worker = Worker()


class FakeModel:
    """Writes a canned answer one word ("token") every `delay` seconds."""

    def __init__(self, delay: float):
        self.delay = delay

    async def tokens(self, prompt: str, turn: int):
        # A function of the prompt and the transcript alone, as the replay rule asks.
        answer = (
            f'You said "{prompt}". This is answer number {turn} of this conversation, '
            "written one word at a time the way a language model writes."
        )
        words = answer.split(" ")
        for i, word in enumerate(words):
            await asyncio.sleep(self.delay)
            yield word if i == len(words) - 1 else word + " "


model = FakeModel(int(os.environ.get("LLM_TOKEN_DELAY_MS", "50")) / 1000)


@worker.bot(os.environ.get("BOT_NAME", "llm-py"))
async def llm(turn):
    if turn.activity.get("type") != "message":
        return
    # What the user said that this answer is for: the messages of a batch (double-text policy
    # `coalesce`) or the ones this turn superseded before its own (`interrupt`), else just this one.
    said = [
        (a.get("text") or "").strip()
        for a in turn.superseded + (turn.batch or [turn.activity])
        if a.get("type") == "message"
    ]
    transcript = turn.conversation.get("transcript", [])
    answered = sum(1 for m in transcript if m["role"] == "assistant")
    await turn.inform("Thinking…")
    reply = await turn.stream(model.tokens(" / ".join(said), answered + 1))
    turn.conversation["transcript"] = (
        transcript
        + [{"role": "user", "text": text} for text in said]
        + [{"role": "assistant", "text": reply}]
    )
    turn.send(reply)


if __name__ == "__main__":
    asyncio.run(worker.serve(sys.argv[1] if len(sys.argv) > 1 else "[::]:50063"))
