#!/usr/bin/env bash
# Overload: do the admitted turns keep their latency when 16 times as many callers as the replica
# admits retry at once, ignoring RetryInfo? (The load card issue's target: admitted turns' p99 at
# most 3 times their p99 at capacity, memory bounded.)
#
#   bench/overload.sh         about 2 minutes after the release build
#   PIN=1 bench/overload.sh   the load generator on CPU 0, the server and PostgreSQL on CPU 1: so
#                             that the callers' own CPU does not slow the admitted turns
#
# One release server as shipped but for `--max-in-flight LIMIT` (64) over a throwaway PostgreSQL
# (bench/pg.sh), the counter bot, 10,000 conversations prefilled. ROUNDS times, alternating on the
# same server: LIMIT callers (capacity), then 16 × LIMIT callers with `--retry-at-once` (every
# refused call sent again at once). Reports per run the OK turns/s and the p50 / p99 of the OK
# calls (the admitted turns), the refusals, and the server's CPU per OK turn and its peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/pg.sh

LIMIT=${LIMIT:-64}; OVER=${OVER:-16}; SECS=${SECS:-8}; ROUNDS=${ROUNDS:-3}; KEYS=10000

cargo build --release --bins -q
BIN=$PWD/target/release
start_pg overload
# PIN=1: the server and PostgreSQL (its backends are forked from the postmaster, and inherit it)
# on CPU 1, the load generator on CPU 0.
SIDE=(); CLIENT=()
if [ "${PIN:-}" = 1 ]; then
    SIDE=(taskset -c 1); CLIENT=(taskset -c 0)
    for pid in $(head -n 1 "$WORK/pg/data/postmaster.pid") $(pgrep -P "$(head -n 1 "$WORK/pg/data/postmaster.pid")"); do
        taskset -p -c 1 "$pid" >/dev/null
    done
fi
SERVER=
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; stop_pg; rm -rf "$WORK"; }
trap cleanup EXIT

URL="postgres://postgres@127.0.0.1:$PORT/postgres"
GRPC=$(free_port)
"${SIDE[@]}" "$BIN/turnstile" serve --listen "127.0.0.1:$GRPC" --database-url "$URL" \
    --max-in-flight "$LIMIT" >"$WORK/service.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$GRPC") 2>/dev/null && break; sleep 0.1; done

RUN=$(printf '%08x' $((RANDOM * RANDOM)))
bench() {  # CALLS [FLAG...] -> JSON
    local calls=$1; shift
    "${CLIENT[@]}" "$BIN/turnstile-bench" --target "127.0.0.1:$GRPC" --duration "$SECS" --warmup 1 \
        --conversations "$KEYS" --concurrency "$calls" --run-id "$RUN" --no-verify --json \
        --cpu-of "server=$SERVER" "$@"
}
"$BIN/turnstile-bench" --target "127.0.0.1:$GRPC" --conversations "$KEYS" --concurrency 32 \
    --run-id "$RUN" --prefill --turns 1 --no-verify --json \
    --after-prefill "psql '$URL' -qc 'ANALYZE turnstile.turnstile_state'" >/dev/null

echo "machine: $(nproc) cores, $(uname -sr); $(date -u +%Y-%m-%dT%H:%MZ); commit $(git rev-parse --short HEAD)"
echo "counter bot, $KEYS conversations prefilled, --max-in-flight $LIMIT, ${SECS}s per run${PIN:+, pinned: client CPU 0, server and PostgreSQL CPU 1}"
echo
printf '%-6s %-24s %9s %8s %8s %s\n' round load "OK/s" "p50 ms" "p99 ms" "statuses; server CPU µs per OK turn; server peak RSS"
for round in $(seq 1 "$ROUNDS"); do
    for load in capacity overload; do
        if [ "$load" = capacity ]; then
            json=$(bench "$LIMIT")
            label="$LIMIT callers"
        else
            json=$(bench $((LIMIT * OVER)) --retry-at-once)
            label="$((LIMIT * OVER)) callers, at once"
        fi
        rss=$(awk '/VmHWM/ {print $2 " kB"}' "/proc/$SERVER/status")
        echo "$json" | python3 -c "
import json, sys
d = json.load(sys.stdin)
print(f\"{sys.argv[1]:<6} {sys.argv[2]:<24} {d['turns_per_second']:9.0f} {d['latency_ms']['p50']:8.1f} \"
      f\"{d['latency_ms']['p99']:8.1f} {d['statuses']}; \"
      f\"{d['cpu_us_per_turn'].get('server', 0):.0f}; {sys.argv[3]}\")
" "$round" "$label" "$rss"
    done
done
