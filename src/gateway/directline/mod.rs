//! Direct Line 3.0, the subset Web Chat and `botframework-directlinejs` use, so that a browser
//! reaches a Turnstile bot without Azure: tokens (`/tokens/generate`, `/tokens/refresh`),
//! conversations (start, reconnect), posting an activity, and reading the transcript by
//! watermark (polling, or a WebSocket on the conversation's `streamUrl`). A bot that drafts its
//! reply while it runs is shown as Web Chat shows a livestream, and a livestream can be stopped
//! (an extension of Direct Line's, for the chat page's Stop button).
//!
//! A posted activity goes to `ProcessTurn` (or `StreamTurn`) like any channel's, and its replies
//! reach the transcript only once the turn has committed, so no reply is ever shown for state
//! that was not saved. Conversations live in this process's memory: several gateway replicas need
//! sticky sessions for Direct Line, and a restart ends every conversation (the bot's state, kept
//! by Turnstile, survives).
//!
//! # Layout
//! - this file: the `DirectLine` type, its routes, its errors and the CORS every route answers
//!   with;
//! - `tokens`: who is calling — secrets, the JWT tokens bound to one conversation, and the
//!   `tokens/generate` and `tokens/refresh` handlers;
//! - `transcript`: the conversations held in memory, their transcripts read by watermark page,
//!   and starting, reconnecting to and reading a conversation;
//! - `posting`: posting an activity — addressing it, running its turn in the background, the
//!   echo of a turn that outlasts its POST — and stopping a streamed turn;
//! - `stream`: the conversation's WebSocket, which pushes the transcript as it grows and a
//!   streamed turn's drafts as a livestream.

mod posting;
mod stream;
mod tokens;
mod transcript;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tokio::sync::watch;
use tower_http::cors::{AllowHeaders, Any, CorsLayer};

use super::config::Secret;
use super::turns::Turns;
use tokens::Keys;
use transcript::Conversations;

pub use tokens::TOKEN_LIFETIME;
pub use transcript::{MAX_CONVERSATIONS, MAX_TRANSCRIPT};

/// The channel id Direct Line gives its activities.
pub const CHANNEL_ID: &str = "directline";

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
        Self {
            keys: Keys::new(secrets),
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
}

/// The Direct Line routes under `/v3/directline`, answering browsers from any origin (as Direct
/// Line does: a page anywhere embeds Web Chat).
pub(super) fn routes(direct_line: Arc<DirectLine>) -> Router {
    Router::new()
        .route("/v3/directline/tokens/generate", post(tokens::generate))
        .route("/v3/directline/tokens/refresh", post(tokens::refresh))
        .route("/v3/directline/conversations", post(transcript::start))
        .route(
            "/v3/directline/conversations/{id}",
            get(transcript::reconnect),
        )
        .route(
            "/v3/directline/conversations/{id}/activities",
            post(posting::post_activity).get(transcript::activities),
        )
        .route(
            "/v3/directline/conversations/{id}/activities/{activity_id}/stop",
            post(posting::stop_activity),
        )
        .route(
            "/v3/directline/conversations/{id}/stream",
            get(stream::stream),
        )
        .layer(cors())
        .with_state(direct_line)
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

/// `2026-11-23T13:25:00.123Z`: the UTC timestamp format activities carry. A clock set before
/// 1970 gives the epoch rather than a panic in a handler.
fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at.max(UNIX_EPOCH)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header;

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
}
