//! `turnstile health-check`: the gRPC health probe, built into the binary.
//!
//! Kubernetes probes speak gRPC health natively, but `helm test`, a container `HEALTHCHECK` or a
//! script needs a client, and the server image is distroless (no shell, no `grpcurl`). So the
//! binary that serves also asks: `grpc.health.v1.Health/Check` for one service name, with TLS
//! and a client certificate when the server wants them, bounded by a timeout.

use std::path::PathBuf;
use std::time::Duration;

use tonic::transport::Endpoint;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::grpc::client::{self, ClientError, ClientTls};

/// What to ask and how to reach it.
#[derive(Debug, Clone)]
pub struct Probe {
    /// `http://host:port` (plaintext HTTP/2) or `https://host:port` (TLS).
    pub address: String,
    /// The service whose status is asked; empty asks for the server as a whole.
    pub service: String,
    /// How long the whole check may take, connecting included.
    pub timeout: Duration,
    /// PEM CA certificate(s) the server's certificate must chain to; needed for `https`.
    pub ca_cert: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the address's host.
    pub tls_domain: Option<String>,
    /// A PEM client certificate and its key, for a server that requires mutual TLS.
    pub client_identity: Option<(PathBuf, PathBuf)>,
}

/// Why a probe could not tell the status.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The address is no valid URI, or `https` was asked without a CA.
    #[error("{0}")]
    Config(String),
    /// A certificate or key file could not be read.
    #[error("reading {path} failed")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No connection (refused, TLS handshake failed, timed out).
    #[error("connecting to {address} failed")]
    Connect {
        /// The address probed.
        address: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server answered the check with an error status (e.g. `NOT_FOUND`: no such service).
    #[error("the server answered {:?}: {}", .0.code(), .0.message())]
    Status(tonic::Status),
    /// The check took longer than the probe's timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl Probe {
    /// Asks the server for its status.
    ///
    /// # Errors
    /// [`ProbeError`] when no status could be had.
    pub async fn check(&self) -> Result<ServingStatus, ProbeError> {
        tokio::time::timeout(self.timeout, self.check_now())
            .await
            .unwrap_or(Err(ProbeError::Timeout(self.timeout)))
    }

    async fn check_now(&self) -> Result<ServingStatus, ProbeError> {
        let channel = self
            .endpoint()?
            .connect()
            .await
            .map_err(|source| ProbeError::Connect {
                address: self.address.clone(),
                source,
            })?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: self.service.clone(),
            })
            .await
            .map_err(ProbeError::Status)?
            .into_inner();
        // An unknown number from a newer server is no status we can call serving.
        Ok(ServingStatus::try_from(response.status).unwrap_or(ServingStatus::Unknown))
    }

    fn endpoint(&self) -> Result<Endpoint, ProbeError> {
        if self.address.starts_with("https://") && self.ca_cert.is_none() {
            return Err(ProbeError::Config(
                "an https address needs --ca-cert, the CA the server's certificate chains to"
                    .into(),
            ));
        }
        let tls = ClientTls {
            ca_cert: self.ca_cert.clone(),
            domain: self.tls_domain.clone(),
            identity: self.client_identity.clone(),
        };
        let endpoint = client::endpoint(&self.address, &tls).map_err(|e| match e {
            ClientError::File { path, source } => ProbeError::File { path, source },
            ClientError::Tls { address, source } => ProbeError::Connect { address, source },
            other => ProbeError::Config(other.to_string()),
        })?;
        Ok(endpoint.connect_timeout(self.timeout).timeout(self.timeout))
    }
}
