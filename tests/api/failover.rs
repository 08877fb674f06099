//! Failover: a primary with a synchronous standby crashes under load, the standby is promoted,
//! and the service finds it by itself through a multi-host URL with
//! `target_session_attrs=read-write` — the libpq way, which managed HA services, Patroni and
//! CloudNativePG all support. Afterwards the checker proves that no acknowledged turn was lost
//! and none applied twice: with synchronous replication, a commit is acknowledged only once the
//! standby has it, so every count a gateway was given survives the failover (see the README for
//! what asynchronous replication loses).
//!
//! The load is the fault suite's: two real `turnstile serve` processes, a gateway that redelivers
//! what failed, and every turn delivered until acknowledged once the fault is over.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use support::check;
use support::fleet::Fleet;
use support::load::{Gateway, Shape, Turn};
use support::pg::{self, Cluster};
use tokio::time::{Instant, sleep};

const SHAPE: Shape = Shape {
    workers: 16,
    duration: Duration::from_secs(5),
    conversations: 40,
    hot: 2,
    hot_share: 0.3,
    call_timeout: Duration::from_secs(3),
    turn_bound: Duration::from_secs(30),
};

/// Load before the crash, so that it hits a busy service.
const LEAD_IN: Duration = Duration::from_millis(2500);

/// How long the primary is gone before the standby is promoted, as a failure detector would take.
const DETECTION: Duration = Duration::from_secs(1);

/// The load goes on at least this long after the promotion.
const RECOVERY: Duration = Duration::from_secs(3);

/// Acknowledged commits must survive the primary: synchronous commit, which the throwaway
/// clusters otherwise turn off for speed.
const DURABLE: &[&str] = &["synchronous_commit=on"];

async fn sql(url: &str, statement: &str) -> Vec<tokio_postgres::SimpleQueryMessage> {
    support::pg::session(url)
        .await
        .simple_query(statement)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e:?}"))
}

/// The first column of the first row `statement` returns.
async fn value(url: &str, statement: &str) -> Option<String> {
    sql(url, statement).await.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_synchronous_standby_promoted_after_the_primary_crashes_loses_no_acknowledged_turn() {
    let started = Instant::now();
    let primary = Arc::new(
        tokio::task::spawn_blocking(|| Cluster::start_with(DURABLE, |_| {}))
            .await
            .unwrap(),
    );
    let primary_url = pg::fresh_database_in(&primary).await;
    let database = primary_url.rsplit('/').next().unwrap().to_owned();
    let standby = {
        let primary = Arc::clone(&primary);
        Arc::new(
            tokio::task::spawn_blocking(move || Cluster::standby_of(&primary, DURABLE))
                .await
                .unwrap(),
        )
    };
    let standby_url = format!(
        "postgres://postgres@127.0.0.1:{}/{database}",
        standby.port()
    );

    // Synchronous from here on: the standby was copied before, so it does not wait for anyone
    // once promoted.
    sql(
        &primary_url,
        "ALTER SYSTEM SET synchronous_standby_names = '*'",
    )
    .await;
    sql(&primary_url, "SELECT pg_reload_conf()").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while value(
        &primary_url,
        "SELECT sync_state FROM pg_stat_replication WHERE sync_state = 'sync'",
    )
    .await
    .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "the standby never became synchronous"
        );
        sleep(Duration::from_millis(100)).await;
    }

    // Both hosts in one URL: the servers connect to whichever accepts writes.
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
        primary.port(),
        standby.port()
    );
    let mut fleet = Fleet::start(2, &url).await;
    let gateway = Gateway::new(&fleet.addrs(), SHAPE.call_timeout);
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let gateway = gateway.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move { gateway.run(SHAPE, "failover", stop).await })
    };
    sleep(LEAD_IN).await;

    let crashed = Instant::now();
    {
        let (primary, standby) = (Arc::clone(&primary), Arc::clone(&standby));
        tokio::task::spawn_blocking(move || {
            primary.crash();
            std::thread::sleep(DETECTION);
            standby.promote();
        })
        .await
        .unwrap();
    }
    let promoted = Instant::now();
    sleep(RECOVERY).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let mut record = gateway.take_record();

    // Every turn acknowledged at least once: receipts make sending them again safe.
    let resent = std::mem::take(&mut record.unacked);
    for (i, turn) in resent.iter().enumerate() {
        gateway
            .deliver(turn, i, Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("{turn:?} could not be delivered after the failover"));
    }
    let settled = gateway.take_record();
    record.acks.extend(settled.acks);
    record.failures.extend(settled.failures);
    record.calls += settled.calls;

    // The new primary holds every acknowledged count, each once.
    let counts = check::final_counts(&standby_url, SHAPE.conversations).await;
    let receipts = check::receipts(&standby_url).await;
    let proof = check::prove(&record, &counts, &receipts);

    // A sample of turns acknowledged before the crash, delivered again: answered from receipts
    // that crossed over to the standby.
    let before: Vec<_> = record
        .acks
        .iter()
        .filter(|a| a.at < crashed)
        .step_by(7)
        .take(60)
        .cloned()
        .collect();
    assert!(
        !before.is_empty(),
        "no turn was acknowledged before the crash"
    );
    for (i, ack) in before.iter().enumerate() {
        let turn = Turn {
            id: ack.id.clone(),
            conversation: ack.conversation,
        };
        let again = gateway
            .deliver(&turn, i, Duration::from_secs(10))
            .await
            .expect("a redelivery after the failover");
        assert!(
            again.redelivered,
            "{turn:?} ran again after the failover: {again:?}"
        );
        assert_eq!(again.count, ack.count, "{turn:?} got another answer");
    }

    let failures_in_fault = record
        .failures
        .iter()
        .filter(|(at, f)| {
            (crashed..promoted + Duration::from_secs(1)).contains(at) && f.is_retried()
        })
        .count();
    // A failover is transient: a gateway must be told to retry, never to give up and alert.
    let internal = record
        .failures
        .iter()
        .filter(|(_, f)| *f == support::load::Failure::Status(tonic::Code::Internal))
        .count();
    let acks_after = record.acks.iter().filter(|a| a.at > promoted).count();
    let acks_before = record.acks.iter().filter(|a| a.at < crashed).count();
    let on_standby = value(&standby_url, "SELECT pg_is_in_recovery()::text").await;
    drop(gateway);
    for (status, log) in fleet.stop() {
        assert!(
            status.success(),
            "a server did not stop cleanly ({status}):\n{log}"
        );
    }
    eprintln!(
        "[failover] {} turns over {} conversations (state counts {}); {acks_before} acknowledged \
         before the crash, {acks_after} after the promotion; {failures_in_fault} retried failures \
         during the failover ({:?} overall); {} resent after the load; {:.1}s",
        proof.turns,
        proof.conversations,
        proof.applied,
        record.failures_by_kind(),
        resent.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        on_standby.as_deref(),
        Some("false"),
        "the standby was promoted"
    );
    assert_eq!(
        internal, 0,
        "calls failed with INTERNAL during the failover"
    );
    assert!(failures_in_fault > 0, "nobody noticed the primary was gone");
    assert!(acks_after > 0, "no turn succeeded on the promoted standby");
}
