#!/usr/bin/env bash
# A double-text storm: the double-text issue's target "a fake-LLM bot taking 20 s, modelling a
# tool call as a tool_use/tool_result pair in conversation state; three replicas, one SIGKILLed
# midway; five more messages from the user during the first turn, sent to different replicas",
# once per double-text policy, each against its expectation:
#
#   coalesce   2 bot runs, 6 receipts, 0 lost, 0 doubled
#   interrupt  the first run cancelled within 100 ms of the second message; no committed state
#              holds a tool_use without its tool_result
#   reject     5 named refusals (CONVERSATION_BUSY), nothing committed for them
#   enqueue    6 runs, in arrival order
#
#   bench/double_text_storm.sh                      the four policies, in that order (~6 minutes)
#   bench/double_text_storm.sh coalesce reject      some of them
#   KILLS="coalesce=0" bench/double_text_storm.sh coalesce   another replica to kill (none: -1)
#   bench/double_text_storm.sh enqueue+serialized   a policy with --serialized-bots llm too, so
#                                                   that enqueued turns wait at the hold, as the
#                                                   other policies' do, instead of running at once
#   TURN_MS=5000 KILL_AT_MS=2500 bench/double_text_storm.sh  a small run
#   NO_BUILD=1 ...                                  measures target/release as it is
#   KEEP=1 ...                                      keeps the scratch directory (server logs)
#
# The workload: for each policy, three replicas of the release server as shipped (RUST_LOG unset,
# default settings) on one PostgreSQL (a throwaway cluster, bench/pg.sh), each started with
# `--double-text llm=POLICY` and the `llm` sample bot paced by `--llm-token-delay-ms` so that its
# first run takes TURN_MS (20 s): 6 words' time for its tool call (src/bots/llm.rs,
# TOOL_CALL_WORDS) and 34 words of answer to a one-word message. Each run appends to the
# conversation's transcript the user's message(s), a tool_use, the tool_result, and the answer.
#
# The gateway is bench/drivers/storm.py (Python 3.11, grpcio and grpcio-tools installed under
# target/tools, from the wheelhouse the worker tests keep there when it exists): message 1 to
# replica 0 at 0 s; messages 2..6 from 1 s, 0.5 s apart, to replicas 1, 2, 1, 2, 1 — one user,
# one conversation, each message its own activity id. A call that fails because its replica is
# gone (UNAVAILABLE) is sent again, the same activity, to the next live replica, as a channel
# redelivers. At KILL_AT_MS (10 s, the first turn's middle) the driver SIGKILLs one replica,
# chosen where it hurts each policy (KILLS):
#   coalesce, enqueue: replica 1, which holds calls waiting behind the first turn (messages 2, 4
#              and 6): their messages were already announced (coalesce: on the hold's waiting
#              list in PostgreSQL) by a replica that then dies, and come back as redeliveries;
#   interrupt: replica 1, which by then runs the latest message's turn (message 6, which
#              superseded 1..5): the superseded messages handed on in its hold must survive it;
#   reject:    replica 0, which runs the first turn (the only one that ever runs; the refused
#              calls leave nothing waiting anywhere): the first message's redelivery must be let
#              in, not refused, and run once the dead replica's hold has lapsed.
# Checks (driver): the final conversation state and receipts, read with psql from
# `turnstile_state` and `turnstile_receipt` — committed runs (assistant entries), receipts per
# activity, lost (no receipt and no refusal), doubled (a user message twice in the transcript),
# the order of the user messages, tool_use entries without their tool_result (in the final state
# and in every committed version seen while the storm ran, sampled every 50 ms), the refusals'
# reason, and the interrupt latency (from sending message 2 to the first call answering
# `superseded: true`). Results and server logs:
# target/artifacts/bench/double-text-storm/POLICY-killN.json (N: the replica killed, -1 none).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TURN_MS=${TURN_MS:-20000}
KILL_AT_MS=${KILL_AT_MS:-$((TURN_MS / 2))}
KILLS=${KILLS:-}
POLICIES=("$@")
[ ${#POLICIES[@]} -gt 0 ] || POLICIES=(coalesce interrupt reject enqueue)
# The first run: the tool call (6 words' time) and 34 words of answer to a one-word message.
WORDS=$((6 + 34))
DELAY_MS=$((TURN_MS / WORDS))

[ -n "${NO_BUILD:-}" ] || cargo build --release --bins -q
BIN=${BIN:-$ROOT/target/release}
TOOLS=$ROOT/target/tools
ARTIFACTS=$ROOT/target/artifacts/bench/double-text-storm
mkdir -p "$ARTIFACTS"

# grpcio and grpcio-tools for the driver, installed once (offline from the worker tests'
# wheelhouse when it is there).
PYDEPS=$TOOLS/python-storm-grpcio-1.76.0
if [ ! -d "$PYDEPS/grpc_tools" ]; then
    wheels=$(ls -d "$TOOLS"/python-worker-wheels-"$(python3 -c 'import sys; print(sys.implementation.cache_tag)')"-* 2>/dev/null | head -n 1 || true)
    pip_env=(PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1)
    [ -n "$wheels" ] && pip_env+=(PIP_NO_INDEX=1 "PIP_FIND_LINKS=$wheels")
    rm -rf "$PYDEPS.tmp"
    env "${pip_env[@]}" python3 -m pip install --quiet --target "$PYDEPS.tmp" \
        grpcio==1.76.0 grpcio-tools==1.76.0
    mv "$PYDEPS.tmp" "$PYDEPS"
fi

. bench/pg.sh
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    stop_pg
    [ -n "${WORK:-}" ] || return 0
    if [ -n "${KEEP:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
start_pg double-text-storm
DB=postgres://postgres@127.0.0.1:$PORT/postgres
PSQL="psql -h 127.0.0.1 -p $PORT -U postgres -d postgres -Atq"
"$BIN/turnstile" migrate --database-url "$DB" >/dev/null 2>&1

kill_for() { # POLICY: the replica to SIGKILL
    local entry
    for entry in $KILLS; do
        [ "${entry%%=*}" = "$1" ] && { echo "${entry#*=}"; return; }
    done
    case ${1%%+*} in reject) echo 0 ;; *) echo 1 ;; esac
}

RUN=$(printf '%06x' $((RANDOM * 32768 + RANDOM)))
echo "== $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo '+changes'), $(nproc) cores; first run ${TURN_MS} ms (${DELAY_MS} ms a word), SIGKILL at ${KILL_AT_MS} ms" >&2
NAMES=()
for policy in "${POLICIES[@]}"; do
    dir=$WORK/$policy
    mkdir -p "$dir"
    ports=() pids=()
    flags=(--double-text "llm=${policy%%+*}")
    [ "$policy" = "${policy%%+*}+serialized" ] && flags+=(--serialized-bots llm)
    for r in 0 1 2; do
        port=$(free_port)
        env -u RUST_LOG "$BIN/turnstile" serve --listen "127.0.0.1:$port" --gateway-listen off \
            --database-url "$DB" --llm-token-delay-ms "$DELAY_MS" "${flags[@]}" \
            >"$dir/server-$r.log" 2>&1 &
        pids+=($!)
        PIDS+=($!)
        ports+=("$port")
    done
    for r in 0 1 2; do
        for _ in $(seq 1 300); do
            (exec 3<>"/dev/tcp/127.0.0.1/${ports[$r]}") 2>/dev/null && break
            kill -0 "${pids[$r]}" 2>/dev/null || { cat "$dir/server-$r.log" >&2; exit 1; }
            sleep 0.1
        done
    done
    kill_replica=$(kill_for "$policy")
    PYTHONPATH=$PYDEPS python3 bench/drivers/storm.py --policy "$policy" \
        --targets "127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}" \
        --pids "${pids[0]},${pids[1]},${pids[2]}" --kill "$kill_replica" \
        --kill-at-ms "$KILL_AT_MS" --conversation "storm-$policy-$RUN" --gen "$WORK/gen" \
        --psql "$PSQL" >"$dir/result.json"
    name=$policy-kill$kill_replica
    NAMES+=("$name")
    tail -n 1 "$dir/result.json" >"$ARTIFACTS/$name.json"
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    for r in 0 1 2; do cp "$dir/server-$r.log" "$ARTIFACTS/$name-server-$r.log"; done
done

# The table: each policy against its expectation.
python3 - "$ARTIFACTS" "${NAMES[@]}" <<'EOF'
import json, sys
artifacts, names = sys.argv[1], sys.argv[2:]
print("| policy | expected | measured | met |")
print("|---|---|---|---|")
for name in names:
    r = json.load(open(f"{artifacts}/{name}.json"))
    policy = r["policy"]
    common = (f"receipts {r['receipts']}, lost {len(r['lost'])}, doubled {len(r['doubled'])}, "
              f"redeliveries {r['redeliveries']}, errors {len(r['errors'])}")
    dangling = bool(r["dangling_tool_use_final"] or r["dangling_tool_use_any_version"])
    base = policy.split("+")[0]
    if base == "coalesce":
        expected = "2 bot runs, 6 receipts, 0 lost, 0 doubled"
        met = (r["runs_committed"] == 2 and r["receipts"] == 6 and not r["lost"]
               and not r["doubled"])
        measured = f"{r['runs_committed']} runs committed; {common}"
    elif base == "interrupt":
        expected = "first run cancelled ≤ 100 ms after message 2; no tool_use without tool_result"
        lat = r["interrupt_latency_ms"]
        met = lat is not None and lat <= 100 and not dangling
        later = ", ".join(f"{x:.0f}" for x in r["interrupt_latencies_ms"][1:])
        measured = (f"cancelled {lat:.0f} ms after message 2 (the later ones: {later} ms); " if lat is not None else "never cancelled; ") + \
                   f"dangling tool_use: {'yes' if dangling else 'none'} in {len(r['versions_seen'])} versions; " + \
                   f"{r['runs_committed']} runs committed; {common}"
    elif base == "reject":
        expected = "5 refusals (CONVERSATION_BUSY), nothing committed for them"
        met = len(r["refused"]) == 5 and not r["refused_committed"]
        measured = (f"{len(r['refused'])} refusals, {len(r['refused_committed'])} of them committed; "
                    f"{r['runs_committed']} runs committed; {common}")
    else:
        expected = "6 runs in arrival order"
        met = r["runs_committed"] == 6 and r["in_send_order"]
        order = " ".join(a.rsplit("-", 1)[-1] for a in r["transcript_user_order"])
        measured = f"{r['runs_committed']} runs committed, order {order}; {common}"
    print(f"| {policy} (SIGKILL replica {r['killed_replica']}) | {expected} | {measured} | {'yes' if met else '**no**'} |")
EOF
