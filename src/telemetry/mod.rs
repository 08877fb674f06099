//! Telemetry: what operators see of a running replica, kept apart from the turn path so that the
//! engine only emits (through the `metrics` facade and `tracing`) and never serves or exports
//! anything itself.

//!
//! A turn's spans (the RPC, the handler, the turn, each attempt, the store calls) are at DEBUG: at
//! the log filter a deployment runs (`info`), nothing records them, and a span nobody records
//! costs a static check instead of its creation and the formatting of its fields — a large share
//! of a turn (`bench/RESULTS.md`). Trace export gets them through a filter of its own
//! ([`traces_filter`]), so that exporting traces does not mean logging at DEBUG.

pub mod metrics;
pub(crate) mod rpc;
pub mod traces;

use tracing_subscriber::EnvFilter;

/// The environment variable of [`traces_filter`].
pub const TRACES_FILTER_ENV: &str = "TURNSTILE_TRACES_FILTER";

/// What the log records: `RUST_LOG`, else `info`.
pub fn log_filter() -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
}

/// What trace export records: `TURNSTILE_TRACES_FILTER` (the `RUST_LOG` syntax), else INFO and
/// Turnstile's own DEBUG spans, which are a turn's.
pub fn traces_filter() -> EnvFilter {
    EnvFilter::try_from_env(TRACES_FILTER_ENV)
        .unwrap_or_else(|_| EnvFilter::new("info,turnstile=debug"))
}
