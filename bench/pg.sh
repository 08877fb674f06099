# A throwaway PostgreSQL cluster for a benchmark script, and free ports: sourced, not run.
#
#   . bench/pg.sh; start_pg NAME      sets WORK (a scratch directory), PORT, PGBIN and AS (how to
#                                     run PostgreSQL's tools: as the postgres user when root)
#   stop_pg                           stops the cluster; the caller's cleanup removes WORK
#   free_port                         prints a free port on 127.0.0.1

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
