#!/usr/bin/env bash
# Streamed turns through the gateway: the streaming issue's remaining targets (issue #27).
#
#   bench/gateway_streaming.sh             everything below, in order (about 8 minutes)
#   bench/gateway_streaming.sh first-draft 1. time to the first draft reaching the channel, p99
#                                             target ≤ 300 ms, TURNS (96) 20 s turns, CONCURRENCY
#                                             (32) in flight, (a) Teams on /api/messages, (b) Direct
#                                             Line over its WebSocket
#   bench/gateway_streaming.sh long        2. one 60 s turn (LONG_MS): Teams with the Connector
#                                             stand-in, and Web Chat 4.18 in headless Chromium
#   bench/gateway_streaming.sh kill        3. two replicas on one PostgreSQL; KILL_TURNS (8) turns on
#                                             replica A, A SIGKILLed halfway, the same activities
#                                             sent to replica B: receipts, finals, bot runs
#   bench/gateway_streaming.sh redeliver   4. REDELIVER_TURNS (8) activities sent again 15 s
#                                             (REDELIVER_AT_MS) into a 20 s turn, to the same
#                                             replica and to another one: bot runs per activity
#   TURNS=32 CONCURRENCY=8 TURN_MS=5000 LONG_MS=10000 bench/gateway_streaming.sh   a small run
#   NO_BUILD=1 ...                         measures target/release as it is
#   NO_BUILD=1 BIN=DIR ...                 measures the turnstile binary in DIR (a copy of a build)
#   GATEWAY_FLAGS="--turn-timeout-ms 130000" ...   flags for `turnstile gateway` in 1 and 2 (the
#                                             default is none: the gateway as shipped)
#   WEBCHAT_TIMEOUT_MS=130000 ...          Web Chat's `sendTimeout` and Direct Line client's
#                                             `timeout` in 2 (default: Web Chat's own, 20 s)
#   KEEP=1 ...                             keeps the scratch directory (logs, results) at the end
#
# The workload: the release binaries as shipped (RUST_LOG unset, default settings), PostgreSQL in
# a throwaway cluster (bench/pg.sh), everything on loopback, removed at the end. The channel side
# is bench/drivers/gateway_streaming.js (Node 20): it plays Teams — a one-on-one chat
# (`channelId` msteams, `conversationType` personal, each turn its own conversation) POSTed to
# `/api/messages`, and a Connector stand-in, an HTTP server that answers the gateway's POSTs to
# `{serviceUrl}/v3/conversations/{id}/activities[/{replyToId}]` with `{"id": …}` and times each
# `typing`/`streaminfo` draft and the final message — and Direct Line: it starts a conversation
# with the Direct Line secret, opens its WebSocket, posts "count" and times the first interim
# `typing` activity (streamType informative/streaming) and the final message; or it drives Web
# Chat 4.18 in Chromium with puppeteer-core (installed under target/tools, as
# tests/third_party/browser.rs installs them). Times run from the channel's POST.
#
# 1 and 2 run `turnstile serve --gateway-listen off` with the `llm` sample bot, paced by
# `--llm-token-delay-ms` so that its 34-word answer to "count" takes TURN_MS, and `turnstile
# gateway --bot llm` beside it (no app id: loopback, unauthenticated; `DirectLineSecret` set, as a
# site embedding Web Chat has). 3 and 4 run two `turnstile serve` replicas on one PostgreSQL,
# each with its embedded gateway, hosting bench/drivers/counting_worker.py, a bot worker built on
# sdk/python (installed from its wheel into a venv under target/tools) that drafts the same way
# (34 words over TURN_MS with `turn.stream`) and appends a line to a file at the start of every
# run, so that runs are counted on any replica, cut-short ones included. Commits are counted as
# rows of `turnstile_receipt` for the activity.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

