//! Dialogs: Bot Framework v4's conversation model — a dialog set, a dialog stack, waterfalls,
//! component dialogs and prompts — running inside Turnstile's replayable turns.
//!
//! Bot Framework users think of a conversation as a stack of dialogs: the active dialog (index 0)
//! gets each message; it may begin a child, which then gets the messages until it ends and hands
//! its result back to the parent (`resume`). This module gives them that model with the same
//! persisted shape, so that the state stays readable and stable across versions: a [`DialogSet`]
//! is bound to a conversation-state property (`DialogState` unless named otherwise), which holds
//! Bot Framework's `DialogState` object `{"dialogStack": […]}`, an array of
//! `{"id": …, "state": {…}}` with the active dialog first. Two dialog sets bound to two
//! properties keep two stacks. A [`WaterfallDialog`] keeps `{"options", "values", "stepIndex"}`, a prompt
//! `{"options", "state": {"attemptCount"}}`, a [`ComponentDialog`] its own stack under
//! `{"dialogs": {"dialogStack": […]}}`.
//!
//! A turn works through a [`DialogContext`], made from a [`DialogSet`] and the [`TurnContext`]:
//!
//! ```
//! # use turnstile::dialogs::{DialogSet, DialogError, DialogTurnStatus};
//! # async fn on_turn(dialogs: &DialogSet, turn: &mut turnstile::TurnContext<'_>) -> Result<(), DialogError> {
//! let mut dc = dialogs.context(turn)?;
//! let result = dc.continue_dialog().await?;
//! if result.status == DialogTurnStatus::Empty {
//!     dc.begin_dialog("root", None).await?;
//! }
//! # Ok(()) }
//! ```
//! [`DialogSet::run`] does exactly that. There is no save to call: the context writes the stack
//! into its property when it goes out of scope, before the bot's turn returns, so the stack is
//! committed with the turn's other state (or thrown away with a replayed attempt) and no path
//! through a bot can forget it.
//!
//! # The replay rule, for dialogs
//! **A dialog turn must be a deterministic function of (state, activity).** The engine may run a
//! turn several times when another replica changed the conversation meanwhile: it throws away
//! everything the losing attempt did — the dialog stack it saved, the messages it sent — and runs
//! the bot again on the state the winner left. So a waterfall step, a validator or a dialog must
//! not:
//! - change another system in a way that is not safe to repeat,
//! - depend on the clock, randomness or a counter that the state does not record,
//! - keep anything in a process-wide variable between turns (put it in the step's values, the
//!   dialog's state or a state scope, which are replayed with the turn).
//!
//! Everything the context offers (state scopes, `send`, the dialog stack) is buffered and replays
//! correctly by construction. A call to another service is safe to repeat when it is
//! idempotent: derive an idempotency key from the inbound activity — e.g.
//! `format!("{}:{}:{}", channel, conversation id, activity id)`, plus the step index when one
//! turn makes several calls — and have the service return the first answer for a key it has
//! seen. Never derive the key from [`TurnContext::attempt`]: every attempt must make the *same*
//! call. Reads are fine as they are, as long as the turn records what it read (a quoted price, a
//! generated reference) in state before acting on it.

mod component;
pub mod prompts;
mod waterfall;

pub use component::ComponentDialog;
pub use prompts::{
    Choice, ChoicePrompt, ConfirmPrompt, FoundChoice, ListStyle, NumberPrompt, Prompt,
    PromptOptions, PromptValidatorContext, TextPrompt,
};
pub use waterfall::{
    StepAction, StepFuture, StepResult, WaterfallDialog, WaterfallStep, WaterfallStepFn,
};

use std::collections::HashMap;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::activity::JsonMap;
use crate::bot::{NoSuchScope, TurnContext};
use crate::state::PropertyError;

/// The conversation-state property a [`DialogSet`] is bound to unless named otherwise.
pub const DIALOG_STATE: &str = "DialogState";

/// The member of a dialog state object (and of a component dialog's state) holding the stack, as
/// in Bot Framework.
pub const DIALOG_STACK: &str = "dialogStack";

/// Bot Framework's `DialogState`: the stored form of one dialog stack.
#[derive(Debug, Default, Serialize, Deserialize)]
struct DialogState {
    #[serde(rename = "dialogStack", default)]
    dialog_stack: Vec<DialogInstance>,
}

