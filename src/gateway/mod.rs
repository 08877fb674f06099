//! The Bot Framework side of Turnstile: `POST /api/messages`, as Azure Bot Service, Teams, the
//! Bot Framework Emulator and the Agents Playground call a bot.
//!
//! The gateway is purely a gRPC client of `TurnService` — it never reaches into the engine or the
//! store — so that it runs as its own process and doubles as the reference for teams writing a
//! gateway in another language. One call flows in a straight line:
//!
//! 1. [`auth`]: the channel's JWT is checked (nothing runs without a valid one, unless no app id
//!    is configured: local development);
//! 2. [`turns`]: the activity goes to `ProcessTurn` as the channel's JSON text, so nothing the
//!    schema does not name is lost, and comes back as JSON replies;
//! 3. delivery: `expectReplies` and `invoke` wait for the turn, within the channel's budget,
//!    and are answered in the HTTP response; any other activity is answered `202 Accepted` at
//!    once, and its turn runs in the [`background`] within the bot's budget, its replies POSTed
//!    to the channel through the [`connector`], in order, as Bot Framework bots do for long
//!    operations. A redelivered activity is answered from the turn's receipt and its replies
//!    delivered again, without running the bot again.
//!
//! `trace` replies are diagnostics for the Emulator and reach no other channel.
//!
//! In a Teams one-on-one chat the turn goes to `StreamTurn` instead, and what the bot drafts while
//! it runs is shown as Teams streams a message ([`teams`]), in the background too; the committed
//! replies are delivered as above, the one that ends the stream marked so.
//!
//! Beside it, in development or with a Direct Line secret, [`directline`] serves Direct Line 3.0
//! for Web Chat, through the same `ProcessTurn` call (or `StreamTurn`, whose drafts become a Web
//! Chat livestream, while a client has the conversation's WebSocket open), and `/` serves a small
//! chat page that uses it.
//!
//! For the platform: `/healthz` and `/readyz` ([`health`]) on the same port, and `/metrics`
//! ([`metrics`]) on a port of its own, never the one an Ingress publishes.

pub(crate) mod auth;
pub(crate) mod background;
pub(crate) mod config;
pub(crate) mod connector;
pub mod directline;
pub(crate) mod health;
pub(crate) mod metrics;
mod page;
pub(crate) mod teams;
pub(crate) mod turns;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tracing::Instrument;

pub use config::{
    AppCredentials, AppType, BUSY_TEXT, ChannelArgs, ConfigError, DeliveryPolicy, GatewayArgs,
    GatewayConfig, SUPERSEDED_TEXT, Secret,
};

use crate::activity::{Activity, types};
use crate::grpc::pb;
use auth::{AuthError, ChannelAuth};
use connector::{Connector, DeliveryError, ReplyAddress};
use teams::{Drafting, Stream};
use turns::{Turns, TurnsError};

/// The channel that shows `trace` activities.
const EMULATOR_CHANNEL: &str = "emulator";
/// `deliveryMode` asking for the replies in the HTTP response.
const EXPECT_REPLIES: &str = "expectReplies";

/// The sockets a gateway answers on.
#[derive(Debug)]
pub struct Listeners {
    /// The Bot Framework endpoint, Direct Line, the chat page and the probes.
    pub http: TcpListener,
    /// Plain HTTP `GET /metrics` in Prometheus text format; no metrics endpoint when `None`.
    pub metrics: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(http: TcpListener) -> Self {
        Self {
            http,
            metrics: None,
        }
    }
}

