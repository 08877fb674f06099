#!/usr/bin/env bash
# Receipt storage under a steady load: the receipt-retention issue's target "Receipt storage is
# flat (±10 %) from one retention window to three, under a steady maximum-rate load (compress
# time: e.g. a 2-minute retention over 8 minutes). A partition drop moves turn p99 by at most 5 %."
#
#   bench/receipts.sh                      a 120 s retention, 480 s of load: ~9 min after the build
#   RETENTION=S DURATION=S bench/receipts.sh   other times (DURATION a few retentions at least)
#   CALLS=N bench/receipts.sh              calls in flight (32), CHUNK=S chunks of load (10)
#   NO_BUILD=1 bench/receipts.sh           measures target/release as it is (BIN=DIR: another build)
#   KEEP=1 bench/receipts.sh               keeps the scratch directory (logs, raw samples)
#
# The workload: the release server as shipped (RUST_LOG unset, default settings) with
# `--receipt-retention-secs RETENTION`, on a throwaway PostgreSQL cluster (bench/pg.sh). The
# receipts are four slots of `turnstile_receipt`, each half a retention wide and emptied whole
# (detached concurrently, truncated, attached again) once all of it is past the retention
# (migrations/V5__receipt_slots.sql): storage should swing between about one and one and a half
# retentions' worth with the 2-slot cycle, and not grow.
#
# turnstile-bench drives the `counter` bot at its maximum rate (CALLS closed-loop callers, 10,000
# conversations, 1 KiB of state each) in consecutive CHUNK-second runs, each a process of its own
# with its own p50/p99/throughput; every activity id is new (each process tags its ids with a
# random tag of its own), so every turn writes a receipt: `redelivered` stays 0 and count(*)
# rises. Meanwhile psql samples, every 5 s, the bytes (pg_total_relation_size) and rows
# (count(*)) of turnstile_receipt_0..3 and turnstile_receipt_legacy; and, every 0.5 s, each
# slot's relfilenode and whether it is attached, which dates its detaches and truncations.
#
# Reported (bench/drivers/receipts.py, Python's standard library): the turns and receipts per
# second; storage at the end of each retention window (the sample nearest), window 3 against
# window 1 (the same phase of the slot cycle: windows are two slots long) and 4 against 2, and
# the band after 1.5 retentions, in bytes, rows and retentions' worth (rows against what the
# retention before wrote: the load's rate drifts on a shared machine); each slot operation; and
# the median p99 of the chunks during which a slot was detached/truncated/attached against that
# of the chunks without (those after the first retention), and against each one's neighbours.
# Window 1 holds exactly one retention (nothing is past it yet) while a later window's end holds
# one to one and a half, by where it falls in the slot cycle: the same-phase ratio measures that
# phase as much as growth. The 5-s count(*) costs PostgreSQL a few hundred ms each, in every chunk
# alike. Results: target/artifacts/bench/receipts/ (summary.txt, samples.csv, chunks.csv, the
# server's log).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

RETENTION=${RETENTION:-120}
DURATION=${DURATION:-480}
CALLS=${CALLS:-32}
CHUNK=${CHUNK:-10}
SAMPLE_S=5
WATCH_S=0.5

