//! Turnstile's tests against third-party tools that the tests install for themselves from npm,
//! PyPI or apt, under `<target dir>/tools`: Chromium with Web Chat, helm, the SDKs built as a
//! wheel and a tarball and installed as a user installs them, Python's grpcio, grpcurl, buf,
//! PgBouncer, and the previous release's `turnstile`, built from its commit.
//!
//! They are a target of their own so that the core suite (`cargo test --test api`) passes on a
//! machine without the network; `cargo test` runs both. A tool that cannot be installed fails
//! its test with a message saying what was missing: nothing here is skipped.
// The 80-line limit is for `src/`: a test reads best as one story, setup to assertion.
#![allow(clippy::unwrap_used, clippy::too_many_lines)]

#[path = "../support/mod.rs"]
mod support;

mod browser;
mod contract;
mod error_details;
mod helm_chart;
mod pooler;
mod upgrade;
mod workers;
