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
mod plan;
mod queue;
mod receipt;
mod retry;
mod stoppable;

pub use retry::RetryPolicy;

use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument as _;

use crate::activity::Activity;
use crate::activity::incoming::{
    ActivityId, ChannelId, ConversationId, IncomingActivity, InvalidActivity,
};
use crate::bot::{BotError, BotRegistry, DoubleText, UnknownBot};
use crate::drafts::{Drafts, Stop};
use crate::state::{Scope, StateKey};
use crate::store::cached::TurnStore;
use crate::store::{Commit, CommitOutcome, Handed, Pending, Snapshot, Store, StoreError, Version};
use hold::{HeldLease, Hold, Holding, Mode};
use outcome::{AttemptEnd, TurnEnd, TurnMetrics};
use plan::{Ran, ScopeSizes, TurnPlan};

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
    /// Other turns held the conversation (its lock, hold or lease) for all of the time a call
    /// without a deadline waits for it ([`hold`]'s `WAIT_WITHOUT_DEADLINE`).
    #[error(
        "other turns of this conversation held it for all of the {waited:?} a call without a deadline waits for it ({attempts} attempts made); nothing was committed: retry, or give the call a deadline to wait longer"
    )]
    ConversationHeld {
        /// How long this turn waited.
        waited: std::time::Duration,
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
            Err(
                TurnError::Aborted { attempts }
                | TurnError::DeadlineExceeded { attempts }
                | TurnError::ConversationHeld { attempts, .. },
            ) => Some(*attempts),
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
        hold.after_conflict(key, free);
        if !free {
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
    /// next turn of the conversation ([`crate::bot::TurnContext::superseded`]). A turn that
    /// holds nothing (a store that needs no hold answered) has nothing to hand on, nor a receipt
    /// to write outside the conversation's order.
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

#[cfg(test)]
mod tests;
