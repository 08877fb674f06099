#!/usr/bin/env bash
# The state cache's memory with large states: the data-lifecycle issue's target "RSS stays under
# the configured cache bytes plus a fixed overhead with 200,000 conversations of 8 KB state".
#
#   bench/cache_memory.sh                  200,000 conversations of 8 KB, two runs: ~8 min
#   CONVERSATIONS=N STATE_BYTES=B bench/cache_memory.sh
#   NO_BUILD=1 bench/cache_memory.sh       measures target/release as it is
#
# The workload: the release server as shipped (RUST_LOG unset, default settings; the state cache
# at its defaults, 100,000 entries and 64 MiB) over PostgreSQL in a throwaway cluster
# (bench/pg.sh), the `counter` sample bot padding each conversation's state to STATE_BYTES.
# turnstile-bench sends one turn to each of CONVERSATIONS conversations (--distinct: each turn a
# conversation of its own, so every state lands in the cache once), 32 at a time. The server's
# resident set is sampled every second from /proc. A first run with the cache off gives the
# overhead the cache is measured against; a last one with `--state-cache-bytes` set past what the
# entries could hold (the cache bounded by entries alone, as before the byte bound) shows what the
# byte bound saves. Printed: each run's RSS before the load, its maximum, and at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

CONVERSATIONS=${CONVERSATIONS:-200000}
STATE_BYTES=${STATE_BYTES:-8192}

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
start_pg cache-memory

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }

run() { # run NAME [server flags…]
    local name=$1
    shift
    local listen
    listen=$(free_port)
    env -u RUST_LOG "$BIN/turnstile" serve --listen "127.0.0.1:$listen" --gateway-listen off \
        --database-url "postgres://postgres@127.0.0.1:$PORT/postgres" "$@" \
        >"$WORK/$name-server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$listen") 2>/dev/null && break
        kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/$name-server.log" >&2; exit 1; }
        sleep 0.1
    done
    local before
    before=$(rss_kib "$SERVER")
    (while true; do rss_kib "$SERVER"; sleep 1; done) >"$WORK/$name-rss" &
    SAMPLER=$!
    echo "== $name: $CONVERSATIONS conversations of $STATE_BYTES bytes, server flags: ${*:-none}" >&2
    "$BIN/turnstile-bench" --bot counter --target "127.0.0.1:$listen" --concurrency 32 \
        --turns "$CONVERSATIONS" --conversations "$CONVERSATIONS" --distinct \
        --state-bytes "$STATE_BYTES" --no-verify | tail -4
    local after
    after=$(rss_kib "$SERVER")
    kill "$SAMPLER" 2>/dev/null || true
    SAMPLER=
    kill "$SERVER" && wait "$SERVER" 2>/dev/null || true
    SERVER=
    awk -v name="$name" -v before="$before" -v after="$after" \
        'BEGIN { max = 0 } { if ($1 > max) max = $1 }
         END { printf "%s: RSS before %.0f MiB, at most %.0f MiB, at the end %.0f MiB\n",
                      name, before / 1024, max / 1024, after / 1024 }' "$WORK/$name-rss"
}

run no-cache --state-cache-bytes 0
run shipped
run entries-only --state-cache-bytes 100000000000
