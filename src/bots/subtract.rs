//! The subtract bot: the seed sample's dialog (Bot Framework's `42.scaleout`), a three-step
//! waterfall over two number prompts. It is the smallest dialog that keeps state across turns —
//! the first number waits in the waterfall's values while the second is asked — which is what
//! the scale-out story needs to show.
//!
//! Any first message → `Enter a number.`; a number N → `I have N now enter another number`; a
//! number M → `The result of the first minus the second is N-M.`, and the dialog ends. Anything
//! that is not a whole number repeats the prompt.

use async_trait::async_trait;

use crate::activity::types;
use crate::bot::{Bot, BotError, Scopes, TurnContext};
use crate::dialogs::{DialogSet, NumberPrompt, PromptOptions, WaterfallDialog};

const ROOT: &str = "subtract";
const NUMBER: &str = "number";
const FIRST: &str = "first";

/// Subtracts the second number the user gives from the first.
#[derive(Debug)]
pub struct SubtractBot {
    dialogs: DialogSet,
}

impl Default for SubtractBot {
    fn default() -> Self {
        let waterfall = WaterfallDialog::new(ROOT)
            .step(|step| {
                Box::pin(async move { step.prompt(NUMBER, PromptOptions::new("Enter a number.")) })
            })
            .step(|step| {
                Box::pin(async move {
                    // A number prompt without a validator ends only with a number.
                    let first: i64 = step.result()?.unwrap_or_default();
                    step.set_value(FIRST, &first)?;
                    step.prompt(
                        NUMBER,
                        PromptOptions::new(format!("I have {first} now enter another number")),
                    )
                })
            })
            .step(|step| {
                Box::pin(async move {
                    let first: i64 = step.value(FIRST)?.unwrap_or_default();
                    let second: i64 = step.result()?.unwrap_or_default();
                    // i128: the difference of two i64 always fits.
                    let difference = i128::from(first) - i128::from(second);
                    step.send_text(format!(
                        "The result of the first minus the second is {difference}."
                    ));
                    step.end()
                })
            });
        Self {
            dialogs: DialogSet::new()
                .with(waterfall)
                .with(NumberPrompt::<i64>::new(NUMBER)),
        }
    }
}

#[async_trait]
impl Bot for SubtractBot {
    /// Its question is the conversation's: no user state is loaded for it.
    fn scopes(&self) -> Scopes {
        Scopes::CONVERSATION
    }

    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if turn.activity().is_type(types::MESSAGE) {
            self.dialogs.run(turn, ROOT).await?;
        }
        Ok(())
    }
}
