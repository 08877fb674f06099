#!/usr/bin/env bash
# Time to first draft of streaming turns over gRPC: the streaming issue's first target, "at most
# 300 ms p99 from the request to the first draft of a bot that drafts as soon as it starts,
# measured on a 20 s streaming turn over gRPC with 32 such turns in flight".
#
#   bench/streaming.sh                 32 turns on the cold server, then 96 (three waves of 32),
#                                      each ~20 s: about 90 s
#   TURNS=N CONCURRENCY=C bench/streaming.sh
#   TURN_MS=M bench/streaming.sh       another length of turn
#   NO_BUILD=1 bench/streaming.sh      measures target/release as it is
#   EXTRA=--json bench/streaming.sh    passes options on to turnstile-bench
#
# The workload: the release server as shipped (RUST_LOG unset), PostgreSQL in a throwaway
# cluster, the metrics endpoint on, and the `llm` sample bot, which drafts a status line
# ("Thinking…") as soon as it starts and then its answer word by word, `--llm-token-delay-ms`
# apart, set here so that a turn takes TURN_MS. turnstile-bench --stream calls StreamTurn,
# CONCURRENCY at a time over 4 HTTP/2 connections, each call on a new conversation, and prints
# the time from each request to its first draft and to its outcome (p50/p90/p99/p99.9/max), the
# drafts, resets and outcomes; it fails if a stream ends with an error or without exactly one
# outcome. It runs twice: one wave on the fresh server (which opens its PostgreSQL connections
# then), and the measured TURNS after it. Everything listens on loopback and is removed at the
# end.
set -euo pipefail
cd "$(dirname "$0")/.."

TURNS=${TURNS:-96}
CONCURRENCY=${CONCURRENCY:-32}
TURN_MS=${TURN_MS:-20000}
# The llm bot's answer to "count", the first of a conversation, is 34 words (`answer` in
# src/bots/llm.rs), each drafted after one delay, after a tool call of 6 delays: 40 × 500 ms =
# 20 s.
DELAYS=40
TOKEN_DELAY_MS=$((TURN_MS / DELAYS))

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
    rm -rf "$WORK"
}
trap cleanup EXIT
start_pg streaming

# --- the server as shipped -----------------------------------------------------------------------
LISTEN=$(free_port)
METRICS=$(free_port)
env -u RUST_LOG "$BIN/turnstile" serve --listen "127.0.0.1:$LISTEN" \
    --metrics-listen "127.0.0.1:$METRICS" \
    --database-url "postgres://postgres@127.0.0.1:$PORT/postgres" \
    --llm-token-delay-ms "$TOKEN_DELAY_MS" >"$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$LISTEN") 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
    sleep 0.1
done

BENCH=("$BIN/turnstile-bench" --stream --bot llm --target "127.0.0.1:$LISTEN"
    --concurrency "$CONCURRENCY" --connections 4 --call-timeout $((TURN_MS / 1000 * 3 + 30))
    --cpu-of "server=$SERVER")
LIMIT=$(((TURNS / CONCURRENCY + 2) * TURN_MS / 1000 + 120))
# A fresh server opens its PostgreSQL connections as the first turns need them: its first wave is
# reported on its own, and the measured turns run on the warm server after it.
echo "== cold server: the first $CONCURRENCY turns (~$((TURN_MS / 1000)) s, llm bot, $TOKEN_DELAY_MS ms a word)" >&2
timeout "$LIMIT" "${BENCH[@]}" --turns "$CONCURRENCY" --conversations "$CONCURRENCY" ${EXTRA:-}
echo "== warm server: $TURNS turns, $CONCURRENCY in flight, each on a new conversation" >&2
timeout "$LIMIT" "${BENCH[@]}" --turns "$TURNS" --conversations "$TURNS" ${EXTRA:-}
