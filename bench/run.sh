#!/usr/bin/env bash
# Turnstile's benchmark, anchored on pgbench in the same run on the same machine.
#
#   bench/run.sh           every workload (about 10 minutes after the release build)
#   bench/run.sh --quick   10,000 conversations at 32 calls, split layout (about 80 s after the build);
#                          QUICK_LAYOUT=shared and QUICK_CALLS=N run it in the other layout or at
#                          another concurrency
#   bench/run.sh --soak    10 minutes of the 32-call workload, the server's memory sampled every 30 s
#   bench/run.sh --unprepared  the --quick workload with --prepared-statements true, then false,
#                          back to back in each round (about 90 s after the build)
#   bench/run.sh --workers the --quick workload on the counter bot in process, then on the same bot
#                          as a Python bot worker (sdk/python/examples/counter.py) through the same
#                          server, back to back in each round (about 90 s after the build)
#   bench/run.sh --card    the load card (bench/card.sh, about 40 minutes after the build): writes
#                          bench/CARD.md and its plots in bench/card/
#   bench/run.sh --hot     hot conversations (about 2 minutes after the build): one conversation at
#                          64 concurrent calls on one replica, then on three; then the `slow` bot
#                          (200 ms per run), 8 concurrent on one conversation over three replicas,
#                          optimistic and serialized. TURNSTILE_BEFORE=/path/to/turnstile adds the
#                          same workloads served by that binary (an earlier build, for comparison).
#
# Two layouts of the machine's cores. "split": PostgreSQL on one half, the clients (pgbench, or the
# service and its load generator) on the other, as in a deployment where the database has its own
# machine; this is the one --quick and the last line report. "shared": everything on every core,
# so that the service and the load generator take CPU from PostgreSQL that pgbench's thin client
# does not.
#
# It starts a throwaway PostgreSQL cluster, measures pgbench running the naive per-turn SQL
# (SELECT state, version; then UPDATE ... WHERE key = $k AND version = $v) over the same keys,
# state size and concurrency, then the service driven by turnstile-bench, and prints both with
# the ratios service / pgbench. Shared machines are noisy: compare ratios, not absolute numbers.
#
# PostgreSQL runs with its default settings. PG_OPTIONS="-c name=value ..." adds server settings
# for a diagnostic run (say "-c synchronous_commit=off" on a machine whose disk flushes are slow:
# there every workload that commits one turn per flush measures the disk, not the service); the
# header line says what was set, and the time one flush of 8 KiB took when the run began.
# BENCH_STATE_BYTES=N pads each state to N bytes instead of 1,024 (the card's sizes are 256, 8192
# and 65536: `BENCH_STATE_BYTES=256 bench/run.sh --quick` is its 256 B split row, alone).
# PG_LOCALE=en_US.UTF-8 creates the cluster, and so its databases, with that locale instead of
# none (C), as a packaged or hosted PostgreSQL is often created: text keys then compare by it.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0; SOAK=0; UNPREPARED=0; WORKERS=0; HOT=0; CARD=0
[ "${1:-}" = "--card" ] && CARD=1
[ "${1:-}" = "--quick" ] && QUICK=1
[ "${1:-}" = "--soak" ] && SOAK=1
[ "${1:-}" = "--unprepared" ] && UNPREPARED=1
[ "${1:-}" = "--workers" ] && WORKERS=1
[ "${1:-}" = "--hot" ] && HOT=1
if [ "$QUICK" = 1 ] || [ "$UNPREPARED" = 1 ] || [ "$WORKERS" = 1 ]; then SECS=8; WARMUP=2; ROUNDS=3; else SECS=10; WARMUP=2; ROUNDS=3; fi
[ "$SOAK" = 1 ] && SECS=${SOAK_SECONDS:-600}
# BENCH_ROUNDS=N and BENCH_SECS_PER_RUN=S change the rounds and their length (a short trial of --card).
SECS=${BENCH_SECS_PER_RUN:-$SECS}; ROUNDS=${BENCH_ROUNDS:-$ROUNDS}
KEYS=10000
PAD=${BENCH_STATE_BYTES:-1024}

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
"${AS[@]}" "$PGBIN/initdb" -D "$WORK/data" -U postgres -A trust -E UTF8 \
    $([ -n "${PG_LOCALE:-}" ] && echo "--locale=$PG_LOCALE" || echo --no-locale) >/dev/null
