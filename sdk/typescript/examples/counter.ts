// The counter bot as a bot worker, the same bot as Turnstile's built-in `counter`: every message
// adds one to a conversation counter and replies `count: N`; an `event` named `read` replies the
// count without counting.
//
// In a project set up as the README says (with this file as counter.ts):
//   npx tsc && node --enable-source-maps dist/counter.js 0.0.0.0:50062
//   turnstile serve --remote-bot counter=http://127.0.0.1:50062
import { Worker, type Turn } from 'turnstile-worker';

export function counter(turn: Turn): void {
  const { activity } = turn;
  if (activity.type === 'event' && activity.name === 'read') {
    turn.send(`count: ${turn.conversation.count ?? 0}`);
    return;
  }
  if (activity.type !== 'message') return;
  const count = Number(turn.conversation.count ?? 0) + 1;
  turn.conversation.count = count;
  turn.send(`count: ${count}`);
}

export const worker = new Worker().bot(process.env.BOT_NAME || 'counter', counter);

if (require.main === module) {
  worker.serve(process.argv[2] || '0.0.0.0:50062').catch((e: unknown) => {
    console.error(e);
    process.exit(1);
  });
}
