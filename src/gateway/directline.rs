//! Direct Line 3.0, the subset Web Chat and `botframework-directlinejs` use, so that a browser
//! reaches a Turnstile bot without Azure: tokens (`/tokens/generate`, `/tokens/refresh`),
//! conversations (start, reconnect), posting an activity, and reading the transcript by
//! watermark (polling, or a WebSocket on the conversation's `streamUrl`).
//!
//! A posted activity is addressed as Direct Line addresses it (channel `directline`, the
//! conversation, a server-assigned id `{conversationId}|{seq}` and timestamp) and goes to
//! `ProcessTurn` like any channel's, with the retries of `/api/messages`, on a task of its own
//! with the bot's budget (`--bot-turn-timeout-ms`), among the gateway's background turns. Only when
//! the turn has committed are the bot's replies appended to the transcript, so no reply is ever
//! shown for state that was not saved. The POST waits for the turn as long as a call that waits
//! may (`--turn-timeout-ms`): a turn that commits within it has the user's activity and the replies
//! appended in one step, and one that fails within it leaves nothing a client could read (`502`,
//! `504`). A turn still running then — a language model writing for a minute — has the user's
//! activity appended at once and the POST answered, as Direct Line's own service does, so that no
//! client gives up on its POST (Web Chat does after 20 s); its replies follow when it commits.
//!
//! A bot that drafts its reply while it runs (a streamed turn) is shown as Web Chat shows a
//! livestream: while a client has the conversation's WebSocket open, a posted activity goes to
//! `StreamTurn` instead, and each draft is pushed to the open streams as an interim `typing`
//! activity (`channelData` `streamType` `streaming` or `informative`, `streamSequence` from 1, and
//! from the second on `streamId`, the first interim activity's id); the turn's last `message`
//! reply with text ends the livestream (`streamType` `final`, the `streamId`). Interim activities
//! are ephemeral, as Web Chat's livestreaming document asks: never in the transcript, so neither
//! a `GET …/activities` poll nor a reconnect sees them, and a poll-only client (Direct Line REST,
//! which ignores livestreams) gets `ProcessTurn` and the committed replies alone. A draft of an
//! attempt that is thrown away (a conflict) is erased in place by an interim activity with empty
//! text, which the replay's drafts then replace.
//!
//! A livestream can be stopped: `POST …/conversations/{id}/activities/{activityId}/stop` (an
//! extension of Direct Line's, for the chat page's Stop button; `{"shownText": …}` optional, the
//! text the client shows, else the last text pushed) stops the activity's turn (`StopTurn`), and
//! what was shown is the committed reply that ends the livestream and enters the transcript.
//!
//! Tokens are HS256 JWTs signed with the (first) Direct Line secret, each bound to one
//! conversation and expiring after [`TOKEN_LIFETIME`]; a client holding a token reaches only its
//! conversation, a client holding a secret reaches any. Without a secret and without an app id
//! (development) no credential is needed and tokens are signed with a key made at start.
//!
//! Conversations live in this process's memory, at most [`MAX_CONVERSATIONS`] of them (the
//! oldest started is forgotten first) with the last [`MAX_TRANSCRIPT`] activities each: several
//! gateway replicas need sticky sessions for Direct Line, and a restart ends every conversation
//! (the bot's state, kept by Turnstile, survives).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rand::Rng as _;
use rand::distr::Alphanumeric;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use subtle::ConstantTimeEq as _;
use tokio::sync::{broadcast, watch};
use tower_http::cors::{AllowHeaders, Any, CorsLayer};

use super::config::Secret;
use super::turns::{Shown, Turns};
use crate::grpc::pb;

/// How long a token is valid; clients refresh it before (`botframework-directlinejs` every 15
/// minutes), as Direct Line's own tokens last 30 minutes.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(30 * 60);
/// Conversations kept in memory; starting one more forgets the oldest.
pub const MAX_CONVERSATIONS: usize = 4096;
/// Activities kept per conversation; older ones can no longer be read.
pub const MAX_TRANSCRIPT: usize = 256;
/// Most activities one `GET …/activities` returns; the client reads on from the watermark.
const PAGE: usize = 100;
/// The channel id Direct Line gives its activities.
pub const CHANNEL_ID: &str = "directline";
/// The issuer and audience of this gateway's tokens.
const TOKEN_ISSUER: &str = "turnstile-directline";
/// Interim activities a stream may fall behind by before it skips some (each one carries the
/// whole text so far, so the next one makes up for those skipped).
const LIVE_BACKLOG: usize = 64;
/// How often an idle WebSocket is pinged, so that proxies keep it open and a dead client is
/// noticed.
const PING_INTERVAL: Duration = Duration::from_secs(30);

/// Who may use Direct Line.
#[derive(Debug)]
enum Keys {
    /// Callers present one of these secrets, or a token signed with the first.
    Secrets(Vec<Secret>),
    /// Development: open; tokens are still issued (clients expect them), signed with this key.
    Development(Vec<u8>),
}

/// Direct Line's state: the keys, the turn client, the conversations.
pub(super) struct DirectLine {
    keys: Keys,
    turns: Turns,
    /// The id the bot has in its activities' `recipient` and replies' `from`.
    bot_id: String,
    conversations: Mutex<Conversations>,
    /// Set when the gateway stops: streams close, so that they do not hold the shutdown.
    stopping: watch::Sender<bool>,
    /// The reply to a message refused while the bot still answers the one before.
    busy_text: String,
    /// How long a POST waits for its turn before answering and letting it run on.
    wait: Duration,
    /// Where the turns run, counted for the gateway's graceful shutdown.
    background: Arc<super::background::Background>,
}

impl std::fmt::Debug for DirectLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectLine")
            .field("bot_id", &self.bot_id)
            .finish_non_exhaustive()
    }
}

/// The conversations this process knows, oldest first in `started`.
#[derive(Default)]
struct Conversations {
    by_id: HashMap<String, Conversation>,
    started: VecDeque<String>,
}

