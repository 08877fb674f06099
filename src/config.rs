//! Configuration: the command line (every flag with an environment variable behind it) and the
//! plain [`Config`] that `serve` takes, which tests build directly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args, Parser, Subcommand};
use secrecy::SecretString;

use crate::bots::remote::{RemoteBotSpec, RemoteBots};
use crate::engine::RetryPolicy;
use crate::grpc::auth::{self, Token};
use crate::grpc::limits::Limits;
use crate::store::postgres::{DatabaseUrl, Schema, Statements};

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
        /// Group-commit statements this replica keeps in flight at once; `None` for a number
        /// that suits `pool_size`.
        commits_in_flight: Option<usize>,
    },
    /// A store the caller built, which several servers in one process may share (tests do, to
    /// run replicas over one store).
    Shared(SharedStore),
}

/// The memory the state cache may hold unless told: 64 MiB, a quarter of the chart's default
/// memory limit.
pub const DEFAULT_STATE_CACHE_BYTES: usize = 64 << 20;

/// A store built outside `serve`, for [`StoreConfig::Shared`].
#[derive(Clone)]
pub struct SharedStore(pub std::sync::Arc<dyn crate::store::Store>);

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedStore")
    }
}

/// Everything `serve` needs besides the listener and the bots.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where turn state is kept.
    pub store: StoreConfig,
    /// Whether `serve` applies pending migrations before it accepts calls.
    pub migrate_on_start: bool,
    /// Where those migrations go when not to the store's URL: a direct session, for a store
    /// reached through a transaction-mode pooler.
    pub migration_url: Option<DatabaseUrl>,
    /// How the PostgreSQL store sends its statements.
    pub statements: Statements,
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
    /// How many bytes of memory those states may hold, at most (0: none).
    pub state_cache_bytes: usize,
    /// The largest state a bot may write to one scope, as JSON text.
    pub max_scope_bytes: usize,
    /// How long each scope's state lives unwritten before it reads as absent; none by default.
    pub ttls: crate::store::Ttls,
    /// How often a replica sweeps the expired state away, once through (only with a TTL).
    pub expiry_sweep_every: Duration,
    /// Bearer tokens a `TurnService` caller may present; with none here nor in
    /// `auth_tokens_file`, calls need no token.
    pub auth_tokens: Vec<Token>,
    /// A file of further tokens, one per line, read when the server starts.
    pub auth_tokens_file: Option<PathBuf>,
    /// Bearer tokens an `AdminService` caller must present; with none here nor in
    /// `admin_tokens_file`, the admin service is off.
    pub admin_tokens: Vec<Token>,
    /// A file of further admin tokens, one per line, read when the server starts.
    pub admin_tokens_file: Option<PathBuf>,
    /// TLS on the gRPC port; plaintext when `None`.
    pub tls: Option<TlsFiles>,
    /// The most turns in flight before new ones are refused with `RESOURCE_EXHAUSTED`; `None`
    /// derives it from the store (see [`Config::max_in_flight`]).
    pub max_in_flight: Option<usize>,
    /// gRPC connection lifetime and liveness (see [`Connections`]).
    pub connections: Connections,
    /// Bots served by bot workers over gRPC, added to the bots `serve` is given.
    pub remote_bots: RemoteBots,
    /// Bots, in-process or remote, whose turns hold the conversation lock from their first
    /// attempt ([`crate::bot::ConcurrencyPolicy::Serialized`]); `serve` applies this after
    /// registering the remote bots, and refuses to start when a name is not hosted.
    pub serialized_bots: Vec<String>,
    /// Each bot's double-text policy, by name ([`crate::bot::DoubleText`]); `serve` applies
    /// these as it does `serialized_bots`, and refuses to start when a name is not hosted.
    pub double_text: Vec<(String, crate::bot::DoubleText)>,
    /// The state scopes given to bots by name in place of those they declare
    /// ([`crate::bot::BotRegistry::with_scopes`]); `serve` applies these as it does
    /// `double_text`.
    pub bot_scopes: Vec<(String, crate::bot::Scopes)>,
}

/// How long a client's HTTP/2 connection lives, and how a dead one is noticed.
///
/// A gateway keeps its connections open for as long as they work, so replicas added by a
/// scale-out would get no traffic from existing gateways: aging connections out makes every
/// client reconnect, through the load balancer, within `max_age` plus `max_age_grace`. Five
/// minutes spreads the load over new replicas quickly while a reconnect (a TCP and, with TLS, a
/// TLS handshake) every five minutes per client costs nothing; 30 s of grace lets a turn in
/// flight finish (well above the default call times) before the connection is cut. The server
/// sends GOAWAY at `max_age`, and clients open a new connection for their next call.
///
/// Keepalive pings every 60 s notice a connection whose peer vanished (a node gone, a NAT entry
/// expired) within `keepalive_interval` + `keepalive_timeout`, instead of holding it until TCP
/// gives up after many minutes; every HTTP/2 client answers a server's pings whatever its own
/// keepalive settings, and one ping a minute costs nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connections {
    /// When a connection is told to go away (GOAWAY); `None`: never.
    pub max_age: Option<Duration>,
    /// How long calls in flight on an aged connection get before it is closed; `None`: as long
    /// as they need.
    pub max_age_grace: Option<Duration>,
    /// How often the server pings an idle connection; `None`: never.
    pub keepalive_interval: Option<Duration>,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// How many calls one connection may carry at once (HTTP/2's `MAX_CONCURRENT_STREAMS`);
    /// `None`: no limit. A client past it waits for a call of its own to end before it sends
    /// another, instead of queueing calls in the server where no limit sees them.
    pub max_streams: Option<u32>,
}

impl Default for Connections {
    fn default() -> Self {
        Self {
            max_age: Some(Duration::from_secs(300)),
            max_age_grace: Some(Duration::from_secs(30)),
            keepalive_interval: Some(Duration::from_secs(60)),
            keepalive_timeout: Duration::from_secs(20),
            max_streams: Some(DEFAULT_MAX_CONCURRENT_STREAMS),
        }
    }
}

/// Calls one client connection may carry at once by default: above any one gateway's share of
/// a replica's turns in flight (a few hundred), and far below what would let one connection
/// queue thousands of calls in the server.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 256;

/// The in-flight limit with the memory store: it does no I/O, so turns are bounded by the CPU and
/// the limit only bounds memory. A replica held 170 MiB at 2,048 concurrent calls (issue 11), so
/// at most about 85 KiB per call: 1,024 calls stay under some 85 MiB.
pub const MEMORY_MAX_IN_FLIGHT: usize = 1024;

