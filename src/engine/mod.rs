//! The turn engine: load → run the bot with its sends buffered → conditional commit → on
//! conflict, reload and replay.
//!
//! This is what makes a lost update impossible to acknowledge. The usual bot loop sends replies
//! as the bot produces them and saves state last, with the last writer winning: two replicas that
//! handle "add mushroom" and "add cheese" at once both say "added", and one topping is gone. Here
//! nothing leaves the engine until the attempt's state change has committed against the versions
//! it read; an attempt that lost the race is thrown away whole, state and replies alike, and the
//! bot runs again on the state the winner left. Replays are bounded, spaced by jittered backoff
//! and stop short of the caller's deadline. Within one replica, turns of the same conversation
//! queue (see `queue`), so conflicts come only from other replicas.
//!
//! Across replicas they queue in the store once they have met (`hold`, which alone knows how an
//! attempt holds its conversation): after a conflict, the turn's next attempt locks the
//! conversation (`Store::lock_conversation`) across load → run → commit, so
//! it runs the bot on state nobody else is about to move, and the conversation stays contended
//! on this replica for a few seconds (see `hot`). Its next turns, while more of them queue here,
//! lease it (`Store::lease_conversation`): they run as on a lone replica, one commit each, the
//! last committing under the lease to hand it on, and the other replicas' turns wait in the
//! store. Those keep a transaction open while the bot runs, which suits bots of
//! milliseconds. A bot whose policy is `Serialized`, and every streamed turn (a model writing
//! for seconds), hold the conversation turn by turn from the first attempt by its fenced hold
//! instead (`Store::hold_conversation`), which keeps no connection while the bot runs; a
//! redelivery of the activity on another replica waits for that hold and is answered from the
//! receipt it finds. The conditional commit stays the backstop.

mod hold;
mod hot;
mod in_flight;
mod outcome;
mod queue;
mod receipt;
mod retry;
mod stoppable;

pub use retry::RetryPolicy;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt as _;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::activity::incoming::{
    ActivityId, ChannelId, ConversationId, IncomingActivity, InvalidActivity,
};
use crate::activity::{Activity, JsonMap};
use crate::bot::{Bot, BotError, BotRegistry, DoubleText, TurnContext, TurnScopes, UnknownBot};
use crate::drafts::{Drafts, Stop};
use crate::state::{Scope, ScopeState, StateKey, TurnKeys};
use crate::store::cached::TurnStore;
use crate::store::{
    Commit, CommitOutcome, Handed, KeyChange, Pending, Snapshot, Store, StoreError, Version,
};
use crate::telemetry::metrics::STATE_BYTES;
use hold::{HeldLease, Hold, Holding, Mode};
use outcome::{AttemptEnd, TurnEnd, TurnMetrics};

/// The largest state a scope may be written with unless told: 256 KiB of JSON text.
pub const DEFAULT_MAX_SCOPE_BYTES: usize = 256 << 10;

/// A turn that committed (or changed nothing): what to deliver.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnOutcome {
    /// The committed attempt's outbound activities, in the order the bot sent them.
    pub activities: Vec<Activity>,
    /// How many times the bot ran.
    pub attempts: u32,
    /// The conversation scope's version after the turn, `None` while it has never been written.
    pub conversation_version: Option<Version>,
    /// Whether this activity had been processed before, and this is its stored answer.
    pub redelivered: bool,
    /// Whether its user stopped the reply while it was being written ([`Engine::stop_turn`]):
    /// the activities are what was shown then.
    pub stopped: bool,
    /// Whether a later message of the conversation interrupted the turn before it committed
    /// ([`DoubleText::Interrupt`]): nothing of it was kept, and it has no activities.
    pub superseded: bool,
    /// The ids of the activities one run answered together, in arrival order, when the bot
    /// coalesces double texts ([`DoubleText::Coalesce`]); empty otherwise. Only the call that
    /// ran the batch has the activities, so that they are delivered once.
    pub coalesced: Vec<String>,
}

/// A turn that did not commit. None of these returns any activity.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The request named a bot this server does not host.
    #[error(transparent)]
    UnknownBot(#[from] UnknownBot),
    /// Every attempt lost a conflict.
    #[error(
        "the conversation's state kept changing under the turn: gave up after {attempts} attempts, nothing was committed"
    )]
    Aborted {
        /// How many times the bot ran.
        attempts: u32,
    },
    /// The caller's deadline passed, or would pass during the next backoff wait.
    #[error(
        "the call's deadline passed before the turn could commit ({attempts} attempts made); nothing was committed"
    )]
    DeadlineExceeded {
        /// How many times the bot ran.
        attempts: u32,
    },
    /// The attempt would have written a scope's state larger than the limit
    /// ([`Engine::with_max_scope_bytes`]): nothing was committed.
    #[error(
        "the bot's {scope} state would be {bytes} bytes, over the limit of {limit}; nothing was committed"
    )]
    StateTooLarge {
        /// The scope, as its name in the message (`conversation`, `user`, `private conversation`).
        scope: Scope,
        /// Its size as JSON text.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// Another message's turn of the conversation is still running, and the bot's double-text
    /// policy is `reject`: nothing was committed for this one.
    #[error(
        "a turn of this conversation is still running, and bot `{bot}` refuses messages meanwhile (double-text policy `reject`); nothing was committed for this one: send it again once the reply has come"
    )]
    ConversationBusy {
        /// The bot.
        bot: String,
    },
    /// The bot returned an error (or panicked). Nothing was committed.
    #[error("the bot failed: {0}")]
    Bot(BotError),
    /// The store could not answer.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Runs turns against one store for the bots of one registry.
#[derive(Clone)]
pub struct Engine {
    /// The store, timed, behind this replica's state cache (`store::cached`).
    store: Arc<TurnStore>,
    bots: BotRegistry,
    retry: RetryPolicy,
    queue: Arc<queue::KeyQueue<Option<HeldLease>>>,
    hot: Arc<hot::HotConversations>,
    stoppable: Arc<stoppable::Stoppable>,
    in_flight: Arc<in_flight::InFlight>,
    /// The largest state a scope may be written with, as JSON text, and the sizes written.
    sizes: Arc<ScopeSizes>,
    metrics: Arc<TurnMetrics>,
}

