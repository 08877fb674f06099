//! Configuration: the command line (every flag with an environment variable behind it) and the
//! plain [`Config`] that `serve` takes, which tests build directly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args, Parser, Subcommand};

use crate::engine::RetryPolicy;
use crate::grpc::auth::{self, Token};
use crate::grpc::limits::Limits;
use crate::store::postgres::DatabaseUrl;

/// Where turn state is kept.
#[derive(Debug, Clone)]
pub enum StoreConfig {
    /// In this process's memory: one replica only, lost on exit.
    Memory,
    /// In PostgreSQL, shared by every replica.
    Postgres {
        /// The connection string (never logged).
        url: DatabaseUrl,
        /// The most connections this replica opens.
        pool_size: usize,
    },
}

/// Everything `serve` needs besides the listener and the bots.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where turn state is kept.
    pub store: StoreConfig,
    /// Whether `serve` applies pending migrations before it accepts calls.
    pub migrate_on_start: bool,
    /// How often and how patiently a conflicted turn is replayed.
    pub retry: RetryPolicy,
    /// What a caller may send.
    pub limits: Limits,
    /// How long in-flight turns get to finish after a shutdown signal.
    pub shutdown_grace: Duration,
    /// How long a turn's receipt is kept, so that a redelivery within it is recognized.
    pub receipt_retention: Duration,
    /// How many keys' last committed state a replica remembers to skip loads (0: none).
    pub state_cache_entries: usize,
    /// Bearer tokens a `TurnService` caller may present; with none here nor in
    /// `auth_tokens_file`, calls need no token.
    pub auth_tokens: Vec<Token>,
    /// A file of further tokens, one per line, read when the server starts.
    pub auth_tokens_file: Option<PathBuf>,
    /// TLS on the gRPC port; plaintext when `None`.
    pub tls: Option<TlsFiles>,
}

/// The PEM files TLS is served from, read when the server starts.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// The server certificate's private key.
    pub key: PathBuf,
    /// The CA that client certificates must chain to; when set, a client without such a
    /// certificate cannot connect (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            store: StoreConfig::Memory,
            migrate_on_start: true,
            retry: RetryPolicy::default(),
            limits: Limits::default(),
            shutdown_grace: Duration::from_secs(30),
            receipt_retention: Duration::from_secs(24 * 60 * 60),
            state_cache_entries: 100_000,
            auth_tokens: Vec::new(),
            auth_tokens_file: None,
            tls: None,
        }
    }
}

/// Turn processing for chat bots: optimistic-concurrency turns over PostgreSQL, served over gRPC.
#[derive(Debug, Parser)]
#[command(name = "turnstile", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// What to do; `serve` when omitted.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `serve`'s options, accepted without the word `serve`.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// The binary's subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process; boxing buys nothing
pub enum Command {
    /// Serve `TurnService` over gRPC (the default).
    Serve(ServeArgs),
    /// Apply pending database migrations, then exit.
    Migrate(MigrateArgs),
    /// Serve the Bot Framework endpoint (`POST /api/messages`) in front of a Turnstile server.
    Gateway(crate::gateway::GatewayArgs),
}

