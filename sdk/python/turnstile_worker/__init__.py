"""Bot workers for Turnstile, in Python.

A bot worker runs your bot's logic; Turnstile runs the turn around it: it queues a
conversation's turns, loads the state, calls your handler, commits the state only if nobody
changed it meanwhile, and otherwise calls your handler again on the fresh state. Your replies
leave only after the commit. So a handler must follow the replay rule: it may run more than once
for one turn, and only the run that commits counts. Keep side effects out of it, or make them
idempotent, keyed by ``turn.activity["id"]``.

    from turnstile_worker import Worker

    worker = Worker()

    @worker.bot("echo")
    def echo(turn):
        turn.conversation["seen"] = turn.conversation.get("seen", 0) + 1
        turn.send(f"you said {turn.text}")

    asyncio.run(worker.serve("0.0.0.0:50061"))

A plain handler runs in a thread of the worker's pool, so one that blocks (a model call, an HTTP
request) holds up no other turn; an ``async def`` handler runs on the event loop and must not
block it.

A handler may show its answer as it writes it, when the turn is streamed (``StreamTurn``):
``await turn.inform("Thinking…")`` shows a status line, ``await turn.draft(text_so_far)`` the
reply so far, and ``reply = await turn.stream(tokens)`` drafts the growing text of an async
iterator of model tokens and returns the whole of it. Drafts are provisional; only what the
handler ``send``s is delivered, after the commit. On a turn nobody streams they do nothing.

    @worker.bot("llm")
    async def llm(turn):
        await turn.inform("Thinking…")
        turn.send(await turn.stream(model.tokens(turn.text)))

When a message arrives while a turn of its conversation still runs, the bot's double-text policy
in Turnstile decides what happens. Under ``interrupt`` the running turn is cancelled and the new
one gets the messages it cancelled in ``turn.superseded``; under ``coalesce`` the messages that
arrived meanwhile are answered by one run, which gets them all in ``turn.batch``. The messages a
turn answers are then ``turn.superseded + (turn.batch or [turn.activity])``.

The gRPC stubs are generated when this package is imported, from the copy of ``worker.proto`` it
carries, by grpcio-tools (``grpc.protos_and_services``): nothing generated is committed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import functools
import inspect
import json
import logging
import os
import signal
import sys
import sysconfig
import traceback
from typing import Any, AsyncIterable, Awaitable, Callable, Iterable, Optional, Union

import grpc

__all__ = ["Scope", "Turn", "Worker"]

_PROTOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protos")


def _load_protos():
    # protos_and_services looks the file up on sys.path.
    sys.path.insert(0, _PROTOS)
    try:
        return grpc.protos_and_services("turnstile/v1/worker.proto")
    finally:
        sys.path.remove(_PROTOS)


pb, _services = _load_protos()

_TRACE = bool(os.environ.get("TURNSTILE_WORKER_TRACE"))

_log = logging.getLogger("turnstile_worker")

#: How many plain (non-async) handlers may run at once, each in a thread of its own.
DEFAULT_MAX_THREADS = 32


class Scope(dict):
    """One state scope: a dict of JSON values, saved with the turn if the turn commits.

    Turnstile checks at commit time that a scope your handler read has not changed meanwhile
    (and replays the turn if it has), so the scope records whether you read it. Writes need no
    care: any change, nested ones included, is found by comparing with the state as loaded.
    ``exists`` says whether this scope had ever been written before this turn.
    """

    def __init__(self, state: dict, exists: bool):
        super().__init__(state)
        self.exists = exists
        self.read = False

    def _reading(self):
        self.read = True

    def __getitem__(self, key):
        self._reading()
        return super().__getitem__(key)

    def __contains__(self, key):
        self._reading()
        return super().__contains__(key)

    def __iter__(self):
        self._reading()
        return super().__iter__()

    def __len__(self):
        self._reading()
        return super().__len__()

    def __eq__(self, other):
        self._reading()
        return super().__eq__(other)

    __hash__ = None

    def __repr__(self):
        self._reading()
        return f"Scope({super().__repr__()})"

    def get(self, key, default=None):
        self._reading()
        return super().get(key, default)

    def keys(self):
        self._reading()
        return super().keys()

    def values(self):
        self._reading()
        return super().values()

    def items(self):
        self._reading()
        return super().items()

    def pop(self, key, *default):
        self._reading()
        return super().pop(key, *default)

    def popitem(self):
        self._reading()
        return super().popitem()

    def setdefault(self, key, default=None):
        self._reading()
        return super().setdefault(key, default)

    def copy(self):
        self._reading()
        return dict(super().items())


class _Done:
    """What ``Turn.draft`` returns: awaitable, done at once, so that an ``async def`` handler
    writes ``await turn.draft(text)`` and a plain one ``turn.draft(text)``."""

    __slots__ = ()

    def __await__(self):
        return iter(())


_DONE = _Done()


class _Drafts:
    """The drafts of one streamed attempt, on their way to the stream: put from the event loop
    or from a handler's thread alike, in the order they were made."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def put(self, item) -> None:
        if self.closed:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self.queue.put_nowait(item)
        else:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Turn:
    """One attempt of one turn: the activity, the three state scopes, ``send``, and the drafts a
    streamed turn shows while it runs (``draft``, ``inform``, ``stream``)."""

    def __init__(self, request, drafts: Optional[_Drafts] = None):
        self._drafts = drafts
        self.bot: str = request.bot
        #: The inbound activity, a Bot Framework JSON object (camelCase keys).
        self.activity: dict = json.loads(request.activity_json)
        #: 1, or more when a conflict made Turnstile replay the turn on fresh state.
        self.attempt: int = request.attempt
        #: The messages this turn supersedes, oldest first, as dicts like ``activity``: when the
        #: bot's double-text policy is ``interrupt``, earlier messages of the conversation whose
        #: turns this one cancelled before they committed. Nothing of those turns was kept, and
        #: they were never answered, so this turn should take them into account. Empty otherwise.
        self.superseded: list = [json.loads(a) for a in request.superseded_json]
        #: The messages this run answers together, in arrival order, as dicts like ``activity``:
        #: when the bot's double-text policy is ``coalesce``, every message that arrived while the
        #: conversation's previous turn ran, the latest last. ``activity`` is one of them, the
        #: one whose call runs the batch (its user's scopes are the ones given); the replies
        #: answer them all. Empty otherwise.
        self.batch: list = [json.loads(a) for a in request.batch_json]
        self._loaded = {}
        #: Shared by everyone in the conversation.
        self.conversation: Scope = self._scope(request, "conversation")
        #: This user across conversations; None when the activity names no user, or when the
        #: server gives the bot only other scopes (``--bot-scopes``).
        self.user: Optional[Scope] = self._scope(request, "user")
        #: This user within this conversation; None as ``user`` is.
        self.private_conversation: Optional[Scope] = self._scope(request, "private_conversation")
        self.replies: list = []

    def _scope(self, request, name):
        if not request.HasField(name):
            return None
        state = getattr(request, name)
        loaded = json.loads(state.state_json)
        self._loaded[name] = loaded
        return Scope(copy.deepcopy(loaded), state.exists)

    @property
    def text(self) -> str:
        """The activity's text, trimmed; empty when it has none."""
        return (self.activity.get("text") or "").strip()

    def send(self, reply: Union[str, dict], **fields: Any) -> None:
        """Buffers a reply: a text, or an activity dict (camelCase keys) with ``fields`` added.

        It is delivered only if this attempt commits. Addressing left out (type, conversation,
        from, recipient, replyToId) is filled in by Turnstile as a reply to the inbound activity.
        """
        activity = {"type": "message", "text": reply} if isinstance(reply, str) else dict(reply)
        activity.update(fields)
        self.replies.append(activity)

    @property
    def streaming(self) -> bool:
        """Whether someone watches this turn's drafts. A handler need not ask: drafting a turn
        nobody streams does nothing. It may, to skip work only drafts need."""
        return self._drafts is not None

    def draft(self, text: str) -> Awaitable[None]:
        """Shows ``text``, the whole reply written so far (not the new part), to whoever streams
        the turn. Provisional: never stored, voided if the attempt is replayed; only what you
        ``send`` is delivered, so the last draft should be the text you then send. Returns at
        once; ``await`` it in an ``async def`` handler, or call it plainly from a plain one."""
        self._offer(pb.WORKER_DRAFT_KIND_TEXT, text)
        return _DONE

    def inform(self, text: str) -> Awaitable[None]:
        """Shows a status line ("Looking at the menu…") to whoever streams the turn: not part of
        the reply, as provisional as a draft. Awaitable or plain, like :meth:`draft`."""
        self._offer(pb.WORKER_DRAFT_KIND_INFORMATIVE, text)
        return _DONE

    async def stream(self, tokens: Union[AsyncIterable[str], Iterable[str]]) -> str:
        """Drafts the growing text of ``tokens`` (an async iterator of a model's tokens, or a
        plain iterable) as each arrives, and returns the whole text: ``turn.send(await
        turn.stream(tokens))``. In a plain handler, loop and call :meth:`draft` instead."""
        text = ""
        if hasattr(tokens, "__aiter__"):
            async for token in tokens:
                text += token
                self.draft(text)
        else:
            for token in tokens:
                text += token
                self.draft(text)
        return text

    def _offer(self, kind, text) -> None:
        if not isinstance(text, str):
            raise TypeError(f"a draft is a str, not {type(text).__name__}")
        if self._drafts is not None:
            self._drafts.put(pb.WorkerDraft(kind=kind, text=text))

    def _answer(self):
        answer = pb.RunTurnResponse(replies_json=[json.dumps(r) for r in self.replies])
        for name, loaded in self._loaded.items():
            scope = getattr(self, name)
            read = scope.read  # before anything below reads the scope
            outcome = getattr(answer, name)
            outcome.read = read
            if not dict.__eq__(scope, loaded):
                outcome.replaced_json = json.dumps(dict(dict.items(scope)))
            elif not read:
                answer.ClearField(name)
        return answer


