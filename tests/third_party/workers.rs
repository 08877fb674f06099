//! Bot workers: bots in Python and TypeScript, run by the SDKs in `sdk/`, keep every guarantee an
//! in-process bot has — the pizza race over three replicas on PostgreSQL, redelivery answered
//! from the receipt without calling the worker, a replica SIGKILLed under load with every count
//! exact — and each way a worker can fail gives its documented status with nothing committed.
//!
//! The tests install what the SDKs need on first use: grpcio and grpcio-tools from PyPI and
//! @grpc/grpc-js and @grpc/proto-loader from npm, under `<target>/tools`. That needs `python3`
//! with pip, `npm`, and the registries; without them the tests fail and say so.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::BTreeSet;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::fleet::Fleet;
use support::load::{Failure, Gateway, Shape};
use support::{TestServer, check, message, texts, toppings};
use tokio::time::{Instant, sleep};
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt as _;
use turnstile::bots::remote::RemoteBots;
use turnstile::config::Config;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::store::Store;
use turnstile::store::memory::MemoryStore;

const PYTHON_PACKAGES: [&str; 2] = ["grpcio==1.76.0", "grpcio-tools==1.76.0"];
const NODE_PACKAGES: [&str; 2] = ["@grpc/grpc-js@1.14.7", "@grpc/proto-loader@0.8.1"];

// --- installing the SDKs' dependencies ------------------------------------------------------

/// A `pip install --target` directory with grpcio and grpcio-tools, for `PYTHONPATH`.
fn python_packages() -> PathBuf {
    support::tools::pip("python-worker-grpcio-1.76.0", &PYTHON_PACKAGES)
}

/// A `node_modules` directory with @grpc/grpc-js and @grpc/proto-loader, for `NODE_PATH`.
fn node_modules() -> PathBuf {
    support::tools::npm("node-worker-grpc-js-1.14.7", &NODE_PACKAGES).join("node_modules")
}

fn sdk(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk").join(path)
}

// --- worker processes -----------------------------------------------------------------------

