// Bot workers for Turnstile, in TypeScript or JavaScript.
//
// A bot worker runs your bot's logic; Turnstile runs the turn around it: it queues a
// conversation's turns, loads the state, calls your handler, commits the state only if nobody
// changed it meanwhile, and otherwise calls your handler again on the fresh state. Your replies
// leave only after the commit. So a handler follows the replay rule: it may run more than once
// for one turn, and only the run that commits counts. Keep side effects out of it, or make them
// idempotent, keyed by `turn.activity.id`.
//
// A handler may show its answer as it writes it, when the turn is streamed (`StreamTurn`):
// `await turn.inform('Thinking…')` shows a status line, `await turn.draft(textSoFar)` the reply so
// far, and `const reply = await turn.stream(tokens)` drafts the growing text of an async iterable
// of model tokens and returns the whole of it. Drafts are provisional; only what the handler
// `send`s is delivered, after the commit. On a turn nobody streams they do nothing.
//
// When a message arrives while a turn of its conversation still runs, the bot's double-text
// policy in Turnstile decides what happens. Under `interrupt` the running turn is cancelled and the
// new one gets the messages it cancelled in `turn.superseded`; under `coalesce` the messages that
// arrived meanwhile are answered by one run, which gets them all in `turn.batch`. The messages a
// turn answers are then `[...turn.superseded, ...(turn.batch.length ? turn.batch : [turn.activity])]`.
//
// The contract (`proto/turnstile/v1/worker.proto`, a copy the package carries) is loaded at run
// time by @grpc/proto-loader: there is no generated code.

import * as path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

// `dist/index.js` → the package's `proto/`.
const PROTO = path.join(__dirname, '..', 'proto', 'turnstile', 'v1', 'worker.proto');

const definition = protoLoader.loadSync(PROTO, {
  keepCase: true,
  longs: Number,
  defaults: true,
  oneofs: true,
});
// proto-loader's types cannot know the package's shape; this is the one service it holds.
const contract = grpc.loadPackageDefinition(definition) as unknown as {
  turnstile: { v1: { BotWorker: grpc.ServiceClientConstructor } };
};
const BotWorker = contract.turnstile.v1.BotWorker;

const TRACE = Boolean(process.env.TURNSTILE_WORKER_TRACE);

/** A JSON value, as state properties and activity members are. */
export type Json = null | boolean | number | string | Json[] | JsonObject;

/** A JSON object; a member set to `undefined` is left out, as `JSON.stringify` does. */
export interface JsonObject {
  [key: string]: Json | undefined;
}

/** A Bot Framework activity (camelCase members); only the common ones are named. */
export interface Activity {
  type?: string;
  id?: string;
  text?: string;
  name?: string;
  value?: Json;
  channelId?: string;
  conversation?: { id?: string; [key: string]: Json | undefined };
  from?: { id?: string; name?: string; [key: string]: Json | undefined };
  recipient?: { id?: string; name?: string; [key: string]: Json | undefined };
  [member: string]: Json | undefined;
}

/** One scope's state: named JSON properties, saved with the turn if the turn commits. */
export type Scope = { [property: string]: Json };

/** A scope's name, as a `Turn` property. */
export type ScopeName = 'conversation' | 'user' | 'privateConversation';

/** A bot's logic for one attempt of one turn: a plain or an `async` function. */
export type Handler = (turn: Turn) => void | Promise<void>;

/** Options of `Worker.start` and `Worker.serve`. */
export interface ServeOptions {
  /** The bearer token Turnstile must send (its `--remote-bot-token`). */
  token?: string;
  /** Serve TLS with this PEM certificate chain and key. */
  tls?: { cert: Buffer; key: Buffer };
}

/** One scope's state as the contract carries it. */
interface ScopeState {
  state_json: string;
  exists: boolean;
}

/** `RunTurnRequest`, as proto-loader decodes it (field names kept, absent messages null). */
interface RunTurnRequest {
  bot: string;
  activity_json: string;
  attempt: number;
  conversation: ScopeState | null;
  user: ScopeState | null;
  private_conversation: ScopeState | null;
  superseded_json: string[];
  batch_json: string[];
}

/** What one attempt did with one scope. */
interface ScopeOutcome {
  read: boolean;
  replaced_json?: string;
}

/** `RunTurnResponse`. */
interface RunTurnResponse {
  replies_json: string[];
  conversation?: ScopeOutcome;
  user?: ScopeOutcome;
  private_conversation?: ScopeOutcome;
}

