//! How an attempt holds its conversation against the other replicas' turns, in one place: the
//! engine's loop asks [`Engine::take`] for a snapshot and a [`Holding`], runs the bot on the
//! snapshot, and commits through the holding, without knowing which way it was held.
//!
//! Four ways, chosen per attempt ([`Mode`]):
//! - **optimistic**: nothing held; the snapshot is a guess from this replica's cache or a load,
//!   and the conditional commit alone keeps a lost update out. One round trip, the common case.
//! - **locked**: the conversation lock ([`Store::lock_conversation`]) for this attempt, a row
//!   lock held from the load to the commit. A replay takes it after a conflict, so that it is
//!   not beaten again by a turn that held nothing.
//! - **held**: the fenced hold ([`Store::hold_conversation`]), for serialized bots and streamed
//!   turns, whose bots may take minutes: no connection is kept while the bot runs.
//! - **leased**: this replica's lease ([`Store::lease_conversation`], [`HeldLease`]) on a
//!   conversation contended lately (see `hot`): its turns queued here run one after another as
//!   on a lone replica, a guess and one commit each, and the lease's last turn commits under it,
//!   which hands the conversation to the other replicas.
//!
//! A store that serves one replica answers that it needs no lock, and the attempt runs
//! optimistically: the engine's per-replica queue serializes already.

use tokio::time::Instant;

use super::{Engine, TurnError, TurnPlan};
use crate::bot::DoubleText;
use crate::state::StateKey;
use crate::store::{
    Commit, CommitOutcome, ConversationLease, ConversationLock, Handed, Lease, LockedTurn,
    NOTHING_HANDED, Others, Snapshot, Store, StoreError,
};

/// How long a held attempt of a call without deadline waits for its conversation.
const WAIT_WITHOUT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
/// How long before the caller's deadline a wait for the conversation gives up (at most a quarter
/// of the time left), so that the caller hears why (`DEADLINE_EXCEEDED`, nothing committed)
/// rather than seeing its own timer fire.
const ANSWER_MARGIN: std::time::Duration = std::time::Duration::from_millis(250);

/// The most turns one lease serves before this replica lets the other replicas' holders in.
const LEASE_TURNS: u32 = 32;
/// The longest one lease serves before this replica lets the other replicas' holders in.
const LEASE_TIME: std::time::Duration = std::time::Duration::from_millis(50);

/// How an attempt holds its conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Not at all: a guess or a load, and the conditional commit.
    Optimistic,
    /// The conversation lock for this attempt ([`Store::lock_conversation`]): the replay of a
    /// turn that lost to one holding nothing.
    Locked,
    /// The conversation's fenced hold for this attempt ([`Store::hold_conversation`]): a
    /// serialized bot's turns, and streamed ones, whose bots may take minutes.
    Held,
    /// This replica's lease on the conversation ([`HeldLease`]).
    Leased,
}

impl Mode {
    /// The mode as the attempt span's `mode` field names it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Optimistic => "optimistic",
            Self::Locked => "locked",
            Self::Held => "held",
            Self::Leased => "leased",
        }
    }
}

/// How one turn's attempts hold its conversation: the next attempt's [`Mode`], this replica's
/// lease on the conversation (kept with the conversation's queue, so that its next turn here
/// finds it), and what the waits are bounded by.
pub(super) struct Hold<'t> {
    mode: Mode,
    lease: &'t mut Option<HeldLease>,
    /// Whether no other turn of the conversation waits on this replica.
    last: bool,
    deadline: Option<Instant>,
}

impl<'t> Hold<'t> {
    /// The holding of a turn whose first attempt runs in `mode`.
    pub(super) fn new(
        mode: Mode,
        lease: &'t mut Option<HeldLease>,
        last: bool,
        deadline: Option<Instant>,
    ) -> Self {
        Self {
            mode,
            lease,
            last,
            deadline,
        }
    }

    /// The next attempt's mode.
    pub(super) fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether attempt `attempt` runs without holding the conversation: a conflict then sends the
    /// next one to the lock at once, as the queue it is, without a blind wait.
    pub(super) fn is_free(&self, attempt: u32) -> bool {
        match self.mode {
            Mode::Optimistic => true,
            Mode::Locked | Mode::Held => false,
            Mode::Leased => HeldLease::serves(self.lease, attempt),
        }
    }

    /// Chooses how the replay after a conflict on `key` holds its conversation, the attempt that
    /// lost having run `free` ([`Hold::is_free`]).
    pub(super) fn after_conflict(&mut self, key: &StateKey, free: bool) {
        if self.mode == Mode::Held && !key.is_hold() {
            // A writer that holds nothing (a plain turn of another replica) beat a held turn:
            // the hold cannot keep it out, the lock's row lock can. The replay locks, as an
            // optimistic turn's does, and then wins.
            self.mode = Mode::Locked;
        }
        if free && self.mode == Mode::Optimistic {
            self.mode = Mode::Leased;
        }
    }

