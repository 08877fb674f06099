"""The gateway side of bench/double_text_storm.sh: one user double-texting a slow bot, on three
replicas, one of which is SIGKILLed midway; then the checks, from the calls' answers and from
PostgreSQL. Prints a human summary to stderr and one JSON object on the last line of stdout.

    python3 storm.py --policy coalesce --targets 127.0.0.1:1,127.0.0.1:2,127.0.0.1:3 \\
        --pids 11,12,13 --kill 1 --kill-at-ms 10000 --gen DIR --psql "psql -h … -Atq" \\
        --conversation storm-coalesce-abcd

It plays a gateway: message 1 goes to replica 0 at once, messages 2..6 follow every --gap-ms
(after --first-gap-ms) to replicas 1, 2, 1, 2, 1, each a ProcessTurn of the `llm` bot with its
own activity id. A call that fails because its replica is gone (UNAVAILABLE: connection reset or
refused) is sent again, the same activity, to the next replica not known to be gone, as a
channel redelivers. At --kill-at-ms it SIGKILLs replica --kill (pid from --pids). Meanwhile it
watches the conversation's committed state (psql `\\watch`, every 50 ms) so that a `tool_use`
without its `tool_result` in any committed version would be seen, not only in the last one.

Needs grpcio and grpcio-tools (PYTHONPATH); it generates the stubs of proto/turnstile/v1/turn.proto
and of google.rpc's Status and ErrorInfo (the two messages it reads, written out below) into --gen.
"""

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time

BOT = "llm"
CHANNEL = "storm"
# Messages: one word each, so that the first answer is the bot's 34 words.
TEXTS = ["first", "second", "third", "fourth", "fifth", "sixth"]
# Replica of each message: the first to replica 0, the others alternating between 1 and 2.
REPLICAS = [0, 1, 2, 1, 2, 1]

STATUS_PROTO = """
syntax = "proto3";
package storm.rpc;
import "google/protobuf/any.proto";
// google.rpc.Status and google.rpc.ErrorInfo, field for field.
message Status { int32 code = 1; string message = 2; repeated google.protobuf.Any details = 3; }
message ErrorInfo { string reason = 1; string domain = 2; map<string, string> metadata = 3; }
"""


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def generate(gen, proto_root):
    """Generates the stubs into `gen` (once) and imports them."""
    os.makedirs(gen, exist_ok=True)
    if not os.path.exists(os.path.join(gen, "storm_status_pb2.py")):
        import grpc_tools
        from grpc_tools import protoc

        include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        with open(os.path.join(gen, "storm_status.proto"), "w", encoding="utf-8") as f:
            f.write(STATUS_PROTO)
        for args in (
            [f"-I{proto_root}", "turnstile/v1/turn.proto"],
            [f"-I{gen}", "storm_status.proto"],
        ):
            code = protoc.main(
                ["protoc", f"-I{include}", f"--python_out={gen}", f"--grpc_python_out={gen}"]
                + args
            )
            if code != 0:
                raise SystemExit(f"protoc failed on {args[-1]}")
    sys.path.insert(0, gen)


class Watcher:
    """Every committed version of the conversation's state seen, through `psql` and `\\watch`."""

    def __init__(self, psql, key, interval):
        sql = (
            "SELECT version, state::text FROM turnstile.turnstile_state "
            f"WHERE key = '{key}' \\watch {interval}\n"
        )
        self.proc = subprocess.Popen(
            psql, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True,
        )
        self.proc.stdin.write(sql)
        self.proc.stdin.flush()
        self.versions = {}

    async def run(self):
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, self.proc.stdout.readline)
            if not line:
                return
            version, sep, state = line.rstrip("\n").partition("|")
            if sep and version.isdigit() and int(version) not in self.versions:
                self.versions[int(version)] = json.loads(state)

    def stop(self):
        self.proc.kill()