/// Why a stop could not be asked for. Nothing was stopped.
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// The request named a bot this server does not host.
    #[error(transparent)]
    UnknownBot(#[from] UnknownBot),
    /// An id is missing or malformed.
    #[error(transparent)]
    Invalid(#[from] InvalidActivity),
}

/// What [`Engine::stop_turn`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopOutcome {
    /// The bot's run is cancelled: what was shown commits as the turn's outcome.
    Stopped,
    /// The bot had already finished: its whole reply commits.
    TooLate,
    /// No streamed turn of that activity runs on this replica.
    NotRunning,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("bots", &self.bots)
            .field("retry", &self.retry)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine running `bots` over `store` (built where the store is opened:
    /// [`TurnStore::for_turns`]).
    pub fn new(store: TurnStore, bots: BotRegistry, retry: RetryPolicy) -> Self {
        Self {
            store: Arc::new(store),
            bots,
            retry,
            queue: Arc::new(queue::KeyQueue::new()),
            hot: Arc::new(hot::HotConversations::default()),
            stoppable: Arc::default(),
            in_flight: Arc::default(),
            sizes: Arc::new(ScopeSizes::new(DEFAULT_MAX_SCOPE_BYTES)),
            metrics: Arc::new(TurnMetrics::new()),
        }
    }

    /// The same engine, refusing to write a scope's state larger than `bytes` as JSON text: the
    /// turn fails with [`TurnError::StateTooLarge`], nothing committed.
    #[must_use]
    pub fn with_max_scope_bytes(mut self, bytes: usize) -> Self {
        self.sizes = Arc::new(ScopeSizes::new(bytes));
        self
    }

    /// How many conversations have a turn in flight or queued in this engine.
    pub fn conversations_in_flight(&self) -> usize {
        self.queue.len()
    }

    /// The hosted bots.
    pub fn bots(&self) -> &BotRegistry {
        &self.bots
    }

    /// Runs one turn of bot `bot` (the default for `None` or empty) for `incoming`, replaying on
    /// conflict, and never starting a wait that would end after `deadline`.
    ///
    /// # Errors
    /// [`TurnError`]: in every case nothing was committed (but see [`StoreError::Unavailable`]
    /// for a connection lost during a commit) and no activity may be delivered.
    pub async fn run_turn(
        &self,
        bot: Option<&str>,
        incoming: &IncomingActivity,
        deadline: Option<Instant>,
    ) -> Result<TurnOutcome, TurnError> {
        self.run(bot, incoming, deadline, None).await
    }

    /// [`Engine::run_turn`], for a turn someone streams when `drafts` is given: the bot's
    /// drafts go there while it runs, and an attempt thrown away for a conflict is reset there
    /// before its replay. The outcome is the same as `run_turn`'s; a redelivery is answered from
    /// its receipt before the bot runs, so it drafts nothing.
    ///
    /// # Errors
    /// As [`Engine::run_turn`]; the drafts offered before an error are void.
    pub async fn run_turn_drafting(
        &self,
        bot: Option<&str>,
        incoming: &IncomingActivity,
        deadline: Option<Instant>,
        drafts: Option<&Drafts>,
    ) -> Result<TurnOutcome, TurnError> {
        self.run(bot, incoming, deadline, drafts).await
    }

    /// Stops the streamed turn of activity `activity` of bot `bot` (the default for `None` or
    /// empty) in `conversation` on `channel`, whose user pressed Stop while its reply was being
    /// written: its bot's run is cancelled, and the turn commits the reply as far as it was
    /// shown — the latest text draft, cut to `shown` (what the channel showed) when given — on
    /// the state as it was, receipted like any answer (see `Drafts::stop`).
    ///
    /// # Errors
    /// [`StopError`] for a bot not hosted here or a missing or malformed id.
    pub fn stop_turn(
        &self,
        bot: Option<&str>,
        channel: &str,
        conversation: &str,
        activity: &str,
        shown: Option<&str>,
    ) -> Result<StopOutcome, StopError> {
        let (bot_name, _) = self.bots.get(bot)?;
        let key = StateKey::receipt(
            bot_name,
            &ChannelId::parse(channel, "channel_id")?,
            &ConversationId::parse(conversation, "conversation_id")?,
            &ActivityId::parse(activity, "activity_id")?,
        );
        let outcome = match self.stoppable.stop(&key, shown) {
            Some(Stop::Stopped) => StopOutcome::Stopped,
            Some(Stop::TooLate) => StopOutcome::TooLate,
            None => StopOutcome::NotRunning,
        };
        tracing::info!(?outcome, "stop asked for");
        Ok(outcome)
    }

    /// A turn, drafting to `drafts` if someone streams it, with the bookkeeping of its outcome.
    #[tracing::instrument(
        name = "turn",
        level = "debug",
        skip_all,
        fields(bot, channel, attempts, outcome)
    )]
    async fn run(
        &self,
        bot: Option<&str>,
        incoming: &IncomingActivity,
        deadline: Option<Instant>,
        drafts: Option<&Drafts>,
    ) -> Result<TurnOutcome, TurnError> {
        let started = std::time::Instant::now();
        let result = self.turn(bot, incoming, deadline, drafts).await;
        let end = TurnEnd::of(&result);
        tracing::Span::current().record("outcome", end.label());
        self.metrics.turn(end);
        self.metrics.duration.record(started.elapsed());
        let attempts = match &result {
            Ok(o) if o.redelivered => None,
            Ok(o) => Some(o.attempts),
            Err(TurnError::Aborted { attempts } | TurnError::DeadlineExceeded { attempts }) => {
                Some(*attempts)
            }
            Err(_) => None,
        };
        if let Some(attempts) = attempts.filter(|&a| a > 0) {
            self.metrics.attempts.record(f64::from(attempts));
        }
        if matches!(&result, Ok(o) if o.redelivered) {
            self.metrics.redeliveries.increment(1);
        }
        result
    }

    /// Counts a turn refused before it reached the engine (a malformed request), among the
    /// turns' outcomes as `invalid`.
    pub fn refused_invalid(&self) {
        self.metrics.turn(TurnEnd::Invalid);
    }

    /// [`Engine::run_turn`] without the bookkeeping of its outcome: queue behind the
    /// conversation's earlier turns, then attempt until an attempt ends the turn.
    async fn turn(
        &self,
        bot: Option<&str>,
        incoming: &IncomingActivity,
        deadline: Option<Instant>,
        drafts: Option<&Drafts>,
    ) -> Result<TurnOutcome, TurnError> {
        let (bot_name, handler) = self.bots.get(bot)?;
        let span = tracing::Span::current();
        span.record("channel", incoming.address().channel.as_str());
        span.record("bot", bot_name);
        let double_text = self.bots.double_text(bot_name);
        let mut plan = TurnPlan::new(
            bot_name,
            handler.as_ref(),
            incoming,
            deadline,
            drafts,
            double_text,
            &self.sizes,
        )
        .with_ttls(self.store.ttls());
        // What a double text does to the turns of its conversation in flight here, before it
        // queues behind them; across replicas, the hold tells (`hold`).
        let _in_flight = self.double_text(&mut plan, double_text).await?;
        // A streamed turn can be stopped from its first moment, queued or running.
        let _stoppable = plan
            .receipt
            .as_ref()
            .zip(drafts)
            .and_then(|(key, drafts)| self.stoppable.enter(key, drafts));
        if self.bots.holds(bot_name) || (plan.drafts.is_some() && plan.receipt.is_some()) {
            // Held turns wait for each other at the hold, not in this replica's queue: there
            // the turns of every replica line up together, first come, first served.
            let mut no_lease = None;
            let hold = Hold::new(Mode::Held, &mut no_lease, true, deadline);
            return self.attempts(&plan, hold, &span).await;
        }
        let mut turn = self.queue_up(&plan.keys.conversation, deadline).await?;
        let last = !turn.others_waiting();
        let mut no_lease = None;
        let lease = turn.held().unwrap_or(&mut no_lease);
        let mode = if lease.is_some() || self.hot.is_hot(&plan.keys.conversation) {
            Mode::Leased
        } else {
            Mode::Optimistic
        };
        self.attempts(&plan, Hold::new(mode, lease, last, deadline), &span)
            .await
    }

    /// What the bot's double-text `policy` does here with `plan`'s message while turns of its
    /// conversation are in flight on this replica: refuse it, ask them to stop, or add it to the
    /// messages waiting for the next run. The registration returned lasts the turn.
    async fn double_text(
        &self,
        plan: &mut TurnPlan<'_>,
        policy: DoubleText,
    ) -> Result<Option<in_flight::Registered>, TurnError> {
        Ok(match policy {
            DoubleText::Enqueue => None,
            // Refused at once while another message's turn is in flight.
            DoubleText::Reject => Some(
                self.in_flight
                    .admit(&plan.keys.conversation, plan.receipt.as_ref())
                    .ok_or_else(|| TurnError::ConversationBusy {
                        bot: plan.bot_name.to_owned(),
                    })?,
            ),
            // Those turns are asked to stop.
            DoubleText::Interrupt => {
                let in_flight = self
                    .in_flight
                    .enter(&plan.keys.conversation, plan.receipt.as_ref());
                plan.interrupt = Some(Arc::clone(in_flight.signal()));
                Some(in_flight)
            }
            // The message joins the ones waiting for the next run.
            DoubleText::Coalesce => {
                if let Some(receipt) = &plan.receipt {
                    let pending = Pending {
                        receipt: receipt.clone(),
                        activity: activity_json(plan.incoming.activity()),
                    };
                    self.store
                        .add_pending(&plan.keys.conversation, &pending)
                        .await?;
                }
                None
            }
        })
    }

    /// Attempts `plan` until an attempt ends the turn, each holding its conversation as `hold`
    /// says.
    async fn attempts(
        &self,
        plan: &TurnPlan<'_>,
        mut hold: Hold<'_>,
        span: &tracing::Span,
    ) -> Result<TurnOutcome, TurnError> {
        let mut attempt = 0;
        let mut outcome_unknown = false;
        let ended = loop {
            attempt += 1;
            span.record("attempts", attempt);
            if let Some(drafts) = plan.drafts.filter(|_| attempt > 1) {
                // The attempt before was thrown away: whatever it showed is void.
                drafts.reset(attempt - 1).await;
            }
            let free = hold.is_free(attempt);
            let lost = match self.run_attempt(plan, &mut hold, attempt).await {
                Ok(AttemptOutcome::Answered(mut outcome)) => {
                    // Processed before — or, after an unknown commit outcome, most likely by this
                    // very call, which is then no redelivery.
                    outcome.redelivered = !outcome_unknown;
                    break Ok(outcome);
                }
                Ok(
                    AttemptOutcome::NothingToCommit(outcome) | AttemptOutcome::Committed(outcome),
                ) => {
                    break Ok(outcome);
                }
                Ok(AttemptOutcome::Conflict(key)) => {
                    if self.after_conflict(plan, &mut hold, &key, free, attempt)? {
                        continue;
                    }
                    None
                }
                Ok(AttemptOutcome::OutcomeUnknown(e)) => {
                    tracing::warn!(attempt, error = %e, "commit outcome unknown; re-reading");
                    outcome_unknown = true;
                    Some(e)
                }
                Err(e) => break Err(e),
            };
            if let Err(e) = self.back_off(attempt, hold.deadline(), lost).await {
                break Err(e);
            }
        };
        hold.finish();
        ended
    }

    /// Runs attempt `attempt` of `plan`, holding its conversation as `hold` says, in a span of
    /// its own (one per run of the bot, so that a trace shows what each replay cost and why it
    /// ended; its store calls and the bot run are its children).
    async fn run_attempt(
        &self,
        plan: &TurnPlan<'_>,
        hold: &mut Hold<'_>,
        attempt: u32,
    ) -> Result<AttemptOutcome, TurnError> {
        let attempt_span = tracing::debug_span!(
            "attempt",
            attempt,
            mode = hold.mode().name(),
            outcome = tracing::field::Empty,
            version = tracing::field::Empty
        );
        let ended = async {
            let (snapshot, holding) = self.take(plan, hold, attempt).await?;
            self.run_on(plan, attempt, snapshot, holding).await
        }
        .instrument(attempt_span.clone())
        .await;
        attempt_span.record("outcome", AttemptEnd::of(&ended).label());
        if let Ok(AttemptOutcome::Committed(TurnOutcome {
            conversation_version: Some(version),
            ..
        })) = &ended
        {
            attempt_span.record("version", version.get());
        }
        ended
    }

    /// Counts a conflict on `key` and chooses how the replay holds its conversation. True:
    /// replay at once, the lock being the queue now, without a blind wait (the attempt that lost
    /// ran `free`); false: back off first.
    fn after_conflict(
        &self,
        plan: &TurnPlan<'_>,
        hold: &mut Hold<'_>,
        key: &StateKey,
        free: bool,
        attempt: u32,
    ) -> Result<bool, TurnError> {
        self.metrics.conflicts.increment(1);
        tracing::debug!(attempt, %key, "conflict; replaying the turn under the lock");
        self.hot.contended(&plan.keys.conversation);
        if !hold.after_conflict(key, free) {
            return Ok(false);
        }
        self.give_up_if_spent(attempt, None)?;
        Ok(true)
    }

    /// Waits for the turns of the same conversation queued before this one on this replica,
    /// within the caller's deadline.
    async fn queue_up(
        &self,
        conversation: &StateKey,
        deadline: Option<Instant>,
    ) -> Result<queue::KeyTurn<Option<HeldLease>>, TurnError> {
        match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, self.queue.enter(conversation))
                .await
                .map_err(|_| TurnError::DeadlineExceeded { attempts: 0 }),
            None => Ok(self.queue.enter(conversation).await),
        }
    }

    /// The rest of an attempt on `snapshot`, taken with `holding`: answer from the receipt if it
    /// has one, else run the bot and commit what it did, through `holding`. Whatever else ends
    /// the attempt lets go of what it holds, here and only here.
    async fn run_on(
        &self,
        plan: &TurnPlan<'_>,
        attempt: u32,
        snapshot: Snapshot,
        holding: Holding,
    ) -> Result<AttemptOutcome, TurnError> {
        let (handed, interrupted) = (holding.handed(), holding.interrupted());
        let ended = match self
            .next_step(plan, attempt, &snapshot, handed, interrupted)
            .await
        {
            Ok(Step::Commit(commit, outcome)) => {
                let implied = commit.implied_versions();
                let result = holding.commit(&*self.store, commit).await;
                return settle(plan, implied, result, outcome);
            }
            Ok(Step::Supersede) => return self.supersede(plan, attempt, &snapshot, holding).await,
            Ok(Step::Done(outcome)) => Ok(outcome),
            Err(e) => Err(e),
        };
        holding.release().await;
        ended
    }

    /// What an attempt on `snapshot` does next: answer from the receipt if it has one, else run
    /// the bot, with what the conversation's earlier turns `handed` on, until done or
    /// `interrupted`.
    async fn next_step(
        &self,
        plan: &TurnPlan<'_>,
        attempt: u32,
        snapshot: &Snapshot,
        handed: &Handed,
        interrupted: futures::future::BoxFuture<'static, ()>,
    ) -> Result<Step, TurnError> {
        if let Some(receipt) = snapshot.receipt() {
            return receipt::decode(receipt).map(|o| Step::Done(AttemptOutcome::Answered(o)));
        }
        let ran = plan.run(attempt, snapshot, handed, interrupted).await?;
        Ok(match ran {
            // A read-only turn of an activity without id, answered from one consistent
            // snapshot: nothing to commit.
            Ran::Built(commit, outcome) if !commit.writes_anything() => {
                Step::Done(AttemptOutcome::NothingToCommit(outcome))
            }
            Ran::Built(commit, outcome) => Step::Commit(commit, outcome),
            Ran::Superseded => Step::Supersede,
        })
    }

    /// The state an attempt that holds nothing runs on. The first attempt of a turn that will
    /// commit may run on this replica's last committed state (a guess its commit checks); a
    /// replay follows a guess that was wrong, or a commit whose outcome is unknown, and reads
    /// the store.
    async fn snapshot(&self, plan: &TurnPlan<'_>, attempt: u32) -> Result<Snapshot, TurnError> {
        // A streamed turn reads the store from its first attempt: a redelivery must find its
        // receipt before the bot runs, or its drafts would show an answer nobody gets. The
        // extra round trip is nothing beside a turn worth streaming.
        Ok(match &plan.receipt {
            Some(receipt) if attempt == 1 && plan.drafts.is_none() => {
                self.store.guess(&plan.key_list, receipt).await?
            }
            receipt => self.store.load(&plan.key_list, receipt.as_ref()).await?,
        })
    }

    /// Between two attempts: fails the turn when its attempts are spent or the wait would pass
    /// the deadline, else waits a jittered backoff. `lost` is the error of an attempt whose
    /// commit outcome is unknown (`None` after a plain conflict).
    async fn back_off(
        &self,
        attempt: u32,
        deadline: Option<Instant>,
        lost: Option<StoreError>,
    ) -> Result<(), TurnError> {
        self.give_up_if_spent(attempt, lost)?;
        let delay = self.retry.delay(attempt, &mut rand::rng());
        if deadline.is_some_and(|d| Instant::now() + delay >= d) {
            return Err(TurnError::DeadlineExceeded { attempts: attempt });
        }
        tokio::time::sleep(delay).await;
        Ok(())
    }

    /// Fails the turn when `attempt` was its last (with `lost`, the error of an attempt whose
    /// commit outcome is unknown, if any).
    fn give_up_if_spent(&self, attempt: u32, lost: Option<StoreError>) -> Result<(), TurnError> {
        if attempt >= self.retry.max_attempts.max(1) {
            return Err(match lost {
                Some(e) => TurnError::Store(e),
                None => TurnError::Aborted { attempts: attempt },
            });
        }
        Ok(())
    }

    /// Ends a turn a later message interrupted: nothing of it is kept but its receipt, which
    /// answers it (and its redeliveries) as superseded, and its activity is handed on to the
    /// next turn of the conversation ([`TurnContext::superseded`]). A turn that holds nothing
    /// (a store that needs no hold answered) has nothing to hand on, nor a receipt to write
    /// outside the conversation's order.
    async fn supersede(
        &self,
        plan: &TurnPlan<'_>,
        attempt: u32,
        snapshot: &Snapshot,
        holding: Holding,
    ) -> Result<AttemptOutcome, TurnError> {
        let outcome = plan.superseded_outcome(attempt, snapshot);
        let Holding::Held(locked) = holding else {
            return Ok(AttemptOutcome::NothingToCommit(outcome));
        };
        tracing::debug!(attempt, "the turn was interrupted by a later message");
        if let Some(drafts) = plan.drafts {
            drafts.reset(attempt).await;
        }
        let mut commit = Commit::new(Vec::new());
        if let Some(key) = &plan.receipt {
            commit = commit.with_receipt(key.clone(), receipt::encode(&outcome, plan.subject()));
        }
        let activity = activity_json(plan.incoming.activity());
        match locked.supersede(commit, activity).await? {
            CommitOutcome::Committed(_) => Ok(AttemptOutcome::Committed(outcome)),
            CommitOutcome::Conflict { key } => {
                // The hold was lost (this turn stalled past it): nothing was written, and the
                // turn that took over runs without it.
                tracing::warn!(%key, "an interrupted turn could not hand itself on");
                Ok(AttemptOutcome::NothingToCommit(outcome))
            }
        }
    }
}

