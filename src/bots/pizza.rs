//! The pizza order bot, the story Turnstile exists for: two quick "add" messages handled by two
//! replicas must both end up on the pizza, and the bot must never say "added" for a topping that
//! did not survive.
//!
//! Commands (case-insensitive): `add <topping>`, `remove <topping>`, `show`, `clear`. The order
//! is a list of toppings in conversation state; every reply that changes it names the whole order.
//!
//! Commands are a plain match, because a command bot reads best as one. The one question the bot
//! asks — `clear` with toppings on the pizza asks for confirmation first — is a dialog: a
//! [`ConfirmPrompt`] on the conversation's dialog stack. A pending question is an interruption
//! point, as in Bot Framework's samples: a yes or no answers it, any other message drops it and
//! runs as a command, so that one person's unanswered "clear?" never blocks another's "add".

use std::sync::LazyLock;

use async_trait::async_trait;

use crate::activity::types;
use crate::bot::{Bot, BotError, Scopes, TurnContext};
use crate::dialogs::prompts::{ConfirmRecognizer, recognize_confirm};
use crate::dialogs::{ConfirmPrompt, DialogSet, DialogTurnStatus, ListStyle, PromptOptions};

const ORDER: &str = "order";
const CONFIRM_CLEAR: &str = "confirm-clear";

/// The pizza bot's dialogs: built once, shared by every turn (they hold no conversation data).
static DIALOGS: LazyLock<DialogSet> = LazyLock::new(|| {
    DialogSet::new().with(ConfirmPrompt::with_recognizer(
        CONFIRM_CLEAR,
        ConfirmRecognizer::with_style(ListStyle::None),
    ))
});

/// Takes a pizza order, one topping per message.
#[derive(Debug, Clone, Copy, Default)]
pub struct PizzaBot;

/// What a command asks for.
enum Outcome {
    Reply(String),
    ConfirmClear(Vec<String>),
}

#[async_trait]
impl Bot for PizzaBot {
    /// Its order is the conversation's: no user state is loaded for it.
    fn scopes(&self) -> Scopes {
        Scopes::CONVERSATION
    }

    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if turn.activity().activity_type.as_deref() != Some(types::MESSAGE) {
            return Ok(());
        }
        let text = turn.text().to_owned();
        let mut dc = DIALOGS.context(turn)?;
        if dc.active_dialog().is_some() {
            if recognize_confirm(&text).is_some() {
                let result = dc.continue_dialog().await?;
                if result.status == DialogTurnStatus::Complete {
                    let turn = dc.turn();
                    let reply = if result.result_as::<bool>()?.unwrap_or(false) {
                        clear(turn)
                    } else {
                        let order: Vec<String> = turn.conversation_property(ORDER)?;
                        format!("Kept your order. {}", describe(&order))
                    };
                    turn.send_text(reply);
                }
                return Ok(());
            }
            dc.cancel_all_dialogs().await?;
        }
        match command(dc.turn(), &text)? {
            Outcome::Reply(reply) => dc.turn().send_text(reply),
            Outcome::ConfirmClear(order) => {
                let question = format!(
                    "Clear your whole order ({})? Say yes or no.",
                    order.join(", ")
                );
                let options = PromptOptions::new(question)
                    .retry_prompt("Say yes to clear your order, or no to keep it.");
                dc.prompt(CONFIRM_CLEAR, options).await?;
            }
        }
        Ok(())
    }
}

fn command(turn: &mut TurnContext<'_>, text: &str) -> Result<Outcome, BotError> {
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
        ("remove", false) => match order.iter().position(|t| t.eq_ignore_ascii_case(&argument)) {
            Some(i) => {
                let removed = order.remove(i);
                turn.conversation_state().set(ORDER, &order)?;
                format!("Removed {removed}. {}", describe(&order))
            }
            None => format!("There is no {argument} on your pizza. {}", describe(&order)),
        },
        ("show", true) => describe(&order),
        ("clear", true) if !order.is_empty() => return Ok(Outcome::ConfirmClear(order)),
        ("clear", true) => clear(turn),
        _ => "Say `add <topping>`, `remove <topping>`, `show` or `clear`.".to_owned(),
    };
    Ok(Outcome::Reply(reply))
}

fn clear(turn: &mut TurnContext<'_>) -> String {
    turn.conversation_state().remove(ORDER);
    "Cleared your order. Your pizza has no toppings.".to_owned()
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