/// Why a dialog turn failed. The turn fails with it: nothing is committed or sent.
#[derive(Debug, thiserror::Error)]
pub enum DialogError {
    /// The stack or a step named a dialog the set does not hold (after a deploy removed it, say).
    #[error("no dialog with id `{0}` in this dialog set")]
    UnknownDialog(String),
    /// A dialog operation that needs an active dialog found the stack empty.
    #[error("the dialog stack is empty: there is no active dialog")]
    NoActiveDialog,
    /// A dialog's stored state, its options or a result did not have the expected shape.
    #[error("dialog `{dialog}`: {what} does not have the expected shape: {source}")]
    Shape {
        /// The dialog whose data it is.
        dialog: String,
        /// What was being read or written (`state`, `options`, `result`, …).
        what: &'static str,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// A state property could not be read or written.
    #[error(transparent)]
    State(#[from] PropertyError),
    /// A scope the activity does not have (user state without `from.id`).
    #[error(transparent)]
    Scope(#[from] NoSuchScope),
    /// A step or validator failed for its own reasons.
    #[error("a dialog step failed: {0}")]
    Failed(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl DialogError {
    /// A step's own failure, to return from a step with `?` via `map_err(DialogError::failed)`.
    pub fn failed(error: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Self::Failed(error.into())
    }

    fn shape(dialog: &str, what: &'static str, source: serde_json::Error) -> Self {
        Self::Shape {
            dialog: dialog.to_owned(),
            what,
            source,
        }
    }
}

/// Where the dialog stack stands after a dialog operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialogTurnStatus {
    /// The stack is empty: no dialog was active.
    Empty,
    /// The active dialog waits for the user's next message.
    Waiting,
    /// The last dialog on the stack ended; the result is its result.
    Complete,
    /// The stack was cancelled.
    Cancelled,
}

/// The outcome of a dialog operation.
#[derive(Debug, Clone, PartialEq)]
pub struct DialogTurnResult {
    /// Where the stack stands.
    pub status: DialogTurnStatus,
    /// The ended dialog's result, for [`DialogTurnStatus::Complete`].
    pub result: Option<Value>,
}

impl DialogTurnResult {
    /// The stack is empty.
    pub fn empty() -> Self {
        Self {
            status: DialogTurnStatus::Empty,
            result: None,
        }
    }

    /// The active dialog waits for the next message ("end of turn").
    pub fn waiting() -> Self {
        Self {
            status: DialogTurnStatus::Waiting,
            result: None,
        }
    }

    /// The root dialog ended with `result`.
    pub fn complete(result: Option<Value>) -> Self {
        Self {
            status: DialogTurnStatus::Complete,
            result,
        }
    }

    /// The stack was cancelled.
    pub fn cancelled() -> Self {
        Self {
            status: DialogTurnStatus::Cancelled,
            result: None,
        }
    }

    /// The result as a `T`, `None` when there is none (or it is JSON `null`).
    ///
    /// # Errors
    /// [`DialogError::Shape`] when the result is not a `T`.
    pub fn result_as<T: DeserializeOwned>(&self) -> Result<Option<T>, DialogError> {
        from_optional(self.result.as_ref(), "the root dialog", "result")
    }
}

/// Why a dialog is being resumed or ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialogReason {
    /// It was just begun.
    BeginCalled,
    /// The user sent a message.
    ContinueCalled,
    /// It (or the child it waited for) ended.
    EndCalled,
    /// It is being replaced by another dialog.
    ReplaceCalled,
    /// The stack is being cancelled.
    CancelCalled,
    /// A waterfall step moved on to the next step without waiting.
    NextCalled,
}

/// One entry of the dialog stack: which dialog, and its persisted state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DialogInstance {
    /// The dialog's id in its set.
    pub id: String,
    /// The dialog's own state (a JSON object whose shape the dialog decides).
    #[serde(default)]
    pub state: JsonMap,
}

impl DialogInstance {
    fn new(id: &str) -> Self {
        Self {
            id: id.to_owned(),
            state: JsonMap::new(),
        }
    }

    /// The whole state read as a `T` (missing members take their serde defaults).
    ///
    /// # Errors
    /// [`DialogError::Shape`] when the state is not a `T`.
    pub fn state_as<T: DeserializeOwned>(&self) -> Result<T, DialogError> {
        T::deserialize(Value::Object(self.state.clone()))
            .map_err(|e| DialogError::shape(&self.id, "state", e))
    }

    /// Replaces the state with `state`, which must serialize to a JSON object.
    ///
    /// # Errors
    /// [`DialogError::Shape`] when it does not.
    pub fn set_state<T: Serialize>(&mut self, state: &T) -> Result<(), DialogError> {
        match serde_json::to_value(state) {
            Ok(Value::Object(map)) => {
                self.state = map;
                Ok(())
            }
            Ok(_) => Err(DialogError::shape(
                &self.id,
                "state",
                serde::de::Error::custom("a dialog's state must be a JSON object"),
            )),
            Err(e) => Err(DialogError::shape(&self.id, "state", e)),
        }
    }
}

/// A dialog: one step of a conversation that can span several turns.
///
/// Only [`Dialog::begin`] is required; the defaults make a dialog that ends when the next message
/// arrives and hands a finished child's result on as its own. Implementations must follow the
/// replay rule in the module documentation.
#[async_trait]
pub trait Dialog: Send + Sync + 'static {
    /// The dialog's id, unique in its set.
    fn id(&self) -> &str;

    /// Starts the dialog; its fresh instance is already the active one on `dc`'s stack.
    ///
    /// # Errors
    /// When the dialog fails; the turn fails with it.
    async fn begin(
        &self,
        dc: &mut DialogContext<'_, '_>,
        options: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError>;

    /// The user sent another activity while this dialog was active.
    ///
    /// # Errors
    /// When the dialog fails.
    async fn continue_dialog(
        &self,
        dc: &mut DialogContext<'_, '_>,
    ) -> Result<DialogTurnResult, DialogError> {
        dc.end_dialog(None).await
    }

    /// A child this dialog began has ended with `result`; this dialog is active again.
    ///
    /// # Errors
    /// When the dialog fails.
    async fn resume(
        &self,
        dc: &mut DialogContext<'_, '_>,
        reason: DialogReason,
        result: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        let _ = reason;
        dc.end_dialog(result).await
    }

    /// Asks the user again for whatever the dialog is waiting for.
    ///
    /// # Errors
    /// When the dialog fails.
    async fn reprompt(
        &self,
        turn: &mut TurnContext<'_>,
        instance: &DialogInstance,
    ) -> Result<(), DialogError> {
        let _ = (turn, instance);
        Ok(())
    }

    /// The dialog's instance has been taken off the stack, for `reason`.
    ///
    /// # Errors
    /// When the dialog fails.
    async fn end(
        &self,
        turn: &mut TurnContext<'_>,
        instance: &DialogInstance,
        reason: DialogReason,
    ) -> Result<(), DialogError> {
        let _ = (turn, instance, reason);
        Ok(())
    }
}

/// The dialogs a bot (or a component dialog) can begin, by id, and the conversation-state
/// property their stack lives in.
///
/// Build it once, when the bot is built; it holds no conversation data.
pub struct DialogSet {
    dialogs: HashMap<String, Box<dyn Dialog>>,
    property: String,
}

impl Default for DialogSet {
    fn default() -> Self {
        Self::bound_to(DIALOG_STATE)
    }
}

impl std::fmt::Debug for DialogSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<&str> = self.dialogs.keys().map(String::as_str).collect();
        ids.sort_unstable();
        f.debug_struct("DialogSet")
            .field("dialogs", &ids)
            .field("property", &self.property)
            .finish()
    }
}

