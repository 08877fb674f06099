//! The engine's own tests: the turn loop against stores that fail on purpose (a lost commit,
//! a conflict every time, a lock that never comes), and what its spans record.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use super::*;
use crate::activity::{ChannelAccount, ConversationAccount};
use crate::bot::{Bot, Scopes, TurnContext};
use crate::state::TurnKeys;
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
    /// Nothing goes wrong: the store only records what it was asked to load.
    None,
}

/// A memory store with one [`Fault`], recording the keys of every load.
struct Faulty {
    inner: MemoryStore,
    fault: Fault,
    loaded: std::sync::Mutex<Vec<Vec<String>>>,
}

impl Faulty {
    fn new(fault: Fault) -> Self {
        Self {
            inner: MemoryStore::new(),
            fault,
            loaded: std::sync::Mutex::default(),
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
        self.loaded
            .lock()
            .expect("not poisoned")
            .push(keys.iter().map(|k| k.as_str().to_owned()).collect());
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
            Fault::LockAlwaysHeld | Fault::None => self.inner.commit(commit).await,
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
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(spans.clone()))
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
async fn a_bot_has_only_the_scopes_it_declares_and_its_turns_load_only_those() {
    /// Keeps a note in every scope it has, and says which it was refused.
    struct Noting(Scopes);
    #[async_trait]
    impl Bot for Noting {
        async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
            turn.conversation_state().set("seen", &true)?;
            let mut refused = Vec::new();
            match turn.user_state() {
                Ok(user) => user.set("seen", &true)?,
                Err(e) => refused.push(e.to_string()),
            }
            match turn.private_conversation_state() {
                Ok(private) => private.set("seen", &true)?,
                Err(e) => refused.push(e.to_string()),
            }
            turn.send_text(refused.join("; "));
            Ok(())
        }
        fn scopes(&self) -> Scopes {
            self.0
        }
    }
    let cases = [
        (Scopes::ALL, 3, ""),
        (
            Scopes::CONVERSATION,
            1,
            "user state is not available: the bot's scopes leave it out (`Bot::scopes`, \
             `--bot-scopes`); private conversation state is not available: the bot's scopes \
             leave it out (`Bot::scopes`, `--bot-scopes`)",
        ),
        (
            Scopes {
                user: true,
                private_conversation: false,
            },
            2,
            "private conversation state is not available: the bot's scopes leave it out \
             (`Bot::scopes`, `--bot-scopes`)",
        ),
    ];
    for (scopes, keys, refused) in cases {
        let store = Arc::new(Faulty::new(Fault::None));
        let engine = Engine::new(
            uncached(Arc::clone(&store) as Arc<dyn Store>),
            BotRegistry::new("noting", Noting(scopes)),
            RetryPolicy::default(),
        );
        let outcome = engine
            .run_turn(None, &incoming("hi"), None)
            .await
            .expect("committed");
        assert_eq!(outcome.activities[0].text.as_deref(), Some(refused));
        let loaded = store.loaded.lock().expect("not poisoned").clone();
        assert_eq!(loaded.len(), 1, "{loaded:?}");
        assert_eq!(loaded[0].len(), keys, "{scopes:?}: {loaded:?}");
        assert!(loaded[0][0].contains("/conversations/c1"), "{loaded:?}");
        // What was written is what the bot had, and nothing of the scopes it did not declare.
        let every: Vec<StateKey> = TurnKeys::new("noting", incoming("hi").address())
            .all()
            .map(|(_, k)| k.clone())
            .collect();
        let written = store.inner.load(&every, None).await.expect("loaded");
        let kept = every.iter().filter(|k| written.get(k).is_some()).count();
        assert_eq!(kept, keys, "{scopes:?}");
    }
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
        matches!(result, Err(TurnError::ConversationHeld { attempts: 0, .. })),
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
