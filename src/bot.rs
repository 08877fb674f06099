//! The bot API: the one trait a bot implements, and the turn context it works through.
//!
//! A bot sees the inbound activity, three typed state scopes and a `send` that only buffers. It
//! never sees the network or the database: the engine decides when its state is committed and
//! whether its replies leave at all.
//!
//! A bot that keeps no user or private-conversation state says so ([`Bot::scopes`]), as a Bot
//! Framework bot that never creates a `UserState` never loads one: its turns load and check the
//! conversation's row alone. A turn's load reads each scope's row and its erasure tombstone, so
//! each scope left out is two index lookups fewer in the database, and the SHA-256 of its key
//! fewer on the replica, on every turn the state cache misses.
//!
//! # The replay rule
//! **A bot's turn may run more than once.** When another replica changed the state while this
//! turn ran, the engine discards everything the attempt did — state changes and sent activities —
//! reloads and runs the bot again on the fresh state. Only the attempt that commits is seen by
//! anyone. So a turn must be a function of (state, activity): no side effects outside the context
//! (no calls that change another system, unless they are idempotent and keyed by the activity id),
//! no dependence on wall-clock time or randomness that the state does not record.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::activity::incoming::IncomingActivity;
use crate::activity::{Activity, types};
use crate::drafts::{DraftError, DraftKind, Drafts};
use crate::state::{PropertyError, Scope, ScopeState};

/// A bot: handles one turn at a time through a [`TurnContext`].
///
/// Implementations must follow the replay rule in the module documentation.
#[async_trait]
pub trait Bot: Send + Sync + 'static {
    /// Handles one turn. Returning an error discards the attempt: no state is committed and no
    /// activity is sent, and the caller gets `INTERNAL`.
    ///
    /// # Errors
    /// Whatever the bot decides is a failure of the turn.
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError>;

    /// The state scopes the bot uses besides its conversation's: all of them unless it says
    /// otherwise. A scope left out is not loaded, and asking for it is an error naming it
    /// ([`NoSuchScope`]).
    fn scopes(&self) -> Scopes {
        Scopes::ALL
    }
}

/// The state scopes a bot uses besides the conversation's, which every bot has ([`Bot::scopes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scopes {
    /// The user scope.
    pub user: bool,
    /// The private conversation scope.
    pub private_conversation: bool,
}

impl Scopes {
    /// Every scope.
    pub const ALL: Self = Self {
        user: true,
        private_conversation: true,
    };
    /// The conversation's alone.
    pub const CONVERSATION: Self = Self {
        user: false,
        private_conversation: false,
    };

    /// Whether `scope` is among these.
    pub fn has(self, scope: Scope) -> bool {
        match scope {
            Scope::Conversation => true,
            Scope::User => self.user,
            Scope::PrivateConversation => self.private_conversation,
        }
    }
}

impl std::str::FromStr for Scopes {
    type Err = String;

    /// Scopes as `--bot-scopes` gives them: `conversation`, alone or joined by `+` with `user`
    /// and `private-conversation` (`conversation+user`). The conversation's scope must be named:
    /// every bot has it, and a value without it reads as if it were left out.
    fn from_str(value: &str) -> Result<Self, String> {
        let mut scopes = Self::CONVERSATION;
        let mut conversation = false;
        for name in value.split('+').map(str::trim) {
            match name {
                "conversation" => conversation = true,
                "user" => scopes.user = true,
                "private-conversation" => scopes.private_conversation = true,
                other => {
                    return Err(format!(
                        "`{other}` is not a scope: `conversation`, `user` or \
                         `private-conversation`, joined by `+`"
                    ));
                }
            }
        }
        if !conversation {
            return Err(format!(
                "`{value}` leaves out `conversation`, which every bot has: write \
                 `conversation+{value}`"
            ));
        }
        Ok(scopes)
    }
}

/// A bot with the scopes it was given in place of those it declares
/// ([`BotRegistry::with_scopes`]).
struct Declared {
    bot: Arc<dyn Bot>,
    scopes: Scopes,
}

#[async_trait]
impl Bot for Declared {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.bot.on_turn(turn).await
    }

    fn scopes(&self) -> Scopes {
        self.scopes
    }
}

/// A bot's failure: any error, with its cause chain kept for the log, and what kind of failure
/// it is, which decides the status the caller gets.
pub struct BotError {
    kind: BotErrorKind,
    error: anyhow::Error,
}