    /// The caller's deadline, which no wait may pass.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Ends the turn's use of the lease: a spent one is let go now, so that the other replicas'
    /// holders get in before this replica's next turn, not after it.
    pub(super) fn finish(self) {
        if !HeldLease::serves(self.lease, 1) {
            *self.lease = None;
        }
    }

    /// How long an attempt may wait for its conversation's lock, hold or lease.
    fn wait(&self) -> std::time::Duration {
        self.deadline.map_or(WAIT_WITHOUT_DEADLINE, |d| {
            let left = d.saturating_duration_since(Instant::now());
            left.saturating_sub(ANSWER_MARGIN.min(left / 4))
        })
    }
}

/// How an attempt's commit reaches the store: freely, or under what the attempt holds.
pub(super) enum Holding {
    /// Nothing held: the conditional commit alone.
    Free,
    /// A lock, a hold, or a lease's last turn, which the commit or a release ends.
    Held(Box<dyn LockedTurn>),
}

impl Holding {
    /// What the conversation's earlier turns left to this one (only a hold keeps anything).
    pub(super) fn handed(&self) -> &Handed {
        match self {
            Self::Free => &NOTHING_HANDED,
            Self::Held(turn) => turn.handed(),
        }
    }

    /// A future that resolves when a turn of another activity asks this one to stop, on any
    /// replica; never when nothing is held.
    pub(super) fn interrupted(&self) -> futures::future::BoxFuture<'static, ()> {
        match self {
            Self::Free => Box::pin(std::future::pending()),
            Self::Held(turn) => turn.interrupted(),
        }
    }

    /// Applies `commit` through `store`, or under what is held, which it then lets go.
    pub(super) async fn commit(
        self,
        store: &dyn Store,
        commit: Commit,
    ) -> Result<CommitOutcome, StoreError> {
        match self {
            Self::Free => store.commit(commit).await,
            Self::Held(turn) => turn.commit(commit).await,
        }
    }

    /// Lets go of what is held, writing nothing.
    pub(super) async fn release(self) {
        if let Self::Held(turn) = self {
            turn.release().await;
        }
    }
}

/// A conversation this replica holds against every other replica (see
/// [`Store::lease_conversation`]), kept with the conversation's queue (`queue`) and handed
/// from one of its turns to the next while turns of it wait here: each then runs as on a lone
/// replica, a guess from the cache and one commit, with nobody else's locked turn or lease
/// in between. The lease's last turn — the [`LEASE_TURNS`]th, or the last one waiting here —
/// commits under it, which ends it; a lease past [`LEASE_TIME`] is let go after the turn that
/// found it so. Either way the replicas take turns.
#[derive(Debug)]
pub(super) struct HeldLease {
    /// `None` once the lease's last turn has it.
    lease: Option<Lease>,
    since: Instant,
    turns: u32,
}

impl HeldLease {
    /// Whether `lease` serves attempt `attempt` of the next turn as an ordinary attempt: it is
    /// held, not spent, and the attempt is a first one (a replay locks for itself).
    pub(super) fn serves(lease: &Option<Self>, attempt: u32) -> bool {
        lease.as_ref().is_some_and(|held| {
            attempt == 1
                && held.lease.is_some()
                && held.turns < LEASE_TURNS
                && held.since.elapsed() < LEASE_TIME
        })
    }

    /// The lease as its last turn, which commits under it and so ends it (`None` if a turn
    /// took it already).
    fn end(&mut self) -> Option<Box<dyn LockedTurn>> {
        self.lease.take().map(Lease::into_last_turn)
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        tracing::debug!(
            turns = self.turns,
            held_us = self.since.elapsed().as_micros(),
            ended_by_commit = self.lease.is_none(),
            "conversation lease given up"
        );
    }
}

/// The snapshot an attempt runs on, and what its commit goes through.
pub(super) type Taken = (Snapshot, Holding);

impl Engine {
    /// Holds `plan`'s conversation for attempt `attempt` the way `hold` says, and loads the
    /// attempt's snapshot under it.
    ///
    /// # Errors
    /// [`TurnError`] when the store cannot answer, the conversation was not granted in time
    /// (the bot did not run), or the bot refuses double texts and another message's turn holds
    /// the conversation.
    pub(super) async fn take(
        &self,
        plan: &TurnPlan<'_>,
        hold: &mut Hold<'_>,
        attempt: u32,
    ) -> Result<Taken, TurnError> {
        match hold.mode {
            Mode::Optimistic => self.free(plan, attempt).await,
            Mode::Locked => self.lock(plan, hold, attempt).await,
            Mode::Held => self.hold(plan, hold, attempt).await,
            Mode::Leased => self.lease(plan, hold, attempt).await,
        }
    }

    /// Nothing held: this replica's last committed state for a first attempt that will commit (a
    /// guess its commit checks), the store's otherwise.
    async fn free(&self, plan: &TurnPlan<'_>, attempt: u32) -> Result<Taken, TurnError> {
        Ok((self.snapshot(plan, attempt).await?, Holding::Free))
    }

