//! Remote bots: a bot that is a call to a bot worker, a process of its own in any language that
//! serves `turnstile.v1.BotWorker` (`proto/turnstile/v1/worker.proto`).
//!
//! The engine cannot tell a remote bot from an in-process one: [`RemoteBot`] implements [`Bot`],
//! so a worker's turns are queued, cached, committed conditionally, replayed on conflict (calling
//! the worker again with the fresh state) and answered from receipts on redelivery exactly like a
//! Rust bot's. What differs is how it fails, and each failure commits nothing:
//! - a worker that cannot be reached (refused, reset, no route) is [`BotErrorKind::Unavailable`]:
//!   the caller gets `UNAVAILABLE` and retries later;
//! - a worker that has not answered when the caller's deadline comes is
//!   [`BotErrorKind::DeadlineExceeded`];
//! - a worker that answers an error status, or an answer that is malformed or over
//!   [`MAX_ANSWER_BYTES`], is [`BotErrorKind::WorkerFailed`]: `INTERNAL`, with a message naming
//!   the worker and the problem, since that is a bug in the worker its author must see.
//!
//! A turn someone streams (`StreamTurn`) calls `BotWorker/StreamRunTurn` instead, and each
//! draft the worker sends is passed on as it arrives ([`TurnContext::draft`] and
//! [`TurnContext::inform`]); its `result` is applied exactly as `RunTurn`'s answer. A turn
//! nobody streams calls `RunTurn`, as a worker that cannot stream is called too: one that
//! answers `StreamRunTurn` with `UNIMPLEMENTED` (an SDK older than streaming) is asked
//! `RunTurn` instead, and is not asked to stream again for [`UNARY_ONLY_FOR`]. A stream the
//! worker gets wrong fails the turn like a malformed answer (`WorkerFailed`): an event after the
//! result, a stream that ends without one, a draft over the size cap; one that breaks midway
//! fails it like a worker that went away (`Unavailable`).
//!
//! Only this module speaks gRPC among the bots; state and replies cross the wire as JSON text,
//! so that nothing of a state object or an activity is lost on the way (no protobuf `Struct`,
//! whose numbers are doubles).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use secrecy::{ExposeSecret as _, SecretString};
use tokio::time::Instant;
use tonic::Code;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;

use crate::activity::{Activity, JsonMap};
use crate::bot::{Bot, BotError, BotErrorKind, BotRegistry, Drafter, TurnContext};
use crate::drafts::DraftError;
use crate::grpc::client::{self, ClientError, ClientTls};
use crate::grpc::pb;
use crate::grpc::pb::bot_worker_client::BotWorkerClient;
use crate::grpc::pb::stream_run_turn_response::Event;
use crate::state::ScopeState;

/// The largest answer read from a worker, in encoded bytes: the replies and the whole new state
/// of every scope. Beyond it the turn fails (`INTERNAL`) rather than store or send what no
/// channel would accept anyway.
pub const MAX_ANSWER_BYTES: usize = 4 << 20;

/// How long a worker may take when the caller set no deadline.
pub const DEFAULT_WORKER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long connecting to a worker may take before the turn fails with `UNAVAILABLE`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a worker that answered `StreamRunTurn` with `UNIMPLEMENTED` is called with `RunTurn`
/// alone before it is asked to stream again: long enough that an old worker costs one extra call
/// now and then, short enough that an upgraded one streams soon after it is deployed.
pub const UNARY_ONLY_FOR: Duration = Duration::from_secs(60);

/// The part of the caller's remaining time kept back from the worker for the commit, at most
/// [`COMMIT_RESERVE_MAX`]: a worker that uses its whole deadline then still fails the turn here,
/// with `DEADLINE_EXCEEDED`, instead of committing after the caller stopped waiting.
const COMMIT_RESERVE_DIVISOR: u32 = 10;
const COMMIT_RESERVE_MAX: Duration = Duration::from_millis(50);

/// `NAME=URL`: a remote bot's name in the registry and its worker's address, parsed from
/// `--remote-bot`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteBotSpec {
    name: String,
    url: http::Uri,
}

/// A `--remote-bot` value that is not `NAME=URL` with an `http` or `https` URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}` is not NAME=URL (like pizza-py=http://pizza-worker:50061): {problem}")]
pub struct InvalidRemoteBot {
    value: String,
    problem: String,
}

