//! Prometheus metrics on their own HTTP port, apart from gRPC, so that a scraper needs neither
//! gRPC nor the callers' credentials.
//!
//! The engine and the gRPC layer record through the `metrics` facade's macros; this module
//! installs the one process-wide recorder that collects them and answers `GET /metrics`. A
//! recorder can be installed only once per process, so every server in a process (tests start
//! several) shares it, and so does the gateway (`turnstile gateway --metrics-listen`). The HTTP
//! side is axum (already in the tree through tonic): one route, read-only, so that request
//! parsing is left to a maintained HTTP implementation.
//!
//! What only a scrape reads is sampled by the scrape, not kept up to date on the turns' path:
//! the connection pool's gauges and the process's own `process_*` metrics (CPU, memory, file
//! descriptors, from `/proc` through `metrics-process`).

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

use crate::store::Store;

/// Turns by how they ended (`outcome`).
pub const TURNS: &str = "turnstile_turns_total";
/// How many times the bot ran for one turn.
pub const TURN_ATTEMPTS: &str = "turnstile_turn_attempts";
/// Commits that lost to another replica's and were replayed (or gave up).
pub const CONFLICTS: &str = "turnstile_conflicts_total";
/// Wall time of one turn, queueing included.
pub const TURN_DURATION: &str = "turnstile_turn_duration_seconds";
/// Wall time of one store call (`op` = `load` | `commit` | `lock`, the wait for a conversation
/// lock).
pub const STORE_DURATION: &str = "turnstile_store_duration_seconds";
/// Single-scope commits per statement of the PostgreSQL store's group commit.
pub const COMMIT_BATCH_SIZE: &str = "turnstile_commit_batch_size";
/// Loads of uncached state per statement of the PostgreSQL store's group load.
pub const LOAD_BATCH_SIZE: &str = "turnstile_load_batch_size";
/// Database connections by `state` (`in_use` | `idle` | `waiting`).
pub const POOL_CONNECTIONS: &str = "turnstile_pool_connections";
/// The size of each scope's state a turn wrote (or was refused for writing), as JSON text, by
/// `scope` (`conversation` | `user` | `private_conversation`).
pub const STATE_BYTES: &str = "turnstile_state_bytes";
/// Redelivered activities answered from their stored receipt, without running the bot.
pub const REDELIVERIES: &str = "turnstile_redeliveries_total";
/// Conversation locks and leases asked for, by `outcome` (`granted` |
/// `not_granted`).
pub const LOCK_WAITS: &str = "turnstile_lock_waits_total";
/// Always 1, labelled with the running `version`: joins other series to the build that made them.
pub const BUILD_INFO: &str = "turnstile_build_info";
/// Turns refused before they started, by `reason` as in the refusal's `ErrorInfo`
/// (`OVERLOADED`: past `--max-in-flight`; `SHUTTING_DOWN`: draining).
pub const REFUSALS: &str = "turnstile_refusals_total";
/// Refusals held back before they were sent, while the replica refused faster than callers that
/// wait as `RetryInfo` asks would make it refuse (`server::admission`).
pub const REFUSALS_HELD: &str = "turnstile_refusals_held_total";
/// Expired receipts removed by the pruner, a slot at a time (`store::postgres::receipts`).
pub const RECEIPTS_PRUNED: &str = "turnstile_receipts_pruned_total";
/// When (Unix seconds) a pruning pass last finished with every step done. Far behind `time()`,
/// expired receipts pile up: pruning fails or cannot keep up.
pub const RECEIPTS_PRUNED_AT: &str = "turnstile_receipts_pruned_timestamp_seconds";
/// State rows deleted by the expiry sweep, once unwritten past their scope's time to live.
pub const STATE_EXPIRED: &str = "turnstile_state_expired_total";

/// Latency buckets, in seconds: from a cached turn (sub-millisecond) to the store's call timeout.
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Attempt buckets: 1 is the common case; the default limit is 10.
const ATTEMPT_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 5.0, 10.0, 20.0];

/// Batch-size buckets: 1 when the database keeps up; up to the group commit's largest batch.
const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];

/// State-size buckets, in bytes: from a counter's few bytes to past the default limit (256 KiB).
const BYTES_BUCKETS: &[f64] = &[
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
];

/// Why metrics could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("installing the Prometheus metrics recorder failed: {0}")]
pub struct MetricsError(String);

