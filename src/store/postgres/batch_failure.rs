//! A failure of a statement that served many turns at once (the group commit's batches, the group
//! load's): each turn gets an error of its own, all of them sharing the one cause.

use std::sync::Arc;

use crate::store::StoreError;

/// A batch's failure, which every call of the batch (a commit, a load) gets: each its own [`StoreError`] of the
/// same kind, whose cause is the one failure, its whole chain kept (PostgreSQL's message, the
/// connection's error), not a copy of its text.
pub(super) struct BatchFailure {
    unavailable: bool,
    cause: Arc<anyhow::Error>,
}

impl BatchFailure {
    pub(super) fn new(e: StoreError) -> Self {
        let (unavailable, cause) = match e {
            StoreError::Unavailable(cause) => (true, cause),
            StoreError::Unexpected(cause) => (false, cause),
        };
        Self {
            unavailable,
            cause: Arc::new(cause),
        }
    }

    /// The failure, as one call's error.
    pub(super) fn error(&self) -> StoreError {
        let cause = anyhow::Error::new(SharedCause(Arc::clone(&self.cause)));
        match self.unavailable {
            true => StoreError::Unavailable(cause),
            false => StoreError::Unexpected(cause),
        }
    }
}

/// One error, shared: its message, and its sources as the error's own.
#[derive(Debug)]
struct SharedCause(Arc<anyhow::Error>);

impl std::fmt::Display for SharedCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for SharedCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use anyhow::anyhow;

    use super::*;

    #[test]
    fn every_commit_of_a_failed_batch_gets_the_failure_with_its_whole_chain() {
        let cause = anyhow!("connection reset by peer").context("sending the batch failed");
        let failure = BatchFailure::new(StoreError::Unavailable(cause));
        for _ in 0..2 {
            let StoreError::Unavailable(e) = failure.error() else {
                panic!("the failure changed its kind");
            };
            assert_eq!(
                e.chain().map(ToString::to_string).collect::<Vec<_>>(),
                ["sending the batch failed", "connection reset by peer"]
            );
        }
        let failure = BatchFailure::new(StoreError::Unexpected(anyhow!("a broken schema")));
        assert!(matches!(failure.error(), StoreError::Unexpected(_)));
    }
}