impl FromStr for RemoteBotSpec {
    type Err = InvalidRemoteBot;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let invalid = |problem: &str| InvalidRemoteBot {
            value: value.to_owned(),
            problem: problem.to_owned(),
        };
        let (name, url) = value
            .trim()
            .split_once('=')
            .ok_or_else(|| invalid("there is no `=`"))?;
        let name = name.trim();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(invalid("the name must be letters, digits, `-`, `_` or `.`"));
        }
        let url: http::Uri = url
            .trim()
            .parse()
            .map_err(|e: http::uri::InvalidUri| invalid(&format!("the URL is invalid: {e}")))?;
        if !matches!(url.scheme_str(), Some("http" | "https")) || url.host().is_none() {
            return Err(invalid(
                "the URL must be http://host:port or https://host:port",
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            url,
        })
    }
}

impl RemoteBotSpec {
    /// The bot's name in the registry.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The worker's address.
    pub fn url(&self) -> &http::Uri {
        &self.url
    }
}

/// The remote bots a server hosts besides its in-process ones, and how it reaches their workers.
#[derive(Debug, Clone, Default)]
pub struct RemoteBots {
    /// The bots, by name and worker address. A remote bot replaces an in-process bot of the same
    /// name.
    pub bots: Vec<RemoteBotSpec>,
    /// The bearer token sent to every worker as `authorization: Bearer <token>`, if any; a
    /// [`SecretString`], so that printing the configuration shows `[REDACTED]`.
    pub token: Option<SecretString>,
    /// The CA certificate(s), PEM, that `https` workers' certificates must chain to.
    pub ca: Option<PathBuf>,
}

/// Why the remote bots could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RemoteBotsError {
    /// The CA file could not be read.
    #[error("reading the bot workers' CA file {path} (--remote-bot-ca) failed")]
    Ca {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An `https` worker without `--remote-bot-ca`.
    #[error(
        "bot worker `{0}` is reached over https, which needs --remote-bot-ca (the CA its certificate chains to)"
    )]
    NoCa(String),
    /// TLS could not be configured for a worker.
    #[error("configuring TLS towards bot worker `{name}` failed")]
    Tls {
        /// The bot.
        name: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The token cannot be sent as a header value.
    #[error("--remote-bot-token holds characters an HTTP header cannot carry")]
    Token,
    /// No endpoint could be made for a worker, for another reason than the above.
    #[error("making the connection to bot worker `{name}` failed")]
    Endpoint {
        /// The bot.
        name: String,
        /// Why.
        #[source]
        source: ClientError,
    },
}