/** `WorkerDraft`: what a streamed attempt shows while it runs. */
interface WorkerDraft {
  kind: 'WORKER_DRAFT_KIND_INFORMATIVE' | 'WORKER_DRAFT_KIND_TEXT';
  text: string;
}

/** `StreamRunTurnResponse`: a draft, or the result, last. */
type StreamRunTurnResponse = { draft: WorkerDraft } | { result: RunTurnResponse };

/** Where a streamed attempt's drafts go. */
type DraftSink = (draft: WorkerDraft) => void;

type ScopeField = 'conversation' | 'user' | 'private_conversation';

/** The scopes, by their field names in the contract and in a `Turn`. */
const SCOPES: ReadonlyArray<readonly [ScopeField, ScopeName]> = [
  ['conversation', 'conversation'],
  ['user', 'user'],
  ['private_conversation', 'privateConversation'],
];

/** A scope as loaded, and whether the handler has read it. */
interface TrackedScope {
  /** The object the handler sees. */
  proxy: Scope;
  /** The object behind it, which the handler changes through the proxy. */
  target: Scope;
  /** The state as loaded, serialized, to tell whether it changed. */
  loaded: string;
  exists: boolean;
  read: boolean;
}

/**
 * One scope's state as a plain-looking object, recording whether the handler read it: Turnstile
 * checks at commit that a scope that was read has not changed meanwhile.
 */
function trackedScope(state: ScopeState): TrackedScope {
  const loaded = JSON.stringify(JSON.parse(state.state_json));
  const target = JSON.parse(loaded) as Scope;
  const tracked: TrackedScope = { proxy: target, target, loaded, exists: state.exists, read: false };
  tracked.proxy = new Proxy(target, {
    get(object, key, receiver) {
      tracked.read = true;
      return Reflect.get(object, key, receiver);
    },
    has(object, key) {
      tracked.read = true;
      return Reflect.has(object, key);
    },
    ownKeys(object) {
      tracked.read = true;
      return Reflect.ownKeys(object);
    },
    getOwnPropertyDescriptor(object, key) {
      tracked.read = true;
      return Reflect.getOwnPropertyDescriptor(object, key);
    },
  });
  return tracked;
}

/**
 * One attempt of one turn: the activity, the three state scopes, `send`, and the drafts a
 * streamed turn shows while it runs (`draft`, `inform`, `stream`).
 */
export class Turn {
  /** The bot's name, as Turnstile knows it. */
  readonly bot: string;
  /** The inbound activity, a Bot Framework JSON object. */
  readonly activity: Activity;
  /** 1, or more when a conflict made Turnstile replay the turn on fresh state. */
  readonly attempt: number;
  /**
   * The messages this turn supersedes, oldest first: when the bot's double-text policy is
   * `interrupt`, earlier messages of the conversation whose turns this one cancelled before they
   * committed. Nothing of those turns was kept, and they were never answered, so this turn should
   * take them into account. Empty otherwise.
   */
  readonly superseded: Activity[];
  /**
   * The messages this run answers together, in arrival order: when the bot's double-text policy
   * is `coalesce`, every message that arrived while the conversation's previous turn ran, the
   * latest last. `activity` is one of them, the one whose call runs the batch (its user's scopes
   * are the ones given); the replies answer them all. Empty otherwise.
   */
  readonly batch: Activity[];
  /** Shared by everyone in the conversation. */
  readonly conversation: Scope;
  /**
   * This user across conversations; null when the activity names no user, or when the server
   * gives the bot only other scopes (`--bot-scopes`).
   */
  readonly user: Scope | null;
  /** This user within this conversation; null as `user` is. */
  readonly privateConversation: Scope | null;
  /** The replies sent so far in this attempt. */
  readonly replies: Activity[] = [];
  /**
   * Aborted when Turnstile cancels this call: the user stopped the reply (`StopTurn`), or the
   * turn's caller gave up. Pass it to a model's client or `fetch`, so that an answer nobody will
   * get stops costing; `turn.stream` stops at the next token by itself.
   */
  readonly signal: AbortSignal;
  readonly #scopes = new Map<ScopeField, TrackedScope>();
  #drafts: DraftSink | null;

