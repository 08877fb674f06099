//! Posting an activity: addressing it, running its turn, and putting the turn's outcome into the
//! transcript — the one path by which a user's activity and the bot's replies get there — and
//! stopping a streamed turn.
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
//! While a client has the conversation's WebSocket open, the turn goes to `StreamTurn` instead,
//! its drafts pushed as a livestream ([`super::stream`]).
//!
//! A livestream can be stopped: `POST …/conversations/{id}/activities/{activityId}/stop` (an
//! extension of Direct Line's, for the chat page's Stop button; `{"shownText": …}` optional, the
//! text the client shows, else the last text pushed) stops the activity's turn (`StopTurn`), and
//! what was shown is the committed reply that ends the livestream and enters the transcript.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::stream::Livestream;
use super::tokens::Caller;
use super::{CHANNEL_ID, DirectLine, DirectLineError, rfc3339};
use crate::gateway::turns;
use crate::grpc::pb;

/// How a turn running in the background ends, told to the POST waiting for it.
type Outcome = oneshot::Receiver<Result<(), DirectLineError>>;

impl DirectLine {
    /// Runs the turn for `body` in `conversation_id` and appends it and its replies to the
    /// transcript once it committed; returns the activity's id.
    async fn post_activity(
        self: &Arc<Self>,
        conversation_id: &str,
        user_id: &str,
        token_user: Option<&str>,
        body: &[u8],
    ) -> Result<String, DirectLineError> {
        let (id, activity) = self.addressed_activity(conversation_id, user_id, token_user, body)?;
        // The turn runs on a task of its own, within the bot's budget, and writes its outcome into
        // the transcript itself; the POST waits for it as long as a call that waits may.
        let echo = Arc::new(Echo::default());
        let outcome = self.spawn_turn(conversation_id, &id, activity, &echo)?;
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

    /// `body`, a user's activity in `conversation_id`, addressed as Direct Line addresses it: a
    /// new id (returned with it), the time, the channel, the conversation, who it is from and to.
    fn addressed_activity(
        &self,
        conversation_id: &str,
        user_id: &str,
        token_user: Option<&str>,
        body: &[u8],
    ) -> Result<(String, Value), DirectLineError> {
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
        let from = sender(token_user, fields.get("from"), user_id);
        fields.insert("from".into(), from);
        fields.insert(
            "recipient".into(),
            json!({"id": self.bot_id, "name": self.bot_id, "role": "bot"}),
        );
        Ok((id, activity))
    }

    /// Starts the turn of `activity` (id `id`) among the background turns; its outcome arrives
    /// on the receiver once it is in the transcript, or has failed.
    fn spawn_turn(
        self: &Arc<Self>,
        conversation_id: &str,
        id: &str,
        activity: Value,
        echo: &Arc<Echo>,
    ) -> Result<Outcome, DirectLineError> {
        let (ended, outcome) = oneshot::channel();
        let turn = {
            let (dl, conversation_id, id, echo) = (
                Arc::clone(self),
                conversation_id.to_owned(),
                id.to_owned(),
                Arc::clone(echo),
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
        Ok(outcome)
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
            Err(status) if turns::is_busy(&status) => pb::ProcessTurnResponse {
                activities_json: vec![
                    json!({"type": "message", "text": self.busy_text}).to_string(),
                ],
                ..pb::ProcessTurnResponse::default()
            },
            response => response.map_err(DirectLineError::Turn)?,
        };
        let mut appended = self.addressed_replies(conversation_id, id, response)?;
        self.end_livestream(conversation_id, id, &mut livestream, &mut appended);
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

/// Who a posted activity is from. A token's user is who its holder is; otherwise the client
/// names the user (`from`), as Direct Line lets a secret's holder do, else it is `user_id`.
fn sender(token_user: Option<&str>, from: Option<&Value>, user_id: &str) -> Value {
    match (token_user, from) {
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

#[tracing::instrument(skip_all, fields(conversation = %id))]
pub(super) async fn post_activity(
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
pub(super) async fn stop_activity(
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
