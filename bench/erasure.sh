#!/usr/bin/env bash
# Erasure under load: the data-lifecycle issue's target "erase 10,000 users while turns run.
# Afterwards a full-table scan finds their ids 0 times, and p99 per erasure is at most 1 s."
#
#   bench/erasure.sh                  10,000 erased users, 2,000 kept ones: ~2 min after the build
#   ERASED=N KEPT=M bench/erasure.sh  other numbers (and GROUP_CONVERSATIONS, 500)
#   NO_BUILD=1 bench/erasure.sh       measures target/release as it is (BIN=DIR: another build)
#   KEEP=1 bench/erasure.sh           keeps the scratch directory (server and worker logs)
#
# The workload: two replicas of the release server as shipped (RUST_LOG unset, default settings)
# on one PostgreSQL (a throwaway cluster, bench/pg.sh), with the two settings the run needs: admin
# tokens (TURNSTILE_ADMIN_TOKENS; the admin service is off without them) and `--remote-bot
# notes=…`, a Python bot worker built on sdk/python (bench/drivers/erasure.py, one per replica):
# no built-in sample bot writes the private conversation scope, and an erasure must remove it.
# Each user (ERASED `erase-user-NNNNN-xx`, KEPT `keep-user-NNNNN-xx`, channel `erasure`) has a
# conversation of their own and shares one of GROUP_CONVERSATIONS group conversations with
# others; the seed sends each user four turns (32 callers): two to `notes` in their own
# conversation, one to `notes` in their group (user scope, and private conversation scope in both
# conversations), one to the shipped `user-state` bot (its user scope). That is four state rows
# and four receipts per user, the user's id in every one of them, key and content.
#
# Then, with the kept users' turns running throughout (LOAD_CONCURRENCY 16 callers over both
# replicas: BEFORE_S seconds alone, during the erasures, AFTER_S after), EraseUser for each of
# the ERASED users by ERASE_CONCURRENCY (8) callers, half of them on each replica, each call's
# latency recorded. Then full scans of every table in the schema (`t::text` of every row, a
# sequential scan by construction), before the erasures and after: rows holding `erase-user-`
# (a prefix of every erased id and of nothing else) must be 0, the kept users' rows all there,
# each erasure record's rows and receipts what was seeded for that user, and a tombstone for each
# erased row (sha256 of its key, its last version). Last, EXPLAIN ANALYZE of the shipped
# ERASE_USER statement (read from src/store/postgres.rs; generic plan; in a transaction rolled
# back) for one kept user, and which of PostgreSQL's files still hold an erased id.
#
# The client is Python (grpcio, in the venv gateway_streaming.sh builds for the SDK's wheel).
# Results: target/artifacts/bench/erasure/ (summary.txt and the JSON of each phase).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ERASED=${ERASED:-10000}
KEPT=${KEPT:-2000}
GROUP_CONVERSATIONS=${GROUP_CONVERSATIONS:-500}
REPLICAS=${REPLICAS:-2}
LOAD_CONCURRENCY=${LOAD_CONCURRENCY:-16}
ERASE_CONCURRENCY=${ERASE_CONCURRENCY:-8}
BEFORE_S=${BEFORE_S:-20}
AFTER_S=${AFTER_S:-5}

[ -n "${NO_BUILD:-}" ] || cargo build --release --bins -q
BUILT=${BIN:+BIN=$BIN}
BIN=${BIN:-$ROOT/target/release}
TOOLS=$ROOT/target/tools
ARTIFACTS=$ROOT/target/artifacts/bench/erasure
mkdir -p "$ARTIFACTS" "$TOOLS"

# The Python SDK's wheel, built from a copy of sdk/python (the tree stays clean), installed in a
# venv of its own with grpcio and grpcio-tools: as bench/gateway_streaming.sh does, same venv.
hash=$(cd sdk/python && find pyproject.toml turnstile_worker -type f -not -path '*/__pycache__/*' |
    sort | xargs sha256sum | sha256sum | cut -c1-12)
