//! What one turn needs on every attempt, worked out once before the first ([`TurnPlan`]), and
//! what one run of its bot makes of a snapshot: the bot run (raced against a later message's
//! interruption and a user's stop), and the commit it asks for, with the receipt that answers a
//! redelivery. Nothing here talks to the store: the loop in `engine` takes the snapshot and
//! commits what this builds, so an attempt's holding (`hold`) and its content stay apart.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt as _;
use tokio::time::Instant;

use super::{TurnError, TurnOutcome, in_flight, receipt};
use crate::activity::incoming::IncomingActivity;
use crate::activity::{Activity, JsonMap};
use crate::bot::{Bot, BotError, DoubleText, Scopes, TurnContext, TurnScopes};
use crate::drafts::Drafts;
use crate::state::{Scope, ScopeState, StateKey, TurnKeys};
use crate::store::{Commit, Expected, Handed, KeyChange, Pending, Snapshot, StateWrite, Version};
use crate::telemetry::metrics::STATE_BYTES;

/// What one turn needs on every attempt, worked out once before the first.
pub(super) struct TurnPlan<'a> {
    pub(super) bot: &'a dyn Bot,
    pub(super) incoming: &'a IncomingActivity,
    pub(super) keys: TurnKeys,
    /// The scopes the bot declared ([`Bot::scopes`]).
    scopes: Scopes,
    /// The key of every scope the turn has, for loads and the cache: the conversation's, and
    /// the user's and the private conversation's when the activity names a user and the bot
    /// declared them.
    pub(super) key_list: Vec<StateKey>,
    /// The activity's receipt; `None` for an activity without id, which is not deduplicated.
    pub(super) receipt: Option<StateKey>,
    /// The caller's deadline, which the bot sees (a bot worker's call gets no longer).
    pub(super) deadline: Option<Instant>,
    /// Where the bot's drafts go, when someone streams the turn.
    pub(super) drafts: Option<&'a Drafts>,
    /// The bot's name.
    pub(super) bot_name: &'a str,
    /// What happens to a message arriving while a turn of the conversation runs.
    pub(super) double_text: DoubleText,
    /// Set when a later message of the conversation on this replica asks this turn to stop
    /// ([`DoubleText::Interrupt`]).
    pub(super) interrupt: Option<Arc<in_flight::Signal>>,
    /// The limit on a scope's written state.
    pub(super) sizes: &'a ScopeSizes,
    /// The user whose activity this is, as its receipt names them for erasure
    /// ([`StateKey::user_subject`]).
    pub(super) subject: Option<String>,
    /// How long each scope lives unwritten: a scope the turn only read is written again, as it
    /// is, once past half of it, so that its time runs from its last use, not its last change.
    pub(super) ttls: crate::store::Ttls,
}

/// How a run of the bot ended, when it did not fail.
pub(super) enum Ran {
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
    pub(super) fn new(
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
        let scopes = bot.scopes();
        Self {
            bot_name,
            double_text,
            bot,
            incoming,
            key_list: keys
                .all()
                .filter(|(scope, _)| scopes.has(*scope))
                .map(|(_, k)| k.clone())
                .collect(),
            scopes,
            receipt: incoming.id().map(|id| keys.receipt(id)),
            // Only a turn with a receipt needs it.
            subject: incoming.id().and_then(|_| keys.user_subject()),
            keys,
            deadline,
            drafts,
            interrupt: None,
            sizes,
            ttls: crate::store::Ttls::NONE,
        }
    }

    /// The same plan, with the scopes' times to live ([`TurnPlan::ttls`]).
    pub(super) fn with_ttls(mut self, ttls: crate::store::Ttls) -> Self {
        self.ttls = ttls;
        self
    }

    /// The user whose activity this is ([`TurnPlan::subject`]).
    pub(super) fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// The context the bot runs in on `snapshot`, with the scopes it declared.
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
        .with_scopes(self.scopes)
        .with_deadline(self.deadline)
        .with_drafts(self.drafts)
    }

    /// Runs the bot for attempt `attempt` on `snapshot`, with what the turns before handed on
    /// (`handed`): what the attempt asks the store to apply, and the outcome it delivers once
    /// applied. The run is raced against a later message's interruption (`interrupted`, or this
    /// replica's [`TurnPlan::interrupt`]), which ends it with nothing kept; and a streamed
    /// turn's against its stop ([`Drafts::stop`]): once stopped, the bot is cancelled (or not
    /// run), and the attempt commits the reply as far as it was shown, on the state as it was.
    pub(super) async fn run(
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
    pub(super) fn superseded_outcome(&self, attempt: u32, snapshot: &Snapshot) -> TurnOutcome {
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
        let expected = snapshot.precondition(key);
        // The properties read are the stored row's at the version expected, unless that row
        // expired: the turn saw it empty, and a write of the changes alone would keep the rest.
        let read = match (expected, snapshot.expiry(key)) {
            (Expected::Version(_), None | Some(Some(_))) => Some(Arc::clone(state.loaded_shared())),
            _ => None,
        };
        let write = match state.is_changed() || refresh {
            true => {
                let write = sizes.check(scope, state.into_properties())?;
                Some(match read {
                    Some(read) => write.changed_since(&read),
                    None => write,
                })
            }
            false => None,
        };
        changes.push(KeyChange {
            key: key.clone(),
            expected,
            write,
        });
    }
    Ok(Commit::new(changes))
}

/// The limit on a scope's written state, and the histogram of the sizes written, by scope.
#[derive(Debug)]
pub(super) struct ScopeSizes {
    limit: usize,
    /// [`STATE_BYTES`] for the conversation, user and private conversation scopes.
    written: [metrics::Histogram; 3],
}

impl ScopeSizes {
    pub(super) fn new(limit: usize) -> Self {
        Self {
            limit,
            written: ["conversation", "user", "private_conversation"]
                .map(|scope| metrics::histogram!(STATE_BYTES, "scope" => scope)),
        }
    }

    /// `state`, to be written to `scope`, with its JSON text, when that is within the limit;
    /// counted either way.
    pub(super) fn check(&self, scope: Scope, state: JsonMap) -> Result<StateWrite, TurnError> {
        let state = StateWrite::new(state);
        let bytes = state.json_len();
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
