//! `/metrics`: a scrape over plain HTTP shows the counters move after turns, a redelivery and a
//! conflict between two replicas sharing one store, refusals and the process's own metrics; and
//! the gateway's `/healthz`, `/readyz` (following Turnstile's health) and `/metrics` on a port of
//! its own.
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
async fn pool_gauges_and_commit_and_load_batches_come_from_postgres() {
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
    // Its first turn loaded the conversation it had not cached: by the group load, alone.
    assert!(
        value(&body, r#"turnstile_load_batch_size_bucket{le="1"}"#) >= 1.0,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_metrics_refusals_and_receipt_pruning_are_scraped() {
    let config = Config {
        max_in_flight: Some(1),
        ..Config::default()
    };
    let (grpc, metrics, _stop, _task) = start_with(config, Arc::new(MemoryStore::new())).await;
    let c = client(grpc).await;
    let (_, before) = get(metrics, "/metrics").await;
    let overloaded = r#"turnstile_refusals_total{reason="OVERLOADED"}"#;
    assert!(
        before.contains(overloaded),
        "refusals are counted from zero, before the first: {before}"
    );
    assert!(
        before.contains("\nturnstile_refusals_held_total "),
        "held refusals are counted from zero, before the first: {before}"
    );

    // The slow bot holds the one slot for 200 ms: the second turn is refused meanwhile.
    let slow = |i: usize| {
        let mut c = c.clone();
        async move {
            let activity = support::message(&format!("overload-{i}"), "alice", "count");
            c.process_turn(turnstile::grpc::pb::ProcessTurnRequest::typed(
                activity, "slow",
            ))
            .await
        }
    };
    let (first, second) = tokio::join!(slow(1), async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        slow(2).await
    });
    first.unwrap();
    assert_eq!(second.unwrap_err().code(), tonic::Code::ResourceExhausted);

    let (_, after) = get(metrics, "/metrics").await;
    assert!(
        value(&after, overloaded) - value(&before, overloaded) >= 1.0,
        "{after}"
    );
    // The process's own metrics, read at the scrape (CPU in whole seconds: maybe 0 so far).
    for name in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        "process_threads",
    ] {
        assert!(value(&after, name) > 0.0, "{name}: {after}");
    }
    assert!(
        after.contains("# TYPE process_cpu_seconds_total counter")
            && after.contains("\nprocess_cpu_seconds_total "),
        "{after}"
    );
    // The pruner's first pass runs at the start and leaves no expired receipt behind.
    let pruned_at = value(&after, "turnstile_receipts_pruned_timestamp_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (now - 600.0..=now + 1.0).contains(&pruned_at),
        "pruned at {pruned_at}, now {now}"
    );
    assert!(
        after.contains("# TYPE turnstile_receipts_pruned_total counter"),
        "{after}"
    );
}

