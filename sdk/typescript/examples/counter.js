// The counter bot in plain JavaScript (CommonJS), the same bot as counter.ts: every message adds
// one to a conversation counter and replies `count: N`; an `event` named `read` replies the count
// without counting.
//
//   node counter.js 0.0.0.0:50062        (in a project with turnstile-worker installed)
//   turnstile serve --remote-bot counter=http://127.0.0.1:50062
'use strict';

const { Worker } = require('turnstile-worker');

function counter(turn) {
  const { activity } = turn;
  if (activity.type === 'event' && activity.name === 'read') {
    turn.send(`count: ${turn.conversation.count ?? 0}`);
    return;
  }
  if (activity.type !== 'message') return;
  const count = (turn.conversation.count ?? 0) + 1;
  turn.conversation.count = count;
  turn.send(`count: ${count}`);
}

const worker = new Worker().bot(process.env.BOT_NAME || 'counter', counter);

if (require.main === module) {
  worker.serve(process.argv[2] || '0.0.0.0:50062').catch((e) => {
    console.error(e);
    process.exit(1);
  });
}

module.exports = { counter, worker };