/// Why the gateway could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Turnstile's address or token is unusable.
    #[error(transparent)]
    Turns(#[from] TurnsError),
    /// The HTTP client for keys, tokens and delivery could not be built.
    #[error("building the HTTP client failed")]
    Http(#[source] reqwest::Error),
    /// Serving HTTP failed.
    #[error("serving HTTP failed")]
    Serve(#[source] std::io::Error),
    /// The metrics recorder could not be installed.
    #[error(transparent)]
    Metrics(#[from] crate::telemetry::metrics::MetricsError),
}

/// Everything a call needs, shared by all calls.
#[derive(Debug)]
struct Gateway {
    /// Turns whose caller waits, within the channel's budget (`turn_timeout`).
    turns: Turns,
    /// Turns run after the channel was answered, within the bot's (`bot_turn_timeout`).
    bot_turns: Turns,
    auth: Option<ChannelAuth>,
    connector: Connector,
    background: Arc<background::Background>,
    /// The reply to a message refused because the bot is still answering the one before.
    busy_text: String,
    /// The final message of a Teams stream whose turn a later message interrupted.
    superseded_text: String,
}

/// Serves `POST /api/messages` on `listeners.http` (and `/metrics` on `listeners.metrics`) until
/// `shutdown` completes, then finishes the calls in flight and the turns running in the
/// background (their deliveries included, within `config.shutdown_grace`) and returns.
///
/// # Errors
/// [`GatewayError`] when the configuration is unusable or serving fails.
pub async fn serve(
    config: GatewayConfig,
    listeners: impl Into<Listeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let Listeners {
        http: listener,
        metrics,
    } = listeners.into();
    // Scrapes go on while the calls in flight finish, and end with them.
    let metrics = MetricsEndpoint::start(metrics)?;
    let http = http_client()?;
    let auth = channel_auth(&config, &http);
    let turns = Turns::new(&config)?;
    let readiness = Arc::new(health::Readiness::new(&config).map_err(TurnsError::from)?);
    let background = background::Background::new(config.max_background_turns);
    let direct_line = direct_line(&config, &turns, &background);
    let gateway = Arc::new(Gateway {
        bot_turns: turns.with_timeout(config.bot_turn_timeout),
        turns,
        connector: Connector::new(config.credentials.as_ref(), http, config.delivery),
        auth,
        background: Arc::clone(&background),
        busy_text: config.busy_text.clone(),
        superseded_text: config.superseded_text.clone(),
    });
    let app = routes(gateway, direct_line.clone(), readiness, &listener);
    tracing::info!(address = ?listener.local_addr().ok(), "serving the Bot Framework endpoint");
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(stop_streams_after(shutdown, direct_line))
        .await
        .map_err(GatewayError::Serve);
    finish_background(&background, config.shutdown_grace).await;
    metrics.stop().await;
    served?;
    tracing::info!("gateway stopped");
    Ok(())
}

/// `/metrics` on a port of its own, when one was given.
struct MetricsEndpoint {
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    stop: Arc<tokio::sync::Notify>,
}

impl MetricsEndpoint {
    /// Installs the metrics recorder and serves its scrapes on `listener`, if any.
    fn start(listener: Option<TcpListener>) -> Result<Self, GatewayError> {
        let stop = Arc::new(tokio::sync::Notify::new());
        let task = match listener {
            Some(listener) => {
                let handle = crate::telemetry::metrics::recorder()?;
                metrics::describe();
                tracing::info!(address = ?listener.local_addr().ok(), "serving /metrics");
                let stopped = Arc::clone(&stop);
                let app = crate::telemetry::metrics::routes(handle);
                Some(tokio::spawn(async move {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(async move { stopped.notified().await })
                        .await
                }))
            }
            None => None,
        };
        Ok(Self { task, stop })
    }

    /// Ends the endpoint once its scrapes in progress are answered.
    async fn stop(self) {
        self.stop.notify_one();
        if let Some(task) = self.task {
            match task.await {
                Ok(Err(e)) => tracing::warn!(error = %e, "serving /metrics failed"),
                Err(e) => tracing::warn!(error = %e, "the /metrics task failed"),
                Ok(Ok(())) => {}
            }
        }
    }
}

/// The HTTP client for keys, tokens and delivery.
fn http_client() -> Result<reqwest::Client, GatewayError> {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .map_err(GatewayError::Http)
}

/// The check of the channels' JWTs, when an app id is configured; else a loud warning.
fn channel_auth(config: &GatewayConfig, http: &reqwest::Client) -> Option<ChannelAuth> {
    let auth = config
        .credentials
        .as_ref()
        .map(|c| ChannelAuth::new(c, http.clone()));
    if auth.is_none() {
        tracing::warn!(
            "NO MicrosoftAppId: the gateway accepts calls WITHOUT AUTHENTICATION and sends \
             replies without a token. This is for the Emulator and the Agents Playground on \
             your own machine only; set MicrosoftAppId and MicrosoftAppPassword before exposing \
             it anywhere"
        );
    }
    auth
}

/// Direct Line, when `config` enables it, running its turns among `background`'s.
fn direct_line(
    config: &GatewayConfig,
    turns: &Turns,
    background: &Arc<background::Background>,
) -> Option<Arc<directline::DirectLine>> {
    // Direct Line's turns have the bot's budget too: a POST answers within the channel's, and
    // the turn runs on among the background turns (see `directline`).
    config.direct_line_enabled().then(|| {
        Arc::new(
            directline::DirectLine::new(
                config.direct_line_secrets.clone(),
                turns.with_timeout(config.bot_turn_timeout),
                &config.bot,
            )
            .with_busy_text(&config.busy_text)
            .running_in(Arc::clone(background), config.turn_timeout),
        )
    })
}

/// `/api/messages`, Direct Line and the chat page when on, and the probes; counted in metrics.
fn routes(
    gateway: Arc<Gateway>,
    direct_line: Option<Arc<directline::DirectLine>>,
    readiness: Arc<health::Readiness>,
    listener: &TcpListener,
) -> Router {
    let mut app = Router::new()
        .route("/api/messages", post(messages))
        .with_state(gateway);
    match direct_line {
        Some(direct_line) => {
            if direct_line.is_open() {
                tracing::warn!(
                    "NO DirectLineSecret: Direct Line (/v3/directline) is open to anyone who \
                     reaches this port; set DirectLineSecret before exposing it"
                );
            }
            app = app
                .merge(directline::routes(direct_line))
                .merge(page::routes());
            if let Ok(address) = listener.local_addr() {
                tracing::info!("open http://{}/ to chat", config::loopback(address));
            }
        }
        None => tracing::info!(
            "Direct Line is off: MicrosoftAppId is set and no DirectLineSecret is configured"
        ),
    }
    // Last, so that every route and the fallback (`_OTHER`) are counted; but the probes.
    app.merge(health::routes(readiness))
        .layer(axum::middleware::from_fn(metrics::track))
}

/// The server's shutdown signal: `shutdown`, then Direct Line's streams told to close.
async fn stop_streams_after(
    shutdown: impl Future<Output = ()>,
    streams: Option<Arc<directline::DirectLine>>,
) {
    shutdown.await;
    // Direct Line streams are upgraded connections, which the graceful shutdown does not
    // track: they get a Close frame, and their tasks end, instead of outliving `serve`.
    if let Some(direct_line) = streams {
        direct_line.stop();
    }
}

/// Waits, up to `grace`, for the turns running in the background.
async fn finish_background(background: &background::Background, grace: std::time::Duration) {
    // The channels were answered `202` for these: their replies are still owed.
    let in_flight = background.in_flight();
    if in_flight > 0 {
        tracing::info!(in_flight, "finishing the turns running in the background");
    }
    if !background.finish(grace).await {
        tracing::warn!(
            ?grace,
            in_flight = background.in_flight(),
            "background turns did not finish within the grace period; abandoning them: their \
             channels were answered 202 and will not redeliver, so their replies are lost"
        );
    }
}

/// Why a call was not answered with the bot's replies.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("the body is not a Bot Framework activity: {0}")]
    BadActivity(String),
    #[error(transparent)]
    Unauthorized(AuthError),
    #[error("Turnstile refused the turn: {0}")]
    Turn(tonic::Status),
    #[error("the bot's reply is not an activity: {0}")]
    BadReply(String),
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
    #[error(transparent)]
    Busy(#[from] background::Full),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        use tonic::Code;
        let status = match &self {
            Refusal::BadActivity(_) => StatusCode::BAD_REQUEST,
            Refusal::Unauthorized(AuthError::KeysUnavailable { .. }) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Refusal::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Refusal::Turn(s) if s.code() == Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Refusal::Turn(s) if s.code() == Code::NotFound || s.code() == Code::Internal => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Refusal::Turn(_) => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::BadReply(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Refusal::Delivery(_) => StatusCode::BAD_GATEWAY,
            Refusal::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        if status.is_server_error() {
            tracing::warn!(error = %self, %status, "call failed");
        } else {
            tracing::info!(error = %self, %status, "call refused");
        }
        // A refused caller learns the class of problem, not the token check's details.
        let message = match &self {
            Refusal::Unauthorized(_) => "unauthorized".to_owned(),
            other => other.to_string(),
        };
        (status, message).into_response()
    }
}

#[tracing::instrument(skip_all, fields(channel = tracing::field::Empty, activity_id = tracing::field::Empty))]
async fn messages(
    State(gateway): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match gateway.handle(&headers, body).await {
        Ok(response) => response,
        Err(refusal) => refusal.into_response(),
    }
}

/// An authenticated call's activity, as the channel sent it and parsed.
struct Call {
    /// The channel's JSON text, which goes to Turnstile verbatim.
    text: String,
    inbound: Activity,
    /// What a Teams draft is built on.
    template: Value,
}

impl Call {
    fn channel_id(&self) -> &str {
        self.inbound.channel_id.as_deref().unwrap_or_default()
    }

    fn conversation(&self) -> Option<(&str, &str)> {
        self.inbound
            .conversation_id()
            .map(|id| (self.channel_id(), id))
    }

    /// Whether the caller waits for the replies in the HTTP response.
    fn answered_in_body(&self) -> bool {
        self.inbound.delivery_mode.as_deref() == Some(EXPECT_REPLIES)
            || self.inbound.is_type(types::INVOKE)
    }
}

impl Gateway {
    /// Parses and authenticates the call, then answers it: with the replies when the caller
    /// waits for them, else `202 Accepted` at once, the turn going on in the background.
    async fn handle(
        self: &Arc<Self>,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response, Refusal> {
        let text =
            std::str::from_utf8(&body).map_err(|_| Refusal::BadActivity("not UTF-8".into()))?;
        let value: Value =
            serde_json::from_str(text).map_err(|e| Refusal::BadActivity(e.to_string()))?;
        let template = draft_template(&value);
        let inbound =
            Activity::from_json(value).map_err(|e| Refusal::BadActivity(e.to_string()))?;
        let call = Call {
            text: text.to_owned(),
            inbound,
            template,
        };
        if let Some(auth) = &self.auth {
            let authorization = headers
                .get(header::AUTHORIZATION)
                .and_then(|h| h.to_str().ok());
            let service_url = call.inbound.service_url.as_deref().unwrap_or_default();
            auth.check(authorization, call.channel_id(), service_url)
                .await
                .map_err(Refusal::Unauthorized)?;
        }
        let span = tracing::Span::current();
        span.record("channel", call.channel_id());
        span.record(
            "activity_id",
            call.inbound.id.as_deref().unwrap_or_default(),
        );
        if call.answered_in_body() {
            return self.answer(&call).await;
        }
        let key = background::ActivityKey::new(
            call.channel_id(),
            call.inbound.conversation_id().unwrap_or_default(),
            call.inbound.id.as_deref(),
        );
        let gateway = Arc::clone(self);
        self.background.spawn(
            key,
            async move { gateway.run_in_background(call).await }.instrument(span),
        )?;
        Ok(StatusCode::ACCEPTED.into_response())
    }

    /// The turn of a caller that waits: `expectReplies` gets the replies in the body, an invoke
    /// its `invokeResponse` (its other replies delivered first), within the channel's budget.
    async fn answer(&self, call: &Call) -> Result<Response, Refusal> {
        let response = match self.turns.process(&call.text, call.conversation()).await {
            Err(status) if turns::is_busy(&status) && !call.inbound.is_type(types::INVOKE) => {
                // Refused, nothing committed: the user is told so, in the body as asked.
                return Ok(expected_replies(&[self.note(call, &self.busy_text)]));
            }
            response => response.map_err(Refusal::Turn)?,
        };
        let mut replies = replies(call, response)?;
        if call.inbound.delivery_mode.as_deref() == Some(EXPECT_REPLIES) {
            return Ok(expected_replies(&replies));
        }
        let at = replies
            .iter()
            .position(|(a, _)| a.is_type(types::INVOKE_RESPONSE));
        let invoke_response = at.map(|i| replies.remove(i).0);
        self.deliver(&call.inbound, &replies, None).await?;
        Ok(match invoke_response {
            Some(reply) => invoke_answer(&reply),
            // Bot Framework's answer to an invoke the bot did not answer.
            None => StatusCode::NOT_IMPLEMENTED.into_response(),
        })
    }

    /// A turn the channel was answered `202` for: run within the bot's budget (streamed to Teams
    /// in a one-on-one chat), its replies delivered through the Connector. Nobody is left to
    /// answer, so a failure is logged and counted; a redelivery is answered from the receipt.
    async fn run_in_background(&self, call: Call) {
        let outcome = match self.deliver_turn(&call).await {
            Ok(()) => "delivered",
            Err(refusal) => {
                let outcome = match &refusal {
                    Refusal::Delivery(_) => "undelivered",
                    Refusal::BadReply(_) => "bad_reply",
                    _ => "failed",
                };
                tracing::warn!(error = %refusal, outcome, "a background turn failed");
                outcome
            }
        };
        metrics::background_turn(outcome);
    }

    /// Runs `call`'s turn within the bot's budget and delivers its replies, in order; in a Teams
    /// one-on-one chat its drafts are streamed meanwhile and the last text reply ends the stream.
    async fn deliver_turn(&self, call: &Call) -> Result<(), Refusal> {
        let (response, stream) = self.run_turn(call).await;
        let response = match response {
            Err(status) if turns::is_busy(&status) => {
                // Refused, nothing committed: the user is told so, as a reply of its own.
                return Ok(self
                    .deliver(&call.inbound, &[self.note(call, &self.busy_text)], None)
                    .await?);
            }
            response => response.map_err(Refusal::Turn)?,
        };
        let key = background::ActivityKey::new(
            call.channel_id(),
            call.inbound.conversation_id().unwrap_or_default(),
            call.inbound.id.as_deref(),
        );
        if response.redelivered
            && key
                .as_ref()
                .is_some_and(|k| self.background.was_delivered(k))
        {
            // The channel sent it again, but this gateway delivered its replies already.
            tracing::info!("a redelivered activity's replies were delivered already; not again");
            return Ok(());
        }
        if response.superseded {
            return self.end_superseded(call, &stream).await;
        }
        if response.stopped && teams::streams(&call.inbound) {
            // Stopped by Teams' 403: what the turn committed is what the closed stream shows the
            // user already (a redelivery too: the first run's stream showed it).
            return Ok(());
        }
        let mut replies = replies(call, response)?;
        let fallback = end_stream_with_last_text(&mut replies, &stream);
        self.deliver(&call.inbound, &replies, fallback).await?;
        if let Some(key) = &key {
            self.background.delivered(key);
        }
        Ok(())
    }

    /// Runs `call`'s turn within the bot's budget, streamed in a Teams one-on-one chat.
    async fn run_turn(
        &self,
        call: &Call,
    ) -> (Result<pb::ProcessTurnResponse, tonic::Status>, Stream) {
        if teams::streams(&call.inbound) {
            self.stream_to_teams(call).await
        } else {
            (
                self.bot_turns
                    .process(&call.text, call.conversation())
                    .await,
                Stream::None,
            )
        }
    }

    /// Runs `call`'s turn with its drafts sent to Teams; answers how the stream stands too.
    async fn stream_to_teams(
        &self,
        call: &Call,
    ) -> (Result<pb::ProcessTurnResponse, tonic::Status>, Stream) {
        let to = ReplyAddress {
            service_url: call.inbound.service_url.as_deref().unwrap_or_default(),
            conversation_id: call.inbound.conversation_id().unwrap_or_default(),
            reply_to_id: call.inbound.id.as_deref(),
        };
        let (drafts, drafting) = tokio::sync::watch::channel(Drafting::Waiting);
        let turn = async {
            let response = self
                .bot_turns
                .stream(&call.text, call.conversation(), |shown| {
                    drafts.send_replace(Drafting::Latest(shown));
                })
                .await;
            drafts.send_replace(Drafting::Ended);
            response
        };
        let shown = async {
            let stream = teams::send_drafts(&self.connector, to, &call.template, drafting).await;
            // Teams closed the stream while the turn runs: stop it at what Teams shows.
            if let (Stream::Closed(shown), Some(conversation), Some(id)) =
                (&stream, call.conversation(), call.inbound.id.as_deref())
            {
                self.bot_turns.stop(conversation, id, shown.clone()).await;
            }
            stream
        };
        tokio::join!(turn, shown)
    }

    /// Ends the Teams stream, if any, of a turn a later message interrupted.
    async fn end_superseded(&self, call: &Call, stream: &Stream) -> Result<(), Refusal> {
        // A later message interrupted the turn: nothing of it is delivered, but a Teams
        // stream its drafts opened is ended, saying why, or Teams would show the void drafts
        // until it times the stream out.
        if let Stream::Open(stream_id) = stream {
            let (note, plain) = self.note(call, &self.superseded_text);
            if let Some(last) = teams::end_stream(&plain, stream_id) {
                self.deliver(&call.inbound, &[(note, last)], Some((0, plain)))
                    .await?;
            }
        }
        Ok(())
    }

    /// A message of the gateway's own, `text` (the user's message was refused while the bot
    /// still answers the one before; a stream's turn was interrupted): addressed as the bot's
    /// replies are, never committed.
    fn note(&self, call: &Call, text: &str) -> (Activity, String) {
        let mut reply = call.template.clone();
        reply["type"] = json!("message");
        reply["text"] = json!(text);
        let json = reply.to_string();
        let activity = Activity::from_json(reply).unwrap_or_else(|_| {
            let mut plain = Activity::message(text);
            plain.reply_to_id.clone_from(&call.inbound.id);
            plain
        });
        (activity, json)
    }

    /// POSTs `replies` in order to the channel the inbound activity came from.
    /// `fallback` is the plain form of the reply at its index, sent instead when the channel
    /// refuses that reply with `403` (Teams, for a stream it already closed).
    async fn deliver(
        &self,
        inbound: &Activity,
        replies: &[(Activity, String)],
        fallback: Option<(usize, String)>,
    ) -> Result<(), DeliveryError> {
        // Replies go back where the (authenticated) inbound activity came from, never to a URL a
        // reply names: the bot's token must not travel anywhere else.
        let service_url = inbound.service_url.as_deref().unwrap_or_default();
        for (i, (reply, json)) in replies.iter().enumerate() {
            let conversation_id = reply
                .conversation_id()
                .or_else(|| inbound.conversation_id())
                .unwrap_or_default();
            let to = ReplyAddress {
                service_url,
                conversation_id,
                reply_to_id: reply.reply_to_id.as_deref(),
            };
            let mut sent = self.connector.send(to, json).await;
            if let (Err(DeliveryError::Refused { status, .. }), Some((at, plain))) =
                (&sent, &fallback)
                && *at == i
                && status.as_u16() == 403
            {
                tracing::info!("Teams refused to end the stream; the reply goes as a message");
                sent = self.connector.send(to, plain).await;
            }
            metrics::delivery(match &sent {
                Ok(()) => "delivered",
                Err(DeliveryError::Refused { .. }) => "refused",
                Err(DeliveryError::Unreachable { .. }) => "unreachable",
                Err(DeliveryError::Token { .. }) => "no_token",
            });
            sent?;
        }
        Ok(())
    }
}

/// A `typing` activity addressed as a reply to `inbound` (the channel's JSON): what a Teams draft
/// is built on.
fn draft_template(inbound: &Value) -> Value {
    let mut template = json!({"type": "typing"});
    for (from, to) in [
        ("channelId", "channelId"),
        ("serviceUrl", "serviceUrl"),
        ("conversation", "conversation"),
        ("recipient", "from"),
        ("from", "recipient"),
        ("id", "replyToId"),
        ("locale", "locale"),
    ] {
        if let Some(value) = inbound.get(from) {
            template[to] = value.clone();
        }
    }
    template
}

/// Makes the last text reply end an open Teams stream; answers its plain form, the fallback.
fn end_stream_with_last_text(
    replies: &mut [(Activity, String)],
    stream: &Stream,
) -> Option<(usize, String)> {
    // The reply that takes the stream's place ends it; plain, should Teams refuse that.
    if let Stream::Open(stream_id) = stream
        && let Some(at) = replies.iter().rposition(|(a, _)| {
            a.is_type(types::MESSAGE) && a.text.as_deref().is_some_and(|t| !t.is_empty())
        })
        && let Some(last) = teams::end_stream(&replies[at].1, stream_id)
    {
        return Some((at, std::mem::replace(&mut replies[at].1, last)));
    }
    None
}

/// The turn's replies for `call`'s channel, each parsed and as the bot sent it; `trace` replies
/// only for the Emulator.
fn replies(
    call: &Call,
    response: pb::ProcessTurnResponse,
) -> Result<Vec<(Activity, String)>, Refusal> {
    let mut replies = Vec::with_capacity(response.activities_json.len());
    for json in response.activities_json {
        let value: Value =
            serde_json::from_str(&json).map_err(|e| Refusal::BadReply(e.to_string()))?;
        let activity = Activity::from_json(value).map_err(|e| Refusal::BadReply(e.to_string()))?;
        if activity.is_type(types::TRACE) && call.channel_id() != EMULATOR_CHANNEL {
            continue;
        }
        replies.push((activity, json));
    }
    Ok(replies)
}

/// `{"activities": [...]}`, the replies as the bot sent them, verbatim.
fn expected_replies(replies: &[(Activity, String)]) -> Response {
    let mut body = String::from("{\"activities\":[");
    for (i, (_, json)) in replies.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(json);
    }
    body.push_str("]}");
    json_response(StatusCode::OK, body)
}

/// The invoke's HTTP answer: the `invokeResponse` activity's `value.status` and `value.body`.
fn invoke_answer(reply: &Activity) -> Response {
    let value = reply.value.as_ref();
    let status = value
        .and_then(|v| v.get("status"))
        .and_then(Value::as_u64)
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    match value.and_then(|v| v.get("body")) {
        Some(body) if !body.is_null() => json_response(status, body.to_string()),
        _ => status.into_response(),
    }
}

fn json_response(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}
