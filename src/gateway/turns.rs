//! The gateway's one call into Turnstile: `ProcessTurn` with the activity as the channel's JSON
//! text, under a deadline, retried while the server says retrying may help (after as long as its
//! `RetryInfo` asks, when it gives one, or a doubling backoff); or, for a channel
//! that can show a reply while it is being written, `StreamTurn`, the same turn with its drafts
//! passed to the caller as they come ([`Shown`]).
//!
//! Retrying is safe because the activity keeps its id: a turn that did commit before its answer
//! was lost is answered from its receipt, not run again (and drafts nothing).

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
use crate::grpc::pb::stream_turn_response::Event;
use crate::grpc::pb::turn_service_client::TurnServiceClient;

/// The first wait before a retry; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How long a stop may take: it only flags the running turn.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

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

/// What a streamed turn shows before its outcome: provisional, never a promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shown {
    /// A status line ("Thinking…"), not part of the reply.
    Status(String),
    /// The whole text so far of the reply being written (it replaces the previous one).
    Text(String),
    /// Everything shown so far is void: an attempt was thrown away after a conflict, or the call
    /// failed (and may be retried, drafting anew).
    Void,
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
        let endpoint = client::endpoint(&config.turnstile_url, &config.turnstile_tls)?;
        let authorization = match &config.turnstile_token {
            Some(token) => Some(bearer(token).ok_or(TurnsError::Token)?),
            None => None,
        };
        Ok(Self {
            client: TurnServiceClient::new(client::channel(&endpoint)),
            bot: config.bot.clone(),
            authorization,
            timeout: config.turn_timeout,
        })
    }

    /// The same client with `timeout` as the deadline of each turn, retries included.
    #[must_use]
    pub fn with_timeout(&self, timeout: Duration) -> Self {
        Self {
            timeout,
            ..self.clone()
        }
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
        self.process_until(activity_json, conversation, Instant::now() + self.timeout)
            .await
    }

    async fn process_until(
        &self,
        activity_json: &str,
        conversation: Option<(&str, &str)>,
        deadline: Instant,
    ) -> Result<pb::ProcessTurnResponse, Status> {
        let mut backoff = FIRST_BACKOFF;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let request = self.request(
                pb::ProcessTurnRequest::json(activity_json, self.bot.clone()).with_json_replies(),
                conversation,
                remaining,
            );
            match self.client.clone().process_turn(request).await {
                Ok(response) => {
                    metrics::turn(Code::Ok);
                    return Ok(response.into_inner());
                }
                Err(status)
                    if retryable(status.code())
                        && remaining > retry_delay(&status, backoff) * 2 =>
                {
                    tracing::info!(code = ?status.code(), "turn not committed; retrying");
                    metrics::turn_retried(status.code());
                    tokio::time::sleep(retry_delay(&status, backoff)).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(status) => {
                    metrics::turn(status.code());
                    return Err(status);
                }
            }
        }
    }
    /// Runs the turn for `activity_json` as [`Turns::process`] does (same deadline, same
    /// retries, same answer), through `StreamTurn`: what the bot shows while it runs goes to
    /// `show` as it arrives, and a [`Shown::Void`] takes it back when its attempt is thrown away
    /// or the call fails. A server without `StreamTurn` is asked with `ProcessTurn` instead.
    ///
    /// # Errors
    /// The last [`Status`] when the server refused the turn or the deadline ran out.
    pub async fn stream(
        &self,
        activity_json: &str,
        conversation: Option<(&str, &str)>,
        mut show: impl FnMut(Shown) + Send,
    ) -> Result<pb::ProcessTurnResponse, Status> {
        let deadline = Instant::now() + self.timeout;
        let mut backoff = FIRST_BACKOFF;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let request = self.request(
                pb::StreamTurnRequest::from(
                    pb::ProcessTurnRequest::json(activity_json, self.bot.clone())
                        .with_json_replies(),
                ),
                conversation,
                remaining,
            );
            let mut shown = false;
            let streamed = match self.client.clone().stream_turn(request).await {
                Ok(events) => Self::follow(events.into_inner(), &mut shown, &mut show).await,
                // Nothing ran: a server from before streaming.
                Err(status) if status.code() == Code::Unimplemented => {
                    tracing::info!("the server cannot stream turns; calling ProcessTurn");
                    return self
                        .process_until(activity_json, conversation, deadline)
                        .await;
                }
                Err(status) => Err(status),
            };
            if streamed.is_err() && shown {
                show(Shown::Void);
            }
            match streamed {
                Ok(response) => {
                    metrics::turn(Code::Ok);
                    return Ok(response);
                }
                Err(status)
                    if retryable(status.code())
                        && remaining > retry_delay(&status, backoff) * 2 =>
                {
                    tracing::info!(code = ?status.code(), "turn not committed; retrying");
                    metrics::turn_retried(status.code());
                    tokio::time::sleep(retry_delay(&status, backoff)).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(status) => {
                    metrics::turn(status.code());
                    return Err(status);
                }
            }
        }
    }

    /// Stops the streamed turn of activity `activity_id` in `conversation` (channel and
    /// conversation id): its user pressed Stop when `shown` was the text on their screen. The
    /// turn then commits what was shown, and its `StreamTurn` call ends with that outcome
    /// (`stopped`). A server that cannot stop turns, or a stop that finds nothing running, lets
    /// the turn commit its whole reply, which the outcome then says.
    pub async fn stop(
        &self,
        conversation: (&str, &str),
        activity_id: &str,
        shown: Option<String>,
    ) -> Option<pb::StopTurnResult> {
        let (channel_id, conversation_id) = conversation;
        let request = self.request(
            pb::StopTurnRequest {
                bot: self.bot.clone(),
                channel_id: channel_id.to_owned(),
                conversation_id: conversation_id.to_owned(),
                activity_id: activity_id.to_owned(),
                shown_text: shown,
            },
            Some(conversation),
            STOP_TIMEOUT,
        );
        match self.client.clone().stop_turn(request).await {
            Ok(response) => {
                let result = response.into_inner().result();
                tracing::info!(?result, "the user stopped the reply");
                Some(result)
            }
            Err(status) => {
                tracing::info!(code = ?status.code(), message = status.message(),
                    "the reply could not be stopped; it commits whole");
                None
            }
        }
    }

    /// Passes one `StreamTurn` call's drafts and resets to `show` until its outcome.
    async fn follow(
        mut events: tonic::Streaming<pb::StreamTurnResponse>,
        shown: &mut bool,
        show: &mut (impl FnMut(Shown) + Send),
    ) -> Result<pb::ProcessTurnResponse, Status> {
        while let Some(event) = events.message().await? {
            match event.event {
                Some(Event::Draft(draft)) => {
                    *shown = true;
                    show(if draft.kind() == pb::DraftKind::Informative {
                        Shown::Status(draft.text)
                    } else {
                        Shown::Text(draft.text)
                    });
                }
                Some(Event::Reset(_)) if *shown => {
                    *shown = false;
                    show(Shown::Void);
                }
                Some(Event::Outcome(outcome)) => return Ok(outcome),
                Some(Event::Reset(_)) | None => {}
            }
        }
        // Retrying is safe: the activity's receipt answers it if the turn did commit.
        Err(Status::unavailable(
            "the turn's stream ended without its outcome",
        ))
    }

    /// `message` under the deadline's `remaining` time, with the token and the conversation
    /// (channel and conversation id) as [`CONVERSATION_METADATA`].
    fn request<T>(
        &self,
        message: T,
        conversation: Option<(&str, &str)>,
        remaining: Duration,
    ) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(remaining);
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
        if let Some(affinity) = conversation
            .and_then(|(channel, conversation)| conversation_value(channel, conversation))
        {
            request
                .metadata_mut()
                .insert(CONVERSATION_METADATA, affinity);
        }
        request
    }
}