VENV=$TOOLS/bench-python-worker-$hash
if [ ! -x "$VENV/bin/python" ]; then
    build=$(mktemp -d /tmp/turnstile-sdk.XXXXXX)
    cp -r sdk/python "$build/sdk"
    rm -rf "$build/sdk/build" "$build/sdk"/*.egg-info
    wheels=$(ls -d "$TOOLS"/python-worker-wheels-"$(python3 -c 'import sys; print(sys.implementation.cache_tag)')"-* 2>/dev/null | head -n 1 || true)
    pip_env=(PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1)
    [ -n "$wheels" ] && pip_env+=(PIP_NO_INDEX=1 "PIP_FIND_LINKS=$wheels")
    env "${pip_env[@]}" python3 -m pip wheel --quiet --no-deps -w "$build/wheel" "$build/sdk"
    rm -rf "$VENV.tmp"
    python3 -m venv "$VENV.tmp"
    env "${pip_env[@]}" "$VENV.tmp/bin/pip" install --quiet "$build"/wheel/*.whl
    rm -rf "$build"
    mv "$VENV.tmp" "$VENV"
fi
PY=("$VENV/bin/python" -B "$ROOT/bench/drivers/erasure.py")

. bench/pg.sh
PIDS=()
LOAD=
cleanup() {
    local pid
    [ -z "$LOAD" ] || kill "$LOAD" 2>/dev/null || true
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    stop_pg
    [ -n "${WORK:-}" ] || return 0
    if [ -n "${KEEP:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
start_pg erasure
DB=postgres://postgres@127.0.0.1:$PORT/postgres
PSQL="psql -h 127.0.0.1 -p $PORT -U postgres -d postgres -Atq -v ON_ERROR_STOP=1"
# Turnstile's tables are in their schema (--database-schema, default turnstile); psql here and in
# the driver finds them by this.
export PGOPTIONS="-c search_path=turnstile,public"
"$BIN/turnstile" migrate --database-url "$DB" >/dev/null 2>&1

wait_port() { # PORT PID LOG
    for _ in $(seq 1 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { cat "$3" >&2; exit 1; }
        sleep 0.1
    done
    echo "nothing listens on $1 ($3)" >&2
    exit 1
}

ADMIN_TOKEN=bench-admin-$(printf '%08x%08x' $((RANDOM * 32768 + RANDOM)) $((RANDOM * 32768 + RANDOM)))
export ADMIN_TOKEN
targets=()
for r in $(seq 0 $((REPLICAS - 1))); do
    wport=$(free_port)
    "${PY[@]}" worker "127.0.0.1:$wport" >"$WORK/worker-$r.log" 2>&1 &
    PIDS+=($!)
    wait_port "$wport" $! "$WORK/worker-$r.log"
    port=$(free_port)
    env -u RUST_LOG TURNSTILE_ADMIN_TOKENS="$ADMIN_TOKEN" "$BIN/turnstile" serve \
        --listen "127.0.0.1:$port" --gateway-listen off --database-url "$DB" \
        --remote-bot "notes=http://127.0.0.1:$wport" >"$WORK/server-$r.log" 2>&1 &
    PIDS+=($!)
    wait_port "$port" $! "$WORK/server-$r.log"
    targets+=("127.0.0.1:$port")
done
TARGETS=$(IFS=,; echo "${targets[*]}")
COMMON=(--targets "$TARGETS" --gen "$WORK/gen" --erased "$ERASED" --kept "$KEPT" --groups "$GROUP_CONVERSATIONS")
OUT=$WORK/out
mkdir -p "$OUT"

echo "== $(date -u +%FT%TZ), ${BUILT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- src migrations proto 2>/dev/null || echo '+changes')}, $(nproc) cores; $REPLICAS replicas, $ERASED erased + $KEPT kept users, $GROUP_CONVERSATIONS groups" >&2
echo "-- seeding (4 turns per user, 32 callers)" >&2
"${PY[@]}" seed "${COMMON[@]}" --concurrency 32 >"$OUT/seed.json"
echo "-- scanning before the erasures" >&2
"${PY[@]}" scan --psql "$PSQL" >"$OUT/scan-before.json"

echo "-- the kept users' turns: ${BEFORE_S} s alone, then the erasures, then ${AFTER_S} s" >&2
"${PY[@]}" load "${COMMON[@]}" --concurrency "$LOAD_CONCURRENCY" >"$OUT/load.json" &
LOAD=$!
sleep "$BEFORE_S"
"${PY[@]}" erase "${COMMON[@]}" --concurrency "$ERASE_CONCURRENCY" >"$OUT/erase.json"
sleep "$AFTER_S"
kill -TERM "$LOAD"
wait "$LOAD"
LOAD=

echo "-- scanning after the erasures" >&2
"${PY[@]}" scan --psql "$PSQL" --tombstones --explain >"$OUT/scan-after.json"

# Where PostgreSQL's files still hold an erased id (the scans above see live rows only), and
# after VACUUM and VACUUM FULL, with the load stopped.
files() { "${PY[@]}" files --psql "$PSQL" --data "$WORK/pg/data" --label "$1"; }
{
    "${PY[@]}" report "$OUT" || true
    for r in $(seq 0 $((REPLICAS - 1))); do
        # (Less the warning at start that the TurnService takes no tokens: so shipped.)
        echo "replica $r logged $(grep -E ' (WARN|ERROR) ' "$WORK/server-$r.log" |
            grep -vc 'no auth tokens configured' || true) warnings and errors, $(grep -c 'event="erasure"' "$WORK/server-$r.log" || true) erasures (the warm-up's included)"
    done
    files "after the erasures"
    $PSQL -c "VACUUM turnstile_state, turnstile_receipt, turnstile_tombstone"
    files "after VACUUM"
    $PSQL -c "VACUUM FULL turnstile_state, turnstile_receipt, turnstile_tombstone"
    files "after VACUUM FULL"
} | tee "$OUT/summary.txt"
cp "$OUT"/*.json "$OUT/summary.txt" "$ARTIFACTS/"
for r in $(seq 0 $((REPLICAS - 1))); do cp "$WORK/server-$r.log" "$ARTIFACTS/server-$r.log"; done
grep -q "^target MET" "$OUT/summary.txt"