/// `activity` as its Bot Framework JSON object.
fn activity_json(activity: &Activity) -> serde_json::Value {
    serde_json::to_value(activity).unwrap_or_default()
}

/// What the store's answer to an attempt's commit means for the turn, after checking that it
/// wrote the versions the commit implied.
fn settle(
    plan: &TurnPlan<'_>,
    implied: Vec<(StateKey, Version)>,
    result: Result<CommitOutcome, StoreError>,
    outcome: TurnOutcome,
) -> Result<AttemptOutcome, TurnError> {
    match result {
        Ok(CommitOutcome::Committed(versions)) => {
            // The version the receipt promised is the one the store wrote: one rule
            // (`KeyChange::version_after`), checked here rather than trusted.
            for (key, version) in implied {
                if versions.get(&key) != Some(&version) {
                    return Err(TurnError::Store(StoreError::Unexpected(anyhow::anyhow!(
                        "the store committed {key} at version {:?}, not the {version:?} the \
                             commit implied",
                        versions.get(&key)
                    ))));
                }
            }
            Ok(AttemptOutcome::Committed(outcome))
        }
        Ok(CommitOutcome::Conflict { key }) => Ok(AttemptOutcome::Conflict(key)),
        // The connection failed while the commit may have been in flight. With a receipt
        // the next load tells whether it landed: replay, and the receipt answers if so.
        Err(e @ StoreError::Unavailable(_)) if plan.receipt.is_some() => {
            Ok(AttemptOutcome::OutcomeUnknown(e))
        }
        Err(e) => Err(e.into()),
    }
}

