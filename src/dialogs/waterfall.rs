//! The waterfall: a dialog made of steps that run one after the other, each usually asking the
//! user something and the next one getting the answer.
//!
//! A step is an async function of a [`WaterfallStep`] that returns what should happen next as a
//! [`StepAction`]: wait for the user, move on, begin a child (a prompt, say), end. Returning the
//! transition instead of performing it keeps a step a plain function of its inputs — the step
//! context borrows only the turn, never the stack — and leaves the waterfall alone in charge of
//! where it stands (`stepIndex`), which is what gets persisted and replayed.

use std::future::Future;
use std::pin::Pin;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    Dialog, DialogContext, DialogError, DialogReason, DialogTurnResult, PromptOptions,
    from_optional, to_json,
};
use crate::activity::{JsonMap, types};
use crate::bot::TurnContext;
use crate::state::PropertyError;

/// What a step returns.
pub type StepResult = Result<StepAction, DialogError>;

/// The future a step returns, borrowing its step context.
pub type StepFuture<'s> = Pin<Box<dyn Future<Output = StepResult> + Send + 's>>;

/// What happens after a step.
#[derive(Debug, Clone, PartialEq)]
pub enum StepAction {
    /// Wait for the user's next message, which the next step receives as its result.
    Wait,
    /// Run the next step now, with this result.
    Next(Option<Value>),
    /// Begin a child dialog; the next step runs when it ends, with its result.
    Begin {
        /// The child's id.
        dialog: String,
        /// Its options.
        options: Option<Value>,
    },
    /// End the waterfall with this result, resuming its parent.
    End(Option<Value>),
    /// End the waterfall without resuming its parent and begin another dialog in its place.
    Replace {
        /// The replacement's id.
        dialog: String,
        /// Its options.
        options: Option<Value>,
    },
    /// Cancel the whole stack.
    CancelAll,
}

/// A waterfall step: an async function of the step context.
///
/// Implemented for every `Fn(&mut WaterfallStep) -> StepFuture`, so both closures
/// (`|step| Box::pin(async move { … })`) and functions work:
///
/// ```
/// use turnstile::dialogs::{StepFuture, WaterfallStep};
///
/// fn greet<'s>(step: &'s mut WaterfallStep<'_, '_>) -> StepFuture<'s> {
///     Box::pin(async move {
///         step.send_text("hello");
///         step.wait()
///     })
/// }
/// ```
pub trait WaterfallStepFn: Send + Sync + 'static {
    /// Runs the step.
    fn call<'s>(&self, step: &'s mut WaterfallStep<'_, '_>) -> StepFuture<'s>;
}

impl<F> WaterfallStepFn for F
where
    F: for<'s, 'a, 't> Fn(&'s mut WaterfallStep<'a, 't>) -> StepFuture<'s> + Send + Sync + 'static,
{
    fn call<'s>(&self, step: &'s mut WaterfallStep<'_, '_>) -> StepFuture<'s> {
        self(step)
    }
}

/// A dialog of steps run in order; it ends after the last one.
pub struct WaterfallDialog {
    id: String,
    steps: Vec<Box<dyn WaterfallStepFn>>,
}

impl std::fmt::Debug for WaterfallDialog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaterfallDialog")
            .field("id", &self.id)
            .field("steps", &self.steps.len())
            .finish()
    }
}

/// What a waterfall persists, in Bot Framework's shape.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WaterfallState {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    options: Option<Value>,
    #[serde(default)]
    values: JsonMap,
    #[serde(default)]
    step_index: usize,
}