/// Turns in flight per PostgreSQL connection when the limit is derived. A turn holds a
/// connection only for its load and its commit (about a millisecond each; commits are grouped),
/// not while its bot runs, so a pool of 16 serves a few thousand turns a second. By Little's law
/// 16 × 32 = 512 turns in flight at that rate is about 100 ms of queueing, beyond which more
/// admitted turns only add latency a gateway will time out on; and 512 calls hold at most about
/// 43 MiB (see [`MEMORY_MAX_IN_FLIGHT`]).
pub const MAX_IN_FLIGHT_PER_CONNECTION: usize = 32;

impl Config {
    /// Whether `TurnService` callers need a bearer token (inline or from the file).
    pub fn has_auth_tokens(&self) -> bool {
        !self.auth_tokens.is_empty() || self.auth_tokens_file.is_some()
    }

    /// The most turns in flight: as configured, else [`MAX_IN_FLIGHT_PER_CONNECTION`] per pool
    /// connection with PostgreSQL, or [`MEMORY_MAX_IN_FLIGHT`] in memory or over a shared store.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.unwrap_or(match &self.store {
            StoreConfig::Memory | StoreConfig::Shared(_) => MEMORY_MAX_IN_FLIGHT,
            StoreConfig::Postgres { pool_size, .. } => pool_size
                .saturating_mul(MAX_IN_FLIGHT_PER_CONNECTION)
                .max(1),
        })
    }
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
            migration_url: None,
            statements: Statements::Prepared,
            retry: RetryPolicy::default(),
            limits: Limits::default(),
            shutdown_grace: Duration::from_secs(30),
            receipt_retention: Duration::from_secs(24 * 60 * 60),
            state_cache_entries: 100_000,
            state_cache_bytes: DEFAULT_STATE_CACHE_BYTES,
            max_scope_bytes: crate::engine::DEFAULT_MAX_SCOPE_BYTES,
            ttls: crate::store::Ttls::NONE,
            expiry_sweep_every: Duration::from_secs(60),
            auth_tokens: Vec::new(),
            auth_tokens_file: None,
            admin_tokens: Vec::new(),
            admin_tokens_file: None,
            tls: None,
            max_in_flight: None,
            connections: Connections::default(),
            remote_bots: RemoteBots::default(),
            serialized_bots: Vec::new(),
            double_text: Vec::new(),
            bot_scopes: Vec::new(),
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
    /// Ask a server for its gRPC health; exit 0 when it is serving, 1 otherwise (for `helm
    /// test`, container health checks and scripts).
    HealthCheck(HealthCheckArgs),
    /// Serve the Bot Framework endpoint (`POST /api/messages`) in front of a Turnstile server.
    Gateway(crate::gateway::GatewayArgs),
    /// Inspect the state a running server keeps, through its admin service (`get`, `ls`).
    State(crate::admin_cli::StateArgs),
}