/// What one turn needs on every attempt, worked out once before the first.
struct TurnPlan<'a> {
    bot: &'a dyn Bot,
    incoming: &'a IncomingActivity,
    keys: TurnKeys,
    /// Every scope's key, for loads and the cache.
    key_list: Vec<StateKey>,
    /// The activity's receipt; `None` for an activity without id, which is not deduplicated.
    receipt: Option<StateKey>,
    /// The caller's deadline, which the bot sees (a bot worker's call gets no longer).
    deadline: Option<Instant>,
    /// Where the bot's drafts go, when someone streams the turn.
    drafts: Option<&'a Drafts>,
    /// The bot's name.
    bot_name: &'a str,
    /// What happens to a message arriving while a turn of the conversation runs.
    double_text: DoubleText,
    /// Set when a later message of the conversation on this replica asks this turn to stop
    /// ([`DoubleText::Interrupt`]).
    interrupt: Option<Arc<in_flight::Signal>>,
    /// The limit on a scope's written state.
    sizes: &'a ScopeSizes,
    /// The user whose activity this is, as its receipt names them for erasure
    /// ([`StateKey::user_subject`]).
    subject: Option<String>,
    /// How long each scope lives unwritten: a scope the turn only read is written again, as it
    /// is, once past half of it, so that its time runs from its last use, not its last change.
    ttls: crate::store::Ttls,
}

/// How a run of the bot ended, when it did not fail.
enum Ran {
    /// What the attempt asks the store to apply, and the outcome it delivers once applied.
    Built(Commit, TurnOutcome),
    /// A later message interrupted it: nothing of it is kept.
    Superseded,
}

/// One run's batch of activities answered together (coalesced double texts), in arrival order:
/// each one's receipt and activity, at the same index; this turn's own among them.
struct Batch {
    receipts: Vec<StateKey>,
    activities: Vec<Activity>,
}

impl Batch {
    /// The batch of this turn (receipt `own`, activity `incoming`): the activities waiting, then
    /// this turn's if it was not among them. Those the store keeps unreadably are left out.
    fn of(pending: &[Pending], own: &StateKey, incoming: &Activity) -> Self {
        let mut batch = Self {
            receipts: Vec::with_capacity(pending.len() + 1),
            activities: Vec::with_capacity(pending.len() + 1),
        };
        for p in pending {
            let activity = if &p.receipt == own {
                incoming.clone()
            } else {
                match Activity::from_json(p.activity.clone()) {
                    Ok(activity) => activity,
                    Err(e) => {
                        tracing::warn!(error = %e, "a coalesced activity is unreadable; skipped");
                        continue;
                    }
                }
            };
            batch.receipts.push(p.receipt.clone());
            batch.activities.push(activity);
        }
        if !batch.receipts.contains(own) {
            batch.receipts.push(own.clone());
            batch.activities.push(incoming.clone());
        }
        batch
    }

    /// Whether it answers several messages, not one.
    fn is_several(&self) -> bool {
        self.receipts.len() > 1
    }

    /// The ids of its activities, in order.
    fn ids(&self) -> Vec<String> {
        self.activities
            .iter()
            .map(|a| a.id.clone().unwrap_or_default())
            .collect()
    }
}

impl<'a> TurnPlan<'a> {
    fn new(
        bot_name: &'a str,
        bot: &'a dyn Bot,
        incoming: &'a IncomingActivity,
        deadline: Option<Instant>,
        drafts: Option<&'a Drafts>,
        double_text: DoubleText,
        sizes: &'a ScopeSizes,
    ) -> Self {
        let address = incoming.address();
        let keys = TurnKeys::new(bot_name, address);
        Self {
            bot_name,
            double_text,
            bot,
            incoming,
            key_list: keys.all().map(|(_, k)| k.clone()).collect(),
            receipt: incoming.id().map(|id| keys.receipt(id)),
            // Only a turn with a receipt needs it.
            subject: incoming
                .id()
                .and(keys.user.as_ref())
                .and_then(StateKey::user_subject),
            keys,
            deadline,
            drafts,
            interrupt: None,
            sizes,
            ttls: crate::store::Ttls::NONE,
        }
    }

