//! Back-pressure: past `max_in_flight` turns, calls are refused with `RESOURCE_EXHAUSTED` (with
//! `ErrorInfo` OVERLOADED and a `RetryInfo`), at once unless they come in a storm, when they are
//! held back; the bot never runs more turns at a time than the limit, and every admitted turn
//! commits exactly once.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use support::{TestApp, TestAppBuilder, message, texts};
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt as _;
use turnstile::bots::CounterBot;
use turnstile::config::Config;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

const LIMIT: usize = 8;
const CALLS: usize = 200;

/// The counter bot behind a gate the test opens, measuring how many turns are inside at once.
#[derive(Clone)]
struct GatedCounter {
    gate: Arc<Semaphore>,
    inside: Arc<AtomicUsize>,
    most_inside: Arc<AtomicUsize>,
    /// How long each turn stays in the bot after the gate, in milliseconds.
    pause_ms: Arc<AtomicU64>,
}

impl GatedCounter {
    /// The gate shut, nobody inside, no pause.
    fn shut() -> Self {
        Self {
            gate: Arc::new(Semaphore::new(0)),
            inside: Arc::default(),
            most_inside: Arc::default(),
            pause_ms: Arc::default(),
        }
    }
}

#[async_trait]
impl Bot for GatedCounter {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_inside.fetch_max(now, Ordering::SeqCst);
        let passed = self.gate.acquire().await.map(drop);
        tokio::time::sleep(Duration::from_millis(self.pause_ms.load(Ordering::SeqCst))).await;
        self.inside.fetch_sub(1, Ordering::SeqCst);
        passed.map_err(BotError::msg)?;
        CounterBot.on_turn(turn).await
    }
}

/// A server on `app` running `bot` with at most `LIMIT` turns in flight.
async fn limited(app: TestAppBuilder<'_>, bot: &GatedCounter) -> TestApp {
    app.bots(BotRegistry::new("counter", bot.clone()))
        .config(|c| Config {
            max_in_flight: Some(LIMIT),
            ..c
        })
        .spawn()
        .await
}

/// Whether call `i` goes to the shared conversation `hot` (one in five, on every connection).
fn is_hot(i: usize) -> bool {
    i % 5 == 0
}

/// A turn in the shared conversation `hot` or in a conversation of its own.
fn turn(wave: &str, i: usize) -> pb::ProcessTurnRequest {
    let conversation = if is_hot(i) {
        "hot".to_owned()
    } else {
        format!("{wave}-{i}")
    };
    pb::ProcessTurnRequest::typed(message(&conversation, "alice", "hi"), String::new())
}

/// Fires `CALLS` turns over four connections (hyper caps streams per connection at 200), call
/// `i` after `i * stagger`; each result arrives on the returned channel with whether it went to
/// the shared conversation and how long it took.
async fn fire(
    clients: &[TurnServiceClient<Channel>],
    wave: &'static str,
    stagger: Duration,
) -> mpsc::UnboundedReceiver<(
    bool,
    Duration,
    Result<pb::ProcessTurnResponse, tonic::Status>,
)> {
    let (tx, rx) = mpsc::unbounded_channel();
    for i in 0..CALLS {
        let mut client = clients[i % clients.len()].clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(stagger * u32::try_from(i).unwrap()).await;
            let started = Instant::now();
            let result = client.process_turn(turn(wave, i)).await;
            let _ = tx.send((
                is_hot(i),
                started.elapsed(),
                result.map(tonic::Response::into_inner),
            ));
        });
    }
    rx
}

fn assert_overloaded(status: &tonic::Status) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let info = status.get_details_error_info().expect("an ErrorInfo");
    assert_eq!(info.reason, "OVERLOADED", "{info:?}");
    assert_eq!(info.domain, turnstile::grpc::error::ERROR_DOMAIN);
    assert_eq!(info.metadata.get("max_in_flight"), Some(&LIMIT.to_string()));
    let retry = status.get_details_retry_info().expect("a RetryInfo");
    assert!(retry.retry_delay.is_some_and(|d| d > Duration::ZERO));
}

