//! Rolling upgrades stay safe: during a rollout the previous release's replicas and this build's
//! serve the same conversations over the same database, and nothing may be lost or doubled
//! meanwhile.
//!
//! The previous release is the one CHANGELOG.md names; its `turnstile` binary is built from its
//! commit in this clone's history (`support::release`). Over one throwaway database, a rollout as
//! Kubernetes runs it, under a steady load of `counter` turns from a gateway that redelivers what
//! failed (the fault suite's load):
//!
//! 1. two old replicas start (migrating the schema as far as the old release knows) and serve;
//! 2. two new replicas start beside them, migrating to the newest schema while the old serve;
//! 3. one more old replica starts on that schema, as a pod of the old ReplicaSet restarted
//!    mid-rollout does, with migrations off as the chart runs its pods;
//! 4. all five serve together: the load goes to every one of them, turns committed by one binary
//!    are redelivered to the other, and a `serialized` bot's turns (held conversations: the
//!    conversation lock in the old release, the hold in this one) race across both;
//! 5. the old replicas are stopped with SIGTERM one by one, as a rollout stops pods, under load;
//! 6. the new replicas serve alone.
//!
//! Then the checker proves from every answer and the final state that every acknowledged turn is
//! counted exactly once, and every redelivery — within one binary or across them, before the
//! rollout or after — was answered from the turn's receipt, with the same replies, without the
//! bot's change being applied again.
//!
//! Erasure, new in this release, meets the old release too: a conversation deleted through a new
//! replica while an old one has it in its cache starts afresh, on the old replica or — refused
//! there with a status a gateway retries, nothing committed — on a new one; never a failure that
//! committed after all, and its deleted data does not come back.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng as _;
use support::check;
use support::fleet::{Fleet, Program};
use support::load::{self, Ack, Gateway, Record, Shape, Turn};
use support::release;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tonic::Code;
use turnstile::grpc::pb;
use turnstile::grpc::pb::admin_service_client::AdminServiceClient;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

const SHAPE: Shape = Shape {
    workers: 12,
    // Each phase's load runs until the test stops it.
    duration: Duration::ZERO,
    conversations: 40,
    hot: 2,
    hot_share: 0.3,
    call_timeout: Duration::from_secs(3),
    turn_bound: Duration::from_secs(20),
};

/// The old replicas serve alone this long before the new ones start.
const OLD_ALONE: Duration = Duration::from_secs(3);
/// Old and new serve together at least this long before the old ones are stopped.
const TOGETHER: Duration = Duration::from_secs(6);
/// Between one old replica's exit and the next one's SIGTERM.
const BETWEEN_STOPS: Duration = Duration::from_millis(500);
/// The new replicas serve alone this long after the last old one exited.
const NEW_ALONE: Duration = Duration::from_secs(3);

/// The conversations of the redelivery probes, after the load's: `old→new` and `new→old`, each
/// cold (the replica redelivered to never saw the conversation) and warm (it has its state in
/// its cache); then both ways warm again with the old pod started after the migration, all of
/// whose sessions were opened on the new schema.
const PROBES: usize = 6;

/// The `serialized` sample bot whose turns hold their conversation: the counter, a little slow.
const HELD_BOT: &str = "slow";
/// How long each of its runs takes.
const HELD_DELAY_MS: &str = "30";
/// Its conversations, all contended.
const HELD_CONVERSATIONS: usize = 2;
/// Workers sending it turns, to any replica of either binary.
const HELD_WORKERS: usize = 4;

/// The conversation of the erasure probe, and the sample bot it talks to (in both releases).
const ERASED: &str = "erased-1";
const ERASED_BOT: &str = "pizza";
/// Its key.
const ERASED_KEY: &str = "pizza/test/conversations/erased-1";
/// The new replicas' admin token (0.1.0 has no admin service).
const ADMIN: &str = "upgrade-admin-token";

const OLD: &str = "old";
const NEW: &str = "new";

/// A load through a gateway to some of the replicas, until stopped.
struct Phase {
    name: &'static str,
    /// Which binary each of the gateway's servers runs.
    binaries: Vec<&'static str>,
    gateway: Gateway,
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Phase {
    fn start(name: &'static str, servers: &[(SocketAddr, &'static str)]) -> Phase {
        let addrs: Vec<SocketAddr> = servers.iter().map(|(addr, _)| *addr).collect();
        let gateway = Gateway::new(&addrs, SHAPE.call_timeout);
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let gateway = gateway.clone();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move { gateway.run(SHAPE, name, stop).await })
        };
        Phase {
            name,
            binaries: servers.iter().map(|(_, binary)| *binary).collect(),
            gateway,
            stop,
            task,
        }
    }

    /// Stops the load, lets every turn under way finish, and returns what the gateway saw.
    async fn finish(self) -> Finished {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("a load panicked");
        Finished {
            name: self.name,
            binaries: self.binaries,
            record: self.gateway.take_record(),
        }
    }
}

