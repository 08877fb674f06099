//! The gateway's probes, on its HTTP port: `/healthz` (live: this process answers HTTP) and
//! `/readyz` (ready: Turnstile's `turnstile.v1.TurnService` answers `SERVING` to a gRPC health
//! check).
//!
//! Liveness never looks past the process: a Turnstile outage must not get every gateway
//! restarted. Readiness does, so that a gateway that cannot run turns leaves its Service's
//! endpoints instead of answering channels 503 after a timeout. Its answer is remembered for
//! [`READY_FOR`], and concurrent probes share one check: a load balancer probing every pod
//! every second costs Turnstile a health check per gateway every [`READY_FOR`] at most.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::sync::Mutex;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::config::GatewayConfig;
use crate::grpc::client::{self, ClientError};

/// How long an answer of Turnstile's is reused.
pub const READY_FOR: Duration = Duration::from_secs(2);
/// How long one check may take, connecting included: below a probe's usual timeout.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// The service whose status decides readiness: the one the gateway calls.
const SERVICE: &str = "turnstile.v1.TurnService";

/// Whether Turnstile serves turns, asked at most once per [`READY_FOR`].
#[derive(Debug)]
pub struct Readiness {
    health: HealthClient<Channel>,
    last: Mutex<Option<(Instant, Result<(), String>)>>,
}

impl Readiness {
    /// Checks the server `config` names, over a connection of its own (opened on first use), so
    /// that a probe never queues behind turns.
    ///
    /// # Errors
    /// [`ClientError`] when the URL or its TLS settings are unusable.
    pub fn new(config: &GatewayConfig) -> Result<Self, ClientError> {
        let endpoint = client::endpoint(&config.turnstile_url, &config.turnstile_tls)?
            .connect_timeout(CHECK_TIMEOUT)
            .timeout(CHECK_TIMEOUT);
        Ok(Self {
            health: HealthClient::new(endpoint.connect_lazy()),
            last: Mutex::new(None),
        })
    }

    /// `Ok` when Turnstile answered `SERVING` within the last [`READY_FOR`], else why not.
    pub async fn check(&self) -> Result<(), String> {
        // Held across the check: probes arriving meanwhile wait for its answer.
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = last.as_ref()
            && at.elapsed() < READY_FOR
        {
            return answer.clone();
        }
        let answer = self.ask().await;
        let was_ready = last.as_ref().map(|(_, previous)| previous.is_ok());
        match (&answer, was_ready) {
            (Ok(()), Some(false)) => tracing::info!("ready: {SERVICE} is serving again"),
            (Err(why), None | Some(true)) => tracing::warn!(%why, "not ready"),
            _ => {}
        }
        *last = Some((Instant::now(), answer.clone()));
        answer
    }

    async fn ask(&self) -> Result<(), String> {
        let request = HealthCheckRequest {
            service: SERVICE.to_owned(),
        };
        let answer = tokio::time::timeout(CHECK_TIMEOUT, self.health.clone().check(request)).await;
        match answer {
            Err(_) => Err(format!("Turnstile did not answer within {CHECK_TIMEOUT:?}")),
            Ok(Err(status)) => Err(format!(
                "Turnstile's health check failed: {:?} {}",
                status.code(),
                status.message()
            )),
            Ok(Ok(response)) => match ServingStatus::try_from(response.into_inner().status) {
                Ok(ServingStatus::Serving) => Ok(()),
                Ok(status) => Err(format!("{SERVICE} is {}", status.as_str_name())),
                Err(_) => Err(format!("{SERVICE}'s status is unknown")),
            },
        }
    }
}

/// The liveness probe's path.
pub const HEALTHZ: &str = "/healthz";
/// The readiness probe's path.
pub const READYZ: &str = "/readyz";

/// `GET /healthz` and `GET /readyz`.
pub fn routes(readiness: Arc<Readiness>) -> Router {
    Router::new()
        .route(HEALTHZ, get(|| async { "ok" }))
        .route(READYZ, get(ready))
        .with_state(readiness)
}

/// The reason stays in the log: the answer may travel beyond the cluster, and a transport
/// error names internal addresses.
async fn ready(State(readiness): State<Arc<Readiness>>) -> (StatusCode, &'static str) {
    match readiness.check().await {
        Ok(()) => (StatusCode::OK, "ready"),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: Turnstile is not serving turns",
        ),
    }
}
