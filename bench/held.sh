#!/usr/bin/env bash
# Serialized turns of many conversations at once on one replica: the double-text issue's target
# "500 conversations at once, each a serialized 20 s turn, on one replica with the default pool
# of 16. All 500 run concurrently, none waits for a pooled connection, and PostgreSQL shows no
# transaction older than one commit's duration."
#
#   bench/held.sh                      500 conversations, a 20 s bot: about 30 s
#   CONVERSATIONS=N TURN_MS=M bench/held.sh
#   NO_BUILD=1 bench/held.sh           measures target/release as it is
#
# The workload: the release server as shipped (RUST_LOG unset, the default pool of 16), PostgreSQL
# in a throwaway cluster (bench/pg.sh), the `slow` sample bot taking TURN_MS per run and named in
# --serialized-bots, so that each turn holds its conversation (the fenced hold) from its first
# attempt. turnstile-bench sends one turn to each of CONVERSATIONS conversations (--distinct), all
# at once, and checks every counter afterwards. Meanwhile PostgreSQL is sampled every 200 ms: the oldest open
# transaction of the database, the sessions idle in a transaction, and the server's connections;
# and the server's /metrics for turns waiting for a pooled connection. Printed at the end: the
# turns' latencies (a turn that waited for another's connection would take a multiple of
# TURN_MS), their outcomes, and the samples' maxima.
set -euo pipefail
cd "$(dirname "$0")/.."

CONVERSATIONS=${CONVERSATIONS:-500}
TURN_MS=${TURN_MS:-20000}

[ -n "${NO_BUILD:-}" ] || cargo build --release --bins -q
BIN=${BIN:-$PWD/target/release}

. bench/pg.sh
SERVER=
SAMPLER=
cleanup() {
    [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null || true
    [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null || true
    stop_pg
    [ -n "${WORK:-}" ] && rm -rf "$WORK"
}
trap cleanup EXIT
start_pg held
PSQL=(psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -Atq)

LISTEN=$(free_port)
METRICS=$(free_port)
env -u RUST_LOG TURNSTILE_SLOW_BOT_DELAY_MS="$TURN_MS" "$BIN/turnstile" serve \
    --listen "127.0.0.1:$LISTEN" --metrics-listen "127.0.0.1:$METRICS" \
    --database-url "postgres://postgres@127.0.0.1:$PORT/postgres" \
    --serialized-bots slow >"$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$LISTEN") 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
    sleep 0.1
done

# Every 200 ms: the oldest open transaction's age (ms), sessions idle in a transaction, the
# database's sessions, and the turns waiting for a pooled connection (the pool's gauge).
(
    while true; do
        "${PSQL[@]}" -c "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)) * 1000, 0)::int,
                                count(*) FILTER (WHERE state LIKE 'idle in transaction%'),
                                count(*)
                           FROM pg_stat_activity
                          WHERE datname = current_database() AND pid <> pg_backend_pid()
                            AND backend_type = 'client backend'" 2>/dev/null | tr '|' ' ' |
            while read -r age idle sessions; do
                waiting=$(curl -s "127.0.0.1:$METRICS/metrics" |
                    awk '/^turnstile_pool_connections\{state="waiting"\}/{print $2}')
                echo "$age $idle $sessions ${waiting:-0}"
            done
        sleep 0.2
    done
) >"$WORK/samples" &
SAMPLER=$!

echo "== $CONVERSATIONS serialized turns of $((TURN_MS / 1000)) s at once, one per conversation, default pool" >&2
"$BIN/turnstile-bench" --bot slow --target "127.0.0.1:$LISTEN" --concurrency "$CONVERSATIONS" \
    --connections 4 --turns "$CONVERSATIONS" --conversations "$CONVERSATIONS" --distinct \
    --call-timeout $((TURN_MS / 1000 * 3 + 30)) --state-bytes 256 --cpu-of "server=$SERVER"
kill "$SAMPLER" 2>/dev/null || true
SAMPLER=
awk 'BEGIN { age = 0; idle = 0; sessions = 0; waiting = 0; n = 0 }
     { n++; if ($1 > age) age = $1; if ($2 > idle) idle = $2; if ($3 > sessions) sessions = $3;
       if ($4 > waiting) waiting = $4 }
     END { printf "samples: %d; oldest open transaction: %d ms; idle in transaction: %d at most; " \
                  "database sessions: %d at most; turns waiting for a pooled connection: %d at most\n",
                  n, age, idle, sessions, waiting }' "$WORK/samples"
