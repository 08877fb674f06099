#!/usr/bin/env bash
# Turnstile's benchmark, anchored on pgbench in the same run on the same machine.
#
#   bench/run.sh           every workload (about 6 minutes after the release build)
#   bench/run.sh --quick   10,000 conversations at 32 calls only (under two minutes after the build)
#
# It starts a throwaway PostgreSQL cluster, measures pgbench running the naive per-turn SQL
# (SELECT state, version; then UPDATE ... WHERE key = $k AND version = $v) over the same keys,
# state size and concurrency, then the service driven by turnstile-bench, and prints both with
# the ratios service / pgbench. Shared machines are noisy: compare ratios, not absolute numbers.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
if [ "$QUICK" = 1 ]; then SECS=15; WARMUP=3; else SECS=20; WARMUP=3; fi
KEYS=10000
PAD=1024

cargo build --release --bins -q
BIN=$PWD/target/release

# --- a throwaway PostgreSQL cluster ------------------------------------------------------------
PGBIN=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
[ -x "$PGBIN/pg_ctl" ] || { echo "PostgreSQL server binaries not found (apt-get install postgresql)" >&2; exit 1; }
WORK=$(mktemp -d /tmp/turnstile-bench.XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
AS=()
if [ "$(id -u)" = 0 ]; then chown postgres: "$WORK"; AS=(runuser -u postgres --); fi
PIDS=()
cleanup() {
    [ -n "${KEEP:-}" ] && { echo "kept $WORK port $PORT"; return; }
    for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
    "${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT
"${AS[@]}" "$PGBIN/initdb" -D "$WORK/data" -U postgres -A trust -E UTF8 --no-locale >/dev/null
"${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/data" -l "$WORK/pg.log" -w \
    -o "-p $PORT -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=300" start >/dev/null
PSQL=(psql -h 127.0.0.1 -p "$PORT" -U postgres -v ON_ERROR_STOP=1 -q)
"${PSQL[@]}" -d postgres -c "CREATE DATABASE anchor" -c "CREATE DATABASE service"

# --- the anchor: pgbench with the naive per-turn SQL --------------------------------------------
"${PSQL[@]}" -d anchor <<SQL
CREATE TABLE state (key text PRIMARY KEY, state jsonb NOT NULL, version bigint NOT NULL);
INSERT INTO state
SELECT 'c' || i, jsonb_build_object('count', 0, 'pad', repeat('.', $PAD)), 1
  FROM generate_series(1, $KEYS) AS i;
VACUUM ANALYZE state;
SQL
cat > "$WORK/turn.sql" <<SQL
\set k random(1, $KEYS)
SELECT state, version FROM state WHERE key = 'c' || :k \gset
UPDATE state SET state = jsonb_set(:state::jsonb, '{count}', to_jsonb(:version + 1)), version = version + 1 WHERE key = 'c' || :k AND version = :version;
SQL
cat > "$WORK/hot.sql" <<SQL
SELECT state, version FROM state WHERE key = 'c1' \gset
UPDATE state SET state = jsonb_set(:state::jsonb, '{count}', to_jsonb(:version + 1)), version = version + 1 WHERE key = 'c1' AND version = :version;
SQL

# pgbench SCRIPT CLIENTS -> "turns/s p99_ms"
pgbench_run() {
    local script=$1 clients=$2 dir
    dir=$(mktemp -d "$WORK/pgbench.XXXX")
    (cd "$dir" && pgbench -h 127.0.0.1 -p "$PORT" -U postgres -n -M prepared -f "$WORK/$script" \
        -c "$clients" -j 2 -T "$SECS" -l anchor >/dev/null 2>"$dir/err") \
        || { cat "$dir/err" >&2; exit 1; }
    python3 - "$dir" "$SECS" <<'PY'
import glob, sys
lat = []
for f in glob.glob(sys.argv[1] + "/pgbench_log.*"):
    for line in open(f):
        parts = line.split()
        if len(parts) >= 3:
            lat.append(int(parts[2]) / 1000.0)
lat.sort()
p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
print(f"{len(lat) / float(sys.argv[2]):.0f} {p99:.2f}")
PY
}

# --- the service ---------------------------------------------------------------------------------
start_servers() {  # N -> sets TARGETS
    local n=$1 i port
    TARGETS=""
    for i in $(seq 1 "$n"); do
        port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        RUST_LOG=warn "$BIN/turnstile" serve --listen "127.0.0.1:$port" \
            --database-url "postgres://postgres@127.0.0.1:$PORT/service" >>"$WORK/service.log" 2>&1 &
        PIDS+=($!)
        TARGETS="${TARGETS:+$TARGETS,}127.0.0.1:$port"
        for _ in $(seq 1 100); do
            (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
            sleep 0.1
        done
    done
}
stop_servers() {
    PEAK_KB=0
    for pid in "${PIDS[@]}"; do
        kb=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
        [ "${kb:-0}" -gt "$PEAK_KB" ] && PEAK_KB=$kb
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    PIDS=()
}
# bench ARGS... -> JSON on stdout
bench() {
    "$BIN/turnstile-bench" --target "$TARGETS" --duration "$SECS" --warmup "$WARMUP" \
        --state-bytes "$PAD" --json "$@"
}
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr); $(date -u +%Y-%m-%dT%H:%MZ)"
echo "PostgreSQL $("$PGBIN/postgres" --version | awk '{print $3}'), default settings; $KEYS keys, ~$PAD-byte state; ${SECS}s per run"
echo

uniform() {  # CONCURRENCY
    local c=$1 anchor tps p99 json stps sp99
    anchor=$(pgbench_run turn.sql "$c"); tps=${anchor% *}; p99=${anchor#* }
    start_servers 1
    json=$(bench --conversations "$KEYS" --concurrency "$c" --prefill)
    stop_servers
    stps=$(echo "$json" | field 'round(d["turns_per_second"])')
    sp99=$(echo "$json" | field 'round(d["latency_ms"]["p99"], 2)')
    echo "$KEYS conversations, $c concurrent: service $stps turns/s p99 $sp99 ms; pgbench $tps turns/s p99 $p99 ms; peak RSS $((PEAK_KB / 1024)) MiB"
    echo "  attempts $(echo "$json" | field 'd["attempts"]'), statuses $(echo "$json" | field 'd["statuses"]'), check $(echo "$json" | field 'd["verification"]')"
    LINE=$(python3 -c "print(f'throughput ratio {$stps/$tps:.2f} (service $stps turns/s, pgbench $tps); p99 ratio {$sp99/$p99:.2f} (service $sp99 ms, pgbench $p99 ms)')")
    echo "  $LINE"
}

hot() {  # REPLICAS
    local n=$1 json
    start_servers "$n"
    json=$(bench --conversations 1 --hot-share 1 --concurrency 64)
    stop_servers
    echo "1 hot conversation, 64 concurrent, $n replica(s): $(echo "$json" | field 'round(d["turns_per_second"])') turns/s, p99 $(echo "$json" | field 'round(d["latency_ms"]["p99"], 2)') ms; attempts $(echo "$json" | field 'd["attempts"]'); statuses $(echo "$json" | field 'd["statuses"]'); check $(echo "$json" | field 'd["verification"]')"
}

if [ "$QUICK" = 1 ]; then
    uniform 32
    echo "$LINE"
    exit 0
fi
uniform 8
uniform 32
anchor=$(pgbench_run hot.sql 1)
echo "pgbench, 1 client on 1 key (one commit per round trip, serialized): ${anchor% *} turns/s, p99 ${anchor#* } ms"
hot 1
hot 3
echo "$LINE"