/// What kind of failure a [`BotError`] is. In-process bots fail with [`BotErrorKind::Failed`];
/// the other kinds exist for bots that are a call to another process (a bot worker, see
/// [`crate::bots::remote`]), whose failures the caller can act on differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BotErrorKind {
    /// The bot failed. The caller gets `INTERNAL` with a generic message; the cause is logged.
    Failed,
    /// The bot's worker could not be reached. The caller gets `UNAVAILABLE`, to retry later.
    Unavailable,
    /// The bot's worker did not answer before the call's deadline: `DEADLINE_EXCEEDED`.
    DeadlineExceeded,
    /// The bot's worker failed or answered something Turnstile cannot use. The caller gets
    /// `INTERNAL` with this error's message, which names the worker and the problem (and is
    /// written to be shown: it holds no state or message text).
    WorkerFailed,
}

impl BotError {
    /// A failure described by `message`.
    pub fn msg(message: impl fmt::Display + fmt::Debug + Send + Sync + 'static) -> Self {
        Self::new(BotErrorKind::Failed, message)
    }

    /// A failure of kind `kind` described by `message`.
    pub fn new(
        kind: BotErrorKind,
        message: impl fmt::Display + fmt::Debug + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            error: anyhow::Error::msg(message),
        }
    }

    /// The same error, of kind `kind`, with `context` as its outermost message (the cause chain
    /// kept beneath it).
    #[must_use]
    pub fn with_kind(
        self,
        kind: BotErrorKind,
        context: impl fmt::Display + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            error: self.error.context(context),
        }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> BotErrorKind {
        self.kind
    }

    /// The outermost message, without the causes beneath it.
    pub fn message(&self) -> String {
        self.error.to_string()
    }

    /// The underlying error, with its cause chain.
    pub fn into_inner(self) -> anyhow::Error {
        self.error
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for BotError {
    fn from(e: E) -> Self {
        Self {
            kind: BotErrorKind::Failed,
            error: anyhow::Error::new(e),
        }
    }
}

impl fmt::Debug for BotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.error, f)
    }
}

impl fmt::Display for BotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `{:#}` prints the whole cause chain on one line.
        write!(f, "{:#}", self.error)
    }
}

/// A state scope the turn does not have: user-scoped state needs a `from.id`, and a bot has only
/// the scopes it declares ([`Bot::scopes`]) or is given ([`BotRegistry::with_scopes`]).
#[derive(Debug, thiserror::Error)]
pub enum NoSuchScope {
    /// The activity names no user.
    #[error("{0} state is not available: the activity has no `from.id`")]
    NoUser(Scope),
    /// The bot does not declare the scope, or was not given it.
    #[error(
        "{0} state is not available: the bot's scopes leave it out (`Bot::scopes`, `--bot-scopes`)"
    )]
    Undeclared(Scope),
}

/// The drafting side of one attempt ([`TurnContext::drafter`]): what it shows whoever streams the
/// turn, if anyone does.
#[derive(Debug, Clone, Copy)]
pub struct Drafter<'a> {
    drafts: Option<&'a Drafts>,
    attempt: u32,
}

impl Drafter<'_> {
    /// [`TurnContext::draft`].
    ///
    /// # Errors
    /// [`DraftError::TooLarge`] for a draft longer than a reply's text may be.
    pub fn draft(&self, text: impl Into<String>) -> Result<(), DraftError> {
        self.offer(DraftKind::Text, text.into())
    }

    /// [`TurnContext::inform`].
    ///
    /// # Errors
    /// [`DraftError::TooLarge`] for a status longer than a reply's text may be.
    pub fn inform(&self, text: impl Into<String>) -> Result<(), DraftError> {
        self.offer(DraftKind::Informative, text.into())
    }

    fn offer(&self, kind: DraftKind, text: String) -> Result<(), DraftError> {
        match self.drafts {
            Some(drafts) => drafts.offer(self.attempt, kind, text),
            None => Ok(()),
        }
    }
}

/// One attempt at one turn: the activity, the state scopes, and the buffered outbound activities.
pub struct TurnContext<'a> {
    incoming: &'a IncomingActivity,
    attempt: u32,
    conversation: ScopeState,
    user: Option<ScopeState>,
    private_conversation: Option<ScopeState>,
    /// The scopes the bot declared; the others are never given, whatever the activity.
    scopes: Scopes,
    outbox: Vec<Activity>,
    deadline: Option<Instant>,
    drafts: Option<&'a Drafts>,
    superseded: &'a [Activity],
    batch: &'a [Activity],
}

