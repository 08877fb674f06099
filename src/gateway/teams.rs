//! Teams' streaming messages: a turn whose bot drafts its reply is shown to the user, in a
//! one-on-one chat, as Teams streams a bot message (Microsoft's "Stream bot messages").
//!
//! While the turn runs, its drafts are POSTed through the Connector as `typing` activities with a
//! `streaminfo` entity: `streamType` `informative` for a status line or `streaming` for the text
//! so far, `streamSequence` from 1, and from the second on the `streamId` that the first POST's
//! answer gave. Teams throttles a stream that updates too often, so at most one draft goes every
//! [`CHUNK_INTERVAL`] (the Agents SDK's default): the first at once, then the latest one written
//! meanwhile, the others dropped (each carries the whole text). After the commit the reply that
//! takes the stream's place is delivered with `streamType` `final` and the `streamId`
//! ([`end_stream`]), as every reply is, after the last draft's POST has been answered.
//!
//! A `403` (Teams' `ContentStreamNotAllowed`: the user pressed Stop, or the stream ran past Teams'
//! two minutes) ends the drafts for the turn, and the turn is stopped: what Teams shows, the last
//! text draft it accepted, is what the turn commits ([`Stream::Closed`], `StopTurn`). That reply
//! is on the user's screen already, in the closed stream, so it is not delivered again; a reply
//! the bot finished before the stop reached it is delivered as a plain message. A void draft (an
//! attempt thrown away) sends nothing: the replay's next draft replaces the text.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;

use super::connector::{Connector, DeliveryError, ReplyAddress};
use super::turns::Shown;
use crate::activity::Activity;

/// The least time between two drafts of one stream.
pub const CHUNK_INTERVAL: Duration = Duration::from_millis(1500);

/// Teams' channel id.
pub const CHANNEL_ID: &str = "msteams";

/// Whether `inbound`'s turn is shown as a Teams stream: a Teams one-on-one chat (Teams streams
/// nowhere else) whose replies go through the Connector.
pub fn streams(inbound: &Activity) -> bool {
    inbound.channel_id.as_deref() == Some(CHANNEL_ID)
        && inbound
            .conversation
            .as_ref()
            .and_then(|c| c.conversation_type.as_deref())
            == Some("personal")
}

/// What the turn has shown so far, as the drafting side sees it.
#[derive(Debug, Clone)]
pub enum Drafting {
    /// Nothing yet.
    Waiting,
    /// The latest draft.
    Latest(Shown),
    /// The turn is over: no more drafts.
    Ended,
}

/// How a turn's stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stream {
    /// No draft reached Teams: the replies go as plain messages.
    None,
    /// A stream is open with this id: the final reply ends it.
    Open(String),
    /// Teams closed the stream (`403`): the user stopped it (or its time ran out) with this
    /// text on screen, the last text draft Teams accepted (`None`: only status lines, or
    /// nothing). A reply committed whole goes as a plain message.
    Closed(Option<String>),
}

/// POSTs the drafts `drafting` offers to `to` until the turn ends, as described in the module
/// documentation; answers how the stream stands.
pub async fn send_drafts(
    connector: &Connector,
    to: ReplyAddress<'_>,
    template: &Value,
    mut drafting: watch::Receiver<Drafting>,
) -> Stream {
    let mut stream_id: Option<String> = None;
    let mut sequence = 0u32;
    // The last text Teams accepted: what the user sees.
    let mut shown: Option<String> = None;
    // A draft came while the last one's interval ran: send it without waiting for another.
    let mut pending = false;
    loop {
        if !pending && drafting.changed().await.is_err() {
            break;
        }
        pending = false;
        let (stream_type, text) = match drafting.borrow_and_update().clone() {
            Drafting::Ended => break,
            Drafting::Waiting | Drafting::Latest(Shown::Void) => continue,
            Drafting::Latest(Shown::Status(text)) => ("informative", text),
            Drafting::Latest(Shown::Text(text)) => ("streaming", text),
        };
        if text.is_empty() {
            continue;
        }
        sequence += 1;
        let mut info = json!({
            "type": "streaminfo",
            "streamType": stream_type,
            "streamSequence": sequence,
        });
        if let Some(id) = &stream_id {
            info["streamId"] = json!(id);
        }
        let mut draft = template.clone();
        draft["type"] = json!("typing");
        draft["text"] = json!(text);
        draft["entities"] = json!([info]);
        let next_at = Instant::now() + CHUNK_INTERVAL;
        let sent = connector.send_draft(to, &draft.to_string()).await;
        if sent.is_ok() && stream_type == "streaming" {
            shown = Some(text);
        }
        match sent {
            Ok(Some(id)) if stream_id.is_none() => stream_id = Some(id),
            Ok(_) => {}
            Err(DeliveryError::Refused { status, .. }) if status.as_u16() == 403 => {
                tracing::info!("Teams closed the stream; no more drafts for this turn");
                return Stream::Closed(shown);
            }
            Err(error) => tracing::info!(%error, sequence, "a draft did not reach Teams"),
        }
        if stream_id.is_none() {
            // Without the first POST's id no later draft can join the stream.
            tracing::info!("Teams gave the stream no id; no more drafts for this turn");
            return Stream::None;
        }
        // Coalesce: what is drafted meanwhile waits, and only the latest goes.
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(next_at) => break,
                changed = drafting.changed() => {
                    if changed.is_err() || matches!(*drafting.borrow(), Drafting::Ended) {
                        return stream_id.map_or(Stream::None, Stream::Open);
                    }
                    pending = true;
                }
            }
        }
    }
    stream_id.map_or(Stream::None, Stream::Open)
}

/// `reply` (Bot Framework JSON text) as the final message of the stream `stream_id`.
pub fn end_stream(reply: &str, stream_id: &str) -> Option<String> {
    let mut value: Value = serde_json::from_str(reply).ok()?;
    let fields = value.as_object_mut()?;
    let info = json!({"type": "streaminfo", "streamType": "final", "streamId": stream_id});
    match fields.entry("entities").or_insert_with(|| json!([])) {
        Value::Array(entities) => entities.push(info),
        other => *other = json!([info]),
    }
    Some(value.to_string())
}
