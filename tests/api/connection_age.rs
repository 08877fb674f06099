//! Connection age: the server tells a client's connection to go away once it is older than
//! `max_connection_age`, the client reconnects on its own (so that replicas added by a scale-out
//! get traffic), and a call in flight at that moment finishes within the grace — or is cut when
//! it outlives it.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::time::Duration;

use async_trait::async_trait;
use support::TestApp;
use support::proxy::Proxy;
use tonic::transport::Channel;
use turnstile::bots::CounterBot;
use turnstile::config::{Config, Connections};
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

/// The counter bot; a message `slow N` takes N milliseconds first.
struct Sleepy;

#[async_trait]
impl Bot for Sleepy {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if let Some(ms) = turn.text().strip_prefix("slow ") {
            let ms: u64 = ms.parse().map_err(BotError::msg)?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        CounterBot.on_turn(turn).await
    }
}

/// A server whose connections age out after one second, behind a proxy that counts the TCP
/// connections clients open, and one channel through it.
async fn aging_server(grace: Duration) -> (TestApp, Proxy, TurnServiceClient<Channel>) {
    // Up (its client connected) before the proxy connects to it.
    let app = TestApp::memory()
        .bots(BotRegistry::new("sleepy", Sleepy))
        .config(move |c| Config {
            connections: Connections {
                max_age: Some(Duration::from_secs(1)),
                max_age_grace: Some(grace),
                ..Connections::default()
            },
            ..c
        })
        .spawn()
        .await;
    let proxy = Proxy::start(app.addr).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", proxy.addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (app, proxy, TurnServiceClient::new(channel))
}

fn say(text: &str) -> turnstile::grpc::pb::ProcessTurnRequest {
    support::request(support::message("aging", "alice", text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aged_connections_are_replaced_and_calls_in_flight_finish_within_the_grace() {
    let (_app, proxy, client) = aging_server(Duration::from_secs(30)).await;

    // A call that is still running when its connection's age passes.
    let slow = tokio::spawn({
        let mut client = client.clone();
        async move { client.process_turn(say("slow 2500")).await }
    });
    // Calls over the same channel, before, during and after the GOAWAY.
    let mut ok = 0;
    for _ in 0..35 {
        let mut c = client.clone();
        let reply = c.process_turn(say("hi")).await;
        assert!(
            reply.is_ok(),
            "a call across the reconnect failed: {reply:?}"
        );
        ok += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let slow = slow.await.unwrap();
    assert!(slow.is_ok(), "the call in flight was cut: {slow:?}");
    let opened = proxy.opened();
    eprintln!("{ok} calls over {opened} connections");
    assert!(
        opened >= 2,
        "calls over 3.5 s stayed on {opened} connection(s)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_outlives_the_grace_is_cut() {
    let (_app, _proxy, mut client) = aging_server(Duration::from_secs(1)).await;
    // Age 1 s + grace 1 s, and a call of 6 s started at once.
    let cut = client.process_turn(say("slow 6000")).await;
    let status = cut.expect_err("the connection was closed under the call");
    eprintln!("cut: {status:?}");
    // The channel reconnects: once it has noticed the cut (a call sent in between may fail
    // with it), calls succeed again.
    let mut again = client.process_turn(say("hi")).await;
    for _ in 0..20 {
        if again.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        again = client.process_turn(say("hi")).await;
    }
    again.unwrap();
}