Handler = Callable[[Turn], Union[None, Awaitable[None]]]


class _Servicer(_services.BotWorkerServicer):
    def __init__(self, bots: dict, token: Optional[str], threads: concurrent.futures.Executor):
        self._bots = bots
        self._authorization = f"Bearer {token}" if token else None
        self._threads = threads

    async def _handler(self, request, context, method: str):
        """The bot ``request`` names, once the call's token is checked."""
        if self._authorization is not None:
            sent = dict(context.invocation_metadata()).get("authorization")
            if sent != self._authorization:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid bearer token")
        handler = self._bots.get(request.bot)
        if handler is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this worker serves no bot named {request.bot!r} (it serves: {', '.join(self._bots)})",
            )
        if _TRACE:
            activity = json.loads(request.activity_json)
            print(
                f"turnstile-worker: {method} bot={request.bot} activity={activity.get('id')} "
                f"attempt={request.attempt}",
                file=sys.stderr,
                flush=True,
            )
        return handler

    async def _failed(self, request, turn, error, context):
        """Reports the bot's bug to Turnstile, which commits nothing. The whole traceback goes to
        this worker's log; Turnstile's caller learns only what and where, since the exception's
        message may quote the state or the activity."""
        _log.error(
            "bot %r failed on activity %s (attempt %d)",
            request.bot,
            turn.activity.get("id"),
            request.attempt,
            exc_info=error,
        )
        await context.abort(grpc.StatusCode.INTERNAL, _describe_failure(error))

    async def RunTurn(self, request, context):
        handler = await self._handler(request, context, "RunTurn")
        turn = Turn(request)
        try:
            await self._run(handler, turn)
        except Exception as e:  # the bot's bug
            await self._failed(request, turn, e, context)
        return turn._answer()

    async def StreamRunTurn(self, request, context):
        """RunTurn for a streamed turn: the handler's drafts as it makes them, then its answer."""
        handler = await self._handler(request, context, "StreamRunTurn")
        drafts = _Drafts(asyncio.get_running_loop())
        turn = Turn(request, drafts)
        done = object()
        task = asyncio.ensure_future(self._run(handler, turn))
        # After every draft the handler made: a thread's drafts reach the loop before its end.
        task.add_done_callback(lambda _: drafts.queue.put_nowait(done))
        try:
            while True:
                draft = await drafts.queue.get()
                if draft is done:
                    break
                yield pb.StreamRunTurnResponse(draft=draft)
        finally:
            # Drafts made after the end (by a thread the handler left running) go nowhere; a
            # call Turnstile gave up on (the user stopped the turn, or its caller went away)
            # stops its handler, if it is a coroutine: it is cancelled at its next await.
            drafts.closed = True
            if not task.done():
                task.cancel()
                print(
                    f"turnstile-worker: bot '{request.bot}' cancelled on activity "
                    f"{turn.activity.get('id')} (attempt {request.attempt}): Turnstile cancelled "
                    "the call (the user stopped the turn, or its caller gave up)",
                    file=sys.stderr,
                    flush=True,
                )
        error = task.exception()
        if error is not None:
            await self._failed(request, turn, error, context)
        yield pb.StreamRunTurnResponse(result=turn._answer())

    async def _run(self, handler, turn):
        """Runs ``handler`` on ``turn``: a coroutine function on the event loop, anything else
        in a thread of the pool (with this call's context variables), so that it may block."""
        if _is_async(handler):
            await handler(turn)
            return
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, handler, turn)
        result = await loop.run_in_executor(self._threads, call)
        if inspect.isawaitable(result):
            await result


