# The load card: `bench/run.sh --card` sources this after setting up its cluster and functions
# (layout, uniform, start_servers, bench, pgbench_run, tree_ticks); it is not run on its own.
#
# It measures the product as shipped (the release server with its default settings, RUST_LOG
# unset) and writes bench/CARD.md with its plots in bench/card/ (bench/drivers/card.py draws them
# with matplotlib). About 40 minutes after the build with the defaults below; each part can be
# narrowed by its variable, and an empty list skips it:
#
#   CARD_STATES="256 8192 65536"              state sizes, in bytes: throughput and p99 against
#                                             pgbench's naive SQL at 32 calls, both layouts
#   CARD_CONVERSATIONS="10000 1000000 10000000"  conversations (256-byte states, created in the
#                                             database), the service against pgbench at each, and
#                                             pgbench alone over the same rows
#   CARD_LOADS="50 80 100"                    open-loop offered loads, % of the open loop's own maximum
#                                             (k6 against the service, then pgbench alone at
#                                             shares of its own maximum and at the service's rates)
#   CARD_RECEIPTS="50000000"                  receipt backlogs to add, rows, after a run with none
#   CARD_INSTRUCTIONS=0                       skips the instruction counts (bench/instructions.sh)
#   CARD_OPEN_LAYOUT=shared                   the open loop's cores: "shared", everything on every
#                                             core; "apart", PostgreSQL and the server on one half,
#                                             k6 on the other (the client's CPU then cannot delay
#                                             the service's answers, but the service has half the
#                                             machine)
#   CARD_OPEN_VUS=32                          k6's callers made before an open-loop run starts (its
#                                             preAllocatedVUs; up to 1,024 in all)
#   CARD_OUT=DIR                              writes DIR/CARD.md and DIR/card/ instead of bench/'s
#                                             (a trial that should not replace the card)
#
# Every throughput is a ratio against pgbench in the same round (bench/run.sh's rounds, median of
# ROUNDS), so the machine's drift between parts does not move the card's comparisons.

CARD_STATES=${CARD_STATES-256 8192 65536}
CARD_CONVERSATIONS=${CARD_CONVERSATIONS-10000 1000000 10000000}
CARD_LOADS=${CARD_LOADS-50 80 100}
CARD_RECEIPTS=${CARD_RECEIPTS-50000000}
CARD_OPEN_LAYOUT=${CARD_OPEN_LAYOUT:-shared}
CARD_OUT=${CARD_OUT:-$PWD/bench}
CARD_DIR=$CARD_OUT/card
DATA=$WORK/card.jsonl
SERVICE_URL="postgres://postgres@127.0.0.1:$PORT/service"
. bench/tools.sh
K6=$(k6_bin)
PLOT_PATH=$(plot_python)
mkdir -p "$CARD_DIR"
: >"$DATA"

record() {  # JSON: one result, a line of $DATA
    echo "$1" >>"$DATA"
}
sql() { psql "$SERVICE_URL" -v ON_ERROR_STOP=1 -qAt -c "$1"; }