  /** @internal A turn is made by the worker from Turnstile's request. */
  constructor(
    request: RunTurnRequest,
    drafts: DraftSink | null = null,
    signal: AbortSignal = new AbortController().signal,
  ) {
    this.#drafts = drafts;
    this.signal = signal;
    this.bot = request.bot;
    this.activity = JSON.parse(request.activity_json) as Activity;
    this.attempt = request.attempt;
    const activities = (texts: string[] | undefined): Activity[] =>
      (texts ?? []).map((text) => JSON.parse(text) as Activity);
    this.superseded = activities(request.superseded_json);
    this.batch = activities(request.batch_json);
    const scope = (field: ScopeField): Scope | null => {
      const state = request[field];
      if (!state) return null;
      const tracked = trackedScope(state);
      this.#scopes.set(field, tracked);
      return tracked.proxy;
    };
    // Turnstile always sends the conversation scope; an empty one stands in if it did not.
    this.conversation = scope('conversation') ?? {};
    this.user = scope('user');
    this.privateConversation = scope('private_conversation');
  }

  /** The activity's text, trimmed; empty when it has none. */
  get text(): string {
    return (this.activity.text || '').trim();
  }

  /** Whether scope `name` had been written before this turn. */
  exists(name: ScopeName): boolean {
    const field = (name === 'privateConversation' ? 'private_conversation' : name) as ScopeField;
    return Boolean(this.#scopes.get(field)?.exists);
  }

  /**
   * Buffers a reply: a text, or an activity object (with `fields` added). Delivered only if
   * this attempt commits; addressing left out is filled in by Turnstile.
   */
  send(reply: string | Activity, fields: Activity = {}): void {
    const activity: Activity = typeof reply === 'string' ? { type: 'message', text: reply } : { ...reply };
    this.replies.push(Object.assign(activity, fields));
  }

  /**
   * Whether someone watches this turn's drafts. A handler need not ask: drafting a turn nobody
   * streams does nothing. It may, to skip work only drafts need.
   */
  get streaming(): boolean {
    return this.#drafts !== null;
  }

  /**
   * Shows `text`, the whole reply written so far (not the new part), to whoever streams the
   * turn. Provisional: never stored, voided if the attempt is replayed; only what you `send` is
   * delivered, so the last draft should be the text you then send.
   */
  async draft(text: string): Promise<void> {
    this.#offer('WORKER_DRAFT_KIND_TEXT', text);
  }

  /** Shows a status line ('Looking at the menu…'): not part of the reply, provisional. */
  async inform(text: string): Promise<void> {
    this.#offer('WORKER_DRAFT_KIND_INFORMATIVE', text);
  }

  /**
   * Drafts the growing text of `tokens` (a model's tokens, as an async iterable or a plain one)
   * as each arrives, and resolves to the whole text: `turn.send(await turn.stream(tokens))`.
   */
  async stream(tokens: AsyncIterable<string> | Iterable<string>): Promise<string> {
    let text = '';
    for await (const token of tokens) {
      this.signal.throwIfAborted();
      text += token;
      this.#offer('WORKER_DRAFT_KIND_TEXT', text);
    }
    return text;
  }

  #offer(kind: WorkerDraft['kind'], text: string): void {
    if (typeof text !== 'string') throw new TypeError(`a draft is a string, not ${typeof text}`);
    this.#drafts?.({ kind, text });
  }

  /** @internal No draft goes anywhere any more: the attempt has ended. */
  endDrafts(): void {
    this.#drafts = null;
  }

  /** @internal The answer to Turnstile: the replies, and what the attempt did to each scope. */
  answer(): RunTurnResponse {
    const answer: RunTurnResponse = { replies_json: this.replies.map((r) => JSON.stringify(r)) };
    for (const [field] of SCOPES) {
      const scope = this.#scopes.get(field);
      if (!scope) continue;
      const read = scope.read; // before serializing reads it
      const now = JSON.stringify(scope.target);
      if (now !== scope.loaded) {
        answer[field] = { read, replaced_json: now };
      } else if (read) {
        answer[field] = { read };
      }
    }
    return answer;
  }
}

/** Serves one or more bots to Turnstile as `turnstile.v1.BotWorker`. */
export class Worker {
  readonly #bots = new Map<string, Handler>();

  /**
   * Registers `handler` (sync or async, taking a `Turn`) as bot `name`: the NAME of
   * `--remote-bot NAME=URL` on the Turnstile side.
   */
  bot(name: string, handler: Handler): this {
    this.#bots.set(name, handler);
    return this;
  }