impl<'a> TurnContext<'a> {
    /// A context for attempt `attempt` (from 1) of the turn for `incoming`, over loaded state.
    pub fn new(
        incoming: &'a IncomingActivity,
        attempt: u32,
        conversation: ScopeState,
        user: Option<ScopeState>,
        private_conversation: Option<ScopeState>,
    ) -> Self {
        Self {
            incoming,
            attempt,
            conversation,
            user,
            private_conversation,
            scopes: Scopes::ALL,
            outbox: Vec::new(),
            deadline: None,
            drafts: None,
            superseded: &[],
            batch: &[],
        }
    }

    /// The same context, for a bot that declared `scopes`: a scope not among them is withheld
    /// even when it was given.
    #[must_use]
    pub fn with_scopes(mut self, scopes: Scopes) -> Self {
        self.scopes = scopes;
        if !scopes.user {
            self.user = None;
        }
        if !scopes.private_conversation {
            self.private_conversation = None;
        }
        self
    }

    /// The same context, for a turn that supersedes `superseded` (see
    /// [`TurnContext::superseded`]).
    #[must_use]
    pub fn with_superseded(mut self, superseded: &'a [Activity]) -> Self {
        self.superseded = superseded;
        self
    }

    /// The same context, for a run that answers `batch` together (see [`TurnContext::batch`]).
    #[must_use]
    pub fn with_batch(mut self, batch: &'a [Activity]) -> Self {
        self.batch = batch;
        self
    }

    /// The messages this turn supersedes, oldest first, when the bot's double-text policy is
    /// [`DoubleText::Interrupt`]: messages of the conversation whose turns a later message
    /// cancelled before they committed. Nothing of those turns was kept, and their users expect
    /// this turn to take them into account. Empty when nothing was interrupted.
    pub fn superseded(&self) -> &[Activity] {
        self.superseded
    }

    /// The messages this run answers together, in arrival order, when the bot's double-text
    /// policy is [`DoubleText::Coalesce`]: every message that arrived while the conversation's
    /// previous turn ran. [`activity`](Self::activity) is one of them, the one whose call runs
    /// the batch (its user's scopes are the ones given); the latest is the last. The replies
    /// answer them all. Empty for other policies.
    pub fn batch(&self) -> &[Activity] {
        self.batch
    }

    /// The same context, for a turn someone streams: its drafts go to `drafts` (`None`: nobody
    /// streams it, and drafting does nothing).
    #[must_use]
    pub fn with_drafts(mut self, drafts: Option<&'a Drafts>) -> Self {
        self.drafts = drafts;
        self
    }

    /// Whether someone watches this turn's drafts (a `StreamTurn` call). A bot need not ask:
    /// drafting a turn nobody streams does nothing. It may, to skip work that only drafts need.
    pub fn streaming(&self) -> bool {
        self.drafts.is_some()
    }

    /// Shows `text`, the whole reply written so far (not the new part), to whoever streams the
    /// turn, while the bot is still writing. A draft is provisional: it is never stored, an
    /// attempt thrown away for a conflict has its drafts voided, and only what the bot
    /// [`send`](Self::send)s is delivered, after the commit. So the last draft should be the
    /// text of the reply the bot then sends.
    ///
    /// # Errors
    /// [`DraftError::TooLarge`] for a draft longer than a reply's text may be.
    pub fn draft(&self, text: impl Into<String>) -> Result<(), DraftError> {
        self.offer(DraftKind::Text, text.into())
    }

    /// Shows a status line ("Looking at the menu…") to whoever streams the turn: not part of
    /// the reply, and as provisional as a [`draft`](Self::draft).
    ///
    /// # Errors
    /// [`DraftError::TooLarge`] for a status longer than a reply's text may be.
    pub fn inform(&self, text: impl Into<String>) -> Result<(), DraftError> {
        self.offer(DraftKind::Informative, text.into())
    }

    fn offer(&self, kind: DraftKind, text: String) -> Result<(), DraftError> {
        self.drafter().offer(kind, text)
    }

