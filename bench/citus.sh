#!/usr/bin/env bash
# Turnstile on Citus against Turnstile on one PostgreSQL, in the same run on the same machine.
#
#   bench/citus.sh    about 3 minutes after the release build
#   SERVE_ARGS='--commits-in-flight 4' bench/citus.sh    a tuned variant, beside the shipped one
#
# Starts a single PostgreSQL and a Citus cluster (a coordinator and 2 workers, every node with
# default settings, Citus' recovery of two-phase commits off so that its records can be counted),
# then alternates, ROUNDS times: one `turnstile serve` as shipped over the single PostgreSQL, the
# same over the coordinator, each driven by turnstile-bench with the counter bot (10,000
# conversations, ~1 KB of state, 32 calls, prefilled). Reports turns/s and CPU per turn of the
# server and of each database node, and, from Citus' own counters (`citus_stat_counters`,
# `pg_dist_transaction`), how many statements went to one shard and to several, and how many
# transactions committed in two phases. Needs Citus installed for the machine's PostgreSQL
# (`../shared/citus/install.sh`). These 2 cores cannot show scale-out: every node shares them. The
# fraction of statements Citus sends to one shard is what decides how the cluster scales.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS=${SECS:-8}; WARMUP=2; ROUNDS=${ROUNDS:-3}; KEYS=10000; PAD=1024; CALLS=32

cargo build --release --bins -q
BIN=$PWD/target/release
PGBIN=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
PGBIN=$(dirname "$(readlink -f "$PGBIN/pg_ctl")")
[ -f "$PGBIN/../lib/citus.so" ] || { echo "Citus is not installed for $PGBIN (../shared/citus/install.sh)" >&2; exit 1; }

