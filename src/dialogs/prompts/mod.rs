//! Prompts: dialogs that ask one question, re-ask until the answer is recognized (and accepted
//! by an optional validator), and end with the recognized value.
//!
//! As in Bot Framework, a prompt is begun with [`PromptOptions`] (the prompt text, a retry prompt,
//! choices), which it persists with an attempt count as `{"options": …, "state":
//! {"attemptCount": n}}`. On each answer it runs its recognizer, then the validator if there is
//! one (which decides alone, and may send its own message instead of the retry prompt), and
//! either ends with the value or sends the retry prompt (the prompt when there is none) and
//! waits. The recognizers understand English only.
//!
//! One generic [`Prompt`] does this for every kind of answer; a [`Recognizer`] says what an answer
//! means and how the question is shown. [`TextPrompt`], [`NumberPrompt`], [`ConfirmPrompt`] and
//! [`ChoicePrompt`] are its instances.

mod choice;
mod confirm;
mod number;

pub use choice::{Choice, ChoiceRecognizer, FoundChoice, recognize_choice, render_inline};
pub use confirm::{ConfirmRecognizer, recognize_confirm};
pub use number::{NumberRecognizer, PromptNumber, RecognizedNumber, recognize_number};

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Dialog, DialogContext, DialogError, DialogInstance, DialogTurnResult, to_json};
use crate::activity::{Activity, types};
use crate::bot::TurnContext;

/// How a prompt shows its choices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ListStyle {
    /// Not at all: the prompt text alone.
    None,
    /// After the prompt text, on one line: `(1) red, (2) green, or (3) blue`.
    #[default]
    Inline,
}

/// What a prompt asks and how; persisted with the prompt, so keep it small.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PromptOptions {
    /// The question.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// What to say after an answer that was not accepted; the prompt when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_prompt: Option<String>,
    /// The choices of a choice prompt.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub choices: Vec<Choice>,
    /// Overrides the prompt's list style.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub style: Option<ListStyle>,
    /// Anything a validator wants to know (a range, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validations: Option<Value>,
}

impl PromptOptions {
    /// Options asking `prompt`.
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: Some(prompt.into()),
            ..Self::default()
        }
    }

    /// With `retry_prompt` said after an answer that was not accepted.
    #[must_use]
    pub fn retry_prompt(mut self, retry_prompt: impl Into<String>) -> Self {
        self.retry_prompt = Some(retry_prompt.into());
        self
    }

    /// With `choices` (for a choice prompt).
    #[must_use]
    pub fn choices(mut self, choices: impl IntoIterator<Item = impl Into<Choice>>) -> Self {
        self.choices = choices.into_iter().map(Into::into).collect();
        self
    }

    /// With the list style `style`, overriding the prompt's.
    #[must_use]
    pub fn style(mut self, style: ListStyle) -> Self {
        self.style = Some(style);
        self
    }

    /// With `validations` for the validator.
    #[must_use]
    pub fn validations(mut self, validations: Value) -> Self {
        self.validations = Some(validations);
        self
    }
}

/// What a prompt understands and how it shows its question.
pub trait Recognizer: Send + Sync + 'static {
    /// The recognized value, the prompt's result.
    type Value: Serialize + DeserializeOwned + Send + Sync;

    /// The value `activity` answers with, if any.
    fn recognize(&self, activity: &Activity, options: &PromptOptions) -> Option<Self::Value>;

    /// The text of the (retry) prompt `text` as the user sees it; choices get appended here.
    fn render(&self, text: &str, options: &PromptOptions) -> String {
        let _ = options;
        text.to_owned()
    }
}

/// What a validator sees: the turn, the recognized value, the options and the attempt count.
pub struct PromptValidatorContext<'a, 't, T> {
    turn: &'a mut TurnContext<'t>,
    recognized: Option<T>,
    options: &'a PromptOptions,
    attempt_count: u32,
}

impl<'t, T> PromptValidatorContext<'_, 't, T> {
    /// The turn, to read state or send a message of the validator's own instead of the retry
    /// prompt.
    pub fn turn(&mut self) -> &mut TurnContext<'t> {
        self.turn
    }

    /// The recognized value; `None` when the recognizer understood nothing.
    pub fn recognized(&self) -> Option<&T> {
        self.recognized.as_ref()
    }

    /// The options the prompt was begun with.
    pub fn options(&self) -> &PromptOptions {
        self.options
    }

    /// How many answers the prompt has received, this one included (from 1).
    pub fn attempt_count(&self) -> u32 {
        self.attempt_count
    }
}

type Validator<T> = Box<dyn Fn(&mut PromptValidatorContext<'_, '_, T>) -> bool + Send + Sync>;

/// A prompt: asks, re-asks until an answer is accepted, ends with the recognized value.
pub struct Prompt<R: Recognizer> {
    id: String,
    recognizer: R,
    validator: Option<Validator<R::Value>>,
}

/// Ends with the text of the user's message (trimmed, not empty).
pub type TextPrompt = Prompt<TextRecognizer>;
/// Ends with a number, typed `T` (`f64`, `i64`, `i32`, …); see [`recognize_number`].
pub type NumberPrompt<T> = Prompt<NumberRecognizer<T>>;
/// Ends with `true` or `false`; see [`recognize_confirm`].
pub type ConfirmPrompt = Prompt<ConfirmRecognizer>;
/// Ends with the [`FoundChoice`] the user picked; see [`recognize_choice`].
pub type ChoicePrompt = Prompt<ChoiceRecognizer>;

