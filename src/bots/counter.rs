//! The counter bot: every message adds one to a conversation-scoped counter and replies
//! `count: N`. The simplest bot on which a lost or doubled turn is visible — the fault tests and
//! the load generator use it.
//!
//! Two extras serve measurement: an `event` activity named `read` replies `count: N` without
//! counting, so a checker can read the final state through the API; and a message whose `value`
//! is `{"pad": B}` keeps a B-byte padding property in the state, so a benchmark can choose the
//! state size it moves per turn.

use async_trait::async_trait;

use crate::activity::types;
use crate::bot::{Bot, BotError, Scopes, TurnContext};

const COUNT: &str = "count";
const PAD: &str = "pad";
/// Larger padding is refused: the knob is for realistic state sizes, not for filling the store.
const MAX_PAD_BYTES: usize = 64 * 1024;

/// Counts the messages of each conversation.
#[derive(Debug, Clone, Copy, Default)]
pub struct CounterBot;

#[async_trait]
impl Bot for CounterBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let activity = turn.activity();
        if activity.is_type(types::EVENT) && activity.name.as_deref() == Some("read") {
            let count: u64 = turn.conversation_property(COUNT)?;
            turn.send_text(format!("count: {count}"));
            return Ok(());
        }
        if !activity.is_type(types::MESSAGE) {
            return Ok(());
        }
        let pad = activity
            .value
            .as_ref()
            .and_then(|v| v.get("pad"))
            .and_then(serde_json::Value::as_u64)
            .map(|b| usize::try_from(b).unwrap_or(usize::MAX).min(MAX_PAD_BYTES));
        let count: u64 = turn.conversation_property(COUNT)?;
        let count = count + 1;
        let state = turn.conversation_state();
        state.set(COUNT, &count)?;
        if let Some(bytes) = pad {
            // Measured where it lies: reading the pad as a `String` copied a kilobyte per turn.
            let current = match state.properties().get(PAD) {
                Some(serde_json::Value::String(pad)) => Some(pad.len()),
                None => None,
                // Not a string: the error reading it as one gives.
                Some(_) => state.get::<String>(PAD)?.map(|pad| pad.len()),
            };
            if current != Some(bytes) {
                state.set(PAD, &".".repeat(bytes))?;
            }
        }
        turn.send_text(format!("count: {count}"));
        Ok(())
    }

    /// Its count is the conversation's: no user state is loaded for it.
    fn scopes(&self) -> Scopes {
        Scopes::CONVERSATION
    }
}