/// One conversation's transcript: `transcript[i]` has watermark position `dropped + i`.
struct Conversation {
    user_id: String,
    /// The next activity's sequence number, for its id `{conversationId}|{seq}`.
    next_seq: u64,
    dropped: u64,
    transcript: VecDeque<Value>,
    /// The transcript's end position, watched by the conversation's WebSockets.
    appended: watch::Sender<u64>,
    /// Interim (livestream) activities, pushed to the open WebSockets and kept nowhere.
    live: broadcast::Sender<Value>,
    /// The activities whose turns are streaming, by id, with the text last pushed for each (a
    /// stop's default of what was shown).
    streaming: HashMap<String, String>,
}

impl Conversation {
    fn new(user_id: String) -> Self {
        Self {
            user_id,
            next_seq: 1,
            dropped: 0,
            transcript: VecDeque::new(),
            appended: watch::Sender::new(0),
            live: broadcast::channel(LIVE_BACKLOG).0,
            streaming: HashMap::new(),
        }
    }

    fn end(&self) -> u64 {
        self.dropped + self.transcript.len() as u64
    }

    fn next_id(&mut self, conversation_id: &str) -> String {
        let id = format!("{conversation_id}|{:07}", self.next_seq);
        self.next_seq += 1;
        id
    }

    /// The activities from watermark position `from` on (at most [`PAGE`]) and the watermark
    /// after them.
    fn page(&self, from: u64) -> (Vec<Value>, u64) {
        let skip = usize::try_from(from.saturating_sub(self.dropped)).unwrap_or(usize::MAX);
        let activities: Vec<Value> = self
            .transcript
            .iter()
            .skip(skip)
            .take(PAGE)
            .cloned()
            .collect();
        let watermark = from.max(self.dropped) + activities.len() as u64;
        (activities, watermark)
    }

    fn append(&mut self, activities: Vec<Value>) {
        self.transcript.extend(activities);
        while self.transcript.len() > MAX_TRANSCRIPT {
            self.transcript.pop_front();
            self.dropped += 1;
        }
        self.appended.send_replace(self.end());
    }
}

/// A token's claims: the conversation it opens and the user it speaks for.
#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    iss: String,
    aud: String,
    /// The conversation.
    conv: String,
    /// The user's id, which the token's holder posts as.
    user: String,
    iat: u64,
    nbf: u64,
    exp: u64,
}

/// Who is calling.
enum Caller {
    /// A holder of a Direct Line secret, or anyone in development: any conversation.
    Trusted,
    /// A holder of a token: its conversation only.
    Token(Claims),
}

/// Why a Direct Line call was refused.
#[derive(Debug, thiserror::Error)]
pub enum DirectLineError {
    /// No `Authorization: Bearer …` header.
    #[error("no Direct Line secret or token")]
    MissingCredentials,
    /// Not a secret, nor a token this gateway signed, or one for another conversation.
    #[error("the secret or token is not valid for this call")]
    Forbidden,
    /// A token that was valid once.
    #[error("the token has expired")]
    TokenExpired,
    /// The conversation was never started here, or was forgotten.
    #[error("no such conversation")]
    UnknownConversation,
    /// A stop's body is not `{"shownText": …}`.
    #[error("the body is not a stop (`{{\"shownText\": …}}`): {0}")]
    BadStop(String),
    /// A stop named an activity whose turn is not streaming here.
    #[error("no streaming turn of that activity here")]
    NotStreaming,
    /// The body is not an activity.
    #[error("the body is not an activity: {0}")]
    BadActivity(String),
    /// Turnstile did not run the turn.
    #[error("the turn failed: {0}")]
    Turn(tonic::Status),
    /// Too many turns run in the background already.
    #[error("{0} turns are already running here; try again shortly")]
    Full(usize),
    /// The bot answered with something that is not an activity.
    #[error("the bot's reply is not an activity: {0}")]
    BadReply(String),
    /// A token could not be signed.
    #[error("signing a token failed")]
    Signing(#[source] jsonwebtoken::errors::Error),
}

impl IntoResponse for DirectLineError {
    fn into_response(self) -> Response {
        use tonic::Code;
        let (status, code) = match &self {
            Self::MissingCredentials => (StatusCode::UNAUTHORIZED, "BadArgument"),
            Self::Forbidden => (StatusCode::FORBIDDEN, "BadArgument"),
            Self::TokenExpired => (StatusCode::FORBIDDEN, "TokenExpired"),
            Self::UnknownConversation | Self::NotStreaming => {
                (StatusCode::NOT_FOUND, "BadArgument")
            }
            Self::BadActivity(_) | Self::BadStop(_) => (StatusCode::BAD_REQUEST, "BadArgument"),
            Self::Turn(s) if s.code() == Code::InvalidArgument => {
                (StatusCode::BAD_REQUEST, "BadArgument")
            }
            Self::Turn(s) if s.code() == Code::DeadlineExceeded => {
                (StatusCode::GATEWAY_TIMEOUT, "BotTimeout")
            }
            Self::Turn(_) | Self::BadReply(_) => (StatusCode::BAD_GATEWAY, "BotError"),
            Self::Full(_) => (StatusCode::SERVICE_UNAVAILABLE, "ServiceError"),
            Self::Signing(_) => (StatusCode::INTERNAL_SERVER_ERROR, "ServiceError"),
        };
        if status.is_server_error() {
            tracing::warn!(error = %self, %status, "Direct Line call failed");
        } else {
            tracing::info!(error = %self, %status, "Direct Line call refused");
        }
        let body = json!({"error": {"code": code, "message": self.to_string()}});
        (status, axum::Json(body)).into_response()
    }
}

impl DirectLine {
    /// Direct Line for `secrets`, or open (development) when there are none.
    pub(super) fn new(secrets: Vec<Secret>, turns: Turns, bot: &str) -> Self {
        let keys = if secrets.is_empty() {
            let mut key = vec![0u8; 32];
            rand::rng().fill(&mut key[..]);
            Keys::Development(key)
        } else {
            Keys::Secrets(secrets)
        };
        Self {
            keys,
            turns,
            bot_id: if bot.is_empty() { "bot" } else { bot }.to_owned(),
            conversations: Mutex::default(),
            stopping: watch::Sender::new(false),
            busy_text: super::config::BUSY_TEXT.to_owned(),
            wait: Duration::from_secs(8),
            background: super::background::Background::new(1000),
        }
    }

