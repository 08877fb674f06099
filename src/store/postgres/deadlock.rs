//! A commit cancelled as a deadlock's victim is sent again, not reported as a conflict.
//!
//! PostgreSQL (and Citus's distributed deadlock detection, across nodes) breaks a deadlock by
//! rolling one of its transactions back whole. A commit is one statement in a transaction of its
//! own, so the victim wrote nothing, and its failure says nothing about the versions it checked:
//! nobody else need have written them. Reported as a conflict, it made its turn replay the bot:
//!
//! - a turn that holds its conversation (`hold`) ran its bot twice though the hold kept every
//!   other writer out, against the promise of a serialized bot;
//! - worse, the engine took the conflict for a writer that holds nothing beating the hold, and
//!   replayed under the conversation lock, which the other held turns do not wait for: their
//!   commits then conflicted in turn, one cascade per victim.
//!
//! Citus cancels such victims where there is no deadlock at all: with many turns waiting for one
//! hold row it counts separate single-statement transactions as one (citusdata/citus#1803), as
//! `hold`'s take already allows for. The serialized race of `tests/api/hot_conversations.rs` on
//! Citus, run with 40 turns, showed it in one run of twelve: a commit cancelled, then three turns
//! replayed.
//!
//! Sending the same statement again gets the commit's real outcome: committed, or a conflict with
//! what moved meanwhile. Only where the statement is its own transaction: inside the lock's
//! transaction (`lock`) the victim's transaction is gone with it, and the turn replays.

use std::time::Duration;

/// How many times a commit cancelled as a deadlock's victim is sent again before its failure
/// stands (as a conflict: the turn replays). A real deadlock between two commits ends with the
/// other one committed, so one more send meets its write and conflicts, or succeeds.
pub(super) const RESENDS: u32 = 3;

/// Whether `e` is PostgreSQL's (or Citus's) "deadlock detected": the transaction was rolled back
/// whole to break one.
pub(super) fn is_victim(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::T_R_DEADLOCK_DETECTED)
}

/// Runs `send` (one commit statement in a transaction of its own) and, while `victim` says its
/// answer is a deadlock's victim, again after a short random pause, at most [`RESENDS`] more
/// times; returns the last answer.
pub(super) async fn resending<T, Fut>(
    mut send: impl FnMut() -> Fut,
    victim: impl Fn(&T) -> bool,
) -> T
where
    Fut: std::future::Future<Output = T>,
{
    for resent in 1..=RESENDS {
        let answer = send().await;
        if !victim(&answer) {
            return answer;
        }
        tracing::debug!(
            resent,
            "a commit was cancelled as a deadlock's victim; sending it again"
        );
        // Apart, so that the transactions of the cycle do not meet again in the same order.
        tokio::time::sleep(Duration::from_millis(rand::random_range(1..=20))).await;
    }
    send().await
}
