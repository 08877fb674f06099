//! What the integration tests share: PostgreSQL clusters, servers started the one way `main`
//! starts them (on port 0) — most tests through [`spawn_app`] — and builders for requests.
#![allow(dead_code, clippy::unwrap_used)]

pub mod app;
pub mod bots;
pub mod check;
pub mod citus;
pub mod fleet;
pub mod load;
pub mod pg;
pub mod pki;
pub mod proxy;
pub mod raw;
pub mod release;
pub mod streams;
pub mod tools;

// Each test target uses what it needs of these.
#[allow(unused_imports)]
pub use app::{TestApp, TestAppBuilder, spawn_app};

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use turnstile::BotRegistry;
use turnstile::config::{Config, SharedStore, StoreConfig};
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::server::ServeError;
use turnstile::store::postgres::DatabaseUrl;

/// A server running in this process, stopped when dropped. Tests start one through [`TestApp`],
/// which wraps it, and start it themselves only where a plain client could not connect (TLS).
pub struct TestServer {
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), ServeError>>>,
    /// Why `serve` returned an error, with its causes, once it has.
    failure: Arc<OnceLock<String>>,
}

/// `error` and its causes, outermost first.
fn causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

impl TestServer {
    /// Starts `turnstile::serve` with `config` and `bots` on a free port.
    pub async fn start(config: Config, bots: BotRegistry) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let failure = Arc::new(OnceLock::new());
        let failed = Arc::clone(&failure);
        let handle = tokio::spawn(async move {
            let served = turnstile::serve(config, bots, listener, async {
                let _ = rx.await;
            })
            .await;
            if let Err(e) = &served {
                let _ = failed.set(causes(e));
            }
            served
        });
        TestServer {
            addr,
            shutdown: Some(tx),
            handle: Some(handle),
            failure,
        }
    }

    /// Starts `turnstile::serve` over `store`, which other servers may share.
    pub async fn start_with_store(
        config: Config,
        store: std::sync::Arc<dyn turnstile::store::Store>,
        bots: BotRegistry,
    ) -> TestServer {
        let config = Config {
            store: StoreConfig::Shared(SharedStore(store)),
            ..config
        };
        TestServer::start(config, bots).await
    }

    /// A new client connection to this server, once the server answers calls: the port is bound
    /// here, before `serve` has migrated its database, and takes connections meanwhile. A test
    /// that timed its turns from then would count the migration in them.
    ///
    /// # Panics
    /// When the server stopped instead, naming why: otherwise the test's calls would fail with
    /// "connection refused" and say nothing of the cause.
    pub async fn client(&self) -> TurnServiceClient<Channel> {
        let endpoint = format!("http://{}", self.addr);
        for _ in 0..100 {
            let connected = tonic::transport::Endpoint::from_shared(endpoint.clone())
                .expect("a valid endpoint")
                .connect()
                .await;
            if let Ok(channel) = connected {
                // Any answer will do: a server waiting for its schema answers NOT_SERVING.
                let answered = tonic_health::pb::health_client::HealthClient::new(channel.clone())
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await;
                if answered.is_err() {
                    self.panic_if_stopped().await;
                }
                return TurnServiceClient::new(channel);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("server at {endpoint} never accepted a connection");
    }

    /// Panics naming why the server stopped, if it stopped with an error (within a moment: its
    /// listener closes as `serve` returns, just before the error is kept).
    async fn panic_if_stopped(&self) {
        for _ in 0..20 {
            if let Some(why) = self.failure.get() {
                panic!("the server at {} stopped: {why}", self.addr);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Asks the server to shut down and waits for it to stop.
    pub async fn stop(mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.handle.take().unwrap().await.unwrap()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A configuration with PostgreSQL at `url`.
pub fn postgres_config(url: &str) -> Config {
    Config {
        store: StoreConfig::Postgres {
            url: DatabaseUrl::new(url),
            pool_size: 8,
            commits_in_flight: None,
        },
        ..Config::default()
    }
}

/// A message from `user` in `conversation` on the `test` channel.
pub fn message(conversation: &str, user: &str, text: &str) -> pb::Activity {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    pb::Activity {
        r#type: Some("message".into()),
        id: Some(format!("act-{id}")),
        channel_id: Some("test".into()),
        service_url: Some("https://gateway.example/test".into()),
        conversation: Some(pb::ConversationAccount {
            id: Some(conversation.into()),
            ..Default::default()
        }),
        from: Some(pb::ChannelAccount {
            id: Some(user.into()),
            name: Some(user.into()),
            role: Some("user".into()),
            ..Default::default()
        }),
        recipient: Some(pb::ChannelAccount {
            id: Some("bot".into()),
            role: Some("bot".into()),
            ..Default::default()
        }),
        text: Some(text.into()),
        ..Default::default()
    }
}

/// A request for the default bot.
pub fn request(activity: pb::Activity) -> pb::ProcessTurnRequest {
    pb::ProcessTurnRequest::typed(activity, "")
}

/// Sends `text` to the default bot and returns the response, panicking on a non-OK status.
pub async fn say(
    client: &mut TurnServiceClient<Channel>,
    conversation: &str,
    text: &str,
) -> pb::ProcessTurnResponse {
    client
        .process_turn(request(message(conversation, "alice", text)))
        .await
        .unwrap_or_else(|s| panic!("`{text}` failed: {s:?}"))
        .into_inner()
}

/// The texts of a response's activities.
pub fn texts(response: &pb::ProcessTurnResponse) -> Vec<String> {
    response
        .activities
        .iter()
        .map(|a| a.text.clone().unwrap_or_default())
        .collect()
}

/// The toppings a pizza bot reply names: `… Your pizza has: a, b, c.`
pub fn toppings(reply: &str) -> Vec<String> {
    match reply.split_once("Your pizza has: ") {
        Some((_, list)) => list
            .trim_end_matches('.')
            .split(", ")
            .map(str::to_owned)
            .collect(),
        None => Vec::new(),
    }
}

/// Runs `turnstile health-check` with `args` in a clean environment: whether it exited 0, and
/// what it printed (stdout, then stderr).
pub fn health_check<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("health-check")
        .args(args)
        .env_clear()
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A TCP port on 127.0.0.1 that was free a moment ago, for a process started with a port number.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("finding a free port")
}