    /// This attempt's drafting alone, [`draft`](Self::draft) and [`inform`](Self::inform)
    /// apart from the rest of the context: unlike the context it can be held across an
    /// `.await` in a `Send` future (a remote bot passing on its worker's drafts as they arrive).
    pub fn drafter(&self) -> Drafter<'a> {
        Drafter {
            drafts: self.drafts,
            attempt: self.attempt,
        }
    }

    /// The same context, for a call that must be answered by `deadline` (`None`: no deadline).
    #[must_use]
    pub fn with_deadline(mut self, deadline: Option<Instant>) -> Self {
        self.deadline = deadline;
        self
    }

    /// When the caller stops waiting for this turn, if it said. A bot that calls another
    /// process (a bot worker) gives that call no longer than this.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The inbound activity.
    pub fn activity(&self) -> &Activity {
        self.incoming.activity()
    }

    /// The inbound activity's text, trimmed; empty when it has none.
    pub fn text(&self) -> &str {
        self.activity().text.as_deref().unwrap_or_default().trim()
    }

    /// Which attempt this is, from 1. Greater than 1 means a conflict forced a replay; bots
    /// should not behave differently because of it (see the replay rule).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The conversation scope: shared by everyone in the conversation.
    pub fn conversation_state(&mut self) -> &mut ScopeState {
        &mut self.conversation
    }

    /// The user scope: this user, across conversations on this channel.
    ///
    /// # Errors
    /// When the bot does not declare the scope ([`Bot::scopes`]), or the activity names no user
    /// (`from.id`), which only non-message activities may omit.
    pub fn user_state(&mut self) -> Result<&mut ScopeState, NoSuchScope> {
        let why = self.missing(Scope::User);
        self.user.as_mut().ok_or(why)
    }

    /// The private conversation scope: this user within this conversation.
    ///
    /// # Errors
    /// As [`TurnContext::user_state`].
    pub fn private_conversation_state(&mut self) -> Result<&mut ScopeState, NoSuchScope> {
        let why = self.missing(Scope::PrivateConversation);
        self.private_conversation.as_mut().ok_or(why)
    }

    /// Why `scope` would be missing from this context.
    fn missing(&self, scope: Scope) -> NoSuchScope {
        match self.scopes.has(scope) {
            true => NoSuchScope::NoUser(scope),
            false => NoSuchScope::Undeclared(scope),
        }
    }

    /// Buffers `activity` as a reply. It is delivered only if this attempt commits. Fields the
    /// bot left empty are filled in as a reply to the inbound activity: type `message`, the same
    /// channel, service URL and conversation, `from` and `recipient` swapped, `reply_to_id` the
    /// inbound id.
    pub fn send(&mut self, activity: Activity) {
        // Addressed where it lies in the outbox: an activity is two kilobytes, and passing it
        // through `address_reply` by value copied it in and out (`bench/RESULTS.md`).
        self.outbox.push(activity);
        if let Some(reply) = self.outbox.last_mut() {
            address_reply(reply, self.incoming.activity());
        }
    }

    /// Buffers a text message as a reply.
    pub fn send_text(&mut self, text: impl Into<String>) {
        self.send(Activity::message(text));
    }

    /// The activities sent so far in this attempt.
    pub fn sent(&self) -> &[Activity] {
        &self.outbox
    }

    /// Ends the attempt: its state scopes and its buffered activities.
    pub fn finish(self) -> (TurnScopes, Vec<Activity>) {
        (
            TurnScopes {
                conversation: self.conversation,
                user: self.user,
                private_conversation: self.private_conversation,
            },
            self.outbox,
        )
    }

    /// Reads a conversation-scoped property, a shorthand used by most bots.
    ///
    /// # Errors
    /// When the stored value does not deserialize into `T`.
    pub fn conversation_property<T: serde::de::DeserializeOwned + Default>(
        &self,
        name: &str,
    ) -> Result<T, PropertyError> {
        self.conversation.get_or_default(name)
    }
}

/// The state scopes as an attempt left them.
pub struct TurnScopes {
    /// The conversation scope.
    pub conversation: ScopeState,
    /// The user scope, when the activity named a user.
    pub user: Option<ScopeState>,
    /// The private conversation scope, when the activity named a user.
    pub private_conversation: Option<ScopeState>,
}

