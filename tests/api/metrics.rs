//! `/metrics`: a scrape over plain HTTP shows the counters move after turns, a redelivery and a
//! conflict between two replicas sharing one store.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::oneshot;
use tonic::transport::Channel;
use turnstile::config::{Config, SharedStore, StoreConfig};
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::server::Listeners;
use turnstile::store::Store;
use turnstile::store::memory::MemoryStore;

/// Starts a server over `store` with metrics on a free port; returns its gRPC and metrics
/// addresses and the sender that stops it.
async fn start(store: Arc<dyn Store>) -> (SocketAddr, SocketAddr, oneshot::Sender<()>) {
    let (grpc, metrics, stop, _) = start_with(Config::default(), store).await;
    (grpc, metrics, stop)
}

/// [`start`] with `config`, also returning the server's task.
async fn start_with(
    config: Config,
    store: Arc<dyn Store>,
) -> (
    SocketAddr,
    SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), turnstile::server::ServeError>>,
) {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addrs = (grpc.local_addr().unwrap(), metrics.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    let config = Config {
        store: StoreConfig::Shared(SharedStore(store)),
        ..config
    };
    let task = tokio::spawn(turnstile::serve(
        config,
        turnstile::bots::samples(),
        Listeners {
            grpc,
            metrics: Some(metrics),
        },
        async {
            let _ = rx.await;
        },
    ));
    (addrs.0, addrs.1, tx, task)
}

async fn get(addr: SocketAddr, path: &str) -> (String, String) {
    request(addr, "GET", path).await
}

async fn request(addr: SocketAddr, method: &str, path: &str) -> (String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

/// The value of the sample `name` (with its labels, as rendered), 0 when absent.
fn value(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn client(addr: SocketAddr) -> TurnServiceClient<Channel> {
    let endpoint = format!("http://{addr}");
    for _ in 0..100 {
        if let Ok(c) = TurnServiceClient::connect(endpoint.clone()).await {
            return c;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("no server at {endpoint}");
}

/// One turn of the counter bot, which writes conversation state every turn.
async fn count(
    client: &mut TurnServiceClient<Channel>,
) -> turnstile::grpc::pb::ProcessTurnResponse {
    let request = turnstile::grpc::pb::ProcessTurnRequest::typed(
        support::message("metrics-conv", "alice", "count"),
        "counter",
    );
    client.process_turn(request).await.unwrap().into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_show_turns_replays_and_conflicts() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (grpc_a, metrics_a, _stop_a) = start(Arc::clone(&store)).await;
    let (grpc_b, _, _stop_b) = start(Arc::clone(&store)).await;
    let (mut a, mut b) = (client(grpc_a).await, client(grpc_b).await);

    let (status, before) = get(metrics_a, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    let committed = r#"turnstile_turns_total{outcome="committed"}"#;
    let redelivered = r#"turnstile_turns_total{outcome="redelivered"}"#;

    // A turn on each replica, then one on A whose remembered state B has made stale: its first
    // commit conflicts and it replays.
    count(&mut a).await;
    count(&mut b).await;
    let third = count(&mut a).await;
    assert_eq!(third.attempts, 2, "the stale cache should cost one replay");
    // A redelivery is answered from its receipt.
    let activity = support::message("metrics-conv", "alice", "again");
    a.process_turn(support::request(activity.clone()))
        .await
        .unwrap();
    let again = a.process_turn(support::request(activity)).await.unwrap();
    assert!(again.into_inner().redelivered);

    let (_, after) = get(metrics_a, "/metrics").await;
    let moved = |name: &str| value(&after, name) - value(&before, name);
    assert!(moved(committed) >= 4.0, "{after}");
    assert!(moved(redelivered) >= 1.0, "{after}");
    assert!(moved("turnstile_redeliveries_total") >= 1.0, "{after}");
    assert!(moved("turnstile_conflicts_total") >= 1.0, "{after}");
    assert!(moved("turnstile_turn_attempts_count") >= 4.0, "{after}");
    assert!(
        moved("turnstile_turn_duration_seconds_count") >= 5.0,
        "{after}"
    );
    assert!(
        moved(r#"turnstile_store_duration_seconds_count{op="commit"}"#) >= 5.0,
        "{after}"
    );
    assert!(
        after.contains("# TYPE turnstile_turn_attempts histogram"),
        "{after}"
    );
    assert!(
        after.contains(r#"turnstile_turn_attempts_bucket{le="2"}"#),
        "{after}"
    );

    let (status, _) = get(metrics_a, "/other").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_gauges_and_commit_batches_come_from_postgres() {
    let url = support::pg::fresh_database().await;
    let config = support::postgres_config(&url);
    let store = turnstile::server::open_store(&config).await.unwrap();
    let (grpc, metrics, _stop) = start(store).await;
    let mut c = client(grpc).await;
    count(&mut c).await;
    let (_, body) = get(metrics, "/metrics").await;
    assert!(
        body.contains(r#"turnstile_pool_connections{state="idle"}"#),
        "{body}"
    );
    assert!(
        body.contains(r#"turnstile_pool_connections{state="in_use"}"#),
        "{body}"
    );
    // The counter bot's commit writes one scope: it went through the group commit, alone.
    assert!(
        value(&body, r#"turnstile_commit_batch_size_bucket{le="1"}"#) >= 1.0,
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpc_durations_count_served_and_refused_calls_by_status() {
    let config = Config {
        auth_tokens: vec![turnstile::grpc::auth::Token::new("scrape-test")],
        ..Config::default()
    };
    let (grpc, metrics, stop, task) = start_with(config, Arc::new(MemoryStore::new())).await;
    let mut c = client(grpc).await;
    let (_, before) = get(metrics, "/metrics").await;

    let mut ok = tonic::Request::new(support::request(support::message("rpc", "alice", "hi")));
    ok.metadata_mut()
        .insert("authorization", "Bearer scrape-test".parse().unwrap());
    c.process_turn(ok).await.unwrap();
    let refused = c
        .process_turn(support::request(support::message("rpc", "alice", "hi")))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);

    let (status, after) = get(metrics, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    let moved = |name: &str| value(&after, name) - value(&before, name);
    let series = |code: u8| {
        format!(
            r#"rpc_server_duration_seconds_count{{rpc_service="turnstile.v1.TurnService",rpc_method="ProcessTurn",rpc_grpc_status_code="{code}"}}"#
        )
    };
    assert!(moved(&series(0)) >= 1.0, "{after}");
    assert!(moved(&series(16)) >= 1.0, "{after}");
    assert!(
        after.contains("# TYPE rpc_server_duration_seconds histogram"),
        "{after}"
    );
    assert_eq!(
        value(
            &after,
            &format!(
                r#"turnstile_build_info{{version="{}"}}"#,
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0,
        "{after}"
    );

    // Only GET /metrics is served.
    let (status, _) = request(metrics, "POST", "/metrics").await;
    assert_eq!(status, "HTTP/1.1 405 Method Not Allowed");
    let (status, _) = get(metrics, "/metrics/other").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");

    // The endpoint stops with the server.
    stop.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(30), task)
        .await
        .expect("the server stopped")
        .unwrap()
        .unwrap();
    let mut closed = false;
    for _ in 0..20 {
        if tokio::net::TcpStream::connect(metrics).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        closed,
        "the metrics port still accepts after the server stopped"
    );
}
