"""The client side of bench/erasure.sh: erasing 10,000 users while turns run. Subcommands:

    erasure.py worker ADDR                 the `notes` bot worker (the Python SDK, importable)
    erasure.py seed  --targets A,B ...     every user's turns; one JSON object on stdout
    erasure.py load  --targets A,B ...     turns of the kept users until SIGTERM; JSON on stdout
    erasure.py erase --targets A,B ...     EraseUser for every erased user; JSON on stdout
    erasure.py scan  --psql "psql …"       full scans of every table; JSON on stdout
    erasure.py report DIR                  the summary of DIR/*.json, and whether the target held

The users, on channel `erasure`: ERASED users `erase-user-NNNNN-xx` and KEPT users
`keep-user-NNNNN-xx` (a five-digit number and two characters derived from it), so that a scan
can look for the prefix `erase-user-`: it matches every erased id and no other text. Each user
has a conversation of their own (`dm-eNNNNN`, `dm-kNNNNN`) and shares one of --groups group
conversations (`group-NNNN`) with the others whose number is the same modulo --groups, erased and
kept users together. No conversation id or activity id contains a user id.

Each user's seed turns, in order (four turns, four receipts, four state rows of their own):
  notes       @ dm     "note 1 …"  user scope + private conversation scope (+ the dm's counter)
  notes       @ dm     "note 2 …"  the same rows again (version 2)
  notes       @ group  "note …"    private conversation scope in the group (+ the group's counter)
  user-state  @ dm     "set …"     the shipped conformance bot's user scope
Every text carries the user's id, so that the user's rows hold it in their content as well as in
their keys. The `notes` bot keeps no user id in the conversation scope (only a counter): what a
bot copies into shared state is beyond erasure's reach (README, "Your data"), and would be found.

The load: LOAD_CONCURRENCY closed-loop callers, each turn a random kept user's, one of the three
kinds of seed turns at random (notes @ dm, notes @ group, user-state @ dm), spread over the
targets; each call's completion time and latency are recorded. The erasures: ERASE_CONCURRENCY
callers taking the erased users from one queue, caller k on target k mod len(targets); each
call's latency, and its record (scopes by bot and kind, receipts).

Needs grpcio and grpcio-tools (PYTHONPATH or a venv); the stubs of proto/turnstile/v1/turn.proto
and admin.proto are generated into --gen.
"""

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time

CHANNEL = "erasure"
ERASED_PREFIX = "erase-user-"
KEPT_PREFIX = "keep-user-"
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
ERASED_RE = r"erase-user-[0-9]{5}-[a-z0-9]{2}"
MAIN_TABLES = ("turnstile_state", "turnstile_receipt", "turnstile_tombstone")
PROTO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def user_id(prefix, n):
    return f"{prefix}{n:05d}-{ALPHABET[(7 * n + 23) % 36]}{ALPHABET[(13 * n + 5) % 36]}"


def dm_of(prefix, n):
    return f"dm-{prefix[0]}{n:05d}"


def group_of(n, groups):
    return f"group-{n % groups:04d}"


def _family(table):
    """`turnstile_lock_0003` → `turnstile_lock_*`: the lock tables are many."""
    return re.sub(r"_[0-9]+$", "_*", table)