impl RemoteBots {
    /// `bots` with a [`RemoteBot`] added for each configured worker (replacing an in-process bot
    /// of the same name). Connections are opened on first use, so a worker that is not up yet
    /// does not keep the server from starting.
    ///
    /// # Errors
    /// [`RemoteBotsError`] when the CA file cannot be read, an `https` worker has no CA, or the
    /// token is not a valid header value.
    pub fn register(&self, mut bots: BotRegistry) -> Result<BotRegistry, RemoteBotsError> {
        // Read now, so that an unreadable CA stops the start even when no worker is https (each
        // https worker's endpoint reads it again).
        if let Some(path) = &self.ca {
            std::fs::read(path).map_err(|source| RemoteBotsError::Ca {
                path: path.clone(),
                source,
            })?;
        }
        let authorization = match &self.token {
            Some(token) => {
                let mut value = format!("Bearer {}", token.expose_secret())
                    .parse::<MetadataValue<Ascii>>()
                    .map_err(|_| RemoteBotsError::Token)?;
                // So that `RemoteBot`'s `Debug` (and the HTTP/2 header table) leave it out.
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        for spec in &self.bots {
            let endpoint = client::endpoint_to(&spec.url, &self.tls_for(spec)?)
                .map_err(|e| RemoteBotsError::from_client(&spec.name, e))?
                .connect_timeout(CONNECT_TIMEOUT);
            let bot = RemoteBot::new(spec.name.clone(), client::channel(&endpoint))
                .with_authorization(authorization.clone());
            tracing::info!(bot = %spec.name, worker = %spec.url, "hosting a remote bot");
            bots = bots.with(spec.name.clone(), bot);
        }
        Ok(bots)
    }

    /// The TLS settings towards `spec`'s worker: none for `http`; for `https`, the CA its
    /// certificate must chain to (`--remote-bot-ca`, which an `https` worker requires, so the
    /// public roots are never trusted here), the URL's host as the name, no client certificate.
    fn tls_for(&self, spec: &RemoteBotSpec) -> Result<ClientTls, RemoteBotsError> {
        if spec.url.scheme_str() != Some("https") {
            return Ok(ClientTls::default());
        }
        let ca = self
            .ca
            .clone()
            .ok_or_else(|| RemoteBotsError::NoCa(spec.name.clone()))?;
        Ok(ClientTls {
            ca_cert: Some(ca),
            domain: None,
            identity: None,
        })
    }
}

impl RemoteBotsError {
    /// The error for bot `name` whose endpoint could not be made.
    fn from_client(name: &str, error: ClientError) -> Self {
        match error {
            // The only file a worker's endpoint reads.
            ClientError::File { path, source } => Self::Ca { path, source },
            ClientError::Tls { source, .. } => Self::Tls {
                name: name.to_owned(),
                source,
            },
            // Not from a parsed URL with the settings `tls_for` gives; named all the same.
            error @ (ClientError::Address { .. } | ClientError::TlsOnPlaintext(_)) => {
                Self::Endpoint {
                    name: name.to_owned(),
                    source: error,
                }
            }
        }
    }
}

/// A bot whose turns run in a bot worker: each attempt is one `BotWorker/RunTurn` call, or one
/// `BotWorker/StreamRunTurn` call when someone streams the turn.
#[derive(Debug, Clone)]
pub struct RemoteBot {
    name: String,
    client: BotWorkerClient<Channel>,
    authorization: Option<MetadataValue<Ascii>>,
    /// Until when the worker is called without streaming, since it said it cannot stream.
    unary_only_until: Arc<Mutex<Option<Instant>>>,
}

/// How a streamed call ended.
enum Streamed {
    /// The worker's result.
    Answer(pb::RunTurnResponse),
    /// The worker cannot stream (`UNIMPLEMENTED` before any event): call `RunTurn`.
    Unimplemented,
}

impl RemoteBot {
    /// The bot named `name` (as the registry and the worker know it), served by the worker
    /// behind `channel`.
    pub fn new(name: impl Into<String>, channel: Channel) -> Self {
        Self {
            name: name.into(),
            client: BotWorkerClient::new(channel)
                .max_decoding_message_size(MAX_ANSWER_BYTES)
                .max_encoding_message_size(usize::MAX),
            authorization: None,
            unary_only_until: Arc::default(),
        }
    }

    /// The same bot, sending `authorization` (`Bearer <token>`) on every call.
    #[must_use]
    pub fn with_authorization(mut self, authorization: Option<MetadataValue<Ascii>>) -> Self {
        self.authorization = authorization;
        self
    }

    /// A failure of this bot's worker, of kind `kind`, described by `problem`.
    fn fail(&self, kind: BotErrorKind, problem: impl fmt::Display) -> BotError {
        BotError::new(kind, format!("bot worker `{}` {problem}", self.name))
    }

    /// The request for the attempt `turn` is.
    fn request(&self, turn: &mut TurnContext<'_>) -> pb::RunTurnRequest {
        let scope = |state: &ScopeState| pb::ScopeState {
            // Not `properties()`, which would count as the bot reading the scope: only the
            // worker's answer says whether it did.
            state_json: serde_json::Value::Object(state.loaded().clone()).to_string(),
            exists: state.was_stored(),
        };
        pb::RunTurnRequest {
            bot: self.name.clone(),
            activity_json: turn.activity().to_json().to_string(),
            attempt: turn.attempt(),
            conversation: Some(scope(turn.conversation_state())),
            user: turn.user_state().ok().map(|s| scope(s)),
            private_conversation: turn.private_conversation_state().ok().map(|s| scope(s)),
            superseded_json: activities_json(turn.superseded()),
            batch_json: activities_json(turn.batch()),
        }
    }

    /// Applies the worker's answer to the turn: its scopes, then its replies. Checks everything
    /// before it changes anything, though a failed turn's context is discarded anyway.
    fn apply(
        &self,
        turn: &mut TurnContext<'_>,
        answer: pb::RunTurnResponse,
    ) -> Result<(), BotError> {
        let malformed = |problem: String| self.fail(BotErrorKind::WorkerFailed, problem);
        let replies = answer
            .replies_json
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let object = json_object(text)
                    .map_err(|e| malformed(format!("answered reply {} that is {e}", i + 1)))?;
                Ok(Activity::from_json(serde_json::Value::Object(object))
                    .unwrap_or_else(|_| Activity::default()))
            })
            .collect::<Result<Vec<_>, BotError>>()?;
        let outcomes = [
            ("conversation", answer.conversation, true),
            ("user", answer.user, turn.user_state().is_ok()),
            (
                "private conversation",
                answer.private_conversation,
                turn.private_conversation_state().is_ok(),
            ),
        ];
        let mut changes = Vec::with_capacity(3);
        for (scope, outcome, present) in outcomes {
            let Some(outcome) = outcome else {
                changes.push(None);
                continue;
            };
            if !present {
                return Err(malformed(format!(
                    "answered {scope} state, which this turn does not have (the activity names \
                     no user, or the bot's scopes leave it out: `--bot-scopes`)"
                )));
            }
            let replaced = match &outcome.replaced_json {
                Some(text) => Some(
                    json_object(text)
                        .map_err(|e| malformed(format!("answered {scope} state that is {e}")))?,
                ),
                None => None,
            };
            changes.push(Some((outcome.read, replaced)));
        }
        let mut changes = changes.into_iter();
        if let Some(change) = changes.next().flatten() {
            apply_scope(turn.conversation_state(), change);
        }
        if let (Some(change), Ok(state)) = (changes.next().flatten(), turn.user_state()) {
            apply_scope(state, change);
        }
        if let (Some(change), Ok(state)) =
            (changes.next().flatten(), turn.private_conversation_state())
        {
            apply_scope(state, change);
        }
        for reply in replies {
            turn.send(reply);
        }
        Ok(())
    }

