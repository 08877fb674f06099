#!/usr/bin/env bash
# What PostgreSQL spends on a turn's receipt: instructions per execution of the common commit (one
# scope updated, its receipt written) and of the load (state and receipt read), as this release
# ships them (`migrations/V5__receipt_slots.sql`: four slots, a check across them), against the
# same statements over the single receipt table of migration V4, in the same database.
#
#   bench/receipt_statements.sh            about two minutes after the build (valgrind)
#   NO_BUILD=1 bench/receipt_statements.sh migrates with target/release as it is (BIN=DIR: another
#                                          build's; only its migrations matter)
#
# Instructions, not seconds: callgrind counts what the backend executes, the same on a busy
# machine as on a quiet one. Each statement is prepared in a single-user backend
# (`postgres --single`, no client, no network) and executed 200 times, then 1,200 times in
# another backend, each time with a fresh activity id; the difference over 1,000 is the cost of
# one execution, without the backend's start and the statement's preparation.
#
# The anchor is V4's layout, built beside the shipped one: `v4_receipt` (the single table, with
# V4's indexes) and V4's `turnstile_key_conversation`, which was STRICT and so was never inlined
# (V5 replaced it). Four figures per statement: V4 as it was; V4's table with V5's key function;
# V5's slots without the check (the partitioned insert alone); V5 as shipped.
#
# Then what the number of slots costs (#29's "flat ±10 %" asks for slots a tenth of the retention
# wide, so about twelve): `trial4_receipt` and `trial12_receipt`, partitioned as V5's table is,
# with its indexes and its check (`trial4_slots`, `trial12_slots`: V5's query over that table),
# each already holding 240,000 receipts spread over its slots, as a running service's do (the
# shipped slots are empty here, which flatters V5's load).
#
# Results: target/artifacts/bench/receipt_statements/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$ROOT/target/artifacts/bench/receipt_statements
mkdir -p "$OUT"
BIN=${BIN:-$ROOT/target/release}
[ "${NO_BUILD:-0}" = 1 ] || cargo build --release --bin turnstile -q
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }

. bench/pg.sh
cleanup() { stop_pg; [ -n "${WORK:-}" ] && rm -rf "$WORK"; }
trap cleanup EXIT
start_pg receipt-statements
URL="postgresql://postgres@127.0.0.1:$PORT/postgres"
"$BIN/turnstile" migrate --database-url "$URL" >/dev/null 2>&1
PSQL=("$(command -v psql || echo "$PGBIN/psql")" -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres -d postgres)
"${PSQL[@]}" <<'SQL'
SET search_path = turnstile, public;
INSERT INTO turnstile_state (key, state, version)
SELECT 'bot/c/conversations/c' || g, '{"n": 1}', 1 FROM generate_series(1, 10000) g;
-- V4's key function (STRICT, so never inlined) and its receipt table, as V4 left them.
CREATE FUNCTION v4_key_conversation(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$
    SELECT CASE WHEN split_part(p_key, '/', 3) = 'conversations'
                THEN split_part(p_key, '/', 2) || '/' || split_part(p_key, '/', 4) END
$$;
CREATE TABLE v4_receipt (key text PRIMARY KEY, payload jsonb NOT NULL,
                         created_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX ON v4_receipt USING brin (created_at);
CREATE INDEX ON v4_receipt (v4_key_conversation(key));
CREATE INDEX ON v4_receipt ((payload->>'user')) WHERE payload ? 'user';
CREATE TABLE v4_inlined (key text PRIMARY KEY, payload jsonb NOT NULL,
                         created_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX ON v4_inlined USING brin (created_at);
CREATE INDEX ON v4_inlined (turnstile_key_conversation(key));
CREATE INDEX ON v4_inlined ((payload->>'user')) WHERE payload ? 'user';
-- The slot-count trial: V5's table, indexes and check with 4 and with 12 slots, filled.
DO $trial$
DECLARE n int;
BEGIN
  FOREACH n IN ARRAY ARRAY[4, 12] LOOP
    EXECUTE format('CREATE TABLE trial%s_receipt (slot int2 NOT NULL, key text NOT NULL,
        payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())
        PARTITION BY LIST (slot)', n);
    FOR i IN 0..n - 1 LOOP
      EXECUTE format('CREATE TABLE trial%1$s_receipt_%2$s PARTITION OF trial%1$s_receipt
          (CONSTRAINT trial%1$s_receipt_%2$s_pkey PRIMARY KEY (key)) FOR VALUES IN (%2$s)', n, i);
    END LOOP;
    EXECUTE format('CREATE INDEX ON trial%s_receipt (turnstile_key_conversation(key))', n);
    EXECUTE format('CREATE INDEX ON trial%s_receipt ((payload->>%L)) WHERE payload ? %L',
        n, 'user', 'user');
    EXECUTE format('CREATE INDEX ON trial%s_receipt USING brin (created_at)', n);
    EXECUTE format('INSERT INTO trial%1$s_receipt (slot, key, payload)
        SELECT g %% %1$s, %2$L || (g %% 10000) || %3$L || g, %4$L
          FROM generate_series(1, 240000) g',
        n, 'bot/c/conversations/c', '/activities/old', '{"user":"c/u1"}');
    EXECUTE format('CREATE FUNCTION trial%1$s_slots(p_key text) RETURNS int2[]
        LANGUAGE plpgsql STRICT AS %2$L', n, format(
        'DECLARE taken boolean; width float8;
         BEGIN
           SELECT EXISTS (SELECT 1 FROM trial%s_receipt WHERE key = p_key), c.width_secs
             INTO taken, width FROM turnstile_receipt_clock c;
           IF taken THEN RAISE unique_violation; END IF;
           RETURN ARRAY[1::int2];
         END', n));
  END LOOP;
END
$trial$;
ANALYZE;
SQL
"${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/pg/data" -m fast stop >/dev/null

# The statements, as src/store/postgres/group_commit.rs (UPDATE_ONE) and src/store/postgres.rs
# (LOAD) send them, with the key and receipt built from $1 (conversation) and $2 (activity).
KEY="('bot/c/conversations/c' || \$1 || '/activities/a' || \$2)"
PAYLOAD="'{\"activities\":[{\"type\":\"message\",\"text\":\"Added ham.\"}],\"attempts\":1,\"version\":2,\"user\":\"c/u1\"}'::jsonb"
WRITE="UPDATE turnstile_state SET state = '{\"n\": 2}', version = version + 1, updated_at = now() WHERE key = 'bot/c/conversations/c' || \$1 RETURNING version"
commit_into() { # $1: the receipt insert's target and select list
    echo "WITH written AS ($WRITE), receipt AS (INSERT INTO $1 FROM written) SELECT version FROM written"
}
declare -A SQL
SQL[commit_v4]=$(commit_into "v4_receipt (key, payload) SELECT $KEY, $PAYLOAD")
SQL[commit_v4_inlined]=$(commit_into "v4_inlined (key, payload) SELECT $KEY, $PAYLOAD")
SQL[commit_slots_unchecked]=$(commit_into "turnstile_receipt (slot, key, payload) SELECT 1, $KEY, $PAYLOAD")
SQL[commit_v5]=$(commit_into "turnstile_receipt (slot, key, payload) SELECT unnest(turnstile_receipt_slots($KEY)), $KEY, $PAYLOAD")
STATE="SELECT 0::int2, key, state, version, extract(epoch FROM now() - updated_at)::float8 FROM turnstile_state WHERE key = ANY(ARRAY['bot/c/conversations/c' || \$1]) UNION ALL SELECT 2::int2, k, NULL, t.version, NULL FROM unnest(ARRAY['bot/c/conversations/c' || \$1]::text[]) AS k JOIN turnstile_tombstone t ON t.key_hash = turnstile_key_hash(k) UNION ALL "
for n in 4 12; do
    SQL[commit_trial$n]=$(commit_into "trial${n}_receipt (slot, key, payload) SELECT unnest(trial${n}_slots($KEY)), $KEY, $PAYLOAD")
    SQL[load_trial$n]="$STATE SELECT 1::int2, key, payload, 0, NULL FROM (SELECT key, payload FROM trial${n}_receipt WHERE key = $KEY LIMIT 1) r"
done
SQL[load_v4]="$STATE SELECT 1::int2, key, payload, 0, NULL FROM v4_receipt WHERE key = $KEY"
SQL[load_v5]="$STATE SELECT 1::int2, key, payload, 0, NULL FROM (SELECT key, payload FROM turnstile_receipt WHERE key = $KEY UNION ALL SELECT key, payload FROM turnstile_receipt_legacy WHERE key = $KEY LIMIT 1) r"

# Instructions of a backend that prepares statement $1 and executes it $2 times.
instructions() {
    local script=$WORK/pg/$1.$2.sql
    {
        echo "SET search_path = turnstile, public;"
        echo "PREPARE s(int, bigint) AS ${SQL[$1]};"
        python3 -c "
import random
for _ in range($2):
    print(f'EXECUTE s({random.randint(1, 10000)}, {random.randint(1, 10**15)});')"
    } >"$script"
    chmod 644 "$script"
    "${AS[@]}" valgrind --tool=callgrind --callgrind-out-file="$WORK/pg/$1.$2.cg" \
        "$PGBIN/postgres" --single -D "$WORK/pg/data" -c synchronous_commit=off postgres \
        <"$script" >"$WORK/pg/$1.$2.log" 2>&1
    if grep -q ERROR "$WORK/pg/$1.$2.log"; then
        grep -m 3 ERROR "$WORK/pg/$1.$2.log" >&2
        exit 1
    fi
    awk '/^summary:/ {print $2}' "$WORK/pg/$1.$2.cg"
}

{
    echo "receipt statements, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'), $("$PGBIN/postgres" --version)"
    echo "instructions per execution (callgrind, (1200 runs - 200 runs) / 1000)"
    for name in commit_v4 commit_v4_inlined commit_slots_unchecked commit_v5 load_v4 load_v5 \
        commit_trial4 commit_trial12 load_trial4 load_trial12; do
        few=$(instructions "$name" 200)
        many=$(instructions "$name" 1200)
        printf '%-24s %10d\n' "$name" $(((many - few) / 1000))
    done
} | tee "$OUT/summary.txt"