def dangling(transcript):
    """The ids of tool_use entries with no tool_result after them."""
    open_calls = []
    for entry in transcript:
        if entry.get("role") == "tool_use":
            open_calls.append(entry.get("tool_use_id"))
        elif entry.get("role") == "tool_result" and entry.get("tool_use_id") in open_calls:
            open_calls.remove(entry.get("tool_use_id"))
    return open_calls


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--targets", required=True)
    p.add_argument("--pids", required=True)
    p.add_argument("--kill", type=int, default=-1, help="replica to SIGKILL (-1: none)")
    p.add_argument("--kill-at-ms", type=int, default=10000)
    p.add_argument("--first-gap-ms", type=int, default=1000)
    p.add_argument("--gap-ms", type=int, default=500)
    p.add_argument("--call-timeout", type=float, default=300.0)
    p.add_argument("--conversation", required=True)
    p.add_argument("--gen", required=True)
    p.add_argument("--proto", default=os.path.join(os.path.dirname(__file__), "..", "..", "proto"))
    p.add_argument("--psql", required=True)
    opts = p.parse_args()

    generate(opts.gen, opts.proto)
    import grpc
    import storm_status_pb2
    from turnstile.v1 import turn_pb2, turn_pb2_grpc

    targets = opts.targets.split(",")
    pids = [int(x) for x in opts.pids.split(",")]
    channels = [grpc.aio.insecure_channel(t) for t in targets]
    stubs = [turn_pb2_grpc.TurnServiceStub(c) for c in channels]
    gone = set()  # replicas a call found gone
    run_tag = opts.conversation.rsplit("-", 1)[-1]
    ids = [f"{run_tag}-m{i + 1}" for i in range(len(TEXTS))]
    psql = shlex.split(opts.psql)
    conv_key = f"{BOT}/{CHANNEL}/conversations/{opts.conversation}"

    watcher = Watcher(psql, conv_key, 0.05)
    watching = asyncio.ensure_future(watcher.run())
    t0 = time.monotonic()
    now_ms = lambda: (time.monotonic() - t0) * 1000.0  # noqa: E731

    def reason_of(err):
        for key, value in err.trailing_metadata() or ():
            if key == "grpc-status-details-bin":
                status = storm_status_pb2.Status.FromString(value)
                for detail in status.details:
                    if detail.type_url.endswith("google.rpc.ErrorInfo"):
                        return storm_status_pb2.ErrorInfo.FromString(detail.value).reason
        return None

    def request(i):
        activity = turn_pb2.Activity(
            type="message",
            id=ids[i],
            channel_id=CHANNEL,
            text=TEXTS[i],
        )
        activity.conversation.id = opts.conversation
        getattr(activity, "from").id = "storm-user"
        activity.recipient.id = "bot"
        return turn_pb2.ProcessTurnRequest(activity=activity, bot=BOT)

    async def send(i):
        """Message i, sent and redelivered until a replica answers; every call recorded."""
        calls = []
        replica = REPLICAS[i]
        for _ in range(10):
            call = {"replica": replica, "sent_ms": now_ms()}
            calls.append(call)
            try:
                reply = await stubs[replica].ProcessTurn(request(i), timeout=opts.call_timeout)
                call.update(
                    end_ms=now_ms(),
                    code="OK",
                    superseded=reply.superseded,
                    coalesced=list(reply.coalesced),
                    redelivered=reply.redelivered,
                    attempts=reply.attempts,
                    version=reply.version,
                    replies=[a.text for a in reply.activities],
                )
                break
            except grpc.aio.AioRpcError as err:
                call.update(
                    end_ms=now_ms(),
                    code=err.code().name,
                    reason=reason_of(err),
                    message=err.details(),
                )
                if err.code() != grpc.StatusCode.UNAVAILABLE or call["reason"]:
                    # Not a replica gone (a refusal, a deadline): the gateway's answer.
                    break
                gone.add(replica)
                alive = [r for r in range(len(stubs)) if r not in gone]
                if not alive:
                    break
                # The next replica along that is not known to be gone.
                replica = min(alive, key=lambda r: (r - replica) % len(stubs))
                await asyncio.sleep(0.1)
        return calls

    async def killer():
        if opts.kill < 0:
            return None
        await asyncio.sleep(opts.kill_at_ms / 1000.0)
        os.kill(pids[opts.kill], signal.SIGKILL)
        at = now_ms()
        log(f"  {at:8.0f} ms  SIGKILL replica {opts.kill} (pid {pids[opts.kill]})")
        return at

    async def scheduled(i):
        delay = 0 if i == 0 else opts.first_gap_ms + (i - 1) * opts.gap_ms
        await asyncio.sleep(delay / 1000.0)
        return await send(i)

    killing = asyncio.ensure_future(killer())
    results = await asyncio.gather(*(scheduled(i) for i in range(len(TEXTS))))
    killed_at = await killing
    await asyncio.sleep(0.3)  # one more sample of the committed state
    watcher.stop()
    await asyncio.wait_for(watching, 5)
    for c in channels:
        await c.close()

    # --- what PostgreSQL committed --------------------------------------------------------------
    def query(sql):
        return subprocess.run(psql + ["-c", sql], check=True, capture_output=True, text=True).stdout

    state_text = query(f"SELECT state::text FROM turnstile.turnstile_state WHERE key = '{conv_key}'").strip()
    state = json.loads(state_text) if state_text else {}
    transcript = state.get("transcript", [])
    receipts = {}
    for line in query(
        "SELECT key, payload::text FROM turnstile.turnstile_receipt "
        f"WHERE key LIKE '{conv_key}/activities/%'"
    ).splitlines():
        key, _, payload = line.partition("|")
        activity = key.rsplit("/", 1)[-1]
        receipts.setdefault(activity, []).append(json.loads(payload))
    hold = query(f"SELECT version, state::text FROM turnstile.turnstile_state WHERE key = '{conv_key}/%hold'")

    # --- checks ---------------------------------------------------------------------------------
    users = [e for e in transcript if e.get("role") == "user"]
    user_ids = [e.get("activity_id") for e in users]
    answers = [e for e in transcript if e.get("role") == "assistant"]
    tool_uses = [e for e in transcript if e.get("role") == "tool_use"]
    final = [calls[-1] for calls in results]
    refused = [
        ids[i] for i, c in enumerate(final)
        if c["code"] == "FAILED_PRECONDITION" and c.get("reason") == "CONVERSATION_BUSY"
    ]
    lost = [a for a in ids if a not in receipts and a not in refused]
    doubled = sorted({a for a in user_ids if user_ids.count(a) > 1})
    in_order = [a for a in user_ids if a in ids]
    dangling_final = dangling(transcript)
    dangling_any = {v: d for v, s in watcher.versions.items() if (d := dangling(s.get("transcript", [])))}
    superseded_at = [
        (i, c["end_ms"]) for i, calls in enumerate(results) for c in calls if c.get("superseded")
    ]
    second_sent = results[1][0]["sent_ms"]
    # Each superseded call against the first sending of the message after it (its interrupter,
    # when the messages arrive in order).
    interrupts = [
        round(t - results[i + 1][0]["sent_ms"], 1)
        for i, t in superseded_at if i + 1 < len(results)
    ]
    first_superseded = min((t for _, t in superseded_at), default=None)
    refused_committed = [a for a in refused if a in receipts or a in user_ids]
    errors = [
        {"id": ids[i], **c} for i, c in enumerate(final)
        if c["code"] != "OK" and not (c["code"] == "FAILED_PRECONDITION" and c.get("reason") == "CONVERSATION_BUSY")
    ]
    seen = sorted(watcher.versions)
    summary = {
        "policy": opts.policy,
        "conversation": opts.conversation,
        "killed_replica": opts.kill if opts.kill >= 0 else None,
        "killed_at_ms": killed_at,
        "runs_committed": len(answers),
        "tool_uses": len(tool_uses),
        "attempts_reported": sum(c.get("attempts", 0) for c in final if c["code"] == "OK" and not c.get("redelivered")),
        "receipts": len(receipts),
        "receipts_per_activity_max": max((len(v) for v in receipts.values()), default=0),
        "lost": lost,
        "doubled": doubled,
        "transcript_user_order": in_order,
        "send_order": ids,
        "in_send_order": in_order == ids,
        "dangling_tool_use_final": dangling_final,
        "dangling_tool_use_any_version": dangling_any,
        "versions_seen": seen,
        "refused": refused,
        "refused_committed": refused_committed,
        "interrupt_latency_ms": (first_superseded - second_sent) if first_superseded is not None else None,
        "interrupt_latencies_ms": interrupts,
        "superseded_returns": [{"id": ids[i], "ms": round(t, 1)} for i, t in superseded_at],
        "errors": errors,
        "redeliveries": sum(len(c) - 1 for c in results),
        "calls": {ids[i]: calls for i, calls in enumerate(results)},
        "receipt_flags": {
            a: {k: v for k, v in r[0].items() if k != "activities"} for a, r in receipts.items()
        },
        "hold_row": hold.strip(),
        "transcript": [
            {k: v for k, v in e.items() if k != "text" or e.get("role") != "assistant"}
            for e in transcript
        ],
    }

    # --- a human account --------------------------------------------------------------------------
    log(f"== {opts.policy}: conversation {opts.conversation}")
    for i, calls in enumerate(results):
        for c in calls:
            flags = [f for f in ("superseded", "redelivered") if c.get(f)]
            if c.get("coalesced"):
                flags.append("coalesced=" + ",".join(x.rsplit("-", 1)[-1] for x in c["coalesced"]))
            what = c["code"] + (f" {c['reason']}" if c.get("reason") else "")
            if c["code"] == "OK":
                what += f" attempts={c['attempts']} version={c['version']} replies={len(c['replies'])}"
            log(
                f"  {ids[i]:>12} -> replica {c['replica']}  sent {c['sent_ms']:8.0f} ms  "
                f"back {c['end_ms']:8.0f} ms  {what} {' '.join(flags)}"
            )
    log(f"  transcript: {[e.get('role') + (':' + e['activity_id'].rsplit('-', 1)[-1] if e.get('activity_id') else '') for e in transcript]}")
    for key in (
        "runs_committed", "receipts", "lost", "doubled", "in_send_order", "dangling_tool_use_final",
        "dangling_tool_use_any_version", "refused", "refused_committed", "interrupt_latency_ms", "interrupt_latencies_ms",
        "redeliveries", "errors",
    ):
        value = summary[key]
        if key == "errors":
            value = [(e["id"], e["code"], e.get("reason"), e.get("message")) for e in value]
        log(f"  {key}: {value}")
    log(f"  committed versions seen: {seen}")
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