    /// The same plan, with the scopes' times to live ([`TurnPlan::ttls`]).
    fn with_ttls(mut self, ttls: crate::store::Ttls) -> Self {
        self.ttls = ttls;
        self
    }

    /// The user whose activity this is ([`TurnPlan::subject`]).
    fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// The context the bot runs in on `snapshot`.
    fn context(&self, attempt: u32, snapshot: &Snapshot) -> TurnContext<'a> {
        let keys = &self.keys;
        TurnContext::new(
            self.incoming,
            attempt,
            scope_state(Scope::Conversation, &keys.conversation, snapshot),
            keys.user
                .as_ref()
                .map(|k| scope_state(Scope::User, k, snapshot)),
            keys.private_conversation
                .as_ref()
                .map(|k| scope_state(Scope::PrivateConversation, k, snapshot)),
        )
        .with_deadline(self.deadline)
        .with_drafts(self.drafts)
    }

    /// Runs the bot for attempt `attempt` on `snapshot`, with what the turns before handed on
    /// (`handed`): what the attempt asks the store to apply, and the outcome it delivers once
    /// applied. The run is raced against a later message's interruption (`interrupted`, or this
    /// replica's [`TurnPlan::interrupt`]), which ends it with nothing kept; and a streamed
    /// turn's against its stop ([`Drafts::stop`]): once stopped, the bot is cancelled (or not
    /// run), and the attempt commits the reply as far as it was shown, on the state as it was.
    async fn run(
        &self,
        attempt: u32,
        snapshot: &Snapshot,
        handed: &Handed,
        interrupted: futures::future::BoxFuture<'static, ()>,
    ) -> Result<Ran, TurnError> {
        let superseded = self.superseded(handed);
        let batch = match (self.double_text, &self.receipt) {
            (DoubleText::Coalesce, Some(own)) => {
                Some(Batch::of(&handed.pending, own, self.incoming.activity()))
            }
            _ => None,
        };
        let context = || {
            self.context(attempt, snapshot)
                .with_superseded(&superseded)
                .with_batch(batch.as_ref().map_or(&[], |b| b.activities.as_slice()))
        };
        let interrupt = async {
            match &self.interrupt {
                Some(signal) => tokio::select! {
                    () = signal.wait() => {}
                    () = interrupted => {}
                },
                None => interrupted.await,
            }
        };
        if self.interrupt.as_ref().is_some_and(|s| s.asked()) {
            return Ok(Ran::Superseded);
        }
        let Some(drafts) = self.drafts else {
            let ran = tokio::select! {
                biased;
                () = interrupt => return Ok(Ran::Superseded),
                ran = run_bot(self.bot, context()) => ran,
            };
            let (scopes, activities) = ran?;
            return self.built(scopes, activities, attempt, snapshot, false, batch.as_ref());
        };
        let shown = match drafts.begin() {
            Err(shown) => shown,
            Ok(()) => {
                let ran = tokio::select! {
                    biased;
                    () = interrupt => return Ok(Ran::Superseded),
                    ran = run_bot(self.bot, context()) => Some(ran),
                    () = drafts.stopped() => None,
                };
                match ran.map(|ran| (drafts.finish(), ran)) {
                    Some((None, ran)) => {
                        let (scopes, activities) = ran?;
                        return self.built(
                            scopes,
                            activities,
                            attempt,
                            snapshot,
                            false,
                            batch.as_ref(),
                        );
                    }
                    // Stopped as the bot finished: the stop was answered first, and wins.
                    Some((Some(shown), _)) => shown,
                    None => drafts.stopped_text().unwrap_or_default(),
                }
            }
        };
        tracing::debug!(attempt, shown_bytes = shown.len(), "the turn was stopped");
        // The reply as the bot would have sent it, on the state it was given, left unchanged.
        let mut context = context();
        if !shown.is_empty() {
            context.send_text(shown);
        }
        let (scopes, activities) = context.finish();
        self.built(scopes, activities, attempt, snapshot, true, batch.as_ref())
    }

    /// The outcome of attempt `attempt` on `snapshot`, interrupted by a later message: no
    /// replies, nothing changed.
    fn superseded_outcome(&self, attempt: u32, snapshot: &Snapshot) -> TurnOutcome {
        TurnOutcome {
            activities: Vec::new(),
            attempts: attempt,
            conversation_version: snapshot.get(&self.keys.conversation).map(|row| row.version),
            redelivered: false,
            stopped: false,
            superseded: true,
            coalesced: Vec::new(),
        }
    }

    /// The activities of the turns `handed` says this one supersedes, for the bot; those the
    /// store keeps unreadably are left out.
    fn superseded(&self, handed: &Handed) -> Vec<Activity> {
        handed
            .superseded
            .iter()
            .filter_map(|json| match Activity::from_json(json.clone()) {
                Ok(activity) => Some(activity),
                Err(e) => {
                    tracing::warn!(error = %e, "a superseded activity is unreadable; skipped");
                    None
                }
            })
            .collect()
    }

    /// What the attempt asks the store to apply, with the receipt that answers a redelivery
    /// (and, for a batch, the receipts of the others it answered), and the outcome it delivers
    /// once applied.
    fn built(
        &self,
        scopes: TurnScopes,
        activities: Vec<Activity>,
        attempt: u32,
        snapshot: &Snapshot,
        stopped: bool,
        batch: Option<&Batch>,
    ) -> Result<Ran, TurnError> {
        let mut commit = commit_of(&self.keys, scopes, snapshot, self.sizes, &self.ttls)?;
        let outcome = TurnOutcome {
            conversation_version: version_after(&commit, &self.keys.conversation, snapshot),
            activities,
            attempts: attempt,
            redelivered: false,
            stopped,
            superseded: false,
            // A batch of one answered one message: nothing coalesced.
            coalesced: batch
                .filter(|b| b.is_several())
                .map(Batch::ids)
                .unwrap_or_default(),
        };
        if let Some(key) = &self.receipt {
            commit = commit.with_receipt(key.clone(), receipt::encode(&outcome, self.subject()));
        }
        if let Some(batch) = batch.filter(|b| b.is_several()) {
            // The others' calls get the same outcome without the replies, which this call
            // delivers; each receipt names its own activity's user.
            let others = TurnOutcome {
                activities: Vec::new(),
                ..outcome.clone()
            };
            for (key, activity) in batch.receipts.iter().zip(&batch.activities) {
                if Some(key) != self.receipt.as_ref() {
                    let user = activity.from_id().map(|user| {
                        crate::state::subject(activity.channel_id.as_deref().unwrap_or(""), user)
                    });
                    commit = commit
                        .with_receipt_also(key.clone(), receipt::encode(&others, user.as_deref()));
                }
            }
        }
        Ok(Ran::Built(commit, outcome))
    }
}

/// What an attempt does once it has its snapshot and has run the bot (or found a receipt).
enum Step {
    /// Ends the attempt without writing: what is held is let go.
    Done(AttemptOutcome),
    /// Commits this, through what the attempt holds, and delivers the outcome once applied.
    Commit(Commit, TurnOutcome),
    /// A later message interrupted it: hand it on ([`Engine::supersede`]).
    Supersede,
}

/// How one attempt ended, when it did not fail the turn.
enum AttemptOutcome {
    /// The snapshot held the activity's receipt: its stored answer.
    Answered(TurnOutcome),
    /// The bot changed nothing and the activity has no receipt to write.
    NothingToCommit(TurnOutcome),
    /// The store applied the attempt: deliver its replies.
    Committed(TurnOutcome),
    /// Another turn changed this key first: replay on fresh state.
    Conflict(StateKey),
    /// The connection failed while the commit may have been in flight; the receipt, on the next
    /// load, tells whether it applied.
    OutcomeUnknown(StoreError),
}

