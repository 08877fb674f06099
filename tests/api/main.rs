//! Turnstile's integration tests, as one binary: one build and one link instead of one per
//! file, and one throwaway PostgreSQL cluster shared by every test (each test gets a fresh
//! database in it; a test that must stop or reconfigure PostgreSQL starts a private cluster).
//!
//! Each module is one area, tested through the public surface a user has: the gRPC API (a server
//! started the one way `main` starts it), the `turnstile` binary, the gateway's HTTP endpoints,
//! the Helm chart. `cargo test --test api <module>::` runs one area.
#![allow(clippy::unwrap_used)]

mod support;

mod activity_props;
mod activity_roundtrip;
mod auth;
mod bad_input;
mod binary;
mod browser;
mod connection_age;
mod directline;
mod embedded;
mod error_details;
mod failover;
mod faults;
mod gateway;
mod helm_chart;
mod hot_conversations;
mod idempotency;
mod json_activities;
mod metrics;
mod overload;
mod pizza_race;
mod pooler;
mod postgres_tls;
mod request_fuzz;
mod sample_bots;
mod shutdown;
mod store_conformance;
mod tls;
mod traces;
mod transcripts;
mod turn_errors;
mod workers;
