"""Writes the load card (bench/CARD.md) and its plots from the results bench/card.sh recorded.

    python3 card.py RESULTS.jsonl CARD.md PLOT_DIR

RESULTS.jsonl holds one JSON object per line, each with a `kind`: `meta` (commit, machine,
PostgreSQL), `instructions`, `state`, `closed` and `open` (k6), `probe` (k6's 10 s runs that
searched for the open loop's maximum) and `open_max` (what they found), the same four of pgbench
alone (`pgbench_closed`, `pgbench_open`, `pgbench_probe`, `pgbench_open_max`), pgbench alone at the
service's offered rates (`pgbench_at_service_rate`), `conversations`,
`receipts`.
The plots are drawn with matplotlib (Agg, PNG); the card links them by their path relative to
CARD.md. Each target of the load-card issue is checked against the figures and marked met or not.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results_path, card_path, plot_dir = sys.argv[1:4]
rows = [json.loads(line) for line in open(results_path) if line.strip()]
meta = next(r for r in rows if r["kind"] == "meta")
of = lambda kind: [r for r in rows if r["kind"] == kind]  # noqa: E731
instructions = of("instructions")
states = of("state")
closed = of("closed")
opened = sorted(of("open"), key=lambda r: r["rate"])
conversations = sorted(of("conversations"), key=lambda r: r["conversations"])
receipts = of("receipts")
probes = sorted(of("probe"), key=lambda r: r["rate"])
# Each open-loop run's offered load, as a percentage of the open loop's own maximum (the highest
# fixed rate answered in full); cards from before it was searched for took the closed loop's.
open_max = next(iter(of("open_max")), None)
top_rate = open_max["rate"] if open_max else (closed[-1]["ok_per_second"] if closed else None)
for r in opened:
    r["load"] = round(100 * r["rate"] / top_rate) if top_rate else None
# PostgreSQL alone at fixed rates (pgbench, the naive SQL), as a percentage of its own maximum.
pg_opened = sorted(of("pgbench_open"), key=lambda r: r["rate"])
pg_closed = next(iter(of("pgbench_closed")), None)
pg_probes = sorted(of("pgbench_probe"), key=lambda r: r["rate"])
pg_open_max = next(iter(of("pgbench_open_max")), None)
for r in pg_opened:
    r["load"] = round(100 * r["rate"] / pg_open_max["rate"])
# PostgreSQL alone at the rates the service was offered, as a percentage of the service's maximum.
pg_at_service = sorted(of("pgbench_at_service_rate"), key=lambda r: r["rate"])
for r in pg_at_service:
    r["load"] = round(100 * r["rate"] / top_rate) if top_rate else None


def nearest(runs, load):
    return min(runs, key=lambda r: abs(r["load"] - load)) if runs else None


def spread(run, of="latency_ms"):
    """p99.9 over p50, the open-loop target's measure."""
    return run[of]["p99.9"] / run[of]["p50"]


def pgbench_spread(run):
    """pgbench's spread both ways: from each transaction's schedule, and from its start."""
    started = f", {spread(run, 'from_start_ms'):.1f}× from each transaction's start" if run.get("from_start_ms") else ""
    return f"{spread(run):.1f}× from its schedule{started}"


def waits(run):
    """The mean number of PostgreSQL's client backends active in each state, the largest three."""
    found = sorted((run.get("postgres_waits") or {}).items(), key=lambda kv: -kv[1])
    return ", ".join(f"{event} {n:.2f}" for event, n in found[:3]) or "–"


def searched(probes):
    return ", ".join(f"{p['rate']:,}/s {'answered' if p['ok_per_second'] >= 0.98 * p['rate'] and p['dropped_iterations'] <= 0.01 * p['rate'] * 10 else 'not'}" for p in probes)
rel = os.path.relpath(plot_dir, os.path.dirname(os.path.abspath(card_path)))


def size(n):
    return f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


