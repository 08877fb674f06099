//! The fault suite: a steady mixed load against three real `turnstile serve` processes sharing one
//! PostgreSQL, while one fault is injected in the middle — the database stopped and restarted, a
//! server SIGKILLed and restarted, the network between servers and database cut. Afterwards the
//! checker proves, from every answer and the final state, that every acknowledged change is in
//! the state, that no reply was returned for a change that is not, and that no turn was applied
//! twice.
//!
//! The load behaves like a gateway: whatever a gateway retries is retried with the same activity
//! id, possibly on another server. Failures during a fault are expected and only counted; the
//! checker's invariants are what is asserted — plus that the fault really happened and hurt, and
//! that the service recovered, so that no scenario can pass vacuously.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use support::check;
use support::citus::CitusCluster;
use support::fleet::Fleet;
use support::load::{Failure, Gateway, Record, Shape, Turn};
use support::pg::{self, Cluster};
use support::proxy::Proxy;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

const SERVERS: usize = 3;

const SHAPE: Shape = Shape {
    workers: 24,
    duration: Duration::from_secs(6),
    conversations: 50,
    hot: 2,
    hot_share: 0.3,
    call_timeout: Duration::from_secs(3),
    turn_bound: Duration::from_secs(20),
};

/// Load before the fault, so that it hits a busy service.
const LEAD_IN: Duration = Duration::from_millis(2500);

/// After the fault is over, failures still count as the fault's for this long: calls that were
/// in flight, pools reconnecting.
const AFTERMATH: Duration = Duration::from_secs(1);

/// The load goes on at least this long after the fault is over, however long the fault took.
const RECOVERY: Duration = Duration::from_secs(2);

/// Where a world's database is: a private cluster, or a private Citus cluster (a coordinator and
/// 2 workers).
enum Database {
    Single(Arc<Cluster>),
    Citus(Arc<CitusCluster>),
}

/// A private cluster, three servers on one database in it (directly or through a proxy), and a
/// gateway in front of them.
struct World {
    name: &'static str,
    database: Database,
    database_url: String,
    proxy: Option<Proxy>,
    fleet: Fleet,
    gateway: Gateway,
    stop_load: Arc<AtomicBool>,
    started: Instant,
}

/// When a fault began and when it was over.
struct Fault {
    began: Instant,
    over: Instant,
    injected: usize,
}

/// What a scenario measured, beyond what the checker proved.
struct Measured {
    record: Record,
    proof: check::Proof,
    failures_in_fault: usize,
    acks_after_fault: usize,
    resent: usize,
}

impl World {
    async fn start(name: &'static str, through_proxy: bool) -> World {
        let started = Instant::now();
        let cluster = Arc::new(
            tokio::task::spawn_blocking(Cluster::start)
                .await
                .expect("starting a cluster"),
        );
        let database_url = pg::fresh_database_in(&cluster).await;
        World::start_on(
            name,
            Database::Single(cluster),
            database_url,
            through_proxy,
            started,
        )
        .await
    }

    /// A world whose servers share a database of a private Citus cluster, laid out for it by
    /// their migration on start.
    async fn start_on_citus(name: &'static str) -> World {
        let started = Instant::now();
        let citus = Arc::new(
            tokio::task::spawn_blocking(|| CitusCluster::start(2))
                .await
                .expect("starting a Citus cluster"),
        );
        let database_url = citus.fresh_database().await;
        World::start_on(name, Database::Citus(citus), database_url, false, started).await
    }

    async fn start_on(
        name: &'static str,
        database: Database,
        database_url: String,
        through_proxy: bool,
        started: Instant,
    ) -> World {
        let (proxy, server_url) = if through_proxy {
            let config: tokio_postgres::Config = database_url.parse().expect("a database URL");
            let port = config.get_ports()[0];
            let proxy = Proxy::start(([127, 0, 0, 1], port).into()).await;
            let url = format!(
                "postgres://postgres@127.0.0.1:{}/{}",
                proxy.addr().port(),
                config.get_dbname().expect("a database name")
            );
            (Some(proxy), url)
        } else {
            (None, database_url.clone())
        };
        let fleet = Fleet::start(SERVERS, &server_url).await;
        let gateway = Gateway::new(&fleet.addrs(), SHAPE.call_timeout);
        World {
            name,
            database,
            database_url,
            proxy,
            fleet,
            gateway,
            stop_load: Arc::new(AtomicBool::new(false)),
            started,
        }
    }