fn address_reply(reply: &mut Activity, to: &Activity) {
    reply
        .activity_type
        .get_or_insert_with(|| types::MESSAGE.to_owned());
    if reply.channel_id.is_none() {
        reply.channel_id = to.channel_id.clone();
    }
    if reply.service_url.is_none() {
        reply.service_url = to.service_url.clone();
    }
    if reply.conversation.is_none() {
        reply.conversation = to.conversation.clone();
    }
    if reply.from.is_none() {
        reply.from = to.recipient.clone();
    }
    if reply.recipient.is_none() {
        reply.recipient = to.from.clone();
    }
    if reply.reply_to_id.is_none() {
        reply.reply_to_id = to.id.clone();
    }
    if reply.locale.is_none() {
        reply.locale = to.locale.clone();
    }
}

/// The bots a server hosts, by name, with one of them the default.
#[derive(Clone)]
pub struct BotRegistry {
    /// By name, hashed: every turn looks its bot up, and a search of the sorted names compared
    /// one string after another (`bench/RESULTS.md`).
    bots: HashMap<String, Arc<dyn Bot>, foldhash::fast::RandomState>,
    default: String,
    /// The bots whose turns hold the conversation from their first attempt.
    serialized: BTreeSet<String>,
    /// The bots given a double-text policy.
    double_text: BTreeMap<String, DoubleText>,
}

/// How the turns of one bot meet concurrent turns of the same conversation on other replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ConcurrencyPolicy {
    /// Run on the state as loaded (or cached) and commit if nobody else did meanwhile: one round
    /// trip when uncontended. After a conflict the turn's next attempt holds the conversation
    /// lock, so a turn runs its bot at most twice whenever the lock comes in time.
    #[default]
    Optimistic,
    /// Hold the conversation from the first attempt, across replicas (a fenced hold, with no
    /// connection held while the bot runs): no run of the bot is ever thrown away for a
    /// conflict. For bots whose turns are slow or cost money (a language model, a payment).
    Serialized,
}

/// What happens to a message that arrives while a turn of its conversation is still running —
/// the user double-texts — the same on every replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DoubleText {
    /// The new turn waits for the running one, then runs: first in, first out within a replica.
    #[default]
    Enqueue,
    /// The new message is refused at once (`FAILED_PRECONDITION`, reason `CONVERSATION_BUSY`,
    /// with a `RetryInfo`), and nothing is committed for it; a redelivery of the running
    /// message itself still waits for that turn's answer.
    Reject,
    /// The new message cancels the running turn: its drafts are reset, nothing of it is
    /// committed, and its activity is receipted as superseded. The new turn runs with the
    /// superseded messages in [`TurnContext::superseded`].
    Interrupt,
    /// The messages arriving while a turn runs wait for it, then are answered by one run of the
    /// bot, which gets them all in [`TurnContext::batch`], in arrival order; each one is
    /// receipted with that run's answer, which is delivered once.
    Coalesce,
}

impl DoubleText {
    /// The policy's name, as `--double-text` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Enqueue => "enqueue",
            Self::Reject => "reject",
            Self::Interrupt => "interrupt",
            Self::Coalesce => "coalesce",
        }
    }
}

impl std::str::FromStr for DoubleText {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name.trim() {
            "enqueue" => Ok(Self::Enqueue),
            "reject" => Ok(Self::Reject),
            "interrupt" => Ok(Self::Interrupt),
            "coalesce" => Ok(Self::Coalesce),
            other => Err(format!(
                "unknown double-text policy `{other}` (one of: enqueue, reject, interrupt, coalesce)"
            )),
        }
    }
}

/// A lookup for a bot the registry does not host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no bot named `{name}` is hosted here (hosted: {hosted})")]
pub struct UnknownBot {
    name: String,
    hosted: String,
}

impl UnknownBot {
    /// The bot the caller asked for.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl BotRegistry {
    /// A registry whose default bot is `bot`, named `name`.
    pub fn new(name: impl Into<String>, bot: impl Bot) -> Self {
        let name = name.into();
        let mut bots = HashMap::default();
        bots.insert(name.clone(), Arc::new(bot) as Arc<dyn Bot>);
        Self {
            bots,
            default: name,
            serialized: BTreeSet::new(),
            double_text: BTreeMap::new(),
        }
    }