    /// The error for a call that ended with `status`; `expired` when the call's time was up.
    fn status_error(&self, status: &tonic::Status, expired: bool) -> BotError {
        let message = shortened(status.message());
        // A status the client made from a failed connection (reset, broken pipe, the worker
        // killed mid-call) carries the transport error as its source and often says UNKNOWN; one
        // the worker sent carries none.
        let transport = std::error::Error::source(status).is_some();
        match status.code() {
            Code::Unknown if transport => self.fail(
                BotErrorKind::Unavailable,
                format_args!("is unavailable (the connection failed: {message})"),
            ),
            Code::Unavailable => self.fail(
                BotErrorKind::Unavailable,
                format_args!("is unavailable ({message})"),
            ),
            // Cancelled by the transport before the call's time was up: the connection went while
            // the call was on it (the worker killed as it was sent), not the deadline.
            Code::Cancelled if transport && !expired => self.fail(
                BotErrorKind::Unavailable,
                format_args!("is unavailable (the connection failed: {message})"),
            ),
            Code::DeadlineExceeded | Code::Cancelled => self.fail(
                BotErrorKind::DeadlineExceeded,
                "did not answer before the call's deadline",
            ),
            Code::OutOfRange | Code::ResourceExhausted
                if message.contains("message length too large") =>
            {
                self.fail(
                    BotErrorKind::WorkerFailed,
                    format_args!("answered more than {MAX_ANSWER_BYTES} bytes ({message})"),
                )
            }
            code => self.fail(
                BotErrorKind::WorkerFailed,
                format_args!("failed: {code:?}: {message}"),
            ),
        }
    }
}

#[async_trait]
impl Bot for RemoteBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let deadline = turn
            .deadline()
            .unwrap_or_else(|| Instant::now() + DEFAULT_WORKER_TIMEOUT);
        let remaining = deadline.saturating_duration_since(Instant::now());
        let reserve = (remaining / COMMIT_RESERVE_DIVISOR).min(COMMIT_RESERVE_MAX);
        let budget = remaining.saturating_sub(reserve);
        if budget.is_zero() {
            return Err(self.fail(
                BotErrorKind::DeadlineExceeded,
                "was not called: the call's deadline had passed",
            ));
        }
        let until = Instant::now() + budget;
        let request = self.request(turn);
        let answer = if turn.streaming() && self.may_stream() {
            match self
                .stream_run_turn(turn.drafter(), request.clone(), until)
                .await?
            {
                Streamed::Answer(answer) => answer,
                Streamed::Unimplemented => {
                    tracing::info!(
                        bot = %self.name,
                        "the bot worker cannot stream (UNIMPLEMENTED): calling RunTurn"
                    );
                    self.cannot_stream();
                    self.run_turn(request, until).await?
                }
            }
        } else {
            self.run_turn(request, until).await?
        };
        self.apply(turn, answer)
    }
}

