//! The conversation's WebSocket (its `streamUrl`): it pushes the transcript as it grows, and a
//! streamed turn's drafts as a Web Chat livestream that is never kept. Everything a client sees
//! before a turn has committed goes through here.
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

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

use super::transcript::WatermarkQuery;
use super::{CHANNEL_ID, DirectLine, DirectLineError, rfc3339};
use crate::gateway::turns::Shown;

/// How often an idle WebSocket is pinged, so that proxies keep it open and a dead client is
/// noticed.
const PING_INTERVAL: Duration = Duration::from_secs(30);

/// One turn's livestream: its id (the first interim activity's) once one was pushed, and the
/// last sequence number used.
#[derive(Debug, Default)]
pub(super) struct Livestream {
    id: Option<String>,
    sequence: u32,
}

impl DirectLine {
    /// Pushes what a streamed turn shows to `conversation_id`'s open streams as an interim
    /// activity of `livestream`, replying to `reply_to`.
    pub(super) fn show(
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

    /// Ends `livestream`, when the turn of `reply_to` pushed one, with its committed `replies`:
    /// the last `message` with text becomes the livestream's final activity, or, when there is
    /// none, the drafts are erased.
    pub(super) fn end_livestream(
        &self,
        conversation_id: &str,
        reply_to: &str,
        livestream: &mut Livestream,
        replies: &mut [Value],
    ) {
        let Some(stream_id) = &livestream.id else {
            return;
        };
        let last_text = replies.iter_mut().rev().find(|reply| {
            reply["type"] == "message" && reply["text"].as_str().is_some_and(|t| !t.is_empty())
        });
        match last_text {
            Some(reply) => mark_final(reply, stream_id),
            // Nothing takes the draft's place: erase it.
            None => self.show(conversation_id, reply_to, livestream, Shown::Void),
        }
    }
}

/// Makes `reply` the final activity of the livestream `stream_id`: it replaces the drafts.
fn mark_final(reply: &mut Value, stream_id: &str) {
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

/// `?t=`: browsers cannot set headers on a WebSocket, so the stream URL carries the token.
#[derive(Debug, Deserialize)]
pub(super) struct StreamQuery {
    t: Option<String>,
    watermark: Option<String>,
}

#[tracing::instrument(skip_all, fields(conversation = %id))]
pub(super) async fn stream(
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