    /// Sets the concurrency policy of the bot named `name` (every bot starts
    /// [`ConcurrencyPolicy::Optimistic`]).
    ///
    /// # Errors
    /// When no bot of that name is registered.
    pub fn with_policy(
        mut self,
        name: &str,
        policy: ConcurrencyPolicy,
    ) -> Result<Self, UnknownBot> {
        let (name, _) = self.get(Some(name))?;
        let name = name.to_owned();
        match policy {
            ConcurrencyPolicy::Optimistic => self.serialized.remove(&name),
            ConcurrencyPolicy::Serialized => self.serialized.insert(name),
        };
        Ok(self)
    }

    /// The concurrency policy of the bot named `name` (as returned by [`BotRegistry::get`]).
    pub fn policy(&self, name: &str) -> ConcurrencyPolicy {
        if self.serialized.contains(name) {
            ConcurrencyPolicy::Serialized
        } else {
            ConcurrencyPolicy::Optimistic
        }
    }

    /// Sets what happens to a message of bot `name`'s conversations that arrives while a turn of
    /// the conversation runs (every bot starts [`DoubleText::Enqueue`], unnamed). A bot given a
    /// policy — `Enqueue` too — holds its conversations from each turn's first attempt, as
    /// [`ConcurrencyPolicy::Serialized`] does, so that every replica sees the running turn and the
    /// waiting ones line up, first in, first out.
    ///
    /// # Errors
    /// When no bot of that name is registered.
    pub fn with_double_text(mut self, name: &str, policy: DoubleText) -> Result<Self, UnknownBot> {
        let (name, _) = self.get(Some(name))?;
        let name = name.to_owned();
        self.double_text.insert(name, policy);
        Ok(self)
    }

    /// Gives the bot named `name` the state scopes `scopes` in place of those it declares
    /// ([`Bot::scopes`]): how a bot that cannot declare them itself — a bot worker's — is spared
    /// loading the scopes it never uses (`--bot-scopes`).
    ///
    /// # Errors
    /// When no bot of that name is registered.
    pub fn with_scopes(mut self, name: &str, scopes: Scopes) -> Result<Self, UnknownBot> {
        let (name, bot) = self.get(Some(name))?;
        let (name, bot) = (name.to_owned(), Arc::clone(bot));
        self.bots
            .insert(name, Arc::new(Declared { bot, scopes }) as Arc<dyn Bot>);
        Ok(self)
    }

    /// Whether the turns of the bot named `name` hold their conversation from the first attempt:
    /// it is serialized, or was given a double-text policy.
    pub fn holds(&self, name: &str) -> bool {
        self.serialized.contains(name) || self.double_text.contains_key(name)
    }

    /// The double-text policy of the bot named `name` (as returned by [`BotRegistry::get`]).
    pub fn double_text(&self, name: &str) -> DoubleText {
        self.double_text.get(name).copied().unwrap_or_default()
    }

    /// Adds `bot` under `name`, replacing any bot of that name.
    #[must_use]
    pub fn with(mut self, name: impl Into<String>, bot: impl Bot) -> Self {
        self.bots.insert(name.into(), Arc::new(bot));
        self
    }

    /// Makes the bot named `name` the default.
    ///
    /// # Errors
    /// When no bot of that name is registered.
    pub fn with_default(mut self, name: &str) -> Result<Self, UnknownBot> {
        self.get(Some(name))?;
        name.clone_into(&mut self.default);
        Ok(self)
    }

    /// The bot named `name` (the default for `None` or an empty name), with its name.
    ///
    /// # Errors
    /// [`UnknownBot`] when no bot of that name is hosted.
    pub fn get(&self, name: Option<&str>) -> Result<(&str, &Arc<dyn Bot>), UnknownBot> {
        let name = match name {
            None | Some("") => self.default.as_str(),
            Some(name) => name,
        };
        self.bots
            .get_key_value(name)
            .map(|(k, v)| (k.as_str(), v))
            .ok_or_else(|| UnknownBot {
                name: name.to_owned(),
                hosted: self.names().collect::<Vec<_>>().join(", "),
            })
    }

    /// The names of the hosted bots, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        let mut names: Vec<&str> = self.bots.keys().map(String::as_str).collect();
        names.sort_unstable();
        names.into_iter()
    }

    /// The default bot's name.
    pub fn default_name(&self) -> &str {
        &self.default
    }
}

impl fmt::Debug for BotRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BotRegistry")
            .field("bots", &self.names().collect::<Vec<_>>())
            .field("default", &self.default)
            .field("serialized", &self.serialized)
            .field("double_text", &self.double_text)
            .finish()
    }
}