def count(n):
    for unit, div in (("M", 1_000_000), ("k", 1_000)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


def met(ok):
    return "met" if ok else "**not met**"


def save(fig, name):
    fig.tight_layout()
    fig.savefig(os.path.join(plot_dir, name), dpi=110)
    plt.close(fig)
    return f"![{name}]({rel}/{name})"


def throughput_and_p99(points, x, xlabel, title, name, logx=False, series=None, anchor="pgbench naive SQL"):
    """Two panels: turns/s of the service and of pgbench (`anchor`), and their p99s, against `x`."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, pts in (series or {"": points}).items():
        xs = [x(p) for p in pts]
        suffix = f" ({label})" if label else ""
        left.plot(xs, [p["service_tps"] for p in pts], "o-", label=f"Turnstile{suffix}")
        left.plot(xs, [p["pgbench_tps"] for p in pts], "s--", label=f"{anchor}{suffix}")
        right.plot(xs, [p["service_p99_ms"] for p in pts], "o-", label=f"Turnstile{suffix}")
        right.plot(xs, [p["pgbench_p99_ms"] for p in pts], "s--", label=f"{anchor}{suffix}")
    for ax, ylabel in ((left, "turns/s"), (right, "p99, ms")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if logx:
            ax.set_xscale("log")
        ax.legend(fontsize=7)
    left.set_title(f"throughput against {title}")
    right.set_title(f"p99 against {title}")
    return save(fig, name)


out = []
w = out.append
# The database's collation, as the card's metadata read it (older runs did not: theirs was C).
collation = next(
    (kv.split("=", 1)[1] for kv in meta["pg_settings"].split() if kv.startswith("lc_collate=")), "C"
)
w("# Turnstile's load card")
w("")
w(
    "Written by `bench/run.sh --card` (bench/card.sh): the release server **as shipped** (default "
    "settings, default log filter), PostgreSQL in a throwaway cluster with its default settings, "
    + (
        "created without a locale (`lc_collate=C`; `PG_LOCALE` gives it one, as hosted PostgreSQL often "
        "has: README, \"The database's collation\"), "
        if collation == "C"
        else f"created with the locale `{collation}` (`PG_LOCALE`; README, \"The database's collation\"), "
    )
    + "on this project's shared build machine. Throughputs are compared with pgbench running the naive "
    "per-turn SQL (read the state and its version, then a conditional update) over the same keys, "
    "state size and concurrency, back to back in each round; the round with the median ratio is "
    "shown. Absolute figures move with the machine's load; the ratios are the card's measure. "
    "`bench/RESULTS.md` has the history and the reasons behind each figure."
)
w("")
w(f"- **Commit** `{meta['commit']}`" + (f" with {meta['dirty_files']} files changed" if meta["dirty_files"] else "") + f", measured {meta['date']}.")
w(f"- **Machine**: {meta['cores']} cores ({meta['cpu']}), {meta['memory_gib']} GiB, Linux {meta['kernel']}; one 8 KiB flush to disk took {meta['flush_ms']} ms.")
w(f"- **PostgreSQL**: {meta['postgres']}; {meta['pg_options'] or 'default settings'} (`{meta['pg_settings']}`).")
w("- **Layouts**: *shared*, everything on every core; *split*, PostgreSQL on half the cores and the service with its load generator on the other half, as when the database has its own machine.")
w("")

# --- targets ---------------------------------------------------------------------------------------
w("## Targets")
w("")
w("| target | measured | |")
w("|---|---|---|")
warm = next((r for r in instructions if r["label"].startswith("warm") and "turnstile-bench" in r["label"]), None)
cold = next((r for r in instructions if r["label"].startswith("cold")), None)
if warm:
    w(f"| ≤ 90,000 instructions per turn, warm, 1,000 conversations | {warm['per_turn']:,} | {met(warm['per_turn'] <= 90_000)} |")
if cold:
    w(f"| ≤ 110,000 instructions per turn, 1,000,000 conversations | {cold['per_turn']:,} | {met(cold['per_turn'] <= 110_000)} |")
for layout, floor in (("shared", 1.0), ("split", 2.0)):
    pts = [s for s in states if s["layout"] == layout]
    if pts:
        ratios = ", ".join(f"{s['service_tps'] / s['pgbench_tps']:.2f} at {size(s['bytes'])}" for s in pts)
        ok = all(s["service_tps"] / s["pgbench_tps"] >= floor for s in pts)
        w(f"| ≥ {floor:.1f}× pgbench at every state size, 32 calls, {layout} layout | {ratios} | {met(ok)} |")
if len(conversations) >= 2:
    lo, hi = conversations[0], conversations[-1]
    anchored = (hi["service_tps"] / hi["pgbench_tps"]) / (lo["service_tps"] / lo["pgbench_tps"])
    alone = ""
    if "rows" in lo and "rows" in hi:
        fell = (hi["rows"]["tps"] / hi["rows"]["anchor_tps"]) / (lo["rows"]["tps"] / lo["rows"]["anchor_tps"])
        alone = f"; PostgreSQL alone (pgbench's naive SQL over the same rows): {fell:.2f}×"
    w(
        f"| {count(hi['conversations'])} conversations ≥ 0.7× the throughput of {count(lo['conversations'])} | "
        f"{anchored:.2f}× (against pgbench in each round; {hi['service_tps'] / lo['service_tps']:.2f}× in turns/s){alone} | {met(anchored >= 0.7)} |"
    )
if opened and closed:
    eighty = nearest(opened, 80)
    lat = eighty["latency_ms"]
    anchor, own = nearest(pg_at_service, 80), nearest(pg_opened, 80)
    alone = (
        f"; PostgreSQL alone (pgbench's naive SQL at the same {anchor['rate']:,} transactions/s): {pgbench_spread(anchor)}"
        if anchor else
        f"; PostgreSQL alone (pgbench's naive SQL at {own['load']} % of its own maximum): {pgbench_spread(own)}"
        if own else ""
    )
    w(f"| open loop at 80 % of the maximum: p99.9 ≤ 5× p50 | {spread(eighty):.1f}× ({lat['p99.9']:.2f} / {lat['p50']:.2f} ms){alone} | {met(lat['p99.9'] <= 5 * lat['p50'])} |")
w("")
w("Two targets are measured by their own scripts rather than here: throughput at the default log filter against `RUST_LOG=warn`, and admitted turns' p99 under 16× overload (`bench/overload.sh`); `bench/RESULTS.md` has their latest figures.")
w("")

# --- instructions ----------------------------------------------------------------------------------
if instructions:
    w("## Instructions per turn at the shipped defaults")
    w("")
    w("`bench/instructions.sh`: every instruction of the server's threads, counted by callgrind, per measured turn (32 calls in flight, ~1 KiB states), and per `grpc.health.v1.Health/Check` call, the transport's floor. Counts do not move with the machine's speed.")
    w("")
    w("| workload | instructions per turn | per health check |")
    w("|---|---|---|")
    for r in instructions:
        w(f"| {r['label']} | {r['per_turn']:,} | {r['health_check']:,} |")
    w("")
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(instructions)))
    labels = [r["label"] for r in instructions]
    ax.barh(labels, [r["per_turn"] for r in instructions], color="tab:blue", label="turn")
    ax.barh(labels, [r["health_check"] for r in instructions], color="tab:gray", label="health check (transport)")
    ax.axvline(90_000, color="tab:green", ls="--", lw=1, label="target, warm (90,000)")
    ax.axvline(110_000, color="tab:orange", ls="--", lw=1, label="target, 1M conversations (110,000)")
    ax.invert_yaxis()
    ax.set_xlabel("instructions per call")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    w(save(fig, "instructions.png"))
    w("")

# --- state size ------------------------------------------------------------------------------------
if states:
    w("## Throughput and p99 against state size")
    w("")
    w("10,000 conversations, 32 calls in flight (turnstile-bench), each state padded to the size shown; pgbench updates the same size of state. Each round starts on emptied tables and analyzes the state table after its prefill, as autovacuum does within a minute or so of a running service's start (builds before b54e6b7 planned their commits on the empty table to read every row, `bench/RESULTS.md`, 2026-11-29).")
    w("")
    w("| state | layout | Turnstile turns/s | pgbench turns/s | ratio | Turnstile p99 | pgbench p99 |")
    w("|---|---|---|---|---|---|---|")
    for s in states:
        w(f"| {size(s['bytes'])} | {s['layout']} | {s['service_tps']:,.0f} | {s['pgbench_tps']:,.0f} | {s['service_tps'] / s['pgbench_tps']:.2f} | {s['service_p99_ms']:.2f} ms | {s['pgbench_p99_ms']:.2f} ms |")
    w("")
    series = {layout: [s for s in states if s["layout"] == layout] for layout in ("shared", "split")}
    w(throughput_and_p99(None, lambda s: s["bytes"], "state, bytes", "state size", "state.png", logx=True, series={k: v for k, v in series.items() if v}))
    w("")

# --- conversations ---------------------------------------------------------------------------------
if conversations:
    w("## Throughput and p99 against conversations")
    w("")
    w("32 calls in flight spread at random over this many conversations of 256-byte state, created in the database beforehand: with many, nearly every turn misses the server's state cache and reads its row, and the index is deeper. pgbench runs its naive SQL over 10,000 keys in each round, as the anchor against the machine's drift.")
    w("")
    w("| conversations | state table | Turnstile turns/s | pgbench turns/s (10,000 keys) | ratio | Turnstile p99 |")
    w("|---|---|---|---|---|---|")
    for c in conversations:
        table = f"{c['table_bytes'] / 2**30:.1f} GiB" if c["table_bytes"] >= 2**30 else f"{c['table_bytes'] / 2**20:.0f} MiB"
        w(f"| {c['conversations']:,} | {table} | {c['service_tps']:,.0f} | {c['pgbench_tps']:,.0f} | {c['service_tps'] / c['pgbench_tps']:.2f} | {c['service_p99_ms']:.2f} ms |")
    w("")
    alone = [c for c in conversations if "rows" in c]
    if alone:
        w("### PostgreSQL alone over the same rows")
        w("")
        w(
            "pgbench's naive SQL (read the state and its version, then a conditional update: two statements a turn) over the service's own rows, "
            "the same conversations in `turnstile_state` with its indexes, back to back with the 10,000-key anchor in each round (median round shown). "
            "It says how much of the service's fall with more conversations is the database's: the naive SQL reads a row every turn at any scale, "
            "where the service reads one only when its replica has not cached the conversation."
        )
        w("")
        w("| conversations | pgbench turns/s over these rows | its anchor (10,000 keys) | ratio | PostgreSQL µs per turn, these rows | PostgreSQL µs per turn, anchor | p99 |")
        w("|---|---|---|---|---|---|---|")
        for c in alone:
            r = c["rows"]
            w(f"| {c['conversations']:,} | {r['tps']:,.0f} | {r['anchor_tps']:,.0f} | {r['tps'] / r['anchor_tps']:.2f} | {r['postgres_cpu_us']:.0f} | {r['anchor_postgres_cpu_us']:.0f} | {r['p99_ms']:.2f} ms |")
        w("")
    w(throughput_and_p99(conversations, lambda c: c["conversations"], "conversations", "conversations", "conversations.png", logx=True, anchor="pgbench naive SQL, 10,000 keys (the anchor)"))
    w("")

# --- open loop -------------------------------------------------------------------------------------
if opened:
    top = closed[-1] if closed else None
    where = {
        "apart": "PostgreSQL and the server on one half of the cores and k6 on the other, so that the client's CPU does not delay the answers",
        "shared": "everything on every core (k6's CPU competes with the server's and PostgreSQL's)",
    }[opened[0].get("layout", "shared")]
    w("## Latency against offered load (open loop)")
    w("")
    if open_max:
        maximum = (
            f"The maximum is the open loop's own, {open_max['rate']:,} turns/s: the highest fixed rate answered in full (98 % of the turns offered "
            f"answered, under 1 % of the sends late), searched for in 10 s runs from half of k6's closed loop (32 callers, each sending when "
            f"answered: {open_max['closed_max']:,} turns/s) in steps of a tenth of it ({searched(probes)}). A turn costs more CPU at a fixed rate than "
            "with 32 callers always waiting, so the closed loop's maximum can be more than a fixed rate is answered at (`bench/RESULTS.md`)."
        )
    else:
        maximum = f"The maximum is k6's closed loop (32 callers, each sending when answered): {top['ok_per_second']:,.0f} turns/s."
    w(
        f"k6 1.1.0 (grpc-go) on the same machine, {where}, 10,000 conversations of 1 KiB. {maximum} Then k6's `constant-arrival-rate` offers a fixed rate, "
        "sending on schedule whether or not earlier calls were answered, so a stall shows in the latencies instead of hiding in a slower send rate "
        "(coordinated omission). *Dropped* counts sends k6 could not start on time (all its callers busy)."
    )
    w("")
    sampled = any(r.get("postgres_waits") is not None for r in opened + pg_opened)
    backends = " PostgreSQL's backends |" if sampled else ""

    def waits_cell(run):
        return f" {waits(run)} |" if sampled else ""

    counted = any(r.get("server_switches_per_turn") is not None for r in opened)
    switches_head = " context switches per turn, server / PostgreSQL |" if counted else ""

    def switches_cell(run):
        if not counted:
            return ""
        mine = [run[k] for k in ("server_switches_per_turn", "postgres_switches_per_turn") if k in run]
        return " " + (" / ".join(f"{n:.1f}" for n in mine) or "–") + " |"

    w(f"| offered | turns/s answered OK | p50 | p90 | p99 | p99.9 | the server's own p50 / p99 / p99.9 | disk flush p50 / p99 / max |{backends} statuses | dropped | server turns/s per core | PostgreSQL turns/s per core | WAL per turn |{switches_head}")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if sampled else "") + ("---|" if counted else ""))
    for r in ([top] if top else []) + opened:
        lat = r["latency_ms"]
        offered = "closed loop, 32 callers" if r["kind"] == "closed" else f"{r['rate']:,}/s ({r['load']} %)"
        codes = ", ".join(f"{'OK' if c == '0' else 'code ' + c} {n:,}" for c, n in sorted(r["by_code"].items()))
        def triple(measured, keys):
            return " / ".join("–" if measured.get(k) is None else f"{measured[k]:.1f}" for k in keys) + " ms"
        server = triple(r.get("server_latency_ms") or {}, ("p50", "p99", "p99.9"))
        if r.get("commit_latency_ms"):
            server += " (commits " + triple(r["commit_latency_ms"], ("p50", "p99", "p99.9")) + ")"
        flush = triple(r.get("disk_flush_ms") or {}, ("p50", "p99", "max"))
        w(
            f"| {offered} | {r['ok_per_second']:,.0f} | {lat['p50']:.2f} ms | {lat['p90']:.2f} ms | {lat['p99']:.2f} ms | {lat['p99.9']:.2f} ms | {server} | {flush} |{waits_cell(r)} {codes} | {r['dropped_iterations']:,} "
            f"| {r['turns_per_server_core_second']:,.0f} | {r['turns_per_postgres_core_second']:,.0f} | {r['wal_bytes_per_turn']:,.0f} B |{switches_cell(r)}"
        )
    w("")
    w("Turns/s per core: turns answered OK per CPU-second the server (or every PostgreSQL process) used during the run, from /proc. "
      "*The server's own* percentiles are of the same turns as the server timed them (`turnstile_turn_duration_seconds`, from the call's "
      "start in the handler to its answer), read from its histogram before and after the run and interpolated within its buckets "
      "(0.5, 1, 2.5, 5, 10, 25, 50, 100 ms …) as Prometheus's `histogram_quantile` does: coarse, but they tell a stall inside the server "
      "from one in the client, the kernel or the HTTP/2 queues on the way. In brackets, the same of the turns' commits "
      "(`turnstile_store_duration_seconds{op=\"commit\"}`: PostgreSQL's round trip, with the group commit's wait for the batch before). "
      "*Disk flush*: 8 KiB written and `fdatasync`'d 20 times a second beside PostgreSQL's data during the run. A turn is answered only "
      "once its commit's WAL is on disk, so one flush that stalls delays every turn in flight: a p99.9 far above p50 with a flush maximum "
      "of the same size is the disk's, not the service's."
      + (" *PostgreSQL's backends*: `pg_stat_activity` sampled 50 times a second during the run, "
         "the mean number of client backends active under each wait event, the largest three; *CPU* is a backend waiting for none, running or "
         "waiting for a core, *IO:WALSync* one flushing the WAL, *LWLock:WALWrite* one waiting for another's flush." if sampled else "")
      + (" *Context switches*: of every thread of the server, and of every PostgreSQL process, per turn answered: each is a thread "
         "that went to sleep (for a wake-up, a lock, the disk) or lost its core, the wake-ups a turn costs, which instructions per turn do not count "
         "(pgbench's are not counted: its backends leave with their counts when it ends)." if counted else ""))
    w("")
    if pg_opened:
        pg_eighty = nearest(pg_opened, 80)
        w("### PostgreSQL alone at fixed rates")
        w("")
        w(
            f"pgbench with the naive per-turn SQL (the anchor: 10,000 keys of 1 KiB, 32 clients, the same cores as k6 above), with no service in front: "
            f"its closed loop ({pg_closed['ok_per_second']:,.0f} transactions/s), then its own fixed-rate maximum, {pg_open_max['rate']:,}/s, searched for as the service's was "
            f"({searched(pg_probes)}), and the same loads of it. pgbench counts a transaction's latency from its scheduled start under `--rate`, so a stall shows in it "
            "as in k6's. That latency is the *schedule lag*, the wait to start (for one of its 32 clients to be free, or for its own thread to get a CPU), "
            "plus the time *from the start*, PostgreSQL's round trip, which compares with the service's commits above. "
            "A transaction it could not start within a second of schedule is skipped "
            "(`--latency-limit`) and counted as dropped. "
            + f"At {pg_eighty['load']} % of its own maximum PostgreSQL alone has a p99.9 / p50 of {pgbench_spread(pg_eighty)}"
            + (f" (a queue: its p50 is {pg_eighty['latency_ms']['p50']:.0f} ms, its schedule lag's p99 {pg_eighty['schedule_lag_ms']['p99']:.0f} ms)"
               if pg_eighty["schedule_lag_ms"]["p99"] > 100 else "")
            + "."
            + (" The anchor of the open-loop target is the next rows: the same SQL at the rates the service was offered, the same turns a second "
               "on the same database and cores with no service in front; at 80 % of the service's maximum, "
               f"{pgbench_spread(nearest(pg_at_service, 80))}."
               if pg_at_service else "")
        )
        w("")
        w(f"| offered | transactions/s | p50 | p90 | p99 | p99.9 | p99.9 / p50 | schedule lag p99 / p99.9 | from the start p50 / p99 / p99.9 | disk flush p50 / p99 / max |{backends} dropped | PostgreSQL µs per transaction | WAL per transaction |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if sampled else ""))
        for r in pg_opened + pg_at_service:
            lat, lag, flush, ran = r["latency_ms"], r["schedule_lag_ms"], r["disk_flush_ms"], r["from_start_ms"]
            whose = "its own" if r["kind"] == "pgbench_open" else "the service's"
            w(
                f"| {r['rate']:,}/s ({r['load']} % of {whose} maximum) | {r['ok_per_second']:,.0f} | {lat['p50']:.2f} ms | {lat['p90']:.2f} ms | {lat['p99']:.2f} ms | {lat['p99.9']:.2f} ms "
                f"| {spread(r):.1f}× | {lag['p99']:.2f} / {lag['p99.9']:.2f} ms | {ran['p50']:.2f} / {ran['p99']:.2f} / {ran['p99.9']:.2f} ms | {flush['p50']:.1f} / {flush['p99']:.1f} / {flush['max']:.1f} ms |{waits_cell(r)} {r['dropped_iterations']:,} "
                f"| {r['postgres_cpu_us_per_turn']:,.0f} | {r['wal_bytes_per_turn']:,.0f} B |"
            )
        w("")
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("p50", "o-"), ("p90", "s-"), ("p99", "^-"), ("p99.9", "v-")):
        ax.plot([r["load"] for r in opened], [r["latency_ms"][key] for r in opened], style, label=f"Turnstile {key}")
    for key, style in (("p50", "o--"), ("p99.9", "v--")):
        if pg_opened:
            ax.plot([r["load"] for r in pg_opened], [r["latency_ms"][key] for r in pg_opened], style, color="grey", label=f"pgbench alone {key}")
        if pg_at_service:
            ax.plot([r["load"] for r in pg_at_service], [r["latency_ms"][key] for r in pg_at_service], style, color="black",
                    label=f"pgbench alone at Turnstile's rates {key}")
    ax.set_yscale("log")
    ax.set_xlabel("offered load, % of a fixed-rate maximum (each one's own; black: Turnstile's)")
    ax.set_ylabel("latency, ms")
    ax.set_title("latency percentiles against offered load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    w(save(fig, "open_loop.png"))
    w("")

# --- receipts --------------------------------------------------------------------------------------
if receipts:
    w("## A receipt backlog")
    w("")
    w("10,000 conversations of 1 KiB, 32 calls; the receipt table first holding only what the runs write, then with the rows shown added (receipts as turns write them, all within the retention, in the slot being written).")
    w("")
    w("| receipts in the table | Turnstile turns/s | pgbench turns/s | ratio | Turnstile p99 |")
    w("|---|---|---|---|---|")
    for r in receipts:
        w(f"| {r['rows']:,} | {r['service_tps']:,.0f} | {r['pgbench_tps']:,.0f} | {r['service_tps'] / r['pgbench_tps']:.2f} | {r['service_p99_ms']:.2f} ms |")
    w("")

open(card_path, "w").write("\n".join(out) + "\n")
