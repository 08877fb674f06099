"""The analysis side of bench/receipts.sh (the load is turnstile-bench's, the samples psql's):

    receipts.py report DIR --retention S --width S --out ARTIFACTS

reads from DIR
    samples.csv   every ~5 s: t (Unix time), bytes and rows of the receipt tables (the four slots
                  and the legacy table, each and summed), counted with count(*)
    watch.csv     every ~0.5 s: t, then per slot `relfilenode:state` (a attached, p detach
                  pending, d detached): a new relfilenode is a TRUNCATE, a state other than `a`
                  a detach under way
    chunk-N.json  turnstile-bench --json of load chunk N, and chunk-times.csv (N, start, end)
writes chunks.csv and samples.csv (with t relative to the load's start) and summary.txt to
ARTIFACTS, and prints the summary. Python's standard library only.

A chunk "has an emptying" when its [start, end] overlaps the interval in which some slot was
detached, truncated or attached again: from the last watch sample that saw the slot attached as
it was before, to the first that saw it attached again (a whole cycle between two samples gives
that half-second interval).
"""

import argparse
import csv
import json
import os
import statistics
import sys

SLOTS = 4


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def quantile(values, q):
    """Linear-interpolated quantile of `values`; None when empty."""
    v = sorted(values)
    if not v:
        return None
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def mb(b):
    return f"{b / 1e6:.1f} MB"


def read_samples(d):
    with open(f"{d}/samples.csv") as f:
        rows = [r for r in csv.reader(f) if r and r[0] and r[0][0].isdigit()]
    out = []
    for r in rows:
        v = [float(x) for x in r]
        out.append({
            "t": v[0], "bytes": v[1], "rows": v[2],
            "slot_rows": v[3:3 + SLOTS], "legacy_rows": v[3 + SLOTS],
            "slot_bytes": v[4 + SLOTS:4 + 2 * SLOTS], "legacy_bytes": v[4 + 2 * SLOTS],
        })
    return out


def read_watch(d):
    out = []
    with open(f"{d}/watch.csv") as f:
        for line in f:
            parts = line.strip().split(",")
            if len(parts) != SLOTS + 1 or not parts[0][:1].isdigit():
                continue
            slots = []
            for p in parts[1:]:
                node, state = p.split(":")
                slots.append((node, state))
            out.append((float(parts[0]), slots))
    return out


def slot_operations(watch):
    """Per slot, the intervals [a, b] in which it was detached/truncated/attached, and whether
    its relfilenode changed in it (emptied) or not (detached and attached again, kept)."""
    ops = []
    for s in range(SLOTS):
        prev_t, prev_node, prev_state = None, None, None
        start, start_node = None, None
        for t, slots in watch:
            node, state = slots[s]
            if prev_t is None:
                prev_t, prev_node, prev_state = t, node, state
                continue
            if start is None:
                if state != "a" or node != prev_node:
                    start, start_node = prev_t, prev_node
            if start is not None and state == "a":
                ops.append({"slot": s, "start": start, "end": t, "emptied": node != start_node})
                start = None
            prev_t, prev_node, prev_state = t, node, state
        if start is not None:
            ops.append({"slot": s, "start": start, "end": prev_t, "emptied": prev_node != start_node,
                        "unfinished": True})
    return sorted(ops, key=lambda o: o["start"])


def count_drops(samples):
    """(t_before, t_after, slot, rows before) where a slot's row count fell to 0 between two
    5-second samples."""
    out = []
    for a, b in zip(samples, samples[1:]):
        for s in range(SLOTS):
            if a["slot_rows"][s] > 0 and b["slot_rows"][s] == 0:
                out.append((a["t"], b["t"], s, a["slot_rows"][s]))
    return out


