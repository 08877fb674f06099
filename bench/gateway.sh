#!/bin/bash
# Build first: cargo build --release --bin turnstile --bin turnstile-bench
# Gateway overhead: the same server, direct gRPC vs /api/messages (expectReplies), same run.
set -e
B="$(cd "$(dirname "$0")/.." && pwd)/target/release"
LOGS="${TMPDIR:-/tmp}"
$B/turnstile serve --listen 127.0.0.1:55051 --state-cache-entries 100000 2>"$LOGS/gw-server.log" &
S=$!
TURNSTILE_BOT=counter TURNSTILE_URL=http://127.0.0.1:55051 $B/turnstile gateway --listen 127.0.0.1:53978 2>"$LOGS/gw-gateway.log" &
G=$!
sleep 1
for round in 1 2; do
  echo "== round $round: direct gRPC"
  $B/turnstile-bench --target 127.0.0.1:55051 --concurrency 32 --duration 8 --warmup 2 --conversations 10000 --state-bytes 1024 --cpu-of server=$S --json
  echo "== round $round: through the gateway"
  $B/turnstile-bench --target 127.0.0.1:55051 --gateway http://127.0.0.1:53978 --concurrency 32 --duration 8 --warmup 2 --conversations 10000 --state-bytes 1024 --cpu-of server=$S --cpu-of gateway=$G --json
done
kill -TERM $G $S
wait
