//! Turnstile processes chat-bot turns for channel gateways over gRPC, with optimistic concurrency
//! over PostgreSQL: a bot's replies leave only after its state change committed, and a turn that
//! lost a race with another replica is replayed on the fresh state.
//!
//! # Layout
//! One turn flows in a straight line: [`grpc`] (decode, validate) → [`engine`] (load → run the bot
//! with sends buffered → conditional commit → replay on conflict) → [`store`] (memory | postgres).
//!
//! - [`activity`] — the Bot Framework Activity domain type, its JSON form, and inbound validation.
//! - [`state`] — state scopes, their escaped keys, and the typed property bag bots use.
//! - [`store`] — the versioned store trait and its memory and PostgreSQL implementations.
//! - [`bot`] — the trait a bot implements and the turn context it works through.
//! - [`engine`] — the turn loop with buffering, bounded replay and backoff.
//! - [`dialogs`] — Bot Framework's dialog model: dialog sets and stacks, waterfalls, components,
//!   prompts.
//! - [`bots`] — the sample bots the binary hosts.
//! - [`gateway`] — `turnstile gateway`: the Bot Framework channel protocol (`/api/messages`,
//!   channel JWTs, delivery to the Connector, Teams' streaming), Direct Line 3.0 (with Web
//!   Chat's livestreams) and the chat page, purely a gRPC client of `TurnService`.
//! - [`grpc`] — generated code, wire conversions, status mapping, the `TurnService` handler, and
//!   the `AdminService` an operator inspects state with.
//! - [`config`] — command-line flags and the configuration `serve` takes.
//! - [`server`] — [`server::serve`], the one way to start the service.
//! - [`probe`] — the gRPC health check `turnstile health-check` runs.
//! - [`admin_cli`] — `turnstile state get|ls`, the admin service from a shell.
//! - [`telemetry`] — Prometheus metrics on their own port, OTLP traces, and the RPC layer that
//!   traces and times every gRPC call.
// These docs describe the crate's whole layout, its internal modules included: read them with
// `cargo doc --document-private-items`, where the links to those modules resolve.
#![allow(rustdoc::private_intra_doc_links)]

pub mod activity;
pub mod admin_cli;
pub mod allocator;
pub mod bot;
pub mod bots;
pub mod config;
pub mod dialogs;
pub(crate) mod drafts;
pub(crate) mod engine;
pub mod gateway;
pub mod grpc;
pub(crate) mod probe;
pub mod server;
pub mod state;
pub mod store;
pub mod telemetry;

pub use bot::{Bot, BotError, BotRegistry, ConcurrencyPolicy, DoubleText, TurnContext};
pub use config::Config;
pub use server::serve;