/// `turnstile serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on for gRPC.
    #[arg(
        help_heading = "Listen",
        long,
        env = "TURNSTILE_LISTEN",
        default_value = "127.0.0.1:50051"
    )]
    pub listen: SocketAddr,
    /// Address to serve Prometheus metrics on (plain HTTP, `GET /metrics`); off when unset.
    #[arg(help_heading = "Listen", long, env = "TURNSTILE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Address of the gateway served in the same process (the chat page, Direct Line and
    /// `/api/messages`), with the channel credentials below when set, else unauthenticated and
    /// on loopback only; `off` serves gRPC only, as production does with `turnstile gateway`
    /// beside it.
    #[arg(
        help_heading = "Listen",
        long,
        env = "TURNSTILE_GATEWAY_LISTEN",
        default_value = "127.0.0.1:3978"
    )]
    pub gateway_listen: GatewayListen,
    /// PostgreSQL connection URL; without it, state is kept in memory (one replica only).
    #[arg(
        help_heading = "Database",
        long,
        env = "DATABASE_URL",
        hide_env_values = true
    )]
    pub database_url: Option<String>,
    /// File holding the PostgreSQL password, used when the database URL has none (a Kubernetes
    /// Secret mounted as a file): keeps it off the command line, which `ps` shows.
    #[arg(
        help_heading = "Database",
        long,
        env = "TURNSTILE_DATABASE_PASSWORD_FILE"
    )]
    pub database_password_file: Option<PathBuf>,
    /// The PostgreSQL schema of Turnstile's tables, created if missing; a database an older
    /// release laid out in `public` is moved into it by the migrations.
    #[arg(help_heading = "Database", long, env = "TURNSTILE_DATABASE_SCHEMA", default_value = "turnstile",
          value_parser = Schema::parse)]
    pub database_schema: Schema,
    /// Most PostgreSQL connections this replica opens.
    #[arg(
        help_heading = "Database",
        long,
        env = "TURNSTILE_POOL_SIZE",
        default_value_t = 16
    )]
    pub pool_size: usize,
    /// Group-commit statements this replica keeps in flight at once (default: 1, each carrying
    /// every commit that queued meanwhile, the next one sent behind it on its connection). Fewer
    /// put more turns in each statement, which costs the database less per turn; more overlap
    /// the round trips to a distant database.
    #[arg(help_heading = "Database", long, env = "TURNSTILE_COMMITS_IN_FLIGHT", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub commits_in_flight: Option<u16>,
    /// Apply pending migrations before serving (turn off when a migration job does it).
    #[arg(help_heading = "Database", long, env = "TURNSTILE_MIGRATE_ON_START", default_value_t = true, action = ArgAction::Set)]
    pub migrate_on_start: bool,
    /// PostgreSQL URL for the migrations on start, when `--database-url` goes through a pooler in
    /// transaction mode (migrations need a session); default: `--database-url`.
    #[arg(
        help_heading = "Database",
        long,
        env = "TURNSTILE_MIGRATION_DATABASE_URL",
        hide_env_values = true
    )]
    pub migration_database_url: Option<String>,
    /// Keep statements prepared on each connection (fastest); `false` behind PgBouncer in
    /// transaction mode, where no statement may outlive its transaction.
    #[arg(help_heading = "Database", long, env = "TURNSTILE_PREPARED_STATEMENTS", default_value_t = true, action = ArgAction::Set)]
    pub prepared_statements: bool,
    /// Largest activity accepted, in encoded bytes.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_MAX_ACTIVITY_BYTES", default_value_t = Limits::default().max_activity_bytes)]
    pub max_activity_bytes: usize,
    /// Longest `text`, `speak` or `summary` accepted, in bytes.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_MAX_TEXT_BYTES", default_value_t = Limits::default().max_text_bytes)]
    pub max_text_bytes: usize,
    /// Most bytes of all attachments of one activity.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_MAX_ATTACHMENTS_BYTES", default_value_t = Limits::default().max_attachments_bytes)]
    pub max_attachments_bytes: usize,
    /// Most bytes of an activity's `channel_data`.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_MAX_CHANNEL_DATA_BYTES", default_value_t = Limits::default().max_channel_data_bytes)]
    pub max_channel_data_bytes: usize,
    /// Deepest nesting of any JSON value in an activity.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_MAX_JSON_DEPTH", default_value_t = Limits::default().max_json_depth)]
    pub max_json_depth: usize,
    /// Largest state a bot may write to one scope (conversation, user, private conversation),
    /// in bytes of JSON text: a turn that would write more fails with `FAILED_PRECONDITION`
    /// `STATE_TOO_LARGE`, nothing committed.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_MAX_SCOPE_BYTES", default_value_t = crate::engine::DEFAULT_MAX_SCOPE_BYTES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_scope_bytes: usize,
    /// How long a conversation's state lives unwritten (`30d`, `12h`, `90m`, `45s`): after that
    /// it reads as absent, and a sweep deletes it. Never, unless set.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_CONVERSATION_TTL", value_parser = parse_ttl)]
    pub conversation_ttl: Option<Duration>,
    /// How long a user's state lives unwritten, as `--conversation-ttl`.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_USER_TTL", value_parser = parse_ttl)]
    pub user_ttl: Option<Duration>,
    /// How long a user's private state in a conversation lives unwritten, as
    /// `--conversation-ttl`.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_PRIVATE_CONVERSATION_TTL", value_parser = parse_ttl)]
    pub private_conversation_ttl: Option<Duration>,
    /// Most turns in flight; beyond it calls are refused at once with RESOURCE_EXHAUSTED.
    /// Default: 32 per pool connection with PostgreSQL, 1024 in memory.
    #[arg(help_heading = "Limits", long, env = "TURNSTILE_MAX_IN_FLIGHT",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_in_flight: Option<u64>,
    /// File of bearer tokens, one per line; when any token is configured, every `TurnService`
    /// call needs `authorization: Bearer <token>` (health and reflection stay open).
    #[arg(help_heading = "Security", long, env = "TURNSTILE_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,
    /// Bearer tokens, comma-separated; prefer the environment variable or the file, since
    /// command lines are visible to other local users.
    #[arg(
        help_heading = "Security",
        long,
        env = "TURNSTILE_AUTH_TOKENS",
        hide_env_values = true
    )]
    pub auth_tokens: Option<String>,
    /// File of admin bearer tokens, one per line: turns the admin service on (`AdminService`:
    /// inspect state, list conversations), for callers presenting one of them. Keep them apart
    /// from the `TurnService` tokens.
    #[arg(help_heading = "Security", long, env = "TURNSTILE_ADMIN_TOKENS_FILE")]
    pub admin_tokens_file: Option<PathBuf>,
    /// Admin bearer tokens, comma-separated; prefer the environment variable or the file.
    #[arg(
        help_heading = "Security",
        long,
        env = "TURNSTILE_ADMIN_TOKENS",
        hide_env_values = true
    )]
    pub admin_tokens: Option<String>,
    /// PEM certificate chain for TLS on the gRPC port (with `--tls-key`); plaintext without.
    #[arg(
        help_heading = "Security",
        long,
        env = "TURNSTILE_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(
        help_heading = "Security",
        long,
        env = "TURNSTILE_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) client certificates must chain to: turns on mutual TLS.
    #[arg(
        help_heading = "Security",
        long,
        env = "TURNSTILE_TLS_CLIENT_CA",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve the embedded gateway on an address other than loopback without `MicrosoftAppId`:
    /// every call is then accepted unauthenticated, by anyone who reaches it.
    #[arg(help_heading = "Security", long, env = "TURNSTILE_GATEWAY_INSECURE")]
    pub gateway_insecure: bool,
    /// The embedded gateway's channel credentials, read as `turnstile gateway` reads them and
    /// enforced when set.
    #[command(flatten)]
    pub channel: crate::gateway::ChannelArgs,
    /// Bots whose turns hold the conversation lock from their first attempt (comma-separated
    /// names): no run of theirs is wasted on a conflict, but each holds a pooled connection while
    /// it runs. The others lock only after a conflict.
    #[arg(
        help_heading = "Bots",
        long,
        env = "TURNSTILE_SERIALIZED_BOTS",
        value_delimiter = ','
    )]
    pub serialized_bots: Vec<String>,
    /// What happens to a message that arrives while a turn of its conversation runs, per bot:
    /// `BOT=POLICY`, comma-separated; `enqueue` (the default: it waits, then runs), `reject`
    /// (refused at once with `CONVERSATION_BUSY`, nothing committed), `interrupt` (the running
    /// turn is cancelled and the new one runs with it handed on) or `coalesce` (the messages
    /// arriving meanwhile are answered together by one run). The same on every replica.
    #[arg(
        help_heading = "Bots",
        long,
        env = "TURNSTILE_DOUBLE_TEXT",
        value_delimiter = ',',
        value_name = "BOT=POLICY",
        value_parser = parse_double_text
    )]
    pub double_text: Vec<(String, crate::bot::DoubleText)>,
    /// The state scopes of a bot that cannot declare them itself (a bot worker's), per bot:
    /// `BOT=SCOPES`, comma-separated, the scopes `conversation`, `user` and
    /// `private-conversation` joined by `+` (`counter-py=conversation`). A scope left out is not
    /// loaded for the bot's turns, and its worker is sent none. Unnamed bots keep the scopes they
    /// declare: every scope, for a worker's.
    #[arg(
        help_heading = "Bots",
        long,
        env = "TURNSTILE_BOT_SCOPES",
        value_delimiter = ',',
        value_name = "BOT=SCOPES",
        value_parser = parse_bot_scopes
    )]
    pub bot_scopes: Vec<(String, crate::bot::Scopes)>,
    /// How long every run of the `slow` sample bot takes, in milliseconds.
    #[arg(
        help_heading = "Bots",
        long,
        env = "TURNSTILE_SLOW_BOT_DELAY_MS",
        default_value_t = 200
    )]
    pub slow_bot_delay_ms: u64,
    /// How long the `llm` sample bot takes per word it streams, in milliseconds.
    #[arg(
        help_heading = "Bots",
        long,
        env = "TURNSTILE_LLM_TOKEN_DELAY_MS",
        default_value_t = 50
    )]
    pub llm_token_delay_ms: u64,
    /// A bot served by a bot worker, as `NAME=URL` (`pizza-py=http://pizza-worker:50061`);
    /// repeatable, comma-separated in the environment. It replaces a built-in bot of that name.
    #[arg(
        help_heading = "Bots",
        long = "remote-bot",
        env = "TURNSTILE_REMOTE_BOTS",
        value_delimiter = ',',
        value_name = "NAME=URL"
    )]
    pub remote_bots: Vec<RemoteBotSpec>,
    /// The bot the embedded gateway's chat page, Direct Line and `/api/messages` talk to: any
    /// hosted bot, a bot worker's (`--remote-bot`) included; empty: the default bot (`pizza`).
    #[arg(
        help_heading = "Bots",
        long,
        env = "TURNSTILE_GATEWAY_BOT",
        default_value = "",
        value_name = "NAME"
    )]
    pub gateway_bot: String,
    /// Bearer token sent to every bot worker (`authorization: Bearer <token>`).
    #[arg(
        help_heading = "Bots",
        long,
        env = "TURNSTILE_REMOTE_BOT_TOKEN",
        hide_env_values = true
    )]
    pub remote_bot_token: Option<String>,
    /// PEM CA certificate(s) that `https` bot workers' certificates must chain to.
    #[arg(help_heading = "Bots", long, env = "TURNSTILE_REMOTE_BOT_CA")]
    pub remote_bot_ca: Option<PathBuf>,
    /// Most times the bot runs for one turn before the call fails with ABORTED.
    #[arg(help_heading = "Tuning", long, env = "TURNSTILE_MAX_ATTEMPTS", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,
    /// Cap of the first backoff wait after a conflict, in milliseconds (doubles per attempt).
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_BACKOFF_BASE_MS",
        default_value_t = 2
    )]
    pub backoff_base_ms: u64,
    /// Cap of any backoff wait, in milliseconds.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_BACKOFF_MAX_MS",
        default_value_t = 200
    )]
    pub backoff_max_ms: u64,
    /// Seconds in-flight turns get to finish after SIGTERM or SIGINT.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_SHUTDOWN_GRACE_SECS",
        default_value_t = 30
    )]
    pub shutdown_grace_secs: u64,
    /// Seconds a turn's receipt is kept: a redelivered activity within this time gets the stored
    /// answer instead of running again.
    #[arg(help_heading = "Tuning", long, env = "TURNSTILE_RECEIPT_RETENTION_SECS", default_value_t = 24 * 60 * 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub receipt_retention_secs: u64,
    /// Seconds between two sweeps of expired state by this replica, each through every key in
    /// batches of 1,000 (only with a TTL set).
    #[arg(help_heading = "Tuning", long, env = "TURNSTILE_EXPIRY_SWEEP_SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub expiry_sweep_secs: u64,
    /// Keys whose last committed state this replica remembers, so that a conversation's next
    /// turn here skips the load (one database round trip instead of two); 0 turns it off.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_STATE_CACHE_ENTRIES",
        default_value_t = 100_000
    )]
    pub state_cache_entries: usize,
    /// Bytes of memory the states this replica remembers may hold, at most (their JSON values
    /// and keys, counted as held in memory); 0 turns the cache off. Keep it well under the
    /// process's memory limit: the chart's default limit, 256 MiB, holds the default.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_STATE_CACHE_BYTES",
        default_value_t = DEFAULT_STATE_CACHE_BYTES
    )]
    pub state_cache_bytes: usize,
    /// Seconds after which a client connection is told to go away (GOAWAY) and the client
    /// reconnects, so that new replicas get traffic; 0: never.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_MAX_CONNECTION_AGE_SECS",
        default_value_t = 300
    )]
    pub max_connection_age_secs: u64,
    /// Seconds calls in flight on an aged connection get before it is closed; 0: no limit.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_MAX_CONNECTION_AGE_GRACE_SECS",
        default_value_t = 30
    )]
    pub max_connection_age_grace_secs: u64,
    /// Seconds between HTTP/2 keepalive pings from the server; 0: no pings.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_HTTP2_KEEPALIVE_INTERVAL_SECS",
        default_value_t = 60
    )]
    pub http2_keepalive_interval_secs: u64,
    /// Seconds a keepalive ping may go unanswered before the connection is closed.
    #[arg(help_heading = "Tuning", long, env = "TURNSTILE_HTTP2_KEEPALIVE_TIMEOUT_SECS", default_value_t = 20,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub http2_keepalive_timeout_secs: u64,
    /// Calls one client connection may carry at once (HTTP/2 MAX_CONCURRENT_STREAMS); a client
    /// past it waits for one of its calls to end; 0: no limit.
    #[arg(
        help_heading = "Tuning",
        long,
        env = "TURNSTILE_MAX_CONCURRENT_STREAMS",
        default_value_t = DEFAULT_MAX_CONCURRENT_STREAMS
    )]
    pub max_concurrent_streams: u32,
}

