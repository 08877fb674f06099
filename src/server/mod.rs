//! Starting the service, the one way: `main` and every test call [`serve`] with a bound
//! listener, so tests run exactly what production runs, on port 0.
//!
//! The gRPC plumbing only the server needs lives beside it: how calls reach the four services
//! (`routes`), the size limit's status (`too_large`), connections ended at an age
//! (`connection_age`), the count of turns in flight that refuses past a limit and waits for them
//! on shutdown (`drain`), and the layer that takes a turn's place in it, or refuses the turn,
//! before its request is read (`admission`). What a call means — its parsing, its errors, the services
//! themselves — is `crate::grpc`'s.

pub(crate) mod admission;
pub(crate) mod connection_age;
pub(crate) mod drain;
pub(crate) mod routes;
pub(crate) mod too_large;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tonic::server::NamedService as _;
use tonic::service::interceptor::{InterceptedService, ResponseBody};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic_health::ServingStatus;
use tower::util::{Either, MapResponse};

use crate::bot::BotRegistry;
use crate::config::{Config, StoreConfig, TlsFiles};
use crate::engine::Engine;
use crate::grpc::admin::AdminApi;
use crate::grpc::auth::{self, Authenticate};
use crate::grpc::coalesce::Coalesced;
use crate::grpc::pb;
use crate::grpc::pb::admin_service_server::AdminServiceServer;
use crate::grpc::pb::turn_service_server::TurnServiceServer;
use crate::grpc::service::TurnApi;
use crate::store::Store;
use crate::store::cached::TurnStore;
use crate::store::memory::MemoryStore;
use crate::store::postgres::{self, PostgresStore};
use crate::store::upkeep::Upkeep;
use crate::telemetry::rpc::RpcTelemetryLayer;
use admission::AdmissionLayer;
use connection_age::Deadlined;
use drain::Drain;
use routes::Services;
use too_large::TooLarge;

/// How long connections get to close once every turn has finished during shutdown.
const CONNECTION_CLOSE_WAIT: Duration = Duration::from_secs(5);

