//! The sample bots the `turnstile` binary hosts, selected by the request's `bot` field.

mod counter;
mod pizza;

pub use counter::CounterBot;
pub use pizza::PizzaBot;

use crate::bot::BotRegistry;

/// The bots `turnstile serve` hosts: `pizza` (the default) and `counter`.
pub fn samples() -> BotRegistry {
    BotRegistry::new("pizza", PizzaBot).with("counter", CounterBot)
}