def _is_async(handler) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)
    )


# Frames in these directories are Python's or an installed package's (this one included), not
# the bot's own code.
_LIBRARY_DIRS = tuple(
    os.path.join(os.path.realpath(p), "")
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {os.path.dirname(os.path.abspath(__file__))}
)


def _describe_failure(error: BaseException) -> str:
    """What ``error`` is and where it was raised, for the status Turnstile's caller sees:
    ``the bot raised KeyError in greet (bot.py:12)``; when it was raised inside a library, the
    innermost frame of the bot's own code follows. Never the exception's message."""
    frames = traceback.extract_tb(error.__traceback__)
    # The first frame is this module's call of the handler.
    frames = [f for f in frames if f.filename != __file__] or frames
    if not frames:
        return f"the bot raised {type(error).__name__}"
    raised = frames[-1]
    where = f" in {_frame(raised)}"
    if _is_library(raised.filename):
        own = [f for f in frames if not _is_library(f.filename)]
        if own:
            where += f", called from {_frame(own[-1])}"
    return f"the bot raised {type(error).__name__}{where}; the traceback is in the worker's log"


def _frame(frame: traceback.FrameSummary) -> str:
    filename = frame.filename
    relative = os.path.relpath(filename) if os.path.isabs(filename) else filename
    if not relative.startswith(os.pardir + os.sep):
        filename = relative
    return f"{frame.name} ({filename}:{frame.lineno})"


