// Counter-bot turns through k6's gRPC client (grpc-go), a load generator that is not ours: the
// load card's open-loop runs and its second instruction count (bench/run.sh --card,
// bench/instructions.sh with CLIENT=k6).
//
// Environment:
//   TARGET         host:port of the server
//   PROTO_DIR      the repository's proto/ directory
//   MODE           "closed": VUS callers, each sending its next turn when the last is answered,
//                  ITERATIONS turns in all (or for DURATION when ITERATIONS is 0);
//                  "open": RATE turns per second whatever the answers (constant-arrival-rate),
//                  for DURATION, with up to MAX_VUS calls in flight
//   CONVERSATIONS  conversations to choose from at random; RUN names them as turnstile-bench does
//                  (`{RUN}-c{n}`), so a run continues the conversations turnstile-bench created
//   PAD            bytes of padding the counter bot keeps in each conversation's state
//   CALL_TIMEOUT   each call's deadline (10s; a server under valgrind needs more)
//   SUMMARY        where to write the summary as JSON
//
// Every activity id is new (`{RUN}-k6-{tag}-{vu}-{iteration}`): every turn runs the bot and writes
// a receipt, as a live conversation's turns do.
import grpc from 'k6/net/grpc';
import { Counter } from 'k6/metrics';

const target = __ENV.TARGET;
const mode = __ENV.MODE || 'closed';
const conversations = parseInt(__ENV.CONVERSATIONS || '10000', 10);
const run = __ENV.RUN || 'k6';
const pad = parseInt(__ENV.PAD || '1024', 10);
const tag = Math.floor(Math.random() * 0xffffffff).toString(16);

// Calls by gRPC status code (0 is OK). A threshold per code makes k6 keep each as its own series
// in the summary; `count>=0` never fails.
const calls = new Counter('turn_calls');
const codes = [...Array(17).keys()];
const thresholds = {};
for (const code of codes) thresholds[`turn_calls{code:${code}}`] = ['count>=0'];

const scenario =
    mode === 'open'
        ? {
              executor: 'constant-arrival-rate',
              rate: parseInt(__ENV.RATE, 10),
              timeUnit: '1s',
              duration: __ENV.DURATION || '20s',
              preAllocatedVUs: parseInt(__ENV.VUS || '64', 10),
              maxVUs: parseInt(__ENV.MAX_VUS || '512', 10),
          }
        : parseInt(__ENV.ITERATIONS || '0', 10) > 0
          ? {
                executor: 'shared-iterations',
                vus: parseInt(__ENV.VUS || '32', 10),
                iterations: parseInt(__ENV.ITERATIONS, 10),
                maxDuration: '30m',
            }
          : {
                executor: 'constant-vus',
                vus: parseInt(__ENV.VUS || '32', 10),
                duration: __ENV.DURATION || '15s',
            };

export const options = {
    scenarios: { turns: scenario },
    thresholds,
    summaryTrendStats: ['avg', 'p(50)', 'p(90)', 'p(99)', 'p(99.9)', 'max', 'count'],
};

const client = new grpc.Client();
client.load([__ENV.PROTO_DIR], 'turnstile/v1/turn.proto');

let connected = false;

export default function () {
    if (!connected) {
        client.connect(target, { plaintext: true, timeout: '60s' });
        connected = true;
    }
    const n = Math.floor(Math.random() * conversations);
    const response = client.invoke(
        'turnstile.v1.TurnService/ProcessTurn',
        {
            activity: {
                type: 'message',
                id: `${run}-k6-${tag}-${__VU}-${__ITER}`,
                channelId: 'bench',
                conversation: { id: `${run}-c${n}` },
                from: { id: `user-${n}` },
                recipient: { id: 'bot' },
                text: 'add one',
                value: { pad },
            },
            bot: 'counter',
        },
        { timeout: __ENV.CALL_TIMEOUT || '10s' },
    );
    // k6 gives the status as an object wrapping the number: Number() unwraps it.
    calls.add(1, { code: String(Number(response.status)) });
}

export function handleSummary(data) {
    const duration = data.metrics.grpc_req_duration ? data.metrics.grpc_req_duration.values : {};
    const byCode = {};
    for (const code of codes) {
        const metric = data.metrics[`turn_calls{code:${code}}`];
        if (metric && metric.values.count > 0) byCode[code] = metric.values.count;
    }
    const dropped = data.metrics.dropped_iterations ? data.metrics.dropped_iterations.values.count : 0;
    const summary = {
        mode,
        rate: mode === 'open' ? parseInt(__ENV.RATE, 10) : null,
        seconds: data.state.testRunDurationMs / 1000,
        calls: data.metrics.turn_calls ? data.metrics.turn_calls.values.count : 0,
        by_code: byCode,
        dropped_iterations: dropped,
        latency_ms: {
            p50: duration['p(50)'],
            p90: duration['p(90)'],
            p99: duration['p(99)'],
            'p99.9': duration['p(99.9)'],
            max: duration.max,
        },
    };
    return { [__ENV.SUMMARY || 'summary.json']: JSON.stringify(summary) };
}