    /// The conversation lock: nobody else's locked or held turn of this conversation loads, runs
    /// or commits until this one has committed or given up.
    async fn lock(
        &self,
        plan: &TurnPlan<'_>,
        hold: &mut Hold<'_>,
        attempt: u32,
    ) -> Result<Taken, TurnError> {
        let lock = self
            .store
            .lock_conversation(
                &plan.keys.conversation,
                &plan.key_list,
                plan.receipt.as_ref(),
                hold.wait(),
            )
            .await?;
        match lock {
            ConversationLock::Held { snapshot, turn } => Ok(self.granted(snapshot, turn)),
            ConversationLock::NotNeeded => self.free(plan, attempt).await,
            // The lock waits for every other turn: never busy.
            ConversationLock::NotGranted | ConversationLock::Busy => {
                Err(self.not_granted(attempt, hold.deadline))
            }
        }
    }

    /// The fenced hold: as the lock, for a turn whose bot may take minutes, without a connection
    /// held while it runs. A redelivery of this activity on another replica waits for it, and is
    /// then answered from its receipt.
    async fn hold(
        &self,
        plan: &TurnPlan<'_>,
        hold: &mut Hold<'_>,
        attempt: u32,
    ) -> Result<Taken, TurnError> {
        let others = match plan.double_text {
            // A bot that refuses double texts refuses them before running, not on a replay.
            DoubleText::Reject if attempt == 1 => Others::Refuse,
            DoubleText::Interrupt => Others::Interrupt,
            _ => Others::Wait,
        };
        let held = self
            .store
            .hold_conversation(
                &plan.keys.conversation,
                &plan.key_list,
                plan.receipt.as_ref(),
                hold.wait(),
                others,
            )
            .await?;
        match held {
            ConversationLock::Held { snapshot, turn } => Ok(self.granted(snapshot, turn)),
            ConversationLock::NotNeeded => self.free(plan, attempt).await,
            ConversationLock::NotGranted => Err(self.not_granted(attempt, hold.deadline)),
            ConversationLock::Busy => Err(TurnError::ConversationBusy {
                bot: plan.bot_name.to_owned(),
            }),
        }
    }

    /// This replica's lease (see [`HeldLease`]): a free attempt while the lease serves — the
    /// lease's last turn, the [`LEASE_TURNS`]th or the last of its conversation waiting here,
    /// commits under it, which ends it — else the first turn of a new lease, on the state loaded
    /// under it. A replay locks for its own turn, holding the conversation's row, so that it is
    /// never beaten again by a turn that took no lock, and so does a last turn that finds no
    /// lease; the next turn leases anew. A store that offers no lease locks turn by turn.
    async fn lease(
        &self,
        plan: &TurnPlan<'_>,
        hold: &mut Hold<'_>,
        attempt: u32,
    ) -> Result<Taken, TurnError> {
        if HeldLease::serves(hold.lease, attempt) {
            let last = hold.last;
            let ending = hold.lease.as_mut().and_then(|held| {
                held.turns += 1;
                // The lease's last turn: its commit ends the lease and lets the next holder in.
                (last || held.turns >= LEASE_TURNS)
                    .then(|| held.end())
                    .flatten()
            });
            let snapshot = self.snapshot(plan, attempt).await?;
            return Ok((snapshot, ending.map_or(Holding::Free, Holding::Held)));
        }
        // Spent, or a replay: let the other replicas' holders in first.
        *hold.lease = None;
        if attempt > 1 || hold.last {
            // A replay, or a turn with no other of its conversation waiting here: the lock for
            // this turn alone, holding the row.
            return self.lock(plan, hold, attempt).await;
        }
        let leased = self
            .store
            .lease_conversation(
                &plan.keys.conversation,
                &plan.key_list,
                plan.receipt.as_ref(),
                hold.wait(),
            )
            .await?;
        match leased {
            ConversationLease::Held {
                lease,
                snapshot,
                waited,
            } => {
                self.metrics.granted.increment(1);
                tracing::debug!(waited, "conversation leased");
                if waited {
                    // Another replica is at this conversation too: keep leasing it.
                    self.hot.contended(&plan.keys.conversation);
                }
                *hold.lease = Some(HeldLease {
                    lease: Some(lease),
                    since: Instant::now(),
                    turns: 1,
                });
                Ok((snapshot, Holding::Free))
            }
            ConversationLease::NotOffered => self.lock(plan, hold, attempt).await,
            ConversationLease::NotGranted => Err(self.not_granted(attempt, hold.deadline)),
        }
    }

    /// A lock or hold granted, with the snapshot loaded under it.
    fn granted(&self, snapshot: Snapshot, turn: Box<dyn LockedTurn>) -> Taken {
        self.metrics.granted.increment(1);
        (snapshot, Holding::Held(turn))
    }

    /// The error of attempt `attempt`, whose conversation was not granted before the deadline:
    /// the bot did not run on it.
    fn not_granted(&self, attempt: u32, deadline: Option<Instant>) -> TurnError {
        self.metrics.not_granted.increment(1);
        let attempts = attempt - 1;
        match deadline {
            Some(_) => TurnError::DeadlineExceeded { attempts },
            None => TurnError::ConversationHeld {
                waited: WAIT_WITHOUT_DEADLINE,
                attempts,
            },
        }
    }
}