/// Where `serve` runs its embedded gateway, if anywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayListen {
    /// No embedded gateway.
    Off,
    /// The gateway's address.
    At(SocketAddr),
}

impl std::str::FromStr for GatewayListen {
    type Err = std::net::AddrParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "" | "off" => Ok(Self::Off),
            address => address.parse().map(Self::At),
        }
    }
}

/// A time to live as operators write it: `30d`, `12h`, `90m`, `45s`, `1h 30m`; at least a
/// second.
fn parse_ttl(value: &str) -> Result<Duration, String> {
    let ttl = humantime::parse_duration(value.trim())
        .map_err(|e| format!("`{value}` is not a duration such as 30d, 12h, 90m or 45s ({e})"))?;
    if ttl < Duration::from_secs(1) {
        return Err(format!("`{value}` is under a second"));
    }
    Ok(ttl)
}

/// `BOT=POLICY`, as `--double-text` takes it.
fn parse_double_text(value: &str) -> Result<(String, crate::bot::DoubleText), String> {
    per_bot(value, "BOT=POLICY", "llm=reject")
}

/// `BOT=SCOPES`, as `--bot-scopes` takes it.
fn parse_bot_scopes(value: &str) -> Result<(String, crate::bot::Scopes), String> {
    per_bot(value, "BOT=SCOPES", "counter-py=conversation")
}

