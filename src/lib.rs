pub mod activity;
pub mod grpc;