impl<R: Recognizer> std::fmt::Debug for Prompt<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompt")
            .field("id", &self.id)
            .field("validator", &self.validator.is_some())
            .finish_non_exhaustive()
    }
}

impl<R: Recognizer + Default> Prompt<R> {
    /// A prompt with id `id` and the default recognizer.
    pub fn new(id: impl Into<String>) -> Self {
        Self::with_recognizer(id, R::default())
    }
}

impl<R: Recognizer> Prompt<R> {
    /// A prompt with id `id` and `recognizer`.
    pub fn with_recognizer(id: impl Into<String>, recognizer: R) -> Self {
        Self {
            id: id.into(),
            recognizer,
            validator: None,
        }
    }

    /// With `validator`, which decides whether an answer is accepted (the recognized value may
    /// be `None`). It must follow the replay rule: no side effects beyond the turn context.
    #[must_use]
    pub fn validator<F>(mut self, validator: F) -> Self
    where
        F: Fn(&mut PromptValidatorContext<'_, '_, R::Value>) -> bool + Send + Sync + 'static,
    {
        self.validator = Some(Box::new(validator));
        self
    }

    /// The recognizer.
    pub fn recognizer(&self) -> &R {
        &self.recognizer
    }

    fn send(&self, turn: &mut TurnContext<'_>, options: &PromptOptions, retry: bool) {
        let text = match (retry, &options.retry_prompt, &options.prompt) {
            (true, Some(retry), _) => retry,
            (_, _, Some(prompt)) => prompt,
            _ => return,
        };
        turn.send_text(self.recognizer.render(text, options));
    }
}

/// What a prompt persists, in Bot Framework's shape.
#[derive(Debug, Default, Serialize, Deserialize)]
struct PromptState {
    #[serde(default)]
    options: PromptOptions,
    #[serde(default)]
    state: Attempts,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Attempts {
    #[serde(default)]
    attempt_count: u32,
}

#[async_trait]
impl<R: Recognizer> Dialog for Prompt<R> {
    fn id(&self) -> &str {
        &self.id
    }

    async fn begin(
        &self,
        dc: &mut DialogContext<'_, '_>,
        options: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        let options: PromptOptions = match options {
            None | Some(Value::Null) => PromptOptions::default(),
            Some(v) => PromptOptions::deserialize(v)
                .map_err(|e| DialogError::shape(&self.id, "options", e))?,
        };
        self.send(dc.turn(), &options, false);
        dc.active_dialog_mut()?.set_state(&PromptState {
            options,
            state: Attempts::default(),
        })?;
        Ok(DialogTurnResult::waiting())
    }

    async fn continue_dialog(
        &self,
        dc: &mut DialogContext<'_, '_>,
    ) -> Result<DialogTurnResult, DialogError> {
        if !dc.turn().activity().is_type(types::MESSAGE) {
            return Ok(DialogTurnResult::waiting());
        }
        let mut state: PromptState = dc.active_dialog_mut()?.state_as()?;
        state.state.attempt_count = state.state.attempt_count.saturating_add(1);
        let recognized = self
            .recognizer
            .recognize(dc.turn().activity(), &state.options);
        let (accepted, recognized, validator_replied) = match &self.validator {
            None => (recognized.is_some(), recognized, false),
            Some(validator) => {
                let turn = dc.turn();
                let sent_before = turn.sent().len();
                let mut context = PromptValidatorContext {
                    turn,
                    recognized,
                    options: &state.options,
                    attempt_count: state.state.attempt_count,
                };
                let accepted = validator(&mut context);
                let replied = context.turn.sent().len() > sent_before;
                (accepted, context.recognized, replied)
            }
        };
        if accepted {
            let result = recognized
                .map(|value| to_json(&value, &self.id, "result"))
                .transpose()?;
            return dc.end_dialog(result).await;
        }
        if !validator_replied {
            self.send(dc.turn(), &state.options, true);
        }
        dc.active_dialog_mut()?.set_state(&state)?;
        Ok(DialogTurnResult::waiting())
    }

    /// A dialog begun on top of the prompt has ended: ask again.
    async fn resume(
        &self,
        dc: &mut DialogContext<'_, '_>,
        _reason: super::DialogReason,
        _result: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        dc.reprompt_dialog().await?;
        Ok(DialogTurnResult::waiting())
    }

    async fn reprompt(
        &self,
        turn: &mut TurnContext<'_>,
        instance: &DialogInstance,
    ) -> Result<(), DialogError> {
        let state: PromptState = instance.state_as()?;
        self.send(turn, &state.options, false);
        Ok(())
    }
}

/// Recognizes any message text: trimmed, and not empty (a message with only an attachment is no
/// answer to a text prompt).
#[derive(Debug, Clone, Copy, Default)]
pub struct TextRecognizer;

impl Recognizer for TextRecognizer {
    type Value = String;

    fn recognize(&self, activity: &Activity, _options: &PromptOptions) -> Option<String> {
        activity
            .text_trimmed()
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
    }
}

/// The words of `text`, lowercase, split at whitespace and hyphens, with surrounding punctuation
/// removed; what the recognizers match against.
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| c.is_whitespace() || c == '-' || c == '–')
        .map(|w| {
            w.trim_matches(|c: char| !c.is_alphanumeric())
                .to_lowercase()
        })
        .filter(|w| !w.is_empty())
        .collect()
}