/// A per-bot setting's `BOT=VALUE` (`form`, as in `example`), its value parsed as a `T`.
fn per_bot<T: std::str::FromStr<Err = String>>(
    value: &str,
    form: &str,
    example: &str,
) -> Result<(String, T), String> {
    let (bot, setting) = value
        .split_once('=')
        .ok_or_else(|| format!("`{value}` is not {form} (for example `{example}`)"))?;
    let bot = bot.trim();
    if bot.is_empty() {
        return Err(format!("`{value}` names no bot"));
    }
    Ok((bot.to_owned(), setting.parse()?))
}

impl ServeArgs {
    /// The configuration these arguments describe.
    pub fn config(&self) -> Config {
        Config {
            store: self.store(),
            migrate_on_start: self.migrate_on_start,
            migration_url: self
                .migration_database_url
                .as_ref()
                .map(|url| self.database(url)),
            statements: if self.prepared_statements {
                Statements::Prepared
            } else {
                Statements::Unprepared
            },
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
            state_cache_bytes: self.state_cache_bytes,
            max_scope_bytes: self.max_scope_bytes,
            ttls: crate::store::Ttls {
                conversation: self.conversation_ttl,
                user: self.user_ttl,
                private_conversation: self.private_conversation_ttl,
            },
            expiry_sweep_every: Duration::from_secs(self.expiry_sweep_secs),
            auth_tokens: self
                .auth_tokens
                .as_deref()
                .map(|t| auth::parse_tokens(t, ','))
                .unwrap_or_default(),
            auth_tokens_file: self.auth_tokens_file.clone(),
            admin_tokens: self
                .admin_tokens
                .as_deref()
                .map(|t| auth::parse_tokens(t, ','))
                .unwrap_or_default(),
            admin_tokens_file: self.admin_tokens_file.clone(),
            tls: self.tls(),
            max_in_flight: self
                .max_in_flight
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            connections: self.connections(),
            remote_bots: RemoteBots {
                bots: self.remote_bots.clone(),
                token: self.remote_bot_token.clone().map(SecretString::from),
                ca: self.remote_bot_ca.clone(),
            },
            serialized_bots: self
                .serialized_bots
                .iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect(),
            double_text: self.double_text.clone(),
            bot_scopes: self.bot_scopes.clone(),
        }
    }

    /// Where state is kept: PostgreSQL when a URL is given, else this process's memory.
    fn store(&self) -> StoreConfig {
        match &self.database_url {
            Some(url) => StoreConfig::Postgres {
                url: self.database(url),
                pool_size: self.pool_size,
                commits_in_flight: self.commits_in_flight.map(usize::from),
            },
            None => StoreConfig::Memory,
        }
    }

    /// The database at `url`, with these arguments' password file and schema.
    fn database(&self, url: &str) -> DatabaseUrl {
        DatabaseUrl::new(url.to_owned())
            .with_password_file(self.database_password_file.clone())
            .with_schema(self.database_schema.clone())
    }

    /// The server's TLS files, when both a certificate and a key are given.
    fn tls(&self) -> Option<TlsFiles> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            _ => None,
        }
    }

    /// How long client connections live, and their keepalives.
    fn connections(&self) -> Connections {
        Connections {
            max_age: seconds_or_off(self.max_connection_age_secs),
            max_age_grace: seconds_or_off(self.max_connection_age_grace_secs),
            keepalive_interval: seconds_or_off(self.http2_keepalive_interval_secs),
            keepalive_timeout: Duration::from_secs(self.http2_keepalive_timeout_secs),
            max_streams: Some(self.max_concurrent_streams).filter(|&n| n > 0),
        }
    }
}

impl ServeArgs {
    /// The sample bots (see [`crate::bots::samples`]) as these arguments configure them.
    pub fn bots(&self) -> crate::bot::BotRegistry {
        let slow = crate::bots::SlowBot::new(Duration::from_millis(self.slow_bot_delay_ms));
        let llm = crate::bots::LlmBot::new(Duration::from_millis(self.llm_token_delay_ms));
        crate::bots::samples().with("slow", slow).with("llm", llm)
    }
}

impl ServeArgs {
    /// The embedded gateway's configuration, for a server whose gRPC listener is at `grpc`,
    /// checked against where it is to listen: the channel credentials, when set, are enforced
    /// as `turnstile gateway` enforces them; without them it serves loopback only (unless
    /// `--gateway-insecure`).
    ///
    /// # Errors
    /// [`crate::gateway::ConfigError`] for incomplete credentials, or an address beyond loopback
    /// without them.
    pub fn embedded_gateway(
        &self,
        grpc: SocketAddr,
        listen: SocketAddr,
    ) -> Result<crate::gateway::GatewayConfig, crate::gateway::ConfigError> {
        let bot = self.gateway_bot.trim();
        if !bot.is_empty() {
            let local = self.bots();
            let hosted: Vec<String> = local
                .names()
                .map(str::to_owned)
                .chain(self.remote_bots.iter().map(|r| r.name().to_owned()))
                .collect();
            if !hosted.iter().any(|name| name == bot) {
                return Err(crate::gateway::ConfigError::UnknownBot {
                    name: bot.to_owned(),
                    hosted: hosted.join(", "),
                });
            }
        }
        let config = crate::gateway::GatewayConfig {
            bot: bot.to_owned(),
            credentials: self.channel.credentials()?,
            direct_line_secrets: self.channel.direct_line_secrets(),
            busy_text: self.channel.busy_text.clone(),
            superseded_text: self.channel.superseded_text.clone(),
            // Its background turns get the same grace as the server's turns.
            shutdown_grace: Duration::from_secs(self.shutdown_grace_secs),
            ..crate::gateway::GatewayConfig::embedded(grpc)
        };
        config.check_exposure(listen, self.gateway_insecure, "--gateway-insecure")?;
        Ok(config)
    }
}

/// `secs` seconds, or `None` for 0 (off).
fn seconds_or_off(secs: u64) -> Option<Duration> {
    (secs > 0).then(|| Duration::from_secs(secs))
}