/// The count a counter reply names.
fn count(response: &pb::ProcessTurnResponse) -> u64 {
    texts(response)[0]
        .strip_prefix("count: ")
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_past_the_limit_are_refused_at_once_and_admitted_turns_are_exact() {
    let bot = GatedCounter::shut();
    let app = limited(TestApp::postgres(), &bot).await;
    // Four connections.
    let mut clients = vec![app.client.clone()];
    for _ in 1..4 {
        clients.push(app.connect().await);
    }

    // Wave 1, the gate shut: no turn can finish, so exactly LIMIT are admitted and every other
    // call must be answered while those still hold their places: refused without waiting.
    let mut results = fire(&clients, "shut", Duration::ZERO).await;
    let mut slowest_refusal = Duration::ZERO;
    for n in 0..CALLS - LIMIT {
        let (_, took, result) = tokio::time::timeout(Duration::from_secs(60), results.recv())
            .await
            .unwrap_or_else(|_| panic!("only {n} calls answered while {LIMIT} turns hold the gate"))
            .unwrap();
        assert_overloaded(&result.expect_err("refused while the gate is shut"));
        slowest_refusal = slowest_refusal.max(took);
    }
    // Refused before its request is read: bytes that are no request at all (which an admitted
    // call would have refused as INVALID_ARGUMENT) get the same answer as a valid one.
    let unread = support::raw::send_raw(app.addr, vec![0xff, 0xff, 0xff, 0x0f, 0x01], None).await;
    assert_overloaded(&unread);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        results.try_recv().is_err(),
        "an admitted turn finished behind a shut gate"
    );
    assert!(bot.most_inside.load(Ordering::SeqCst) <= LIMIT);
    eprintln!(
        "slowest of {} refusals: {slowest_refusal:?}; {} turns in the bot",
        CALLS - LIMIT,
        bot.most_inside.load(Ordering::SeqCst)
    );

    let most_while_shut = bot.most_inside.load(Ordering::SeqCst);
    let mut hot_counts = Vec::new();
    bot.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    for _ in 0..LIMIT {
        let (hot, _, result) = tokio::time::timeout(Duration::from_secs(60), results.recv())
            .await
            .expect("the admitted turns finish once the gate opens")
            .unwrap();
        let response = result.expect("an admitted turn commits");
        if hot {
            hot_counts.push(count(&response));
        } else {
            assert_eq!(count(&response), 1);
        }
    }
    // Behind the shut gate sat every admitted turn of its own conversation, and one of the
    // shared conversation's (the others queued behind it): no more, no fewer.
    let cold_admitted = LIMIT - hot_counts.len();
    assert_eq!(
        most_while_shut,
        cold_admitted + usize::from(!hot_counts.is_empty()),
        "turns in the bot behind the shut gate"
    );

    // Wave 2, the gate open, calls spread over a second and each turn 30 ms in the bot: slots
    // free up and are taken again, the shared conversation's turns queue, some calls find the
    // replica full, and the bot never holds more than LIMIT.
    bot.pause_ms.store(30, Ordering::SeqCst);
    let mut results = fire(&clients, "open", Duration::from_millis(5)).await;
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..CALLS {
        let (hot, _, result) = tokio::time::timeout(Duration::from_secs(60), results.recv())
            .await
            .expect("every call is answered")
            .unwrap();
        match result {
            Ok(response) => {
                admitted += 1;
                if hot {
                    hot_counts.push(count(&response));
                } else {
                    assert_eq!(count(&response), 1);
                }
            }
            Err(status) => {
                assert_overloaded(&status);
                refused += 1;
            }
        }
    }
    let most = bot.most_inside.load(Ordering::SeqCst);
    eprintln!("wave 2: {admitted} admitted, {refused} refused, at most {most} turns in the bot");
    assert!(most <= LIMIT, "{most} turns ran in the bot at once");
    assert!(
        refused > 0 && admitted > 0,
        "{admitted} admitted, {refused} refused"
    );

    // Every admitted turn of the shared conversation counted once: 1..=n, no gap, no double.
    hot_counts.sort_unstable();
    let expected: Vec<u64> = (1..=hot_counts.len() as u64).collect();
    assert_eq!(hot_counts, expected);
    let read = pb::Activity {
        r#type: Some("event".into()),
        name: Some("read".into()),
        ..message("hot", "alice", "")
    };
    let state = clients[0]
        .process_turn(support::request(read))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        count(&state),
        hot_counts.len() as u64,
        "refused turns left no trace"
    );
}

