//! Telemetry: what operators see of a running replica, kept apart from the turn path so that the
//! engine only emits (through the `metrics` facade and `tracing`) and never serves anything.

pub mod metrics;