/// `turnstile migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// PostgreSQL connection URL: straight to PostgreSQL, not through a pooler in transaction
    /// mode (migrations need a session).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// File holding the PostgreSQL password, used when the URL has none.
    #[arg(long, env = "TURNSTILE_DATABASE_PASSWORD_FILE")]
    pub database_password_file: Option<PathBuf>,
    /// The PostgreSQL schema of Turnstile's tables (as `serve`'s).
    #[arg(long, env = "TURNSTILE_DATABASE_SCHEMA", default_value = "turnstile", value_parser = Schema::parse)]
    pub database_schema: Schema,
    /// Instead of migrating, remove the views and the function a migration from 0.1.0 left in
    /// `public` for that release's replicas: run once none of them is left.
    #[arg(long)]
    pub drop_compat: bool,
    /// Lay the tables out for Citus, and fail if the database has no `citus` extension. Without
    /// it, a database with the extension (a Citus coordinator) is laid out for Citus all the
    /// same, and one without stays a single PostgreSQL.
    #[arg(long, conflicts_with = "drop_compat")]
    pub citus: bool,
}

impl MigrateArgs {
    /// The database these arguments name.
    pub fn database_url(&self) -> DatabaseUrl {
        DatabaseUrl::new(self.database_url.clone())
            .with_password_file(self.database_password_file.clone())
            .with_schema(self.database_schema.clone())
    }
}

/// `turnstile health-check`.
#[derive(Debug, Clone, Args)]
pub struct HealthCheckArgs {
    /// The server: `http://host:port` for plaintext, `https://host:port` for TLS.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub address: String,
    /// The service whose health is asked (`turnstile.v1.TurnService`); empty asks for the
    /// server as a whole.
    #[arg(long, default_value = "")]
    pub service: String,
    /// Seconds the whole check may take, connecting included.
    #[arg(long, default_value_t = 5)]
    pub timeout_secs: u64,
    /// PEM CA certificate(s) the server's certificate must chain to (needed for `https`).
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// The name the server's certificate carries, when it differs from the address's host.
    #[arg(long)]
    pub tls_domain: Option<String>,
    /// PEM client certificate, for a server that requires mutual TLS (with `--key`).
    #[arg(long, requires = "key")]
    pub cert: Option<PathBuf>,
    /// PEM private key of `--cert`.
    #[arg(long, requires = "cert")]
    pub key: Option<PathBuf>,
}