def percentile(values, p):
    """Nearest-rank percentile of `values` (sorted or not); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1]


# --- the bot worker ------------------------------------------------------------------------------


def worker(address):
    from turnstile_worker import Worker

    w = Worker()

    @w.bot("notes")
    async def notes(turn):
        """Notes a message: the user's last note and count (user scope), their notes in this
        conversation (private conversation scope), and the conversation's message count (its
        scope: no user id there)."""
        if turn.activity.get("type") != "message":
            return
        text = turn.text
        turn.conversation["messages"] = turn.conversation.get("messages", 0) + 1
        if turn.user is not None:
            turn.user["notes"] = turn.user.get("notes", 0) + 1
            turn.user["last"] = text
        if turn.private_conversation is not None:
            kept = list(turn.private_conversation.get("notes", []))
            turn.private_conversation["notes"] = (kept + [text])[-4:]
        turn.send(f"Noted: {text}")

    asyncio.run(w.serve(address))


# --- gRPC clients --------------------------------------------------------------------------------


def stubs_module(gen):
    """Generates the stubs into `gen` (once) and imports them."""
    os.makedirs(gen, exist_ok=True)
    if not os.path.exists(os.path.join(gen, "turnstile", "v1", "admin_pb2_grpc.py")):
        import grpc_tools
        from grpc_tools import protoc

        include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        for proto in ("turnstile/v1/turn.proto", "turnstile/v1/admin.proto"):
            code = protoc.main(
                ["protoc", f"-I{include}", f"-I{PROTO_ROOT}", f"--python_out={gen}",
                 f"--grpc_python_out={gen}", proto]
            )
            if code != 0:
                raise SystemExit(f"protoc failed on {proto}")
    sys.path.insert(0, gen)


def activity_json(aid, user, conversation, text):
    return json.dumps(
        {
            "type": "message",
            "id": aid,
            "channelId": CHANNEL,
            "serviceUrl": "https://erasure.invalid/",
            "from": {"id": user, "name": user},
            "recipient": {"id": "bot", "name": "bot"},
            "conversation": {"id": conversation},
            "text": text,
        }
    )


class Turns:
    """ProcessTurn over several targets, each call's outcome kept."""

    def __init__(self, targets, timeout):
        import grpc
        from turnstile.v1 import turn_pb2, turn_pb2_grpc

        self.grpc = grpc
        self.pb = turn_pb2
        self.channels = [grpc.aio.insecure_channel(t) for t in targets]
        self.stubs = [turn_pb2_grpc.TurnServiceStub(c) for c in self.channels]
        self.timeout = timeout

    async def send(self, target, bot, aid, user, conversation, text):
        """Returns (code name, latency in seconds)."""
        request = self.pb.ProcessTurnRequest(
            activity_json=activity_json(aid, user, conversation, text), bot=bot
        )
        start = time.perf_counter()
        try:
            await self.stubs[target % len(self.stubs)].ProcessTurn(request, timeout=self.timeout)
            code = "OK"
        except self.grpc.aio.AioRpcError as err:
            code = err.code().name
        return code, time.perf_counter() - start

    async def close(self):
        for c in self.channels:
            await c.close()


def seed_turns(prefix, n, groups):
    """The seed turns of user `n`: (bot, conversation, text), in order."""
    user = user_id(prefix, n)
    dm = dm_of(prefix, n)
    return [
        ("notes", dm, f"note 1 from {user}: call me back"),
        ("notes", dm, f"note 2 from {user}: on Tuesday"),
        ("notes", group_of(n, groups), f"note from {user} to the group"),
        ("user-state", dm, f"set colour of {user} is teal"),
    ]


async def seed(opts):
    turns = Turns(opts.targets.split(","), opts.timeout)
    users = [(ERASED_PREFIX, n) for n in range(opts.erased)] + [
        (KEPT_PREFIX, n) for n in range(opts.kept)
    ]
    random.Random(1).shuffle(users)
    queue = asyncio.Queue()
    for u in users:
        queue.put_nowait(u)
    codes = {}
    failed = []
    latencies = []
    counter = iter(range(10**9))

    async def caller(k):
        while not queue.empty():
            prefix, n = queue.get_nowait()
            user = user_id(prefix, n)
            for bot, conversation, text in seed_turns(prefix, n, opts.groups):
                aid = f"s{next(counter)}"
                code, latency = await turns.send(k, bot, aid, user, conversation, text)
                codes[code] = codes.get(code, 0) + 1
                latencies.append(latency)
                if code != "OK":
                    failed.append({"user": user, "bot": bot, "code": code})

    start = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(opts.concurrency)))
    elapsed = time.perf_counter() - start
    await turns.close()
    n = sum(codes.values())
    log(f"seeded {len(users)} users, {n} turns in {elapsed:.1f} s ({n / elapsed:.0f} turns/s), "
        f"statuses {codes}, p99 {percentile(latencies, 99) * 1000:.0f} ms")
    print(json.dumps({"users": len(users), "erased": opts.erased, "kept": opts.kept,
                      "groups": opts.groups, "turns": n, "codes": codes, "seconds": elapsed,
                      "failed": failed[:20], "turns_per_user": 4}))