/// A phase's record, with which binary each of its servers ran.
struct Finished {
    name: &'static str,
    binaries: Vec<&'static str>,
    record: Record,
}

impl Finished {
    fn binary(&self, ack: &Ack) -> &'static str {
        self.binaries[ack.server]
    }

    /// `name: N acks (old x, new y), z redelivered, f failed calls`.
    fn summary(&self) -> String {
        let by = |binary| {
            self.record
                .acks
                .iter()
                .filter(|a| self.binary(a) == binary)
                .count()
        };
        format!(
            "{}: {} acks ({} by old, {} by new), {} of them redelivered, {} failed calls {:?}",
            self.name,
            self.record.acks.len(),
            by(OLD),
            by(NEW),
            self.record.acks.iter().filter(|a| a.redelivered).count(),
            self.record.failures.len(),
            self.record.failures_by_kind()
        )
    }
}

/// How many of the receipts' indexes on text compare bytewise (`src/store/postgres/bytewise.rs`):
/// each slot's key index, and the conversation's and the user's over the slots.
async fn bytewise_indexes(url: &str) -> i64 {
    support::pg::session(url)
        .await
        .query_one(
            "SELECT count(*) FROM unnest(ARRAY['turnstile_receipt_0_pkey', \
                    'turnstile_receipt_1_pkey', 'turnstile_receipt_2_pkey', \
                    'turnstile_receipt_3_pkey', 'turnstile_receipt_conversation', \
                    'turnstile_receipt_user']) x \
               JOIN pg_index i ON i.indexrelid = format('turnstile.%s', x)::regclass \
               JOIN pg_opclass o ON o.oid = i.indclass[0] \
              WHERE o.opcname = 'text_pattern_ops' AND i.indisvalid",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The schema version the database's migration history reaches.
async fn schema_version(url: &str) -> i64 {
    support::pg::session(url)
        .await
        .query_one(
            "SELECT max(version)::bigint FROM refinery_schema_history",
            &[],
        )
        .await
        .expect("reading the migration history")
        .get(0)
}

/// The highest version in this tree's `migrations/` (`V<N>__name.sql`).
fn newest_migration() -> i64 {
    std::fs::read_dir(release::repo().join("migrations"))
        .unwrap()
        .filter_map(|entry| {
            let name = entry.unwrap().file_name().into_string().ok()?;
            name.strip_prefix('V')?.split("__").next()?.parse().ok()
        })
        .max()
        .expect("migrations/ holds migrations")
}

/// A client of the replica at `addr`.
async fn client(addr: SocketAddr) -> TurnServiceClient<tonic::transport::Channel> {
    TurnServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"))
}

/// Sends `request` to the replica at `addr` until it answers: a status a gateway retries is
/// retried there, after a pause, for 20 s at most.
async fn process_on(addr: SocketAddr, request: pb::ProcessTurnRequest) -> pb::ProcessTurnResponse {
    try_process_on(addr, request)
        .await
        .unwrap_or_else(|status| panic!("{addr}: {status:?}"))
}

/// [`process_on`], returning the status a gateway would not retry.
async fn try_process_on(
    addr: SocketAddr,
    request: pb::ProcessTurnRequest,
) -> Result<pb::ProcessTurnResponse, tonic::Status> {
    let mut client = client(addr).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut call = tonic::Request::new(request.clone());
        call.set_timeout(Duration::from_secs(5));
        match client.process_turn(call).await {
            Ok(response) => return Ok(response.into_inner()),
            Err(status)
                if matches!(
                    status.code(),
                    Code::Unavailable | Code::Aborted | Code::DeadlineExceeded
                ) && Instant::now() < deadline =>
            {
                sleep(Duration::from_millis(100)).await;
            }
            Err(status) => return Err(status),
        }
    }
}

/// N of a response that is one `count: N` reply.
fn count_of(response: &pb::ProcessTurnResponse) -> u64 {
    match response.activities.as_slice() {
        [reply] => reply
            .text
            .as_deref()
            .and_then(|t| t.strip_prefix("count: "))
            .and_then(|n| n.parse().ok()),
        _ => None,
    }
    .unwrap_or_else(|| panic!("not one `count: N` reply: {response:?}"))
}

/// A response in short: its replies' texts, whether it was a redelivery, the version.
fn answer(response: &pb::ProcessTurnResponse) -> String {
    format!(
        "{:?} (redelivered: {}, version {:?})",
        support::texts(response),
        response.redelivered,
        response.version
    )
}

/// The probes: in a conversation of its own, a turn committed by a replica of one binary is
/// delivered again to a replica of the other. It must be answered from the receipt — flagged
/// `redelivered`, the same replies and version — and the conversation's count must not move.
/// `warm`: the replica redelivered to served the conversation just before, so it has the state
/// from before the turn in its cache (the one case in which a bot may run again; its commit
/// then meets the receipt and is thrown away). Returns what the checker needs, and the
/// violations found.
async fn probe(
    url: &str,
    conversation: usize,
    committer: (SocketAddr, &'static str),
    redelivered_to: (SocketAddr, &'static str),
    warm: bool,
    record: &mut Record,
) -> Vec<String> {
    let mut violations = Vec::new();
    let label = format!(
        "a turn committed by the {} binary, delivered again to the {} one ({})",
        committer.1,
        redelivered_to.1,
        if warm { "its cache warm" } else { "cold" }
    );
    let mut deliver = async |id: String, to: SocketAddr| {
        let turn = Turn { id, conversation };
        let response = process_on(to, load::request_for(&turn)).await;
        record.acks.push(Ack {
            id: turn.id.clone(),
            conversation,
            count: count_of(&response),
            redelivered: response.redelivered,
            server: 0,
            at: Instant::now(),
        });
        if !record.turns.contains(&turn) {
            record.turns.push(turn);
        }
        response
    };
    let prefix = format!("probe-{conversation}");
    if warm {
        deliver(format!("{prefix}-warm"), redelivered_to.0).await;
    }
    let id = format!("{prefix}-turn");
    let first = deliver(id.clone(), committer.0).await;
    let count =
        || async { check::final_counts(url, SHAPE.conversations + PROBES).await[&conversation] };
    let before = count().await;
    if first.redelivered || count_of(&first) != before {
        violations.push(format!(
            "{label}: its first delivery was answered {}, the state counts {before}",
            answer(&first)
        ));
    }
    let again = deliver(id.clone(), redelivered_to.0).await;
    let after = count().await;
    if !again.redelivered {
        violations.push(format!(
            "{label}: the redelivery was not answered from the receipt: {} (first: {})",
            answer(&again),
            answer(&first)
        ));
    }
    if again.activities != first.activities || again.version != first.version {
        violations.push(format!(
            "{label}: the redelivery got another answer:\nfirst {:?} at {:?}\nagain {:?} at {:?}",
            first.activities, first.version, again.activities, again.version
        ));
    }
    if after != before {
        violations.push(format!(
            "{label}: the redelivery was applied again: the count went from {before} to {after}"
        ));
    }
    // And back to the replica that committed it.
    let back = deliver(id, committer.0).await;
    if !back.redelivered || back.activities != first.activities {
        violations.push(format!(
            "{label}: then delivered to its committer again, it was answered {} (first: {})",
            answer(&back),
            answer(&first)
        ));
    }
    violations
}

/// One answer to a turn of the held bot.
#[derive(Debug, Clone)]
struct HeldAck {
    id: String,
    conversation: usize,
    count: u64,
    redelivered: bool,
    binary: &'static str,
}

/// The request that delivers held turn `id` in conversation `conversation`.
fn held_request(id: &str, conversation: usize) -> pb::ProcessTurnRequest {
    let activity = support::message(
        &held_conversation(conversation),
        &format!("user-held-{conversation}"),
        "hi",
    );
    pb::ProcessTurnRequest::typed(
        pb::Activity {
            id: Some(id.to_owned()),
            ..activity
        },
        HELD_BOT,
    )
}

fn held_conversation(i: usize) -> String {
    format!("held-{i}")
}

fn held_key(conversation: usize) -> String {
    format!(
        "{HELD_BOT}/test/conversations/{}",
        held_conversation(conversation)
    )
}

/// The held bot's load: turns of a few contended conversations, each to a replica of either
/// binary at random (the next one after a retried failure), and a third of them, once answered,
/// delivered again to a replica of the other binary, which must answer from the receipt.
async fn held_load(
    servers: Vec<(SocketAddr, &'static str)>,
    stop: Arc<AtomicBool>,
) -> (Vec<HeldAck>, Vec<String>) {
    let acks = Arc::new(Mutex::new(Vec::new()));
    let violations = Arc::new(Mutex::new(Vec::new()));
    let workers: Vec<_> = (0..HELD_WORKERS)
        .map(|worker| {
            let servers = servers.clone();
            let stop = Arc::clone(&stop);
            let acks = Arc::clone(&acks);
            let violations = Arc::clone(&violations);
            tokio::spawn(async move {
                let mut clients = Vec::new();
                for (addr, _) in &servers {
                    clients.push(client(*addr).await);
                }
                let mut seq = 0;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let id = format!("held-w{worker}-{seq}");
                    let (conversation, mut server, redeliver) = {
                        let mut rng = rand::rng();
                        (
                            rng.random_range(0..HELD_CONVERSATIONS),
                            rng.random_range(0..servers.len()),
                            rng.random_bool(1.0 / 3.0),
                        )
                    };
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let first = loop {
                        let mut call = tonic::Request::new(held_request(&id, conversation));
                        call.set_timeout(Duration::from_secs(5));
                        match clients[server].process_turn(call).await {
                            Ok(response) => break response.into_inner(),
                            Err(status)
                                if !matches!(
                                    status.code(),
                                    Code::InvalidArgument | Code::NotFound | Code::Internal
                                ) && Instant::now() < deadline =>
                            {
                                server = (server + 1) % servers.len();
                                sleep(Duration::from_millis(20)).await;
                            }
                            Err(status) => panic!("held turn {id}: {status:?}"),
                        }
                    };
                    let ack = HeldAck {
                        id: id.clone(),
                        conversation,
                        count: count_of(&first),
                        redelivered: first.redelivered,
                        binary: servers[server].1,
                    };
                    acks.lock().unwrap().push(ack.clone());
                    if !redeliver {
                        continue;
                    }
                    let others: Vec<usize> = (0..servers.len())
                        .filter(|&i| servers[i].1 != ack.binary)
                        .collect();
                    let other = others[rand::rng().random_range(0..others.len())];
                    let again = process_on(servers[other].0, held_request(&id, conversation)).await;
                    let again_ack = HeldAck {
                        count: count_of(&again),
                        redelivered: again.redelivered,
                        binary: servers[other].1,
                        ..ack.clone()
                    };
                    if !again.redelivered || again.activities != first.activities {
                        violations.lock().unwrap().push(format!(
                            "held turn {id}, answered by the {} binary {}, was delivered again to \
                             the {} binary and answered {}",
                            ack.binary,
                            answer(&first),
                            again_ack.binary,
                            answer(&again)
                        ));
                    }
                    acks.lock().unwrap().push(again_ack);
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a held-bot worker panicked");
    }
    let acks = std::mem::take(&mut *acks.lock().unwrap());
    let violations = std::mem::take(&mut *violations.lock().unwrap());
    (acks, violations)
}

/// The checker for the held bot, as `check::prove` is for the load: per conversation, the Ns of
/// the distinct turns are exactly 1..=final, each turn got one N however often it was delivered,
/// and each left one receipt holding it.
async fn prove_held(url: &str, acks: &[HeldAck]) -> Vec<String> {
    let db = support::pg::session(url).await;
    let keys: Vec<String> = (0..HELD_CONVERSATIONS).map(held_key).collect();
    let finals: HashMap<String, u64> = db
        .query(
            "SELECT key, state FROM turnstile_state WHERE key = ANY($1)",
            &[&keys],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| {
            let state: serde_json::Value = row.get(1);
            (row.get(0), state["count"].as_u64().unwrap())
        })
        .collect();
    let receipts: HashMap<String, Option<u64>> = db
        .query(
            "SELECT DISTINCT key, payload FROM (SELECT key, payload FROM turnstile_receipt \
             UNION ALL SELECT key, payload FROM turnstile_receipt_legacy) r WHERE key LIKE $1",
            &[&format!("{HELD_BOT}/%")],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| {
            let payload: serde_json::Value = row.get(1);
            let n = payload["activities"][0]["text"]
                .as_str()
                .and_then(|t| t.strip_prefix("count: "))
                .and_then(|n| n.parse().ok());
            (row.get(0), n)
        })
        .collect();

    let mut violations = Vec::new();
    let mut answers: BTreeMap<&str, &HeldAck> = BTreeMap::new();
    for ack in acks {
        match answers.get(ack.id.as_str()) {
            Some(first) if first.count != ack.count => violations.push(format!(
                "held turn {} was answered `count: {}` by the {} binary and `count: {}` by the {}",
                ack.id, first.count, first.binary, ack.count, ack.binary
            )),
            Some(_) => {}
            None => {
                answers.insert(&ack.id, ack);
            }
        }
    }
    for conversation in 0..HELD_CONVERSATIONS {
        let last = finals.get(&held_key(conversation)).copied().unwrap_or(0);
        let mut ns: Vec<(u64, &str)> = answers
            .values()
            .filter(|a| a.conversation == conversation)
            .map(|a| (a.count, a.id.as_str()))
            .collect();
        ns.sort_unstable();
        let expected: Vec<u64> = (1..=last).collect();
        let got: Vec<u64> = ns.iter().map(|(n, _)| *n).collect();
        if got != expected {
            violations.push(format!(
                "held conversation {conversation}: the state counts {last}, the {} distinct turns \
                 were told {got:?}",
                ns.len()
            ));
        }
    }
    for (id, ack) in &answers {
        let key = format!("{}/activities/{id}", held_key(ack.conversation));
        if receipts.get(&key) != Some(&Some(ack.count)) {
            violations.push(format!(
                "held turn {id}: acknowledged `count: {}`, its receipt says {:?}",
                ack.count,
                receipts.get(&key)
            ));
        }
    }
    if receipts.len() != answers.len() {
        violations.push(format!(
            "{} held receipts for {} held turns",
            receipts.len(),
            answers.len()
        ));
    }
    violations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn old_and_new_replicas_serving_together_through_a_rollout_lose_and_double_nothing() {
    let previous = release::last();
    let old_binary = {
        let previous = previous.clone();
        tokio::task::spawn_blocking(move || previous.binary())
            .await
            .unwrap()
    };
    let started = Instant::now();
    // Collated by a locale's rules, as a hosted PostgreSQL's databases are: the new replicas'
    // migration then rebuilds the receipts' indexes (bytewise) while the old serve.
    let url = support::pg::fresh_database_collated("en-US").await;
    let mut fleet = Fleet::new_with_env(
        &url,
        &[
            ("TURNSTILE_GATEWAY_LISTEN", "off"),
            ("TURNSTILE_SERIALIZED_BOTS", HELD_BOT),
            ("TURNSTILE_SLOW_BOT_DELAY_MS", HELD_DELAY_MS),
        ],
    );
    let old = Program::binary(&old_binary);
    let new = Program::this_build();
    let mut violations: Vec<String> = Vec::new();

    // 1. The old release alone, as it runs before the rollout.
    let old_a = fleet.add(old.clone()).await;
    let old_b = fleet.add(old.clone()).await;
    let old_schema = schema_version(&url).await;
    let addrs = |fleet: &Fleet, servers: &[(usize, &'static str)]| {
        let all = fleet.addrs();
        servers
            .iter()
            .map(|&(i, binary)| (all[i], binary))
            .collect::<Vec<_>>()
    };
    let alone = Phase::start("old-alone", &addrs(&fleet, &[(old_a, OLD), (old_b, OLD)]));
    sleep(OLD_ALONE).await;

    // 2. The new replicas start, migrating the schema under the old ones' load.
    let new_a = fleet.add(new.clone()).await;
    let new_b = fleet.add(new.clone()).await;
    let new_schema = schema_version(&url).await;
    assert_eq!(
        new_schema,
        newest_migration(),
        "the new replicas migrated the schema to the newest version"
    );
    assert_eq!(
        bytewise_indexes(&url).await,
        6,
        "the new replicas' migration rebuilt the receipts' indexes to compare bytewise"
    );

    // 3. An old pod (re)started mid-rollout, on the new schema, with migrations off as the chart
    // starts pods. (Migrating on start, 0.1.0 refuses a history holding a version it does not
    // know, "migration V4__… is missing from the filesystem", and exits.)
    let old_late = fleet
        .add(old.clone().env("TURNSTILE_MIGRATE_ON_START", "false"))
        .await;

    // 4. All together: the load, the held bot, and redeliveries across the binaries.
    let servers = addrs(
        &fleet,
        &[
            (old_a, OLD),
            (old_b, OLD),
            (new_a, NEW),
            (new_b, NEW),
            (old_late, OLD),
        ],
    );
    let together = Phase::start("together", &servers);
    let together_since = Instant::now();
    let alone = alone.finish().await;
    let held_stop = Arc::new(AtomicBool::new(false));
    let held = tokio::spawn(held_load(servers.clone(), Arc::clone(&held_stop)));
    let mut probes = Record::default();
    let (old_addr, new_addr, late_addr) = (servers[0], servers[2], servers[4]);
    for (k, (committer, to, warm)) in [
        (old_addr, new_addr, false),
        (new_addr, old_addr, false),
        (old_addr, new_addr, true),
        (new_addr, old_addr, true),
        (late_addr, new_addr, true),
        (new_addr, late_addr, true),
    ]
    .into_iter()
    .enumerate()
    {
        violations.extend(
            probe(
                &url,
                SHAPE.conversations + k,
                committer,
                to,
                warm,
                &mut probes,
            )
            .await,
        );
    }
    tokio::time::sleep_until(together_since + TOGETHER).await;
    held_stop.store(true, Ordering::Relaxed);
    let (held_acks, held_violations) = held.await.expect("the held bot's load panicked");
    violations.extend(held_violations);

    // 5. The old replicas stopped one by one, as a rollout replaces pods, under load.
    for i in [old_a, old_b, old_late] {
        let (status, log) = fleet.terminate(i);
        assert!(
            status.success(),
            "old replica {i} did not stop cleanly on SIGTERM ({status}):\n{log}"
        );
        sleep(BETWEEN_STOPS).await;
    }

    // 6. The new replicas alone.
    let only_new = addrs(&fleet, &[(new_a, NEW), (new_b, NEW)]);
    let after = Phase::start("new-alone", &only_new);
    let together = together.finish().await;
    sleep(NEW_ALONE).await;
    let after = after.finish().await;
    let serving = started.elapsed();

    // A rollout is routine: whatever fails meanwhile, a gateway must be told to retry.
    for phase in [&alone, &together, &after] {
        let final_failures: Vec<_> = phase
            .record
            .failures
            .iter()
            .filter(|(_, f)| !f.is_retried())
            .collect();
        if !final_failures.is_empty() {
            violations.push(format!(
                "{}: {} calls failed with a status a gateway does not retry: {:?}",
                phase.name,
                final_failures.len(),
                phase.record.failures_by_kind()
            ));
        }
    }

    // Every turn acknowledged at least once: what a phase never got an OK for is sent again,
    // to the new replicas (receipts make that safe).
    let mut record = Record::default();
    for phase in [&alone, &together, &after] {
        record.turns.extend(phase.record.turns.iter().cloned());
        record.acks.extend(phase.record.acks.iter().cloned());
        record.unacked.extend(phase.record.unacked.iter().cloned());
    }
    record.turns.extend(probes.turns);
    record.acks.extend(probes.acks);
    let settle = Gateway::new(
        &only_new.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
        SHAPE.call_timeout,
    );
    let resent = std::mem::take(&mut record.unacked);
    for (i, turn) in resent.iter().enumerate() {
        settle
            .deliver(turn, i, Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("{turn:?} could not be delivered after the rollout"));
    }

    // Turns the old release answered, delivered again once it is gone: the new replicas answer
    // them from its receipts.
    let answered_by_old: Vec<Ack> = [&alone, &together]
        .into_iter()
        .flat_map(|phase| {
            phase
                .record
                .acks
                .iter()
                .filter(|a| phase.binary(a) == OLD && !a.redelivered)
                .cloned()
        })
        .step_by(11)
        .take(40)
        .collect();
    assert!(
        !answered_by_old.is_empty(),
        "the old replicas answered nothing"
    );
    for (i, ack) in answered_by_old.iter().enumerate() {
        let turn = Turn {
            id: ack.id.clone(),
            conversation: ack.conversation,
        };
        let again = settle
            .deliver(&turn, i, Duration::from_secs(10))
            .await
            .expect("a redelivery after the rollout");
        if !again.redelivered || again.count != ack.count {
            violations.push(format!(
                "{turn:?}, answered `count: {}` by the old release, was answered {again:?} by \
                 the new one after the rollout",
                ack.count
            ));
        }
    }
    let settled = settle.take_record();
    record.acks.extend(settled.acks);

    // Nothing lost, nothing doubled: the load's, the probes' and the held bot's turns.
    let counts = check::final_counts(&url, SHAPE.conversations + PROBES).await;
    let receipts = check::receipts(&url).await;
    violations.extend(prove_held(&url, &held_acks).await);
    for (status, log) in fleet.stop() {
        assert!(
            status.success(),
            "a new replica did not stop cleanly ({status}):\n{log}"
        );
    }
    let logs: Vec<String> = [old_a, old_b, new_a, new_b, old_late]
        .into_iter()
        .map(|i| {
            let log = fleet.log(i);
            let lines: Vec<&str> = log.lines().collect();
            format!(
                "server {i}:\n{}",
                lines[lines.len().saturating_sub(30)..].join("\n")
            )
        })
        .collect();
    // The redeliveries across binaries first: when they fail, they say best what broke.
    assert!(
        violations.is_empty(),
        "{} violations (first 30):\n{}\n\nthe servers' logs (0, 1, 4: old; 2, 3: new), their \
         ends:\n{}",
        violations.len(),
        violations[..violations.len().min(30)].join("\n"),
        logs.join("\n")
    );
    let proof = check::prove(&record, &counts, &receipts);

    let held_turns: std::collections::HashSet<&str> =
        held_acks.iter().map(|a| a.id.as_str()).collect();
    eprintln!(
        "[upgrade] {} → this build; schema {old_schema} → {new_schema}; {} turns over {} \
         conversations (state counts {}), {} held turns ({} answers, {} by old, {} redelivered); \
         {} resent after the rollout, {} redelivered to the new release after it; serving \
         {:.1}s\n  {}\n  {}\n  {}",
        previous.version,
        proof.turns,
        proof.conversations,
        proof.applied,
        held_turns.len(),
        held_acks.len(),
        held_acks.iter().filter(|a| a.binary == OLD).count(),
        held_acks.iter().filter(|a| a.redelivered).count(),
        resent.len(),
        answered_by_old.len(),
        serving.as_secs_f64(),
        alone.summary(),
        together.summary(),
        after.summary(),
    );
    assert!(
        together
            .record
            .acks
            .iter()
            .any(|a| together.binary(a) == OLD)
            && together
                .record
                .acks
                .iter()
                .any(|a| together.binary(a) == NEW),
        "old and new replicas did not both serve the load together: {}",
        together.summary()
    );
    assert!(
        held_acks.iter().any(|a| a.binary == OLD && !a.redelivered)
            && held_acks.iter().any(|a| a.binary == NEW && !a.redelivered),
        "the held bot's turns were not committed by both binaries"
    );
}

/// Sends `text` to the pizza bot in the erasure test's conversation, through the replica at
/// `to`: the toppings its reply names, or the status it failed with.
async fn order(to: SocketAddr, text: &str) -> Result<Vec<String>, tonic::Status> {
    let activity = support::message(ERASED, "user-erased", text);
    let request = pb::ProcessTurnRequest::typed(activity, ERASED_BOT);
    try_process_on(to, request)
        .await
        .map(|response| toppings_of(&response))
}

/// The toppings a pizza bot's (first) reply names.
fn toppings_of(response: &pb::ProcessTurnResponse) -> Vec<String> {
    support::texts(response)
        .first()
        .map(|reply| support::toppings(reply))
        .unwrap_or_default()
}

/// Adds a violation unless `said` is `expected`.
fn expect(
    violations: &mut Vec<String>,
    what: &str,
    said: Result<Vec<String>, tonic::Status>,
    expected: &[&str],
) {
    match said {
        Ok(said) if said == expected => {}
        Ok(said) => violations.push(format!(
            "{what}: the pizza has {said:?}, expected {expected:?}"
        )),
        Err(status) => violations.push(format!(
            "{what}: failed with {:?} {:?}, expected the pizza to have {expected:?}",
            status.code(),
            status.message()
        )),
    }
}

/// What the database holds of the erasure test's conversation and of activity `id`'s receipt.
async fn erased_rows(url: &str, id: &str) -> String {
    let db = support::pg::session(url).await;
    let state = db
        .query_opt(
            "SELECT version, state::text FROM turnstile_state WHERE key = $1",
            &[&ERASED_KEY],
        )
        .await
        .unwrap()
        .map(|row| {
            format!(
                "version {} {}",
                row.get::<_, i64>(0),
                row.get::<_, String>(1)
            )
        });
    let receipt = db
        .query_opt(
            "SELECT DISTINCT payload::text FROM (SELECT key, payload FROM turnstile_receipt \
             UNION ALL SELECT key, payload FROM turnstile_receipt_legacy) r WHERE key = $1",
            &[&format!("{ERASED_KEY}/activities/{id}")],
        )
        .await
        .unwrap()
        .map(|row| row.get::<_, String>(0));
    format!("state row: {state:?}; receipt of {id}: {receipt:?}")
}

/// [`erased_rows`] when neither exists.
fn erased_rows_none(id: &str) -> String {
    format!("state row: None; receipt of {id}: None")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_deleted_mid_rollout_starts_afresh_whichever_release_serves_it() {
    let old_binary = tokio::task::spawn_blocking(|| release::last().binary())
        .await
        .unwrap();
    let url = support::pg::fresh_database().await;
    let mut fleet = Fleet::new_with_env(&url, &[("TURNSTILE_GATEWAY_LISTEN", "off")]);
    let old = fleet.add(Program::binary(&old_binary)).await;
    let new = fleet
        .add(Program::this_build().env("TURNSTILE_ADMIN_TOKENS", ADMIN))
        .await;
    let (old, new) = (fleet.addrs()[old], fleet.addrs()[new]);
    let mut violations = Vec::new();

    // The old replica has the conversation in its cache, at version 2.
    expect(
        &mut violations,
        "old, before",
        order(old, "add mushroom").await,
        &["mushroom"],
    );
    expect(
        &mut violations,
        "old, before",
        order(old, "add cheese").await,
        &["mushroom", "cheese"],
    );
    let mut admin = AdminServiceClient::connect(format!("http://{new}"))
        .await
        .unwrap();
    let mut delete = tonic::Request::new(pb::DeleteConversationRequest {
        channel_id: load::CHANNEL.into(),
        conversation_id: ERASED.into(),
    });
    delete
        .metadata_mut()
        .insert("authorization", format!("Bearer {ADMIN}").parse().unwrap());
    let record = admin
        .delete_conversation(delete)
        .await
        .unwrap_or_else(|s| panic!("DeleteConversation on the new replica: {s:?}"))
        .into_inner()
        .record
        .expect("an erasure record");
    assert!(
        !record.scopes.is_empty(),
        "DeleteConversation found nothing to delete: {record:?}"
    );

    // The old replica's next turn either starts from nothing, or — since 0.1.0 cannot create a
    // key above its tombstone — is refused with a status a gateway retries, nothing committed,
    // and is then answered by a new replica. Never a failure that committed after all.
    let activity = support::message(ERASED, "user-erased", "add olives");
    let id = activity.id.clone().unwrap();
    let request = pb::ProcessTurnRequest::typed(activity, ERASED_BOT);
    let mut call = tonic::Request::new(request.clone());
    call.set_timeout(Duration::from_secs(10));
    let asked = Instant::now();
    let outcome = client(old).await.process_turn(call).await;
    eprintln!(
        "[upgrade] after the deletion the old replica answered {:?} in {:.1?}",
        outcome
            .as_ref()
            .map(|r| support::texts(r.get_ref()))
            .map_err(|s| s.code()),
        asked.elapsed()
    );
    match outcome {
        Ok(response) => expect(
            &mut violations,
            "old, its cache holding the deleted state",
            Ok(toppings_of(&response.into_inner())),
            &["olives"],
        ),
        Err(status) if matches!(status.code(), Code::Aborted | Code::Unavailable) => {
            let rows = erased_rows(&url, &id).await;
            if rows != erased_rows_none(&id) {
                violations.push(format!(
                    "after the deletion, the old replica refused `add olives` ({id}) with {:?} \
                     {:?}, yet the database holds {rows}",
                    status.code(),
                    status.message()
                ));
            }
            // The gateway's retry, on another replica.
            let retried = process_on(new, request).await;
            if retried.redelivered {
                violations.push(format!(
                    "`add olives` ({id}), refused by the old replica, was then answered as a \
                     redelivery: {}",
                    answer(&retried)
                ));
            }
            expect(
                &mut violations,
                "new, retrying what the old one refused",
                Ok(toppings_of(&retried)),
                &["olives"],
            );
        }
        Err(status) => {
            // Evidence: whether the turn committed after all, and what its redelivery gets.
            let rows = erased_rows(&url, &id).await;
            let again = try_process_on(old, request).await;
            violations.push(format!(
                "after the deletion, the old replica failed `add olives` ({id}) with {:?} {:?}, \
                 which a gateway does not retry; the database then held {rows}; the same \
                 activity delivered again to it was answered {:?}",
                status.code(),
                status.message(),
                again
                    .map(|r| answer(&r))
                    .map_err(|s| (s.code(), s.message().to_owned())),
            ));
        }
    }
    expect(
        &mut violations,
        "new, after the old one's turn",
        order(new, "add ham").await,
        &["olives", "ham"],
    );
    expect(
        &mut violations,
        "old, after the new one's turn",
        order(old, "show").await,
        &["olives", "ham"],
    );
    let resurrected: i64 = support::pg::session(&url)
        .await
        .query_one(
            "SELECT count(*) FROM turnstile_state WHERE state::text LIKE '%mushroom%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    if resurrected != 0 {
        violations.push(format!(
            "{resurrected} state rows hold the deleted conversation's toppings again"
        ));
    }
    let logs = [fleet.log(0), fleet.log(1)];
    for (status, log) in fleet.stop() {
        assert!(
            status.success(),
            "a replica did not stop cleanly ({status}):\n{log}"
        );
    }
    assert!(
        violations.is_empty(),
        "{} violations:\n{}\n\nthe old replica's log:\n{}\nthe new replica's log:\n{}",
        violations.len(),
        violations.join("\n"),
        logs[0],
        logs[1]
    );
}

/// Two commits of one activity racing on an old replica (a gateway's retry of a call that timed
/// out while the first still ran) each write its receipt through what the old release reaches in
/// `public`: the view's insert and the `turnstile_commit` wrapper. The loser's error names
/// `turnstile_receipt_pkey`, by which the old release answers from the receipt, not the slot's
/// index, which it took for a store failure (`migrations/V7__receipt_compat_names.sql`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_replicas_racing_receipts_fail_by_the_name_it_knows() {
    let old_binary = tokio::task::spawn_blocking(|| release::last().binary())
        .await
        .unwrap();
    let url = support::pg::fresh_database().await;
    let mut fleet = Fleet::new_with_env(&url, &[("TURNSTILE_GATEWAY_LISTEN", "off")]);
    // The old release lays the database out; this build moves it and migrates it.
    fleet.add(Program::binary(&old_binary)).await;
    fleet.add(Program::this_build()).await;

    let ways = [
        (
            "the view's insert",
            "INSERT INTO public.turnstile_receipt (key, payload) VALUES ('raced', '{}')",
            "INSERT INTO public.turnstile_receipt (key, payload) VALUES ('raced', '{}')",
        ),
        (
            "the turnstile_commit wrapper",
            "SELECT * FROM public.turnstile_commit(ARRAY['raced/a'], ARRAY[0::bigint], \
             ARRAY['{}'::jsonb], 'raced/receipt', '{}')",
            "SELECT * FROM public.turnstile_commit(ARRAY['raced/b'], ARRAY[0::bigint], \
             ARRAY['{}'::jsonb], 'raced/receipt', '{}')",
        ),
    ];
    let observer = support::pg::session(&url).await;
    for (way, first, second) in ways {
        let winner = support::pg::session(&url).await;
        winner.batch_execute("BEGIN").await.unwrap();
        winner.batch_execute(first).await.unwrap();
        let loser = support::pg::session(&url).await;
        let raced = tokio::spawn(async move { loser.batch_execute(second).await });
        // The second waits for the first's receipt, not yet committed.
        let started = Instant::now();
        loop {
            let waiting: i64 = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                      WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if waiting == 1 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{way}: the second never waited"
            );
            sleep(Duration::from_millis(20)).await;
        }
        winner.batch_execute("COMMIT").await.unwrap();
        let failed = raced.await.unwrap().expect_err(way);
        let db = failed
            .as_db_error()
            .unwrap_or_else(|| panic!("{way}: {failed:?}"));
        assert_eq!(
            (db.code().code(), db.constraint()),
            ("23505", Some("turnstile_receipt_pkey")),
            "{way}: {db:?}"
        );
    }
    for (status, log) in fleet.stop() {
        assert!(
            status.success(),
            "a replica did not stop cleanly ({status}):\n{log}"
        );
    }
}