    fn start_load(&self) -> JoinHandle<()> {
        let gateway = self.gateway.clone();
        let name = self.name;
        let stop = Arc::clone(&self.stop_load);
        tokio::spawn(async move { gateway.run(SHAPE, name, stop).await })
    }

    /// Lets the load run on a while after `fault`, waits for it to end, delivers every turn that
    /// was never acknowledged, runs the checker, stops the servers and prints a summary.
    async fn finish(mut self, load: JoinHandle<()>, fault: &Fault) -> Measured {
        tokio::time::sleep_until(fault.over + RECOVERY).await;
        self.stop_load.store(true, Ordering::Relaxed);
        load.await.expect("the load panicked");
        let mut record = self.gateway.take_record();

        // Every turn acknowledged once at least: receipts make sending them again safe.
        let resent = record.unacked.len();
        let unacked: Vec<Turn> = std::mem::take(&mut record.unacked);
        let settling: Vec<_> = unacked
            .into_iter()
            .enumerate()
            .map(|(i, turn)| {
                let gateway = self.gateway.clone();
                tokio::spawn(async move {
                    gateway
                        .deliver(&turn, i, Duration::from_secs(30))
                        .await
                        .unwrap_or_else(|| {
                            panic!("{turn:?} could not be delivered after the fault")
                        })
                })
            })
            .collect();
        for settle in settling {
            settle.await.expect("settling a turn");
        }
        let settled = self.gateway.take_record();
        record.acks.extend(settled.acks);
        record.failures.extend(settled.failures);
        record.calls += settled.calls;

        let counts = check::final_counts(&self.database_url, SHAPE.conversations).await;
        let receipts = check::receipts(&self.database_url).await;
        let proof = check::prove(&record, &counts, &receipts);

        // A sample of acknowledged turns, delivered again: each answered from its receipt with
        // the same N, and the state does not move.
        let mut sample: Vec<_> = record.acks.iter().step_by(17).take(120).cloned().collect();
        sample.dedup_by(|a, b| a.id == b.id);
        for (i, ack) in sample.iter().enumerate() {
            let turn = Turn {
                id: ack.id.clone(),
                conversation: ack.conversation,
            };
            let again = self
                .gateway
                .deliver(&turn, i, Duration::from_secs(10))
                .await
                .expect("a redelivery after the run");
            assert!(again.redelivered, "{turn:?} ran again: {again:?}");
            assert_eq!(again.count, ack.count, "{turn:?} got another answer");
        }
        let _ = self.gateway.take_record();
        assert_eq!(
            check::final_counts(&self.database_url, SHAPE.conversations).await,
            counts,
            "redeliveries changed the state"
        );

        // A fault is transient: a gateway must be told to retry, never to give up and alert.
        let internal = record
            .failures
            .iter()
            .filter(|(_, f)| *f == Failure::Status(tonic::Code::Internal))
            .count();
        assert_eq!(
            internal, 0,
            "calls failed with INTERNAL during a transient fault"
        );

        let window = fault.began..fault.over + AFTERMATH;
        let failures_in_fault = record
            .failures
            .iter()
            .filter(|(at, failure)| window.contains(at) && failure.is_retried())
            .count();
        let acks_after_fault = record.acks.iter().filter(|a| a.at > fault.over).count();

        drop(self.gateway);
        let exits = self.fleet.stop();
        for (status, log) in &exits {
            assert!(
                status.success(),
                "a server did not stop cleanly ({status}):\n{log}"
            );
        }

        let measured = Measured {
            failures_in_fault,
            acks_after_fault,
            resent,
            proof,
            record,
        };
        eprintln!(
            "{}",
            summary(self.name, &measured, fault, self.started.elapsed())
        );
        measured
    }
}