impl RemoteBot {
    /// Whether the worker may be asked to stream: it has not said lately that it cannot.
    fn may_stream(&self) -> bool {
        let until = *self
            .unary_only_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        until.is_none_or(|until| Instant::now() >= until)
    }

    /// Remembers that the worker cannot stream, for [`UNARY_ONLY_FOR`]. (A std mutex: held for
    /// a copy, never across an await.)
    fn cannot_stream(&self) {
        *self
            .unary_only_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + UNARY_ONLY_FOR);
    }

    /// `message` as a call that must end by `until`, with the bearer token if there is one.
    fn call<T>(&self, message: T, until: Instant) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(until.saturating_duration_since(Instant::now()));
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
        request
    }

    /// The error for a worker still working when the call's time is up.
    fn too_late(&self) -> BotError {
        self.fail(
            BotErrorKind::DeadlineExceeded,
            "did not answer before the call's deadline",
        )
    }

    /// One `RunTurn` call, answered by `until`.
    async fn run_turn(
        &self,
        request: pb::RunTurnRequest,
        until: Instant,
    ) -> Result<pb::RunTurnResponse, BotError> {
        if Instant::now() >= until {
            return Err(self.too_late());
        }
        let mut client = self.client.clone();
        let request = self.call(request, until);
        match tokio::time::timeout_at(until, client.run_turn(request)).await {
            Err(_) => Err(self.too_late()),
            Ok(Err(status)) => Err(self.status_error(&status, Instant::now() >= until)),
            Ok(Ok(answer)) => Ok(answer.into_inner()),
        }
    }

    /// One `StreamRunTurn` call, answered by `until`: passes each draft on to `drafter` as
    /// it arrives, and returns the result once the stream has ended after it.
    async fn stream_run_turn(
        &self,
        drafter: Drafter<'_>,
        request: pb::RunTurnRequest,
        until: Instant,
    ) -> Result<Streamed, BotError> {
        let request = self.call(stream_request(request), until);
        let mut client = self.client.clone();
        let streamed = async {
            let mut events = match client.stream_run_turn(request).await {
                Ok(response) => response.into_inner(),
                Err(status) if unimplemented(&status) => return Ok(Streamed::Unimplemented),
                Err(status) => return Err(self.status_error(&status, Instant::now() >= until)),
            };
            let mut result = None;
            let mut first = true;
            loop {
                let event = match events.message().await {
                    Ok(Some(event)) => event,
                    Ok(None) => break,
                    Err(status) if first && unimplemented(&status) => {
                        return Ok(Streamed::Unimplemented);
                    }
                    Err(status) => {
                        return Err(self.status_error(&status, Instant::now() >= until));
                    }
                };
                first = false;
                if result.is_some() {
                    return Err(self.fail(
                        BotErrorKind::WorkerFailed,
                        "sent an event after its result (the result must be the last)",
                    ));
                }
                match event.event {
                    Some(Event::Draft(draft)) => self.pass_on(drafter, draft)?,
                    Some(Event::Result(answer)) => result = Some(answer),
                    None => {
                        return Err(self.fail(
                            BotErrorKind::WorkerFailed,
                            "sent an event that is neither a draft nor a result",
                        ));
                    }
                }
            }
            result.map(Streamed::Answer).ok_or_else(|| {
                self.fail(
                    BotErrorKind::WorkerFailed,
                    "ended its stream without a result",
                )
            })
        };
        tokio::time::timeout_at(until, streamed)
            .await
            .unwrap_or_else(|_| Err(self.too_late()))
    }

    /// Shows a worker's draft to whoever streams the turn.
    fn pass_on(&self, drafter: Drafter<'_>, draft: pb::WorkerDraft) -> Result<(), BotError> {
        let shown = match pb::WorkerDraftKind::try_from(draft.kind) {
            Ok(pb::WorkerDraftKind::Text) => drafter.draft(draft.text),
            Ok(pb::WorkerDraftKind::Informative) => drafter.inform(draft.text),
            Ok(pb::WorkerDraftKind::Unspecified) | Err(_) => {
                return Err(self.fail(
                    BotErrorKind::WorkerFailed,
                    format_args!(
                        "sent a draft of kind {}, which is neither text nor informative",
                        draft.kind
                    ),
                ));
            }
        };
        shown.map_err(|e| match e {
            DraftError::TooLarge { size, limit } => self.fail(
                BotErrorKind::WorkerFailed,
                format_args!(
                    "sent a draft of {size} bytes, over the limit of {limit} bytes (--max-text-bytes)"
                ),
            ),
        })
    }
}