async def load(opts):
    turns = Turns(opts.targets.split(","), opts.timeout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    samples = []  # (completed at, wall clock; latency s; ok)
    counter = iter(range(10**9))
    rng = random.Random(2)

    async def caller(k):
        while not stop.is_set():
            n = rng.randrange(opts.kept)
            user = user_id(KEPT_PREFIX, n)
            kind = rng.randrange(3)
            if kind == 0:
                bot, conversation, text = "notes", dm_of(KEPT_PREFIX, n), f"more from {user}"
            elif kind == 1:
                bot, conversation, text = "notes", group_of(n, opts.groups), f"{user} again"
            else:
                bot, conversation, text = "user-state", dm_of(KEPT_PREFIX, n), f"set {user} {k}"
            code, latency = await turns.send(k, bot, f"l{next(counter)}", user, conversation, text)
            samples.append((time.time(), latency, code))

    started = time.time()
    tasks = [asyncio.ensure_future(caller(k)) for k in range(opts.concurrency)]
    await stop.wait()
    await asyncio.gather(*tasks)
    await turns.close()
    codes = {}
    for _, _, code in samples:
        codes[code] = codes.get(code, 0) + 1
    log(f"load: {len(samples)} turns, statuses {codes}")
    print(json.dumps({"started": started, "stopped": time.time(), "codes": codes,
                      "concurrency": opts.concurrency,
                      "samples": [[round(t, 4), round(l, 6), c] for t, l, c in samples]}))


async def erase(opts):
    import grpc
    from turnstile.v1 import admin_pb2, admin_pb2_grpc

    channels = [grpc.aio.insecure_channel(t) for t in opts.targets.split(",")]
    stubs = [admin_pb2_grpc.AdminServiceStub(c) for c in channels]
    metadata = (("authorization", f"Bearer {os.environ['ADMIN_TOKEN']}"),)
    # Warm the channels: a call on a connection being opened would count the connection's setup.
    for stub in stubs:
        await stub.EraseUser(admin_pb2.EraseUserRequest(channel_id=CHANNEL, user_id="nobody"),
                             metadata=metadata, timeout=30)
    ids = list(range(opts.erased))
    random.Random(3).shuffle(ids)
    queue = asyncio.Queue()
    for n in ids:
        queue.put_nowait(n)
    results = []

    async def caller(k):
        stub = stubs[k % len(stubs)]
        while not queue.empty():
            n = queue.get_nowait()
            user = user_id(ERASED_PREFIX, n)
            began = time.time()
            start = time.perf_counter()
            calls, codes = 0, []
            while True:
                calls += 1
                try:
                    answer = await stub.EraseUser(
                        admin_pb2.EraseUserRequest(channel_id=CHANNEL, user_id=user),
                        metadata=metadata, timeout=opts.timeout,
                    )
                    break
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code().name)
                    # UNAVAILABLE: a deadlock with a turn's commit, nothing deleted: ask again.
                    if err.code() != grpc.StatusCode.UNAVAILABLE or calls >= 5:
                        answer = None
                        break
            latency = time.perf_counter() - start
            record = answer.record if answer is not None else None
            results.append({
                "user": user,
                "began": round(began, 4),
                "latency": round(latency, 6),
                "calls": calls,
                "errors": codes,
                "ok": record is not None,
                "erasure_id": record.erasure_id if record else None,
                "scopes": [[s.bot, s.scope, s.key, s.version] for s in record.scopes]
                if record else [],
                "receipts": record.receipts if record else 0,
            })

    started = time.time()
    start = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(opts.concurrency)))
    elapsed = time.perf_counter() - start
    stopped = time.time()
    for c in channels:
        await c.close()
    lat = [r["latency"] for r in results]
    log(f"erased {len(results)} users in {elapsed:.1f} s ({len(results) / elapsed:.0f}/s), "
        f"p50 {percentile(lat, 50) * 1000:.0f} ms, p99 {percentile(lat, 99) * 1000:.0f} ms, "
        f"max {max(lat) * 1000:.0f} ms, failed {sum(not r['ok'] for r in results)}")
    print(json.dumps({"started": started, "stopped": stopped, "seconds": elapsed,
                      "concurrency": opts.concurrency, "targets": len(stubs),
                      "results": results}))