/// The gateway's probes and metrics: `/healthz` answers while Turnstile is away, `/readyz` only
/// once Turnstile serves, and `/metrics`, on its own port, counts requests, turns and
/// deliveries (a channel that refuses a reply once costs one retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_probes_follow_turnstile_and_metrics_count_turns_and_deliveries() {
    use axum::http::StatusCode;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    // A Turnstile address with nothing behind it yet: bound, so that no other test takes the
    // port meanwhile (CI saw one do so), and not listening, so that connections are refused.
    let reserved = tokio::net::TcpSocket::new_v4().unwrap();
    reserved.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let turnstile_addr: SocketAddr = reserved.local_addr().unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let scrape = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (gateway, metrics) = (http.local_addr().unwrap(), scrape.local_addr().unwrap());
    let (stop_gateway, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(turnstile::gateway::serve(
        turnstile::gateway::GatewayConfig::development(format!("http://{turnstile_addr}")),
        turnstile::gateway::Listeners {
            http,
            metrics: Some(scrape),
        },
        async {
            let _ = stopped.await;
        },
    ));

    let (status, body) = get(gateway, "/healthz").await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    let (status, body) = get(gateway, "/readyz").await;
    assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{body}");
    assert!(!body.contains("127.0.0.1"), "no internal address: {body}");

    // Turnstile comes up: ready within the cached answer's lifetime.
    let listener = reserved.listen(1024).unwrap();
    let (stop_server, server_stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(turnstile::serve(
        Config::default(),
        turnstile::bots::samples(),
        listener,
        async {
            let _ = server_stopped.await;
        },
    ));
    let ready_within = |expected: &'static str| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let (status, _) = get(gateway, "/readyz").await;
            if status == expected {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "/readyz still {status}, expected {expected}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    ready_within("HTTP/1.1 200 OK").await;

    // A channel that refuses the first reply with 503, then takes every reply.
    let posts = Arc::new(AtomicUsize::new(0));
    let channel = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let channel_addr = channel.local_addr().unwrap();
    let app = axum::Router::new()
        .route(
            "/v3/conversations/{conversation}/activities/{reply_to}",
            axum::routing::post(
                |axum::extract::State(posts): axum::extract::State<Arc<AtomicUsize>>| async move {
                    if posts.fetch_add(1, Ordering::SeqCst) == 0 {
                        StatusCode::SERVICE_UNAVAILABLE
                    } else {
                        StatusCode::OK
                    }
                },
            ),
        )
        .with_state(Arc::clone(&posts));
    tokio::spawn(async move { axum::serve(channel, app).await });

    let (_, before) = get(metrics, "/metrics").await;
    let activity = serde_json::json!({
        "type": "message", "id": "gw-metrics-1", "channelId": "test",
        "serviceUrl": format!("http://{channel_addr}"),
        "conversation": {"id": "gw-metrics"},
        "from": {"id": "user-1"}, "recipient": {"id": "bot"},
        "text": "hi",
    });
    let response = reqwest::Client::new()
        .post(format!("http://{gateway}/api/messages"))
        .json(&activity)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202, "answered before the turn");
    // The turn and its delivery run after the answer: scrape until they are counted. The
    // counters are the process's, which the other gateway tests running beside this one add to,
    // so this delivery is known done by its channel's second post, not by the counter alone.
    let background = r#"turnstile_gateway_background_turns_total{outcome="delivered"}"#;
    let mut after = String::new();
    for _ in 0..1500 {
        let (status, scraped) = get(metrics, "/metrics").await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        after = scraped;
        if value(&after, background) - value(&before, background) >= 1.0
            && posts.load(Ordering::SeqCst) >= 2
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(posts.load(Ordering::SeqCst) >= 2, "the reply was retried");
    let moved = |name: &str| value(&after, name) - value(&before, name);
    assert!(moved(background) >= 1.0, "{after}");
    assert!(
        moved(r#"turnstile_gateway_requests_total{route="/api/messages",status="202"}"#) >= 1.0,
        "{after}"
    );
    assert!(
        moved(r#"turnstile_gateway_request_duration_seconds_count{route="/api/messages"}"#) >= 1.0,
        "{after}"
    );
    assert!(
        moved(r#"turnstile_gateway_turns_total{code="OK"}"#) >= 1.0,
        "{after}"
    );
    assert!(
        moved(r#"turnstile_gateway_delivery_retries_total{reason="refused"}"#) >= 1.0,
        "{after}"
    );
    assert!(
        moved(r#"turnstile_gateway_deliveries_total{outcome="delivered"}"#) >= 1.0,
        "{after}"
    );
    assert!(value(&after, "process_resident_memory_bytes") > 0.0);
    assert!(
        !after.contains(r#"route="/healthz""#) && !after.contains(r#"route="/readyz""#),
        "probes are not counted: {after}"
    );

    // Metrics are not on the port channels reach.
    let (status, _) = get(gateway, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    let (_, after_404) = get(metrics, "/metrics").await;
    assert!(
        value(
            &after_404,
            r#"turnstile_gateway_requests_total{route="_OTHER",status="404"}"#
        ) >= 1.0,
        "unrouted paths share one label: {after_404}"
    );

    // Turnstile goes away: not ready again, still live.
    stop_server.send(()).unwrap();
    server.await.unwrap().unwrap();
    ready_within("HTTP/1.1 503 Service Unavailable").await;
    let (status, _) = get(gateway, "/healthz").await;
    assert_eq!(status, "HTTP/1.1 200 OK");

    // Both ports close with the gateway.
    stop_gateway.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("the gateway stopped")
        .unwrap()
        .unwrap();
    assert!(tokio::net::TcpStream::connect(metrics).await.is_err());
}