/// The conversation scope's version once `commit` has applied.
fn version_after(commit: &Commit, conversation: &StateKey, snapshot: &Snapshot) -> Option<Version> {
    commit
        .changes()
        .iter()
        .find(|c| &c.key == conversation)
        .and_then(KeyChange::version_after)
        .or_else(|| snapshot.get(conversation).map(|row| row.version))
}

fn scope_state(scope: Scope, key: &StateKey, snapshot: &Snapshot) -> ScopeState {
    let row = snapshot.get(key);
    let loaded = row.map(|row| row.state.clone()).unwrap_or_default();
    ScopeState::new(scope, loaded).stored(row.is_some())
}

/// Runs the bot on one attempt's context. A panicking bot is a failed turn, not a dead
/// connection: the panic is caught here and reported like an error.
async fn run_bot(
    bot: &dyn crate::bot::Bot,
    mut context: TurnContext<'_>,
) -> Result<(TurnScopes, Vec<Activity>), TurnError> {
    let outcome = AssertUnwindSafe(bot.on_turn(&mut context))
        .catch_unwind()
        .await;
    match outcome {
        Ok(Ok(())) => Ok(context.finish()),
        Ok(Err(e)) => Err(TurnError::Bot(e)),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            Err(TurnError::Bot(BotError::msg(format!(
                "the bot panicked: {message}"
            ))))
        }
    }
}

/// What an attempt asks the store to apply: every changed scope written, and every scope the bot
/// only read checked, each against the version the attempt read. Checking the read scopes too
/// makes a turn that wrote one scope on the strength of another replay when that other one moved;
/// a scope the bot never looked at is left out, so changes there cost this turn nothing.
fn commit_of(
    keys: &TurnKeys,
    scopes: TurnScopes,
    snapshot: &Snapshot,
    sizes: &ScopeSizes,
    ttls: &crate::store::Ttls,
) -> Result<Commit, TurnError> {
    let TurnScopes {
        conversation,
        user,
        private_conversation,
    } = scopes;
    let scoped = [
        (
            Scope::Conversation,
            Some(&keys.conversation),
            Some(conversation),
        ),
        (Scope::User, keys.user.as_ref(), user),
        (
            Scope::PrivateConversation,
            keys.private_conversation.as_ref(),
            private_conversation,
        ),
    ];
    let mut changes = Vec::with_capacity(scoped.len());
    for (scope, key, state) in scoped {
        let (Some(key), Some(state)) = (key, state) else {
            continue;
        };
        if !(state.was_used() || state.is_changed()) {
            continue;
        }
        // A scope read, not changed, past half its time to live: written again as it is, so
        // that a user who keeps talking is not expired for state that never changes.
        let refresh = match (ttls.of(key), snapshot.expiry(key)) {
            (Some(ttl), Some(Some(remaining))) => remaining < ttl / 2,
            _ => false,
        };
        let write = match state.is_changed() || refresh {
            true => Some(Arc::new(sizes.check(scope, state.into_properties())?)),
            false => None,
        };
        changes.push(KeyChange {
            key: key.clone(),
            expected: snapshot.precondition(key),
            write,
        });
    }
    Ok(Commit::new(changes))
}

/// The limit on a scope's written state, and the histogram of the sizes written, by scope.
#[derive(Debug)]
struct ScopeSizes {
    limit: usize,
    /// [`STATE_BYTES`] for the conversation, user and private conversation scopes.
    written: [metrics::Histogram; 3],
}

