// Bot workers for Turnstile, in TypeScript or JavaScript.
//
// A bot worker runs your bot's logic; Turnstile runs the turn around it: it queues a
// conversation's turns, loads the state, calls your handler, commits the state only if nobody
// changed it meanwhile, and otherwise calls your handler again on the fresh state. Your replies
// leave only after the commit. So a handler follows the replay rule: it may run more than once
// for one turn, and only the run that commits counts. Keep side effects out of it, or make them
// idempotent, keyed by `turn.activity.id`.
//
// The contract (proto/turnstile/v1/worker.proto) is loaded at run time by @grpc/proto-loader:
// there is no generated code.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const definition = protoLoader.loadSync(
  path.join(__dirname, 'proto', 'turnstile', 'v1', 'worker.proto'),
  { keepCase: true, longs: Number, defaults: true, oneofs: true },
);
const BotWorker = grpc.loadPackageDefinition(definition).turnstile.v1.BotWorker;

const TRACE = Boolean(process.env.TURNSTILE_WORKER_TRACE);

/** The scopes, by their field names in the contract and in a `Turn`. */
const SCOPES = [
  ['conversation', 'conversation'],
  ['user', 'user'],
  ['private_conversation', 'privateConversation'],
];

/**
 * One scope's state as a plain-looking object, recording whether the handler read it: Turnstile
 * checks at commit that a scope that was read has not changed meanwhile.
 */
function trackedScope(state) {
  const tracker = { read: false };
  const proxy = new Proxy(state, {
    get(target, key, receiver) {
      tracker.read = true;
      return Reflect.get(target, key, receiver);
    },
    has(target, key) {
      tracker.read = true;
      return Reflect.has(target, key);
    },
    ownKeys(target) {
      tracker.read = true;
      return Reflect.ownKeys(target);
    },
    getOwnPropertyDescriptor(target, key) {
      tracker.read = true;
      return Reflect.getOwnPropertyDescriptor(target, key);
    },
  });
  return { proxy, tracker, target: state };
}

/** One attempt of one turn: the activity, the three state scopes, and `send`. */
class Turn {
  constructor(request) {
    /** The bot's name, as Turnstile knows it. */
    this.bot = request.bot;
    /** The inbound activity, a Bot Framework JSON object. */
    this.activity = JSON.parse(request.activity_json);
    /** 1, or more when a conflict made Turnstile replay the turn on fresh state. */
    this.attempt = request.attempt;
    /** The replies sent so far in this attempt. */
    this.replies = [];
    this._scopes = {};
    for (const [field, name] of SCOPES) {
      const scope = request[field];
      if (!scope) {
        this[name] = null;
        continue;
      }
      const loaded = JSON.stringify(JSON.parse(scope.state_json));
      const tracked = trackedScope(JSON.parse(loaded));
      this._scopes[field] = { ...tracked, loaded, exists: scope.exists };
      this[name] = tracked.proxy;
    }
  }

  /** The activity's text, trimmed; empty when it has none. */
  get text() {
    return (this.activity.text || '').trim();
  }

  /** Whether scope `name` had been written before this turn. */
  exists(name) {
    const field = name === 'privateConversation' ? 'private_conversation' : name;
    return Boolean(this._scopes[field] && this._scopes[field].exists);
  }

  /**
   * Buffers a reply: a text, or an activity object (with `fields` added). Delivered only if
   * this attempt commits; addressing left out is filled in by Turnstile.
   */
  send(reply, fields = {}) {
    const activity = typeof reply === 'string' ? { type: 'message', text: reply } : { ...reply };
    this.replies.push(Object.assign(activity, fields));
  }

  _answer() {
    const answer = { replies_json: this.replies.map((r) => JSON.stringify(r)) };
    for (const [field] of SCOPES) {
      const scope = this._scopes[field];
      if (!scope) continue;
      const read = scope.tracker.read; // before serializing reads it
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
class Worker {
  constructor() {
    this._bots = new Map();
  }

  /**
   * Registers `handler` (sync or async, taking a `Turn`) as bot `name`: the NAME of
   * `--remote-bot NAME=URL` on the Turnstile side.
   */
  bot(name, handler) {
    this._bots.set(name, handler);
    return this;
  }

  /**
   * Starts serving on `address` (`host:port`, port 0 for any); resolves to `{ server, port }`.
   * Options: `token`, the bearer token Turnstile must send (`--remote-bot-token`); `tls`,
   * `{ cert, key }` PEM buffers.
   */
  start(address = '0.0.0.0:50061', options = {}) {
    if (this._bots.size === 0) {
      return Promise.reject(new Error('no bots registered: call worker.bot(name, handler)'));
    }
    const server = new grpc.Server();
    server.addService(BotWorker.service, { RunTurn: (call, callback) => this._runTurn(call, callback, options.token) });
    const credentials = options.tls
      ? grpc.ServerCredentials.createSsl(null, [{ cert_chain: options.tls.cert, private_key: options.tls.key }])
      : grpc.ServerCredentials.createInsecure();
    return new Promise((resolve, reject) => {
      server.bindAsync(address, credentials, (error, port) => (error ? reject(error) : resolve({ server, port })));
    });
  }

  /** Serves until SIGTERM or SIGINT, then lets the calls in flight finish (5 s at most). */
  async serve(address = '0.0.0.0:50061', options = {}) {
    const { server, port } = await this.start(address, options);
    console.log(`turnstile-worker: serving ${[...this._bots.keys()].join(', ')} on port ${port}`);
    const stop = () => {
      const force = setTimeout(() => server.forceShutdown(), 5000);
      server.tryShutdown(() => clearTimeout(force));
    };
    process.once('SIGTERM', stop);
    process.once('SIGINT', stop);
    return { server, port };
  }

  async _runTurn(call, callback, token) {
    if (token && call.metadata.get('authorization')[0] !== `Bearer ${token}`) {
      callback({ code: grpc.status.UNAUTHENTICATED, details: 'no valid bearer token' });
      return;
    }
    const request = call.request;
    const handler = this._bots.get(request.bot);
    if (!handler) {
      callback({
        code: grpc.status.NOT_FOUND,
        details: `this worker serves no bot named '${request.bot}' (it serves: ${[...this._bots.keys()].join(', ')})`,
      });
      return;
    }
    let turn;
    try {
      turn = new Turn(request);
      if (TRACE) {
        console.error(`turnstile-worker: RunTurn bot=${request.bot} activity=${turn.activity.id} attempt=${request.attempt}`);
      }
      await handler(turn);
    } catch (e) {
      // The bot's bug, reported to Turnstile, which commits nothing.
      const name = e && e.name ? e.name : 'Error';
      callback({ code: grpc.status.INTERNAL, details: `the bot threw ${name}: ${e && e.message}` });
      return;
    }
    callback(null, turn._answer());
  }
}

module.exports = { Worker, Turn };