# --- what was measured, on what -------------------------------------------------------------------
"$BIN/turnstile" migrate --database-url "$SERVICE_URL" >/dev/null 2>&1
record "$(python3 - "$(git rev-parse --short HEAD)" "$(git status --porcelain | grep -vc '^??' || true)" \
    "$FLUSH_MS" "$("$PGBIN/postgres" --version)" "${PG_OPTIONS:-}" \
    "$(sql "SELECT string_agg(name || '=' || setting || coalesce(unit, ''), ' ' ORDER BY name) FROM pg_settings
            WHERE name IN ('shared_buffers', 'max_connections', 'synchronous_commit', 'fsync', 'wal_level',
                           'max_wal_size', 'checkpoint_timeout', 'work_mem', 'effective_cache_size',
                           'random_page_cost', 'jit', 'huge_pages', 'lc_collate')")" <<'PY'
import json, os, platform, sys
commit, dirty, flush, pg, options, settings = sys.argv[1:]
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
print(json.dumps({"kind": "meta", "commit": commit, "dirty_files": int(dirty), "cores": os.cpu_count(),
                  "cpu": model, "memory_gib": round(mem / 1048576), "kernel": platform.release(),
                  "postgres": pg, "pg_options": options, "pg_settings": settings,
                  "flush_ms": float(flush), "date": __import__("datetime").datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC")}))
PY
)"

# --- instructions per turn at the shipped defaults (bench/instructions.sh, its own clusters) ------
instructions() {  # LABEL ENV... -> records the count
    local label=$1 line
    shift
    line=$(env NO_BUILD=1 "$@" bash bench/instructions.sh 2>"$WORK/instructions.log" | tail -n 1) \
        || { cat "$WORK/instructions.log" >&2; exit 1; }
    echo "instructions, $label: $line"
    record "$(python3 - "$label" "$line" <<'PY'
import json, re, sys
turn, check = (int(n.replace(",", "")) for n in re.findall(r"[\d,]+", sys.argv[2].split(":", 1)[1])[:2])
print(json.dumps({"kind": "instructions", "label": sys.argv[1], "per_turn": turn, "health_check": check}))
PY
)"
}
if [ "${CARD_INSTRUCTIONS:-1}" != 0 ]; then
    instructions "warm, 1,000 conversations, turnstile-bench" CONVERSATIONS=1000
    instructions "warm, 1,000 conversations, k6" CONVERSATIONS=1000 CLIENT=k6
    instructions "cold, 1,000,000 conversations, turnstile-bench" CONVERSATIONS=1000000
fi

# --- state sizes: the service against pgbench, 32 calls, both layouts ------------------------------
for size in $CARD_STATES; do
    PAD=$size
    anchor_state "$size"
    for where in shared split; do
        sql "TRUNCATE turnstile.turnstile_state, turnstile.turnstile_receipt"
        layout "$where"
        uniform 32
        record "{\"kind\": \"state\", \"bytes\": $size, \"layout\": \"$where\", \"service_tps\": $MED_S, \"pgbench_tps\": $MED_T, \"service_p99_ms\": $MED_SP, \"pgbench_p99_ms\": $MED_P}"
    done
done
PAD=1024
anchor_state "$PAD"

# The disk's flushes during a run of SECS seconds, in the background (FLUSH_PROBE is its pid; wait
# for it, then $WORK/flush.json has them): 8 KiB written and fdatasync'd 20 times a second beside
# PostgreSQL's data, timed. A turn is answered once its commit's WAL is flushed, so a flush that
# stalls shows in every turn in flight; this says whether the disk stalled in this run.
flush_probe() {  # SECS
    python3 - "$WORK/flush.probe" "$1" >"$WORK/flush.json" <<'PY' &
import json, os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
block, times = os.urandom(8192), []
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    started = time.perf_counter()
    os.pwrite(fd, block, 0)
    os.fdatasync(fd)
    times.append((time.perf_counter() - started) * 1000)
    time.sleep(0.05)
times.sort()
at = lambda q: times[min(len(times) - 1, int(len(times) * q))]
print(json.dumps({"flushes": len(times), "p50": at(0.5), "p99": at(0.99), "max": times[-1],
                  "over_20ms": sum(t > 20 for t in times)}))
PY
    FLUSH_PROBE=$!
}

# What PostgreSQL's client backends did during a run of SECS seconds, in the background
# (WAITS_PROBE is its pid; wait for it, then $WORK/waits.json has it): pg_stat_activity sampled
# 50 times a second by one backend (itself not counted), each active backend counted under its
# wait event, or "CPU" when it waits for none (running, or runnable and waiting for a core). Each
# count is divided by the samples taken: the mean number of backends in that state. It says
# whether a run's commits waited for the WAL's flush, for a lock, or for a CPU.
waits_probe() {  # SECS
    psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -qAt -v ON_ERROR_STOP=1 >"$WORK/waits.json" 2>"$WORK/waits.err" <<SQL &
CREATE TEMP TABLE samples (event text);
DO \$\$
DECLARE
    stop timestamptz := clock_timestamp() + make_interval(secs => $1);
BEGIN
    WHILE clock_timestamp() < stop LOOP
        PERFORM pg_stat_clear_snapshot();
        INSERT INTO samples
        SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity
         WHERE state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid();
        INSERT INTO samples VALUES ('%samples');
        PERFORM pg_sleep(0.02);
    END LOOP;
END
\$\$;
SELECT coalesce(json_object_agg(event, round(n::numeric / (SELECT count(*) FROM samples WHERE event = '%samples'), 3)), '{}')
  FROM (SELECT event, count(*) AS n FROM samples WHERE event <> '%samples' GROUP BY event) AS counts;
SQL
    WAITS_PROBE=$!
}

# --- open loop: k6 at fixed arrival rates, shared layout -------------------------------------------
# The maximum is the open loop's own: the highest fixed rate k6 gets answered in full, found from
# k6's closed loop (32 callers) on the same server, so that the client's CPU, which competes with
# the server on this machine, is in every run.
k6_run() {  # MODE RATE SECONDS [KIND] -> records one run (KIND "probe": a search's, not on the card)
    local mode=$1 rate=$2 secs=$3 kind=${4:-$1} s0 s1 p0 p1 w0 w1 c0 c1 q0 q1 vus=32
    if [ "$mode" = open ]; then vus=${CARD_OPEN_VUS:-32}; fi
    s0=$(tree_ticks "$SERVER_PID"); p0=$(tree_ticks "$PGPID")
    c0=$(tree_sum switches "$SERVER_PID"); q0=$(tree_sum switches "$PGPID")
    w0=$(psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -qAt -c "SELECT pg_current_wal_lsn() - '0/0'")
    # The server's own view of the same turns: its turn-duration histogram, before and after.
    curl -s "${METRICS_URLS[0]}" >"$WORK/metrics.before"
    flush_probe "$secs"
    waits_probe "$secs"
    TARGET=$TARGETS PROTO_DIR=$PWD/proto MODE=$mode RATE=$rate DURATION=${secs}s VUS=$vus MAX_VUS=1024 \
        CONVERSATIONS=$KEYS PAD=$PAD RUN=$OPEN_RUN SUMMARY="$WORK/k6.json" \
        "${CLIENT[@]}" "$K6" run -q --no-usage-report bench/drivers/turns.k6.js >/dev/null 2>"$WORK/k6.log" \
        || { cat "$WORK/k6.log" >&2; exit 1; }
    wait "$FLUSH_PROBE"
    wait "$WAITS_PROBE" || { cat "$WORK/waits.err" >&2; exit 1; }
    s1=$(tree_ticks "$SERVER_PID"); p1=$(tree_ticks "$PGPID")
    c1=$(tree_sum switches "$SERVER_PID"); q1=$(tree_sum switches "$PGPID")
    w1=$(psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -qAt -c "SELECT pg_current_wal_lsn() - '0/0'")
    curl -s "${METRICS_URLS[0]}" >"$WORK/metrics.after"
    LINE=$(python3 - "$WORK/k6.json" "$mode" "$CARD_OPEN_LAYOUT" "$((s1 - s0))" "$((p1 - p0))" "$((w1 - w0))" "$NCPU" \
        "$WORK/metrics.before" "$WORK/metrics.after" "$WORK/flush.json" "$kind" "$((c1 - c0))" "$((q1 - q0))" "$WORK/waits.json" <<'PY'
import json, re, sys
d = json.load(open(sys.argv[1]))
d["disk_flush_ms"] = json.load(open(sys.argv[10]))
d["postgres_waits"] = json.loads(open(sys.argv[14]).read().strip() or "{}")
def buckets(path, metric, labels=""):
    """Counts by upper bound (seconds) of histogram `metric`'s series with `labels`, summed."""
    counts = {}
    for line in open(path):
        m = re.match(metric + r'_bucket\{(.*)le="([^"]+)".*\} (\S+)', line)
        if m and labels in m[1]:
            le = float("inf") if m[2] == "+Inf" else float(m[2])
            counts[le] = counts.get(le, 0) + float(m[3])
    return counts
def quantiles(metric, labels=""):
    before, after = buckets(sys.argv[8], metric, labels), buckets(sys.argv[9], metric, labels)
    run = sorted((le, after[le] - before.get(le, 0)) for le in after)
    return {"p50": quantile(run, 0.5), "p99": quantile(run, 0.99), "p99.9": quantile(run, 0.999)}, (run[-1][1] if run else 0)
def quantile(run, q):
    """As Prometheus's histogram_quantile: linear within the bucket the rank falls in."""
    total = run[-1][1] if run else 0
    rank, lower, below = q * total, 0.0, 0
    for le, cumulative in run:
        if cumulative >= rank and cumulative > below:
            if le == float("inf"):
                return lower * 1000
            return (lower + (le - lower) * (rank - below) / (cumulative - below)) * 1000
        lower, below = le, cumulative
    return None
d["server_latency_ms"], d["server_turns"] = quantiles("turnstile_turn_duration_seconds")
# The part of it that was the commit, PostgreSQL's round trip with the group commit's wait.
d["commit_latency_ms"], d["commits"] = quantiles("turnstile_store_duration_seconds", 'op="commit"')
d["layout"] = sys.argv[3]
server, postgres, wal, cores = (int(a) for a in sys.argv[4:8])
ok = d["by_code"].get("0", 0)
d.update(kind=sys.argv[11], ok=ok, ok_per_second=ok / d["seconds"],
         server_cpu_us_per_turn=server / 100 * 1e6 / max(ok, 1), postgres_cpu_us_per_turn=postgres / 100 * 1e6 / max(ok, 1),
         wal_bytes_per_turn=wal / max(ok, 1), cores=cores)
d["server_switches_per_turn"] = int(sys.argv[12]) / max(ok, 1)
d["postgres_switches_per_turn"] = int(sys.argv[13]) / max(ok, 1)
d["turns_per_server_core_second"] = 1e6 / max(d["server_cpu_us_per_turn"], 1e-9)
d["turns_per_postgres_core_second"] = 1e6 / max(d["postgres_cpu_us_per_turn"], 1e-9)
print(json.dumps(d))
PY
)
    record "$LINE"
    python3 - "$LINE" <<'PY'
import json, sys
d = json.loads(sys.argv[1]); l = d["latency_ms"]
print(f"k6 {d['mode']} {d['rate'] or ''}: {d['ok_per_second']:.0f} OK/s, p50 {l['p50']:.2f} p99 {l['p99']:.2f}"
      f" p99.9 {l['p99.9']:.2f} ms, by status {d['by_code']}, dropped {d['dropped_iterations']},"
      f" CPU µs/turn server {d['server_cpu_us_per_turn']:.0f} postgres {d['postgres_cpu_us_per_turn']:.0f},"
      f" WAL {d['wal_bytes_per_turn']:.0f} B/turn; the server's own p50 {d['server_latency_ms']['p50']}"
      f" p99 {d['server_latency_ms']['p99']} p99.9 {d['server_latency_ms']['p99.9']} ms"
      f" (its commits' p50 {d['commit_latency_ms']['p50']} p99 {d['commit_latency_ms']['p99']} p99.9 {d['commit_latency_ms']['p99.9']} ms);"
      f" disk flushes p50 {d['disk_flush_ms']['p50']:.2f} p99 {d['disk_flush_ms']['p99']:.2f} max {d['disk_flush_ms']['max']:.1f} ms")
PY
}
# The highest fixed rate RUNNER answers in full (MAX_RATE), searched for from half of CLOSED_MAX in
# steps of a tenth of it, 10 s at each rate: up while 98 % of the offered turns are answered and
# under 1 % of the sends cannot start on time, down from half while not. RUNNER RATE SECS KIND
# records a run and leaves its JSON in LINE.
fixed_rate_max() {  # RUNNER CLOSED_MAX
    local runner=$1 closed_max=$2 step rate
    step=$((closed_max / 10)); rate=$((closed_max / 2)); MAX_RATE=0
    while [ "$rate" -ge "$step" ] && [ "$rate" -le "$closed_max" ]; do
        "$runner" open "$rate" 10 probe
        if [ "$(echo "$LINE" | field "int(d['ok_per_second'] >= 0.98 * $rate and d['dropped_iterations'] <= 0.01 * $rate * 10)")" = 1 ]; then
            MAX_RATE=$rate; rate=$((rate + step))
        elif [ "$MAX_RATE" -gt 0 ]; then
            break
        else
            rate=$((rate - step))
        fi
    done
    [ "$MAX_RATE" -gt 0 ] || MAX_RATE=$step
}

# RUNNER's closed loop (15 s), its own fixed-rate maximum (recorded as kind MAX_KIND) and the
# CARD_LOADS shares of it (20 s each).
closed_then_loads() {  # RUNNER MAX_KIND
    local runner=$1 closed_max load
    "$runner" closed "" 15
    closed_max=$(echo "$LINE" | field 'round(d["ok_per_second"])')
    fixed_rate_max "$runner" "$closed_max"
    record "{\"kind\": \"$2\", \"rate\": $MAX_RATE, \"closed_max\": $closed_max}"
    for load in $CARD_LOADS; do
        "$runner" open "$((MAX_RATE * load / 100))" 20
    done
}

# PostgreSQL alone at fixed rates: pgbench with the naive per-turn SQL (the anchor, 32 clients) at
# RATE transactions a second (none: as fast as it goes, its closed loop), SECS seconds, records a
# run of kind "pgbench_KIND". Its latency is pgbench's own under --rate, counted from each
# transaction's scheduled start, so a stall shows in it as in k6's open loop; beside it the wait
# to start (the schedule lag: for a free client, or for pgbench's own thread to get a CPU) and the
# time from the start, PostgreSQL's round trip. A transaction pgbench could not start
# within a second of its schedule is skipped (--latency-limit), and counted as k6 counts sends it
# could not start ("dropped").
pgbench_at() {  # MODE RATE SECS [KIND]
    local mode=$1 rate=$2 secs=$3 kind=pgbench_${4:-$1} dir p0 p1 w0 w1 limit=()
    dir=$(mktemp -d "$WORK/pgbench.XXXX")
    [ "$mode" = open ] && limit=(--rate="$rate" --latency-limit=1000)
    p0=$(tree_ticks "$PGPID")
    w0=$(psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -qAt -c "SELECT pg_current_wal_lsn() - '0/0'")
    flush_probe "$secs"
    waits_probe "$secs"
    (cd "$dir" && "${CLIENT[@]}" pgbench -h 127.0.0.1 -p "$PORT" -U postgres -n -M prepared -f "$WORK/turn.sql" \
        -c 32 -j 2 -T "$secs" "${limit[@]}" -l anchor >"$dir/out" 2>"$dir/err") || { cat "$dir/err" >&2; exit 1; }
    wait "$FLUSH_PROBE"
    wait "$WAITS_PROBE" || { cat "$WORK/waits.err" >&2; exit 1; }
    p1=$(tree_ticks "$PGPID")
    w1=$(psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -qAt -c "SELECT pg_current_wal_lsn() - '0/0'")
    LINE=$(python3 - "$dir" "$secs" "$rate" "$kind" "$((p1 - p0))" "$((w1 - w0))" "$WORK/flush.json" "$CARD_OPEN_LAYOUT" "$WORK/waits.json" <<'PY'
import glob, json, sys
where, secs, rate, kind, pg, wal, flush, layout, waits = sys.argv[1:]
done, lag, ran, skipped = [], [], [], 0
# Each line: client, transaction, time (µs, from its scheduled start under --rate), script, epoch,
# µs, and under --rate the schedule lag (µs); a skipped transaction's time is "skipped".
for path in glob.glob(where + "/pgbench_log.*"):
    for line in open(path):
        f = line.split()
        if len(f) < 6:
            continue
        if f[2] == "skipped":
            skipped += 1
            continue
        done.append(int(f[2]) / 1000)
        lag.append(int(f[6]) / 1000 if len(f) > 6 else 0.0)
        ran.append(done[-1] - lag[-1])
done.sort(); lag.sort(); ran.sort()
at = lambda xs, q: xs[min(len(xs) - 1, int(len(xs) * q))] if xs else None
n = max(len(done), 1)
print(json.dumps({
    "kind": kind, "mode": "closed" if not rate else "open", "rate": int(rate) if rate else None, "layout": layout,
    "seconds": float(secs), "ok": len(done), "ok_per_second": len(done) / float(secs), "dropped_iterations": skipped,
    "latency_ms": {k: at(done, q) for k, q in (("p50", .5), ("p90", .9), ("p99", .99), ("p99.9", .999))},
    "schedule_lag_ms": {k: at(lag, q) for k, q in (("p50", .5), ("p99", .99), ("p99.9", .999))},
    "from_start_ms": {k: at(ran, q) for k, q in (("p50", .5), ("p99", .99), ("p99.9", .999))},
    "postgres_cpu_us_per_turn": int(pg) / 100 * 1e6 / n, "wal_bytes_per_turn": int(wal) / n,
    "disk_flush_ms": json.load(open(flush)),
    "postgres_waits": json.loads(open(waits).read().strip() or "{}"),
}))
PY
)
    record "$LINE"
    echo "$LINE" | field "f\"pgbench {d['mode']} {d['rate'] or ''}: {d['ok_per_second']:.0f}/s, p50 {d['latency_ms']['p50']:.2f} p99 {d['latency_ms']['p99']:.2f} p99.9 {d['latency_ms']['p99.9']:.2f} ms (schedule lag p99.9 {d['schedule_lag_ms']['p99.9']:.2f}), skipped {d['dropped_iterations']}, disk flushes p99 {d['disk_flush_ms']['p99']:.2f} max {d['disk_flush_ms']['max']:.1f} ms\""
}

open_loop() {
    sql "TRUNCATE turnstile.turnstile_state, turnstile.turnstile_receipt"
    if [ "$CARD_OPEN_LAYOUT" = apart ]; then
        # The split layout's halves: PostgreSQL on the first, and the server beside it; k6 (the
        # clients') on the second.
        layout split
        local clients=("${CLIENT[@]}")
        CLIENT=(taskset -c "0-$((NCPU / 2 - 1))")
        start_servers 1 metrics
        CLIENT=("${clients[@]}")
    else
        layout shared
        start_servers 1 metrics
    fi
    OPEN_RUN=$(printf '%08x' $((RANDOM * 32768 + RANDOM)))
    "$BIN/turnstile-bench" --target "$TARGETS" --conversations "$KEYS" --state-bytes "$PAD" \
        --run-id "$OPEN_RUN" --prefill --turns 1000 --no-verify --after-prefill "$AFTER_PREFILL" >/dev/null
    SERVER_PID=${PIDS[0]}
    # The open loop's own maximum. A turn costs more CPU at a fixed rate than with 32 callers
    # always waiting (the group commit gathers fewer commits into each statement and flush,
    # bench/RESULTS.md), so the closed loop's maximum can be past what is answered at a fixed
    # rate, and a run "at 80 %" of it measured a queue.
    closed_then_loads k6_run open_max
    local service_max=$MAX_RATE load
    stop_servers
    # PostgreSQL alone, the same way: its own maximum and the same shares of it.
    closed_then_loads pgbench_at pgbench_open_max
    # And at the rates the service was offered, the anchor of the open-loop target: what this
    # machine's database and cores give the same turns a second with no service in front. (At a
    # share of its own maximum, which is several times the service's, it may be queueing: a p50 of
    # hundreds of milliseconds, whose p99.9 is then a small multiple of it.)
    for load in $CARD_LOADS; do
        pgbench_at open "$((service_max * load / 100))" 20 at_service_rate
    done
}
[ -z "$CARD_LOADS" ] || open_loop

# --- conversations: 256-byte states created in the database, the service against pgbench ----------
# PostgreSQL alone over the same rows: pgbench's naive SQL on the service's own N conversations'
# rows (turnstile_state, its indexes, fillfactor and all), back to back with the 10,000-key anchor
# in each of ROUNDS rounds; ROWS is the median round's JSON. How far its ratio to the anchor falls
# from 10,000 conversations to N is the database's own part of the service's fall: a turn whose
# conversation no replica has cached reads its row first, as the naive SQL always does.
same_rows() {  # N -> sets ROWS
    local n=$1 r a b rounds=()
    cat >"$WORK/rows.sql" <<SQL
\set k random(0, $((n - 1)))
SELECT state, version FROM turnstile.turnstile_state WHERE key = 'counter/bench/conversations/card-c' || :k \gset
UPDATE turnstile.turnstile_state SET state = jsonb_set(:state::jsonb, '{count}', to_jsonb(:version + 1)), version = version + 1 WHERE key = 'counter/bench/conversations/card-c' || :k AND version = :version;
SQL
    for r in $(seq 1 "$ROUNDS"); do
        a=$(pgbench_run turn.sql 32)
        b=$(pgbench_run rows.sql 32 service)
        echo "  PostgreSQL alone, round $r: pgbench over these $n rows $b, over the anchor's 10,000 $a (turns/s p99_ms pgbench_cpu_us postgres_cpu_us)"
        rounds+=("$b $a")
    done
    ROWS=$(printf '%s\n' "${rounds[@]}" | python3 -c 'import json, sys
rounds = sorted((list(map(float, l.split())) for l in sys.stdin if l.strip()), key=lambda r: r[0] / r[4])
t, p99, _, pg, at, ap99, _, apg = rounds[len(rounds) // 2]
print(json.dumps({"tps": t, "p99_ms": p99, "postgres_cpu_us": pg, "anchor_tps": at, "anchor_postgres_cpu_us": apg}))')
    echo "  PostgreSQL alone, median round: $ROWS"
}
PAD=256
anchor_state "$PAD"
sql "TRUNCATE turnstile.turnstile_state, turnstile.turnstile_receipt"
layout shared
seeded=0
for n in $CARD_CONVERSATIONS; do
    started=$(date +%s)
    seed_conversations "$SERVICE_URL" card "$seeded" "$n" "$PAD"
    seeded=$n
    echo "$n conversations in the database ($(($(date +%s) - started)) s to add them)"
    CONVERSATIONS=$n RUN_ID=card uniform 32
    same_rows "$n"
    record "{\"kind\": \"conversations\", \"conversations\": $n, \"bytes\": $PAD, \"service_tps\": $MED_S, \"pgbench_tps\": $MED_T, \"service_p99_ms\": $MED_SP, \"pgbench_p99_ms\": $MED_P, \"table_bytes\": $(sql "SELECT pg_total_relation_size('turnstile.turnstile_state')"), \"rows\": $ROWS}"
done
PAD=1024
anchor_state "$PAD"

# --- a receipt backlog: none, then CARD_RECEIPTS more rows, 10,000 conversations of 1 KiB ----------
sql "TRUNCATE turnstile.turnstile_state, turnstile.turnstile_receipt"
backlog() {
    uniform 32
    record "{\"kind\": \"receipts\", \"rows\": $(sql "SELECT count(*) FROM turnstile.turnstile_receipt"), \"service_tps\": $MED_S, \"pgbench_tps\": $MED_T, \"service_p99_ms\": $MED_SP, \"pgbench_p99_ms\": $MED_P}"
}
backlog
for rows in $CARD_RECEIPTS; do
    started=$(date +%s)
    # Receipts as turns write them (a reply, its conversation and user), in the slot being
    # written, 500 to a conversation, a million per statement; every key in ascending order, as
    # time-ordered activity ids would be, so that each index grows at its end.
    for ((start = 0; start < rows; start += 1000000)); do
        psql "$SERVICE_URL" -v ON_ERROR_STOP=1 -q <<SQL
INSERT INTO turnstile.turnstile_receipt (key, payload)
SELECT 'counter/bench/conversations/backlog-c' || lpad((i / 500)::text, 8, '0') || '/activities/' || lpad(i::text, 10, '0'),
       jsonb_build_object('user', 'bench/user-' || lpad((i / 500)::text, 8, '0'), 'version', 1, 'attempts', 1,
                          'activities', jsonb_build_array(jsonb_build_object(
                              'type', 'message', 'text', 'count: 1', 'channelId', 'bench',
                              'from', jsonb_build_object('id', 'bot'),
                              'recipient', jsonb_build_object('id', 'user-' || (i / 500)))))
  FROM generate_series($start, least($start + 1000000, $rows) - 1) AS i;
SQL
    done
    sql "VACUUM ANALYZE turnstile.turnstile_receipt"
    echo "$rows receipts added ($(($(date +%s) - started)) s)"
    backlog
done

# --- the card ------------------------------------------------------------------------------------
PYTHONPATH=$PLOT_PATH python3 bench/drivers/card.py "$DATA" "$CARD_OUT/CARD.md" "$CARD_DIR"
cp "$DATA" "$CARD_DIR/card.jsonl"
echo "wrote $CARD_OUT/CARD.md and $CARD_DIR/"