    /// The same, running its turns among `background`'s (the gateway's, which a graceful
    /// shutdown waits for), each POST waiting `wait` for its turn before it answers.
    #[must_use]
    pub(super) fn running_in(
        mut self,
        background: Arc<super::background::Background>,
        wait: Duration,
    ) -> Self {
        self.background = background;
        self.wait = wait;
        self
    }

    /// The same, telling a user whose message is refused while the bot still answers the one
    /// before `text`.
    #[must_use]
    pub(super) fn with_busy_text(mut self, text: &str) -> Self {
        text.clone_into(&mut self.busy_text);
        self
    }

    /// Closes every stream, now and from now on.
    pub(super) fn stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Whether callers need no credential.
    pub(super) fn is_open(&self) -> bool {
        matches!(self.keys, Keys::Development(_))
    }

    fn signing_key(&self) -> &[u8] {
        match &self.keys {
            Keys::Secrets(secrets) => secrets.first().map_or(&[][..], |s| s.expose().as_bytes()),
            Keys::Development(key) => key,
        }
    }

    /// The caller the `Authorization` header names.
    fn caller(&self, headers: &HeaderMap) -> Result<Caller, DirectLineError> {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|h| h.to_str().ok())
            .and_then(|h| {
                h.strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let Some(bearer) = bearer else {
            return if self.is_open() {
                Ok(Caller::Trusted)
            } else {
                Err(DirectLineError::MissingCredentials)
            };
        };
        if let Keys::Secrets(secrets) = &self.keys
            && secrets
                .iter()
                .any(|s| bool::from(s.expose().as_bytes().ct_eq(bearer.as_bytes())))
        {
            return Ok(Caller::Trusted);
        }
        match self.verify(bearer) {
            Ok(claims) => Ok(Caller::Token(claims)),
            // In development a stale token (from before a restart) is no reason to refuse.
            Err(_) if self.is_open() => Ok(Caller::Trusted),
            Err(e) => Err(e),
        }
    }

    fn verify(&self, token: &str) -> Result<Claims, DirectLineError> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_issuer(&[TOKEN_ISSUER]);
        validation.set_audience(&[TOKEN_ISSUER]);
        validation.leeway = 30;
        let keys: Vec<&[u8]> = match &self.keys {
            Keys::Secrets(secrets) => secrets.iter().map(|s| s.expose().as_bytes()).collect(),
            Keys::Development(key) => vec![key],
        };
        let mut expired = false;
        for key in keys {
            match jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(key), &validation)
            {
                Ok(data) => return Ok(data.claims),
                Err(e) if *e.kind() == jsonwebtoken::errors::ErrorKind::ExpiredSignature => {
                    expired = true;
                }
                Err(_) => {}
            }
        }
        Err(if expired {
            DirectLineError::TokenExpired
        } else {
            DirectLineError::Forbidden
        })
    }

