//! The turns the gateway runs after it answered the channel: an ordinary activity on
//! `/api/messages` is answered `202 Accepted` at once, and its turn and the delivery of its
//! replies go on here, as a Bot Framework bot does for a long operation. The channel's own
//! timeout (15 s) then bounds nothing but that answer; the bot has the gateway's bot budget.
//!
//! [`Background`] owns two things. It counts the turns in flight, so that a graceful shutdown
//! waits for them ([`Background::finish`]) instead of dropping replies already committed, and so
//! that they are bounded: a channel's call holds no connection for its turn, and past
//! the bound a new activity is refused ([`Full`], a `503` the channel retries) rather than
//! queued, as many turns retrying an overloaded Turnstile for minutes would be. And it
//! holds each activity's key while its turn runs: a redelivery of the same activity (its `202`
//! was lost, or the channel retried early) waits for the first to end and is then answered from
//! the turn's receipt. A replica already queues a conversation's turns, but a gateway in front of
//! several replicas without affinity could send the redelivery to another one while the first
//! runs, where the bot would run once more; and the redelivery's replies would interleave with
//! the first's.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Mutex as KeyLock, Notify, OwnedMutexGuard};

/// One activity: its channel, conversation and id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ActivityKey {
    channel_id: String,
    conversation_id: String,
    activity_id: String,
}

impl ActivityKey {
    /// The key of an activity, when it has an id to be redelivered under.
    pub fn new(channel_id: &str, conversation_id: &str, activity_id: Option<&str>) -> Option<Self> {
        let activity_id = activity_id.filter(|id| !id.is_empty())?;
        Some(Self {
            channel_id: channel_id.to_owned(),
            conversation_id: conversation_id.to_owned(),
            activity_id: activity_id.to_owned(),
        })
    }
}

/// The background turns of one gateway.
#[derive(Debug)]
pub struct Background {
    max: usize,
    in_flight: AtomicUsize,
    idle: Notify,
    // A std mutex: it is held for a map lookup only, never across an await (mini-redis `db.rs`).
    held: Mutex<HashMap<ActivityKey, Arc<KeyLock<()>>>>,
    /// The activities whose replies this gateway delivered lately, oldest first, at most
    /// [`DELIVERED`]: a redelivery of one of them is answered from its receipt but not delivered
    /// again (the user has the replies already).
    delivered: Mutex<(
        std::collections::HashSet<ActivityKey>,
        std::collections::VecDeque<ActivityKey>,
    )>,
}

/// How many delivered activities a gateway remembers: minutes of a busy gateway's traffic, the
/// time in which a channel resends an activity.
const DELIVERED: usize = 10_000;

/// Why a turn was not started: `limit` turns are already running in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{limit} turns are already running in the background here")]
pub struct Full {
    /// The bound.
    pub limit: usize,
}

/// One background turn counted in flight; dropping it (the turn ended, or its task was dropped)
/// uncounts it.
struct InFlight(Arc<Background>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// An activity's key, held while its turn runs.
struct Held {
    background: Arc<Background>,
    key: ActivityKey,
    guard: Option<OwnedMutexGuard<()>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = self
            .background
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        drop(self.guard.take());
        // Nobody waits for the key when the map's is the only reference left: forget it.
        if held
            .get(&self.key)
            .is_some_and(|lock| Arc::strong_count(lock) == 1)
        {
            held.remove(&self.key);
        }
    }
}

impl Background {
    /// No turn in flight; at most `max` at a time.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            held: Mutex::default(),
            delivered: Mutex::default(),
        })
    }

    /// Remembers that `key`'s replies were delivered.
    pub fn delivered(&self, key: &ActivityKey) {
        let mut delivered = self
            .delivered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (set, order) = &mut *delivered;
        if set.insert(key.clone()) {
            order.push_back(key.clone());
            while order.len() > DELIVERED {
                if let Some(oldest) = order.pop_front() {
                    set.remove(&oldest);
                }
            }
        }
    }

    /// Whether `key`'s replies were delivered by this gateway lately.
    pub fn was_delivered(&self, key: &ActivityKey) -> bool {
        self.delivered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .contains(key)
    }

    /// Runs `turn` on a task of its own, counted until it ends; with a `key`, only once no
    /// earlier turn of the same activity is running.
    ///
    /// # Errors
    /// [`Full`], and `turn` is dropped, when `max` turns are in flight.
    pub fn spawn(
        self: &Arc<Self>,
        key: Option<ActivityKey>,
        turn: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), Full> {
        // Counted before the task starts, so that `finish` right after cannot miss it; and
        // counted, then checked, so that of spawns racing for the last place one wins.
        let before = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let in_flight = InFlight(Arc::clone(self));
        if before >= self.max {
            return Err(Full { limit: self.max });
        }
        let background = Arc::clone(self);
        tokio::spawn(async move {
            let _in_flight = in_flight;
            let _held = match key {
                Some(key) => Some(background.hold(key).await),
                None => None,
            };
            turn.await;
        });
        Ok(())
    }

    /// How many background turns are running or waiting for their activity's key.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits for the background turns to end, at most `grace`; answers whether they all did.
    pub async fn finish(&self, grace: Duration) -> bool {
        tokio::time::timeout(grace, self.idle()).await.is_ok()
    }

    async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so a turn ending in between still wakes us.
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Waits until no other turn holds `key`, then holds it.
    async fn hold(self: &Arc<Self>, key: ActivityKey) -> Held {
        let lock = {
            let mut held = self
                .held
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::clone(held.entry(key.clone()).or_default())
        };
        let guard = lock.lock_owned().await;
        Held {
            background: Arc::clone(self),
            key,
            guard: Some(guard),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_turn_of_one_activity_waits_for_the_first_and_finish_waits_for_both() {
        let background = Background::new(3);
        let key = ActivityKey::new("test", "c1", Some("a1"));
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let order = Arc::new(Mutex::new(Vec::new()));
        let first = Arc::clone(&order);
        let spawned = background.spawn(key.clone(), async move {
            let _ = released.await;
            first.lock().unwrap_or_else(|e| e.into_inner()).push(1);
        });
        assert_eq!(spawned, Ok(()));
        let second = Arc::clone(&order);
        let spawned = background.spawn(key, async move {
            second.lock().unwrap_or_else(|e| e.into_inner()).push(2);
        });
        assert_eq!(spawned, Ok(()));
        let other = Arc::clone(&order);
        let spawned = background.spawn(ActivityKey::new("test", "c1", Some("a2")), async move {
            other.lock().unwrap_or_else(|e| e.into_inner()).push(3);
        });
        assert_eq!(spawned, Ok(()));
        assert_eq!(background.in_flight(), 3);
        assert_eq!(
            background.spawn(None, async {}),
            Err(Full { limit: 3 }),
            "past the bound"
        );
        assert_eq!(background.in_flight(), 3, "the refused one is not counted");
        let _ = release.send(());
        assert!(background.finish(Duration::from_secs(5)).await);
        assert_eq!(background.in_flight(), 0);
        let order = order.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let at = |n| order.iter().position(|&x| x == n);
        assert!(
            at(1) < at(2),
            "the redelivery ran after the first: {order:?}"
        );
        assert!(
            background
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
        );
    }
}
