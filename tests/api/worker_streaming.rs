//! A bot worker streams drafts too: a streamed turn (`StreamTurn`) of a remote bot calls
//! `BotWorker/StreamRunTurn`, passes each of the worker's drafts on as it arrives, and commits
//! the worker's result; a conflict between replicas voids the first attempt's drafts and the
//! replay, a new call, drafts anew; a turn nobody streams calls `RunTurn`, as before. A worker
//! that cannot stream (`UNIMPLEMENTED`) is called with `RunTurn` instead. Each way a worker can
//! get its stream wrong — an event after its result, no result, an error after drafting, a draft
//! over the size cap, a connection that breaks midway — ends the call with a status naming it,
//! and commits nothing. A stopped turn (`StopTurn`) cancels the worker's call and commits what it
//! had drafted. A worker reached over `https` is verified against `--remote-bot-ca`. The worker
//! is a tonic server inside the test; the store is real PostgreSQL.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::proxy::Proxy;
use support::streams::{outcome, stream};
use support::{TestApp, message, texts};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};
use tonic_types::StatusExt as _;
use turnstile::bots::remote::RemoteBots;
use turnstile::config::Config;
use turnstile::grpc::pb;
use turnstile::grpc::pb::stream_run_turn_response::Event as WorkerEvent;
use turnstile::grpc::pb::stream_turn_response::Event;

/// A worker that counts like the counter bot, drafting `count:` then `count: N`, and gets its
/// stream wrong on request (the message's text says how). Bot `old` cannot stream.
#[derive(Default)]
struct FakeWorker {
    /// Every call: (method, bot, text).
    calls: Mutex<Vec<(&'static str, String, String)>>,
    /// What the first attempt of a `wait` message waits for after drafting.
    gate: Notify,
    /// Calls whose caller went away while the worker was still writing.
    cancelled: std::sync::atomic::AtomicU32,
}

struct FakeService(Arc<FakeWorker>);

type Sent = Result<pb::StreamRunTurnResponse, Status>;

impl FakeWorker {
    /// Records the call; returns the text and the count the answer will hold.
    fn called(&self, method: &'static str, request: &pb::RunTurnRequest) -> (String, u64) {
        let activity: serde_json::Value = serde_json::from_str(&request.activity_json).unwrap();
        let text = activity["text"].as_str().unwrap_or_default().to_owned();
        self.calls
            .lock()
            .unwrap()
            .push((method, request.bot.clone(), text.clone()));
        let state: serde_json::Value =
            serde_json::from_str(&request.conversation.as_ref().unwrap().state_json).unwrap();
        (text, state["count"].as_u64().unwrap_or(0) + 1)
    }

    fn calls(&self) -> Vec<(&'static str, String, String)> {
        self.calls.lock().unwrap().clone()
    }

    /// Serves on a free port; returns its address.
    async fn serve(self: &Arc<Self>) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = pb::bot_worker_server::BotWorkerServer::new(FakeService(Arc::clone(self)));
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    /// The same over TLS, with a certificate for `localhost` that `ca` signed.
    async fn serve_tls(
        self: &Arc<Self>,
        ca: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    ) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = support::pki::leaf(ca, &["localhost"]);
        let tls = tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(server.cert, server.key),
        );
        let service = pb::bot_worker_server::BotWorkerServer::new(FakeService(Arc::clone(self)));
        tokio::spawn(
            tonic::transport::Server::builder()
                .tls_config(tls)
                .unwrap()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }
}

fn answer(count: u64) -> pb::RunTurnResponse {
    pb::RunTurnResponse {
        replies_json: vec![serde_json::json!({"text": format!("count: {count}")}).to_string()],
        conversation: Some(pb::ScopeOutcome {
            read: true,
            replaced_json: Some(serde_json::json!({"count": count}).to_string()),
        }),
        user: None,
        private_conversation: None,
    }
}

fn draft(kind: pb::WorkerDraftKind, text: impl Into<String>) -> Sent {
    Ok(pb::StreamRunTurnResponse {
        event: Some(WorkerEvent::Draft(pb::WorkerDraft {
            kind: kind as i32,
            text: text.into(),
        })),
    })
}

fn result(count: u64) -> Sent {
    Ok(pb::StreamRunTurnResponse {
        event: Some(WorkerEvent::Result(answer(count))),
    })
}