    fn token(&self, conversation_id: &str, user_id: &str) -> Result<String, DirectLineError> {
        let now = unix_now();
        let claims = Claims {
            iss: TOKEN_ISSUER.to_owned(),
            aud: TOKEN_ISSUER.to_owned(),
            conv: conversation_id.to_owned(),
            user: user_id.to_owned(),
            iat: now,
            nbf: now,
            exp: now + TOKEN_LIFETIME.as_secs(),
        };
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(self.signing_key()),
        )
        .map_err(DirectLineError::Signing)
    }

    fn conversations(&self) -> MutexGuard<'_, Conversations> {
        // A panic while holding the lock cannot leave a conversation half-changed (every change
        // is one push or one append), so a poisoned lock is still usable.
        self.conversations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers a new conversation for `user_id`, forgetting the oldest beyond the bound.
    fn start(&self, user_id: Option<String>) -> (String, String) {
        let conversation_id = random_id(22);
        let user_id = user_id.unwrap_or_else(|| format!("dl_{}", random_id(16)));
        let mut all = self.conversations();
        all.by_id
            .insert(conversation_id.clone(), Conversation::new(user_id.clone()));
        all.started.push_back(conversation_id.clone());
        while all.started.len() > MAX_CONVERSATIONS {
            if let Some(oldest) = all.started.pop_front() {
                all.by_id.remove(&oldest);
            }
        }
        (conversation_id, user_id)
    }

    /// `conversation_id`'s user, when the conversation exists and `caller` may use it.
    fn authorize(&self, caller: &Caller, conversation_id: &str) -> Result<String, DirectLineError> {
        if let Caller::Token(claims) = caller
            && claims.conv != conversation_id
        {
            return Err(DirectLineError::Forbidden);
        }
        self.user_of(conversation_id)
    }

    /// The user of `conversation_id`, when this process knows the conversation.
    fn user_of(&self, conversation_id: &str) -> Result<String, DirectLineError> {
        self.conversations()
            .by_id
            .get(conversation_id)
            .map(|c| c.user_id.clone())
            .ok_or(DirectLineError::UnknownConversation)
    }

    /// What a started or resumed conversation's client needs.
    fn conversation_answer(
        &self,
        headers: &HeaderMap,
        conversation_id: &str,
        user_id: &str,
        watermark: Option<u64>,
    ) -> Result<Value, DirectLineError> {
        let token = self.token(conversation_id, user_id)?;
        // A reconnecting client's stream starts where its reading stopped.
        let resume = watermark.map_or_else(String::new, |w| format!("&watermark={w}"));
        // Behind a proxy that terminates TLS, the page is on https and may only open wss.
        let scheme = match headers
            .get("x-forwarded-proto")
            .and_then(|h| h.to_str().ok())
        {
            Some(proto) if proto.eq_ignore_ascii_case("https") => "wss",
            _ => "ws",
        };
        let stream_url = headers
            .get("x-forwarded-host")
            .or_else(|| headers.get(header::HOST))
            .and_then(|h| h.to_str().ok())
            .map(|host| {
                format!(
                    "{scheme}://{host}/v3/directline/conversations/{conversation_id}/stream?t={token}{resume}"
                )
            });
        Ok(json!({
            "conversationId": conversation_id,
            "token": token,
            "expires_in": TOKEN_LIFETIME.as_secs(),
            "streamUrl": stream_url,
        }))
    }

    /// Pushes what a streamed turn shows to `conversation_id`'s open streams as an interim
    /// activity of `livestream`, replying to `reply_to`.
    fn show(
        &self,
        conversation_id: &str,
        reply_to: &str,
        livestream: &mut Livestream,
        shown: Shown,
    ) {
        let (stream_type, text) = match shown {
            Shown::Status(text) => ("informative", text),
            Shown::Text(text) => ("streaming", text),
            // Nothing shown yet, nothing to take back.
            Shown::Void if livestream.id.is_none() => return,
            Shown::Void => ("streaming", String::new()),
        };
        let mut all = self.conversations();
        let Some(conversation) = all.by_id.get_mut(conversation_id) else {
            return;
        };
        if stream_type == "streaming" {
            conversation
                .streaming
                .insert(reply_to.to_owned(), text.clone());
        }
        let id = conversation.next_id(conversation_id);
        livestream.sequence += 1;
        let mut stream_info = json!({
            "streamType": stream_type,
            "streamSequence": livestream.sequence,
        });
        match &livestream.id {
            Some(stream_id) => stream_info["streamId"] = json!(stream_id),
            None => livestream.id = Some(id.clone()),
        }
        let mut entity = stream_info.clone();
        entity["type"] = json!("streaminfo");
        let interim = json!({
            "type": "typing",
            "id": id,
            "timestamp": rfc3339(SystemTime::now()),
            "channelId": CHANNEL_ID,
            "conversation": {"id": conversation_id},
            "from": {"id": self.bot_id, "name": self.bot_id, "role": "bot"},
            "replyToId": reply_to,
            "text": text,
            "channelData": stream_info,
            "entities": [entity],
        });
        // No open stream: nobody to show it to, and nothing to keep.
        let _ = conversation.live.send(interim);
    }

    /// Runs the turn for `body` in `conversation_id` and appends it and its replies to the
    /// transcript once it committed; returns the activity's id.
    async fn post_activity(
        self: &Arc<Self>,
        conversation_id: &str,
        user_id: &str,
        token_user: Option<&str>,
        body: &[u8],
    ) -> Result<String, DirectLineError> {
        let mut activity: Value = serde_json::from_slice(body)
            .map_err(|e| DirectLineError::BadActivity(e.to_string()))?;
        let Some(fields) = activity.as_object_mut() else {
            return Err(DirectLineError::BadActivity("not a JSON object".into()));
        };
        let id = {
            let mut all = self.conversations();
            all.by_id
                .get_mut(conversation_id)
                .ok_or(DirectLineError::UnknownConversation)?
                .next_id(conversation_id)
        };
        fields.insert("id".into(), json!(id));
        fields.insert("timestamp".into(), json!(rfc3339(SystemTime::now())));
        fields.insert("channelId".into(), json!(CHANNEL_ID));
        fields.insert("conversation".into(), json!({"id": conversation_id}));
        // A token's user is who its holder is; otherwise the client names the user, as Direct
        // Line lets a secret's holder do.
        let from = match (token_user, fields.get("from")) {
            (Some(user), Some(Value::Object(from))) => {
                let mut from = from.clone();
                from.insert("id".into(), json!(user));
                Value::Object(from)
            }
            (Some(user), _) => json!({"id": user}),
            (None, Some(Value::Object(from))) if from.get("id").is_some_and(Value::is_string) => {
                Value::Object(from.clone())
            }
            (None, _) => json!({"id": user_id}),
        };
        fields.insert("from".into(), from);
        fields.insert(
            "recipient".into(),
            json!({"id": self.bot_id, "name": self.bot_id, "role": "bot"}),
        );
        // The turn runs on a task of its own, within the bot's budget, and writes its outcome into
        // the transcript itself; the POST waits for it as long as a call that waits may.
        let echo = Arc::new(Echo::default());
        let (ended, outcome) = tokio::sync::oneshot::channel();
        let turn = {
            let (dl, conversation_id, id, echo) = (
                Arc::clone(self),
                conversation_id.to_owned(),
                id.clone(),
                Arc::clone(&echo),
            );
            async move {
                let result = dl.run_turn(&conversation_id, &id, activity, &echo).await;
                if let Err(error) = &result {
                    if echo.is_echoed() {
                        tracing::warn!(%error, "a Direct Line turn failed after its POST was answered");
                    }
                }
                let _ = ended.send(result);
            }
        };
        self.background
            .spawn(None, turn)
            .map_err(|full| DirectLineError::Full(full.limit))?;
        match tokio::time::timeout(self.wait, outcome).await {
            Ok(Ok(result)) => result.map(|()| id),
            Ok(Err(_)) => Err(DirectLineError::BadReply(
                "the turn's task ended without an outcome".into(),
            )),
            // Still running: the user's message goes into the transcript now, as Direct Line's
            // own service puts it there, and the replies follow when the turn has committed.
            Err(_) => {
                self.echo(conversation_id, &id, &echo)?;
                Ok(id)
            }
        }
    }

    /// Appends the user's activity of a turn still running, once (see [`Echo`]).
    fn echo(&self, conversation_id: &str, id: &str, echo: &Echo) -> Result<(), DirectLineError> {
        let mut all = self.conversations();
        let conversation = all
            .by_id
            .get_mut(conversation_id)
            .ok_or(DirectLineError::UnknownConversation)?;
        let mut pending = echo.lock();
        if let Some(activity) = pending.take() {
            conversation.append(vec![activity]);
            tracing::debug!(id, "the turn runs on; its activity is in the transcript");
        }
        Ok(())
    }

    /// Runs the turn of `activity` (id `id`) in `conversation_id`, streaming it to the open
    /// WebSockets when any is open, and appends it and its replies to the transcript once it
    /// committed — or only the replies, when the activity was echoed meanwhile.
    async fn run_turn(
        &self,
        conversation_id: &str,
        id: &str,
        activity: Value,
        echo: &Echo,
    ) -> Result<(), DirectLineError> {
        let text = activity.to_string();
        echo.park(activity);
        let mut livestream = Livestream::default();
        let response = match self
            .process_or_stream(conversation_id, id, &text, &mut livestream)
            .await
        {
            // Refused, nothing committed: the user's message and why, in the transcript.
            Err(status) if super::turns::is_busy(&status) => pb::ProcessTurnResponse {
                activities_json: vec![
                    json!({"type": "message", "text": self.busy_text}).to_string(),
                ],
                ..pb::ProcessTurnResponse::default()
            },
            response => response.map_err(DirectLineError::Turn)?,
        };
        let mut appended = self.addressed_replies(conversation_id, id, response)?;
        if let Some(stream_id) = &livestream.id {
            let last_text = appended.iter_mut().rev().find(|reply| {
                reply["type"] == "message" && reply["text"].as_str().is_some_and(|t| !t.is_empty())
            });
            match last_text {
                Some(reply) => end_livestream(reply, stream_id),
                // Nothing takes the draft's place: erase it.
                None => self.show(conversation_id, id, &mut livestream, Shown::Void),
            }
        }
        self.append_turn(conversation_id, appended, echo)
    }

    /// Runs the turn of `text`, its drafts pushed to `livestream` when a WebSocket is open.
    async fn process_or_stream(
        &self,
        conversation_id: &str,
        id: &str,
        text: &str,
        livestream: &mut Livestream,
    ) -> Result<pb::ProcessTurnResponse, tonic::Status> {
        let turn_conversation = Some((CHANNEL_ID, conversation_id));
        // Nobody could see a draft without an open stream: polling clients ignore livestreams.
        let watched = self
            .conversations()
            .by_id
            .get(conversation_id)
            .is_some_and(|c| c.live.receiver_count() > 0);
        if !watched {
            return self.turns.process(text, turn_conversation).await;
        }
        if let Some(conversation) = self.conversations().by_id.get_mut(conversation_id) {
            conversation.streaming.insert(id.to_owned(), String::new());
        }
        let response = self
            .turns
            .stream(text, turn_conversation, |shown| {
                self.show(conversation_id, id, livestream, shown);
            })
            .await;
        if let Some(conversation) = self.conversations().by_id.get_mut(conversation_id) {
            conversation.streaming.remove(id);
        }
        response
    }

    /// The turn's replies, but `trace`, addressed as Direct Line's replies to activity `id`.
    fn addressed_replies(
        &self,
        conversation_id: &str,
        id: &str,
        response: pb::ProcessTurnResponse,
    ) -> Result<Vec<Value>, DirectLineError> {
        let mut appended = Vec::with_capacity(response.activities_json.len() + 1);
        for json in response.activities_json {
            let mut reply: Value = serde_json::from_str(&json)
                .map_err(|e| DirectLineError::BadReply(e.to_string()))?;
            let Some(fields) = reply.as_object_mut() else {
                return Err(DirectLineError::BadReply("not a JSON object".into()));
            };
            // Diagnostics for the Emulator only, as on `/api/messages`.
            if fields.get("type").and_then(Value::as_str) == Some("trace") {
                continue;
            }
            fields
                .entry("timestamp")
                .or_insert_with(|| json!(rfc3339(SystemTime::now())));
            fields.insert("channelId".into(), json!(CHANNEL_ID));
            fields.insert("conversation".into(), json!({"id": conversation_id}));
            fields
                .entry("from")
                .or_insert_with(|| json!({"id": self.bot_id, "name": self.bot_id, "role": "bot"}));
            fields.entry("replyToId").or_insert_with(|| json!(id));
            appended.push(reply);
        }
        Ok(appended)
    }

    /// Appends a committed turn's replies, `appended`, to the transcript, each given its id.
    fn append_turn(
        &self,
        conversation_id: &str,
        mut appended: Vec<Value>,
        echo: &Echo,
    ) -> Result<(), DirectLineError> {
        let mut all = self.conversations();
        // Forgotten while the turn ran: the turn committed, but nobody can read it here.
        let conversation = all
            .by_id
            .get_mut(conversation_id)
            .ok_or(DirectLineError::UnknownConversation)?;
        for reply in &mut appended {
            if let Some(fields) = reply.as_object_mut() {
                fields.insert("id".into(), json!(conversation.next_id(conversation_id)));
            }
        }
        // The user's activity first, unless it was echoed while the turn ran.
        if let Some(activity) = echo.lock().take() {
            appended.insert(0, activity);
        }
        conversation.append(appended);
        Ok(())
    }
}

