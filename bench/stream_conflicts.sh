#!/usr/bin/env bash
# Streamed turns that lose a conflict mid-stream: the streaming issue's target "one final per
# activity, after the commit, through a conflict mid-stream: a reset, then a replay that commits".
#
#   bench/stream_conflicts.sh          30 s (SECONDS_=N to change)
#   NO_BUILD=1 bench/stream_conflicts.sh
#
# Two replicas of the release server as shipped on one PostgreSQL (bench/pg.sh), the `llm` bot at
# 10 ms a word (a ~0.35 s answer). On replica A, `turnstile-bench --stream` sends streamed turns,
# 4 at a time, all to one conversation (--hot-share 1). On replica B, at the same time, a second
# `turnstile-bench` sends plain `ProcessTurn`s of the same bot to the same conversation (the same
# --run-id), 4 at a time: these commit without holding the conversation, so a streamed turn's
# commit can find the conversation moved, and its attempt is thrown away (a `reset`) and replayed.
# turnstile-bench --stream fails if any stream ends with an error or without exactly one outcome
# as its last event, and prints the drafts, resets and outcomes it saw. Afterwards PostgreSQL is
# asked how many receipts the streamed activities have: one each.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_SECONDS=${SECONDS_:-30}

[ -n "${NO_BUILD:-}" ] || cargo build --release --bins -q
BIN=${BIN:-$PWD/target/release}

. bench/pg.sh
A= B=
cleanup() {
    for p in $A $B; do kill "$p" 2>/dev/null && wait "$p" 2>/dev/null || true; done
    stop_pg
    [ -n "${WORK:-}" ] && rm -rf "$WORK"
}
trap cleanup EXIT
start_pg stream-conflicts
DB="postgres://postgres@127.0.0.1:$PORT/postgres"

serve() {
    env -u RUST_LOG "$BIN/turnstile" serve --listen "127.0.0.1:$1" --gateway-listen off \
        --database-url "$DB" --llm-token-delay-ms 10 >"$WORK/server-$1.log" 2>&1 &
}
LA=$(free_port); LB=$(free_port)
"$BIN/turnstile" migrate --database-url "$DB" >/dev/null
serve "$LA"; A=$!
serve "$LB"; B=$!
for port in $LA $LB; do
    for _ in $(seq 1 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.1
    done
done

RUN=$(printf '%08x' $((RANDOM * 32768 + RANDOM)))
echo "== streamed turns on A, plain turns on B, one conversation, ${RUN_SECONDS} s" >&2
"$BIN/turnstile-bench" --target "127.0.0.1:$LB" --bot llm --no-verify --hot-share 1 \
    --conversations 1 --concurrency 4 --connections 1 --duration "$RUN_SECONDS" --run-id "$RUN" \
    >"$WORK/plain.txt" 2>&1 &
PLAIN=$!
"$BIN/turnstile-bench" --stream --target "127.0.0.1:$LA" --bot llm --hot-share 1 \
    --conversations 1 --concurrency 4 --connections 1 --duration "$RUN_SECONDS" --run-id "$RUN" \
    --call-timeout 60
wait "$PLAIN"
echo "== the plain turns on B:" >&2
cat "$WORK/plain.txt"
psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -Atq -c \
    "SELECT 'streamed and plain activities receipted: ' || count(*) || ', receipts per activity at most: ' ||
            coalesce(max(n), 0) FROM (SELECT key, count(*) AS n FROM turnstile.turnstile_receipt GROUP BY key) r"
