//! Turnstile's integration tests, as one binary: one build and one link instead of one per
//! file, and one throwaway PostgreSQL cluster shared by every test (each test gets a fresh
//! database in it; a test that must stop or reconfigure PostgreSQL starts a private cluster).
//!
//! Each module is one area, tested through the public surface a user has: the gRPC API (a server
//! started the one way `main` starts it), the `turnstile` binary, the gateway's HTTP endpoints.
//! `cargo test --test api <module>::` runs one area.
//!
//! This target needs nothing from the network: PostgreSQL's server binaries are all it asks of
//! the machine, so `cargo test --test api` passes offline. Tests that install third-party tools
//! from npm, PyPI or apt (a browser, helm, the SDKs' packages, grpcurl, PgBouncer) are the
//! `third_party` target's (`tests/third_party/`); plain `cargo test` runs both.
// The 80-line limit is for `src/`: a test reads best as one story, setup to assertion.
#![allow(clippy::unwrap_used, clippy::too_many_lines)]

#[path = "../support/mod.rs"]
mod support;

mod activity_props;
mod activity_roundtrip;
mod admin;
mod auth;
mod bad_input;
mod binary;
mod bytewise_keys;
mod citus;
mod connection_age;
mod directline;
mod double_text;
mod embedded;
mod erasure;
mod expiry;
mod failover;
mod faults;
mod gateway;
mod held_turns;
mod hot_conversations;
mod idempotency;
mod json_activities;
mod layout;
mod metrics;
mod overload;
mod pizza_race;
mod postgres_tls;
mod request_fuzz;
mod sample_bots;
mod schema_health;
mod sdk_protos;
mod shutdown;
mod state_compression;
mod statement_plans;
mod stop_turn;
mod store_conformance;
mod streaming;
mod tls;
mod traces;
mod transcripts;
mod turn_errors;
mod worker_streaming;
