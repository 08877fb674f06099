// Types for turnstile-worker (index.js). See README.md.
import type { Server } from '@grpc/grpc-js';

/** A JSON value, as state properties and activity members are. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

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

/** One attempt of one turn. */
export declare class Turn {
  /** The bot's name, as Turnstile knows it. */
  readonly bot: string;
  /** The inbound activity. */
  readonly activity: Activity;
  /** 1, or more when a conflict made Turnstile replay the turn on fresh state. */
  readonly attempt: number;
  /** Shared by everyone in the conversation. */
  readonly conversation: Scope;
  /** This user across conversations; null when the activity names no user. */
  readonly user: Scope | null;
  /** This user within this conversation; null when the activity names no user. */
  readonly privateConversation: Scope | null;
  /** The replies sent so far in this attempt. */
  readonly replies: Activity[];
  /** The activity's text, trimmed; empty when it has none. */
  readonly text: string;
  /** Whether the scope had been written before this turn. */
  exists(scope: 'conversation' | 'user' | 'privateConversation'): boolean;
  /** Buffers a reply (a text, or an activity with `fields` added); delivered only on commit. */
  send(reply: string | Activity, fields?: Activity): void;
}

/** A bot's logic for one attempt of one turn. */
export type Handler = (turn: Turn) => void | Promise<void>;

/** Options of `Worker.start` and `Worker.serve`. */
export interface ServeOptions {
  /** The bearer token Turnstile must send (its `--remote-bot-token`). */
  token?: string;
  /** Serve TLS with this PEM certificate chain and key. */
  tls?: { cert: Buffer; key: Buffer };
}

/** Serves bots to Turnstile as `turnstile.v1.BotWorker`. */
export declare class Worker {
  /** Registers `handler` as bot `name` (the NAME of Turnstile's `--remote-bot NAME=URL`). */
  bot(name: string, handler: Handler): this;
  /** Starts serving on `address` (`host:port`; port 0 for any free one). */
  start(address?: string, options?: ServeOptions): Promise<{ server: Server; port: number }>;
  /** Like `start`, printing the port, and stopping on SIGTERM or SIGINT. */
  serve(address?: string, options?: ServeOptions): Promise<{ server: Server; port: number }>;
}