/// The user's activity of a turn, until it is in the transcript: appended with the replies when
/// the turn commits within the POST's wait, or on its own when the wait ends first (the echo),
/// whichever comes first, under the conversations' lock, so never twice.
#[derive(Debug, Default)]
struct Echo(Mutex<Option<Value>>);

impl Echo {
    fn park(&self, activity: Value) {
        *self.lock() = Some(activity);
    }

    fn is_echoed(&self) -> bool {
        self.lock().is_none()
    }

    fn lock(&self) -> MutexGuard<'_, Option<Value>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl DirectLine {
    /// Stops the streaming turn of activity `activity_id` in `conversation_id` at `shown`, the
    /// text its client shows (else the last text pushed): its committed reply, which ends the
    /// livestream, is what was shown.
    async fn stop_turn(
        &self,
        conversation_id: &str,
        activity_id: &str,
        shown: Option<String>,
    ) -> Result<&'static str, DirectLineError> {
        let pushed = self
            .conversations()
            .by_id
            .get(conversation_id)
            .ok_or(DirectLineError::UnknownConversation)?
            .streaming
            .get(activity_id)
            .cloned()
            .ok_or(DirectLineError::NotStreaming)?;
        let shown = shown.unwrap_or(pushed);
        let result = self
            .turns
            .stop((CHANNEL_ID, conversation_id), activity_id, Some(shown))
            .await;
        Ok(match result {
            Some(pb::StopTurnResult::Stopped) => "stopped",
            Some(pb::StopTurnResult::TooLate) => "tooLate",
            _ => "notRunning",
        })
    }
}