impl DialogSet {
    /// An empty set, bound to the conversation-state property [`DIALOG_STATE`].
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty set whose stack lives in conversation-state property `property`: a bot with two
    /// independent dialog sets binds them to two properties.
    pub fn bound_to(property: impl Into<String>) -> Self {
        Self {
            dialogs: HashMap::new(),
            property: property.into(),
        }
    }

    /// The conversation-state property this set's stack lives in.
    pub fn property(&self) -> &str {
        &self.property
    }

    /// Adds `dialog` under its id, replacing any dialog with that id.
    #[must_use]
    pub fn with(mut self, dialog: impl Dialog) -> Self {
        self.add(dialog);
        self
    }

    /// Adds `dialog` under its id, replacing any dialog with that id.
    pub fn add(&mut self, dialog: impl Dialog) {
        self.dialogs
            .insert(dialog.id().to_owned(), Box::new(dialog));
    }

    /// The dialog with id `id`.
    ///
    /// # Errors
    /// [`DialogError::UnknownDialog`] when the set has none.
    pub fn find(&self, id: &str) -> Result<&dyn Dialog, DialogError> {
        self.dialogs
            .get(id)
            .map(Box::as_ref)
            .ok_or_else(|| DialogError::UnknownDialog(id.to_owned()))
    }

