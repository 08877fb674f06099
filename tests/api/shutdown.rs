//! Shutdown: health turns NOT_SERVING, new turns are refused with UNAVAILABLE, the turns in
//! flight finish and commit exactly once, then the server stops.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use support::{TestApp, message, texts};
use tokio::sync::watch;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_types::StatusExt as _;
use turnstile::bots::CounterBot;
use turnstile::grpc::pb;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

/// The counter bot, held inside its turn until the test opens the gate, so that the shutdown
/// certainly catches it in flight, however slow the machine.
struct GatedCounter {
    started: Arc<AtomicUsize>,
    gate: watch::Receiver<bool>,
}

#[async_trait]
impl Bot for GatedCounter {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        let mut gate = self.gate.clone();
        gate.wait_for(|open| *open).await.map_err(BotError::from)?;
        CounterBot.on_turn(turn).await
    }
}

/// Waits (generously) until `check` holds.
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn turn(id: &str) -> pb::ProcessTurnRequest {
    pb::ProcessTurnRequest::typed(
        pb::Activity {
            id: Some(id.into()),
            ..message(&format!("conv-{id}"), "alice", "hi")
        },
        "",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_flight_turns_finish_once_and_new_ones_are_refused() {
    let started = Arc::new(AtomicUsize::new(0));
    let (open, gate) = watch::channel(false);
    let bot = GatedCounter {
        started: started.clone(),
        gate,
    };
    let app = TestApp::postgres()
        .bots(BotRegistry::new("counter", bot))
        .spawn()
        .await;
    let url = app.database_url().to_owned();
    // The app goes away mid-test: its client stays.
    let client = app.client.clone();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();

    let in_flight: Vec<_> = (0..8)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move { client.process_turn(turn(&format!("t{i}"))).await })
        })
        .collect();
    eventually("8 turns in flight", async || {
        started.load(Ordering::SeqCst) == 8
    })
    .await;

    let stopped = tokio::spawn(app.stop());
    let health = HealthClient::new(channel);
    eventually("probes see the drain", async || {
        let status = health
            .clone()
            .check(HealthCheckRequest {
                service: "turnstile.v1.TurnService".into(),
            })
            .await
            .expect("health answers during the drain")
            .into_inner()
            .status;
        status == ServingStatus::NotServing as i32
    })
    .await;
    let refused = client
        .clone()
        .process_turn(turn("late"))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("shutting down"), "{refused:?}");
    let info = refused.get_details_error_info().expect("an ErrorInfo");
    assert_eq!(info.reason, "SHUTTING_DOWN");
    assert!(
        refused.get_details_retry_info().is_some(),
        "retry elsewhere: {refused:?}"
    );

    open.send(true).unwrap();
    for call in in_flight {
        let response = call
            .await
            .unwrap()
            .expect("an in-flight turn finished")
            .into_inner();
        assert_eq!(texts(&response), ["count: 1"]);
    }
    tokio::time::timeout(Duration::from_secs(10), stopped)
        .await
        .expect("the server stopped after the drain")
        .unwrap()
        .unwrap();

    // A new replica on the same database: every drained turn committed exactly once, and the
    // refused one never ran.
    let mut next = TestApp::on(&url).spawn().await;
    for i in 0..8 {
        let mut again = turn(&format!("t{i}"));
        again.bot = "counter".into();
        let response = next.client.process_turn(again).await.unwrap().into_inner();
        assert!(response.redelivered, "t{i} committed before the stop");
        assert_eq!(texts(&response), ["count: 1"]);
    }
    let mut late = turn("late");
    late.bot = "counter".into();
    let response = next.client.process_turn(late).await.unwrap().into_inner();
    assert!(!response.redelivered, "the refused turn had not run");
    assert_eq!(texts(&response), ["count: 1"]);
}