/// The process-wide Prometheus recorder, installed on first use.
///
/// # Errors
/// [`MetricsError`] when another metrics recorder was installed in this process first.
pub fn recorder() -> Result<PrometheusHandle, MetricsError> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(SECONDS_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(TURN_ATTEMPTS.into()), ATTEMPT_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(COMMIT_BATCH_SIZE.into()),
                        BATCH_SIZE_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(LOAD_BATCH_SIZE.into()),
                        BATCH_SIZE_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(STATE_BYTES.into()), BYTES_BUCKETS)
                })
                .and_then(PrometheusBuilder::install_recorder)
                .map_err(|e| e.to_string())?;
            describe();
            process().describe();
            metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            Ok(handle)
        })
        .clone()
        .map_err(MetricsError)
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(TURNS, "Turns by outcome");
    describe_histogram!(TURN_ATTEMPTS, "How many times the bot ran for one turn");
    describe_counter!(CONFLICTS, "Commits that lost a race with another replica");
    describe_histogram!(TURN_DURATION, Unit::Seconds, "Wall time of one turn");
    describe_histogram!(STORE_DURATION, Unit::Seconds, "Wall time of one store call");
    describe_histogram!(
        COMMIT_BATCH_SIZE,
        "Single-scope commits applied by one statement of the group commit"
    );
    describe_histogram!(
        LOAD_BATCH_SIZE,
        "Loads of state not in the cache read by one statement of the group load"
    );
    describe_gauge!(POOL_CONNECTIONS, "Database connections by state");
    describe_histogram!(
        STATE_BYTES,
        Unit::Bytes,
        "Size of each scope's state a turn wrote, as JSON text, by scope"
    );
    describe_counter!(
        REDELIVERIES,
        "Redelivered activities answered from their receipt"
    );
    describe_counter!(
        LOCK_WAITS,
        "Conversation locks and leases asked for, by outcome"
    );
    describe_gauge!(BUILD_INFO, "1, labelled with the running version");
    describe_counter!(REFUSALS, "Turns refused before they started, by reason");
    describe_counter!(
        REFUSALS_HELD,
        "Overload refusals held back before they were sent, during a storm of refusals"
    );
    describe_counter!(RECEIPTS_PRUNED, "Expired receipts deleted");
    describe_counter!(
        STATE_EXPIRED,
        "State rows deleted by the expiry sweep, unwritten past their scope's time to live"
    );
    describe_gauge!(
        RECEIPTS_PRUNED_AT,
        Unit::Seconds,
        "When a pruning pass last left no expired receipt behind (Unix time)"
    );
    describe_histogram!(
        super::rpc::RPC_SERVER_DURATION,
        Unit::Seconds,
        "Wall time of one gRPC call on the server, by service, method and status code"
    );
}

/// The collector of the `process_*` metrics, one per process like the recorder.
fn process() -> &'static metrics_process::Collector {
    static COLLECTOR: OnceLock<metrics_process::Collector> = OnceLock::new();
    COLLECTOR.get_or_init(metrics_process::Collector::default)
}

/// Records a pruning pass that deleted `pruned` expired receipts and left none behind.
pub fn receipts_pruned(pruned: u64) {
    metrics::counter!(RECEIPTS_PRUNED).increment(pruned);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    metrics::gauge!(RECEIPTS_PRUNED_AT).set(now.as_secs_f64());
}

/// Counts state rows an expiry sweep deleted.
pub fn state_expired(deleted: u64) {
    metrics::counter!(STATE_EXPIRED).increment(deleted);
}

/// Answers `GET /metrics` on `listener` with `handle`'s rendering, sampling `store`'s connection
/// pool first, until `shutdown` completes; then lets scrapes in progress finish. Other paths get
/// 404, other methods 405.
///
/// # Errors
/// When accepting connections fails for good.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    store: Arc<dyn Store>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(scrape))
        .with_state(Scrape {
            handle,
            store: Some(store),
        });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// `GET /metrics` with `handle`'s rendering, for a process without a store (the gateway).
pub fn routes(handle: PrometheusHandle) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .with_state(Scrape {
            handle,
            store: None,
        })
}

/// What a scrape reads.
#[derive(Clone)]
struct Scrape {
    handle: PrometheusHandle,
    store: Option<Arc<dyn Store>>,
}

async fn scrape(State(scrape): State<Scrape>) -> impl IntoResponse {
    if let Some(store) = &scrape.store {
        sample_pool(store.as_ref());
    }
    // A few reads of /proc, once per scrape.
    process().collect();
    (
        [(
            http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        scrape.handle.render(),
    )
}

/// Sets the pool gauges from the store's pool, when it has one.
fn sample_pool(store: &dyn Store) {
    if let Some(pool) = store.pool_status() {
        #[allow(clippy::cast_precision_loss)] // connection counts are far below 2^52
        for (state, value) in [
            ("in_use", pool.in_use),
            ("idle", pool.idle),
            ("waiting", pool.waiting),
        ] {
            metrics::gauge!(POOL_CONNECTIONS, "state" => state).set(value as f64);
        }
    }
}
