//! The gateway's one call into Turnstile: `ProcessTurn` with the activity as the channel's JSON
//! text, under a deadline, retried while the server says retrying may help.
//!
//! Retrying is safe because the activity keeps its id: a turn that did commit before its answer
//! was lost is answered from its receipt, not run again.

use std::time::Duration;

use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use super::config::{GatewayConfig, Secret};
use super::metrics;
use crate::grpc::affinity::{CONVERSATION_METADATA, conversation_value};
use crate::grpc::client::{self, ClientError};
use crate::grpc::pb;
use crate::grpc::pb::turn_service_client::TurnServiceClient;

/// The first wait before a retry; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A `TurnService` client bound to one bot.
#[derive(Clone)]
pub struct Turns {
    client: TurnServiceClient<Channel>,
    bot: String,
    authorization: Option<MetadataValue<Ascii>>,
    timeout: Duration,
}

impl std::fmt::Debug for Turns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turns")
            .field("bot", &self.bot)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Why the gateway cannot talk to Turnstile at all.
#[derive(Debug, thiserror::Error)]
pub enum TurnsError {
    /// The server URL or its TLS settings are unusable.
    #[error("the Turnstile URL or its TLS settings are unusable")]
    Endpoint(#[from] ClientError),
    /// The bearer token cannot be sent as a header.
    #[error("the Turnstile auth token holds characters a header cannot carry")]
    Token,
}

impl Turns {
    /// A client of the server `config` names; it connects on first use.
    ///
    /// # Errors
    /// [`TurnsError`] when the URL or the token is unusable.
    pub fn new(config: &GatewayConfig) -> Result<Self, TurnsError> {
        let endpoint =
            client::endpoint(&config.turnstile_url, &config.turnstile_tls)?.tcp_nodelay(true);
        let authorization = match &config.turnstile_token {
            Some(token) => Some(bearer(token).ok_or(TurnsError::Token)?),
            None => None,
        };
        Ok(Self {
            client: TurnServiceClient::new(endpoint.connect_lazy()),
            bot: config.bot.clone(),
            authorization,
            timeout: config.turn_timeout,
        })
    }

    /// Runs the turn for `activity_json`, the channel's text, and returns its replies as JSON.
    /// `conversation` (channel and conversation id) goes along as
    /// [`CONVERSATION_METADATA`], so that a mesh can keep a conversation on one replica.
    ///
    /// # Errors
    /// The last [`Status`] when the server refused the turn or the deadline ran out.
    pub async fn process(
        &self,
        activity_json: &str,
        conversation: Option<(&str, &str)>,
    ) -> Result<pb::ProcessTurnResponse, Status> {
        let affinity = conversation
            .and_then(|(channel, conversation)| conversation_value(channel, conversation));
        let deadline = Instant::now() + self.timeout;
        let mut backoff = FIRST_BACKOFF;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let mut request = Request::new(
                pb::ProcessTurnRequest::json(activity_json, self.bot.clone()).with_json_replies(),
            );
            request.set_timeout(remaining);
            if let Some(authorization) = &self.authorization {
                request
                    .metadata_mut()
                    .insert("authorization", authorization.clone());
            }
            if let Some(affinity) = &affinity {
                request
                    .metadata_mut()
                    .insert(CONVERSATION_METADATA, affinity.clone());
            }
            match self.client.clone().process_turn(request).await {
                Ok(response) => {
                    metrics::turn(Code::Ok);
                    return Ok(response.into_inner());
                }
                Err(status) if retryable(status.code()) && remaining > backoff * 2 => {
                    tracing::info!(code = ?status.code(), "turn not committed; retrying");
                    metrics::turn_retried(status.code());
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(status) => {
                    metrics::turn(status.code());
                    return Err(status);
                }
            }
        }
    }
}

/// Whether the same activity may be sent again: the server committed nothing and says why.
fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Aborted | Code::Unavailable | Code::ResourceExhausted
    )
}

fn bearer(token: &Secret) -> Option<MetadataValue<Ascii>> {
    format!("Bearer {}", token.expose()).parse().ok()
}