[ -n "${NO_BUILD:-}" ] || cargo build --release --bins -q
BUILT=${BIN:+BIN=$BIN}
BIN=${BIN:-$ROOT/target/release}
ARTIFACTS=$ROOT/target/artifacts/bench/receipts
mkdir -p "$ARTIFACTS"
rm -f "$ARTIFACTS"/*.csv "$ARTIFACTS"/summary.txt

. bench/pg.sh
SERVER=
SAMPLER=
WATCHER=
LOAD_PID=
cleanup() {
    local pid
    for pid in "$LOAD_PID" "$SAMPLER" "$WATCHER" "$SERVER"; do
        [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
    done
    for pid in "$LOAD_PID" "$SAMPLER" "$WATCHER" "$SERVER"; do
        [ -z "$pid" ] || wait "$pid" 2>/dev/null || true
    done
    stop_pg
    [ -n "${WORK:-}" ] || return 0
    if [ -n "${KEEP:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
start_pg receipts
DB=postgres://postgres@127.0.0.1:$PORT/postgres
PSQL=(psql -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -Atq -v ON_ERROR_STOP=1)
"$BIN/turnstile" migrate --database-url "$DB" >/dev/null 2>&1

LISTEN=$(free_port)
METRICS=$(free_port)
env -u RUST_LOG "$BIN/turnstile" serve --listen "127.0.0.1:$LISTEN" --gateway-listen off \
    --metrics-listen "127.0.0.1:$METRICS" --database-url "$DB" \
    --receipt-retention-secs "$RETENTION" >"$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$LISTEN") 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
    sleep 0.1
done
# The server sets the slots' width from its retention as its upkeep starts.
WIDTH=
for _ in $(seq 1 100); do
    WIDTH=$("${PSQL[@]}" -c "SELECT width_secs FROM turnstile.turnstile_receipt_clock
                              WHERE width_secs = $RETENTION / 2.0")
    [ -z "$WIDTH" ] || break
    sleep 0.1
done
[ -n "$WIDTH" ] || { echo "the server did not set the slots' width to $RETENTION / 2 s" >&2; exit 1; }

# Every 5 s: time, bytes and rows of the receipt tables (summed, then each: slots 0..3, legacy).
tables=(turnstile_receipt_0 turnstile_receipt_1 turnstile_receipt_2 turnstile_receipt_3
    turnstile_receipt_legacy)
sizes=
counts=
for t in "${tables[@]}"; do
    sizes+="${sizes:+ + }pg_total_relation_size('turnstile.$t')"
    counts+="${counts:+ + }(SELECT count(*) FROM turnstile.$t)"
done
cols="extract(epoch FROM clock_timestamp()), $sizes, $counts"
for t in "${tables[@]}"; do cols+=", (SELECT count(*) FROM turnstile.$t)"; done
for t in "${tables[@]}"; do cols+=", pg_total_relation_size('turnstile.$t')"; done
(
    while true; do
        "${PSQL[@]}" -F, -c "SELECT $cols" || true
        sleep "$SAMPLE_S"
    done
) >"$WORK/samples.csv" 2>"$WORK/sampler.log" &
SAMPLER=$!
# Every 0.5 s (catalog only, no lock on the tables): each slot's relfilenode (a TRUNCATE gives a
# new one) and whether it is attached (a), its detach pending (p) or detached (d).
"${PSQL[@]}" >"$WORK/watch.csv" 2>"$WORK/watcher.log" <<SQL &
SELECT extract(epoch FROM clock_timestamp()) || ',' || string_agg(c.relfilenode || ':' ||
       CASE WHEN i.inhrelid IS NULL THEN 'd' WHEN i.inhdetachpending THEN 'p' ELSE 'a' END,
       ',' ORDER BY c.relname)
  FROM pg_class c LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
 WHERE c.relnamespace = 'turnstile'::regnamespace
   AND c.relname IN ('turnstile_receipt_0', 'turnstile_receipt_1', 'turnstile_receipt_2',
                     'turnstile_receipt_3')
\watch $WATCH_S
SQL
WATCHER=$!

RUN=$(printf '%08x' $((RANDOM * 32768 + RANDOM)))
echo "== $(date -u +%FT%TZ), ${BUILT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- src migrations proto 2>/dev/null || echo '+changes')}, $(nproc) cores; retention $RETENTION s (slots $WIDTH s), $DURATION s of load in $CHUNK-s chunks, $CALLS calls in flight" >&2
: >"$WORK/chunk-times.csv"
n=0
t_end=$((SECONDS + DURATION))
while [ "$SECONDS" -lt "$t_end" ]; do
    d=$((t_end - SECONDS))
    [ "$d" -le "$CHUNK" ] || d=$CHUNK
    start=$(date +%s.%N)
    rc=0
    # The conversations are the run's (--run-id) and carry on from chunk to chunk; the activity
    # ids are each process's own.
    "$BIN/turnstile-bench" --target "127.0.0.1:$LISTEN" --concurrency "$CALLS" --duration "$d" \
        --run-id "$RUN" --no-verify --json >"$WORK/chunk-$n.json" 2>>"$WORK/bench.log" &
    LOAD_PID=$!
    wait "$LOAD_PID" || rc=$?
    LOAD_PID=
    echo "$n,$start,$(date +%s.%N),$rc" >>"$WORK/chunk-times.csv"
    if [ $((n % 6)) = 5 ]; then
        echo "-- t = $((DURATION - t_end + SECONDS)) s: $(tail -n 1 "$WORK/samples.csv" | cut -d, -f3) receipt rows" >&2
    fi
    n=$((n + 1))
done
sleep "$SAMPLE_S"
kill "$SAMPLER" "$WATCHER" 2>/dev/null || true
wait "$SAMPLER" "$WATCHER" 2>/dev/null || true
SAMPLER=
WATCHER=

# Rows against distinct keys (a receipt written in a slot's first 10 s is in two slots), and the
# server's own count of what it pruned.
read -r rows keys < <("${PSQL[@]}" -F' ' -c "SELECT count(*), count(DISTINCT key) FROM (
    SELECT key FROM turnstile.turnstile_receipt_0 UNION ALL SELECT key FROM turnstile.turnstile_receipt_1
    UNION ALL SELECT key FROM turnstile.turnstile_receipt_2 UNION ALL SELECT key FROM turnstile.turnstile_receipt_3) r")
pruned=$(curl -s "127.0.0.1:$METRICS/metrics" | grep -E '^turnstile_receipts_pruned' | tr '\n' ' ' || true)
{
    python3 -B bench/drivers/receipts.py report "$WORK" --retention "$RETENTION" --width "$WIDTH" \
        --chunk "$CHUNK" --out "$ARTIFACTS" \
        --distinct-keys "$rows receipt rows, $keys distinct keys"
    echo "server metrics: ${pruned:-none}"
    # (Less the warning at start that the TurnService takes no tokens: so shipped.)
    echo "server log: $(grep -E ' (WARN|ERROR) ' "$WORK/server.log" | grep -vc 'no auth tokens configured' || true) warnings and errors, of which $(grep -c 'emptying a receipt slot stopped' "$WORK/server.log" || true) 'emptying a receipt slot stopped', $(grep -c 'pruning turn receipts failed' "$WORK/server.log" || true) 'pruning turn receipts failed'"
    [ ! -s "$WORK/sampler.log" ] || echo "sampler: $(sort "$WORK/sampler.log" | uniq -c | head -n 5)"
} | tee "$ARTIFACTS/summary.txt"
cp "$WORK/server.log" "$ARTIFACTS/server.log"
