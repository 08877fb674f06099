"""The pizza order bot as a bot worker: `add <topping>`, `remove <topping>`, `show`, `clear`.

The order is a list in conversation state. Two "add" messages handled at once by two Turnstile
replicas both end up on the pizza: the one that loses the race is run again on the order the
other one saved, so no reply ever names an order that was not saved. Under the double-text
policies `coalesce` and `interrupt` one turn answers several commands, each in order.

    python examples/pizza.py 0.0.0.0:50061
    turnstile serve --remote-bot pizza-py=http://127.0.0.1:50061
"""

import asyncio
import sys

from turnstile_worker import Worker

worker = Worker()


def describe(order):
    if not order:
        return "Your pizza has no toppings."
    return f"Your pizza has: {', '.join(order)}."


@worker.bot("pizza-py")
def pizza(turn):
    # The commands this turn answers: with the double-text policy `coalesce` every message of the
    # batch, with `interrupt` the superseded ones first (never applied: nothing of their turns was
    # saved), else just this one. Each is applied in order and answered.
    messages = [
        a for a in turn.superseded + (turn.batch or [turn.activity]) if a.get("type") == "message"
    ]
    if not messages:
        return
    saved = order = turn.conversation.get("order", [])
    for activity in messages:
        order = command(order, (activity.get("text") or "").strip(), turn.send)
    if order != saved:
        if order:
            turn.conversation["order"] = order
        else:
            turn.conversation.pop("order", None)


def command(order, text, send):
    """Applies one command to `order`, sends its answer, and returns the new order."""
    command, _, argument = text.partition(" ")
    command, argument = command.lower(), argument.strip()
    if command == "add" and argument:
        if any(t.lower() == argument.lower() for t in order):
            send(f"{argument} is already on your pizza. {describe(order)}")
            return order
        send(f"Added {argument}. {describe(order + [argument])}")
        return order + [argument]
    if command == "remove" and argument:
        kept = [t for t in order if t.lower() != argument.lower()]
        if len(kept) == len(order):
            send(f"There is no {argument} on your pizza. {describe(order)}")
        else:
            send(f"Removed {argument}. {describe(kept)}")
        return kept
    if command == "show" and not argument:
        send(describe(order))
    elif command == "clear" and not argument:
        send("Cleared your order. Your pizza has no toppings.")
        return []
    else:
        send("Say `add <topping>`, `remove <topping>`, `show` or `clear`.")
    return order


if __name__ == "__main__":
    asyncio.run(worker.serve(sys.argv[1] if len(sys.argv) > 1 else "[::]:50061"))