"${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/data" -l "$WORK/pg.log" -w \
    -o "-p $PORT -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=300 ${PG_OPTIONS:-}" start >/dev/null
PSQL=(psql -h 127.0.0.1 -p "$PORT" -U postgres -v ON_ERROR_STOP=1 -q)
"${PSQL[@]}" -d postgres -c "CREATE DATABASE anchor" -c "CREATE DATABASE service"

# --- the anchor: pgbench with the naive per-turn SQL --------------------------------------------
anchor_state() {  # PAD: the anchor's KEYS rows, each with PAD bytes of padding
    "${PSQL[@]}" -d anchor <<SQL
DROP TABLE IF EXISTS state;
CREATE TABLE state (key text PRIMARY KEY, state jsonb NOT NULL, version bigint NOT NULL);
INSERT INTO state
SELECT 'c' || i, jsonb_build_object('count', 0, 'pad', repeat('.', $1)), 1
  FROM generate_series(1, $KEYS) AS i;
VACUUM ANALYZE state;
SQL
}
anchor_state "$PAD"
cat > "$WORK/turn.sql" <<SQL
\set k random(1, $KEYS)
SELECT state, version FROM state WHERE key = 'c' || :k \gset
UPDATE state SET state = jsonb_set(:state::jsonb, '{count}', to_jsonb(:version + 1)), version = version + 1 WHERE key = 'c' || :k AND version = :version;
SQL
# The service's own common commit when it goes alone (UPDATE_ONE in
# src/store/postgres/group_commit.rs): write the scope over the version it read and insert the
# turn's receipt, one statement. The service knows the version from its cache; pgbench has no
# cache, so a subquery reads it in the same statement.
"${PSQL[@]}" -d anchor <<SQL
CREATE TABLE receipt (key text PRIMARY KEY, payload jsonb NOT NULL,
                      created_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX receipt_created_at ON receipt USING brin (created_at);
SQL
cat > "$WORK/own.sql" <<SQL
\set k random(1, $KEYS)
WITH written AS (UPDATE state SET state = jsonb_set(state, '{count}', to_jsonb(version + 1)), version = version + 1 WHERE key = 'c' || :k AND version = (SELECT version FROM state WHERE key = 'c' || :k) RETURNING version), receipt AS (INSERT INTO receipt (key, payload) SELECT 'counter/bench/conversations/run-c' || :k || '/activities/' || md5(random()::text), jsonb_build_object('activities', jsonb_build_array(jsonb_build_object('type', 'message', 'text', 'count: ' || version)), 'attempts', 1, 'version', version) FROM written) SELECT version FROM written;
SQL
cat > "$WORK/hot_own.sql" <<SQL
WITH written AS (UPDATE state SET state = jsonb_set(state, '{count}', to_jsonb(version + 1)), version = version + 1 WHERE key = 'c2' AND version = (SELECT version FROM state WHERE key = 'c2') RETURNING version), receipt AS (INSERT INTO receipt (key, payload) SELECT 'counter/bench/conversations/run-c2/activities/' || md5(random()::text), jsonb_build_object('activities', jsonb_build_array(jsonb_build_object('type', 'message', 'text', 'count: ' || version)), 'attempts', 1, 'version', version) FROM written) SELECT version FROM written;
SQL
cat > "$WORK/hot.sql" <<SQL
SELECT state, version FROM state WHERE key = 'c1' \gset
UPDATE state SET state = jsonb_set(:state::jsonb, '{count}', to_jsonb(:version + 1)), version = version + 1 WHERE key = 'c1' AND version = :version;
SQL

PGPID=$(head -n 1 "$WORK/data/postmaster.pid")
# What process PID and all its descendants have used so far, summed: `ticks`, CPU clock ticks (a
# postmaster's count every backend, the exited ones through its reaped-children times);
# `switches`, context switches of every thread (voluntary: it waited, for a wake-up, a lock or the
# disk; involuntary: the scheduler took its core), of the live processes only: one that exits
# takes its count with it, so a pool's backends are counted and pgbench's, which leave when it
# ends, are not.
tree_sum() {  # ticks|switches PID
    python3 - "$1" "$2" <<'PY'
import os, sys
what, root = sys.argv[1], int(sys.argv[2])
stats = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stats[int(pid)] = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
def switches(pid):
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in threads:
        try:
            for line in open(f"/proc/{pid}/task/{tid}/status"):
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total
own = switches if what == "switches" else lambda pid: sum(int(f) for f in stats[pid][11:15])
children = {}
for pid, fields in stats.items():
    children.setdefault(int(fields[1]), []).append(pid)
total, stack = 0, [root]
while stack:
    pid = stack.pop()
    if pid in stats:
        total += own(pid)
    stack.extend(children.get(pid, []))
print(total)
PY
}
tree_ticks() { tree_sum ticks "$1"; }

# The layout: which cores PostgreSQL and the clients run on; CLIENT is the prefix of every client.
NCPU=$(nproc)
CLIENT=()
layout() {  # split | shared
    local db=0-$((NCPU - 1)) pid
    CLIENT=()
    if [ "$1" = split ]; then
        db=0-$((NCPU / 2 - 1))
        CLIENT=(taskset -c "$((NCPU / 2))-$((NCPU - 1))")
    fi
    # New backends inherit the postmaster's affinity; the running ones are moved too.
    # A backend that exits meanwhile needs no moving.
    for pid in "$PGPID" $(ps -o pid= --ppid "$PGPID"); do
        if ! taskset -pc "$db" "$pid" >/dev/null 2>&1 && kill -0 "$pid" 2>/dev/null; then
            echo "cannot move PostgreSQL's process $pid to CPUs $db" >&2
            exit 1
        fi
    done
    LAYOUT=$1
}

# pgbench SCRIPT CLIENTS [DATABASE] -> "turns/s p99_ms pgbench_cpu_us_per_turn postgres_cpu_us_per_turn"
# (DATABASE: anchor, the anchor's own tables, unless named)
pgbench_run() {
    local script=$1 clients=$2 db=${3:-anchor} dir pg0 pg1
    dir=$(mktemp -d "$WORK/pgbench.XXXX")
    pg0=$(tree_ticks "$PGPID")
    (cd "$dir" && "${CLIENT[@]}" python3 -c 'import resource, subprocess, sys
code = subprocess.call(sys.argv[1:])
r = resource.getrusage(resource.RUSAGE_CHILDREN)
open("cpu", "w").write(str(r.ru_utime + r.ru_stime))
sys.exit(code)' pgbench -h 127.0.0.1 -p "$PORT" -U postgres -n -M prepared -f "$WORK/$script" \
        -c "$clients" -j 2 -T "$SECS" -l "$db" >/dev/null 2>"$dir/err") \
        || { cat "$dir/err" >&2; exit 1; }
    pg1=$(tree_ticks "$PGPID")
    python3 - "$dir" "$SECS" "$pg0" "$pg1" <<'PY'
import glob, sys
lat = []
for f in glob.glob(sys.argv[1] + "/pgbench_log.*"):
    for line in open(f):
        parts = line.split()
        if len(parts) >= 3:
            lat.append(int(parts[2]) / 1000.0)
lat.sort()
p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
n = max(len(lat), 1)
client = float(open(sys.argv[1] + "/cpu").read()) * 1e6 / n
server = (int(sys.argv[4]) - int(sys.argv[3])) / 100 * 1e6 / n
print(f"{len(lat) / float(sys.argv[2]):.0f} {p99:.2f} {client:.0f} {server:.0f}")
PY
}

# --- the service ---------------------------------------------------------------------------------
SERVE_ARGS=()  # further `turnstile serve` options
SERVER=${SERVER:-}  # the server binary; empty: this build's
start_servers() {  # N [metrics] -> sets TARGETS, and METRICS_URLS with "metrics"
    local n=$1 i port mport metrics=()
    TARGETS=""
    METRICS_URLS=()
    CPU_OF=(--cpu-of "postgres=$PGPID")
    for i in $(seq 1 "$n"); do
        port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        if [ "${2:-}" = metrics ]; then
            mport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
            metrics=(--metrics-listen "127.0.0.1:$mport")
            METRICS_URLS+=("http://127.0.0.1:$mport/metrics")
        fi
        # As shipped: the default log filter (`info`), unless the caller exports RUST_LOG.
        "${CLIENT[@]}" "${SERVER:-$BIN/turnstile}" serve --listen "127.0.0.1:$port" \
            --database-url "postgres://postgres@127.0.0.1:$PORT/service" "${metrics[@]}" "${SERVE_ARGS[@]}" \
            >>"$WORK/service.log" 2>&1 &
        PIDS+=($!)
        CPU_OF+=(--cpu-of "server$i=$!")
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
# What runs between a prefill and the measured turns. The server made its statements' plans
# while its tables were empty (each round starts on emptied ones), and keeps them until their
# statistics change: a plan for a table of ten pages scans 10,000 conversations' rows for every
# batch of commits. A running service has them remade within a minute or so of its start, when
# autovacuum first analyzes the table; the measured seconds come sooner, so ANALYZE does it here
# (the anchor's table is analyzed when made). bench/RESULTS.md, 2026-11-29 03:35.
AFTER_PREFILL="psql -h 127.0.0.1 -p $PORT -U postgres -d service -qc 'ANALYZE turnstile.turnstile_state'"
# bench ARGS... -> JSON on stdout (with --prefill, AFTER_PREFILL runs before the measured turns)
bench() {
    local after=()
    case " $* " in *" --prefill "*) after=(--after-prefill "$AFTER_PREFILL") ;; esac
    "${CLIENT[@]}" "$BIN/turnstile-bench" --target "$TARGETS" --duration "${BENCH_SECS:-$SECS}" --warmup "$WARMUP" \
        --state-bytes "$PAD" --json "${CPU_OF[@]}" "${after[@]}" "$@"
}
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr); $(date -u +%Y-%m-%dT%H:%MZ)"
FLUSH_MS=$(WORK_DIR=$WORK python3 -c '
import os, time
fd = os.open(os.path.join(os.environ["WORK_DIR"], "flush.probe"), os.O_WRONLY | os.O_CREAT | os.O_DSYNC, 0o600)
started = time.perf_counter()
for _ in range(100): os.pwrite(fd, bytes(8192), 0)
print(f"{(time.perf_counter() - started) * 10:.2f}")
os.close(fd)' )
echo "PostgreSQL $("$PGBIN/postgres" --version | awk '{print $3}'), ${PG_OPTIONS:-default settings}, locale ${PG_LOCALE:-C}; $KEYS keys, ~$PAD-byte state; ${SECS}s per run; one 8 KiB flush to disk ${FLUSH_MS} ms"
echo

cpu_of() { echo "$1" | field '", ".join(f"{k} {v:.0f}" for k, v in d["cpu_us_per_turn"].items())'; }

# One round of the uniform workload: pgbench, then the service, back to back.
# CONVERSATIONS and RUN_ID (both or neither): the service continues that many conversations of that
# run, already in the database (bench/pg.sh's seed_conversations), instead of creating KEYS new ones.
round_of() {  # CONCURRENCY -> sets TPS P99 CLIENT_CPU PG_CPU JSON STPS SP99
    read -r TPS P99 CLIENT_CPU PG_CPU <<<"$(pgbench_run turn.sql "$1")"
    start_servers 1
    if [ -n "${RUN_ID:-}" ]; then
        JSON=$(bench --conversations "$CONVERSATIONS" --run-id "$RUN_ID" --no-verify --concurrency "$1")
    else
        JSON=$(bench --conversations "$KEYS" --concurrency "$1" --prefill)
    fi
    stop_servers
    STPS=$(echo "$JSON" | field 'round(d["turns_per_second"])')
    SP99=$(echo "$JSON" | field 'round(d["latency_ms"]["p99"], 2)')
}

# The machine's speed drifts by as much as 2x within minutes, so one pgbench run and one service
# run minutes apart can disagree by that much for no reason of their own. Each workload is
# therefore run in ROUNDS rounds, pgbench and the service back to back in each, and the round
# with the median throughput ratio is the result.
uniform() {  # CONCURRENCY [own] -- "own" also runs pgbench on the service's own commit statement
    local c=$1 r rounds=() otps op99 oclient opg best
    echo "${CONVERSATIONS:-$KEYS} conversations, $c concurrent, $LAYOUT cores:"
    for r in $(seq 1 "$ROUNDS"); do
        round_of "$c"
        echo "  round $r: service $STPS turns/s p99 $SP99 ms; pgbench $TPS turns/s p99 $P99 ms; ratios $(python3 -c "print(f'{$STPS/$TPS:.2f}, p99 {$SP99/$P99:.2f}')"); peak RSS $((PEAK_KB / 1024)) MiB"
        echo "    CPU µs per turn: service run: $(cpu_of "$JSON"); pgbench run: pgbench $CLIENT_CPU, postgres $PG_CPU"
        echo "    attempts $(echo "$JSON" | field 'd["attempts"]'), statuses $(echo "$JSON" | field 'd["statuses"]'), check $(echo "$JSON" | field 'd["verification"]')"
        rounds+=("$STPS $TPS $SP99 $P99")
    done
    read -r MED_S MED_T MED_SP MED_P <<<"$(printf '%s\n' "${rounds[@]}" | python3 -c '
import sys
rounds = [tuple(map(float, l.split())) for l in sys.stdin if l.strip()]
rounds.sort(key=lambda r: r[0] / r[1])
print(*rounds[len(rounds) // 2])')"
    best=$(python3 -c "s, t, sp, p = $MED_S, $MED_T, $MED_SP, $MED_P
print(f'throughput ratio {s/t:.2f} (service {s:.0f} turns/s, pgbench {t:.0f}); p99 ratio {sp/p:.2f} (service {sp} ms, pgbench {p} ms)')")
    if [ "${2:-}" = own ]; then
        read -r otps op99 oclient opg <<<"$(pgbench_run own.sql "$c")"
        echo "  pgbench running the service's own commit statement: $otps turns/s p99 $op99 ms (CPU µs per turn: pgbench $oclient, postgres $opg)"
    fi
    LINE=$best
    echo "  median round: $LINE"
}

hot() {  # REPLICAS
    local n=$1 json runs
    start_servers "$n" metrics
    json=$(bench --conversations 1 --hot-share 1 --concurrency 64)
    runs=$(server_runs)
    stop_servers
    HOT_TPS=$(echo "$json" | field 'd["turns_per_second"]')
    HOT_P99=$(echo "$json" | field 'd["latency_ms"]["p99"]')
    echo "1 hot conversation, 64 concurrent, $n replica(s), $LAYOUT cores: $(echo "$json" | field 'round(d["turns_per_second"])') turns/s, p99 $(echo "$json" | field 'round(d["latency_ms"]["p99"], 2)') ms; attempts $(echo "$json" | field 'd["attempts"]'); statuses $(echo "$json" | field 'd["statuses"]'); check $(echo "$json" | field 'd["verification"]'); peak RSS $((PEAK_KB / 1024)) MiB"
    echo "  CPU µs per turn: $(cpu_of "$json"); $(echo "$json" | field "f'{d[\"turns_per_second\"] / $HOT_ANCHOR:.2f}'") of one commit per round trip"
    echo "  $runs"
}

# runs_per_turn JSON -> "runs per committed turn, committed, other statuses"
runs_per_turn() {
    echo "$1" | field '(lambda a, s: f"{sum(int(k) * v for k, v in a.items()) / max(sum(a.values()), 1):.2f} runs per committed turn ({sum(a.values())} committed; attempts {a}; statuses {s})")(d["attempts"], d["statuses"])'
}

# Hot conversations: one replica against three in the same run, then the slow bot's wasted runs.
hot_conversations() {  # LABEL -- SERVER/SERVE_ARGS set by the caller
    local one_tps one_p99 json
    hot 1
    one_tps=$HOT_TPS; one_p99=$HOT_P99
    hot 3
    echo "  $1: three replicas / one: throughput $(python3 -c "print(f'{$HOT_TPS/$one_tps:.2f}')"), p99 $(python3 -c "print(f'{$HOT_P99/$one_p99:.2f}')")"
}
# server_runs -> "R runs for C committed turns (F failed: outcomes), per replica ..." from every
# server's own counters, warm-up included: the load generator sees only the calls it measured,
# and not the runs of a turn that failed and that it then sent again.
server_runs() {
    local url
    for url in "${METRICS_URLS[@]}"; do curl -s "$url"; echo "# end of replica"; done | python3 -c '
import re, sys
replicas, cur = [], {"runs": 0, "committed": 0, "failed": {}, "holds": 0, "loads": 0}
for line in sys.stdin:
    if line.startswith("# end of replica"):
        replicas.append(cur); cur = {"runs": 0, "committed": 0, "failed": {}, "holds": 0, "loads": 0}; continue
    m = re.match(r"turnstile_store_duration_seconds_count\{op=\"load\"\} (\S+)", line)
    if m: cur["loads"] += float(m.group(1))
    m = re.match(r"turnstile_turn_attempts_sum (\S+)", line)
    if m: cur["runs"] += float(m.group(1))
    m = re.match(r"turnstile_lock_waits_total\{outcome=\"granted\"\} (\S+)", line)
    if m: cur["holds"] += float(m.group(1))
    m = re.match(r"turnstile_turns_total\{outcome=\"(\w+)\"\} (\S+)", line)
    if m and m.group(1) == "committed": cur["committed"] += float(m.group(2))
    elif m and m.group(1) in ("aborted", "deadline_exceeded", "unavailable", "failed") and float(m.group(2)):
        cur["failed"][m.group(1)] = cur["failed"].get(m.group(1), 0) + int(float(m.group(2)))
runs = sum(r["runs"] for r in replicas); committed = sum(r["committed"] for r in replicas)
failed = {}
for r in replicas:
    for k, v in r["failed"].items(): failed[k] = failed.get(k, 0) + v
per_replica = [int(r["committed"]) for r in replicas]
holds = sum(r["holds"] for r in replicas); loads = sum(r["loads"] for r in replicas)
print(f"servers: {runs / max(committed, 1):.2f} runs per committed turn ({int(runs)} runs, {int(committed)} committed, failed {failed or 0}; committed per replica {per_replica}); {holds / max(committed, 1):.2f} conversation locks or leases and {loads / max(committed, 1):.2f} loads per committed turn")'
}
slow_bot() {  # LABEL -- SERVER/SERVE_ARGS set by the caller
    local json runs
    start_servers 3 metrics
    # One connection per replica, so that the 8 calls spread over all three (3, 3, 2).
    json=$(bench --bot slow --conversations 1 --hot-share 1 --concurrency 8 --connections 1)
    runs=$(server_runs)
    stop_servers
    echo "slow bot (200 ms per run), 1 conversation, 8 concurrent, 3 replicas, $1: $(echo "$json" | field 'round(d["turns_per_second"], 1)') turns/s, p99 $(echo "$json" | field 'round(d["latency_ms"]["p99"])') ms; $runs; load generator: $(runs_per_turn "$json"); check $(echo "$json" | field 'd["verification"]')"
}

[ "$NCPU" -ge 2 ] || { echo "the split layout needs at least 2 cores" >&2; exit 1; }
if [ "$CARD" = 1 ]; then
    . bench/pg.sh  # seed_conversations
    . bench/card.sh
    exit 0
fi
if [ "$HOT" = 1 ]; then
    layout shared
    read -r htps hp99 _ _ <<<"$(pgbench_run hot_own.sql 1)"
    echo "pgbench, 1 client on 1 key (the service's commit statement: one commit per round trip), $LAYOUT cores: $htps turns/s, p99 $hp99 ms"
    HOT_ANCHOR=$htps
    hot_conversations "this build"
    SERVE_ARGS=(--slow-bot-delay-ms 200)
    slow_bot "optimistic"
    SERVE_ARGS=(--slow-bot-delay-ms 200 --serialized-bots slow)
    slow_bot "serialized"
    if [ -n "${TURNSTILE_BEFORE:-}" ]; then
        SERVER=$TURNSTILE_BEFORE; SERVE_ARGS=()
        echo "served by $TURNSTILE_BEFORE:"
        hot_conversations "$TURNSTILE_BEFORE"
        SERVE_ARGS=(--slow-bot-delay-ms 200)
        slow_bot "$TURNSTILE_BEFORE"
        SERVER=""
    fi
    exit 0
fi
if [ "$SOAK" = 1 ]; then
    layout shared
    start_servers 1
    server=${PIDS[0]}
    (
        start=$(date +%s)
        while kill -0 "$server" 2>/dev/null; do
            echo "$(($(date +%s) - start)) $(awk '/VmRSS/ {print $2}' "/proc/$server/status" 2>/dev/null)"
            sleep 30
        done
    ) >"$WORK/rss" &
    json=$(bench --conversations "$KEYS" --concurrency 32 --prefill)
    stop_servers
    echo "soak: $KEYS conversations, 32 concurrent, $SECS s: $(echo "$json" | field 'round(d["turns_per_second"])') turns/s, p99 $(echo "$json" | field 'round(d["latency_ms"]["p99"], 2)') ms; statuses $(echo "$json" | field 'd["statuses"]'); check $(echo "$json" | field 'd["verification"]')"
    echo "server resident memory (s: MiB): $(awk 'NF == 2 {printf "%s%d: %.1f", sep, $1, $2 / 1024; sep = ", "}' "$WORK/rss"); peak $((PEAK_KB / 1024)) MiB"
    exit 0
fi
if [ "$QUICK" = 1 ]; then
    layout "${QUICK_LAYOUT:-split}"
    uniform "${QUICK_CALLS:-32}"
    echo "$LINE"
    exit 0
fi
if [ "$UNPREPARED" = 1 ]; then
    # What a transaction-mode pooler's setting costs: each statement parsed and planned per call.
    layout split
    echo "$KEYS conversations, 32 concurrent, $LAYOUT cores, prepared statements on then off:"
    ratios=()
    for r in $(seq 1 "$ROUNDS"); do
        line=""
        for prepared in true false; do
            SERVE_ARGS=(--prepared-statements "$prepared")
            start_servers 1
            JSON=$(bench --conversations "$KEYS" --concurrency 32 --prefill)
            stop_servers
            tps=$(echo "$JSON" | field 'round(d["turns_per_second"])')
            p99=$(echo "$JSON" | field 'round(d["latency_ms"]["p99"], 2)')
            line="$line prepared=$prepared $tps turns/s p99 $p99 ms ($(cpu_of "$JSON") µs CPU/turn), check $(echo "$JSON" | field 'd["verification"]');"
            [ "$prepared" = true ] && on=$tps || off=$tps
        done
        ratio=$(python3 -c "print(f'{$off/$on:.2f}')")
        ratios+=("$ratio")
        echo "  round $r:$line unprepared/prepared $ratio"
    done
    echo "median unprepared/prepared throughput: $(printf '%s\n' "${ratios[@]}" | sort -n | sed -n "$(( (ROUNDS + 1) / 2 ))p")"
    exit 0
fi
if [ "$WORKERS" = 1 ]; then
    # The same counter bot in process (`counter`) and as a Python bot worker (`counter-py`), both
    # hosted by one server, driven back to back in each round: the difference is the worker hop
    # (a gRPC call, JSON both ways, the Python SDK). The worker runs on the clients' cores.
    PYDEPS=$PWD/target/tools/python-worker-grpcio-1.76.0  # what tests/workers.rs installs
    if [ ! -d "$PYDEPS" ]; then
        python3 -m pip install --quiet --disable-pip-version-check --target "$PYDEPS.partial" \
            grpcio==1.76.0 grpcio-tools==1.76.0 && mv "$PYDEPS.partial" "$PYDEPS"
    fi
    layout split
    echo "$KEYS conversations, 32 concurrent, $LAYOUT cores: counter in process, then as a Python worker:"
    ratios=()
    for r in $(seq 1 "$ROUNDS"); do
        wport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        PYTHONPATH="$PYDEPS:$PWD/sdk/python" "${CLIENT[@]}" python3 sdk/python/examples/counter.py \
            "127.0.0.1:$wport" >>"$WORK/worker.log" 2>&1 &
        wpid=$!
        for _ in $(seq 1 300); do
            (exec 3<>"/dev/tcp/127.0.0.1/$wport") 2>/dev/null && break
            sleep 0.1
        done
        SERVE_ARGS=(--remote-bot "counter-py=http://127.0.0.1:$wport")
        start_servers 1
        PIDS+=("$wpid")
        CPU_OF+=(--cpu-of "worker=$wpid")
        line=""
        for bot in counter counter-py; do
            JSON=$(bench --conversations "$KEYS" --concurrency 32 --prefill --bot "$bot")
            tps=$(echo "$JSON" | field 'round(d["turns_per_second"])')
            p50=$(echo "$JSON" | field 'round(d["latency_ms"]["p50"], 3)')
            p99=$(echo "$JSON" | field 'round(d["latency_ms"]["p99"], 2)')
            line="$line $bot $tps turns/s p50 $p50 ms p99 $p99 ms ($(cpu_of "$JSON") µs CPU/turn), check $(echo "$JSON" | field 'd["verification"]');"
            [ "$bot" = counter ] && { itps=$tps; ip50=$p50; ip99=$p99; } || { wtps=$tps; wp50=$p50; wp99=$p99; }
        done
        # One call at a time: the latencies without queueing, so the difference is the hop alone.
        for bot in counter counter-py; do
            JSON=$(BENCH_SECS=4 bench --conversations "$KEYS" --concurrency 1 --bot "$bot" --no-verify)
            p50=$(echo "$JSON" | field 'round(d["latency_ms"]["p50"], 3)')
            line="$line $bot alone p50 $p50 ms;"
            [ "$bot" = counter ] && i1=$p50 || w1=$p50
        done
        stop_servers
        echo "  round $r:$line"
        ratios+=("$(python3 -c "print(f'{$wtps/$itps:.3f} $itps $wtps $ip50 $wp50 $ip99 $wp99 $i1 $w1')")")
    done
    printf '%s\n' "${ratios[@]}" | sort -n | sed -n "$(( (ROUNDS + 1) / 2 ))p" | python3 -c '
import sys
r, itps, wtps, ip50, wp50, ip99, wp99, i1, w1 = map(float, sys.stdin.read().split())
print(f"median round: worker/in-process throughput {r:.2f} ({wtps:.0f} vs {itps:.0f} turns/s); "
      f"p99 {wp99} vs {ip99} ms; p50 {wp50} vs {ip50} ms; the hop at p50, one call at a time: "
      f"{w1 - i1:.3f} ms ({w1} vs {i1} ms)")'
    exit 0
fi
layout shared
uniform 8
uniform 32 own
read -r htps hp99 _ _ <<<"$(pgbench_run hot.sql 1)"
echo "pgbench, 1 client on 1 key (naive SQL, serialized), $LAYOUT cores: $htps turns/s, p99 $hp99 ms"
read -r htps hp99 _ _ <<<"$(pgbench_run hot_own.sql 1)"
echo "pgbench, 1 client on 1 key (the service's commit statement: one commit per round trip), $LAYOUT cores: $htps turns/s, p99 $hp99 ms"
HOT_ANCHOR=$htps
hot 1
hot 3
layout split
uniform 8
uniform 32 own
echo "$LINE"
