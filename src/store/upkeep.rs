//! The store's upkeep, on tasks of its own beside the turns: the receipt pruner, which keeps
//! redelivery's memory to its retention, and the expiry sweep, which gives the room of expired
//! state back. Both are ordinary store calls in bounded steps, so every replica runs them and
//! the store lets them share the work; neither is on a turn's path.

use std::sync::Arc;
use std::time::Duration;

use super::{Store, Ttls};

/// The store's upkeep, off the turns' path: the receipt pruner always, the expiry sweep with a
/// time to live.
pub(crate) struct Upkeep {
    pruner: tokio::task::JoinHandle<()>,
    sweeper: Option<tokio::task::JoinHandle<()>>,
}

impl Upkeep {
    /// Starts pruning `store`'s receipts older than `retention` and, when any scope has a time
    /// to live (`ttls`), sweeping its expired state once every `sweep_every`.
    pub(crate) fn start(
        store: &Arc<dyn Store>,
        retention: Duration,
        ttls: Ttls,
        sweep_every: Duration,
    ) -> Self {
        Self {
            pruner: tokio::spawn(prune_receipts(Arc::clone(store), retention)),
            sweeper: ttls
                .any()
                .then(|| tokio::spawn(sweep_expired(Arc::clone(store), sweep_every))),
        }
    }

    /// Stops both.
    pub(crate) fn stop(self) {
        self.pruner.abort();
        if let Some(sweeper) = self.sweeper {
            sweeper.abort();
        }
    }
}

/// Keys one step of the expiry sweep looks at.
const SWEEP_BATCH: usize = 1000;
/// The pause between two steps of a sweep, so that a sweep through millions of keys is a trickle
/// of short statements beside the turns, never a burst.
const SWEEP_PAUSE: Duration = Duration::from_millis(50);

/// Deletes the state that expired ([`crate::store::Ttls`]), going through every key in bounded
/// steps, once every `every`. Expired state already reads as absent; this gives its room back.
/// Every replica sweeps; a row another replica's step has is skipped.
async fn sweep_expired(store: Arc<dyn Store>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let mut after: Option<String> = None;
        loop {
            match store.sweep_expired(after.as_deref(), SWEEP_BATCH).await {
                Ok(swept) => {
                    crate::telemetry::metrics::state_expired(swept.deleted);
                    match swept.next {
                        Some(next) => after = Some(next),
                        None => break,
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "sweeping expired state failed; will retry");
                    break;
                }
            }
            tokio::time::sleep(SWEEP_PAUSE).await;
        }
    }
}

/// Removes receipts older than `retention`, eight times per retention period (at most every five
/// minutes), off the turns' path: PostgreSQL's slots can be emptied during a quarter of it
/// (`store::postgres::receipts`), so each gets two passes at least. Every replica prunes; the
/// store lets them share the work.
async fn prune_receipts(store: Arc<dyn Store>, retention: Duration) {
    let period = (retention / 8).clamp(Duration::from_secs(1), Duration::from_secs(300));
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match store.prune_receipts(retention).await {
            Ok(pruned) => {
                crate::telemetry::metrics::receipts_pruned(pruned);
                if pruned > 0 {
                    tracing::debug!(pruned, "pruned expired turn receipts");
                }
            }
            Err(e) => tracing::warn!(error = %e, "pruning turn receipts failed; will retry"),
        }
    }
}
