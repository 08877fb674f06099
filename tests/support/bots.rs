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

/// Records what each run was handed by double texting: appends the message — or, for a batch
/// of coalesced messages, all of them joined by `+` — to a conversation list, and replies with
/// the list and the messages it supersedes. A first attempt at `wait` writes a `tool_use` into
/// the conversation, then holds on `gate` before writing its `tool_result`, as an agent between
/// a tool call and its answer; it counts its runs.
pub struct DoubleTexts {
    /// Released by the test when the held run may go on.
    pub gate: Arc<Semaphore>,
    /// How many times the bot ran.
    pub runs: Arc<std::sync::atomic::AtomicU32>,
}

#[async_trait]
impl Bot for DoubleTexts {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let text_of = |a: &turnstile::activity::Activity| a.text.clone().unwrap_or_default();
        let superseded: Vec<String> = turn.superseded().iter().map(text_of).collect();
        let batch: Vec<String> = turn.batch().iter().map(text_of).collect();
        let said = if batch.is_empty() {
            turn.text().to_owned()
        } else {
            batch.join("+")
        };
        let mut items: Vec<String> = turn.conversation_property("items")?;
        items.push(said.clone());
        if said == "wait" && turn.attempt() == 1 {
            turn.conversation_state().set("tool_use", &"menu")?;
            turn.draft("looking at the menu")?;
            self.gate.acquire().await?.forget();
            turn.conversation_state().set("tool_result", &"pizza")?;
        }
        turn.conversation_state().set("items", &items)?;
        turn.send_text(format!(
            "{} | superseded: {}",
            items.join(", "),
            superseded.join(", ")
        ));
        Ok(())
    }
}