    /// A dialog context for this turn, with the stack loaded from this set's property; the
    /// context writes it back when it is dropped.
    ///
    /// A conversation stored before dialog sets had a property of their own keeps its stack in
    /// a top-level `dialogStack`; the default set takes it from there, and moves it.
    ///
    /// # Errors
    /// [`DialogError::State`] when the stored dialog state is not a dialog stack.
    pub fn context<'a, 't>(
        &'a self,
        turn: &'a mut TurnContext<'t>,
    ) -> Result<DialogContext<'a, 't>, DialogError> {
        let state = turn.conversation_state();
        let stack = match state.get::<DialogState>(&self.property)? {
            Some(stored) => stored.dialog_stack,
            None if self.property == DIALOG_STATE => state.get_or_default(DIALOG_STACK)?,
            None => Vec::new(),
        };
        let mut dc = DialogContext::over(self, turn, stack);
        dc.home = Some(&self.property);
        Ok(dc)
    }

    /// The usual turn: continue the active dialog; when none is active, begin `root` (without
    /// options); the stack is saved with the turn. Bots usually call this for message activities
    /// only, so that a `conversationUpdate` does not start a dialog.
    ///
    /// # Errors
    /// Whatever a dialog fails with, or [`DialogError::State`].
    pub async fn run(
        &self,
        turn: &mut TurnContext<'_>,
        root: &str,
    ) -> Result<DialogTurnResult, DialogError> {
        let mut dc = self.context(turn)?;
        let mut result = dc.continue_dialog().await?;
        if result.status == DialogTurnStatus::Empty {
            result = dc.begin_dialog(root, None).await?;
        }
        Ok(result)
    }
}

/// One turn's view of a dialog stack: the set its ids refer to, the turn, and the stack itself.
///
/// The stack is loaded when the context is made from a [`DialogSet`] and written back into the
/// set's property when the context is dropped (the end of the bot's turn at the latest), so it is
/// committed with the turn; a component dialog's inner context is kept by the component instead.
pub struct DialogContext<'a, 't> {
    dialogs: &'a DialogSet,
    turn: &'a mut TurnContext<'t>,
    stack: Vec<DialogInstance>,
    /// The conversation-state property the stack is written to on drop; `None` for an inner
    /// stack, which its component dialog keeps in its own state.
    home: Option<&'a str>,
}

impl std::fmt::Debug for DialogContext<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DialogContext")
            .field("dialogs", self.dialogs)
            .field("stack", &self.stack)
            .finish_non_exhaustive()
    }
}

impl<'a, 't> DialogContext<'a, 't> {
    /// A context over `stack` (active dialog first) that writes nowhere; component dialogs use
    /// it for their inner stacks, which they keep in their own state ([`Self::into_stack`]).
    pub(crate) fn over(
        dialogs: &'a DialogSet,
        turn: &'a mut TurnContext<'t>,
        stack: Vec<DialogInstance>,
    ) -> Self {
        Self {
            dialogs,
            turn,
            stack,
            home: None,
        }
    }

