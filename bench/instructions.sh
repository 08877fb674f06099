#!/usr/bin/env bash
# The server's instructions per turn, counted by valgrind's callgrind: a figure that the machine's
# speed and its neighbours do not move, unlike the throughput bench/run.sh measures.
#
#   bench/instructions.sh            3,000 measured turns and 3,000 measured health checks
#   TURNS=N CHECKS=M bench/instructions.sh
#   KEEP=1 bench/instructions.sh     keeps the callgrind files (for callgrind_annotate) and says where
#   NO_BUILD=1 bench/instructions.sh measures target/release as it is
#   CLIENT=k6 bench/instructions.sh  the measured turns sent by k6 (grpc-go, bench/drivers/turns.k6.js)
#                                    instead of turnstile-bench (tonic): same calls, concurrency and
#                                    conversations, one HTTP/2 connection per caller as k6 does
#   CONVERSATIONS=1000000 bench/instructions.sh   cold: that many conversations, created straight in
#                                    the database (seed_conversations), the warm-up WARMUP_TURNS
#                                    random turns over them: nearly every measured turn misses the
#                                    state cache and reads its row, as with a long tail of users
#
# The workload: the release server, PostgreSQL in a throwaway cluster, the metrics endpoint on (as
# deployed), the counter bot with ~1 KB of conversation state, 32 concurrent calls over 4 HTTP/2
# connections from turnstile-bench (tonic), over 1,000 conversations. A warm-up run first creates
# every conversation and then continues them, so that the measured turns are the steady state of a
# running service (state cached, prepared statements and pooled connections in place); callgrind's
# counters are zeroed after it (`callgrind_control -z`) and dumped after the measured turns
# (`callgrind_control -d`), so the server's start and the warm-up are not counted. The measured run
# opens its own 4 connections (a few hundred instructions per turn at most).
#
# Then the same for `grpc.health.v1.Health/Check` calls on the same server, the transport's floor:
# what a call costs through tonic, h2 and the server's own layers with no turn behind it.
#
# The last line is `instructions per turn: N (health check: H)`. Both count every thread of the
# server, the runtime's and the connection pool's included; the kernel's work is not counted.
set -euo pipefail
cd "$(dirname "$0")/.."

TURNS=${TURNS:-3000}
CHECKS=${CHECKS:-3000}
WARMUP_TURNS=${WARMUP_TURNS:-1000}
CONVERSATIONS=${CONVERSATIONS:-1000}
PAD=${PAD:-1024}
CLIENT=${CLIENT:-turnstile-bench}
# Up to 10,000 conversations the warm-up creates them through the service; past that they are
# created in the database.
SEED=0; [ "$CONVERSATIONS" -gt 10000 ] && SEED=1

command -v valgrind >/dev/null || { echo "valgrind not found (apt-get install valgrind)" >&2; exit 1; }
# NO_BUILD=1 measures the binaries as they are, without building them first.
[ -n "${NO_BUILD:-}" ] || cargo build --release --bins -q
BIN=$PWD/target/release

