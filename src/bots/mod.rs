//! The sample bots the `turnstile` binary hosts, selected by the request's `bot` field.

mod pizza;

pub use pizza::PizzaBot;

use crate::bot::BotRegistry;

/// The bots `turnstile serve` hosts: `pizza` (the default).
pub fn samples() -> BotRegistry {
    BotRegistry::new("pizza", PizzaBot)
}
