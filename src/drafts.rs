//! Drafts: what a bot shows while it is still writing its reply — a status line, the text so
//! far — on a channel beside the turn, never in it.
//!
//! A language-model bot's turn takes seconds, and its user expects to watch the answer form. But
//! a reply is a promise only once its turn has committed: an attempt can still be thrown away
//! for a conflict and replayed on fresh state, with a different answer. So drafts travel apart
//! from the buffered replies: they are offered to whoever streams the turn (`StreamTurn`), are
//! never stored and cost no database work, and a [`DraftEvent::Reset`] voids an attempt's
//! drafts before its replay drafts anew. The turn's outcome does not change shape for them.
//!
//! Offering a draft never waits: the channel is bounded, and a draft that finds it full is
//! dropped, since the next one carries the whole text so far anyway. A reset is the one event
//! that must arrive, so the engine waits for room to send it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::mpsc;

/// Drafts a streaming call buffers before the oldest is dropped: a few seconds of a model's
/// output at a draft per token, more than a caller reading as fast as it can ever falls behind.
pub const DRAFT_BUFFER: usize = 64;

/// What a draft shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// A status line ("Looking at the menu…"), not part of the reply.
    Informative,
    /// The reply's whole text so far.
    Text,
}

/// One event on a turn's draft channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DraftEvent {
    /// What attempt `attempt` shows now.
    Draft {
        /// The attempt (from 1) that drafted it.
        attempt: u32,
        /// A status line or the text so far.
        kind: DraftKind,
        /// The text.
        text: String,
    },
    /// Attempt `attempt` was thrown away: its drafts are void.
    Reset {
        /// The attempt thrown away.
        attempt: u32,
    },
}

/// Why a draft was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DraftError {
    /// The draft is longer than a reply's text may be.
    #[error("a draft of {size} bytes is over the limit of {limit} bytes (--max-text-bytes)")]
    TooLarge {
        /// The draft's size in bytes.
        size: usize,
        /// The most a draft may hold.
        limit: usize,
    },
}

/// The sending side of a turn's draft channel, which the engine lends to each attempt's
/// [`crate::bot::TurnContext`].
#[derive(Debug, Clone)]
pub struct Drafts {
    events: mpsc::Sender<DraftEvent>,
    max_bytes: usize,
    /// The last attempt that offered a draft (0: none yet), so that only an attempt that showed
    /// something is reset.
    drafted: Arc<AtomicU32>,
}

impl Drafts {
    /// A draft channel holding up to `capacity` events, for drafts of at most `max_bytes`.
    pub fn channel(capacity: usize, max_bytes: usize) -> (Self, mpsc::Receiver<DraftEvent>) {
        let (events, receiver) = mpsc::channel(capacity.max(1));
        (
            Self {
                events,
                max_bytes,
                drafted: Arc::new(AtomicU32::new(0)),
            },
            receiver,
        )
    }

    /// Offers a draft of attempt `attempt`; dropped when the channel is full or nobody listens
    /// any more.
    ///
    /// # Errors
    /// [`DraftError::TooLarge`] for a draft over the limit; nothing is offered then.
    pub fn offer(&self, attempt: u32, kind: DraftKind, text: String) -> Result<(), DraftError> {
        if text.len() > self.max_bytes {
            return Err(DraftError::TooLarge {
                size: text.len(),
                limit: self.max_bytes,
            });
        }
        self.drafted.store(attempt, Ordering::Relaxed);
        // Full: the next draft carries the whole text anyway. Closed: the caller hung up, and
        // the turn goes on to commit for its retry.
        let _ = self.events.try_send(DraftEvent::Draft {
            attempt,
            kind,
            text,
        });
        Ok(())
    }

    /// Voids attempt `attempt`'s drafts, if it offered any: waits for room, since a reset must
    /// not be lost, unless nobody listens any more.
    pub async fn reset(&self, attempt: u32) {
        if self.drafted.load(Ordering::Relaxed) == attempt {
            let _ = self.events.send(DraftEvent::Reset { attempt }).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn drafts_are_offered_resets_only_for_attempts_that_drafted_and_big_ones_refused() {
        let (drafts, mut events) = Drafts::channel(2, 8);
        drafts.reset(1).await;
        drafts
            .offer(1, DraftKind::Informative, "thinking".into())
            .expect("fits");
        drafts.offer(1, DraftKind::Text, "a".into()).expect("fits");
        // Full: dropped, not waited for.
        drafts
            .offer(1, DraftKind::Text, "a b".into())
            .expect("fits");
        assert_eq!(
            drafts.offer(1, DraftKind::Text, "a b c d e".into()),
            Err(DraftError::TooLarge { size: 9, limit: 8 })
        );
        let first = events.recv().await.expect("a draft");
        assert_eq!(
            first,
            DraftEvent::Draft {
                attempt: 1,
                kind: DraftKind::Informative,
                text: "thinking".into()
            }
        );
        drafts.reset(1).await;
        drafts.reset(2).await;
        assert!(matches!(
            events.recv().await,
            Some(DraftEvent::Draft { ref text, .. }) if text == "a"
        ));
        assert_eq!(events.recv().await, Some(DraftEvent::Reset { attempt: 1 }));
        drop(drafts);
        assert_eq!(
            events.recv().await,
            None,
            "no reset for an attempt that drafted nothing"
        );
    }
}