/// A bot worker process, killed when dropped. It runs with `TURNSTILE_WORKER_TRACE`, so its
/// stderr names every call it gets.
struct WorkerProcess {
    child: Child,
    port: u16,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl WorkerProcess {
    /// A Python worker: `python3 args…` with the SDK importable.
    fn python(args: &[&str]) -> WorkerProcess {
        let packages = tokio::task::block_in_place(python_packages);
        let mut command = Command::new("python3");
        command.args(args).env(
            "PYTHONPATH",
            format!("{}:{}", packages.display(), sdk("python").display()),
        );
        WorkerProcess::spawn(command)
    }

    /// A Node worker: `node script` with the SDK's dependencies resolvable.
    fn node(script: &Path) -> WorkerProcess {
        let modules = tokio::task::block_in_place(node_modules);
        let mut command = Command::new("node");
        command
            .arg(script)
            .arg("127.0.0.1:0")
            .env("NODE_PATH", modules);
        WorkerProcess::spawn(command)
    }

    /// Starts `command` and waits (generously) for the line that says which port it serves on.
    fn spawn(mut command: Command) -> WorkerProcess {
        let mut child = command
            .env("TURNSTILE_WORKER_TRACE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting a bot worker");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&stderr);
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(port) = line.rsplit_once(" on port ").map(|(_, p)| p.to_owned()) {
                    let _ = tx.send(port);
                }
            }
        });
        let port = tokio::task::block_in_place(|| rx.recv_timeout(Duration::from_secs(120)));
        let port: u16 = match port {
            Ok(port) => port.trim().parse().unwrap(),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the bot worker never said its port; stderr:\n{}",
                    stderr.lock().unwrap().join("\n")
                );
            }
        };
        WorkerProcess {
            child,
            port,
            stderr,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The attempts the worker was called with for activity `id`, in order.
    fn calls(&self, id: &str) -> Vec<u32> {
        let needle = format!(" activity={id} ");
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("turnstile-worker: RunTurn") && l.contains(&needle))
            .filter_map(|l| l.rsplit_once("attempt=")?.1.parse().ok())
            .collect()
    }

    /// [`WorkerProcess::calls`] once there are `n` of them (the worker's stderr is read by a
    /// thread of its own, so a line may trail the answer it was printed before), or after 30 s.
    async fn calls_settled(&self, id: &str, n: usize) -> Vec<u32> {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let calls = self.calls(id);
            if calls.len() >= n || Instant::now() > until {
                return calls;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// How many calls the worker got in all.
    fn all_calls(&self) -> usize {
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("turnstile-worker: RunTurn"))
            .count()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A configuration hosting `name` as a remote bot served at `url`.
fn remote(config: Config, name: &str, url: &str) -> Config {
    Config {
        remote_bots: RemoteBots {
            bots: vec![format!("{name}={url}").parse().unwrap()],
            ..RemoteBots::default()
        },
        ..config
    }
}

/// `text` from `user` to bot `bot` in `conversation`, with activity id `id`.
fn to_bot(bot: &str, conversation: &str, id: &str, text: &str) -> pb::ProcessTurnRequest {
    let mut activity = message(conversation, "alice", text);
    activity.id = Some(id.into());
    pb::ProcessTurnRequest::typed(activity, bot)
}

fn reason(status: &Status) -> String {
    status
        .get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

// --- the pizza race, with the Python pizza bot ----------------------------------------------

const RACE_TURNS: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_python_pizza_bot_never_acknowledges_a_lost_topping_over_three_replicas() {
    let pizza = sdk("python/examples/pizza.py");
    let worker = WorkerProcess::python(&[pizza.to_str().unwrap(), "127.0.0.1:0"]);
    let url = support::pg::fresh_database().await;
    let config = || remote(support::postgres_config(&url), "pizza-py", &worker.url());
    let (a, b, c) = tokio::join!(
        TestServer::start(config(), turnstile::bots::samples()),
        TestServer::start(config(), turnstile::bots::samples()),
        TestServer::start(config(), turnstile::bots::samples()),
    );
    let clients = [a.client().await, b.client().await, c.client().await];

    let calls = (0..RACE_TURNS).map(|i| {
        let mut client = clients[i % clients.len()].clone();
        tokio::spawn(async move {
            let topping = format!("t{i:02}");
            let mut activity = message("py-race", &format!("user{i}"), &format!("add {topping}"));
            activity.id = Some(format!("add-{i}"));
            let response = client
                .process_turn(pb::ProcessTurnRequest::typed(activity, "pizza-py"))
                .await
                .unwrap_or_else(|s| panic!("add {topping} failed: {s:?}"))
                .into_inner();
            (topping, texts(&response).join("\n"), response.attempts)
        })
    });
    let mut added = Vec::new();
    for call in calls.collect::<Vec<_>>() {
        added.push(call.await.unwrap());
    }

    // Every reply names its topping, and the replies' orders form one chain 1..=40.
    let mut orders: Vec<BTreeSet<String>> = Vec::new();
    for (topping, reply, _) in &added {
        let order: BTreeSet<String> = toppings(reply).into_iter().collect();
        assert!(
            reply.starts_with(&format!("Added {topping}.")) && order.contains(topping),
            "the reply to `add {topping}` does not name it: {reply:?}"
        );
        orders.push(order);
    }
    orders.sort_by_key(BTreeSet::len);
    assert_eq!(
        orders.iter().map(BTreeSet::len).collect::<Vec<_>>(),
        (1..=RACE_TURNS).collect::<Vec<_>>(),
        "every turn saw a distinct order size"
    );
    for pair in orders.windows(2) {
        assert!(
            pair[0].is_subset(&pair[1]),
            "an acknowledged order was lost: {:?} is not in {:?}",
            pair[0],
            pair[1]
        );
    }
    let mut client = clients[0].clone();
    let shown = client
        .process_turn(to_bot("pizza-py", "py-race", "show-1", "show"))
        .await
        .unwrap()
        .into_inner();
    let final_order: BTreeSet<String> = toppings(&texts(&shown)[0]).into_iter().collect();
    assert_eq!(final_order.len(), RACE_TURNS, "{final_order:?}");

    // The race happened, and each replay called the worker again with the next attempt.
    let replayed: Vec<_> = added.iter().filter(|(_, _, a)| *a > 1).collect();
    assert!(!replayed.is_empty(), "no turn needed a second attempt");
    let i = added.iter().position(|(_, _, a)| *a > 1).unwrap();
    let attempts = worker
        .calls_settled(&format!("add-{i}"), added[i].2 as usize)
        .await;
    assert_eq!(
        attempts,
        (1..=added[i].2).collect::<Vec<_>>(),
        "the worker saw each attempt of add-{i}"
    );
    eprintln!(
        "{} of {RACE_TURNS} turns were replayed; {} worker calls",
        replayed.len(),
        worker.all_calls()
    );
}

// --- the TypeScript counter: redelivery and a replica SIGKILL -------------------------------

/// Sends activity `id` once, then three times at once, to `server`'s `counter`: every answer is
/// the first one's.
async fn deliver_four_times(server: &TestServer, worker: &WorkerProcess, id: &str, n: u64) {
    let mut client = server.client().await;
    let first = client
        .process_turn(to_bot("counter", "ts", id, "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&first), [format!("count: {n}")]);
    assert!(!first.redelivered);
    let again = (0..3).map(|_| {
        let mut client = client.clone();
        let id = id.to_owned();
        tokio::spawn(async move {
            client
                .process_turn(to_bot("counter", "ts", &id, "hi"))
                .await
                .unwrap()
                .into_inner()
        })
    });
    for call in again.collect::<Vec<_>>() {
        let again = call.await.unwrap();
        assert!(again.redelivered, "{again:?}");
        assert_eq!(texts(&again), [format!("count: {n}")], "the same answer");
    }
    assert!(!worker.calls_settled(id, 1).await.is_empty());
    // Time for any stray call's trace line to be read.
    sleep(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_is_answered_from_the_receipt_without_calling_the_typescript_worker() {
    let worker = WorkerProcess::node(&sdk("typescript/examples/counter.js"));
    // Without the state cache every attempt loads the receipt with the state: a redelivery never
    // reaches the worker.
    let uncached = Config {
        state_cache_entries: 0,
        ..Config::default()
    };
    let server = TestServer::start(
        remote(uncached, "counter", &worker.url()),
        turnstile::bots::samples(),
    )
    .await;
    deliver_four_times(&server, &worker, "once-1", 1).await;
    assert_eq!(worker.calls("once-1"), [1], "the worker ran the turn once");
    deliver_four_times(&server, &worker, "once-2", 2).await;
    assert_eq!(
        worker.calls("once-2"),
        [1],
        "the redeliveries counted nothing"
    );

    // With it (the default), a redelivery to the replica that cached the conversation skips the
    // load that finds the receipt: the worker runs once more, that run's commit meets the
    // receipt and is thrown away, and the stored answer is returned (README, guarantees).
    let cached = TestServer::start(
        remote(Config::default(), "counter", &worker.url()),
        turnstile::bots::samples(),
    )
    .await;
    deliver_four_times(&cached, &worker, "cached-1", 1).await;
    deliver_four_times(&cached, &worker, "cached-2", 2).await;
    let calls = worker.calls("cached-2");
    assert!(
        calls.len() <= 4 && calls.iter().all(|&a| a == 1),
        "each call at most one wasted run: {calls:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_typescript_counter_survives_a_replica_sigkill_with_every_count_exact() {
    const SHAPE: Shape = Shape {
        workers: 12,
        duration: Duration::from_secs(5),
        conversations: 20,
        hot: 2,
        hot_share: 0.3,
        call_timeout: Duration::from_secs(3),
        turn_bound: Duration::from_secs(20),
    };
    const VICTIM: usize = 1;
    let worker = WorkerProcess::node(&sdk("typescript/examples/counter.js"));
    let url = support::pg::fresh_database().await;
    // `counter` is the TypeScript worker here: it replaces the built-in counter bot.
    let remote_bots = format!("counter={}", worker.url());
    let mut fleet =
        Fleet::start_with_env(3, &url, &[("TURNSTILE_REMOTE_BOTS", remote_bots.as_str())]).await;
    let gateway = Gateway::new(&fleet.addrs(), SHAPE.call_timeout);
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let gateway = gateway.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move { gateway.run(SHAPE, "ts-kill", stop).await })
    };
    sleep(Duration::from_secs(2)).await;
    let calls_before = worker.all_calls();
    fleet.kill(VICTIM);
    sleep(Duration::from_secs(1)).await;
    fleet.restart(VICTIM).await;
    let over = Instant::now();
    sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();

    let mut record = gateway.take_record();
    for (i, turn) in std::mem::take(&mut record.unacked).into_iter().enumerate() {
        gateway
            .deliver(&turn, i, Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("{turn:?} could not be delivered after the kill"));
    }
    let settled = gateway.take_record();
    record.acks.extend(settled.acks);
    record.failures.extend(settled.failures);

    let counts = check::final_counts(&url, SHAPE.conversations).await;
    let receipts = check::receipts(&url).await;
    let proof = check::prove(&record, &counts, &receipts);
    assert!(
        calls_before > 0,
        "the worker was never called before the kill"
    );
    assert!(
        record
            .acks
            .iter()
            .any(|a| a.server == VICTIM && a.at > over),
        "the restarted replica answered no turn"
    );
    let internal = record
        .failures
        .iter()
        .filter(|(_, f)| *f == Failure::Status(Code::Internal))
        .count();
    assert_eq!(internal, 0, "INTERNAL during a replica kill");
    eprintln!(
        "{} turns over {} conversations, {} applied; {} failures retried; {} worker calls",
        proof.turns,
        proof.conversations,
        proof.applied,
        record.failures.len(),
        worker.all_calls()
    );
    for (status, log) in fleet.stop() {
        assert!(status.success(), "a server did not stop cleanly:\n{log}");
    }
}

// --- failures: down, slow, raising ----------------------------------------------------------

/// A Python worker whose bot `moody` counts every message, then fails as the text asks.
const MOODY: &str = r#"
import asyncio
from turnstile_worker import Worker

worker = Worker()

@worker.bot("moody")
async def moody(turn):
    if turn.text == "peek":
        seen = turn.conversation.get("count", 0)
        if turn.attempt == 1:
            await asyncio.sleep(3)
        turn.send(f"seen: {seen}")
        return
    count = turn.conversation.get("count", 0) + 1
    turn.conversation["count"] = count
    turn.send(f"count: {count}")
    if turn.text == "boom":
        raise ValueError("no pizza today")
    if turn.text == "slow":
        await asyncio.sleep(10)

asyncio.run(worker.serve("127.0.0.1:0"))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_raising_slow_or_down_fails_the_turn_with_its_status_and_commits_nothing() {
    let mut worker = WorkerProcess::python(&["-c", MOODY]);
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let server = TestServer::start_with_store(
        remote(Config::default(), "moody", &worker.url()),
        Arc::clone(&store),
        turnstile::bots::samples(),
    )
    .await;
    let mut client = server.client().await;

    let raised = client
        .process_turn(to_bot("moody", "m", "boom-1", "boom"))
        .await
        .unwrap_err();
    assert_eq!(raised.code(), Code::Internal, "{raised:?}");
    assert_eq!(reason(&raised), "BOT_FAILED");
    assert!(
        raised.message().contains("bot worker `moody` failed")
            && raised
                .message()
                .contains("raised ValueError: no pizza today"),
        "the message names the worker and the problem: {raised:?}"
    );

    let mut slow = tonic::Request::new(to_bot("moody", "m", "slow-1", "slow"));
    slow.set_timeout(Duration::from_secs(3));
    let started = Instant::now();
    let late = client.process_turn(slow).await.unwrap_err();
    assert_eq!(late.code(), Code::DeadlineExceeded, "{late:?}");
    assert!(started.elapsed() < Duration::from_secs(9), "not cut short");
    if !late.details().is_empty() {
        // The server's answer (not the client's own timer, which may fire first).
        assert_eq!(reason(&late), "DEADLINE_EXCEEDED", "{late:?}");
    }
    assert_eq!(
        worker.calls_settled("slow-1", 1).await,
        [1],
        "the slow worker was called"
    );

    let ok = client
        .process_turn(to_bot("moody", "m", "ok-1", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        texts(&ok),
        ["count: 1"],
        "the failed turns committed nothing"
    );
    assert_eq!(ok.version, 1);

    worker.kill();
    let down = client
        .process_turn(to_bot("moody", "m", "down-1", "hi"))
        .await
        .unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert_eq!(reason(&down), "BOT_UNAVAILABLE");
    assert!(down.get_details_retry_info().is_some(), "{down:?}");
    assert!(down.message().contains("bot worker `moody`"), "{down:?}");

    // The worker back (on another port, so through another server over the same store): the
    // turn that found it down had committed nothing.
    let back = WorkerProcess::python(&["-c", MOODY]);
    let other = TestServer::start_with_store(
        remote(Config::default(), "moody", &back.url()),
        Arc::clone(&store),
        turnstile::bots::samples(),
    )
    .await;
    let after = other
        .client()
        .await
        .process_turn(to_bot("moody", "m", "down-1", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&after), ["count: 2"]);
    assert!(
        !after.redelivered,
        "the turn was not committed while the worker was down"
    );

    // Killed in the middle of a call: the connection breaks under it, and that is UNAVAILABLE
    // too (the client library says UNKNOWN with a transport error).
    let mut back = back;
    let cut = {
        let mut client = other.client().await;
        tokio::spawn(async move {
            let mut slow = tonic::Request::new(to_bot("moody", "m", "slow-2", "slow"));
            slow.set_timeout(Duration::from_secs(30));
            client.process_turn(slow).await
        })
    };
    assert_eq!(back.calls_settled("slow-2", 1).await, [1]);
    back.kill();
    let cut = cut.await.unwrap().unwrap_err();
    assert_eq!(cut.code(), Code::Unavailable, "{cut:?}");
    assert_eq!(reason(&cut), "BOT_UNAVAILABLE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_turn_that_only_read_a_scope_is_replayed_when_it_moved() {
    let worker = WorkerProcess::python(&["-c", MOODY]);
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let start = || {
        TestServer::start_with_store(
            remote(Config::default(), "moody", &worker.url()),
            Arc::clone(&store),
            turnstile::bots::samples(),
        )
    };
    let (a, b) = tokio::join!(start(), start());
    let mut client_b = b.client().await;
    let peeking = {
        let mut client = a.client().await;
        tokio::spawn(async move {
            client
                .process_turn(to_bot("moody", "p", "peek-1", "peek"))
                .await
                .unwrap()
                .into_inner()
        })
    };
    let until = Instant::now() + Duration::from_secs(60);
    while worker.calls("peek-1").is_empty() {
        assert!(Instant::now() < until, "the worker was never called");
        sleep(Duration::from_millis(10)).await;
    }
    // While the peek sleeps in the worker, another replica changes what it read.
    let changed = client_b
        .process_turn(to_bot("moody", "p", "count-1", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&changed), ["count: 1"]);
    let peeked = peeking.await.unwrap();
    assert_eq!(
        (texts(&peeked), peeked.attempts),
        (vec!["seen: 1".to_owned()], 2),
        "the SDK reported the read, so the stale answer was replayed"
    );
    assert_eq!(worker.calls_settled("peek-1", 2).await, [1, 2]);
}

// --- failures: garbage and oversized answers; replays on conflict (a worker in Rust) ---------

/// A worker for bot `fake` that counts like the counter bot and answers garbage when asked,
/// recording every call as (activity id, attempt, conversation state).
#[derive(Default)]
struct FakeWorker {
    calls: Mutex<Vec<(String, u32, String)>>,
    gate: tokio::sync::Notify,
}

/// The gRPC service of a [`FakeWorker`].
struct FakeService(Arc<FakeWorker>);

#[tonic::async_trait]
impl pb::bot_worker_server::BotWorker for FakeService {
    async fn run_turn(
        &self,
        request: tonic::Request<pb::RunTurnRequest>,
    ) -> Result<tonic::Response<pb::RunTurnResponse>, Status> {
        let request = request.into_inner();
        let activity: serde_json::Value = serde_json::from_str(&request.activity_json).unwrap();
        let id = activity["id"].as_str().unwrap_or_default().to_owned();
        let text = activity["text"].as_str().unwrap_or_default().to_owned();
        let state_json = request.conversation.as_ref().unwrap().state_json.clone();
        self.0
            .calls
            .lock()
            .unwrap()
            .push((id, request.attempt, state_json.clone()));
        if text.starts_with("wait") && request.attempt == 1 {
            self.0.gate.notified().await;
        }
        let state: serde_json::Value = serde_json::from_str(&state_json).unwrap();
        let count = state["count"].as_u64().unwrap_or(0) + 1;
        let mut reply = serde_json::json!({"text": format!("count: {count}")}).to_string();
        let mut new_state = serde_json::json!({"count": count}).to_string();
        let conversation = match text.as_str() {
            // Reads the state, changes nothing.
            "wait-peek" => pb::ScopeOutcome {
                read: true,
                replaced_json: None,
            },
            _ => pb::ScopeOutcome {
                read: true,
                replaced_json: Some(new_state.clone()),
            },
        };
        match text.as_str() {
            "error" => return Err(Status::internal("the model provider refused")),
            "garbage-state" => new_state = "[1, 2]".into(),
            "garbage-reply" => reply = "count: one".into(),
            "huge" => {
                reply = serde_json::json!({"text": "x".repeat(5 << 20)}).to_string();
            }
            _ => {}
        }
        let conversation = match conversation.replaced_json {
            Some(_) => pb::ScopeOutcome {
                read: true,
                replaced_json: Some(new_state),
            },
            None => conversation,
        };
        Ok(tonic::Response::new(pb::RunTurnResponse {
            replies_json: vec![reply],
            conversation: Some(conversation),
            user: None,
            private_conversation: None,
        }))
    }
}

impl FakeWorker {
    /// Serves on a free port; returns its URL.
    async fn serve(self: &Arc<Self>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let service = pb::bot_worker_server::BotWorkerServer::new(FakeService(Arc::clone(self)))
            .max_encoding_message_size(usize::MAX);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        url
    }

    fn attempts(&self, id: &str) -> Vec<(u32, String)> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(i, _, _)| i == id)
            .map(|(_, a, s)| (*a, s.clone()))
            .collect()
    }
}

async fn client_for(
    worker_url: &str,
    store: &Arc<dyn Store>,
) -> (TestServer, TurnServiceClient<Channel>) {
    let server = TestServer::start_with_store(
        remote(Config::default(), "fake", worker_url),
        Arc::clone(store),
        turnstile::bots::samples(),
    )
    .await;
    let client = server.client().await;
    (server, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_or_oversized_answer_is_internal_naming_the_problem_and_commits_nothing() {
    let worker = Arc::new(FakeWorker::default());
    let url = worker.serve().await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (_server, mut client) = client_for(&url, &store).await;

    for (text, problem) in [
        (
            "garbage-state",
            "bot worker `fake` answered conversation state that is not a JSON object",
        ),
        (
            "garbage-reply",
            "bot worker `fake` answered reply 1 that is not valid JSON",
        ),
        ("huge", "bot worker `fake` answered more than 4194304 bytes"),
        (
            "error",
            "bot worker `fake` failed: Internal: the model provider refused",
        ),
    ] {
        let status = client
            .process_turn(to_bot("fake", "g", text, text))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{text}: {status:?}");
        assert_eq!(reason(&status), "BOT_FAILED", "{text}");
        assert!(
            status.message().starts_with(problem),
            "{text}: the message should name the problem: {:?}",
            status.message()
        );
    }
    let ok = client
        .process_turn(to_bot("fake", "g", "fine", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&ok), ["count: 1"], "nothing was committed before");
    let reply = &ok.activities[0];
    assert_eq!(
        reply.reply_to_id.as_deref(),
        Some("fine"),
        "a worker's reply is addressed back like an in-process bot's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_calls_the_worker_again_with_the_fresh_state() {
    let worker = Arc::new(FakeWorker::default());
    let url = worker.serve().await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (_a, client_a) = client_for(&url, &store).await;
    let (_b, mut client_b) = client_for(&url, &store).await;

    // Replica A's turn reads the state, then waits inside the worker.
    let waiting = {
        let mut client = client_a.clone();
        tokio::spawn(async move {
            client
                .process_turn(to_bot("fake", "race", "slow-turn", "wait"))
                .await
                .unwrap()
                .into_inner()
        })
    };
    let until = Instant::now() + Duration::from_secs(30);
    while worker.attempts("slow-turn").is_empty() {
        assert!(Instant::now() < until, "the worker was never called");
        sleep(Duration::from_millis(10)).await;
    }
    // Meanwhile replica B commits a turn of the same conversation.
    let fast = client_b
        .process_turn(to_bot("fake", "race", "fast-turn", "hi"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&fast), ["count: 1"]);
    worker.gate.notify_one();

    let slow = waiting.await.unwrap();
    assert_eq!(texts(&slow), ["count: 2"], "replayed on the fresh state");
    assert_eq!(slow.attempts, 2);
    assert_eq!(slow.version, 2);
    let attempts = worker.attempts("slow-turn");
    assert_eq!(
        attempts,
        [(1, "{}".to_owned()), (2, r#"{"count":1}"#.to_owned())],
        "attempt 2 got the state replica B committed"
    );

    // A turn that only read the state is version-checked too: the worker said it read it.
    let peeking = {
        let mut client = client_a.clone();
        tokio::spawn(async move {
            client
                .process_turn(to_bot("fake", "race", "peek-turn", "wait-peek"))
                .await
                .unwrap()
                .into_inner()
        })
    };
    while worker.attempts("peek-turn").is_empty() {
        assert!(Instant::now() < until, "the worker was never called");
        sleep(Duration::from_millis(10)).await;
    }
    client_b
        .process_turn(to_bot("fake", "race", "fast-turn-2", "hi"))
        .await
        .unwrap();
    worker.gate.notify_one();
    let peeked = peeking.await.unwrap();
    assert_eq!(peeked.attempts, 2, "the read was checked at commit");
    assert_eq!(
        texts(&peeked),
        ["count: 4"],
        "it answered from the fresh state"
    );
}