  /**
   * Starts serving on `address` (`host:port`, port 0 for any); resolves to `{ server, port }`.
   * Options: `token`, the bearer token Turnstile must send (`--remote-bot-token`); `tls`,
   * `{ cert, key }` PEM buffers.
   */
  start(address = '0.0.0.0:50061', options: ServeOptions = {}): Promise<{ server: grpc.Server; port: number }> {
    if (this.#bots.size === 0) {
      return Promise.reject(new Error('no bots registered: call worker.bot(name, handler)'));
    }
    // Read per call, so that a bot registered after the start is served too.
    const bots = this.#bots;
    const server = new grpc.Server();
    server.addService(BotWorker.service, {
      RunTurn: (
        call: grpc.ServerUnaryCall<RunTurnRequest, RunTurnResponse>,
        callback: grpc.sendUnaryData<RunTurnResponse>,
      ) => {
        void runTurn(bots, call, callback, options.token);
      },
      StreamRunTurn: (call: grpc.ServerWritableStream<RunTurnRequest, StreamRunTurnResponse>) => {
        void streamRunTurn(bots, call, options.token);
      },
    });
    const credentials = options.tls
      ? grpc.ServerCredentials.createSsl(null, [{ cert_chain: options.tls.cert, private_key: options.tls.key }])
      : grpc.ServerCredentials.createInsecure();
    return new Promise((resolve, reject) => {
      server.bindAsync(address, credentials, (error, port) => (error ? reject(error) : resolve({ server, port })));
    });
  }

  /** Like `start`, printing the port, and stopping on SIGTERM or SIGINT after the calls in
   * flight (5 s at most). */
  async serve(address = '0.0.0.0:50061', options: ServeOptions = {}): Promise<{ server: grpc.Server; port: number }> {
    const { server, port } = await this.start(address, options);
    console.log(`turnstile-worker: serving ${[...this.#bots.keys()].join(', ')} on port ${port}`);
    const stop = () => {
      const force = setTimeout(() => server.forceShutdown(), 5000);
      server.tryShutdown(() => clearTimeout(force));
    };
    process.once('SIGTERM', stop);
    process.once('SIGINT', stop);
    return { server, port };
  }
}

/** A failed call's status. */
interface Failure {
  code: grpc.status;
  details: string;
}

/** The bot `call` asks for, once its token is checked; a failure otherwise. */
function handlerFor(
  bots: Map<string, Handler>,
  call: grpc.ServerUnaryCall<RunTurnRequest, unknown> | grpc.ServerWritableStream<RunTurnRequest, unknown>,
  token: string | undefined,
  method: string,
): Handler | Failure {
  if (token && call.metadata.get('authorization')[0] !== `Bearer ${token}`) {
    return { code: grpc.status.UNAUTHENTICATED, details: 'no valid bearer token' };
  }
  const request = call.request;
  const handler = bots.get(request.bot);
  if (!handler) {
    return {
      code: grpc.status.NOT_FOUND,
      details: `this worker serves no bot named '${request.bot}' (it serves: ${[...bots.keys()].join(', ')})`,
    };
  }
  if (TRACE) {
    let id: unknown;
    try {
      id = (JSON.parse(request.activity_json) as Activity).id;
    } catch {
      id = undefined;
    }
    console.error(`turnstile-worker: ${method} bot=${request.bot} activity=${id} attempt=${request.attempt}`);
  }
  return handler;
}

/** Runs `handler` on the turn `request` is; the turn, or the failure to report. */
async function runHandler(
  handler: Handler,
  request: RunTurnRequest,
  drafts: DraftSink | null,
  signal?: AbortSignal,
): Promise<Turn | Failure> {
  let turn: Turn | undefined;
  try {
    turn = new Turn(request, drafts, signal);
    await handler(turn);
    return turn;
  } catch (e) {
    if (signal?.aborted) {
      // Not the bot's bug: Turnstile stopped waiting, and the handler stopped with it.
      const activity = turn ? turn.activity.id : undefined;
      console.error(
        `turnstile-worker: bot '${request.bot}' cancelled on activity ${activity} (attempt ${request.attempt}): Turnstile cancelled the call (the user stopped the turn, or its caller gave up)`,
      );
      return { code: grpc.status.CANCELLED, details: 'cancelled by Turnstile' };
    }
    // The bot's bug, reported to Turnstile, which commits nothing. The whole stack goes to this
    // worker's log; Turnstile's caller learns only what and where, since the error's message may
    // quote the state or the activity's text.
    const activity = turn ? ` on activity ${turn.activity.id}` : '';
    console.error(
      `turnstile-worker: bot '${request.bot}' failed${activity} (attempt ${request.attempt}):`,
      e instanceof Error && e.stack ? e.stack : e,
    );
    return { code: grpc.status.INTERNAL, details: describeFailure(e) };
  } finally {
    turn?.endDrafts();
  }
}

