//! The sample bots the `turnstile` binary hosts, selected by the request's `bot` field.
//!
//! - `pizza` (the default) — the pizza order bot, see [`PizzaBot`].
//! - `counter` — counts messages per conversation, see [`CounterBot`]; the fault tests and the
//!   load generator use it.
//! - `slow` — the counter bot taking a set time per run (200 ms unless told), like a bot that
//!   calls a language model, see [`SlowBot`].
//! - `llm` — a stand-in for a language-model agent that streams its answer word by word
//!   (drafts, then the committed reply), see [`LlmBot`].
//! - `subtract` — the seed sample's dialog (Bot Framework's `42.scaleout`), see [`SubtractBot`].
//! - remote bots, one per `--remote-bot NAME=URL`: bots in any language, run by a bot worker
//!   over gRPC, see [`remote`].
//! - `waterfall`, `waterfall-nested`, `waterfall-prompt`, `text-prompt`, `number-prompt`,
//!   `confirm-prompt`, `choice-prompt`, `conversation-state`, `user-state` — the conformance
//!   bots, one per Bot Framework transcript, see [`conformance`].

pub mod conformance;
mod counter;
pub mod llm;
mod pizza;
pub mod remote;
pub(crate) mod slow;
mod subtract;

pub use counter::CounterBot;
pub use llm::LlmBot;
pub use pizza::PizzaBot;
pub use slow::SlowBot;
pub use subtract::SubtractBot;

use crate::bot::BotRegistry;
use conformance::{
    ChoicePromptBot, ConfirmPromptBot, NumberPromptBot, StateBot, StateScope, TextPromptBot,
    WaterfallBot, WaterfallNestedBot, WaterfallPromptBot,
};

/// The conformance bots' names, each with the transcript (file stem) it answers.
pub const CONFORMANCE: [(&str, &str); 9] = [
    ("waterfall", "Waterfall"),
    ("waterfall-nested", "WaterfallNested"),
    ("waterfall-prompt", "WaterfallPrompt"),
    ("text-prompt", "TextPrompt"),
    ("number-prompt", "NumberPrompt"),
    ("confirm-prompt", "ConfirmPrompt"),
    ("choice-prompt", "ChoicePrompt"),
    ("conversation-state", "ConversationStateTest"),
    ("user-state", "UserStateTest"),
];

/// The bots `turnstile serve` hosts: `pizza` (the default), `counter`, `slow`, `llm`, `subtract` and
/// the conformance bots.
pub fn samples() -> BotRegistry {
    BotRegistry::new("pizza", PizzaBot)
        .with("counter", CounterBot)
        .with("slow", SlowBot::default())
        .with("llm", LlmBot::default())
        .with("subtract", SubtractBot::default())
        .with("waterfall", WaterfallBot::default())
        .with("waterfall-nested", WaterfallNestedBot::default())
        .with("waterfall-prompt", WaterfallPromptBot::default())
        .with("text-prompt", TextPromptBot::default())
        .with("number-prompt", NumberPromptBot::default())
        .with("confirm-prompt", ConfirmPromptBot::default())
        .with("choice-prompt", ChoicePromptBot::default())
        .with(
            "conversation-state",
            StateBot::new(StateScope::Conversation),
        )
        .with("user-state", StateBot::new(StateScope::User))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_conformance_bot_is_hosted_and_pizza_is_the_default() {
        let bots = samples();
        assert_eq!(bots.default_name(), "pizza");
        for (name, _) in CONFORMANCE {
            assert!(bots.get(Some(name)).is_ok(), "{name} is not hosted");
        }
        assert!(bots.get(Some("subtract")).is_ok());
        assert!(bots.get(Some("counter")).is_ok());
        assert!(bots.get(Some("slow")).is_ok());
        assert!(bots.get(Some("llm")).is_ok());
    }
}
