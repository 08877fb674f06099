//! Telemetry: what operators see of a running replica, kept apart from the turn path so that the
//! engine only emits (through the `metrics` facade and `tracing`) and never serves or exports
//! anything itself.

pub mod metrics;
pub mod rpc;
pub mod traces;