/** Answers one `RunTurn` call. */
async function runTurn(
  bots: Map<string, Handler>,
  call: grpc.ServerUnaryCall<RunTurnRequest, RunTurnResponse>,
  callback: grpc.sendUnaryData<RunTurnResponse>,
  token: string | undefined,
): Promise<void> {
  const handler = handlerFor(bots, call, token, 'RunTurn');
  if (typeof handler !== 'function') {
    callback(handler);
    return;
  }
  const cancelled = new AbortController();
  call.on('cancelled', () => cancelled.abort(new Error('Turnstile cancelled the call')));
  const turn = await runHandler(handler, call.request, null, cancelled.signal);
  if (turn instanceof Turn) callback(null, turn.answer());
  else callback(turn);
}

/** Answers one `StreamRunTurn` call: the handler's drafts as it makes them, then its answer. */
async function streamRunTurn(
  bots: Map<string, Handler>,
  call: grpc.ServerWritableStream<RunTurnRequest, StreamRunTurnResponse>,
  token: string | undefined,
): Promise<void> {
  const handler = handlerFor(bots, call, token, 'StreamRunTurn');
  if (typeof handler !== 'function') {
    call.emit('error', handler);
    return;
  }
  // A call Turnstile gave up on takes no more drafts, and its turn's signal aborts.
  let open = true;
  const cancelled = new AbortController();
  call.on('cancelled', () => {
    open = false;
    cancelled.abort(new Error('Turnstile cancelled the call'));
  });
  const turn = await runHandler(
    handler,
    call.request,
    (draft) => {
      if (open) call.write({ draft });
    },
    cancelled.signal,
  );
  if (!open) return;
  if (turn instanceof Turn) {
    call.write({ result: turn.answer() });
    call.end();
  } else {
    call.emit('error', turn);
  }
}

/**
 * What `thrown` was and where it was thrown, for the status Turnstile's caller sees:
 * `the bot threw TypeError in counter (counter.js:12:7)`; when it was thrown inside a
 * dependency, the innermost frame of the bot's own code follows.
 */
function describeFailure(thrown: unknown): string {
  if (!(thrown instanceof Error)) {
    return `the bot threw ${thrown === null ? 'null' : `a ${typeof thrown}`}, not an Error (see the worker's log)`;
  }
  // A class's own name (`class NoPizza extends Error`) unless the error names itself.
  const name = thrown.name && thrown.name !== 'Error' ? thrown.name : thrown.constructor?.name || 'Error';
  const frames = stackFrames(thrown.stack ?? '');
  if (frames.length === 0) return `the bot threw ${name} (see the worker's log)`;
  const own = frames.find((f) => !f.dependency);
  let where = ` in ${frames[0].text}`;
  if (frames[0].dependency && own) where += `, called from ${own.text}`;
  return `the bot threw ${name}${where}; the stack is in the worker's log`;
}

interface Frame {
  /** `function (file:line:column)`, or the location alone. */
  text: string;
  /** Node's own code, a package's, or this SDK's, rather than the bot's. */
  dependency: boolean;
}

/** This package's code, compiled and (as source maps name it) source. */
const SDK_DIRS = [__dirname, path.join(__dirname, '..', 'src')].map((dir) => dir + path.sep);

/** The frames of V8 stack `stack`, innermost first. */
function stackFrames(stack: string): Frame[] {
  const frames: Frame[] = [];
  for (const line of stack.split('\n')) {
    const frame = /^\s+at (?:async )?(?:(.*?) \((.*)\)|(.*))$/.exec(line);
    if (!frame) continue;
    const fn = frame[1];
    let location = frame[2] ?? frame[3];
    if (location.startsWith('file://')) {
      const at = /:\d+:\d+$/.exec(location)?.[0] ?? '';
      location = fileURLToPath(location.slice(0, location.length - at.length)) + at;
    }
    const dependency =
      location.startsWith('node:') ||
      location === 'native' ||
      location === '<anonymous>' ||
      location.includes(`${path.sep}node_modules${path.sep}`) ||
      SDK_DIRS.some((dir) => location.startsWith(dir));
    const shown = shortPath(location);
    frames.push({ text: fn ? `${fn} (${shown})` : shown, dependency });
  }
  return frames;
}

/** `location` relative to the working directory when it is inside it. */
function shortPath(location: string): string {
  const cwd = process.cwd() + path.sep;
  return location.startsWith(cwd) ? location.slice(cwd.length) : location;
}
