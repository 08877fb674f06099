//! The counter bot: every message adds one to a conversation-scoped counter and replies
//! `count: N`. The simplest bot on which a lost or doubled turn is visible — the fault tests and
//! the benchmark use it.

use async_trait::async_trait;

use crate::activity::types;
use crate::bot::{Bot, BotError, TurnContext};

const COUNT: &str = "count";

/// Counts the messages of each conversation.
#[derive(Debug, Clone, Copy, Default)]
pub struct CounterBot;

#[async_trait]
impl Bot for CounterBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if turn.activity().activity_type.as_deref() != Some(types::MESSAGE) {
            return Ok(());
        }
        let count: u64 = turn.conversation_property(COUNT)?;
        let count = count + 1;
        turn.conversation_state().set(COUNT, &count)?;
        turn.send_text(format!("count: {count}"));
        Ok(())
    }
}
