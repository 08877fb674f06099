//! The conformance bots: one per Bot Framework transcript in `tests/fixtures/transcripts/`, each
//! the bot the Bot Framework SDKs were tested with, written on [`crate::dialogs`]. The `.chat`
//! files say word for word what each must answer; `tests/api/transcripts.rs` replays them through
//! gRPC.
//!
//! Like the originals, they act on messages only: the `conversationUpdate` that opens every
//! transcript gets no reply.

use async_trait::async_trait;

use crate::activity::types;
use crate::bot::{Bot, BotError, TurnContext};
use crate::dialogs::prompts::ConfirmRecognizer;
use crate::dialogs::{
    ChoicePrompt, ConfirmPrompt, DialogError, DialogSet, DialogTurnResult, DialogTurnStatus,
    FoundChoice, ListStyle, NumberPrompt, PromptOptions, StepFuture, TextPrompt, WaterfallDialog,
    WaterfallStep,
};

fn is_message(turn: &TurnContext<'_>) -> bool {
    turn.activity().is_type(types::MESSAGE)
}

/// A waterfall step that says `text` and waits.
fn say(
    text: &'static str,
) -> impl for<'s, 'a, 't> Fn(&'s mut WaterfallStep<'a, 't>) -> StepFuture<'s> + Send + Sync + 'static
{
    move |step| {
        Box::pin(async move {
            step.send_text(text);
            step.wait()
        })
    }
}

/// `Waterfall`: three steps, each says `stepN` and waits.
#[derive(Debug)]
pub struct WaterfallBot {
    dialogs: DialogSet,
}

impl Default for WaterfallBot {
    fn default() -> Self {
        let waterfall = WaterfallDialog::new("test")
            .step(say("step1"))
            .step(say("step2"))
            .step(say("step3"));
        Self {
            dialogs: DialogSet::new().with(waterfall),
        }
    }
}

#[async_trait]
impl Bot for WaterfallBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if is_message(turn) {
            self.dialogs.run(turn, "test").await?;
        }
        Ok(())
    }
}

/// `WaterfallNested`: waterfall a says `step1` and begins b (`step1.1`, `step1.2`); when b ends,
/// a says `step2` and begins c (`step2.1`, `step2.2`).
#[derive(Debug)]
pub struct WaterfallNestedBot {
    dialogs: DialogSet,
}

impl Default for WaterfallNestedBot {
    fn default() -> Self {
        let a = WaterfallDialog::new("test-waterfall-a")
            .step(|step| {
                Box::pin(async move {
                    step.send_text("step1");
                    step.begin("test-waterfall-b")
                })
            })
            .step(|step| {
                Box::pin(async move {
                    step.send_text("step2");
                    step.begin("test-waterfall-c")
                })
            });
        let b = WaterfallDialog::new("test-waterfall-b")
            .step(say("step1.1"))
            .step(say("step1.2"));
        let c = WaterfallDialog::new("test-waterfall-c")
            .step(say("step2.1"))
            .step(say("step2.2"));
        Self {
            dialogs: DialogSet::new().with(a).with(b).with(c),
        }
    }
}

#[async_trait]
impl Bot for WaterfallNestedBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if is_message(turn) {
            self.dialogs.run(turn, "test-waterfall-a").await?;
        }
        Ok(())
    }
}

/// `WaterfallPrompt`: each step thanks for the previous number, says `stepN` and asks for a
/// number (retry prompt `It must be a number`).
#[derive(Debug)]
pub struct WaterfallPromptBot {
    dialogs: DialogSet,
}

fn number_options() -> PromptOptions {
    PromptOptions::new("Enter a number.").retry_prompt("It must be a number")
}

impl Default for WaterfallPromptBot {
    fn default() -> Self {
        let waterfall = WaterfallDialog::new("test-waterfall")
            .step(|step| {
                Box::pin(async move {
                    step.send_text("step1");
                    step.prompt("number", number_options())
                })
            })
            .step(|step| {
                Box::pin(async move {
                    let n: i64 = step.result()?.unwrap_or_default();
                    step.send_text(format!("Thanks for '{n}'"));
                    step.send_text("step2");
                    step.prompt("number", number_options())
                })
            })
            .step(|step| {
                Box::pin(async move {
                    let n: i64 = step.result()?.unwrap_or_default();
                    step.send_text(format!("Thanks for '{n}'"));
                    step.send_text("step3");
                    step.wait()
                })
            });
        Self {
            dialogs: DialogSet::new()
                .with(waterfall)
                .with(NumberPrompt::<i64>::new("number")),
        }
    }
}

#[async_trait]
impl Bot for WaterfallPromptBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if is_message(turn) {
            self.dialogs.run(turn, "test-waterfall").await?;
        }
        Ok(())
    }
}

/// The prompt tests' turn: continue the prompt, or begin it with `options` when none is active.
async fn prompt_turn(
    dialogs: &DialogSet,
    turn: &mut TurnContext<'_>,
    prompt: &str,
    options: PromptOptions,
) -> Result<DialogTurnResult, DialogError> {
    let mut dc = dialogs.context(turn)?;
    let mut result = dc.continue_dialog().await?;
    if result.status == DialogTurnStatus::Empty {
        result = dc.prompt(prompt, options).await?;
    }
    Ok(result)
}

/// `TextPrompt`: asks for text longer than three characters.
#[derive(Debug)]
pub struct TextPromptBot {
    dialogs: DialogSet,
}

