//! The slow bot: the counter bot, but every run first waits a set time, as a bot does whose turn
//! calls a language model or a payment API. On it a wasted run is visible and costs what it
//! would cost in production: each replay after a conflict waits again, so the attempts histogram
//! (`turnstile_turn_attempts`, bot runs per turn) and the turn latency show what a concurrency
//! policy saves (`bench/run.sh --hot`).

use std::time::Duration;

use async_trait::async_trait;

use super::CounterBot;
use crate::bot::{Bot, BotError, Scopes, TurnContext};

/// The slow bot's wait when none is configured.
pub const DEFAULT_DELAY: Duration = Duration::from_millis(200);

/// Counts the messages of each conversation, taking `delay` for every run.
#[derive(Debug, Clone, Copy)]
pub struct SlowBot {
    delay: Duration,
}

impl SlowBot {
    /// A slow bot whose every run takes `delay`.
    pub fn new(delay: Duration) -> Self {
        Self { delay }
    }
}

impl Default for SlowBot {
    fn default() -> Self {
        Self::new(DEFAULT_DELAY)
    }
}

#[async_trait]
impl Bot for SlowBot {
    /// Its count is the conversation's: no user state is loaded for it.
    fn scopes(&self) -> Scopes {
        Scopes::CONVERSATION
    }

    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        tokio::time::sleep(self.delay).await;
        CounterBot.on_turn(turn).await
    }
}