# --- a throwaway PostgreSQL cluster (bench/pg.sh) ------------------------------------------------
. bench/pg.sh
SERVER=
WORK=
cleanup() {
    [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null || true
    stop_pg
    [ -n "$WORK" ] || return 0
    if [ -n "${KEEP:-}" ]; then echo "kept $WORK (callgrind files: $WORK/callgrind.out.*)"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
start_pg instructions
URL="postgres://postgres@127.0.0.1:$PORT/postgres"
RUN=$(printf '%08x' $((RANDOM * 32768 + RANDOM)))
if [ "$SEED" = 1 ]; then
    echo "creating $CONVERSATIONS conversations in the database" >&2
    "$BIN/turnstile" migrate --database-url "$URL" >/dev/null
    seed_conversations "$URL" "$RUN" 0 "$CONVERSATIONS" "$PAD"
fi

# --- the server under callgrind ------------------------------------------------------------------
LISTEN=$(free_port)
METRICS=$(free_port)
# As shipped: the log filter a deployment runs (RUST_LOG unset: `info`). `RUST_LOG=warn
# bench/instructions.sh` measures another filter beside it.
valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.out.%p" \
    "$BIN/turnstile" serve --listen "127.0.0.1:$LISTEN" --metrics-listen "127.0.0.1:$METRICS" \
    --database-url "$URL" >"$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 600); do
    (exec 3<>"/dev/tcp/127.0.0.1/$LISTEN") 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
    sleep 0.2
done

bench() {
    "$BIN/turnstile-bench" --target "127.0.0.1:$LISTEN" --concurrency 32 --connections 4 \
        --conversations "$CONVERSATIONS" --state-bytes "$PAD" --run-id "$RUN" --no-verify \
        --call-timeout 120 "$@"
}
# Zeroes the counters (START) or dumps them and prints the instructions counted since (STOP).
counted() {
    if [ "$1" = start ]; then
        callgrind_control -z "$SERVER" >/dev/null
        return
    fi
    local before after
    before=$(ls "$WORK" | grep -c '^callgrind.out' || true)
    callgrind_control -d "$SERVER" >/dev/null
    for _ in $(seq 1 300); do
        after=$(ls "$WORK" | grep -c '^callgrind.out' || true)
        [ "$after" -gt "$before" ] && break
        sleep 0.1
    done
    local dump
    dump=$(ls -t "$WORK"/callgrind.out.* | head -n 1)
    # `totals:` (or, in older files, `summary:`) is the dump's instruction count (event Ir).
    for _ in $(seq 1 100); do
        grep -qE '^(totals|summary):' "$dump" && break
        sleep 0.1
    done
    grep -E '^(totals|summary):' "$dump" | tail -n 1 | awk '{print $2}'
}

if [ "$SEED" = 1 ]; then
    echo "warm-up: $WARMUP_TURNS turns over $CONVERSATIONS conversations" >&2
    bench --turns "$WARMUP_TURNS" >/dev/null
else
    echo "warm-up: every conversation once, then $WARMUP_TURNS turns" >&2
    bench --prefill --turns "$WARMUP_TURNS" >/dev/null
fi
counted start
if [ "$CLIENT" = k6 ]; then
    . bench/tools.sh
    K6=$(k6_bin)
    TARGET="127.0.0.1:$LISTEN" PROTO_DIR=$PWD/proto MODE=closed VUS=32 ITERATIONS=$TURNS \
        CONVERSATIONS=$CONVERSATIONS PAD=$PAD RUN=$RUN CALL_TIMEOUT=120s SUMMARY="$WORK/k6.json" \
        "$K6" run -q --no-usage-report bench/drivers/turns.k6.js >/dev/null 2>"$WORK/k6.log" \
        || { cat "$WORK/k6.log" >&2; exit 1; }
    TURN_IR=$(counted stop)
    # Every measured call must have been a turn that committed, or the count per turn means nothing.
    python3 -c 'import json, sys
d = json.load(open(sys.argv[1]))
print("k6:", d["calls"], "calls, by status", d["by_code"], file=sys.stderr)
sys.exit(d["by_code"] != {"0": int(sys.argv[2])})' "$WORK/k6.json" "$TURNS" || { echo "k6: not every call was OK" >&2; exit 1; }
else
    bench --turns "$TURNS" >"$WORK/turns.txt"
    TURN_IR=$(counted stop)
    grep -E 'turns/s|OK' "$WORK/turns.txt" | head -n 3 >&2 || true
fi

bench --health --turns 1000 >/dev/null
counted start
bench --health --turns "$CHECKS" >&2
CHECK_IR=$(counted stop)

echo "turns: $TURN_IR instructions for $TURNS; health checks: $CHECK_IR for $CHECKS" >&2
python3 -c "import sys; t, n, h, m = map(int, sys.argv[1:]); print(f'instructions per turn: {round(t / n, -2):,.0f} (health check: {round(h / m, -2):,.0f})')" \
    "$TURN_IR" "$TURNS" "$CHECK_IR" "$CHECKS"