/// `request` as the request of `StreamRunTurn`, which carries the same fields (every one: a field
/// added to the contract must be named here).
fn stream_request(request: pb::RunTurnRequest) -> pb::StreamRunTurnRequest {
    let pb::RunTurnRequest {
        bot,
        activity_json,
        attempt,
        conversation,
        user,
        private_conversation,
        superseded_json,
        batch_json,
    } = request;
    pb::StreamRunTurnRequest {
        bot,
        activity_json,
        attempt,
        conversation,
        user,
        private_conversation,
        superseded_json,
        batch_json,
    }
}

/// Whether `status` is a worker saying it has no `StreamRunTurn` (not a failed connection that
/// a client library reported as such).
fn unimplemented(status: &tonic::Status) -> bool {
    status.code() == Code::Unimplemented && std::error::Error::source(status).is_none()
}

/// Each of `activities` as its Bot Framework JSON text, in order: the superseded messages and the
/// batch of a turn, as `activity_json` carries its activity.
fn activities_json(activities: &[Activity]) -> Vec<String> {
    activities.iter().map(|a| a.to_json().to_string()).collect()
}

/// Applies one scope's outcome: marks it read, replaces it.
fn apply_scope(state: &mut ScopeState, (read, replaced): (bool, Option<JsonMap>)) {
    if read {
        // Reading the properties is what marks an in-process bot's scope as read.
        let _ = state.properties();
    }
    if let Some(properties) = replaced {
        state.replace(properties);
    }
}

/// `text` as a JSON object, or what it is instead ("not valid JSON: …", "a JSON array, not an
/// object").
fn json_object(text: &str) -> Result<JsonMap, String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(other) => Err(format!(
            "not a JSON object (a JSON {})",
            match other {
                serde_json::Value::Null => "null",
                serde_json::Value::Bool(_) => "boolean",
                serde_json::Value::Number(_) => "number",
                serde_json::Value::String(_) => "string",
                serde_json::Value::Array(_) => "array",
                serde_json::Value::Object(_) => "object",
            }
        )),
        Err(e) => Err(format!("not valid JSON ({e})")),
    }
}

