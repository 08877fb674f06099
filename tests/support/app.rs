//! One test's Turnstile, as zero2prod's `spawn_app()`: the server started the one way `main`
//! starts it ([`TestServer`], `turnstile::serve` on port 0), over a fresh database on the shared
//! throwaway cluster unless told otherwise, and a client connected to it.
//!
//! `spawn_app()` is the usual case: the sample bots over PostgreSQL. A test that needs other bots,
//! another store or a configuration tweak says so on [`TestApp`]'s builder, and a second replica
//! over the same database or store is [`TestApp::replica`].

use std::net::SocketAddr;
use std::sync::Arc;

use tonic::transport::Channel;
use turnstile::BotRegistry;
use turnstile::config::{Config, SharedStore, StoreConfig};
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::server::ServeError;
use turnstile::store::Store as StateStore;

use super::{TestServer, pg, postgres_config};

/// A running server for one test, stopped when dropped, and a client connected to it.
pub struct TestApp {
    /// Where the server listens (127.0.0.1, a port of its own).
    pub addr: SocketAddr,
    /// A client connected to the server; its clones share the connection.
    pub client: TurnServiceClient<Channel>,
    server: TestServer,
    /// The configuration it was started with, for [`TestApp::replica`].
    config: Config,
    database_url: Option<String>,
}

/// The sample bots (`turnstile serve`'s) over a fresh PostgreSQL database.
pub async fn spawn_app() -> TestApp {
    TestApp::postgres().spawn().await
}

impl TestApp {
    /// An app over a fresh database on the shared throwaway cluster (or `TEST_DATABASE_URL`'s
    /// server).
    pub fn postgres<'a>() -> TestAppBuilder<'a> {
        TestAppBuilder::new(Store::FreshDatabase)
    }

    /// An app over the existing database `url`: another cluster's (a private one, Citus), or one
    /// another app or the test itself already uses.
    pub fn on<'a>(url: &str) -> TestAppBuilder<'a> {
        TestAppBuilder::new(Store::Database(url.to_owned()))
    }

    /// An app over its own memory store.
    pub fn memory<'a>() -> TestAppBuilder<'a> {
        TestAppBuilder::new(Store::Memory)
    }

    /// An app over `store`, which other apps in this process may share.
    pub fn shared<'a>(store: Arc<dyn StateStore>) -> TestAppBuilder<'a> {
        TestAppBuilder::new(Store::Shared(store))
    }

    /// The URL of the app's database.
    ///
    /// # Panics
    /// When the app has none (a memory or shared store).
    pub fn database_url(&self) -> &str {
        self.database_url
            .as_deref()
            .expect("this app keeps its state in no database of its own")
    }

    /// Another server with this one's configuration, so over the same database or shared store,
    /// hosting `bots`.
    ///
    /// # Panics
    /// When this app is on a memory store of its own, which no other server can see.
    pub async fn replica(&self, bots: BotRegistry) -> TestApp {
        assert!(
            !matches!(self.config.store, StoreConfig::Memory),
            "a replica of an app on its own memory store would share nothing: use TestApp::shared"
        );
        TestApp::start(self.config.clone(), bots, self.database_url.clone()).await
    }

    /// A client on a connection of its own, for a test that counts connections.
    pub async fn connect(&self) -> TurnServiceClient<Channel> {
        self.server.client().await
    }

    /// Asks the server to shut down and waits for it to stop.
    pub async fn stop(self) -> Result<(), ServeError> {
        self.server.stop().await
    }

    async fn start(config: Config, bots: BotRegistry, database_url: Option<String>) -> TestApp {
        let server = TestServer::start(config.clone(), bots).await;
        TestApp {
            addr: server.addr,
            client: server.client().await,
            server,
            config,
            database_url,
        }
    }
}

/// Where an app keeps its state.
enum Store {
    FreshDatabase,
    Database(String),
    Memory,
    Shared(Arc<dyn StateStore>),
}

/// What a test asks of its app besides the defaults: other bots, a configuration tweak.
#[must_use = "an app starts on `.spawn().await`"]
pub struct TestAppBuilder<'a> {
    store: Store,
    bots: Option<BotRegistry>,
    tweaks: Vec<Box<dyn FnOnce(Config) -> Config + Send + 'a>>,
}

impl<'a> TestAppBuilder<'a> {
    fn new(store: Store) -> TestAppBuilder<'a> {
        TestAppBuilder {
            store,
            bots: None,
            tweaks: Vec::new(),
        }
    }

    /// Hosts `bots` instead of the sample bots.
    pub fn bots(self, bots: BotRegistry) -> TestAppBuilder<'a> {
        TestAppBuilder {
            bots: Some(bots),
            ..self
        }
    }

    /// Changes the configuration: `tweak` gets the one with the store set (PostgreSQL with a pool
    /// of 8, or the memory or shared store; everything else as `Config::default()`) and returns
    /// the one to start with, typically `|c| Config { …, ..c }`. Tweaks apply in order.
    pub fn config(
        mut self,
        tweak: impl FnOnce(Config) -> Config + Send + 'a,
    ) -> TestAppBuilder<'a> {
        self.tweaks.push(Box::new(tweak));
        self
    }

    /// Makes the database when it is a fresh one, and starts the server.
    pub async fn spawn(self) -> TestApp {
        let (config, database_url) = match self.store {
            Store::FreshDatabase => {
                let url = pg::fresh_database().await;
                (postgres_config(&url), Some(url))
            }
            Store::Database(url) => (postgres_config(&url), Some(url)),
            Store::Memory => (Config::default(), None),
            Store::Shared(store) => (
                Config {
                    store: StoreConfig::Shared(SharedStore(store)),
                    ..Config::default()
                },
                None,
            ),
        };
        let config = self.tweaks.into_iter().fold(config, |c, tweak| tweak(c));
        let bots = self.bots.unwrap_or_else(turnstile::bots::samples);
        TestApp::start(config, bots, database_url).await
    }
}