    /// The turn: the activity, state scopes and `send`.
    pub fn turn(&mut self) -> &mut TurnContext<'t> {
        self.turn
    }

    /// The stack, the active dialog first.
    pub fn stack(&self) -> &[DialogInstance] {
        &self.stack
    }

    /// The active dialog's instance, if any.
    pub fn active_dialog(&self) -> Option<&DialogInstance> {
        self.stack.first()
    }

    /// The active dialog's instance, to change its state.
    ///
    /// # Errors
    /// [`DialogError::NoActiveDialog`] when the stack is empty.
    pub fn active_dialog_mut(&mut self) -> Result<&mut DialogInstance, DialogError> {
        self.stack.first_mut().ok_or(DialogError::NoActiveDialog)
    }

    /// Pushes a new instance of dialog `id` and begins it with `options`.
    ///
    /// # Errors
    /// [`DialogError::UnknownDialog`], or whatever the dialog fails with.
    pub async fn begin_dialog(
        &mut self,
        id: &str,
        options: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        let dialogs = self.dialogs;
        let dialog = dialogs.find(id)?;
        self.stack.insert(0, DialogInstance::new(id));
        dialog.begin(self, options).await
    }

    /// Begins prompt `id` with `options`: [`Self::begin_dialog`] for prompts.
    ///
    /// # Errors
    /// As [`Self::begin_dialog`].
    pub async fn prompt(
        &mut self,
        id: &str,
        options: PromptOptions,
    ) -> Result<DialogTurnResult, DialogError> {
        let options =
            serde_json::to_value(options).map_err(|e| DialogError::shape(id, "options", e))?;
        self.begin_dialog(id, Some(options)).await
    }

    /// Hands the inbound activity to the active dialog; [`DialogTurnStatus::Empty`] when the
    /// stack is empty.
    ///
    /// # Errors
    /// Whatever the dialog fails with.
    pub async fn continue_dialog(&mut self) -> Result<DialogTurnResult, DialogError> {
        let dialogs = self.dialogs;
        match self.stack.first() {
            None => Ok(DialogTurnResult::empty()),
            Some(active) => dialogs.find(&active.id)?.continue_dialog(self).await,
        }
    }

    /// Ends the active dialog with `result` and resumes its parent with it; when it was the
    /// last dialog, the stack is complete and `result` is the turn's result.
    ///
    /// # Errors
    /// Whatever the dialogs fail with.
    pub async fn end_dialog(
        &mut self,
        result: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        self.pop(DialogReason::EndCalled).await?;
        let dialogs = self.dialogs;
        match self.stack.first() {
            None => Ok(DialogTurnResult::complete(result)),
            Some(parent) => {
                dialogs
                    .find(&parent.id)?
                    .resume(self, DialogReason::EndCalled, result)
                    .await
            }
        }
    }

    /// Ends the active dialog without resuming its parent and begins dialog `id` in its place.
    ///
    /// # Errors
    /// As [`Self::begin_dialog`].
    pub async fn replace_dialog(
        &mut self,
        id: &str,
        options: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        self.pop(DialogReason::ReplaceCalled).await?;
        self.begin_dialog(id, options).await
    }

    /// Ends every dialog on the stack, active first, without resuming any.
    ///
    /// # Errors
    /// Whatever the dialogs' `end` fails with.
    pub async fn cancel_all_dialogs(&mut self) -> Result<DialogTurnResult, DialogError> {
        if self.stack.is_empty() {
            return Ok(DialogTurnResult::empty());
        }
        while !self.stack.is_empty() {
            self.pop(DialogReason::CancelCalled).await?;
        }
        Ok(DialogTurnResult::cancelled())
    }

    /// Asks the active dialog to prompt again.
    ///
    /// # Errors
    /// Whatever the dialog fails with.
    pub async fn reprompt_dialog(&mut self) -> Result<(), DialogError> {
        let dialogs = self.dialogs;
        match self.stack.first() {
            None => Ok(()),
            Some(active) => dialogs.find(&active.id)?.reprompt(self.turn, active).await,
        }
    }

    /// The stack, for a component dialog to keep in its own state.
    pub(crate) fn into_stack(mut self) -> Vec<DialogInstance> {
        std::mem::take(&mut self.stack)
    }

    async fn pop(&mut self, reason: DialogReason) -> Result<(), DialogError> {
        if self.stack.is_empty() {
            return Ok(());
        }
        let instance = self.stack.remove(0);
        self.dialogs
            .find(&instance.id)?
            .end(self.turn, &instance, reason)
            .await
    }
}

/// Writes the stack into its property, removing the property when the stack is empty (a finished
/// conversation leaves no dialog state behind), and the top-level stack of the old layout.
impl Drop for DialogContext<'_, '_> {
    fn drop(&mut self) {
        let Some(property) = self.home else {
            return;
        };
        let state = self.turn.conversation_state();
        if property == DIALOG_STATE {
            state.remove(DIALOG_STACK);
        }
        if self.stack.is_empty() {
            state.remove(property);
            return;
        }
        let stored = DialogState {
            dialog_stack: std::mem::take(&mut self.stack),
        };
        // A stack is ids and JSON values, which always serialize; were that ever to fail, the
        // property would keep the stack the turn started with.
        if let Err(e) = state.set(property, &stored) {
            tracing::error!(error = %e, property, "writing the dialog stack failed");
        }
    }
}

/// `value` (absent or JSON `null` meaning `None`) as a `T`.
fn from_optional<T: DeserializeOwned>(
    value: Option<&Value>,
    dialog: &str,
    what: &'static str,
) -> Result<Option<T>, DialogError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v)
            .map(Some)
            .map_err(|e| DialogError::shape(dialog, what, e)),
    }
}

/// `value` as JSON.
fn to_json<T: Serialize + ?Sized>(
    value: &T,
    dialog: &str,
    what: &'static str,
) -> Result<Value, DialogError> {
    serde_json::to_value(value).map_err(|e| DialogError::shape(dialog, what, e))
}

#[cfg(test)]
mod tests;