/// One turn's livestream: its id (the first interim activity's) once one was pushed, and the
/// last sequence number used.
#[derive(Debug, Default)]
struct Livestream {
    id: Option<String>,
    sequence: u32,
}

/// Makes `reply` the final activity of the livestream `stream_id`: it replaces the drafts.
fn end_livestream(reply: &mut Value, stream_id: &str) {
    let Some(fields) = reply.as_object_mut() else {
        return;
    };
    let channel_data = fields.entry("channelData").or_insert_with(|| json!({}));
    if let Some(channel_data) = channel_data.as_object_mut() {
        channel_data.insert("streamId".into(), json!(stream_id));
        channel_data.insert("streamType".into(), json!("final"));
    }
    let entity = json!({"type": "streaminfo", "streamId": stream_id, "streamType": "final"});
    match fields.entry("entities").or_insert_with(|| json!([])) {
        Value::Array(entities) => entities.push(entity),
        other => *other = json!([entity]),
    }
}

/// The Direct Line routes under `/v3/directline`, answering browsers from any origin (as Direct
/// Line does: a page anywhere embeds Web Chat).
pub(super) fn routes(direct_line: Arc<DirectLine>) -> Router {
    Router::new()
        .route("/v3/directline/tokens/generate", post(generate))
        .route("/v3/directline/tokens/refresh", post(refresh))
        .route("/v3/directline/conversations", post(start))
        .route("/v3/directline/conversations/{id}", get(reconnect))
        .route(
            "/v3/directline/conversations/{id}/activities",
            post(post_activity).get(activities),
        )
        .route(
            "/v3/directline/conversations/{id}/activities/{activity_id}/stop",
            post(stop_activity),
        )
        .route("/v3/directline/conversations/{id}/stream", get(stream))
        .layer(cors())
        .with_state(direct_line)
}

/// The optional body of `tokens/generate` and `conversations`.
#[derive(Debug, Default, Deserialize)]
struct StartBody {
    user: Option<StartUser>,
}

#[derive(Debug, Default, Deserialize)]
struct StartUser {
    id: Option<String>,
}

fn requested_user(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<StartBody>(body)
        .ok()?
        .user?
        .id
        .filter(|id| !id.is_empty())
}