# --- the scans -----------------------------------------------------------------------------------


def psql_query(psql, sql):
    out = subprocess.run(psql + ["-F", "\t", "-c", sql], check=True, capture_output=True,
                         text=True).stdout
    return [line.split("\t") for line in out.splitlines() if line]


def erase_user_sql():
    """ERASE_USER as src/store/postgres.rs builds it (the `erase!` macro with its two
    conditions), read from the source so that the EXPLAIN below is of the statement shipped;
    None when the source no longer has that shape."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "store",
                        "postgres.rs")
    try:
        source = open(path, encoding="utf-8").read()
    except OSError:
        return None
    macro = re.search(r"macro_rules! erase \{.*?concat!\((.*?)\)\s*\};", source, re.S)
    user = re.search(r"const ERASE_USER: Sql = Sql \{\s*text: erase!\((.*?)\),\s*types", source,
                     re.S)
    if not macro or not user:
        return None

    def literals(text):
        # Rust string literals, `\` + newline + indentation dropped, `\"` unescaped.
        return [re.sub(r"\\\n\s*", "", s).replace('\\"', '"')
                for s in re.findall(r'"((?:[^"\\]|\\.)*)"', text, re.S)]

    parts = re.split(r"(\$state|\$receipts)", macro.group(1))
    state, receipts = literals(user.group(1))
    sql = ""
    for part in parts:
        if part == "$state":
            sql += state
        elif part == "$receipts":
            sql += receipts
        else:
            sql += "".join(literals(part))
    return sql


def scan(opts):
    psql = shlex.split(opts.psql)
    tables = [r[0] for r in psql_query(
        psql, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]
    result = {"at": time.time(), "tables": {}}
    # One pass over every row of each table (the CTE is materialized once): a whole-row
    # reference cannot come from any index, so each is a sequential scan by construction. One
    # psql for them all: the lock tables are a thousand.
    script = "".join(
        f"WITH r AS MATERIALIZED (SELECT t::text AS x FROM {table} t) "
        f"SELECT '{table}', count(*), "
        f"count(*) FILTER (WHERE strpos(x, '{ERASED_PREFIX}') > 0), "
        f"count(*) FILTER (WHERE strpos(x, '{KEPT_PREFIX}') > 0), "
        f"(SELECT count(DISTINCT m[1]) FROM r, regexp_matches(x, '({ERASED_RE})', 'g') m) "
        "FROM r;\n"
        for table in tables
    )
    start = time.perf_counter()
    out = subprocess.run(psql + ["-F", "\t"], input=script, check=True, capture_output=True,
                         text=True).stdout
    result["seconds"] = round(time.perf_counter() - start, 3)
    for line in out.splitlines():
        table, rows, erased, kept, distinct = line.split("\t")
        result["tables"][table] = {"rows": int(rows), "with_erased_id": int(erased),
                                   "with_kept_id": int(kept),
                                   "distinct_erased_ids": int(distinct)}
    if sorted(result["tables"]) != sorted(tables):
        raise SystemExit("the scan did not answer for every table")
    plan = psql_query(psql, "EXPLAIN SELECT t::text FROM turnstile_state t")
    result["plan_of_scan"] = plan[0][0].strip() if plan else None
    # The state rows and receipts by bot, scope and whose.
    whose = (f"CASE WHEN strpos(key, '{ERASED_PREFIX}') > 0 THEN 'erased' "
             f"WHEN strpos(key, '{KEPT_PREFIX}') > 0 THEN 'kept' ELSE 'nobody' END")
    kind = ("CASE WHEN split_part(key, '/', 3) = 'users' THEN 'user' "
            "WHEN split_part(key, '/', 5) = 'users' THEN 'private_conversation' "
            "WHEN split_part(key, '/', 5) = 'activities' THEN 'receipt' "
            "WHEN split_part(key, '/', 5) = '' THEN 'conversation' ELSE 'other' END")
    result["state_by_scope"] = [
        {"bot": b, "scope": s, "whose": w, "rows": int(c)}
        for b, s, w, c in psql_query(
            psql,
            f"SELECT split_part(key, '/', 1), {kind}, {whose}, count(*) FROM turnstile_state "
            "GROUP BY 1, 2, 3 ORDER BY 1, 2, 3")
    ]
    result["receipts_by_user"] = [
        {"bot": b, "whose": w, "rows": int(c)}
        for b, w, c in psql_query(
            psql,
            "SELECT split_part(key, '/', 1), "
            f"CASE WHEN strpos(payload->>'user', '{ERASED_PREFIX}') > 0 THEN 'erased' "
            f"WHEN strpos(payload->>'user', '{KEPT_PREFIX}') > 0 THEN 'kept' ELSE 'nobody' END, "
            "count(*) FROM turnstile_receipt GROUP BY 1, 2 ORDER BY 1, 2")
    ]
    if opts.tombstones:
        result["tombstones"] = {h: int(v) for h, v in psql_query(
            psql, "SELECT encode(key_hash, 'hex'), version FROM turnstile_tombstone")}
    if opts.explain:
        subject = f"{CHANNEL}/{user_id(KEPT_PREFIX, 0)}"
        sql = erase_user_sql()
        if sql is None:
            result["explain"] = None
        else:
            script = (
                "BEGIN;\nSET LOCAL plan_cache_mode = force_generic_plan;\n"
                f"PREPARE erase_user(text) AS {sql};\n"
                f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE erase_user('{subject}');\n"
                "ROLLBACK;\n"
            )
            out = subprocess.run(psql, input=script, check=True, capture_output=True,
                                 text=True).stdout
            result["explain"] = {"sql": sql, "plan": out.splitlines()}
    print(json.dumps(result))


def files(opts):
    """Where PostgreSQL's files still hold the bytes `erase-user-`, after a CHECKPOINT: one
    line, relations by name with their count of occurrences, and the WAL segments. The SQL scans
    see live rows only: a deleted row's bytes stay in its page (and its index entries in theirs)
    until the page is written over, and in the WAL until the segment is recycled."""
    psql = shlex.split(opts.psql)
    psql_query(psql, "CHECKPOINT")
    names = {f: n for f, n in psql_query(
        psql, "SELECT pg_relation_filenode(oid), relname FROM pg_class "
              "WHERE pg_relation_filenode(oid) IS NOT NULL")}
    db = psql_query(psql, "SELECT oid FROM pg_database WHERE datname = current_database()")[0][0]
    needle = ERASED_PREFIX.encode()
    found = {}
    base = os.path.join(opts.data, "base", db)
    for name in os.listdir(base):
        with open(os.path.join(base, name), "rb") as f:
            n = f.read().count(needle)
        if n:
            rel = names.get(re.sub(r"(_[a-z]+)?(\.[0-9]+)?$", "", name), name)
            found[rel] = found.get(rel, 0) + n
    wal_dir = os.path.join(opts.data, "pg_wal")
    wal = 0
    for name in os.listdir(wal_dir):
        path = os.path.join(wal_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                wal += needle in f.read()
    where = ", ".join(f"{rel} {n}" for rel, n in sorted(found.items(), key=lambda x: -x[1]))
    print(f"`erase-user-` in PostgreSQL's files {opts.label}: {sum(found.values())} times "
          f"({where or 'nowhere'}); in {wal} WAL segments")


# --- the report ----------------------------------------------------------------------------------


def report(opts):
    d = opts.dir
    load_ = json.load(open(f"{d}/load.json"))
    erase_ = json.load(open(f"{d}/erase.json"))
    before = json.load(open(f"{d}/scan-before.json"))
    after = json.load(open(f"{d}/scan-after.json"))
    seeded = json.load(open(f"{d}/seed.json"))
    out = []
    ok_all = True

    def check(label, good, detail):
        nonlocal ok_all
        ok_all &= bool(good)
        out.append(f"- {label}: {detail} — {'met' if good else 'NOT MET'}")

    # Erasure latency and throughput.
    results = erase_["results"]
    lat = sorted(r["latency"] for r in results)
    ms = lambda v: f"{v * 1000:.0f} ms" if v >= 0.01 else f"{v * 1000:.1f} ms"  # noqa: E731
    failed = [r for r in results if not r["ok"]]
    retried = [r for r in results if r["calls"] > 1]
    p99 = percentile(lat, 99)
    out.append(f"erasures: {len(results)} by {erase_['concurrency']} callers over "
               f"{erase_['targets']} replica(s) in {erase_['seconds']:.1f} s = "
               f"{len(results) / erase_['seconds']:.0f} erasures/s; "
               f"failed {len(failed)}, asked again {len(retried)}")
    out.append("per erasure: " + ", ".join(
        f"{name} {ms(percentile(lat, p))}" for name, p in
        (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("p99.9", 99.9))
    ) + f", max {ms(lat[-1])}")

    # The load, before / during / after the erasures.
    samples = load_["samples"]
    e0, e1 = erase_["started"], erase_["stopped"]
    t0 = load_["started"] + opts.warmup

    def window(a, b):
        inside = [s for s in samples if a <= s[0] < b]
        good = [s[1] for s in inside if s[2] == "OK"]
        bad = len(inside) - len(good)
        secs = b - a
        if secs <= 0 or not inside:
            return "no samples"
        return (f"{len(good) / secs:.0f} turns/s, p50 {ms(percentile(good, 50))}, "
                f"p99 {ms(percentile(good, 99))}, max {ms(max(good))}, errors {bad} "
                f"({secs:.0f} s)")

    out.append(f"turns of the kept users ({load_['concurrency']} in flight): "
               f"before {window(t0, e0)}; during {window(e0, e1)}; "
               f"after {window(e1, load_['stopped'])}")
    load_ok = load_["codes"].get("OK", 0)
    load_bad = sum(v for k, v in load_["codes"].items() if k != "OK")

    # What the records say against what was seeded.
    n_erased = seeded["erased"]
    scopes = {}
    for r in results:
        for bot, scope, _, _ in r["scopes"]:
            scopes[(bot, scope)] = scopes.get((bot, scope), 0) + 1
    rec_rows = sum(scopes.values())
    rec_receipts = sum(r["receipts"] for r in results)
    seeded_rows = sum(x["rows"] for x in before["state_by_scope"] if x["whose"] == "erased")
    seeded_receipts = sum(x["rows"] for x in before["receipts_by_user"] if x["whose"] == "erased")
    per_user = {(r["user"], len(r["scopes"]), r["receipts"]) for r in results}
    odd = [u for u, s, c in per_user if s != 4 or c != 4]
    out.append("records: " + ", ".join(f"{b} {s} {c}" for (b, s), c in sorted(scopes.items()))
               + f"; receipts {rec_receipts}")
    check("records add up to what was seeded",
          rec_rows == seeded_rows == 4 * n_erased and rec_receipts == seeded_receipts
          == 4 * n_erased and not odd and not failed,
          f"{rec_rows} state rows and {rec_receipts} receipts in {len(results)} records; "
          f"seeded (scan before) {seeded_rows} and {seeded_receipts} = 4 and 4 per user × "
          f"{n_erased}; users with other counts: {len(odd)}")

    # Tombstones: one per erased row, sha256 of its key, its recorded version.
    tomb = after.get("tombstones", {})
    missing = wrong = 0
    for r in results:
        for _, _, key, version in r["scopes"]:
            h = hashlib.sha256(key.encode()).hexdigest()
            if h not in tomb:
                missing += 1
            elif tomb[h] != version:
                wrong += 1
    check("tombstones", missing == 0 and wrong == 0 and len(tomb) == rec_rows,
          f"{len(tomb)} rows; of the {rec_rows} erased keys {missing} without a tombstone, "
          f"{wrong} with another version")

    # The full scans.
    out.append("full scans (rows containing `erase-user-` / distinct erased ids; "
               "rows containing `keep-user-`), before → after:")
    found = 0
    quiet = []  # tables with no user's id before or after: named together
    for table, a in sorted(after["tables"].items()):
        b = before["tables"].get(table, {"rows": 0, "with_erased_id": 0, "with_kept_id": 0,
                                         "distinct_erased_ids": 0})
        found += a["with_erased_id"] + a["distinct_erased_ids"]
        if table not in MAIN_TABLES and not any(
            x["with_erased_id"] or x["with_kept_id"] for x in (a, b)
        ):
            quiet.append((table, a["rows"]))
            continue
        out.append(f"  {table}: {b['rows']} → {a['rows']} rows; erased ids in "
                   f"{b['with_erased_id']} rows ({b['distinct_erased_ids']} ids) → "
                   f"{a['with_erased_id']} rows ({a['distinct_erased_ids']} ids); kept ids in "
                   f"{b['with_kept_id']} → {a['with_kept_id']} rows")
    if quiet:
        out.append(f"  {len(quiet)} other tables ({', '.join(sorted({_family(t) for t, _ in quiet}))}), "
                   f"{sum(r for _, r in quiet)} rows after: no id before or after")
    out.append(f"  every table scanned in {after['seconds']:.1f} s "
               f"(before: {before['seconds']:.1f} s); plan: {after.get('plan_of_scan')}")
    check("no erased id left (target: 0)", found == 0, f"{found} rows/ids found")

    # The kept users' data.
    def kept(scan_, table):
        return scan_["tables"].get(table, {}).get("with_kept_id", 0)

    kept_rows_b = sum(x["rows"] for x in before["state_by_scope"] if x["whose"] == "kept")
    kept_rows_a = sum(x["rows"] for x in after["state_by_scope"] if x["whose"] == "kept")
    kept_rec_b = sum(x["rows"] for x in before["receipts_by_user"] if x["whose"] == "kept")
    kept_rec_a = sum(x["rows"] for x in after["receipts_by_user"] if x["whose"] == "kept")
    check("the kept users' data intact",
          kept_rows_a == kept_rows_b == 4 * seeded["kept"]
          and kept_rec_a == kept_rec_b + load_ok
          and kept(after, "turnstile_state") == kept(before, "turnstile_state"),
          f"state rows {kept_rows_b} → {kept_rows_a} (4 per kept user × {seeded['kept']}); "
          f"receipts {kept_rec_b} → {kept_rec_a} (+{load_ok} turns committed by the load, "
          f"{load_bad} failed)")
    conv_b = sum(x["rows"] for x in before["state_by_scope"] if x["scope"] == "conversation")
    conv_a = sum(x["rows"] for x in after["state_by_scope"] if x["scope"] == "conversation")
    out.append(f"conversation scopes (no user's, not erased): {conv_b} → {conv_a}")

    check("p99 per erasure ≤ 1 s (target)", p99 <= 1.0, ms(p99))
    if after.get("explain"):
        out.append("EXPLAIN ANALYZE of ERASE_USER (generic plan, a kept user, rolled back):")
        out.extend("    " + line for line in after["explain"]["plan"]
                   if line and not line.startswith(("BEGIN", "SET", "PREPARE", "ROLLBACK")))
    out.append(f"target {'MET' if ok_all else 'NOT MET'}")
    print("\n".join(out))
    return 0 if ok_all else 1


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("address")
    for name in ("seed", "load", "erase"):
        s = sub.add_parser(name)
        s.add_argument("--targets", required=True)
        s.add_argument("--gen", required=True)
        s.add_argument("--erased", type=int, default=10000)
        s.add_argument("--kept", type=int, default=2000)
        s.add_argument("--groups", type=int, default=500)
        s.add_argument("--concurrency", type=int, default=16)
        s.add_argument("--timeout", type=float, default=60.0)
    s = sub.add_parser("scan")
    s.add_argument("--psql", required=True)
    s.add_argument("--tombstones", action="store_true")
    s.add_argument("--explain", action="store_true",
                   help="EXPLAIN ANALYZE ERASE_USER for the first kept user (rolled back)")
    f = sub.add_parser("files")
    f.add_argument("--psql", required=True)
    f.add_argument("--data", required=True)
    f.add_argument("--label", required=True)
    r = sub.add_parser("report")
    r.add_argument("dir")
    r.add_argument("--warmup", type=float, default=3.0)
    opts = p.parse_args()

    if opts.command == "worker":
        worker(opts.address)
    elif opts.command == "scan":
        scan(opts)
    elif opts.command == "files":
        files(opts)
    elif opts.command == "report":
        sys.exit(report(opts))
    else:
        stubs_module(opts.gen)
        asyncio.run({"seed": seed, "load": load, "erase": erase}[opts.command](opts))


if __name__ == "__main__":
    main()