fn summary(name: &str, m: &Measured, fault: &Fault, elapsed: Duration) -> String {
    let r = &m.record;
    let replays = r.acks.iter().filter(|a| a.redelivered).count();
    let by_kind: BTreeMap<String, usize> = r
        .failures_by_kind()
        .into_iter()
        .map(|(kind, n)| {
            let kind = match kind {
                Failure::Status(code) => format!("{code:?}"),
                Failure::Transport(code) => format!("transport/{code:?}"),
            };
            (kind, n)
        })
        .collect();
    format!(
        "[{name}] {} turns acknowledged over {} conversations (state counts {}); {} calls, {} \
         retries, {} answered from receipts; {} faults injected, {} retried failures during the \
         fault ({by_kind:?} overall); {} turns resent after the load; {} acks after the fault; \
         {:.1}s",
        m.proof.turns,
        m.proof.conversations,
        m.proof.applied,
        r.calls,
        r.calls - m.proof.turns as u64,
        replays,
        fault.injected,
        m.failures_in_fault,
        m.resent,
        m.acks_after_fault,
        elapsed.as_secs_f64()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_stopped_and_restarted_under_load() {
    let world = World::start("pg-restart", false).await;
    let Database::Single(cluster) = &world.database else {
        unreachable!("a single cluster")
    };
    let cluster = Arc::clone(cluster);
    stopped_and_restarted(world, move || outage(&cluster)).await;
}

/// Stops `node` for 1.5 s, then starts it again.
fn outage(node: &Cluster) {
    node.stop();
    std::thread::sleep(Duration::from_millis(1500));
    node.resume();
}

/// Runs `restart` (a database node stopped and started again) under load, and checks that the
/// fault was noticed and that the service recovered.
async fn stopped_and_restarted(world: World, restart: impl FnOnce() + Send + 'static) {
    let load = world.start_load();
    sleep(LEAD_IN).await;

    let began = Instant::now();
    tokio::task::spawn_blocking(restart)
        .await
        .expect("stopping and restarting PostgreSQL");
    let fault = Fault {
        began,
        over: Instant::now(),
        injected: 1,
    };

    let m = world.finish(load, &fault).await;
    assert!(
        m.failures_in_fault > 0,
        "nobody noticed the database was down"
    );
    assert!(
        m.acks_after_fault > 0,
        "no turn succeeded after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_killed_and_restarted_under_load() {
    server_killed_and_restarted(World::start("sigkill", false).await).await;
}

/// The same with the tables distributed over a Citus coordinator and 2 workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_citus_a_server_killed_and_restarted_under_load() {
    if !support::citus::installed() {
        return;
    }
    server_killed_and_restarted(World::start_on_citus("citus-sigkill").await).await;
}

/// A Citus worker, holding half the shards, stopped and restarted under load: the turns of its
/// conversations fail while it is away and are delivered again; none is lost or applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_citus_a_worker_stopped_and_restarted_under_load() {
    if !support::citus::installed() {
        return;
    }
    let world = World::start_on_citus("citus-worker-restart").await;
    let Database::Citus(citus) = &world.database else {
        unreachable!("a Citus cluster")
    };
    let citus = Arc::clone(citus);
    stopped_and_restarted(world, move || outage(&citus.workers[0])).await;
}

async fn server_killed_and_restarted(mut world: World) {
    const VICTIM: usize = 1;
    let load = world.start_load();
    sleep(LEAD_IN).await;

    let began = Instant::now();
    world.fleet.kill(VICTIM);
    sleep(Duration::from_secs(1)).await;
    world.fleet.restart(VICTIM).await;
    let fault = Fault {
        began,
        over: Instant::now(),
        injected: 1,
    };

    let m = world.finish(load, &fault).await;
    assert!(
        m.failures_in_fault > 0,
        "no call noticed the server was killed"
    );
    assert!(
        m.acks_after_fault > 0,
        "no turn succeeded after the restart"
    );
    let from_victim = m
        .record
        .acks
        .iter()
        .filter(|a| a.server == VICTIM && a.at > fault.over)
        .count();
    assert!(from_victim > 0, "the restarted server answered no turn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_to_postgres_cut_under_load() {
    let world = World::start("net-cut", true).await;
    let load = world.start_load();
    sleep(LEAD_IN).await;

    let proxy = world.proxy.as_ref().expect("a proxy");
    let began = Instant::now();
    let first = proxy.cut(Duration::from_millis(300));
    sleep(Duration::from_secs(1)).await;
    let second = proxy.cut(Duration::from_millis(300));
    let fault = Fault {
        began,
        over: Instant::now() + Duration::from_millis(300),
        injected: 2,
    };
    let (opened, refused) = (proxy.opened(), proxy.refused());
    eprintln!(
        "[net-cut] cut {first} then {second} connections; {opened} opened, {refused} refused"
    );

    let m = world.finish(load, &fault).await;
    assert!(
        first > 0 && second > 0,
        "each cut found live connections: {first}, {second}"
    );
    assert!(
        m.failures_in_fault > 0,
        "no call noticed the cut connections"
    );
    assert!(m.acks_after_fault > 0, "no turn succeeded after the cuts");
}