WHAT=${1:-all}
TURNS=${TURNS:-96}
CONCURRENCY=${CONCURRENCY:-32}
TURN_MS=${TURN_MS:-20000}
LONG_MS=${LONG_MS:-60000}
KILL_TURNS=${KILL_TURNS:-8}
REDELIVER_TURNS=${REDELIVER_TURNS:-8}
REDELIVER_AT_MS=${REDELIVER_AT_MS:-$((TURN_MS * 3 / 4))}
# The llm bot's answer to "count", the first of a conversation, is 34 words (src/bots/llm.rs),
# each drafted after one delay, after a tool call of 6 delays: 40 delays a run. The counting
# worker writes the 34 words, one delay each.
WORDS=34
DELAYS=40
SECRET=bench-direct-line-secret

[ -n "${NO_BUILD:-}" ] || cargo build --release --bins -q
BIN=${BIN:-$ROOT/target/release}
TOOLS=$ROOT/target/tools
DRIVER=$ROOT/bench/drivers/gateway_streaming.js
PUPPETEER_DIR=$TOOLS/puppeteer-core-24.43.1
WEBCHAT_JS=$TOOLS/botframework-webchat-4.18.1/webchat.js
CHROMIUM=/usr/bin/chromium

# --- tools ---------------------------------------------------------------------------------------
# puppeteer-core (its `ws` is the driver's WebSocket client too) and Web Chat's bundle, where and
# as tests/third_party/browser.rs installs them; Chromium from apt.
tools() {
    command -v node >/dev/null || { echo "node (20) is needed: apt-get install nodejs npm" >&2; exit 1; }
    if [ ! -d "$PUPPETEER_DIR/node_modules/puppeteer-core" ]; then
        mkdir -p "$PUPPETEER_DIR"
        npm install --no-audit --no-fund --silent --prefix "$PUPPETEER_DIR" puppeteer-core@24.43.1
    fi
    if [ ! -f "$WEBCHAT_JS" ]; then
        local dir
        dir=$(dirname "$WEBCHAT_JS")
        mkdir -p "$dir"
        (cd "$dir" && npm pack --silent botframework-webchat@4.18.1 >/dev/null &&
            tar xzf botframework-webchat-4.18.1.tgz package/dist/webchat.js &&
            mv package/dist/webchat.js webchat.js && rm -rf package botframework-webchat-4.18.1.tgz)
    fi
}
chromium() {
    [ -x "$CHROMIUM" ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null ||
        { echo "$CHROMIUM is missing: apt-get install chromium (as root)" >&2; exit 1; }
}

# The Python SDK's wheel, built from a copy of sdk/python (the tree stays clean), installed in a
# venv of its own; offline from the wheelhouse the worker tests download, when it is there.
python_worker() {
    local hash venv
    hash=$(cd sdk/python && find pyproject.toml turnstile_worker -type f -not -path '*/__pycache__/*' |
        sort | xargs sha256sum | sha256sum | cut -c1-12)
    venv=$TOOLS/bench-python-worker-$hash
    if [ ! -x "$venv/bin/python" ]; then
        local build wheels
        build=$(mktemp -d /tmp/turnstile-sdk.XXXXXX)
        cp -r sdk/python "$build/sdk"
        rm -rf "$build/sdk/build" "$build/sdk"/*.egg-info
        wheels=$(ls -d "$TOOLS"/python-worker-wheels-"$(python3 -c 'import sys; print(sys.implementation.cache_tag)')"-* 2>/dev/null | head -n 1 || true)
        local pip_env=(PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1)
        [ -n "$wheels" ] && pip_env+=(PIP_NO_INDEX=1 "PIP_FIND_LINKS=$wheels")
        env "${pip_env[@]}" python3 -m pip wheel --quiet --no-deps -w "$build/wheel" "$build/sdk"
        python3 -m venv "$venv.tmp"
        env "${pip_env[@]}" "$venv.tmp/bin/pip" install --quiet "$build"/wheel/*.whl
        rm -rf "$build"
        mv "$venv.tmp" "$venv"
    fi
    PYTHON=$venv/bin/python
}

# --- processes -------------------------------------------------------------------------------------
. bench/pg.sh
PIDS=()
WORK=
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    stop_pg
    [ -n "$WORK" ] || return 0
    if [ -n "${KEEP:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
start_pg gateway-streaming
DB=postgres://postgres@127.0.0.1:$PORT/postgres
PSQL=$(command -v psql || echo "$PGBIN/psql")
DBNAME=postgres
psql_() { "${AS[@]}" "$PSQL" -h 127.0.0.1 -p "$PORT" -U postgres -d "$DBNAME" -Atq "$@"; }

wait_port() { # PORT PID LOG
    for _ in $(seq 1 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { cat "$3" >&2; exit 1; }
        sleep 0.1
    done
    echo "nothing listens on $1" >&2; cat "$3" >&2; exit 1
}

stop_all() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    PIDS=()
}

# A fresh database for each part, so that none sees another's receipts.
fresh_db() {
    DBNAME=postgres
    psql_ -c "SET client_min_messages = warning" -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
    DBNAME=$1
    DB=postgres://postgres@127.0.0.1:$PORT/$1
}

# `turnstile serve` with the llm bot at TURN words' pace and `turnstile gateway --bot llm`.
# Sets GATEWAY.
llm_stack() { # TURN_MS NAME
    fresh_db "$2"
    local grpc gw
    grpc=$(free_port)
    gw=$(free_port)
    env -u RUST_LOG "$BIN/turnstile" serve --listen "127.0.0.1:$grpc" --gateway-listen off \
        --database-url "$DB" --llm-token-delay-ms $(($1 / DELAYS)) >"$WORK/$2-server.log" 2>&1 &
    PIDS+=($!)
    wait_port "$grpc" $! "$WORK/$2-server.log"
    # shellcheck disable=SC2086 # GATEWAY_FLAGS is a list of flags
    env -u RUST_LOG DirectLineSecret=$SECRET "$BIN/turnstile" gateway --listen "127.0.0.1:$gw" \
        --turnstile-url "http://127.0.0.1:$grpc" --bot llm ${GATEWAY_FLAGS:-} >"$WORK/$2-gateway.log" 2>&1 &
    PIDS+=($!)
    wait_port "$gw" $! "$WORK/$2-gateway.log"
    GATEWAY=http://127.0.0.1:$gw
}

# Two `turnstile serve` replicas on one database, each with its embedded gateway, both hosting
# the counting worker as their gateway's bot. Sets GATEWAY_A, GATEWAY_B, REPLICA_A, RUNS.
replicas() { # NAME
    fresh_db "$1"
    RUNS=$WORK/$1-runs.jsonl
    : >"$RUNS"
    local worker
    worker=$(free_port)
    RUNS_FILE=$RUNS TOKEN_DELAY_MS=$((TURN_MS / WORDS)) WORDS=$WORDS \
        "$PYTHON" bench/drivers/counting_worker.py "127.0.0.1:$worker" >"$WORK/$1-worker.log" 2>&1 &
    PIDS+=($!)
    wait_port "$worker" $! "$WORK/$1-worker.log"
    local name grpc gw
    for name in a b; do
        grpc=$(free_port)
        gw=$(free_port)
        env -u RUST_LOG "$BIN/turnstile" serve --listen "127.0.0.1:$grpc" \
            --gateway-listen "127.0.0.1:$gw" --database-url "$DB" \
            --remote-bot "counted=http://127.0.0.1:$worker" --gateway-bot counted \
            >"$WORK/$1-replica-$name.log" 2>&1 &
        PIDS+=($!)
        wait_port "$gw" $! "$WORK/$1-replica-$name.log"
        if [ $name = a ]; then GATEWAY_A=http://127.0.0.1:$gw; REPLICA_A=$!; else GATEWAY_B=http://127.0.0.1:$gw; fi
    done
}

# Receipts committed for each activity id in the driver's JSON (`ids`).
receipts() { # RESULT_JSON
    local id counts=()
    for id in $(node -e 'for (const id of JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).ids) console.log(id)' "$1"); do
        counts+=("$(psql_ -c "SELECT count(*) FROM turnstile.turnstile_receipt WHERE key LIKE '%$id'")")
    done
    echo "   receipts per activity (commits): ${counts[*]}" >&2
}

drive() { # NAME COMMAND ARGS...
    local name=$1
    shift
    node "$DRIVER" "$@" --node-modules "$PUPPETEER_DIR/node_modules" | tail -n 1 >"$WORK/$name.json"
    echo "   ($WORK/$name.json)" >&2
}

[ "$WHAT" = all ] || [ "$WHAT" = first-draft ] || [ "$WHAT" = long ] || [ "$WHAT" = kill ] ||
    [ "$WHAT" = redeliver ] || { echo "usage: $0 [all|first-draft|long|kill|redeliver]" >&2; exit 2; }
tools

if [ "$WHAT" = all ] || [ "$WHAT" = first-draft ]; then
    echo "== 1. first draft through the gateway: $TURNS turns of ~$((TURN_MS / 1000)) s, $CONCURRENCY in flight" >&2
    llm_stack "$TURN_MS" first
    # The cold server's first wave on each channel is reported apart, as bench/streaming.sh does.
    drive first-teams-cold first-draft-teams --name teams-cold --gateway "$GATEWAY" \
        --turns "$CONCURRENCY" --concurrency "$CONCURRENCY" --turn-ms "$TURN_MS"
    drive first-teams first-draft-teams --name teams --gateway "$GATEWAY" \
        --turns "$TURNS" --concurrency "$CONCURRENCY" --turn-ms "$TURN_MS"
    drive first-directline first-draft-directline --name directline --gateway "$GATEWAY" \
        --secret $SECRET --turns "$TURNS" --concurrency "$CONCURRENCY" --turn-ms "$TURN_MS"
    stop_all
fi

if [ "$WHAT" = all ] || [ "$WHAT" = long ]; then
    chromium
    echo "== 2. one $((LONG_MS / 1000)) s turn through the gateway" >&2
    llm_stack "$LONG_MS" long
    drive long-teams long-teams --gateway "$GATEWAY" --turn-ms "$LONG_MS"
    mkdir -p "$ROOT/target/artifacts/bench"
    drive long-webchat long-webchat --gateway "$GATEWAY" --secret $SECRET --turn-ms "$LONG_MS" \
        --puppeteer "$PUPPETEER_DIR/node_modules/puppeteer-core" --chromium "$CHROMIUM" \
        --webchat-js "$WEBCHAT_JS" --artifacts "$ROOT/target/artifacts/bench" \
        ${WEBCHAT_TIMEOUT_MS:+--webchat-timeout-ms "$WEBCHAT_TIMEOUT_MS"}
    stop_all
fi

if [ "$WHAT" = all ] || [ "$WHAT" = kill ] || [ "$WHAT" = redeliver ]; then python_worker; fi

if [ "$WHAT" = all ] || [ "$WHAT" = kill ]; then
    echo "== 3. replica A SIGKILLed mid-stream, $KILL_TURNS turns of ~$((TURN_MS / 1000)) s retried on replica B" >&2
    replicas kill
    drive kill kill --gateway "$GATEWAY_A" --gateway-b "$GATEWAY_B" --kill-pid "$REPLICA_A" \
        --turns "$KILL_TURNS" --turn-ms "$TURN_MS" --runs-file "$RUNS"
    receipts "$WORK/kill.json"
    stop_all
fi

if [ "$WHAT" = all ] || [ "$WHAT" = redeliver ]; then
    for to in same other; do
        echo "== 4. redelivery $REDELIVER_AT_MS ms into a $((TURN_MS / 1000)) s turn, to the $to replica: $REDELIVER_TURNS activities" >&2
        replicas "redeliver_$to"
        drive "redeliver-$to" redeliver --gateway "$GATEWAY_A" --gateway-b "$GATEWAY_B" --to $to \
            --turns "$REDELIVER_TURNS" --turn-ms "$TURN_MS" --at-ms "$REDELIVER_AT_MS" --runs-file "$RUNS"
        receipts "$WORK/redeliver-$to.json"
        stop_all
    done
fi
