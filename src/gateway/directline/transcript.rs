//! The conversations this process holds, each a transcript read by watermark, and the routes
//! that start one, reconnect to one and read one: what a client sees of a conversation, kept
//! apart from how a turn's outcome gets into it ([`super::posting`]) or is pushed to a WebSocket
//! ([`super::stream`]).
//!
//! Conversations live in this process's memory, at most [`MAX_CONVERSATIONS`] of them (the
//! oldest started is forgotten first) with the last [`MAX_TRANSCRIPT`] activities each: several
//! gateway replicas need sticky sessions for Direct Line, and a restart ends every conversation
//! (the bot's state, kept by Turnstile, survives).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, MutexGuard};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rand::Rng as _;
use rand::distr::Alphanumeric;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use super::tokens::{Caller, TOKEN_LIFETIME};
use super::{DirectLine, DirectLineError};

/// Conversations kept in memory; starting one more forgets the oldest.
pub const MAX_CONVERSATIONS: usize = 4096;
/// Activities kept per conversation; older ones can no longer be read.
pub const MAX_TRANSCRIPT: usize = 256;
/// Most activities one `GET …/activities` returns; the client reads on from the watermark.
const PAGE: usize = 100;
/// Interim activities a stream may fall behind by before it skips some (each one carries the
/// whole text so far, so the next one makes up for those skipped).
const LIVE_BACKLOG: usize = 64;

/// The conversations this process knows, oldest first in `started`.
#[derive(Default)]
pub(super) struct Conversations {
    pub(super) by_id: HashMap<String, Conversation>,
    started: VecDeque<String>,
}

/// One conversation's transcript: `transcript[i]` has watermark position `dropped + i`.
pub(super) struct Conversation {
    user_id: String,
    /// The next activity's sequence number, for its id `{conversationId}|{seq}`.
    next_seq: u64,
    dropped: u64,
    transcript: VecDeque<Value>,
    /// The transcript's end position, watched by the conversation's WebSockets.
    pub(super) appended: watch::Sender<u64>,
    /// Interim (livestream) activities, pushed to the open WebSockets and kept nowhere.
    pub(super) live: broadcast::Sender<Value>,
    /// The activities whose turns are streaming, by id, with the text last pushed for each (a
    /// stop's default of what was shown).
    pub(super) streaming: HashMap<String, String>,
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

    /// The next activity id, `{conversation_id}|{seq}`.
    pub(super) fn next_id(&mut self, conversation_id: &str) -> String {
        let id = format!("{conversation_id}|{:07}", self.next_seq);
        self.next_seq += 1;
        id
    }

    /// The activities from watermark position `from` on (at most [`PAGE`]) and the watermark
    /// after them.
    pub(super) fn page(&self, from: u64) -> (Vec<Value>, u64) {
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

    /// Appends `activities`, dropping the oldest beyond [`MAX_TRANSCRIPT`], and tells the
    /// streams.
    pub(super) fn append(&mut self, activities: Vec<Value>) {
        self.transcript.extend(activities);
        while self.transcript.len() > MAX_TRANSCRIPT {
            self.transcript.pop_front();
            self.dropped += 1;
        }
        self.appended.send_replace(self.end());
    }
}

impl DirectLine {
    pub(super) fn conversations(&self) -> MutexGuard<'_, Conversations> {
        // A panic while holding the lock cannot leave a conversation half-changed (every change
        // is one push or one append), so a poisoned lock is still usable.
        self.conversations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers a new conversation for `user_id`, forgetting the oldest beyond the bound.
    pub(super) fn start(&self, user_id: Option<String>) -> (String, String) {
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

    /// The user of `conversation_id`, when this process knows the conversation.
    pub(super) fn user_of(&self, conversation_id: &str) -> Result<String, DirectLineError> {
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

/// The user a start's `body` asks for, if any.
pub(super) fn requested_user(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<StartBody>(body)
        .ok()?
        .user?
        .id
        .filter(|id| !id.is_empty())
}

#[tracing::instrument(skip_all, fields(conversation = tracing::field::Empty))]
pub(super) async fn start(
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
pub(super) struct WatermarkQuery {
    pub(super) watermark: Option<String>,
}

impl WatermarkQuery {
    pub(super) fn position(&self) -> u64 {
        self.watermark
            .as_deref()
            .and_then(|w| w.trim().parse().ok())
            .unwrap_or(0)
    }
}

#[tracing::instrument(skip_all, fields(conversation = %id))]
pub(super) async fn reconnect(
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
pub(super) async fn activities(
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

fn random_id(len: usize) -> String {
    rand::rng()
        .sample_iter(Alphanumeric)
        .take(len)
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::GatewayConfig;
    use crate::gateway::turns::Turns;
    use axum::http::HeaderValue;

    #[tokio::test]
    async fn the_oldest_conversation_is_forgotten_beyond_the_bound() {
        let config = GatewayConfig::development("http://127.0.0.1:9");
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
        let config = GatewayConfig::development("http://127.0.0.1:9");
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
