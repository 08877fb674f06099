//! How turns and attempts end, as their spans' `outcome` fields and the turn metrics name them.
//!
//! Each is an enum rather than a string, so that a new way to end must be named here before it
//! can be counted, and the turn counter's handles are taken once per label when the engine is
//! built, not looked up by name at every turn (each lookup hashes the key and searches the
//! recorder's registry).

use super::{AttemptOutcome, TurnError, TurnOutcome};
use crate::bot::BotErrorKind;
use crate::store::StoreError;
use crate::telemetry::metrics::{
    CONFLICTS, LOCK_WAITS, REDELIVERIES, TURN_ATTEMPTS, TURN_DURATION, TURNS,
};

/// How a turn ended, as the `turn` span's `outcome` field and the [`TURNS`] label name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TurnEnd {
    Committed,
    Redelivered,
    Stopped,
    /// Refused as a double text (`reject`).
    Rejected,
    /// Refused before it reached the engine: a malformed request, or an unknown bot.
    Invalid,
    Aborted,
    DeadlineExceeded,
    Unavailable,
    Failed,
}

impl TurnEnd {
    /// Every end, in the order of their counters in [`TurnMetrics`].
    const ALL: [Self; 9] = [
        Self::Committed,
        Self::Redelivered,
        Self::Stopped,
        Self::Rejected,
        Self::Invalid,
        Self::Aborted,
        Self::DeadlineExceeded,
        Self::Unavailable,
        Self::Failed,
    ];

    /// The end of a turn that returned `result`.
    pub(super) fn of(result: &Result<TurnOutcome, TurnError>) -> Self {
        match result {
            Ok(o) if o.redelivered => Self::Redelivered,
            Ok(o) if o.stopped => Self::Stopped,
            Ok(_) => Self::Committed,
            Err(TurnError::UnknownBot(_)) => Self::Invalid,
            Err(TurnError::ConversationBusy { .. }) => Self::Rejected,
            Err(TurnError::Aborted { .. } | TurnError::ConversationHeld { .. }) => Self::Aborted,
            Err(TurnError::DeadlineExceeded { .. }) => Self::DeadlineExceeded,
            Err(TurnError::Bot(e)) if e.kind() == BotErrorKind::DeadlineExceeded => {
                Self::DeadlineExceeded
            }
            Err(TurnError::Store(StoreError::Unavailable(_))) => Self::Unavailable,
            Err(TurnError::Bot(e)) if e.kind() == BotErrorKind::Unavailable => Self::Unavailable,
            Err(_) => Self::Failed,
        }
    }

    /// Its name as a span field and a metric label.
    pub(super) fn label(self) -> &'static str {
        match self {
            Self::Committed => "committed",
            Self::Redelivered => "redelivered",
            Self::Stopped => "stopped",
            Self::Rejected => "rejected",
            Self::Invalid => "invalid",
            Self::Aborted => "aborted",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Unavailable => "unavailable",
            Self::Failed => "failed",
        }
    }
}

/// How one attempt ended, as the `attempt` span's `outcome` field names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AttemptEnd {
    /// Answered from the activity's receipt.
    Receipt,
    ReadOnly,
    Committed,
    Conflict,
    CommitUnknown,
    LockNotGranted,
    BotFailed,
    StoreFailed,
}

impl AttemptEnd {
    /// The end of an attempt that returned `ended`.
    pub(super) fn of(ended: &Result<AttemptOutcome, TurnError>) -> Self {
        match ended {
            Ok(AttemptOutcome::Answered(_)) => Self::Receipt,
            Ok(AttemptOutcome::NothingToCommit(_)) => Self::ReadOnly,
            Ok(AttemptOutcome::Committed(_)) => Self::Committed,
            Ok(AttemptOutcome::Conflict(_)) => Self::Conflict,
            Ok(AttemptOutcome::OutcomeUnknown(_)) => Self::CommitUnknown,
            Err(
                TurnError::DeadlineExceeded { .. }
                | TurnError::Aborted { .. }
                | TurnError::ConversationHeld { .. },
            ) => Self::LockNotGranted,
            Err(TurnError::Bot(_)) => Self::BotFailed,
            Err(_) => Self::StoreFailed,
        }
    }

    /// Its name as a span field.
    pub(super) fn label(self) -> &'static str {
        match self {
            Self::Receipt => "receipt",
            Self::ReadOnly => "read_only",
            Self::Committed => "committed",
            Self::Conflict => "conflict",
            Self::CommitUnknown => "commit_unknown",
            Self::LockNotGranted => "lock_not_granted",
            Self::BotFailed => "bot_failed",
            Self::StoreFailed => "store_failed",
        }
    }
}

/// The engine's metric handles, taken once when it is built.
pub(super) struct TurnMetrics {
    /// [`TURNS`], one handle per [`TurnEnd`], in the order of [`TurnEnd::ALL`].
    turns: [metrics::Counter; TurnEnd::ALL.len()],
    pub(super) duration: metrics::Histogram,
    pub(super) attempts: metrics::Histogram,
    pub(super) conflicts: metrics::Counter,
    pub(super) redeliveries: metrics::Counter,
    /// [`LOCK_WAITS`]: locks, holds and leases granted, and not granted in time.
    pub(super) granted: metrics::Counter,
    pub(super) not_granted: metrics::Counter,
}

impl TurnMetrics {
    pub(super) fn new() -> Self {
        Self {
            turns: TurnEnd::ALL.map(|end| metrics::counter!(TURNS, "outcome" => end.label())),
            duration: metrics::histogram!(TURN_DURATION),
            attempts: metrics::histogram!(TURN_ATTEMPTS),
            conflicts: metrics::counter!(CONFLICTS),
            redeliveries: metrics::counter!(REDELIVERIES),
            granted: metrics::counter!(LOCK_WAITS, "outcome" => "granted"),
            not_granted: metrics::counter!(LOCK_WAITS, "outcome" => "not_granted"),
        }
    }

    /// Counts a turn that ended so.
    pub(super) fn turn(&self, end: TurnEnd) {
        self.turns[end as usize].increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::TurnEnd;

    #[test]
    fn every_end_counts_on_its_own_handle() {
        for (i, end) in TurnEnd::ALL.into_iter().enumerate() {
            assert_eq!(end as usize, i, "{end:?} is out of place in TurnEnd::ALL");
        }
    }
}