#[tracing::instrument(skip_all)]
async fn generate(
    State(dl): State<Arc<DirectLine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, DirectLineError> {
    let Caller::Trusted = dl.caller(&headers)? else {
        // A token cannot mint tokens: that would extend it forever to other conversations.
        return Err(DirectLineError::Forbidden);
    };
    let (conversation_id, user_id) = dl.start(requested_user(&body));
    let token = dl.token(&conversation_id, &user_id)?;
    Ok(axum::Json(json!({
        "conversationId": conversation_id,
        "token": token,
        "expires_in": TOKEN_LIFETIME.as_secs(),
    }))
    .into_response())
}

#[tracing::instrument(skip_all)]
async fn refresh(
    State(dl): State<Arc<DirectLine>>,
    headers: HeaderMap,
) -> Result<Response, DirectLineError> {
    let Caller::Token(claims) = dl.caller(&headers)? else {
        return Err(DirectLineError::Forbidden);
    };
    // A forgotten conversation's token is not renewed: the 404 ends the client's refresh loop.
    dl.user_of(&claims.conv)?;
    let token = dl.token(&claims.conv, &claims.user)?;
    Ok(axum::Json(json!({
        "conversationId": claims.conv,
        "token": token,
        "expires_in": TOKEN_LIFETIME.as_secs(),
    }))
    .into_response())
}

#[tracing::instrument(skip_all, fields(conversation = tracing::field::Empty))]
async fn start(
    State(dl): State<Arc<DirectLine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, DirectLineError> {
    let (conversation_id, user_id, status) = match dl.caller(&headers)? {
        Caller::Trusted => {
            let (conversation_id, user_id) = dl.start(requested_user(&body));
            (conversation_id, user_id, StatusCode::CREATED)
        }
        // A generated token's conversation was registered when the token was made.
        Caller::Token(claims) => {
            dl.user_of(&claims.conv)?;
            (claims.conv, claims.user, StatusCode::OK)
        }
    };
    tracing::Span::current().record("conversation", conversation_id.as_str());
    let answer = dl.conversation_answer(&headers, &conversation_id, &user_id, None)?;
    Ok((status, axum::Json(answer)).into_response())
}

/// `?watermark=`: a position in the transcript, as a decimal string; empty or absent is 0.
#[derive(Debug, Default, Deserialize)]
struct WatermarkQuery {
    watermark: Option<String>,
}

impl WatermarkQuery {
    fn position(&self) -> u64 {
        self.watermark
            .as_deref()
            .and_then(|w| w.trim().parse().ok())
            .unwrap_or(0)
    }
}

#[tracing::instrument(skip_all, fields(conversation = %id))]
async fn reconnect(
    State(dl): State<Arc<DirectLine>>,
    Path(id): Path<String>,
    Query(query): Query<WatermarkQuery>,
    headers: HeaderMap,
) -> Result<Response, DirectLineError> {
    let caller = dl.caller(&headers)?;
    let user_id = dl.authorize(&caller, &id)?;
    let watermark = query.watermark.is_some().then(|| query.position());
    let answer = dl.conversation_answer(&headers, &id, &user_id, watermark)?;
    Ok(axum::Json(answer).into_response())
}

#[tracing::instrument(skip_all, fields(conversation = %id))]
async fn post_activity(
    State(dl): State<Arc<DirectLine>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, DirectLineError> {
    let caller = dl.caller(&headers)?;
    let user_id = dl.authorize(&caller, &id)?;
    let token_user = match &caller {
        Caller::Token(claims) => Some(claims.user.as_str()),
        Caller::Trusted => None,
    };
    let activity_id = dl.post_activity(&id, &user_id, token_user, &body).await?;
    Ok(axum::Json(json!({ "id": activity_id })).into_response())
}

/// The optional body of a stop: what the client shows.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StopBody {
    shown_text: Option<String>,
}

#[tracing::instrument(skip_all, fields(conversation = %id))]
async fn stop_activity(
    State(dl): State<Arc<DirectLine>>,
    Path((id, activity_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, DirectLineError> {
    let caller = dl.caller(&headers)?;
    dl.authorize(&caller, &id)?;
    let stop: StopBody = if body.iter().all(u8::is_ascii_whitespace) {
        StopBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| DirectLineError::BadStop(e.to_string()))?
    };
    let result = dl.stop_turn(&id, &activity_id, stop.shown_text).await?;
    Ok(axum::Json(json!({ "result": result })).into_response())
}

#[tracing::instrument(skip_all, fields(conversation = %id))]
async fn activities(
    State(dl): State<Arc<DirectLine>>,
    Path(id): Path<String>,
    Query(query): Query<WatermarkQuery>,
    headers: HeaderMap,
) -> Result<Response, DirectLineError> {
    let caller = dl.caller(&headers)?;
    dl.authorize(&caller, &id)?;
    let (activities, watermark) = dl
        .conversations()
        .by_id
        .get(&id)
        .ok_or(DirectLineError::UnknownConversation)?
        .page(query.position());
    Ok(axum::Json(json!({
        "activities": activities,
        "watermark": watermark.to_string(),
    }))
    .into_response())
}

/// `?t=`: browsers cannot set headers on a WebSocket, so the stream URL carries the token.
#[derive(Debug, Deserialize)]
struct StreamQuery {
    t: Option<String>,
    watermark: Option<String>,
}

#[tracing::instrument(skip_all, fields(conversation = %id))]
async fn stream(
    State(dl): State<Arc<DirectLine>>,
    Path(id): Path<String>,
    Query(query): Query<StreamQuery>,
    upgrade: WebSocketUpgrade,
) -> Result<Response, DirectLineError> {
    let mut headers = HeaderMap::new();
    if let Some(token) = &query.t
        && let Ok(value) = HeaderValue::from_str(&format!("Bearer {token}"))
    {
        headers.insert(header::AUTHORIZATION, value);
    }
    let caller = dl.caller(&headers)?;
    dl.authorize(&caller, &id)?;
    let from = WatermarkQuery {
        watermark: query.watermark,
    }
    .position();
    let (appended, live) = {
        let all = dl.conversations();
        let conversation = all
            .by_id
            .get(&id)
            .ok_or(DirectLineError::UnknownConversation)?;
        (
            conversation.appended.subscribe(),
            conversation.live.subscribe(),
        )
    };
    Ok(upgrade.on_upgrade(move |socket| push_activities(dl, id, from, appended, live, socket)))
}

/// Sends every activity from `from` on to `socket` as `{activities, watermark}`, as they are
/// appended, and each interim activity as it comes (`{activities}`, no watermark: it is not in
/// the transcript), until the client goes away or the conversation is forgotten.
async fn push_activities(
    dl: Arc<DirectLine>,
    id: String,
    mut from: u64,
    mut appended: watch::Receiver<u64>,
    mut live: broadcast::Receiver<Value>,
    mut socket: WebSocket,
) {
    let mut ping = tokio::time::interval(PING_INTERVAL);
    ping.tick().await;
    let mut stopping = dl.stopping.subscribe();
    if *stopping.borrow_and_update() {
        let _ = socket.send(Message::Close(None)).await;
        return;
    }
    loop {
        // Interim activities first: a turn's drafts are all pushed before its commit appends
        // the final reply, so they reach the client before it.
        if !send_waiting_interims(&mut live, &mut socket).await {
            return;
        }
        if !send_appended(&dl, &id, &mut from, &mut socket).await {
            return;
        }
        tokio::select! {
            interim = live.recv() => match interim {
                Ok(interim) => {
                    if !send_interim(&mut socket, interim).await {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                // The conversation was forgotten.
                Err(broadcast::error::RecvError::Closed) => {
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
            },
            changed = appended.changed() => {
                if changed.is_err() {
                    // The conversation was forgotten.
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
            }
            _ = stopping.changed() => {
                let _ = socket.send(Message::Close(None)).await;
                return;
            }
            _ = ping.tick() => {
                if socket.send(Message::Ping(Bytes::new())).await.is_err() {
                    return;
                }
            }
            received = socket.recv() => match received {
                // Web Chat sends empty messages to notice a broken connection; nothing to do.
                Some(Ok(Message::Close(_)) | Err(_)) | None => return,
                Some(Ok(_)) => {}
            },
        }
    }
}

/// Sends the interim activities already waiting in `live`; false when the client is gone.
async fn send_waiting_interims(
    live: &mut broadcast::Receiver<Value>,
    socket: &mut WebSocket,
) -> bool {
    loop {
        let interim = match live.try_recv() {
            Ok(interim) => interim,
            Err(broadcast::error::TryRecvError::Lagged(_)) => continue,
            Err(_) => return true,
        };
        if !send_interim(socket, interim).await {
            return false;
        }
    }
}

/// Sends the transcript from `from` on, moving `from` past it; false when the client is gone or
/// the conversation was forgotten (the socket then closed).
async fn send_appended(dl: &DirectLine, id: &str, from: &mut u64, socket: &mut WebSocket) -> bool {
    loop {
        let page = dl.conversations().by_id.get(id).map(|c| c.page(*from));
        let Some((activities, watermark)) = page else {
            let _ = socket.send(Message::Close(None)).await;
            return false;
        };
        if activities.is_empty() {
            return true;
        }
        *from = watermark;
        let group = json!({"activities": activities, "watermark": watermark.to_string()});
        if socket
            .send(Message::Text(group.to_string().into()))
            .await
            .is_err()
        {
            return false;
        }
    }
}

/// Sends one interim activity as a group of its own; false when the client is gone.
async fn send_interim(socket: &mut WebSocket, interim: Value) -> bool {
    let group = json!({ "activities": [interim] });
    socket
        .send(Message::Text(group.to_string().into()))
        .await
        .is_ok()
}

/// Lets pages on any origin call Direct Line, as the real service does: answers preflights and
/// marks every answer readable cross-origin. Credentials travel in `Authorization`, never in
/// cookies, so a wildcard origin gives a foreign page nothing it could not send itself. A
/// preflight's headers are allowed as asked, because a wildcard would not cover `Authorization`;
/// a browser may keep the answer for a day. No `Vary`: every origin gets the same answer.
fn cors() -> CorsLayer {
    CorsLayer::new()
        .allow_origin(Any)
        .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
        .allow_headers(AllowHeaders::mirror_request())
        .max_age(Duration::from_secs(24 * 60 * 60))
        .vary([])
}

fn random_id(len: usize) -> String {
    rand::rng()
        .sample_iter(Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `2026-11-23T13:25:00.123Z`: the UTC timestamp format activities carry. A clock set before
/// 1970 gives the epoch rather than a panic in a handler.
fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at.max(UNIX_EPOCH)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_rfc3339() {
        let at = UNIX_EPOCH + Duration::from_millis(1_795_958_700_123);
        assert_eq!(rfc3339(at), "2026-11-29T13:25:00.123Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339(before), "1970-01-01T00:00:00.000Z");
    }

    #[tokio::test]
    async fn pages_on_any_origin_may_call_direct_line() {
        use tower::ServiceExt as _;

        let config = super::super::GatewayConfig::development("http://127.0.0.1:9");
        let dl = DirectLine::new(Vec::new(), Turns::new(&config).expect("client"), "");
        let app = routes(Arc::new(dl));
        let asked = "authorization,content-type,x-ms-bot-agent";
        let preflight = axum::http::Request::options("/v3/directline/conversations")
            .header(header::ORIGIN, "https://shop.example")
            .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
            .header(header::ACCESS_CONTROL_REQUEST_HEADERS, asked)
            .body(axum::body::Body::empty())
            .expect("request");
        let answer = app.clone().oneshot(preflight).await.expect("answer");
        assert!(answer.status().is_success(), "{}", answer.status());
        let headers = answer.headers();
        assert_eq!(headers[header::ACCESS_CONTROL_ALLOW_ORIGIN], "*");
        assert_eq!(headers[header::ACCESS_CONTROL_ALLOW_HEADERS], asked);
        assert_eq!(
            headers[header::ACCESS_CONTROL_ALLOW_METHODS],
            "GET,POST,OPTIONS"
        );
        assert_eq!(headers[header::ACCESS_CONTROL_MAX_AGE], "86400");

        let start = axum::http::Request::post("/v3/directline/conversations")
            .header(header::ORIGIN, "https://shop.example")
            .body(axum::body::Body::empty())
            .expect("request");
        let answer = app.oneshot(start).await.expect("answer");
        assert!(answer.status().is_success(), "{}", answer.status());
        assert_eq!(answer.headers()[header::ACCESS_CONTROL_ALLOW_ORIGIN], "*");
    }

    #[tokio::test]
    async fn the_oldest_conversation_is_forgotten_beyond_the_bound() {
        let config = super::super::GatewayConfig::development("http://127.0.0.1:9");
        let dl = DirectLine::new(Vec::new(), Turns::new(&config).expect("client"), "");
        let (first, _) = dl.start(None);
        let (second, _) = dl.start(Some("dl_ada".into()));
        assert_eq!(dl.user_of(&second).expect("known"), "dl_ada");
        for _ in 0..MAX_CONVERSATIONS - 1 {
            dl.start(None);
        }
        assert!(matches!(
            dl.user_of(&first),
            Err(DirectLineError::UnknownConversation)
        ));
        assert!(dl.user_of(&second).is_ok(), "only the oldest goes");
        assert_eq!(dl.conversations().by_id.len(), MAX_CONVERSATIONS);
    }

    #[test]
    fn stream_urls_follow_the_proxy_scheme_and_host() {
        let config = super::super::GatewayConfig::development("http://127.0.0.1:9");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let _guard = runtime.enter();
        let dl = DirectLine::new(Vec::new(), Turns::new(&config).expect("client"), "");
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("10.0.0.5:3978"));
        let direct = dl
            .conversation_answer(&headers, "c1", "u", None)
            .expect("answer");
        assert!(
            direct["streamUrl"]
                .as_str()
                .expect("url")
                .starts_with("ws://10.0.0.5:3978/v3/directline/conversations/c1/stream?t=")
        );
        headers.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        headers.insert("x-forwarded-host", HeaderValue::from_static("bot.example"));
        let proxied = dl
            .conversation_answer(&headers, "c1", "u", None)
            .expect("answer");
        assert!(
            proxied["streamUrl"]
                .as_str()
                .expect("url")
                .starts_with("wss://bot.example/v3/directline/conversations/c1/stream?t=")
        );
    }

    #[test]
    fn pages_follow_the_watermark_past_dropped_activities() {
        let mut conversation = Conversation::new("u".into());
        conversation.append((0..MAX_TRANSCRIPT as u64 + 10).map(|i| json!(i)).collect());
        assert_eq!(conversation.dropped, 10);
        let (first, watermark) = conversation.page(0);
        assert_eq!(first.first(), Some(&json!(10)), "dropped ones are gone");
        assert_eq!(watermark, 10 + PAGE as u64);
        let (rest, end) = conversation.page(watermark);
        assert_eq!(rest.first(), Some(&json!(10 + PAGE as u64)));
        let (none, same) = conversation.page(MAX_TRANSCRIPT as u64 + 10);
        assert!(none.is_empty());
        assert_eq!(same, MAX_TRANSCRIPT as u64 + 10);
        assert!(end <= same);
    }
}
