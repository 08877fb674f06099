//! The one place where domain outcomes become gRPC statuses.
//!
//! A caller's mistake keeps its message, which names the problem. A failure on our side is
//! logged with its whole cause chain and answered with a generic message: the caller learns what
//! to do (retry or not), never our internals.

use tonic::{Code, Status};

use crate::activity::incoming::InvalidActivity;
use crate::engine::TurnError;
use crate::store::StoreError;

impl From<InvalidActivity> for Status {
    fn from(e: InvalidActivity) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

impl From<TurnError> for Status {
    fn from(e: TurnError) -> Self {
        match e {
            TurnError::UnknownBot(e) => Status::not_found(e.to_string()),
            e @ TurnError::Aborted { .. } => Status::aborted(e.to_string()),
            e @ TurnError::DeadlineExceeded { .. } => Status::deadline_exceeded(e.to_string()),
            TurnError::Bot(e) => {
                tracing::error!(error = %e, "bot failed; nothing was committed");
                Status::internal("the bot failed to handle the activity; state is untouched")
            }
            TurnError::Store(e @ StoreError::Unavailable(_)) => {
                tracing::warn!(error = ?anyhow_chain(&e), "state store unavailable");
                Status::unavailable(
                    "the state store is unavailable; the turn was not committed, retry later",
                )
            }
            TurnError::Store(e @ StoreError::Unexpected(_)) => {
                tracing::error!(error = ?anyhow_chain(&e), "state store failed");
                Status::new(
                    Code::Internal,
                    "the state store failed; the turn was not committed",
                )
            }
        }
    }
}

/// The error and its sources, one line.
fn anyhow_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