/// `--max-concurrent-streams`: one connection carries at most that many calls at once; the
/// client holds the others back, and they run as places free up, though the replica would admit
/// them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_carries_at_most_max_concurrent_streams_calls() {
    let bot = GatedCounter::shut();
    let mut app = TestApp::memory()
        .bots(BotRegistry::new("counter", bot.clone()))
        .config(|c| {
            let mut config = Config {
                max_in_flight: Some(64),
                ..c
            };
            config.connections.max_streams = Some(2);
            config
        })
        .spawn()
        .await;
    // One connection: its clones share it. A first call, let through, so that the client has
    // the server's settings before it sends more (sent before them, extra streams are reset).
    bot.gate.add_permits(1);
    app.client.process_turn(turn("streams", 0)).await.unwrap();
    bot.most_inside.store(0, Ordering::SeqCst);
    let calls: Vec<_> = (0..5)
        .map(|i| {
            let mut client = app.client.clone();
            tokio::spawn(async move { client.process_turn(turn("streams", i + 1)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        bot.most_inside.load(Ordering::SeqCst),
        2,
        "calls in the bot at once over one connection limited to 2 streams"
    );
    bot.gate.add_permits(5);
    for call in calls {
        call.await
            .unwrap()
            .expect("every call runs once a stream is free");
    }
}

/// A storm of refusals: past 100 refusals in 100 ms, each further one is held back 200 ms and
/// its `RetryInfo` asks for 300 ms instead of 500, so that a caller that waits as asked retries
/// when it would have, and one that retries at once is slowed down. The first ones go at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_a_storm_of_refusals_each_is_held_back_and_asks_for_as_much_less_wait() {
    const STORM: usize = 1000;
    let bot = GatedCounter::shut();
    let app = limited(TestApp::memory(), &bot).await;
    // The places taken, behind the shut gate.
    let admitted: Vec<_> = (0..LIMIT)
        .map(|i| {
            let mut client = app.client.clone();
            tokio::spawn(async move { client.process_turn(turn("storm", i * 5 + 1)).await })
        })
        .collect();
    while bot.inside.load(Ordering::SeqCst) < LIMIT {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A thousand calls at once over eight connections: refused in a few windows of 100 ms, so
    // that at least one of them counts more than 100.
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(app.connect().await);
    }
    let calls: Vec<_> = (0..STORM)
        .map(|i| {
            let mut client = clients[i % clients.len()].clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let status = client
                    .process_turn(turn("storm", i * 5 + 2))
                    .await
                    .expect_err("refused: every place is taken");
                (started.elapsed(), status)
            })
        })
        .collect();
    let (mut at_once, mut held) = (0, 0);
    for call in calls {
        let (took, status) = call.await.unwrap();
        assert_overloaded(&status);
        let delay = status
            .get_details_retry_info()
            .and_then(|r| r.retry_delay)
            .unwrap();
        if delay == Duration::from_millis(300) {
            assert!(took >= Duration::from_millis(200), "held {took:?}");
            held += 1;
        } else {
            assert_eq!(delay, Duration::from_millis(500), "{status:?}");
            at_once += 1;
        }
    }
    eprintln!("{at_once} refused at once, {held} held back");
    assert!(at_once >= 100, "the first hundred go at once: {at_once}");
    assert!(held > 0, "none of {STORM} held back");

    bot.gate.add_permits(LIMIT);
    for call in admitted {
        call.await.unwrap().expect("the admitted turns commit");
    }
}