impl Default for TextPromptBot {
    fn default() -> Self {
        let prompt = TextPrompt::new("TextPrompt")
            .validator(|ctx| ctx.recognized().is_some_and(|t| t.chars().count() > 3));
        Self {
            dialogs: DialogSet::new().with(prompt),
        }
    }
}

#[async_trait]
impl Bot for TextPromptBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !is_message(turn) {
            return Ok(());
        }
        let options = PromptOptions::new("Enter some text.")
            .retry_prompt("Make sure the text is greater than three characters.");
        let result = prompt_turn(&self.dialogs, turn, "TextPrompt", options).await?;
        if result.status == DialogTurnStatus::Complete {
            let text: String = result.result_as()?.unwrap_or_default();
            turn.send_text(format!("Bot received the text '{text}'."));
        }
        Ok(())
    }
}

/// `NumberPrompt`: asks for a whole number between 0 and 100 (exclusive), in digits or words.
#[derive(Debug)]
pub struct NumberPromptBot {
    dialogs: DialogSet,
}

impl Default for NumberPromptBot {
    fn default() -> Self {
        let prompt = NumberPrompt::<i64>::new("NumberPrompt")
            .validator(|ctx| ctx.recognized().is_some_and(|n| (1..100).contains(n)));
        Self {
            dialogs: DialogSet::new().with(prompt),
        }
    }
}

#[async_trait]
impl Bot for NumberPromptBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !is_message(turn) {
            return Ok(());
        }
        let options = PromptOptions::new("Enter a number.")
            .retry_prompt("You must enter a valid positive number less than 100.");
        let result = prompt_turn(&self.dialogs, turn, "NumberPrompt", options).await?;
        if result.status == DialogTurnStatus::Complete {
            let n: i64 = result.result_as()?.unwrap_or_default();
            turn.send_text(format!("Bot received the number '{n}'."));
        }
        Ok(())
    }
}

/// `ConfirmPrompt`: asks for a yes or no, without showing choices.
#[derive(Debug)]
pub struct ConfirmPromptBot {
    dialogs: DialogSet,
}

impl Default for ConfirmPromptBot {
    fn default() -> Self {
        let prompt = ConfirmPrompt::with_recognizer(
            "ConfirmPrompt",
            ConfirmRecognizer::with_style(ListStyle::None),
        );
        Self {
            dialogs: DialogSet::new().with(prompt),
        }
    }
}

#[async_trait]
impl Bot for ConfirmPromptBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !is_message(turn) {
            return Ok(());
        }
        let options = PromptOptions::new("Please confirm.")
            .retry_prompt("Please confirm, say 'yes' or 'no' or something like that.");
        let result = prompt_turn(&self.dialogs, turn, "ConfirmPrompt", options).await?;
        if result.status == DialogTurnStatus::Complete {
            let confirmed: bool = result.result_as()?.unwrap_or_default();
            turn.send_text(if confirmed {
                "Confirmed."
            } else {
                "Not confirmed."
            });
        }
        Ok(())
    }
}

/// `ChoicePrompt`: asks for a color among red, green and blue, shown inline.
#[derive(Debug)]
pub struct ChoicePromptBot {
    dialogs: DialogSet,
}

impl Default for ChoicePromptBot {
    fn default() -> Self {
        Self {
            dialogs: DialogSet::new().with(ChoicePrompt::new("ChoicePrompt")),
        }
    }
}

#[async_trait]
impl Bot for ChoicePromptBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !is_message(turn) {
            return Ok(());
        }
        let options = PromptOptions::new("favorite color?")
            .retry_prompt("I didn't catch that. Select a color from the list.")
            .choices(["red", "green", "blue"]);
        let result = prompt_turn(&self.dialogs, turn, "ChoicePrompt", options).await?;
        if result.status == DialogTurnStatus::Complete {
            if let Some(choice) = result.result_as::<FoundChoice>()? {
                turn.send_text(format!("Bot received the choice '{}'.", choice.value));
            }
        }
        Ok(())
    }
}

/// Which state scope a [`StateBot`] works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateScope {
    /// `ConversationStateTest`.
    Conversation,
    /// `UserStateTest`.
    User,
}

/// `ConversationStateTest` and `UserStateTest`: `set X` stores X, `read` answers `value:X`,
/// `delete` removes it, anything else answers `bot message`.
#[derive(Debug, Clone, Copy)]
pub struct StateBot {
    scope: StateScope,
}

impl StateBot {
    /// A state bot over `scope`.
    pub fn new(scope: StateScope) -> Self {
        Self { scope }
    }
}

const VALUE: &str = "value";

#[async_trait]
impl Bot for StateBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !is_message(turn) {
            return Ok(());
        }
        let text = turn.text().to_owned();
        let state = match self.scope {
            StateScope::Conversation => turn.conversation_state(),
            StateScope::User => turn.user_state()?,
        };
        let reply = if let Some(value) = text.strip_prefix("set ") {
            state.set(VALUE, value)?;
            None
        } else if text == "read" {
            let value: String = state.get_or_default(VALUE)?;
            Some(format!("value:{value}"))
        } else if text == "delete" {
            state.remove(VALUE);
            None
        } else {
            Some("bot message".to_owned())
        };
        if let Some(reply) = reply {
            turn.send_text(reply);
        }
        Ok(())
    }
}
