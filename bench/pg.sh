# A throwaway PostgreSQL cluster for a benchmark script, and free ports: sourced, not run.
#
#   . bench/pg.sh; start_pg NAME      sets WORK (a scratch directory), PORT, PGBIN and AS (how to
#                                     run PostgreSQL's tools: as the postgres user when root)
#   stop_pg                           stops the cluster; the caller's cleanup removes WORK
#   free_port                         prints a free port on 127.0.0.1
#   seed_conversations URL RUN FROM TO PAD   conversations straight in the database (below)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_pg() {
    PGBIN=$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
    [ -x "$PGBIN/pg_ctl" ] || { echo "PostgreSQL server binaries not found (apt-get install postgresql)" >&2; exit 1; }
    WORK=$(mktemp -d "/tmp/turnstile-$1.XXXXXX")
    chmod 755 "$WORK"
    PORT=$(free_port)
    AS=()
    mkdir "$WORK/pg"
    if [ "$(id -u)" = 0 ]; then chown postgres: "$WORK/pg"; AS=(runuser -u postgres --); fi
    "${AS[@]}" "$PGBIN/initdb" -D "$WORK/pg/data" -U postgres -A trust -E UTF8 --no-locale >/dev/null
    "${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/pg/data" -l "$WORK/pg/log" -w \
        -o "-p $PORT -k $WORK/pg -c listen_addresses=127.0.0.1" start >/dev/null
}

stop_pg() {
    [ -n "${WORK:-}" ] && "${AS[@]}" "$PGBIN/pg_ctl" -D "$WORK/pg/data" -m immediate stop >/dev/null 2>&1 || true
}

# seed_conversations URL RUN FROM TO PAD: creates the counter bot's state of conversations FROM to
# TO-1 of run RUN (turnstile-bench's `--run-id`: conversation n is `{RUN}-c{n}`), as its first turn
# would have left it (count 0, PAD bytes of padding, version 1), straight in the database, a million
# rows per statement: so that a benchmark can start from millions of conversations without sending
# millions of turns first. The schema must exist (the server migrates it as it starts). The insert
# trigger (a tombstone check: a fresh database has none) is skipped. It ends with a checkpoint and
# a sync: the seed and its VACUUM leave dirty pages in the kernel (1.5 GiB seen after 10 million
# rows), whose writing out would otherwise be charged to whichever run comes next.
seed_conversations() {
    local url=$1 run=$2 from=$3 to=$4 pad=$5 start end
    for ((start = from; start < to; start += 1000000)); do
        end=$((start + 1000000 < to ? start + 1000000 : to))
        psql "$url" -v ON_ERROR_STOP=1 -q <<SQL
SET session_replication_role = replica;
INSERT INTO turnstile.turnstile_state (key, state, version)
SELECT 'counter/bench/conversations/$run-c' || i, jsonb_build_object('pad', repeat('.', $pad), 'count', 0), 1
  FROM generate_series($start, $end - 1) AS i
ON CONFLICT (key) DO NOTHING;
SQL
    done
    psql "$url" -q -c "VACUUM ANALYZE turnstile.turnstile_state"
    psql "$url" -q -c "CHECKPOINT"
    sync
}
