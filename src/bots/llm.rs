//! The `llm` sample bot: a stand-in for a language-model agent, so that streaming can be tried
//! on any machine — no network, no model. It answers with canned text, one word every
//! `token_delay` (50 ms unless told, `--llm-token-delay-ms`), showing a status line first and
//! then its answer as it "writes" it ([`TurnContext::draft`]); only the whole answer, sent at
//! the end, is delivered, once its turn has committed.
//!
//! Like a real agent it keeps the conversation's transcript in conversation state (`transcript`:
//! the user's and its own messages, in order), which is what a conflict would otherwise corrupt,
//! and what a replay recomputes from the fresh state.

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::activity::types;
use crate::bot::{Bot, BotError, TurnContext};

const TRANSCRIPT: &str = "transcript";

/// How long the fake model takes per word unless told.
pub const DEFAULT_TOKEN_DELAY: Duration = Duration::from_millis(50);

/// Streams a canned answer word by word.
#[derive(Debug, Clone, Copy)]
pub struct LlmBot {
    token_delay: Duration,
}

impl LlmBot {
    /// A bot that "writes" one word every `token_delay`.
    pub fn new(token_delay: Duration) -> Self {
        Self { token_delay }
    }
}

impl Default for LlmBot {
    fn default() -> Self {
        Self::new(DEFAULT_TOKEN_DELAY)
    }
}

/// One message of the transcript kept in conversation state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `user` or `assistant`.
    pub role: String,
    /// What was said.
    pub text: String,
}

/// The fake model's answer to `text`, the `turn`th of the conversation: a function of the
/// state and the activity alone, as the replay rule asks.
pub fn answer(text: &str, turn: usize) -> String {
    format!(
        "You said \"{text}\". This is answer number {turn} of this conversation, written one word \
         at a time the way a language model writes, so that you can watch it arrive before it \
         is committed."
    )
}

#[async_trait]
impl Bot for LlmBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !turn.activity().is_type(types::MESSAGE) {
            return Ok(());
        }
        let mut transcript: Vec<Message> = turn.conversation_property(TRANSCRIPT)?;
        let said = turn.text().to_owned();
        turn.inform("Thinking…")?;
        let reply = answer(&said, transcript.len() / 2 + 1);
        let mut written = String::with_capacity(reply.len());
        for word in reply.split_inclusive(' ') {
            tokio::time::sleep(self.token_delay).await;
            written.push_str(word);
            turn.draft(written.as_str())?;
        }
        transcript.push(Message {
            role: "user".into(),
            text: said,
        });
        transcript.push(Message {
            role: "assistant".into(),
            text: written.clone(),
        });
        turn.conversation_state().set(TRANSCRIPT, &transcript)?;
        turn.send_text(written);
        Ok(())
    }
}