impl ScopeSizes {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            written: ["conversation", "user", "private_conversation"]
                .map(|scope| metrics::histogram!(STATE_BYTES, "scope" => scope)),
        }
    }

    /// `state`, to be written to `scope`, when it is within the limit; counted either way.
    fn check(&self, scope: Scope, state: JsonMap) -> Result<JsonMap, TurnError> {
        let bytes = crate::state::json_len(&state);
        let at = match scope {
            Scope::Conversation => 0,
            Scope::User => 1,
            Scope::PrivateConversation => 2,
        };
        #[allow(clippy::cast_precision_loss)]
        self.written[at].record(bytes as f64);
        if bytes > self.limit {
            return Err(TurnError::StateTooLarge {
                scope,
                bytes,
                limit: self.limit,
            });
        }
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use async_trait::async_trait;

    use super::*;
    use crate::activity::{ChannelAccount, ConversationAccount};
    use crate::bot::Bot;
    use crate::store::memory::MemoryStore;
    use crate::store::{CacheSize, ConversationLock, Ttls};

    /// `store` as an engine uses it, without a state cache.
    fn uncached(store: Arc<dyn Store>) -> TurnStore {
        TurnStore::for_turns(store, CacheSize::NONE, Ttls::NONE)
    }

    /// What a [`Faulty`] store does wrong; everything else is a [`MemoryStore`]'s.
    enum Fault {
        /// Every commit loses: another replica always got there first.
        AlwaysBeaten,
        /// The connection breaks right after the first commit applied: the engine cannot know
        /// whether it landed. The flag says whether that answer was lost already.
        LosesTheFirstAnswer(std::sync::atomic::AtomicBool),
        /// Commits apply, but every written key is reported one version ahead.
        MisreportsVersions,
        /// Another party always holds the conversation lock.
        LockAlwaysHeld,
    }

    /// A memory store with one [`Fault`].
    struct Faulty {
        inner: MemoryStore,
        fault: Fault,
    }

    impl Faulty {
        fn new(fault: Fault) -> Self {
            Self {
                inner: MemoryStore::new(),
                fault,
            }
        }

        fn losing_the_first_answer() -> Self {
            Self::new(Fault::LosesTheFirstAnswer(
                std::sync::atomic::AtomicBool::new(false),
            ))
        }
    }

    #[async_trait]
    impl Store for Faulty {
        async fn load(
            &self,
            keys: &[StateKey],
            receipt: Option<&StateKey>,
        ) -> Result<Snapshot, StoreError> {
            self.inner.load(keys, receipt).await
        }
        async fn commit(&self, commit: Commit) -> Result<CommitOutcome, StoreError> {
            match &self.fault {
                Fault::AlwaysBeaten => Ok(CommitOutcome::Conflict {
                    key: commit.changes()[0].key.clone(),
                }),
                Fault::LosesTheFirstAnswer(lost) => {
                    let outcome = self.inner.commit(commit).await?;
                    if !lost.swap(true, Ordering::SeqCst) {
                        return Err(StoreError::Unavailable(anyhow::anyhow!(
                            "connection reset during COMMIT"
                        )));
                    }
                    Ok(outcome)
                }
                Fault::MisreportsVersions => Ok(match self.inner.commit(commit).await? {
                    CommitOutcome::Committed(versions) => CommitOutcome::Committed(
                        versions.into_iter().map(|(k, v)| (k, v.next())).collect(),
                    ),
                    conflict => conflict,
                }),
                Fault::LockAlwaysHeld => self.inner.commit(commit).await,
            }
        }
        async fn prune_receipts(&self, age: Duration) -> Result<u64, StoreError> {
            self.inner.prune_receipts(age).await
        }
        async fn lease_conversation(
            &self,
            conversation: &StateKey,
            keys: &[StateKey],
            receipt: Option<&StateKey>,
            wait: Duration,
        ) -> Result<crate::store::ConversationLease, StoreError> {
            self.inner
                .lease_conversation(conversation, keys, receipt, wait)
                .await
        }
        fn pool_status(&self) -> Option<crate::store::PoolStatus> {
            self.inner.pool_status()
        }
        async fn lock_conversation(
            &self,
            conversation: &StateKey,
            keys: &[StateKey],
            receipt: Option<&StateKey>,
            wait: Duration,
        ) -> Result<ConversationLock, StoreError> {
            match self.fault {
                Fault::LockAlwaysHeld => Ok(ConversationLock::NotGranted),
                _ => {
                    self.inner
                        .lock_conversation(conversation, keys, receipt, wait)
                        .await
                }
            }
        }

        async fn hold_conversation(
            &self,
            conversation: &StateKey,
            keys: &[StateKey],
            receipt: Option<&StateKey>,
            wait: Duration,
            others: crate::store::Others,
        ) -> Result<ConversationLock, StoreError> {
            match self.fault {
                Fault::LockAlwaysHeld => Ok(ConversationLock::NotGranted),
                _ => {
                    self.inner
                        .hold_conversation(conversation, keys, receipt, wait, others)
                        .await
                }
            }
        }

        async fn sweep_expired(
            &self,
            after: Option<&str>,
            batch: usize,
        ) -> Result<crate::store::Swept, StoreError> {
            self.inner.sweep_expired(after, batch).await
        }

        async fn erase(
            &self,
            erasure: &crate::store::Erasure,
        ) -> Result<crate::store::Erased, StoreError> {
            self.inner.erase(erasure).await
        }

        async fn add_pending(
            &self,
            conversation: &StateKey,
            pending: &crate::store::Pending,
        ) -> Result<(), StoreError> {
            self.inner.add_pending(conversation, pending).await
        }

        async fn inspect(
            &self,
            keys: &[StateKey],
            receipts_under: &str,
            receipts: usize,
        ) -> Result<crate::store::Inspected, StoreError> {
            self.inner.inspect(keys, receipts_under, receipts).await
        }

        async fn list_conversations(
            &self,
            prefix: &str,
            after: Option<&str>,
            limit: usize,
        ) -> Result<Vec<crate::store::InspectedRow>, StoreError> {
            self.inner.list_conversations(prefix, after, limit).await
        }
    }

    /// Counts its runs, writes conversation state and replies.
    #[derive(Default)]
    struct Counter(AtomicU32);

    #[async_trait]
    impl Bot for Counter {
        async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            if turn.text() == "peek" {
                turn.send_text("just looking");
                return Ok(());
            }
            let n: u64 = turn.conversation_property("n")?;
            turn.conversation_state().set("n", &(n + 1))?;
            turn.send_text(format!("count: {}", n + 1));
            Ok(())
        }
    }

    fn incoming(text: &str) -> IncomingActivity {
        incoming_with_id(text, "a1")
    }

    fn incoming_with_id(text: &str, id: &str) -> IncomingActivity {
        IncomingActivity::parse(Activity {
            id: Some(id.into()),
            channel_id: Some("test".into()),
            service_url: Some("https://gateway.example".into()),
            conversation: Some(ConversationAccount {
                id: Some("c1".into()),
                ..Default::default()
            }),
            from: Some(ChannelAccount {
                id: Some("alice".into()),
                ..Default::default()
            }),
            recipient: Some(ChannelAccount {
                id: Some("bot".into()),
                ..Default::default()
            }),
            ..Activity::message(text)
        })
        .expect("a valid activity")
    }

    fn engine(store: impl Store, retry: RetryPolicy) -> (Engine, Arc<Counter>) {
        struct Shared(Arc<Counter>);
        #[async_trait]
        impl Bot for Shared {
            async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
                self.0.on_turn(turn).await
            }
        }
        let counter = Arc::new(Counter::default());
        let bots = BotRegistry::new("counter", Shared(Arc::clone(&counter)));
        (Engine::new(uncached(Arc::new(store)), bots, retry), counter)
    }

    #[tokio::test]
    async fn a_turn_that_always_loses_is_aborted_after_max_attempts() {
        let retry = RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
        };
        let (engine, runs) = engine(Faulty::new(Fault::AlwaysBeaten), retry);
        let result = engine.run_turn(None, &incoming("hi"), None).await;
        assert!(
            matches!(result, Err(TurnError::Aborted { attempts: 3 })),
            "{result:?}"
        );
        assert_eq!(
            runs.0.load(Ordering::SeqCst),
            3,
            "the bot ran once per attempt"
        );
    }

    #[tokio::test]
    async fn a_store_reporting_another_version_than_the_commit_implied_fails_the_turn() {
        let (engine, _) = engine(
            Faulty::new(Fault::MisreportsVersions),
            RetryPolicy::default(),
        );
        let result = engine.run_turn(None, &incoming("hi"), None).await;
        assert!(
            matches!(result, Err(TurnError::Store(StoreError::Unexpected(_)))),
            "the receipt promised version 1, the store said 2: {result:?}"
        );
    }

    /// Records every span's name and fields, as `name field=value`.
    #[derive(Clone, Default)]
    struct Spans(Arc<std::sync::Mutex<Vec<String>>>);

    struct Fields<'a>(&'a str, &'a mut Vec<String>);

    impl tracing::field::Visit for Fields<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.1
                .push(format!("{} {}={value:?}", self.0, field.name()));
        }
    }

    impl<S> tracing_subscriber::Layer<S> for Spans
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            id: &tracing::span::Id,
            ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if !under_recorded(id, &ctx) {
                return;
            }
            let mut seen = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            attrs.record(&mut Fields(attrs.metadata().name(), &mut seen));
        }

        fn on_record(
            &self,
            id: &tracing::span::Id,
            values: &tracing::span::Record<'_>,
            ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if !under_recorded(id, &ctx) {
                return;
            }
            let name = ctx.span(id).map_or("?", |s| s.name());
            let mut seen = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            values.record(&mut Fields(name, &mut seen));
        }
    }

    /// Whether span `id` is, or descends from, a span named `recorded`.
    fn under_recorded<S>(
        id: &tracing::span::Id,
        ctx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        ctx.span(id)
            .is_some_and(|span| span.scope().any(|s| s.name() == "recorded"))
    }

    /// The spans under a `recorded` span, from anywhere in this test process. A process-wide
    /// subscriber, because tracing caches per callsite whether any subscriber wants it, and a
    /// thread-local one loses that race against test threads that have none.
    fn recorder() -> &'static Spans {
        use tracing_subscriber::layer::SubscriberExt as _;
        static RECORDER: std::sync::OnceLock<Spans> = std::sync::OnceLock::new();
        RECORDER.get_or_init(|| {
            let spans = Spans::default();
            tracing::subscriber::set_global_default(
                tracing_subscriber::registry().with(spans.clone()),
            )
            .expect("no other global subscriber in the library's tests");
            spans
        })
    }

    #[tokio::test]
    async fn each_attempt_has_a_span_with_its_outcome_and_no_message_text() {
        let retry = RetryPolicy {
            max_attempts: 2,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
        };
        let turns = || async {
            let (beaten, _) = engine(Faulty::new(Fault::AlwaysBeaten), retry);
            let _ = beaten.run_turn(None, &incoming("secret words"), None).await;
            let (winning, _) = engine(MemoryStore::new(), RetryPolicy::default());
            winning
                .run_turn(None, &incoming("secret words"), None)
                .await
                .expect("an uncontested turn commits");
        };
        let spans = recorder();
        turns().instrument(tracing::info_span!("recorded")).await;

        let seen = spans.0.lock().expect("no test thread panicked").clone();
        for expected in [
            "attempt attempt=1",
            "attempt attempt=2",
            "attempt outcome=\"conflict\"",
            "turn outcome=\"aborted\"",
            "attempt outcome=\"committed\"",
            "attempt version=1",
            "turn outcome=\"committed\"",
            "turn bot=\"counter\"",
            "turn channel=\"test\"",
        ] {
            assert!(
                seen.iter().any(|s| s == expected),
                "no `{expected}` in {seen:#?}"
            );
        }
        assert_eq!(
            seen.iter()
                .filter(|s| *s == "attempt outcome=\"conflict\"")
                .count(),
            2
        );
        assert!(!seen.iter().any(|s| s.contains("secret")), "{seen:#?}");
    }

    #[tokio::test]
    async fn replays_stop_short_of_the_deadline() {
        let retry = RetryPolicy {
            max_attempts: 10,
            base_delay: Duration::from_secs(5),
            max_delay: Duration::from_secs(5),
        };
        let (engine, runs) = engine(Faulty::new(Fault::AlwaysBeaten), retry);
        let deadline = Instant::now() + Duration::from_millis(50);
        let started = Instant::now();
        // A 5 s wait would overrun a 50 ms deadline, unless the jitter drew a tiny one; either way
        // the turn ends with DEADLINE_EXCEEDED long before ten 5 s waits.
        let result = engine.run_turn(None, &incoming("hi"), Some(deadline)).await;
        assert!(
            matches!(result, Err(TurnError::DeadlineExceeded { .. })),
            "{result:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(runs.0.load(Ordering::SeqCst) >= 1);
    }

    #[tokio::test]
    async fn replies_are_addressed_back_to_the_sender_and_versions_reported() {
        let (engine, _) = engine(MemoryStore::new(), RetryPolicy::default());
        let first = engine
            .run_turn(None, &incoming("hi"), None)
            .await
            .expect("committed");
        assert_eq!(first.attempts, 1);
        assert_eq!(first.conversation_version, Some(Version::FIRST));
        let reply = &first.activities[0];
        assert_eq!(reply.text.as_deref(), Some("count: 1"));
        assert_eq!(reply.activity_type.as_deref(), Some("message"));
        assert_eq!(
            reply.from.as_ref().and_then(|f| f.id.as_deref()),
            Some("bot")
        );
        assert_eq!(
            reply.recipient.as_ref().and_then(|r| r.id.as_deref()),
            Some("alice")
        );
        assert_eq!(reply.reply_to_id.as_deref(), Some("a1"));
        assert_eq!(reply.channel_id.as_deref(), Some("test"));
        assert_eq!(
            reply.conversation.as_ref().and_then(|c| c.id.as_deref()),
            Some("c1")
        );

        let second = engine
            .run_turn(None, &incoming_with_id("hi", "a2"), None)
            .await
            .expect("committed");
        assert_eq!(second.conversation_version, Some(Version::new(2)));
        let peek = engine
            .run_turn(None, &incoming_with_id("peek", "a3"), None)
            .await
            .expect("read-only");
        assert_eq!(
            peek.conversation_version,
            Some(Version::new(2)),
            "nothing written"
        );
        assert_eq!(engine.conversations_in_flight(), 0);
    }

    #[tokio::test]
    async fn an_unknown_commit_outcome_is_resolved_by_the_receipt_not_a_second_run() {
        let store = Faulty::losing_the_first_answer();
        let (engine, runs) = engine(store, RetryPolicy::default());
        let outcome = engine
            .run_turn(None, &incoming("hi"), None)
            .await
            .expect("resolved");
        assert_eq!(runs.0.load(Ordering::SeqCst), 1, "the bot ran once");
        assert_eq!(outcome.activities[0].text.as_deref(), Some("count: 1"));
        assert!(!outcome.redelivered, "it is this call's own commit");
        let again = engine
            .run_turn(None, &incoming("hi"), None)
            .await
            .expect("redelivery");
        assert!(again.redelivered);
        assert_eq!(runs.0.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn without_an_activity_id_an_unknown_outcome_is_unavailable() {
        let store = Faulty::losing_the_first_answer();
        let (engine, _) = engine(store, RetryPolicy::default());
        let mut activity = incoming("hi").activity().clone();
        activity.id = None;
        let no_id = IncomingActivity::parse(activity).expect("valid");
        let result = engine.run_turn(None, &no_id, None).await;
        assert!(
            matches!(result, Err(TurnError::Store(StoreError::Unavailable(_)))),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn a_stale_cache_costs_a_replay_never_a_wrong_count() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let counter = || {
            struct Plain;
            #[async_trait]
            impl Bot for Plain {
                async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
                    Counter::default().on_turn(turn).await
                }
            }
            BotRegistry::new("counter", Plain)
        };
        // Two replicas over one store, the first with a cache.
        let size = CacheSize {
            entries: 100,
            bytes: 1 << 20,
        };
        let cached = TurnStore::for_turns(Arc::clone(&store), size, Ttls::NONE);
        let cached = Engine::new(cached, counter(), RetryPolicy::default());
        let other = Engine::new(
            uncached(Arc::clone(&store)),
            counter(),
            RetryPolicy::default(),
        );
        let text = |o: &TurnOutcome| o.activities[0].text.clone().unwrap_or_default();

        let first = cached
            .run_turn(None, &incoming_with_id("hi", "1"), None)
            .await
            .expect("ok");
        assert_eq!(text(&first), "count: 1");
        let second = cached
            .run_turn(None, &incoming_with_id("hi", "2"), None)
            .await
            .expect("ok");
        assert_eq!(
            (text(&second), second.attempts),
            ("count: 2".into(), 1),
            "a cache hit"
        );
        let third = other
            .run_turn(None, &incoming_with_id("hi", "3"), None)
            .await
            .expect("ok");
        assert_eq!(text(&third), "count: 3");
        // The cached replica still believes in version 2: its guess conflicts, and the replay
        // on the loaded state counts right.
        let fourth = cached
            .run_turn(None, &incoming_with_id("hi", "4"), None)
            .await
            .expect("ok");
        assert_eq!((text(&fourth), fourth.attempts), ("count: 4".into(), 2));
        // A redelivery served from a cache hit still finds its receipt.
        let again = cached
            .run_turn(None, &incoming_with_id("hi", "4"), None)
            .await
            .expect("ok");
        assert!(again.redelivered);
        assert_eq!(text(&again), "count: 4");
    }

    #[tokio::test]
    async fn a_serialized_bot_whose_lock_never_comes_fails_without_running() {
        let (engine, runs) = engine(Faulty::new(Fault::LockAlwaysHeld), RetryPolicy::default());
        let engine = Engine {
            bots: engine
                .bots
                .clone()
                .with_policy("counter", crate::bot::ConcurrencyPolicy::Serialized)
                .expect("hosted"),
            ..engine
        };
        let deadline = Instant::now() + Duration::from_secs(1);
        let result = engine.run_turn(None, &incoming("hi"), Some(deadline)).await;
        assert!(
            matches!(result, Err(TurnError::DeadlineExceeded { attempts: 0 })),
            "{result:?}"
        );
        let result = engine.run_turn(None, &incoming("hi"), None).await;
        assert!(
            matches!(result, Err(TurnError::Aborted { attempts: 0 })),
            "{result:?}"
        );
        assert_eq!(runs.0.load(Ordering::SeqCst), 0, "the bot never ran");
    }

    #[tokio::test]
    async fn on_a_store_of_one_replica_a_serialized_bot_runs_as_usual() {
        let (engine, runs) = engine(MemoryStore::new(), RetryPolicy::default());
        let engine = Engine {
            bots: engine
                .bots
                .clone()
                .with_policy("counter", crate::bot::ConcurrencyPolicy::Serialized)
                .expect("hosted"),
            ..engine
        };
        let outcome = engine
            .run_turn(None, &incoming("hi"), None)
            .await
            .expect("committed");
        assert_eq!(outcome.attempts, 1);
        assert_eq!(outcome.activities[0].text.as_deref(), Some("count: 1"));
        assert_eq!(runs.0.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_unknown_bot_is_refused_before_anything_runs() {
        let (engine, runs) = engine(MemoryStore::new(), RetryPolicy::default());
        let result = engine.run_turn(Some("nobody"), &incoming("hi"), None).await;
        assert!(
            matches!(result, Err(TurnError::UnknownBot(_))),
            "{result:?}"
        );
        assert_eq!(runs.0.load(Ordering::SeqCst), 0);
    }
}