/// Whether `status` refuses a message because the bot is still answering the one before
/// (`CONVERSATION_BUSY`, a bot whose double-text policy is `reject`): nothing was committed.
pub fn is_busy(status: &Status) -> bool {
    use tonic_types::StatusExt as _;
    status.code() == Code::FailedPrecondition
        && status
            .get_error_details()
            .error_info()
            .is_some_and(|info| info.reason == "CONVERSATION_BUSY")
}

/// How long to wait before sending the turn again: as long as the server's `RetryInfo` asks, when
/// it gives one (an overloaded server says when it expects room), and never less than the
/// doubling `backoff`.
fn retry_delay(status: &Status, backoff: Duration) -> Duration {
    use tonic_types::StatusExt as _;
    status
        .get_details_retry_info()
        .and_then(|info| info.retry_delay)
        .map_or(backoff, |asked| asked.max(backoff))
}

/// Whether the same activity may be sent again: the server committed nothing and says why.
fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Aborted | Code::Unavailable | Code::ResourceExhausted
    )
}

fn bearer(token: &Secret) -> Option<MetadataValue<Ascii>> {
    let mut value: MetadataValue<Ascii> = format!("Bearer {}", token.expose()).parse().ok()?;
    // Marked sensitive: a `Debug` of the request (a log, a trace) shows no token.
    value.set_sensitive(true);
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_waits_as_long_as_the_server_asks() {
        use tonic_types::{ErrorDetails, StatusExt as _};
        let backoff = Duration::from_millis(50);
        let plain = Status::unavailable("busy");
        assert_eq!(retry_delay(&plain, backoff), backoff);
        let asked = Status::with_error_details(
            Code::ResourceExhausted,
            "overloaded",
            ErrorDetails::with_retry_info(Some(Duration::from_millis(700))),
        );
        assert_eq!(retry_delay(&asked, backoff), Duration::from_millis(700));
        let sooner = Status::with_error_details(
            Code::ResourceExhausted,
            "overloaded",
            ErrorDetails::with_retry_info(Some(Duration::from_millis(10))),
        );
        assert_eq!(retry_delay(&sooner, backoff), backoff);
    }

    #[test]
    fn the_turn_token_is_never_printed() {
        let header = bearer(&Secret::new("s3cret")).expect("a valid header");
        assert!(header.is_sensitive());
        assert!(!format!("{header:?}").contains("s3cret"));
    }
}
