// A language-model bot as a bot worker, streaming its answer: a stand-in for a model, so that
// streaming can be tried anywhere — no network, no model. The fake model yields a canned answer
// a word at a time, LLM_TOKEN_DELAY_MS (50) apart; the bot shows "Thinking…", then its reply as
// it grows, and sends the whole reply, which is what is delivered once the turn commits. Like a
// real agent it keeps the conversation's transcript in conversation state (`transcript`: the
// user's and its own messages, in order). Several messages answered at once — a batch under the
// double-text policy `coalesce`, or the messages a turn superseded under `interrupt` — are one
// prompt.
//
// In a project set up as the README says (with this file as llm.ts):
//   npx tsc && LLM_TOKEN_DELAY_MS=50 node --enable-source-maps dist/llm.js 0.0.0.0:50064
//   turnstile serve --remote-bot llm-ts=http://127.0.0.1:50064
// Then `StreamTurn` with `bot: "llm-ts"` streams the drafts, and `ProcessTurn` just answers.
import { setTimeout as sleep } from 'node:timers/promises';
import { Worker, type Turn } from 'turnstile-worker';

/** One message of the transcript kept in conversation state. */
type Message = { role: 'user' | 'assistant'; text: string };

/** Writes a canned answer one word ("token") every `delayMs`. */
export class FakeModel {
  constructor(readonly delayMs: number) {}

  /** Stops when `signal` aborts (the user stopped the reply), as a model's client would. */
  async *tokens(prompt: string, turn: number, signal?: AbortSignal): AsyncGenerator<string> {
    // A function of the prompt and the transcript alone, as the replay rule asks.
    const answer =
      `You said "${prompt}". This is answer number ${turn} of this conversation, ` +
      'written one word at a time the way a language model writes.';
    const words = answer.split(' ');
    for (const [i, word] of words.entries()) {
      await sleep(this.delayMs, undefined, { signal });
      yield i === words.length - 1 ? word : `${word} `;
    }
  }
}

const model = new FakeModel(Number(process.env.LLM_TOKEN_DELAY_MS ?? 50));

export async function llm(turn: Turn): Promise<void> {
  if (turn.activity.type !== 'message') return;
  // What the user said that this answer is for: the messages of a batch (double-text policy
  // `coalesce`) or the ones this turn superseded before its own (`interrupt`), else just this one.
  const said = [...turn.superseded, ...(turn.batch.length ? turn.batch : [turn.activity])]
    .filter((a) => a.type === 'message')
    .map((a) => (a.text ?? '').trim());
  const transcript = (turn.conversation.transcript ?? []) as Message[];
  await turn.inform('Thinking…');
  const n = transcript.filter((m) => m.role === 'assistant').length + 1;
  const reply = await turn.stream(model.tokens(said.join(' / '), n, turn.signal));
  const messages: Message[] = [
    ...said.map((text): Message => ({ role: 'user', text })),
    { role: 'assistant', text: reply },
  ];
  turn.conversation.transcript = [...transcript, ...messages];
  turn.send(reply);
}

export const worker = new Worker().bot(process.env.BOT_NAME || 'llm-ts', llm);

if (require.main === module) {
  worker.serve(process.argv[2] || '0.0.0.0:50064').catch((e: unknown) => {
    console.error(e);
    process.exit(1);
  });
}