impl WaterfallDialog {
    /// A waterfall with no steps yet.
    pub fn new(id: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            steps: Vec::new(),
        }
    }

    /// Appends a step.
    #[must_use]
    pub fn step<F>(mut self, step: F) -> Self
    where
        F: for<'s, 'a, 't> Fn(&'s mut WaterfallStep<'a, 't>) -> StepFuture<'s>
            + Send
            + Sync
            + 'static,
    {
        self.steps.push(Box::new(step));
        self
    }

    /// Runs step `index` and what it asks for, moving on through [`StepAction::Next`] in a loop.
    async fn run_steps(
        &self,
        dc: &mut DialogContext<'_, '_>,
        mut index: usize,
        mut reason: DialogReason,
        mut result: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        loop {
            let Some(step_fn) = self.steps.get(index) else {
                return dc.end_dialog(result).await;
            };
            let mut state: WaterfallState = dc.active_dialog_mut()?.state_as()?;
            state.step_index = index;
            let mut step = WaterfallStep {
                dialog: &self.id,
                turn: dc.turn(),
                index,
                reason,
                options: state.options.take(),
                values: std::mem::take(&mut state.values),
                result: result.take(),
            };
            let action = step_fn.call(&mut step).await?;
            state.options = step.options;
            state.values = step.values;
            dc.active_dialog_mut()?.set_state(&state)?;
            match action {
                StepAction::Wait => return Ok(DialogTurnResult::waiting()),
                StepAction::Next(next) => {
                    index += 1;
                    reason = DialogReason::NextCalled;
                    result = next;
                }
                StepAction::Begin { dialog, options } => {
                    return dc.begin_dialog(&dialog, options).await;
                }
                StepAction::End(result) => return dc.end_dialog(result).await,
                StepAction::Replace { dialog, options } => {
                    return dc.replace_dialog(&dialog, options).await;
                }
                StepAction::CancelAll => return dc.cancel_all_dialogs().await,
            }
        }
    }
}

#[async_trait]
impl Dialog for WaterfallDialog {
    fn id(&self) -> &str {
        &self.id
    }

    async fn begin(
        &self,
        dc: &mut DialogContext<'_, '_>,
        options: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        let state = WaterfallState {
            options,
            ..WaterfallState::default()
        };
        dc.active_dialog_mut()?.set_state(&state)?;
        self.run_steps(dc, 0, DialogReason::BeginCalled, None).await
    }

    /// The user's message is the waiting step's answer: the next step gets its text as result.
    /// Other activities leave the waterfall waiting.
    async fn continue_dialog(
        &self,
        dc: &mut DialogContext<'_, '_>,
    ) -> Result<DialogTurnResult, DialogError> {
        if !dc.turn().activity().is_type(types::MESSAGE) {
            return Ok(DialogTurnResult::waiting());
        }
        let text = dc.turn().activity().text.clone();
        self.resume(dc, DialogReason::ContinueCalled, text.map(Value::String))
            .await
    }

    async fn resume(
        &self,
        dc: &mut DialogContext<'_, '_>,
        reason: DialogReason,
        result: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        let state: WaterfallState = dc.active_dialog_mut()?.state_as()?;
        self.run_steps(dc, state.step_index + 1, reason, result)
            .await
    }
}

/// What a step sees: the turn, the waterfall's options and values, and the previous step's
/// result (the child's result, or the user's text after [`WaterfallStep::wait`]).
pub struct WaterfallStep<'a, 't> {
    dialog: &'a str,
    turn: &'a mut TurnContext<'t>,
    index: usize,
    reason: DialogReason,
    options: Option<Value>,
    values: JsonMap,
    result: Option<Value>,
}

impl std::fmt::Debug for WaterfallStep<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaterfallStep")
            .field("dialog", &self.dialog)
            .field("index", &self.index)
            .field("reason", &self.reason)
            .field("options", &self.options)
            .field("values", &self.values)
            .field("result", &self.result)
            .finish_non_exhaustive()
    }
}