def read_chunks(d):
    times = {}
    with open(f"{d}/chunk-times.csv") as f:
        for r in csv.reader(f):
            if r:
                times[int(r[0])] = (float(r[1]), float(r[2]), int(r[3]))
    chunks = []
    for n in sorted(times):
        start, end, rc = times[n]
        try:
            with open(f"{d}/chunk-{n}.json") as f:
                j = json.loads(f.read().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            j = None
        chunks.append({"n": n, "start": start, "end": end, "rc": rc, "json": j})
    return chunks


def report(opts):
    d = opts.dir
    R = opts.retention
    samples = read_samples(d)
    watch = read_watch(d)
    chunks = read_chunks(d)
    if not samples or not chunks:
        sys.exit("no samples or no chunks")
    t0 = chunks[0]["start"]
    end = chunks[-1]["end"]
    ops = slot_operations(watch)
    drops = count_drops(samples)
    out = []

    # --- the load
    good = [c for c in chunks if c["json"]]
    turns = sum(c["json"]["turns_per_second"] * c["json"]["seconds"] for c in good)
    busy = sum(c["json"]["seconds"] for c in good)
    statuses, redelivered, retries = {}, 0, 0
    for c in good:
        for k, v in c["json"]["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        redelivered += c["json"]["redelivered"]
        retries += c["json"]["retries"]
    failed_chunks = [c["n"] for c in chunks if c["rc"] != 0 or not c["json"]]
    out.append(f"load: {len(chunks)} chunks over {end - t0:.0f} s, {turns:.0f} turns acknowledged, "
               f"{turns / busy:.0f} turns/s while measuring ({turns / (end - t0):.0f}/s over the "
               f"wall clock, gaps between chunks included); statuses {json.dumps(statuses)}, "
               f"retries {retries}, redelivered {redelivered} (0: every activity id was new)"
               + (f"; chunks that failed: {failed_chunks}" if failed_chunks else ""))

    # --- receipts written: the slope of the row count before anything was emptied
    first_op = ops[0]["start"] if ops else end
    early = [s for s in samples if t0 + 5 <= s["t"] <= min(t0 + R - 5, first_op)]
    rate = None
    per_turn = 1 + min(10, opts.width / 4) / opts.width
    if len(early) >= 2:
        rate = (early[-1]["rows"] - early[0]["rows"]) / (early[-1]["t"] - early[0]["t"])
        tps = statistics.mean(c["json"]["turns_per_second"] for c in good
                              if c["start"] < early[-1]["t"] and c["end"] > early[0]["t"])
        out.append(f"receipt rows written: {rate:.0f}/s in the first retention (count(*) rising), "
                   f"{rate / tps:.3f} rows per acknowledged turn (a receipt written in a slot's "
                   f"first min(10 s, a quarter slot) goes in the slot before too: "
                   f"{1 + min(10, opts.width / 4) / opts.width:.3f} expected)")
    if opts.distinct_keys:
        out.append(f"at the end: {opts.distinct_keys}")

    # --- storage
    def at(t):
        return min(samples, key=lambda s: abs(s["t"] - t))

    def turns_between(a, b):
        """Turns acknowledged in [a, b], each chunk's spread evenly over it."""
        n = 0.0
        for c in good:
            overlap = min(b, c["end"]) - max(a, c["start"])
            if overlap > 0:
                n += c["json"]["turns_per_second"] * c["json"]["seconds"] * overlap / (
                    c["end"] - c["start"])
        return n

    def worth(s):
        """Rows held, in retentions' worth: against the rows the last retention's turns wrote
        (the load's rate drifts on a shared machine; this does not), at the rows per turn the
        slots' layout gives (the rate measured above is noisier)."""
        return s["rows"] / (per_turn * turns_between(s["t"] - R, s["t"]))

    windows = round((end - t0) / R)
    ends = []
    out.append(f"storage (bytes of turnstile_receipt_0..3 + legacy, pg_total_relation_size; "
               f"rows by count(*); retention {R:.0f} s, slots {opts.width:.0f} s wide):")
    for k in range(1, windows + 1):
        s = at(t0 + k * R)
        ends.append(s)
        phase = s["t"] % opts.width
        out.append(f"  end of window {k} (t = {s['t'] - t0:5.0f} s, {phase:4.1f} s into a slot): "
                   f"{mb(s['bytes'])}, {s['rows']:.0f} rows = {worth(s):.2f} retentions' worth; "
                   f"slots {[int(x) for x in s['slot_rows']]}")
    steady = [s for s in samples if s["t"] >= t0 + 1.5 * R]
    if len(ends) >= 3:
        r31 = ends[2]["bytes"] / ends[0]["bytes"]
        out.append(f"  window 3 / window 1 (same phase of the slot cycle): {r31:.3f} bytes, "
                   f"{ends[2]['rows'] / ends[0]['rows']:.3f} rows, "
                   f"{worth(ends[2]) / worth(ends[0]):.3f} in retentions' worth — the ±10 % target: "
                   f"{'met' if abs(r31 - 1) <= 0.10 else 'NOT MET'}")
    if len(ends) >= 4:
        out.append(f"  window 4 / window 2 (both after warm-up, same phase): "
                   f"{ends[3]['bytes'] / ends[1]['bytes']:.3f} bytes, "
                   f"{ends[3]['rows'] / ends[1]['rows']:.3f} rows, "
                   f"{worth(ends[3]) / worth(ends[1]):.3f} in retentions' worth")
    if steady:
        lo = min(steady, key=lambda s: s["bytes"])
        hi = max(steady, key=lambda s: s["bytes"])
        rlo = min(s["rows"] for s in steady)
        rhi = max(s["rows"] for s in steady)
        wlo = min(worth(s) for s in steady)
        whi = max(worth(s) for s in steady)
        out.append(f"  band after 1.5 retentions (t ≥ {1.5 * R:.0f} s, {len(steady)} samples): "
                   f"{mb(lo['bytes'])} (t = {lo['t'] - t0:.0f} s) to {mb(hi['bytes'])} "
                   f"(t = {hi['t'] - t0:.0f} s), max/min {hi['bytes'] / lo['bytes']:.3f}; rows "
                   f"{rlo:.0f} to {rhi:.0f}; {wlo:.2f} to {whi:.2f} retentions' worth (rows over "
                   f"{per_turn:.3f} × the turns of the retention before the sample)")
        # Growth: the band's first slot cycle against its last, in bytes and in retentions' worth.
        cyc = 2 * opts.width
        first = [s for s in steady if s["t"] < steady[0]["t"] + cyc]
        last = [s for s in steady if s["t"] > steady[-1]["t"] - cyc]
        if steady[-1]["t"] - steady[0]["t"] >= 2 * cyc:
            out.append(f"  peak bytes over the band's first {cyc:.0f} s vs its last: "
                       f"{mb(max(s['bytes'] for s in first))} vs "
                       f"{mb(max(s['bytes'] for s in last))}; troughs "
                       f"{mb(min(s['bytes'] for s in first))} vs "
                       f"{mb(min(s['bytes'] for s in last))}; in retentions' worth, peaks "
                       f"{max(worth(s) for s in first):.2f} vs {max(worth(s) for s in last):.2f}, "
                       f"troughs {min(worth(s) for s in first):.2f} vs "
                       f"{min(worth(s) for s in last):.2f}")
    legacy = max(s["legacy_bytes"] for s in samples)
    out.append(f"  legacy table: at most {mb(legacy)}, {max(s['legacy_rows'] for s in samples):.0f} rows")

    # --- the emptyings
    emptied = [o for o in ops if o["emptied"]]
    kept = [o for o in ops if not o["emptied"]]
    out.append(f"slot operations seen (watch every ~0.5 s): {len(emptied)} emptyings, "
               f"{len(kept)} detach+attach without truncation, "
               f"{sum(1 for o in ops if o.get('unfinished'))} unfinished at the end; "
               f"row counts falling to 0 between 5-s samples: {len(drops)}")
    for o in ops:
        out.append(f"  slot {o['slot']}: t = {o['start'] - t0:6.1f} to {o['end'] - t0:6.1f} s "
                   f"({o['end'] - o['start']:.1f} s, {o['start'] % opts.width:.1f} s into a slot) "
                   f"{'emptied' if o['emptied'] else 'NOT emptied'}"
                   f"{' (unfinished)' if o.get('unfinished') else ''}")
    for (a, b, s, n) in drops:
        out.append(f"  count: slot {s} {n:.0f} → 0 rows between t = {a - t0:.1f} and {b - t0:.1f} s")

    # --- latency in chunks with and without an emptying
    rows = []
    for c in chunks:
        j = c["json"]
        hit = [o for o in ops if o["start"] < c["end"] and o["end"] > c["start"]]
        rows.append({
            "chunk": c["n"], "start_s": round(c["start"] - t0, 2), "end_s": round(c["end"] - t0, 2),
            "turns_per_second": round(j["turns_per_second"], 1) if j else "",
            "p50_ms": round(j["latency_ms"]["p50"], 3) if j else "",
            "p90_ms": round(j["latency_ms"]["p90"], 3) if j else "",
            "p99_ms": round(j["latency_ms"]["p99"], 3) if j else "",
            "p999_ms": round(j["latency_ms"]["p99.9"], 3) if j else "",
            "max_ms": round(j["latency_ms"]["max"], 3) if j else "",
            "non_ok": sum(v for k, v in j["statuses"].items() if k != "OK") if j else "",
            "slot_operation": ";".join(f"{o['slot']}{'' if o['emptied'] else '(kept)'}" for o in hit),
        })
    with open(f"{opts.out}/chunks.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    # Compared: the chunks after the first retention (tables at their working size), less short
    # and failed ones.
    full = [r for r in rows if r["p99_ms"] != "" and r["start_s"] >= R
            and r["end_s"] - r["start_s"] >= 0.8 * opts.chunk]
    with_ = [r for r in full if r["slot_operation"]]
    without = [r for r in full if not r["slot_operation"]]
    out.append(f"turn latency per {opts.chunk:.0f}-s chunk, chunks starting after the first "
               f"retention ({len(with_)} with a slot operation, {len(without)} without):")
    if with_ and without:
        for key, name in (("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9")):
            a = statistics.median(r[key] for r in with_)
            b = statistics.median(r[key] for r in without)
            out.append(f"  median {name}: {a:.2f} ms with, {b:.2f} ms without: ratio {a / b:.3f}")
        a = statistics.median(r["p99_ms"] for r in with_)
        b = statistics.median(r["p99_ms"] for r in without)
        q1, q3 = quantile([r["p99_ms"] for r in without], 0.25), quantile(
            [r["p99_ms"] for r in without], 0.75)
        out.append(f"  p99 of the chunks without, spread: {min(r['p99_ms'] for r in without):.2f} "
                   f"/ {q1:.2f} / {q3:.2f} / {max(r['p99_ms'] for r in without):.2f} ms "
                   f"(min / p25 / p75 / max); with: "
                   + ", ".join(f"{r['p99_ms']:.2f}" for r in with_) + " ms")
        # Each chunk with an operation against the mean of its two neighbours (the load's rate,
        # and so its latency, drifts over minutes on a shared machine).
        by_n = {r["chunk"]: r for r in rows if r["p99_ms"] != ""}
        paired = []
        for r in with_:
            near = [by_n[m]["p99_ms"] for m in (r["chunk"] - 1, r["chunk"] + 1)
                    if m in by_n and not by_n[m]["slot_operation"]]
            if near:
                paired.append(r["p99_ms"] / statistics.mean(near))
        if paired:
            out.append(f"  p99 of each chunk with, over the mean of its neighbours without: "
                       + ", ".join(f"{x:.2f}" for x in paired)
                       + f"; median {statistics.median(paired):.3f}")
        tw = statistics.median(r["turns_per_second"] for r in with_)
        tn = statistics.median(r["turns_per_second"] for r in without)
        out.append(f"  median throughput: {tw:.0f} turns/s with, {tn:.0f} without")
        out.append(f"  target (a partition drop moves p99 by at most 5 %): ratio {a / b:.3f} — "
                   f"{'met' if a / b <= 1.05 else 'NOT MET'}")
    else:
        out.append("  no comparison: no chunk with a slot operation, or none without")

    # samples.csv with t relative to the load's start, for plotting.
    with open(f"{opts.out}/samples.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "unix_time", "bytes", "rows"]
                   + [f"rows_{s}" for s in range(SLOTS)] + ["rows_legacy"]
                   + [f"bytes_{s}" for s in range(SLOTS)] + ["bytes_legacy"])
        for s in samples:
            w.writerow([round(s["t"] - t0, 2), s["t"], int(s["bytes"]), int(s["rows"])]
                       + [int(x) for x in s["slot_rows"]] + [int(s["legacy_rows"])]
                       + [int(x) for x in s["slot_bytes"]] + [int(s["legacy_bytes"])])
    print("\n".join(out))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report")
    r.add_argument("dir")
    r.add_argument("--retention", type=float, required=True)
    r.add_argument("--width", type=float, required=True)
    r.add_argument("--chunk", type=float, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--distinct-keys", default="")
    opts = p.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    report(opts)


if __name__ == "__main__":
    main()