WORK=$(mktemp -d /tmp/turnstile-citus-bench.XXXXXX)
AS=()
if [ "$(id -u)" = 0 ]; then chown postgres: "$WORK"; AS=(runuser -u postgres --); fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
NODES=()
PIDS=()
cleanup() {
    for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
    for node in "${NODES[@]:-}"; do
        [ -n "$node" ] && "${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/$node" -m immediate stop >/dev/null 2>&1 || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

node() {  # NAME PORT [SETTING...]: a running cluster
    local name=$1 port=$2; shift 2
    "${AS[@]}" "$PGBIN/initdb" -D "$WORK/$name" -U postgres -A trust -E UTF8 --no-locale >/dev/null
    local opts="-p $port -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=300"
    for setting in "$@"; do opts="$opts -c $setting"; done
    "${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/$name" -l "$WORK/$name.log" -w -o "$opts" start >/dev/null
    NODES+=("$name")
}
psql_at() { psql -h 127.0.0.1 -p "$1" -U postgres -v ON_ERROR_STOP=1 -qAt -d "$2" -c "$3"; }
postmaster() { head -n 1 "$WORK/$1/postmaster.pid"; }

SINGLE=$(free_port); node single "$SINGLE"
psql_at "$SINGLE" postgres "CREATE DATABASE service"
CITUS=(shared_preload_libraries=citus citus.recover_2pc_interval=-1 citus.enable_stat_counters=on)
COORD=$(free_port); node coord "$COORD" "${CITUS[@]}"
W1=$(free_port); node w1 "$W1" "${CITUS[@]}"
W2=$(free_port); node w2 "$W2" "${CITUS[@]}"
for port in "$W1" "$W2" "$COORD"; do
    psql_at "$port" postgres "CREATE DATABASE service"
    psql_at "$port" service "CREATE EXTENSION citus"
done
psql_at "$COORD" service "SELECT citus_set_coordinator_host('127.0.0.1', $COORD)" >/dev/null
psql_at "$COORD" service "SELECT citus_add_node('127.0.0.1', $W1)" >/dev/null
psql_at "$COORD" service "SELECT citus_add_node('127.0.0.1', $W2)" >/dev/null
"$BIN/turnstile" migrate --database-url "postgres://postgres@127.0.0.1:$SINGLE/service" 2>>"$WORK/migrate.log"
"$BIN/turnstile" migrate --citus --database-url "postgres://postgres@127.0.0.1:$COORD/service" 2>>"$WORK/migrate.log"

# serve PORT CPU_OF... -> JSON of one measured run on a fresh server over that database
serve_and_bench() {
    local db=$1; shift
    local port; port=$(free_port)
    # shellcheck disable=SC2086 # SERVE_ARGS: a tuned variant's flags, empty for the product as shipped
    "$BIN/turnstile" serve --listen "127.0.0.1:$port" ${SERVE_ARGS:-} \
        --database-url "postgres://postgres@127.0.0.1:$db/service" >>"$WORK/service.log" 2>&1 &
    local pid=$!
    PIDS+=("$pid")
    for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
    "$BIN/turnstile-bench" --target "127.0.0.1:$port" --duration "$SECS" --warmup "$WARMUP" \
        --conversations "$KEYS" --concurrency "$CALLS" --state-bytes "$PAD" --prefill --json \
        --cpu-of "server=$pid" "$@"
    kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
    PIDS=()
}
# Two-phase commits are counted on every node: the group commit's batches run on the workers, and
# a batch that wrote a shard of another node would be committed in two phases by its worker.
counters() {
    echo "$(psql_at "$COORD" service "SELECT sum(query_execution_single_shard), sum(query_execution_multi_shard), (SELECT count(*) FROM pg_dist_transaction), sum(connection_establishment_succeeded), sum(connection_reused) FROM citus_stat_counters")|$(psql_at "$W1" service "SELECT count(*) FROM pg_dist_transaction")|$(psql_at "$W2" service "SELECT count(*) FROM pg_dist_transaction")"
}
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

echo "machine: $(nproc) cores, $(uname -sr); $(date -u +%Y-%m-%dT%H:%MZ); PostgreSQL $("$PGBIN/postgres" --version | awk '{print $3}'), Citus $(psql_at "$COORD" service "SELECT extversion FROM pg_extension WHERE extname = 'citus'")"
echo "counter bot, $KEYS conversations prefilled, ~$PAD-byte state, $CALLS calls, ${SECS}s per run, the server as shipped"
echo
printf '%-6s %-7s %9s %9s %s\n' round engine "turns/s" "p99 ms" "CPU µs per turn"
for round in $(seq 1 "$ROUNDS"); do
    json=$(serve_and_bench "$SINGLE" --cpu-of "postgres=$(postmaster single)")
    printf '%-6s %-7s %9.0f %9.1f %s\n' "$round" single "$(echo "$json" | field 'd["turns_per_second"]')" \
        "$(echo "$json" | field 'd["latency_ms"]["p99"]')" \
        "$(echo "$json" | field '", ".join(f"{k} {v:.0f}" for k, v in d["cpu_us_per_turn"].items())')"
    before=$(counters)
    json=$(serve_and_bench "$COORD" --cpu-of "coordinator=$(postmaster coord)" \
        --cpu-of "worker1=$(postmaster w1)" --cpu-of "worker2=$(postmaster w2)")
    after=$(counters)
    turns=$(echo "$json" | field 'round(d["turns_per_second"] * d["seconds"])')
    printf '%-6s %-7s %9.0f %9.1f %s\n' "$round" citus "$(echo "$json" | field 'd["turns_per_second"]')" \
        "$(echo "$json" | field 'd["latency_ms"]["p99"]')" \
        "$(echo "$json" | field '", ".join(f"{k} {v:.0f}" for k, v in d["cpu_us_per_turn"].items())')"
    python3 - "$before" "$after" "$turns" <<'PY'
import sys
b = [int(x) for x in sys.argv[1].split("|")]
a = [int(x) for x in sys.argv[2].split("|")]
single, multi, two_phase, opened, reused, by_w1, by_w2 = (a[i] - b[i] for i in range(7))
print(f"       citus counted, warm-up and prefill included: {single} single-shard and {multi} "
      f"multi-shard statements ({single / max(1, single + multi):.1%} router-planned), "
      f"{two_phase} two-phase commits by the coordinator and {by_w1} / {by_w2} by the workers, "
      f"{opened} connections to workers opened and {reused} reused; {sys.argv[3]} measured turns")
PY
done