def _is_library(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_LIBRARY_DIRS)


class Worker:
    """Serves one or more bots to Turnstile as ``turnstile.v1.BotWorker``."""

    def __init__(self, *, max_threads: int = DEFAULT_MAX_THREADS) -> None:
        """``max_threads``: how many plain (non-async) handlers may run at once, each in a
        thread, so that a handler that blocks holds up no other turn."""
        self._bots: dict = {}
        self._max_threads = max_threads

    def bot(self, name: str) -> Callable[[Handler], Handler]:
        """Registers the decorated function (sync or async, taking a :class:`Turn`) as bot
        ``name``: the NAME of ``--remote-bot NAME=URL`` on the Turnstile side."""

        def register(handler: Handler) -> Handler:
            self._bots[name] = handler
            return handler

        return register

    async def start(
        self,
        address: str = "[::]:50061",
        *,
        token: Optional[str] = None,
        tls: Optional[tuple] = None,
    ):
        """Starts serving on ``address``; returns ``(server, port)``. ``token``: the bearer token
        Turnstile must send (``--remote-bot-token``). ``tls``: ``(cert_pem, key_pem)`` bytes."""
        if not self._bots:
            raise ValueError("no bots registered: decorate a handler with @worker.bot(name)")
        server = grpc.aio.server()
        threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._max_threads, thread_name_prefix="turnstile-bot"
        )
        servicer = _Servicer(dict(self._bots), token, threads)
        _services.add_BotWorkerServicer_to_server(servicer, server)
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials([(tls[1], tls[0])])
            port = server.add_secure_port(address, credentials)
        await server.start()
        return server, port

    async def serve(self, address: str = "[::]:50061", **options) -> None:
        """Serves until SIGTERM or SIGINT, then finishes the calls in flight (5 s at most)."""
        server, port = await self.start(address, **options)
        print(
            f"turnstile-worker: serving {', '.join(self._bots)} on port {port}",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(5)
