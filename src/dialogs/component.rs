//! Component dialogs: a dialog made of dialogs, with its own dialog set and its own stack.
//!
//! A component packages a sub-conversation (a waterfall and the prompts it uses, say) behind one
//! id, so that a bot composes it without knowing its parts. The outer stack holds one entry for
//! the whole component; the inner stack lives in that entry's state under
//! `{"dialogs": {"dialogStack": […]}}`, as in Bot Framework. The component ends, with the inner
//! result, when its inner stack empties.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    Dialog, DialogContext, DialogError, DialogInstance, DialogReason, DialogSet, DialogTurnResult,
    DialogTurnStatus,
};
use crate::bot::TurnContext;

/// A dialog with an inner dialog set; it begins with its initial dialog and ends when that ends.
///
/// Its dialogs can begin only each other, not the dialogs of the set the component is in.
#[derive(Debug)]
pub struct ComponentDialog {
    id: String,
    initial: String,
    dialogs: DialogSet,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct ComponentState {
    #[serde(default)]
    dialogs: InnerState,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InnerState {
    #[serde(default)]
    dialog_stack: Vec<DialogInstance>,
}

impl ComponentDialog {
    /// A component `id` that begins with `initial` (which it adds to its set).
    pub fn new(id: impl Into<String>, initial: impl Dialog) -> Self {
        let initial_id = initial.id().to_owned();
        Self {
            id: id.into(),
            initial: initial_id,
            dialogs: DialogSet::new().with(initial),
        }
    }

    /// Adds `dialog` to the component's inner set.
    #[must_use]
    pub fn with(mut self, dialog: impl Dialog) -> Self {
        self.dialogs.add(dialog);
        self
    }

    /// Keeps the inner stack and waits, or ends the component with the inner result.
    async fn settle(
        &self,
        dc: &mut DialogContext<'_, '_>,
        result: DialogTurnResult,
        inner: Vec<DialogInstance>,
    ) -> Result<DialogTurnResult, DialogError> {
        match result.status {
            DialogTurnStatus::Waiting => {
                dc.active_dialog_mut()?.set_state(&ComponentState {
                    dialogs: InnerState {
                        dialog_stack: inner,
                    },
                })?;
                Ok(DialogTurnResult::waiting())
            }
            DialogTurnStatus::Complete | DialogTurnStatus::Empty => {
                dc.end_dialog(result.result).await
            }
            DialogTurnStatus::Cancelled => dc.end_dialog(None).await,
        }
    }

    fn inner_stack(instance: &DialogInstance) -> Result<Vec<DialogInstance>, DialogError> {
        Ok(instance.state_as::<ComponentState>()?.dialogs.dialog_stack)
    }
}

#[async_trait]
impl Dialog for ComponentDialog {
    fn id(&self) -> &str {
        &self.id
    }

    async fn begin(
        &self,
        dc: &mut DialogContext<'_, '_>,
        options: Option<Value>,
    ) -> Result<DialogTurnResult, DialogError> {
        let mut inner = DialogContext::over(&self.dialogs, dc.turn(), Vec::new());
        let result = inner.begin_dialog(&self.initial, options).await?;
        let stack = inner.into_stack();
        self.settle(dc, result, stack).await
    }

    async fn continue_dialog(
        &self,
        dc: &mut DialogContext<'_, '_>,
    ) -> Result<DialogTurnResult, DialogError> {
        let stack = Self::inner_stack(dc.active_dialog_mut()?)?;
        let mut inner = DialogContext::over(&self.dialogs, dc.turn(), stack);
        let result = inner.continue_dialog().await?;
        let stack = inner.into_stack();
        self.settle(dc, result, stack).await
    }

    /// A dialog begun on top of the component (in the outer set) ended: the component goes on
    /// waiting, asking its inner dialog to prompt again.
    async fn resume(
        &self,
        dc: &mut DialogContext<'_, '_>,
        _reason: DialogReason,
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
        let stack = Self::inner_stack(instance)?;
        DialogContext::over(&self.dialogs, turn, stack)
            .reprompt_dialog()
            .await
    }

    /// On cancel, the inner dialogs are ended too (so that their `end` runs).
    async fn end(
        &self,
        turn: &mut TurnContext<'_>,
        instance: &DialogInstance,
        reason: DialogReason,
    ) -> Result<(), DialogError> {
        if reason == DialogReason::CancelCalled {
            let stack = Self::inner_stack(instance)?;
            DialogContext::over(&self.dialogs, turn, stack)
                .cancel_all_dialogs()
                .await?;
        }
        Ok(())
    }
}
