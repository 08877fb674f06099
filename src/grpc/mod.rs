//! The gRPC boundary: generated code, conversions between wire and domain types, the mapping of
//! domain errors to `tonic::Status`, and the `TurnService` implementation.

/// Code generated from `proto/turnstile/v1/turn.proto`.
#[allow(clippy::all, clippy::too_many_lines, missing_docs)]
pub mod pb {
    tonic::include_proto!("turnstile.v1");

    /// The encoded file descriptor set, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("turnstile_descriptor");
}

pub(crate) mod admin;
pub mod affinity;
pub mod auth;
pub mod client;
pub mod coalesce;
pub(crate) mod codec;
pub mod convert;
pub mod error;
pub mod limits;
pub mod request;
pub mod service;
