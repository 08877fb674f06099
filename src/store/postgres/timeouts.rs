//! How long PostgreSQL may take to answer, in one place for the plain store calls, the lock's and
//! the hold's, and the group commit's batches: a call that gets no answer in time counts the
//! store unavailable (a silent connection would otherwise hold its turn, and its conversation's
//! queue, for as long as TCP takes to give up), and the server's own statement limit sits below
//! it, so that PostgreSQL gives up first and says why.

use std::time::Duration;

use anyhow::anyhow;

use crate::store::StoreError;

/// How long one load or commit may take before the store counts as unavailable. A connection that
/// goes silent (a partition rather than a reset) would otherwise hold the turn, and its
/// conversation's queue, for as long as TCP takes to give up. A commit cut short this way has an
/// unknown outcome, which the engine resolves through the turn's receipt.
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The server-side limit on one statement (lock waits included), below [`CALL_TIMEOUT`] so that
/// the server gives up first and says so. Sent as a startup parameter (`options`), except with
/// [`super::Statements::Unprepared`]: PgBouncer refuses a connection that carries `options`, so behind
/// it the limit is the role's (`ALTER ROLE … SET statement_timeout`, see the README).
pub(super) const STATEMENT_TIMEOUT: Duration = Duration::from_secs(8);

/// Runs one store call, counting the store unavailable when it takes longer than [`CALL_TIMEOUT`].
pub(super) async fn within_call_timeout<T>(
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(no_answer()))
}

/// Runs one store call, counting the store unavailable when it has not answered by `deadline`
/// (a call's [`CALL_TIMEOUT`] counted from when it was queued).
pub(super) async fn within_deadline<T>(
    deadline: tokio::time::Instant,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout_at(deadline, call)
        .await
        .unwrap_or_else(|_| Err(no_answer()))
}

/// A store call that got no answer within [`CALL_TIMEOUT`].
pub(super) fn no_answer() -> StoreError {
    StoreError::Unavailable(anyhow!("no answer from PostgreSQL within {CALL_TIMEOUT:?}"))
}
