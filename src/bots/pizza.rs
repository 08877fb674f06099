//! The pizza order bot, the story Turnstile exists for: two quick "add" messages handled by two
//! replicas must both end up on the pizza, and the bot must never say "added" for a topping that
//! did not survive.
//!
//! Commands (case-insensitive): `add <topping>`, `remove <topping>`, `show`, `clear`. The order
//! is a list of toppings in conversation state; every reply that changes it names the whole order.

use async_trait::async_trait;

use crate::activity::types;
use crate::bot::{Bot, BotError, TurnContext};

const ORDER: &str = "order";

/// Takes a pizza order, one topping per message.
#[derive(Debug, Clone, Copy, Default)]
pub struct PizzaBot;

#[async_trait]
impl Bot for PizzaBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if turn.activity().activity_type.as_deref() != Some(types::MESSAGE) {
            return Ok(());
        }
        let text = turn.text().to_owned();
        let (command, argument) = match text.split_once(char::is_whitespace) {
            Some((command, rest)) => (command.to_lowercase(), rest.trim().to_owned()),
            None => (text.to_lowercase(), String::new()),
        };
        let mut order: Vec<String> = turn.conversation_property(ORDER)?;
        let reply = match (command.as_str(), argument.is_empty()) {
            ("add", false) => {
                if contains(&order, &argument) {
                    format!("{argument} is already on your pizza. {}", describe(&order))
                } else {
                    order.push(argument.clone());
                    turn.conversation_state().set(ORDER, &order)?;
                    format!("Added {argument}. {}", describe(&order))
                }
            }
            ("remove", false) => match order.iter().position(|t| t.eq_ignore_ascii_case(&argument))
            {
                Some(i) => {
                    let removed = order.remove(i);
                    turn.conversation_state().set(ORDER, &order)?;
                    format!("Removed {removed}. {}", describe(&order))
                }
                None => format!("There is no {argument} on your pizza. {}", describe(&order)),
            },
            ("show", true) => describe(&order),
            ("clear", true) => {
                turn.conversation_state().remove(ORDER);
                "Cleared your order. Your pizza has no toppings.".to_owned()
            }
            _ => "Say `add <topping>`, `remove <topping>`, `show` or `clear`.".to_owned(),
        };
        turn.send_text(reply);
        Ok(())
    }
}

fn contains(order: &[String], topping: &str) -> bool {
    order.iter().any(|t| t.eq_ignore_ascii_case(topping))
}

/// `Your pizza has: ham, mushroom.` — the reply format the tests and users read the order from.
fn describe(order: &[String]) -> String {
    if order.is_empty() {
        "Your pizza has no toppings.".to_owned()
    } else {
        format!("Your pizza has: {}.", order.join(", "))
    }
}