impl HealthCheckArgs {
    /// The probe these arguments describe.
    pub fn probe(&self) -> crate::probe::Probe {
        crate::probe::Probe {
            address: self.address.clone(),
            service: self.service.clone(),
            timeout: Duration::from_secs(self.timeout_secs),
            ca_cert: self.ca_cert.clone(),
            tls_domain: self.tls_domain.clone(),
            client_identity: self.cert.clone().zip(self.key.clone()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::Parser as _;

    use super::{Cli, Command};
    use crate::store::postgres::Statements;

    fn serve_config(args: &[&str]) -> super::Config {
        let cli = Cli::try_parse_from(args).unwrap();
        match cli.command {
            Some(Command::Serve(args)) => args.config(),
            _ => cli.serve.config(),
        }
    }

    #[test]
    fn statements_are_prepared_unless_told_otherwise() {
        let config = serve_config(&["turnstile", "--database-url", "postgres://h/db"]);
        assert_eq!(config.statements, Statements::Prepared);
        assert!(config.migration_url.is_none());

        let config = serve_config(&[
            "turnstile",
            "serve",
            "--database-url",
            "postgres://pooler/db",
            "--prepared-statements",
            "false",
            "--migration-database-url",
            "postgres://primary/db",
        ]);
        assert_eq!(config.statements, Statements::Unprepared);
        assert!(config.migration_url.is_some());
    }
}

#[cfg(test)]
mod server_flags {
    use super::*;

    fn serve_config(args: &[&str]) -> Config {
        let cli = Cli::try_parse_from(std::iter::once("turnstile").chain(args.iter().copied()))
            .expect("valid arguments");
        cli.serve.config()
    }

    #[test]
    fn connection_flags_default_and_zero_turns_them_off() {
        let defaults = serve_config(&[]);
        assert_eq!(defaults.connections, Connections::default());
        assert_eq!(defaults.connections.max_age, Some(Duration::from_secs(300)));
        let off = serve_config(&[
            "--max-connection-age-secs",
            "0",
            "--max-connection-age-grace-secs",
            "0",
            "--http2-keepalive-interval-secs",
            "0",
            "--max-concurrent-streams",
            "0",
        ]);
        assert_eq!(
            defaults.connections.max_streams,
            Some(DEFAULT_MAX_CONCURRENT_STREAMS)
        );
        assert_eq!(off.connections.max_streams, None);
        assert_eq!(off.connections.max_age, None);
        assert_eq!(off.connections.max_age_grace, None);
        assert_eq!(off.connections.keepalive_interval, None);
        assert!(Cli::try_parse_from(["turnstile", "--http2-keepalive-timeout-secs", "0"]).is_err());
    }

    #[test]
    fn commits_in_flight_are_bounded() {
        let cli = Cli::try_parse_from(["turnstile", "--commits-in-flight", "1"]).expect("parses");
        assert_eq!(cli.serve.commits_in_flight, Some(1));
        for bad in ["0", "65", "many"] {
            let err = Cli::try_parse_from(["turnstile", "--commits-in-flight", bad])
                .expect_err(bad)
                .to_string();
            assert!(err.contains("--commits-in-flight"), "{err}");
        }
    }

    #[test]
    fn serialized_bots_are_named_and_checked() {
        let cli = Cli::try_parse_from(["turnstile", "--serialized-bots", "slow,pizza"])
            .expect("valid arguments");
        let bots = crate::server::with_policies(cli.serve.bots(), &cli.serve.config())
            .expect("hosted bots");
        for name in ["slow", "pizza"] {
            assert_eq!(bots.policy(name), crate::bot::ConcurrencyPolicy::Serialized);
        }
        assert_eq!(
            bots.policy("counter"),
            crate::bot::ConcurrencyPolicy::Optimistic
        );
        let cli = Cli::try_parse_from(["turnstile", "--serialized-bots", "nobody"])
            .expect("valid arguments");
        assert!(
            crate::server::with_policies(cli.serve.bots(), &cli.serve.config()).is_err(),
            "an unknown bot is refused"
        );
    }

    #[test]
    fn the_database_schema_defaults_to_turnstile_and_refuses_what_is_not_a_plain_name() {
        let cli = Cli::try_parse_from(["turnstile", "--database-url", "postgres://db/x"])
            .expect("valid arguments");
        let StoreConfig::Postgres { url, .. } = cli.serve.config().store else {
            panic!("a PostgreSQL store");
        };
        assert_eq!(url.schema().as_str(), "turnstile");
        for bad in [
            "",
            "Turnstile",
            "turn-stile",
            "1st",
            "pg_catalog",
            "a;drop",
            "x y",
        ] {
            let err = Cli::try_parse_from(["turnstile", "--database-schema", bad])
                .expect_err("refused")
                .to_string();
            assert!(err.contains("--database-schema"), "{bad}: {err}");
        }
        let cli = Cli::try_parse_from([
            "turnstile",
            "migrate",
            "--database-url",
            "postgres://db/x",
            "--database-schema",
            "bots_state",
        ])
        .expect("valid arguments");
        let Some(Command::Migrate(args)) = cli.command else {
            panic!("migrate");
        };
        assert_eq!(args.database_url().schema().as_str(), "bots_state");
    }

    #[test]
    fn times_to_live_are_off_by_default_and_malformed_ones_are_refused_naming_the_flag() {
        let cli = Cli::try_parse_from(["turnstile"]).expect("valid arguments");
        assert!(!cli.serve.config().ttls.any());
        let cli = Cli::try_parse_from([
            "turnstile",
            "--conversation-ttl",
            "30d",
            "--user-ttl",
            "400d",
            "--private-conversation-ttl",
            "1h 30m",
        ])
        .expect("valid arguments");
        let ttls = cli.serve.config().ttls;
        assert_eq!(ttls.conversation, Some(Duration::from_secs(30 * 86_400)));
        assert_eq!(ttls.user, Some(Duration::from_secs(400 * 86_400)));
        assert_eq!(ttls.private_conversation, Some(Duration::from_secs(5_400)));
        for (flag, value) in [
            ("--conversation-ttl", "30"),
            ("--user-ttl", "forever"),
            ("--private-conversation-ttl", "500ms"),
            ("--conversation-ttl", ""),
            ("--conversation-ttl", "1 fortnight"),
        ] {
            let err = Cli::try_parse_from(["turnstile", flag, value])
                .expect_err("refused")
                .to_string();
            assert!(err.contains(flag), "{value}: {err}");
            assert!(
                err.contains("30d") || err.contains("under a second"),
                "{value}: {err}"
            );
        }
    }

    #[test]
    fn the_scope_size_limit_defaults_to_256_kib_and_refuses_nonsense() {
        let cli = Cli::try_parse_from(["turnstile"]).expect("valid arguments");
        assert_eq!(cli.serve.config().max_scope_bytes, 256 << 10);
        assert_eq!(cli.serve.config().state_cache_bytes, 64 << 20);
        let cli = Cli::try_parse_from(["turnstile", "--max-scope-bytes", "1000"])
            .expect("valid arguments");
        assert_eq!(cli.serve.config().max_scope_bytes, 1000);
        for value in ["0", "256k", "", "18446744073709551616"] {
            let err = Cli::try_parse_from(["turnstile", "--max-scope-bytes", value])
                .expect_err("refused")
                .to_string();
            assert!(err.contains("--max-scope-bytes"), "{value}: {err}");
        }
    }

    #[test]
    fn double_text_policies_are_parsed_named_and_checked() {
        use crate::bot::DoubleText;
        let cli = Cli::try_parse_from([
            "turnstile",
            "--double-text",
            "slow=reject, llm=interrupt, subtract=coalesce, counter=enqueue",
        ])
        .expect("valid arguments");
        let bots = crate::server::with_policies(cli.serve.bots(), &cli.serve.config())
            .expect("hosted bots");
        assert_eq!(bots.double_text("slow"), DoubleText::Reject);
        assert_eq!(bots.double_text("llm"), DoubleText::Interrupt);
        assert_eq!(bots.double_text("subtract"), DoubleText::Coalesce);
        assert_eq!(bots.double_text("counter"), DoubleText::Enqueue);
        assert_eq!(bots.double_text("pizza"), DoubleText::Enqueue);
        for (value, says) in [
            ("slow=maybe", "unknown double-text policy `maybe`"),
            ("slow", "is not BOT=POLICY"),
            ("=reject", "names no bot"),
            (
                "slow=Coalesce",
                "one of: enqueue, reject, interrupt, coalesce",
            ),
        ] {
            let err = refused("--double-text", value);
            assert!(err.contains(says), "{value}: {err}");
        }
        let err = refused_at_start("--double-text", "nobody=reject");
        assert!(err.contains("nobody"), "{err}");
    }

    /// Why the arguments `flag value` are refused.
    fn refused(flag: &str, value: &str) -> String {
        Cli::try_parse_from(["turnstile", flag, value])
            .expect_err("refused")
            .to_string()
    }

    /// Why a server started with `flag value` (parsed) refuses its bots.
    fn refused_at_start(flag: &str, value: &str) -> String {
        let cli = Cli::try_parse_from(["turnstile", flag, value]).expect("valid arguments");
        crate::server::with_policies(cli.serve.bots(), &cli.serve.config())
            .expect_err("an unknown bot is refused")
            .to_string()
    }

    #[test]
    fn bot_scopes_are_parsed_named_and_checked() {
        use crate::bot::Scopes;
        use crate::state::Scope;
        let cli = Cli::try_parse_from([
            "turnstile",
            "--bot-scopes",
            "waterfall=conversation, subtract=conversation+user, \
             llm=private-conversation + conversation",
        ])
        .expect("valid arguments");
        let bots = crate::server::with_policies(cli.serve.bots(), &cli.serve.config())
            .expect("hosted bots");
        let scopes = |name: &str| bots.get(Some(name)).expect("hosted").1.scopes();
        assert_eq!(scopes("waterfall"), Scopes::CONVERSATION);
        assert_eq!(
            scopes("subtract"),
            Scopes {
                user: true,
                private_conversation: false
            }
        );
        assert!(scopes("llm").has(Scope::PrivateConversation) && !scopes("llm").has(Scope::User));
        assert_eq!(
            scopes("user-state"),
            Scopes::ALL,
            "an unnamed bot keeps its own"
        );
        for (value, says) in [
            ("pizza=user", "leaves out `conversation`"),
            ("pizza=conversation+users", "`users` is not a scope"),
            ("pizza", "is not BOT=SCOPES"),
            ("=conversation", "names no bot"),
        ] {
            let err = refused("--bot-scopes", value);
            assert!(err.contains(says), "{value}: {err}");
        }
        let err = refused_at_start("--bot-scopes", "nobody=conversation");
        assert!(
            err.contains("--bot-scopes") && err.contains("nobody"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_remote_bot_can_be_serialized() {
        let cli = Cli::try_parse_from([
            "turnstile",
            "--remote-bot",
            "pizza-py=http://127.0.0.1:50061",
            "--serialized-bots",
            "pizza-py",
        ])
        .expect("valid arguments");
        let config = cli.serve.config();
        let bots = config
            .remote_bots
            .register(cli.serve.bots())
            .expect("remote bots");
        let bots = crate::server::with_policies(bots, &config).expect("a hosted bot");
        assert_eq!(
            bots.policy("pizza-py"),
            crate::bot::ConcurrencyPolicy::Serialized
        );
    }

    #[test]
    fn the_embedded_gateway_listens_on_loopback_unless_moved_or_off() {
        let at = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("turnstile").chain(args.iter().copied()))
                .expect("valid arguments")
                .serve
                .gateway_listen
        };
        assert_eq!(
            at(&[]),
            GatewayListen::At("127.0.0.1:3978".parse().expect("address"))
        );
        assert_eq!(at(&["--gateway-listen", "off"]), GatewayListen::Off);
        assert_eq!(at(&["--gateway-listen", ""]), GatewayListen::Off);
        assert_eq!(
            at(&["--gateway-listen", "0.0.0.0:80"]),
            GatewayListen::At("0.0.0.0:80".parse().expect("address"))
        );
        assert!(Cli::try_parse_from(["turnstile", "--gateway-listen", "nowhere"]).is_err());
    }

    #[test]
    fn the_gateway_bot_may_be_any_hosted_bot_a_workers_included() {
        let grpc: SocketAddr = "127.0.0.1:50051".parse().expect("address");
        let listen: SocketAddr = "127.0.0.1:3978".parse().expect("address");
        let args = |extra: &[&str]| {
            Cli::try_parse_from(std::iter::once("turnstile").chain(extra.iter().copied()))
                .expect("valid arguments")
                .serve
        };
        let default = args(&[])
            .embedded_gateway(grpc, listen)
            .expect("the default");
        assert_eq!(default.bot, "");
        let counter = args(&["--gateway-bot", "counter"])
            .embedded_gateway(grpc, listen)
            .expect("a sample bot");
        assert_eq!(counter.bot, "counter");
        let worker = args(&[
            "--remote-bot",
            "pizza-py=http://127.0.0.1:50061",
            "--gateway-bot",
            "pizza-py",
        ])
        .embedded_gateway(grpc, listen)
        .expect("a worker's bot");
        assert_eq!(worker.bot, "pizza-py");
        let unknown = args(&["--gateway-bot", "pizza-py"])
            .embedded_gateway(grpc, listen)
            .expect_err("no such worker")
            .to_string();
        assert!(unknown.contains("`pizza-py` is not hosted"), "{unknown}");
    }

    #[test]
    fn the_in_flight_limit_is_derived_from_the_pool_unless_set() {
        assert_eq!(serve_config(&[]).max_in_flight(), MEMORY_MAX_IN_FLIGHT);
        let pooled = serve_config(&["--database-url", "postgres://x/y", "--pool-size", "16"]);
        assert_eq!(pooled.max_in_flight(), 16 * MAX_IN_FLIGHT_PER_CONNECTION);
        let set = serve_config(&["--database-url", "postgres://x/y", "--max-in-flight", "8"]);
        assert_eq!(set.max_in_flight(), 8);
        assert!(Cli::try_parse_from(["turnstile", "--max-in-flight", "0"]).is_err());
    }

    #[test]
    fn remote_bots_are_parsed_at_startup_naming_the_flag() {
        let config = serve_config(&[
            "--remote-bot",
            "pizza-py=http://pizza-worker:50061",
            "--remote-bot",
            "a=http://h:1,b=https://h:2",
        ]);
        let names: Vec<&str> = config.remote_bots.bots.iter().map(|b| b.name()).collect();
        assert_eq!(names, ["pizza-py", "a", "b"]);
        assert!(config.remote_bots.token.is_none());
        let err = Cli::try_parse_from(["turnstile", "--remote-bot", "pizza=pizza-worker:50061"])
            .expect_err("no scheme")
            .to_string();
        assert!(err.contains("--remote-bot"), "{err}");
        assert!(err.contains("http://host:port"), "{err}");
    }
}

#[cfg(test)]
mod help {
    use clap::CommandFactory as _;

    use super::Cli;

    /// The headings of `--help`, in order, and the flags under "Options" (none but help and
    /// version: every setting belongs to a group).
    fn headings(command: &mut clap::Command) -> (Vec<String>, Vec<String>) {
        let help = command.render_long_help().to_string();
        let mut headings = Vec::new();
        let mut ungrouped = Vec::new();
        let mut in_options = false;
        for line in help.lines() {
            if !line.starts_with(' ') && line.ends_with(':') {
                let heading = line.trim_end_matches(':').to_owned();
                in_options = heading == "Options";
                headings.push(heading);
            } else if in_options
                && line.trim_start().starts_with('-')
                && let Some((_, flag)) = line.split_once("--")
            {
                ungrouped.push(flag.split_whitespace().next().unwrap_or("").to_owned());
            }
        }
        (headings, ungrouped)
    }

    #[test]
    fn serve_groups_its_settings_under_headings() {
        let (headings, ungrouped) = headings(&mut Cli::command());
        let expected = [
            "Listen",
            "Database",
            "Limits",
            "Security",
            "Channel credentials (Bot Framework's names)",
            "Bots",
            "Tuning",
        ];
        let found: Vec<&str> = headings
            .iter()
            .map(String::as_str)
            .filter(|h| expected.contains(h))
            .collect();
        assert_eq!(found, expected, "{headings:?}");
        assert_eq!(ungrouped, ["help", "version"], "flags with no heading");
    }

    #[test]
    fn the_gateway_groups_its_settings_under_headings() {
        let mut cli = Cli::command();
        let gateway = cli
            .find_subcommand_mut("gateway")
            .expect("the gateway subcommand");
        let (headings, ungrouped) = headings(gateway);
        for heading in [
            "Listen",
            "Turnstile server",
            "Limits",
            "Security",
            "Channel credentials (Bot Framework's names)",
        ] {
            assert!(headings.iter().any(|h| h == heading), "{headings:?}");
        }
        assert_eq!(ungrouped, ["help"], "flags with no heading");
    }
}
