//! Telemetry as shipped costs a turn nothing: at the log filter a deployment runs (`info`, the
//! default of `RUST_LOG`), no span and no event is recorded for a turn that goes well. A span
//! that is recorded is created and has its fields formatted at every turn, whether or not
//! anything is ever printed: a third of a turn's instructions when a turn's spans were at INFO
//! (`bench/RESULTS.md`). This test fails if one comes back.
//!
//! A target of its own, because it installs the process's global subscriber: the shipped log
//! filter (`turnstile::telemetry::log_filter`) in front of a layer that counts what passes it.
#![allow(clippy::unwrap_used)]

use std::sync::Mutex;
use std::time::Duration;

use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use turnstile::bots::LlmBot;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

/// Every span and event the shipped filter lets through: `level target name`.
#[derive(Default)]
struct Seen(Mutex<Vec<String>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for &'static Seen {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let m = attrs.metadata();
        self.0
            .lock()
            .unwrap()
            .push(format!("span {} {} {}", m.level(), m.target(), m.name()));
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let m = event.metadata();
        self.0
            .lock()
            .unwrap()
            .push(format!("event {} {} {}", m.level(), m.target(), m.name()));
    }
}

fn activity(conversation: &str, id: usize) -> pb::Activity {
    pb::Activity {
        r#type: Some("message".into()),
        id: Some(format!("a{id}")),
        channel_id: Some("test".into()),
        conversation: Some(pb::ConversationAccount {
            id: Some(conversation.into()),
            ..Default::default()
        }),
        from: Some(pb::ChannelAccount {
            id: Some("ada".into()),
            ..Default::default()
        }),
        text: Some("add ham".into()),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_records_no_span_and_no_event_at_the_shipped_log_filter() {
    // SAFETY of the test's premise: the filter as a deployment gets it, with RUST_LOG unset.
    assert!(
        std::env::var_os("RUST_LOG").is_none(),
        "run this test without RUST_LOG: it checks the default filter"
    );
    static SEEN: std::sync::OnceLock<Seen> = std::sync::OnceLock::new();
    let seen: &'static Seen = SEEN.get_or_init(Seen::default);
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry().with(seen.with_filter(turnstile::telemetry::log_filter())),
    )
    .unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(turnstile::serve(
        turnstile::Config::default(),
        // The `llm` bot drafts: a streamed turn is checked too, at a word a millisecond.
        turnstile::bots::samples().with("llm", LlmBot::new(Duration::from_millis(1))),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    let mut client = loop {
        match TurnServiceClient::connect(format!("http://{address}")).await {
            Ok(client) => break client,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    // The server's start logs at INFO (the store it uses, "serving TurnService"): that is not a
    // turn's. A first turn is answered only once the server serves, after those lines; the
    // connection alone can come before them (the listener is bound before `serve` runs).
    client
        .process_turn(pb::ProcessTurnRequest::typed(activity("warm-up", 100), ""))
        .await
        .unwrap();
    seen.0.lock().unwrap().clear();

    for i in 0..20 {
        let streamed = i % 2 == 0;
        let conversation = format!("c{}", i % 4);
        if streamed {
            let mut events = client
                .stream_turn(pb::StreamTurnRequest::typed(
                    activity(&conversation, i),
                    "llm",
                ))
                .await
                .unwrap()
                .into_inner();
            while events.message().await.unwrap().is_some() {}
        } else {
            client
                .process_turn(pb::ProcessTurnRequest::typed(
                    activity(&conversation, i),
                    "",
                ))
                .await
                .unwrap();
        }
    }
    let during_turns = std::mem::take(&mut *seen.0.lock().unwrap());
    assert!(
        during_turns.is_empty(),
        "recorded at the shipped filter during 20 turns (each costs every turn): {during_turns:#?}"
    );
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
