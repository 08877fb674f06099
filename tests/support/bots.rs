//! Bots the tests share, each made to put a turn where a test needs it.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Semaphore;
use turnstile::{Bot, BotError, TurnContext};

/// Appends each message's text to a conversation list and drafts the list it will say; its
/// first attempt at a message `wait` then holds on `gate`, so that another replica can change
/// the conversation meanwhile and that attempt is thrown away.
pub struct Gated {
    /// Released by the test when the held attempt may go on.
    pub gate: Arc<Semaphore>,
}

#[async_trait]
impl Bot for Gated {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let mut items: Vec<String> = turn.conversation_property("items")?;
        let text = turn.text().to_owned();
        items.push(text.clone());
        turn.draft(format!("writing {}", items.join(", ")))?;
        if text == "wait" && turn.attempt() == 1 {
            self.gate.acquire().await?.forget();
        }
        turn.conversation_state().set("items", &items)?;
        turn.send_text(items.join(", "));
        Ok(())
    }
}