#[tonic::async_trait]
impl pb::bot_worker_server::BotWorker for FakeService {
    async fn run_turn(
        &self,
        request: tonic::Request<pb::RunTurnRequest>,
    ) -> Result<tonic::Response<pb::RunTurnResponse>, Status> {
        let (_, count) = self.0.called("RunTurn", request.get_ref());
        Ok(tonic::Response::new(answer(count)))
    }

    type StreamRunTurnStream = ReceiverStream<Sent>;

    async fn stream_run_turn(
        &self,
        request: tonic::Request<pb::StreamRunTurnRequest>,
    ) -> Result<tonic::Response<Self::StreamRunTurnStream>, Status> {
        let r = request.into_inner();
        let bot = r.bot.clone();
        let attempt = r.attempt;
        let (text, count) = self.0.called(
            "StreamRunTurn",
            &pb::RunTurnRequest {
                bot: r.bot,
                activity_json: r.activity_json,
                attempt: r.attempt,
                conversation: r.conversation,
                user: r.user,
                private_conversation: r.private_conversation,
                superseded_json: r.superseded_json,
                batch_json: r.batch_json,
            },
        );
        if bot == "old" {
            return Err(Status::unimplemented("Method not found!"));
        }
        use pb::WorkerDraftKind::{Informative, Text};
        let events = match text.as_str() {
            "after" => vec![draft(Text, "count: 1"), result(count), draft(Text, "more")],
            "no-result" => vec![draft(Text, "count: 1")],
            "fails" => vec![
                draft(Text, "half an answer"),
                Err(Status::internal("the model went away")),
            ],
            "big" => vec![draft(Text, "x".repeat(100))],
            "break" => vec![draft(Text, "half an answer")],
            "wait" => vec![draft(Text, format!("count: {count}"))],
            _ => vec![
                draft(Informative, "Thinking…"),
                draft(Text, "count:"),
                draft(Text, format!("count: {count}")),
                result(count),
            ],
        };
        let (tx, rx) = mpsc::channel(8);
        let worker = Arc::clone(&self.0);
        tokio::spawn(async move {
            for event in events {
                if tx.send(event).await.is_err() {
                    return;
                }
            }
            if text == "wait" {
                // The first attempt holds here, its draft shown, while another replica commits
                // (or until its caller cancels the call: the user stopped the turn).
                if attempt == 1 {
                    tokio::select! {
                        () = worker.gate.notified() => {}
                        () = tx.closed() => {
                            worker.cancelled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            return;
                        }
                    }
                }
                let _ = tx.send(result(count)).await;
            }
            if text == "break" {
                // Never ends: the test cuts the connection under it.
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(tx);
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// Each draft as `kind text`.
fn drafts(events: &[Event]) -> Vec<String> {
    support::streams::drafts(events)
        .into_iter()
        .map(|d| format!("{:?} {}", d.kind(), d.text))
        .collect()
}

/// `config` hosting each `(name, address)` as a remote bot.
fn with_remote_bots(config: Config, bots: &[(&str, std::net::SocketAddr)]) -> Config {
    Config {
        remote_bots: RemoteBots {
            bots: bots
                .iter()
                .map(|(name, addr)| format!("{name}=http://{addr}").parse().unwrap())
                .collect(),
            ..RemoteBots::default()
        },
        ..config
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_over_https_is_verified_against_the_remote_bot_ca() {
    let url = support::pg::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = support::pki::new_ca("worker CA");
    let other = support::pki::new_ca("another CA");
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.path().join("other.pem"), other.pem()).unwrap();
    let worker = Arc::new(FakeWorker::default());
    let addr = worker.serve_tls(&ca).await;
    let serving = |config: Config, ca_file: &str| Config {
        remote_bots: RemoteBots {
            bots: vec![
                format!("fake=https://localhost:{}", addr.port())
                    .parse()
                    .unwrap(),
            ],
            ca: Some(dir.path().join(ca_file)),
            ..RemoteBots::default()
        },
        ..config
    };

    let mut app = TestApp::on(&url)
        .config(|c| serving(c, "ca.pem"))
        .spawn()
        .await;
    let reply = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("w-tls", "ada", "hello"),
            "fake",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&reply), ["count: 1"]);

    // A worker whose certificate does not chain to the CA is never called.
    let mut app = TestApp::on(&url)
        .config(|c| serving(c, "other.pem"))
        .spawn()
        .await;
    let refused = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("w-tls", "ada", "again"),
            "fake",
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(worker.calls().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_drafts_stream_before_its_committed_result_and_an_unstreamed_turn_calls_run_turn()
{
    let worker = Arc::new(FakeWorker::default());
    let addr = worker.serve().await;
    let mut app = TestApp::postgres()
        .config(|c| with_remote_bots(c, &[("fake", addr)]))
        .spawn()
        .await;
    let activity = message("w-stream", "ada", "hello");

    let (events, ended) = stream(&app, activity.clone(), "fake").await;
    ended.unwrap();
    assert_eq!(
        drafts(&events),
        ["Informative Thinking…", "Text count:", "Text count: 1"],
        "the worker's drafts, in order: {events:?}"
    );
    let committed = outcome(&events);
    assert_eq!(texts(committed), ["count: 1"]);
    assert_eq!(committed.version, 1);
    assert_eq!(
        worker.calls(),
        [("StreamRunTurn", "fake".to_owned(), "hello".to_owned())]
    );

    // A redelivery: the receipt answers, the worker is not called, nothing is drafted.
    let (again, ended) = stream(&app, activity, "fake").await;
    ended.unwrap();
    assert_eq!(again.len(), 1, "the outcome alone: {again:?}");
    assert!(outcome(&again).redelivered);
    assert_eq!(worker.calls().len(), 1);

    // A turn nobody streams costs what it did: one RunTurn.
    let reply = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("w-stream", "ada", "more"),
            "fake",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&reply), ["count: 2"]);
    assert_eq!(
        worker.calls().last().unwrap(),
        &("RunTurn", "fake".to_owned(), "more".to_owned())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_stream_is_called_with_run_turn_and_its_turn_commits() {
    let worker = Arc::new(FakeWorker::default());
    let addr = worker.serve().await;
    let app = TestApp::postgres()
        .config(|c| with_remote_bots(c, &[("old", addr)]))
        .spawn()
        .await;

    let (events, ended) = stream(&app, message("w-old", "ada", "one"), "old").await;
    ended.unwrap();
    assert_eq!(events.len(), 1, "no drafts, the outcome: {events:?}");
    assert_eq!(texts(outcome(&events)), ["count: 1"]);
    // The next streamed turn goes straight to RunTurn: the worker said it cannot stream.
    let (events, ended) = stream(&app, message("w-old", "ada", "two"), "old").await;
    ended.unwrap();
    assert_eq!(texts(outcome(&events)), ["count: 2"]);
    let methods: Vec<(&str, String)> = worker
        .calls()
        .into_iter()
        .map(|(method, _, text)| (method, text))
        .collect();
    assert_eq!(
        methods,
        [
            ("StreamRunTurn", "one".to_owned()),
            ("RunTurn", "one".to_owned()),
            ("RunTurn", "two".to_owned()),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_worker_gets_wrong_or_that_breaks_ends_with_a_status_naming_it_and_commits_nothing()
 {
    let worker = Arc::new(FakeWorker::default());
    let addr = worker.serve().await;
    let proxy = Proxy::start(addr).await;
    let mut app = TestApp::postgres()
        .config(|mut c| {
            c.limits.max_text_bytes = 64;
            with_remote_bots(c, &[("fake", addr), ("cut", proxy.addr())])
        })
        .spawn()
        .await;

    for (text, problem) in [
        (
            "after",
            "bot worker `fake` sent an event after its result (the result must be the last)",
        ),
        (
            "no-result",
            "bot worker `fake` ended its stream without a result",
        ),
        (
            "fails",
            "bot worker `fake` failed: Internal: the model went away",
        ),
        (
            "big",
            "bot worker `fake` sent a draft of 100 bytes, over the limit of 64 bytes (--max-text-bytes)",
        ),
    ] {
        let (events, ended) = stream(&app, message("w-bad", "ada", text), "fake").await;
        let status = ended.expect_err(text);
        assert_eq!(status.code(), Code::Internal, "{text}: {status:?}");
        assert_eq!(
            status.get_details_error_info().unwrap().reason,
            "BOT_FAILED",
            "{text}"
        );
        assert!(
            status.message().starts_with(problem),
            "{text}: the message should name the problem: {:?}",
            status.message()
        );
        assert!(
            !events.iter().any(|e| matches!(e, Event::Outcome(_))),
            "{text}: {events:?}"
        );
    }

    // The connection breaks after a draft has reached the caller: the worker went away.
    let mut events = app
        .client
        .stream_turn(pb::StreamTurnRequest::typed(
            message("w-bad", "ada", "break"),
            "cut",
        ))
        .await
        .unwrap()
        .into_inner();
    let first = events.message().await.unwrap().unwrap().event.unwrap();
    assert_eq!(drafts(&[first]), ["Text half an answer"]);
    assert!(proxy.cut(Duration::ZERO) > 0, "a connection to cut");
    let status = events.message().await.expect_err("the stream broke");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "BOT_UNAVAILABLE"
    );
    assert!(
        status
            .message()
            .starts_with("bot worker `cut` is unavailable"),
        "{status:?}"
    );

    // Nothing of any of them committed: the next turn counts from zero.
    let (events, ended) = stream(&app, message("w-bad", "ada", "hello"), "fake").await;
    ended.unwrap();
    let committed = outcome(&events);
    assert_eq!(texts(committed), ["count: 1"]);
    assert_eq!(committed.version, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_mid_stream_voids_the_workers_drafts_and_its_replay_drafts_anew() {
    let worker = Arc::new(FakeWorker::default());
    let addr = worker.serve().await;
    let mut a = TestApp::postgres()
        .config(|c| with_remote_bots(c, &[("fake", addr)]))
        .spawn()
        .await;
    let mut b = a.replica(turnstile::bots::samples()).await;
    b.client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("w-race", "ada", "first"),
            "fake",
        ))
        .await
        .unwrap();

    let mut events = a
        .client
        .stream_turn(pb::StreamTurnRequest::typed(
            message("w-race", "ada", "wait"),
            "fake",
        ))
        .await
        .unwrap()
        .into_inner();
    // The worker's first draft: attempt 1 has read the state and waits in the worker.
    let first = events.message().await.unwrap().unwrap().event.unwrap();
    assert!(
        matches!(&first, Event::Draft(d) if d.attempt == 1 && d.text == "count: 2"),
        "{first:?}"
    );
    // Meanwhile replica B commits a turn of the same conversation.
    let other = b
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("w-race", "bob", "other"),
            "fake",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&other), ["count: 2"]);
    worker.gate.notify_one();

    let mut rest = vec![first];
    while let Some(response) = events.message().await.unwrap() {
        rest.push(response.event.unwrap());
    }
    let seen = support::streams::kinds(&rest);
    assert_eq!(
        seen,
        [
            "draft 1 count: 2",
            "reset 1",
            "draft 2 count: 3",
            "outcome 2"
        ],
        "the void draft, its reset, the replay's draft on fresh state, then the outcome"
    );
    let committed = outcome(&rest);
    assert_eq!(texts(committed), ["count: 3"]);
    assert_eq!(committed.version, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_turn_cancels_the_workers_call_and_commits_what_it_had_drafted() {
    let worker = Arc::new(FakeWorker::default());
    let addr = worker.serve().await;
    let mut app = TestApp::postgres()
        .config(|c| with_remote_bots(c, &[("remote", addr)]))
        .spawn()
        .await;
    let activity = message("stop-w", "ada", "wait");
    let mut events = app
        .client
        .stream_turn(pb::StreamTurnRequest::typed(activity.clone(), "remote"))
        .await
        .unwrap()
        .into_inner();
    let first = events.message().await.unwrap().unwrap().event.unwrap();
    assert!(
        matches!(&first, Event::Draft(d) if d.text == "count: 1"),
        "{first:?}"
    );

    let stopped = app
        .client
        .stop_turn(pb::StopTurnRequest {
            bot: "remote".into(),
            channel_id: activity.channel_id.clone().unwrap(),
            conversation_id: activity.conversation.clone().unwrap().id.unwrap(),
            activity_id: activity.id.clone().unwrap(),
            shown_text: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stopped.result(), pb::StopTurnResult::Stopped);
    let (events, ended) = support::streams::collect(events, vec![first]).await;
    ended.unwrap();
    let committed = outcome(&events);
    assert!(committed.stopped);
    assert_eq!(
        texts(committed),
        ["count: 1"],
        "what the worker had drafted"
    );
    assert_eq!(
        committed.version, 0,
        "the worker's state change is not committed"
    );
    // The worker sees its call cancelled: it stops writing.
    for _ in 0..100 {
        if worker.cancelled.load(std::sync::atomic::Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        worker.cancelled.load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(worker.calls().len(), 1, "the worker ran once");
}