/// A worker's status message, cut to a length a log line and an error message can carry.
fn shortened(message: &str) -> String {
    const MOST: usize = 300;
    if message.len() <= MOST {
        return message.to_owned();
    }
    let mut end = MOST;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::incoming::IncomingActivity;
    use crate::activity::{ChannelAccount, ConversationAccount};
    use crate::state::Scope;
    use tonic::transport::Endpoint;

    #[test]
    fn remote_bot_specs_are_parsed_at_the_boundary() {
        let spec: RemoteBotSpec = "pizza-py=http://127.0.0.1:50061".parse().expect("valid");
        assert_eq!(spec.name(), "pizza-py");
        assert_eq!(spec.url().port_u16(), Some(50061));
        for bad in [
            "pizza-py",
            "=http://h:1",
            "pizza py=http://h:1",
            "pizza=ftp://h:1",
            "pizza=not a url",
            "pizza=/path",
        ] {
            let err = bad.parse::<RemoteBotSpec>().expect_err(bad);
            assert!(err.to_string().contains(bad.trim()), "{err}");
        }
    }

    #[test]
    fn an_https_worker_is_verified_against_the_remote_bot_ca_alone() {
        let ca = tempfile::NamedTempFile::new().expect("CA file");
        let bots = RemoteBots {
            bots: vec![
                "plain=http://127.0.0.1:50061".parse().expect("valid"),
                "secure=https://worker.example:50061"
                    .parse()
                    .expect("valid"),
            ],
            ca: Some(ca.path().to_owned()),
            ..RemoteBots::default()
        };
        // The CA is no setting of a plaintext worker's, so it is not refused as one.
        assert_eq!(
            bots.tls_for(&bots.bots[0]).expect("http"),
            ClientTls::default()
        );
        let secure = ClientTls {
            ca_cert: Some(ca.path().to_owned()),
            ..ClientTls::default()
        };
        assert_eq!(bots.tls_for(&bots.bots[1]).expect("https"), secure);
        let without_ca = RemoteBots {
            ca: None,
            ..bots.clone()
        };
        let err = without_ca
            .tls_for(&without_ca.bots[1])
            .expect_err("no public roots");
        assert!(
            matches!(&err, RemoteBotsError::NoCa(name) if name == "secure"),
            "{err}"
        );

        // An unreadable CA stops the start, named by its flag, even with plaintext workers only.
        let unreadable = RemoteBots {
            bots: vec![bots.bots[0].clone()],
            ca: Some("/nonexistent/ca.pem".into()),
            ..RemoteBots::default()
        };
        let err = unreadable
            .register(crate::bots::samples())
            .expect_err("unreadable CA");
        assert!(err.to_string().contains("--remote-bot-ca"), "{err}");
    }

    #[test]
    fn the_worker_token_is_never_printed() {
        let bots = RemoteBots {
            token: Some(SecretString::from("s3cret")),
            ..RemoteBots::default()
        };
        assert!(!format!("{bots:?}").contains("s3cret"));
    }

    /// A message `id` saying `text` in conversation `c1`, from `u1`.
    fn message(id: &str, text: &str) -> Activity {
        Activity {
            id: Some(id.into()),
            channel_id: Some("test".into()),
            conversation: Some(ConversationAccount {
                id: Some("c1".into()),
                ..Default::default()
            }),
            from: Some(ChannelAccount {
                id: Some("u1".into()),
                ..Default::default()
            }),
            ..Activity::message(text)
        }
    }

    /// The ids and texts of activities sent as JSON texts.
    fn sent(texts: &[String]) -> Vec<(String, String)> {
        texts
            .iter()
            .map(|text| {
                let activity: serde_json::Value = serde_json::from_str(text).expect("JSON");
                (
                    activity["id"].as_str().unwrap_or_default().to_owned(),
                    activity["text"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn the_superseded_messages_and_the_batch_reach_the_worker_in_order() {
        let bot = RemoteBot::new(
            "remote",
            Endpoint::from_static("http://127.0.0.1:1").connect_lazy(),
        );
        let incoming = IncomingActivity::parse(message("m3", "three")).expect("valid");
        let scope = || ScopeState::new(Scope::Conversation, JsonMap::new());

        let mut plain = TurnContext::new(&incoming, 1, scope(), None, None);
        let request = bot.request(&mut plain);
        assert!(request.superseded_json.is_empty() && request.batch_json.is_empty());

        let superseded = [message("m0", "zero"), message("m1", "one")];
        let mut interrupting =
            TurnContext::new(&incoming, 1, scope(), None, None).with_superseded(&superseded);
        let request = bot.request(&mut interrupting);
        let expected = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(id, text)| ((*id).to_owned(), (*text).to_owned()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            sent(&request.superseded_json),
            expected(&[("m0", "zero"), ("m1", "one")])
        );
        assert!(request.batch_json.is_empty());

        let batch = [
            message("m1", "one"),
            message("m2", "two"),
            message("m3", "three"),
        ];
        let mut coalesced = TurnContext::new(&incoming, 2, scope(), None, None).with_batch(&batch);
        let request = bot.request(&mut coalesced);
        let batch_sent = expected(&[("m1", "one"), ("m2", "two"), ("m3", "three")]);
        assert_eq!(sent(&request.batch_json), batch_sent);
        assert!(request.superseded_json.is_empty());
        // Each is the whole activity, written as `activity_json` is.
        assert_eq!(
            request.batch_json[2], request.activity_json,
            "the same activity, the same JSON"
        );

        // A streamed attempt's request carries them too.
        let streamed = stream_request(request);
        assert_eq!(sent(&streamed.batch_json), batch_sent);
        assert_eq!(streamed.attempt, 2);
        let streamed = stream_request(bot.request(&mut interrupting));
        assert_eq!(
            sent(&streamed.superseded_json),
            expected(&[("m0", "zero"), ("m1", "one")])
        );
    }

    #[test]
    fn json_objects_are_told_from_everything_else() {
        assert!(json_object(r#"{"a":1}"#).is_ok());
        assert_eq!(
            json_object("[1]").expect_err("an array"),
            "not a JSON object (a JSON array)"
        );
        assert!(
            json_object("{")
                .expect_err("truncated")
                .starts_with("not valid JSON"),
        );
    }
}
