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
//!
//! A streamed turn can also be stopped ([`Drafts::stop`]): its user pressed Stop while the reply
//! was being written. The stop lives here, beside the drafts, because what it commits is what
//! the drafts showed: the bot's run is cancelled, and the turn commits the reply as far as it
//! was shown, and nothing of what the bot had not drafted yet. [`Drafts::begin`] and
//! [`Drafts::finish`] bracket each run of the bot, so that a stop and the bot's own end cannot
//! both win: a stop that comes once the bot has finished is too late, and says so.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, watch};

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

/// What a stop did ([`Drafts::stop`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The bot's run is cancelled: what was shown commits.
    Stopped,
    /// The bot had already finished: its whole reply commits.
    TooLate,
}

/// Where a streamed turn's bot stands, as far as a stop cares.
#[derive(Debug)]
enum Run {
    /// Not finished: waiting to run, running, or between a thrown-away attempt and its replay.
    Running,
    /// The bot finished an attempt, which is committing.
    Finishing,
    /// Stopped: this text (possibly empty) is the reply to commit.
    Stopped(String),
}

/// The part of a turn's drafts that a stop reads and writes.
#[derive(Debug)]
struct Shown {
    /// The latest text draft, and its attempt; emptied when that attempt is reset.
    latest: Option<(u32, String)>,
    run: Run,
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
    shown: Arc<Mutex<Shown>>,
    /// Set once the turn is stopped, for the run it cancels.
    stopped: Arc<watch::Sender<bool>>,
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
                shown: Arc::new(Mutex::new(Shown {
                    latest: None,
                    run: Run::Running,
                })),
                stopped: Arc::new(watch::Sender::new(false)),
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
        if kind == DraftKind::Text {
            let mut shown = self.lock();
            if matches!(shown.run, Run::Stopped(_)) {
                // The run is being cancelled: nothing more is shown.
                return Ok(());
            }
            shown.latest = Some((attempt, text.clone()));
        }
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
        {
            let mut shown = self.lock();
            if shown.latest.as_ref().is_some_and(|(a, _)| *a == attempt) {
                shown.latest = None;
            }
        }
        if self.drafted.load(Ordering::Relaxed) == attempt {
            let _ = self.events.send(DraftEvent::Reset { attempt }).await;
        }
    }

    /// Stops the turn (its user pressed Stop), unless its bot has finished already. The reply
    /// to commit is the latest text draft, cut to the longest start it shares with `shown`, what
    /// the channel showed, when the caller knows it: never more than the bot drafted, nor than
    /// the user saw. Stopping twice keeps the first stop's text.
    pub fn stop(&self, shown: Option<&str>) -> Stop {
        let mut state = self.lock();
        match state.run {
            Run::Finishing => return Stop::TooLate,
            Run::Stopped(_) => return Stop::Stopped,
            Run::Running => {}
        }
        let latest = state.latest.as_ref().map_or("", |(_, text)| text.as_str());
        let text = match shown {
            Some(shown) => common_start(latest, shown),
            None => latest,
        };
        state.run = Run::Stopped(text.to_owned());
        drop(state);
        self.stopped.send_replace(true);
        Stop::Stopped
    }

    /// Before the bot runs for an attempt: `Err` with the reply to commit when the turn was
    /// stopped already, and the bot must not run.
    ///
    /// # Errors
    /// The stopped reply's text, when the turn was stopped.
    pub fn begin(&self) -> Result<(), String> {
        let mut state = self.lock();
        match &state.run {
            Run::Stopped(text) => Err(text.clone()),
            _ => {
                state.run = Run::Running;
                Ok(())
            }
        }
    }

    /// After the bot finished an attempt of its own accord: `Some` with the reply to commit
    /// instead of the bot's, when a stop came first.
    pub fn finish(&self) -> Option<String> {
        let mut state = self.lock();
        match &state.run {
            Run::Stopped(text) => Some(text.clone()),
            _ => {
                state.run = Run::Finishing;
                None
            }
        }
    }

    /// The reply to commit, once the turn is stopped.
    pub fn stopped_text(&self) -> Option<String> {
        match &self.lock().run {
            Run::Stopped(text) => Some(text.clone()),
            _ => None,
        }
    }

    /// Resolves once the turn is stopped: the engine races the bot's run against it.
    pub async fn stopped(&self) {
        let mut stopped = self.stopped.subscribe();
        // The sender lives as long as `self`: the wait cannot fail.
        let _ = stopped.wait_for(|stopped| *stopped).await;
    }

    /// Whether `other` is this turn's drafts (and not another call's).
    pub fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.shown, &other.shown)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shown> {
        // Held for a few assignments, never across an await, and nothing in it can panic.
        self.shown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The longest start `a` and `b` share, cut at a character boundary.
fn common_start<'a>(a: &'a str, b: &str) -> &'a str {
    let end = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or_else(|| a.len().min(b.len()), |((at, _), _)| at);
    // `end` is a boundary of `a`: a char index, or `b`'s length, which is a boundary of the
    // shared start when `b` is the shorter.
    a.get(..end).unwrap_or_default()
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

    #[tokio::test]
    async fn a_stop_keeps_what_was_shown_and_a_finished_run_is_too_late() {
        let (drafts, _events) = Drafts::channel(8, 64);
        // Stopped before the bot ran: nothing was shown, and the bot must not run.
        let (waiting, _e) = Drafts::channel(8, 64);
        assert_eq!(waiting.stop(Some("anything")), Stop::Stopped);
        assert_eq!(waiting.begin(), Err(String::new()));

        drafts.begin().expect("not stopped");
        drafts
            .offer(1, DraftKind::Text, "héllo wor".into())
            .expect("fits");
        drafts
            .offer(1, DraftKind::Informative, "status".into())
            .expect("fits");
        // The attempt is thrown away: what it showed is void; the replay drafts anew.
        drafts.reset(1).await;
        drafts.begin().expect("not stopped");
        drafts
            .offer(2, DraftKind::Text, "héllo world".into())
            .expect("fits");
        let stopping = drafts.stopped();
        assert_eq!(drafts.stop(Some("héllo wxyz")), Stop::Stopped);
        stopping.await;
        // Cut at a character boundary, to what both share; a second stop keeps the first.
        assert_eq!(drafts.stop(None), Stop::Stopped);
        assert_eq!(drafts.stopped_text().as_deref(), Some("héllo w"));
        // Drafts after the stop show nothing more; the bot ending now finds the stop.
        drafts
            .offer(2, DraftKind::Text, "héllo world!".into())
            .expect("fits");
        assert_eq!(drafts.finish().as_deref(), Some("héllo w"));
        assert_eq!(drafts.begin(), Err("héllo w".to_owned()));

        // A bot that finished before the stop commits its own reply: the stop is too late.
        let (late, _e) = Drafts::channel(8, 64);
        late.begin().expect("fits");
        late.offer(1, DraftKind::Text, "all".into()).expect("fits");
        assert_eq!(late.finish(), None);
        assert_eq!(late.stop(None), Stop::TooLate);
        assert_eq!(late.stopped_text(), None);
        // After a conflict the replay has shown nothing yet: a stop then keeps no reply.
        late.reset(1).await;
        late.begin().expect("fits");
        assert_eq!(late.stop(None), Stop::Stopped);
        assert_eq!(late.stopped_text().as_deref(), Some(""));
        assert_eq!(common_start("ab", "abc"), "ab");
        assert_eq!(common_start("abc", "ab"), "ab");
        assert_eq!(common_start("é", "e"), "");
    }
}
