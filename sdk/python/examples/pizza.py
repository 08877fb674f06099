"""The pizza order bot as a bot worker: `add <topping>`, `remove <topping>`, `show`, `clear`.

The order is a list in conversation state. Two "add" messages handled at once by two Turnstile
replicas both end up on the pizza: the one that loses the race is run again on the order the
other one saved, so no reply ever names an order that was not saved.

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
    if turn.activity.get("type") != "message":
        return
    command, _, argument = turn.text.partition(" ")
    command, argument = command.lower(), argument.strip()
    order = turn.conversation.get("order", [])
    if command == "add" and argument:
        if any(t.lower() == argument.lower() for t in order):
            turn.send(f"{argument} is already on your pizza. {describe(order)}")
        else:
            turn.conversation["order"] = order + [argument]
            turn.send(f"Added {argument}. {describe(order + [argument])}")
    elif command == "remove" and argument:
        kept = [t for t in order if t.lower() != argument.lower()]
        if len(kept) == len(order):
            turn.send(f"There is no {argument} on your pizza. {describe(order)}")
        else:
            turn.conversation["order"] = kept
            turn.send(f"Removed {argument}. {describe(kept)}")
    elif command == "show" and not argument:
        turn.send(describe(order))
    elif command == "clear" and not argument:
        turn.conversation.pop("order", None)
        turn.send("Cleared your order. Your pizza has no toppings.")
    else:
        turn.send("Say `add <topping>`, `remove <topping>`, `show` or `clear`.")


if __name__ == "__main__":
    asyncio.run(worker.serve(sys.argv[1] if len(sys.argv) > 1 else "[::]:50061"))