/// How often a server that did not migrate on start checks the database's schema until it is
/// one it can serve: a migration Job's work is noticed within this, without a restart.
const SCHEMA_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// How long the check before serving may take; past it (a database not reachable yet), the
/// server serves NOT_SERVING and keeps checking every [`SCHEMA_CHECK_INTERVAL`].
const FIRST_SCHEMA_CHECK: Duration = Duration::from_secs(5);

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The database cannot be used: its URL is invalid, it cannot be reached (the error names
    /// where and why), or a migration failed.
    #[error(transparent)]
    Database(#[from] postgres::DatabaseError),
    /// gRPC reflection could not be built from the embedded descriptors.
    #[error("building gRPC reflection failed")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The gRPC server failed.
    #[error("the gRPC server failed")]
    Transport(#[from] tonic::transport::Error),
    /// The bearer tokens file could not be read.
    #[error("reading the auth tokens file {path} failed")]
    AuthTokens {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A TLS file could not be read.
    #[error("reading the TLS file {path} failed")]
    TlsFile {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The remote bots could not be set up.
    #[error("setting up the remote bots failed")]
    RemoteBots(#[from] crate::bots::remote::RemoteBotsError),
    /// A serialized bot is not hosted.
    #[error("a bot to serialize is not hosted")]
    SerializedBot(#[source] crate::bot::UnknownBot),
    /// A bot given a double-text policy is not hosted.
    #[error("--double-text: {0}")]
    DoubleTextBot(crate::bot::UnknownBot),
    /// A bot given scopes is not hosted.
    #[error("--bot-scopes: {0}")]
    ScopesBot(crate::bot::UnknownBot),
    /// The metrics recorder could not be installed.
    #[error(transparent)]
    Metrics(#[from] crate::telemetry::metrics::MetricsError),
}

/// The sockets a server answers on.
#[derive(Debug)]
pub struct Listeners {
    /// gRPC: `TurnService`, health and reflection.
    pub grpc: TcpListener,
    /// Plain HTTP `GET /metrics` in Prometheus text format; no metrics endpoint when `None`.
    pub metrics: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(grpc: TcpListener) -> Self {
        Self {
            grpc,
            metrics: None,
        }
    }
}

/// Builds the store `config` names, migrating it first when configured to.
///
/// # Errors
/// [`ServeError::Database`].
pub async fn open_store(config: &Config) -> Result<Arc<dyn Store>, ServeError> {
    Ok(open(config).await?.0)
}

/// [`open_store`], and the PostgreSQL store again when it was not migrated on start: its schema
/// is for [`watch_schema`] to check before it serves.
async fn open(config: &Config) -> Result<(Arc<dyn Store>, Option<PostgresStore>), ServeError> {
    Ok(match &config.store {
        StoreConfig::Memory => {
            tracing::warn!(
                "no database URL: keeping state in memory, which serves one replica only and is \
                 lost on exit; set --database-url (DATABASE_URL) to share state between replicas"
            );
            (Arc::new(MemoryStore::new().with_ttls(config.ttls)), None)
        }
        StoreConfig::Postgres {
            url,
            pool_size,
            commits_in_flight,
        } => {
            if config.migrate_on_start {
                let migration_url = config.migration_url.as_ref().unwrap_or(url);
                let applied = postgres::migrate(migration_url).await?;
                tracing::info!(applied, "database migrations up to date");
            }
            let store = PostgresStore::connect_with(url, *pool_size, config.statements)?
                .with_commits_in_flight(*commits_in_flight)
                .with_ttls(config.ttls);
            let unmigrated = (!config.migrate_on_start).then(|| store.clone());
            (Arc::new(store), unmigrated)
        }
        StoreConfig::Shared(shared) => (Arc::clone(&shared.0), None),
    })
}

/// `bots` with the concurrency policies and scopes `config` sets, once every bot (remote ones
/// included) is registered.
///
/// # Errors
/// [`ServeError::SerializedBot`] when `config.serialized_bots` names a bot that is not hosted,
/// [`ServeError::DoubleTextBot`] when `config.double_text` does, [`ServeError::ScopesBot`] when
/// `config.bot_scopes` does.
pub fn with_policies(mut bots: BotRegistry, config: &Config) -> Result<BotRegistry, ServeError> {
    for name in &config.serialized_bots {
        bots = bots
            .with_policy(name, crate::bot::ConcurrencyPolicy::Serialized)
            .map_err(ServeError::SerializedBot)?;
    }
    for (name, policy) in &config.double_text {
        bots = bots
            .with_double_text(name, *policy)
            .map_err(ServeError::DoubleTextBot)?;
    }
    for (name, scopes) in &config.bot_scopes {
        bots = bots
            .with_scopes(name, *scopes)
            .map_err(ServeError::ScopesBot)?;
    }
    Ok(bots)
}

/// Serves `TurnService` (with `grpc.health.v1.Health` and server reflection v1 and v1alpha) for
/// `bots` and the remote bots of `config.remote_bots` over the store `config` names, on `listeners` (a gRPC listener, and a metrics one if
/// wanted), until `shutdown` completes. Then health turns `NOT_SERVING`, new turns get
/// `UNAVAILABLE`, turns in flight get up to `config.shutdown_grace` to finish, and the server
/// stops. Until then, calls beyond `config.max_in_flight()` turns in flight get
/// `RESOURCE_EXHAUSTED`, and client connections age out after `config.connections.max_age`.
///
/// This is the one way to start the service: `main`, the example and every test call it (tests
/// that run several replicas over one store pass it as [`StoreConfig::Shared`]).
///
/// # Errors
/// [`ServeError`] when the store cannot be opened or the server fails.
pub async fn serve(
    config: Config,
    bots: BotRegistry,
    listeners: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let bots = with_policies(config.remote_bots.register(bots)?, &config)?;
    let (store, unmigrated) = open(&config).await?;
    let Listeners {
        grpc: listener,
        metrics,
    } = listeners.into();
    let local_addr = listener.local_addr().ok();
    // First, as it installs the metrics recorder: a histogram taken before (the timed store's)
    // records into nothing, and `turnstile_store_duration_seconds` stayed empty.
    let metrics = MetricsEndpoint::start(metrics, &store)?;
    let turn_store = for_turns(&store, &config);
    let upkeep = Upkeep::start(
        &store,
        config.receipt_retention,
        config.ttls,
        config.expiry_sweep_every,
    );
    let admin = AdminServiceServer::new(AdminApi::new(
        Arc::clone(&store),
        bots.clone(),
        admin_tokens(&config)?,
    ));
    let max_in_flight = config.max_in_flight();
    tracing::info!(max_in_flight, "turns in flight beyond this are refused");
    let drain = Drain::new(max_in_flight);
    let turns = turn_service(engine(turn_store, bots, &config), &config)?;
    let admission = AdmissionLayer::new(Arc::clone(&drain));
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let schema_watch = report_readiness(&health_reporter, unmigrated).await;
    let (reflection_v1, reflection_v1alpha) = reflection()?;

    let stopping = Arc::new(Notify::new());
    let signal = drain_on(
        shutdown,
        Drained {
            drain,
            schema_watch,
            health: health_reporter,
            grace: config.shutdown_grace,
            stopping: Arc::clone(&stopping),
        },
    );
    let services = Services::new(TurnServiceServer::<TurnApi>::NAME, turns)
        .with(health)
        .with(admin)
        .with(reflection_v1)
        .with(reflection_v1alpha);
    let server = server_builder(&config)?
        .layer(RpcTelemetryLayer::default())
        .layer(admission)
        .serve_with_incoming_shutdown(services, incoming(listener, &config), signal);
    tracing::info!(address = ?local_addr, "serving TurnService");

    let served = tokio::select! {
        result = server => result,
        // Every turn has finished or been abandoned; a client that keeps its connection open
        // after that must not hold the process.
        () = async { stopping.notified().await; tokio::time::sleep(CONNECTION_CLOSE_WAIT).await } => {
            tracing::warn!("clients kept connections open after the drain; closing them");
            Ok(())
        }
    };
    upkeep.stop();
    metrics.stop().await;
    served?;
    tracing::info!("stopped");
    Ok(())
}

/// The engine over `store`, with this configuration's limits.
fn engine(store: TurnStore, bots: BotRegistry, config: &Config) -> Engine {
    Engine::new(store, bots, config.retry).with_max_scope_bytes(config.max_scope_bytes)
}

/// `store` as the turn engine uses it: timed, behind this configuration's state cache, which
/// keeps to its expiry.
fn for_turns(store: &Arc<dyn Store>, config: &Config) -> TurnStore {
    let size = crate::store::CacheSize {
        entries: config.state_cache_entries,
        bytes: config.state_cache_bytes,
    };
    TurnStore::for_turns(Arc::clone(store), size, config.ttls)
}

/// The largest gRPC message either way: twice the largest activity, at least 4 MiB.
fn max_message(config: &Config) -> usize {
    config
        .limits
        .max_activity_bytes
        .saturating_mul(2)
        .max(4 << 20)
}

/// `TurnService` as served: limited in message size, with the bearer-token check when tokens
/// are configured.
fn turn_service(engine: Engine, config: &Config) -> Result<TurnService, ServeError> {
    let max_message = max_message(config);
    let authenticate = authenticate(config)?;
    let turns = TurnServiceServer::new(TurnApi::new(engine, config.limits))
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message);
    // Without tokens the interceptor only lets every call through, after converting its request
    // to tonic's and back (`bench/RESULTS.md`): then `TurnService` goes without it.
    Ok(if authenticate.is_enabled() {
        Either::Left(MapResponse::new(
            TooLarge::new(InterceptedService::new(turns, authenticate), max_message),
            |response: http::Response<ResponseBody<tonic::body::Body>>| {
                response.map(tonic::body::Body::new)
            },
        ))
    } else {
        Either::Right(TooLarge::new(turns, max_message))
    })
}

/// [`turn_service`]'s service: with or without the token check.
type TurnService = Either<
    MapResponse<
        TooLarge<InterceptedService<TurnServiceServer<TurnApi>, Authenticate>>,
        fn(http::Response<ResponseBody<tonic::body::Body>>) -> http::Response<tonic::body::Body>,
    >,
    TooLarge<TurnServiceServer<TurnApi>>,
>;

/// Reports `TurnService` serving once the schema is one its statements were written for: at
/// once for a store migrated on start; else after a first check, or when `watch_schema` (the
/// returned task) finds it. Until then `TurnService` is NOT_SERVING (the server as a whole, "",
/// is up: liveness must not restart a replica that waits for its migration Job) and turns are
/// refused at the store's gate.
async fn report_readiness(
    health: &tonic_health::server::HealthReporter,
    unmigrated: Option<PostgresStore>,
) -> Option<tokio::task::JoinHandle<()>> {
    let Some(store) = unmigrated else {
        health.set_serving::<TurnServiceServer<TurnApi>>().await;
        return None;
    };
    store.hold_until_schema_checked();
    health.set_not_serving::<TurnServiceServer<TurnApi>>().await;
    // The first check before the port answers, so that a replica whose migration Job has run
    // serves its first turn rather than refusing it while a watcher starts.
    let mut logged = String::new();
    let first = tokio::time::timeout(FIRST_SCHEMA_CHECK, check_schema(&store, &mut logged));
    if first.await.unwrap_or(false) {
        health.set_serving::<TurnServiceServer<TurnApi>>().await;
        None
    } else {
        Some(tokio::spawn(watch_schema(store, health.clone(), logged)))
    }
}

/// gRPC reflection, v1 and v1alpha, describing the service's protos and the `google.rpc`
/// error-detail types too: every error status carries them, and a client that learns the
/// contract by reflection (grpcurl) decodes them only if it can look them up.
#[allow(clippy::type_complexity)]
fn reflection() -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    ServeError,
> {
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}

/// What a graceful shutdown goes through ([`drain_on`]).
struct Drained {
    drain: Arc<Drain>,
    schema_watch: Option<tokio::task::JoinHandle<()>>,
    health: tonic_health::server::HealthReporter,
    grace: Duration,
    /// Told when the turns in flight have finished or been abandoned.
    stopping: Arc<Notify>,
}

/// The server's shutdown signal: once `shutdown` completes, refuses new turns, reports
/// NOT_SERVING, and gives the turns in flight their grace before the server stops.
async fn drain_on(shutdown: impl Future<Output = ()>, drained: Drained) {
    let Drained {
        drain,
        schema_watch,
        health,
        grace,
        stopping,
    } = drained;
    shutdown.await;
    drain.start();
    if let Some(watch) = schema_watch {
        // Stopped, not just told to stop, before NOT_SERVING: it must not report SERVING after
        // that.
        watch.abort();
        let _ = watch.await;
    }
    health.set_not_serving::<TurnServiceServer<TurnApi>>().await;
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    tracing::info!(
        in_flight = drain.in_flight(),
        "shutting down: refusing new turns, finishing those in flight"
    );
    if tokio::time::timeout(grace, drain.idle()).await.is_err() {
        tracing::warn!(
            ?grace,
            in_flight = drain.in_flight(),
            "in-flight turns did not finish within the grace period; abandoning them \
             (an abandoned turn commits all or nothing, and its caller gets an error)"
        );
    }
    stopping.notify_one();
}

/// The connections `listener` accepts, each ended at the configured age plus its grace.
fn incoming(
    listener: TcpListener,
    config: &Config,
) -> impl futures::Stream<Item = std::io::Result<Coalesced<Deadlined>>> + use<> {
    let connections = config.connections;
    // GOAWAY at the age by tonic, the hard end after the grace by the socket: see
    // `server::connection_age` for why not tonic's own grace.
    let lifetime = connections
        .max_age
        .zip(connections.max_age_grace)
        .map(|(age, grace)| age.saturating_add(grace));
    // Answers written together (`grpc::coalesce`), but not beneath TLS.
    let tls = config.tls.is_some();
    TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .map(move |accepted| {
            accepted.map(|stream| Coalesced::unless_tls(Deadlined::new(stream, lifetime), tls))
        })
}

/// The gRPC server with this configuration's keepalives, connection age and TLS.
fn server_builder(config: &Config) -> Result<Server, ServeError> {
    let connections = config.connections;
    let mut builder = Server::builder()
        .http2_keepalive_interval(connections.keepalive_interval)
        .http2_keepalive_timeout(Some(connections.keepalive_timeout))
        .max_concurrent_streams(connections.max_streams);
    if let Some(age) = connections.max_age {
        builder = builder.max_connection_age(age);
    }
    if let Some(tls) = &config.tls {
        builder = builder.tls_config(tls_config(tls)?)?;
    }
    Ok(builder)
}

/// `/metrics` on a listener of its own, if the server has one. Scrapes go on while the gRPC side
/// drains, and end with it.
struct MetricsEndpoint {
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    stop: Arc<Notify>,
}

impl MetricsEndpoint {
    fn start(listener: Option<TcpListener>, store: &Arc<dyn Store>) -> Result<Self, ServeError> {
        let stop = Arc::new(Notify::new());
        let task = match listener {
            Some(listener) => {
                let handle = crate::telemetry::metrics::recorder()?;
                tracing::info!(address = ?listener.local_addr().ok(), "serving /metrics");
                let stopped = Arc::clone(&stop);
                Some(tokio::spawn(crate::telemetry::metrics::serve(
                    listener,
                    handle,
                    Arc::clone(store),
                    async move { stopped.notified().await },
                )))
            }
            None => None,
        };
        Ok(Self { task, stop })
    }

    /// Ends the endpoint, giving scrapes in progress a moment; its port is closed on return.
    async fn stop(self) {
        let Some(mut task) = self.task else {
            return;
        };
        self.stop.notify_one();
        match tokio::time::timeout(CONNECTION_CLOSE_WAIT, &mut task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the metrics endpoint failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the metrics endpoint's task failed"),
            Err(_) => {
                tracing::warn!("a scraper kept the metrics endpoint open; closing it");
                task.abort();
                // Until the aborted task is dropped its listener stays open: wait for that, so
                // that the port is closed once `serve` returns.
                let _ = task.await;
            }
        }
    }
}

/// The rustls configuration `tls` describes: the server's identity and, for mutual TLS, the CA
/// every client certificate must chain to (a client without one is refused in the handshake).
fn tls_config(tls: &TlsFiles) -> Result<ServerTlsConfig, ServeError> {
    let read = |path: &std::path::PathBuf| {
        std::fs::read(path).map_err(|source| ServeError::TlsFile {
            path: path.clone(),
            source,
        })
    };
    let mut config =
        ServerTlsConfig::new().identity(Identity::from_pem(read(&tls.cert)?, read(&tls.key)?));
    if let Some(ca) = &tls.client_ca {
        config = config.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    tracing::info!(mutual = tls.client_ca.is_some(), "serving gRPC over TLS");
    Ok(config)
}

/// The admin tokens `config` names (inline and in its file); none: the admin service is off.
fn admin_tokens(config: &Config) -> Result<Vec<auth::Token>, ServeError> {
    let mut tokens = config.admin_tokens.clone();
    if let Some(path) = &config.admin_tokens_file {
        tokens.extend(
            auth::read_tokens_file(path).map_err(|source| ServeError::AuthTokens {
                path: path.clone(),
                source,
            })?,
        );
    }
    Ok(tokens)
}

/// The `TurnService` interceptor for the tokens `config` names (inline and in its file).
fn authenticate(config: &Config) -> Result<Authenticate, ServeError> {
    let mut tokens = config.auth_tokens.clone();
    if let Some(path) = &config.auth_tokens_file {
        tokens.extend(
            auth::read_tokens_file(path).map_err(|source| ServeError::AuthTokens {
                path: path.clone(),
                source,
            })?,
        );
    }
    let authenticate = Authenticate::new(tokens);
    if !authenticate.is_enabled() {
        tracing::warn!(
            "no auth tokens configured: any caller that reaches the port may run turns; set \
             TURNSTILE_AUTH_TOKENS_FILE or TURNSTILE_AUTH_TOKENS to require a bearer token"
        );
    }
    Ok(authenticate)
}

/// Checks the database's schema, at once and then every [`SCHEMA_CHECK_INTERVAL`], until it is
/// one this binary serves (its own version, or a newer one: migrations only add); then reports
/// `TurnService` SERVING and returns. Each new reason for not serving is logged once.
async fn watch_schema(
    store: PostgresStore,
    health: tonic_health::server::HealthReporter,
    mut logged: String,
) {
    loop {
        tokio::time::sleep(SCHEMA_CHECK_INTERVAL).await;
        if check_schema(&store, &mut logged).await {
            break;
        }
    }
    health.set_serving::<TurnServiceServer<TurnApi>>().await;
}

/// One check of the database's schema: whether this replica can serve turns on it. Why not is
/// logged when it differs from `logged`, the reason last logged.
async fn check_schema(store: &PostgresStore, logged: &mut String) -> bool {
    let waiting = match store.check_schema().await {
        Ok(status @ postgres::SchemaStatus::Ahead { .. }) => {
            tracing::warn!(
                "{status}: serving beside it, as migrations only add; upgrade this replica"
            );
            return true;
        }
        Ok(status @ postgres::SchemaStatus::Current { .. }) => {
            tracing::info!("{status}: serving turns");
            return true;
        }
        Ok(behind) => behind.to_string(),
        Err(e) => format!(
            "cannot check the database schema: {:#}",
            anyhow::Error::from(e)
        ),
    };
    if waiting != *logged {
        tracing::warn!(
            "TurnService NOT_SERVING: {waiting}; checking again every {SCHEMA_CHECK_INTERVAL:?}"
        );
        *logged = waiting;
    }
    false
}