impl<'t> WaterfallStep<'_, 't> {
    /// The turn: the activity, state scopes and `send`.
    pub fn turn(&mut self) -> &mut TurnContext<'t> {
        self.turn
    }

    /// Buffers a text reply (shorthand for `turn().send_text`).
    pub fn send_text(&mut self, text: impl Into<String>) {
        self.turn.send_text(text);
    }

    /// This step's index, from 0.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Why this step runs: begun, the user answered, a child ended, or the previous step moved on.
    pub fn reason(&self) -> DialogReason {
        self.reason
    }

    /// The options the waterfall was begun with, as a `T`.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when they are not a `T`.
    pub fn options<T: DeserializeOwned>(&self) -> Result<Option<T>, DialogError> {
        from_optional(self.options.as_ref(), self.dialog, "options")
    }

    /// The previous step's result as a `T`: a child's result, or the user's text.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when it is not a `T`.
    pub fn result<T: DeserializeOwned>(&self) -> Result<Option<T>, DialogError> {
        from_optional(
            self.result.as_ref(),
            self.dialog,
            "the previous step's result",
        )
    }

    /// The previous step's result as JSON.
    pub fn result_value(&self) -> Option<&Value> {
        self.result.as_ref()
    }

    /// Value `name` from the waterfall's values bag, kept across its steps.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when it is not a `T`.
    pub fn value<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, DialogError> {
        from_optional(self.values.get(name), self.dialog, "a value")
    }

    /// Sets value `name` in the waterfall's values bag.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when `value` does not serialize.
    pub fn set_value<T: Serialize + ?Sized>(
        &mut self,
        name: &str,
        value: &T,
    ) -> Result<(), DialogError> {
        let json = to_json(value, self.dialog, "a value")?;
        self.values.insert(name.to_owned(), json);
        Ok(())
    }

    /// The whole values bag.
    pub fn values(&self) -> &JsonMap {
        &self.values
    }

    /// Wait for the user; the next step gets the text of their next message.
    ///
    /// # Errors
    /// Never; a `Result` so that it can end a step directly.
    pub fn wait(&self) -> StepResult {
        Ok(StepAction::Wait)
    }

    /// Run the next step now, without a result.
    ///
    /// # Errors
    /// Never.
    pub fn next(&self) -> StepResult {
        Ok(StepAction::Next(None))
    }

    /// Run the next step now, with `result`.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when `result` does not serialize.
    pub fn next_with<T: Serialize + ?Sized>(&self, result: &T) -> StepResult {
        Ok(StepAction::Next(Some(to_json(
            result,
            self.dialog,
            "result",
        )?)))
    }

    /// Begin prompt `id` with `options`; the next step gets the recognized value.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when the options do not serialize.
    pub fn prompt(&self, id: &str, options: PromptOptions) -> StepResult {
        Ok(StepAction::Begin {
            dialog: id.to_owned(),
            options: Some(to_json(&options, id, "options")?),
        })
    }

    /// Begin child dialog `id` without options.
    ///
    /// # Errors
    /// Never.
    pub fn begin(&self, id: &str) -> StepResult {
        Ok(StepAction::Begin {
            dialog: id.to_owned(),
            options: None,
        })
    }

    /// Begin child dialog `id` with `options`.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when the options do not serialize.
    pub fn begin_with<T: Serialize + ?Sized>(&self, id: &str, options: &T) -> StepResult {
        Ok(StepAction::Begin {
            dialog: id.to_owned(),
            options: Some(to_json(options, id, "options")?),
        })
    }

    /// End the waterfall without a result.
    ///
    /// # Errors
    /// Never.
    pub fn end(&self) -> StepResult {
        Ok(StepAction::End(None))
    }

    /// End the waterfall with `result`, which its parent (or the bot) receives.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when `result` does not serialize.
    pub fn end_with<T: Serialize + ?Sized>(&self, result: &T) -> StepResult {
        Ok(StepAction::End(Some(to_json(
            result,
            self.dialog,
            "result",
        )?)))
    }

    /// Replace the waterfall with dialog `id` (begun without options).
    ///
    /// # Errors
    /// Never.
    pub fn replace(&self, id: &str) -> StepResult {
        Ok(StepAction::Replace {
            dialog: id.to_owned(),
            options: None,
        })
    }

    /// Cancel every dialog on the stack.
    ///
    /// # Errors
    /// Never.
    pub fn cancel_all(&self) -> StepResult {
        Ok(StepAction::CancelAll)
    }

    /// Reads a conversation-state property (shorthand).
    ///
    /// # Errors
    /// When the stored value is not a `T`.
    pub fn conversation_property<T: DeserializeOwned + Default>(
        &self,
        name: &str,
    ) -> Result<T, PropertyError> {
        self.turn.conversation_property(name)
    }
}