/// `turnstile serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on for gRPC.
    #[arg(long, env = "TURNSTILE_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Address to serve Prometheus metrics on (plain HTTP, `GET /metrics`); off when unset.
    #[arg(long, env = "TURNSTILE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// PostgreSQL connection URL; without it, state is kept in memory (one replica only).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Most PostgreSQL connections this replica opens.
    #[arg(long, env = "TURNSTILE_POOL_SIZE", default_value_t = 16)]
    pub pool_size: usize,
    /// Apply pending migrations before serving (turn off when a migration job does it).
    #[arg(long, env = "TURNSTILE_MIGRATE_ON_START", default_value_t = true, action = ArgAction::Set)]
    pub migrate_on_start: bool,
    /// Most times the bot runs for one turn before the call fails with ABORTED.
    #[arg(long, env = "TURNSTILE_MAX_ATTEMPTS", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// Cap of the first backoff wait after a conflict, in milliseconds (doubles per attempt).
    #[arg(long, env = "TURNSTILE_BACKOFF_BASE_MS", default_value_t = 2)]
    pub backoff_base_ms: u64,
    /// Cap of any backoff wait, in milliseconds.
    #[arg(long, env = "TURNSTILE_BACKOFF_MAX_MS", default_value_t = 200)]
    pub backoff_max_ms: u64,
    /// Largest activity accepted, in encoded bytes.
    #[arg(long, env = "TURNSTILE_MAX_ACTIVITY_BYTES", default_value_t = Limits::default().max_activity_bytes)]
    pub max_activity_bytes: usize,
    /// Longest `text`, `speak` or `summary` accepted, in bytes.
    #[arg(long, env = "TURNSTILE_MAX_TEXT_BYTES", default_value_t = Limits::default().max_text_bytes)]
    pub max_text_bytes: usize,
    /// Most bytes of all attachments of one activity.
    #[arg(long, env = "TURNSTILE_MAX_ATTACHMENTS_BYTES", default_value_t = Limits::default().max_attachments_bytes)]
    pub max_attachments_bytes: usize,
    /// Most bytes of an activity's `channel_data`.
    #[arg(long, env = "TURNSTILE_MAX_CHANNEL_DATA_BYTES", default_value_t = Limits::default().max_channel_data_bytes)]
    pub max_channel_data_bytes: usize,
    /// Deepest nesting of any JSON value in an activity.
    #[arg(long, env = "TURNSTILE_MAX_JSON_DEPTH", default_value_t = Limits::default().max_json_depth)]
    pub max_json_depth: usize,
    /// Seconds in-flight turns get to finish after SIGTERM or SIGINT.
    #[arg(long, env = "TURNSTILE_SHUTDOWN_GRACE_SECS", default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// Seconds a turn's receipt is kept: a redelivered activity within this time gets the stored
    /// answer instead of running again.
    #[arg(long, env = "TURNSTILE_RECEIPT_RETENTION_SECS", default_value_t = 24 * 60 * 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub receipt_retention_secs: u64,
    /// Keys whose last committed state this replica remembers, so that a conversation's next
    /// turn here skips the load (one database round trip instead of two); 0 turns it off.
    #[arg(long, env = "TURNSTILE_STATE_CACHE_ENTRIES", default_value_t = 100_000)]
    pub state_cache_entries: usize,
    /// File of bearer tokens, one per line; when any token is configured, every `TurnService`
    /// call needs `authorization: Bearer <token>` (health and reflection stay open).
    #[arg(long, env = "TURNSTILE_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,
    /// Bearer tokens, comma-separated; prefer the environment variable or the file, since
    /// command lines are visible to other local users.
    #[arg(long, env = "TURNSTILE_AUTH_TOKENS", hide_env_values = true)]
    pub auth_tokens: Option<String>,
    /// PEM certificate chain for TLS on the gRPC port (with `--tls-key`); plaintext without.
    #[arg(long, env = "TURNSTILE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "TURNSTILE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) client certificates must chain to: turns on mutual TLS.
    #[arg(long, env = "TURNSTILE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl ServeArgs {
    /// The configuration these arguments describe.
    pub fn config(&self) -> Config {
        Config {
            store: match &self.database_url {
                Some(url) => StoreConfig::Postgres {
                    url: DatabaseUrl::new(url.clone()),
                    pool_size: self.pool_size,
                },
                None => StoreConfig::Memory,
            },
            migrate_on_start: self.migrate_on_start,
            retry: RetryPolicy {
                max_attempts: self.max_attempts,
                base_delay: Duration::from_millis(self.backoff_base_ms),
                max_delay: Duration::from_millis(self.backoff_max_ms),
            },
            limits: Limits {
                max_activity_bytes: self.max_activity_bytes,
                max_text_bytes: self.max_text_bytes,
                max_attachments_bytes: self.max_attachments_bytes,
                max_channel_data_bytes: self.max_channel_data_bytes,
                max_json_depth: self.max_json_depth,
            },
            shutdown_grace: Duration::from_secs(self.shutdown_grace_secs),
            receipt_retention: Duration::from_secs(self.receipt_retention_secs),
            state_cache_entries: self.state_cache_entries,
            auth_tokens: self
                .auth_tokens
                .as_deref()
                .map(|t| auth::parse_tokens(t, ','))
                .unwrap_or_default(),
            auth_tokens_file: self.auth_tokens_file.clone(),
            tls: match (&self.tls_cert, &self.tls_key) {
                (Some(cert), Some(key)) => Some(TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: self.tls_client_ca.clone(),
                }),
                _ => None,
            },
        }
    }
}

/// `turnstile migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// PostgreSQL connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}
