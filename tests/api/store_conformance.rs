//! One conformance suite for every store: the memory store and PostgreSQL must keep the same
//! optimistic-concurrency contract, case by case. Each case is a test of its own on each store,
//! `store_conformance::on_<store>::<case>`, so that a failure names both.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;

use serde_json::json;
use turnstile::activity::JsonMap;
use turnstile::activity::incoming::{ChannelId, ConversationId, UserId};
use turnstile::state::StateKey;
use turnstile::store::memory::MemoryStore;
use turnstile::store::postgres::{self, DatabaseUrl, PostgresStore, Statements};
use turnstile::store::{
    Commit, CommitOutcome, ConversationLock, Erasure, Expected, KeyChange, Receipt, StateWrite,
    Store, Version, Versions,
};

fn conversation(id: &str) -> StateKey {
    StateKey::conversation(
        "bot",
        &ChannelId::parse("test", "channel_id").unwrap(),
        &ConversationId::parse(id, "conversation.id").unwrap(),
    )
}

fn user(id: &str) -> StateKey {
    StateKey::user(
        "bot",
        &ChannelId::parse("test", "channel_id").unwrap(),
        &UserId::parse(id, "from.id").unwrap(),
    )
}

fn state(value: serde_json::Value) -> JsonMap {
    match value {
        serde_json::Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

fn write(key: &StateKey, expected: Expected, value: serde_json::Value) -> KeyChange {
    KeyChange {
        key: key.clone(),
        expected,
        write: Some(state(value).into()),
    }
}

fn check(key: &StateKey, expected: Expected) -> KeyChange {
    KeyChange {
        key: key.clone(),
        expected,
        write: None,
    }
}

async fn commit(store: &dyn Store, changes: Vec<KeyChange>) -> CommitOutcome {
    store.commit(Commit::new(changes)).await.unwrap()
}

fn committed(outcome: CommitOutcome) -> Versions {
    match outcome {
        CommitOutcome::Committed(versions) => versions,
        CommitOutcome::Conflict { key } => panic!("unexpected conflict on {key}"),
    }
}

fn conflict(outcome: CommitOutcome) -> StateKey {
    match outcome {
        CommitOutcome::Conflict { key } => key,
        CommitOutcome::Committed(v) => panic!("expected a conflict, committed {v:?}"),
    }
}

async fn version_of(store: &dyn Store, key: &StateKey) -> Option<(JsonMap, Version)> {
    let snapshot = store.load(std::slice::from_ref(key), None).await.unwrap();
    snapshot
        .get(key)
        .map(|row| (JsonMap::clone(&row.state), row.version))
}

/// Versions and conflicts: create-if-absent, updates at the version read, keys only checked, all
/// keys of a commit or none, loads of several keys, and JSON as written.
async fn versions_and_conflicts(store: Arc<dyn Store>) {
    let store = store.as_ref();
    let a = conversation("a");
    let b = user("b");

    // A key never written loads as absent.
    assert_eq!(version_of(store, &a).await, None);

    // Create-if-absent: version 1.
    let versions =
        committed(commit(store, vec![write(&a, Expected::Absent, json!({"n": 1}))]).await);
    assert_eq!(versions[&a], Version::FIRST);
    assert_eq!(
        version_of(store, &a).await,
        Some((state(json!({"n": 1})), Version::FIRST))
    );

    // Creating it again is a conflict, not an overwrite.
    assert_eq!(
        conflict(commit(store, vec![write(&a, Expected::Absent, json!({"n": 9}))]).await),
        a
    );
    assert_eq!(
        version_of(store, &a).await.unwrap().0,
        state(json!({"n": 1}))
    );

    // An update at the version read bumps it; at a stale version it is a conflict.
    let v2 = committed(
        commit(
            store,
            vec![write(
                &a,
                Expected::Version(Version::FIRST),
                json!({"n": 2}),
            )],
        )
        .await,
    );
    assert_eq!(v2[&a], Version::new(2));
    assert_eq!(
        conflict(
            commit(
                store,
                vec![write(
                    &a,
                    Expected::Version(Version::FIRST),
                    json!({"n": 3})
                )]
            )
            .await
        ),
        a
    );
    assert_eq!(
        version_of(store, &a).await.unwrap(),
        (state(json!({"n": 2})), Version::new(2))
    );

    // Updating a key that does not exist is a conflict.
    let ghost = conversation("ghost");
    conflict(
        commit(
            store,
            vec![write(&ghost, Expected::Version(Version::FIRST), json!({}))],
        )
        .await,
    );
    assert_eq!(version_of(store, &ghost).await, None);

    // All keys of a commit apply together or not at all: a stale second key stops the first.
    let outcome = commit(
        store,
        vec![
            write(&a, Expected::Version(Version::new(2)), json!({"n": 3})),
            write(&b, Expected::Version(Version::new(7)), json!({"x": true})),
        ],
    )
    .await;
    assert_eq!(conflict(outcome), b);
    assert_eq!(
        version_of(store, &a).await.unwrap().1,
        Version::new(2),
        "a was not applied"
    );
    assert_eq!(version_of(store, &b).await, None);

    // And a conflicting create stops an update in the same commit.
    committed(commit(store, vec![write(&b, Expected::Absent, json!({"x": 1}))]).await);
    let outcome = commit(
        store,
        vec![
            write(&a, Expected::Version(Version::new(2)), json!({"n": 3})),
            write(&b, Expected::Absent, json!({"x": 2})),
        ],
    )
    .await;
    assert_eq!(conflict(outcome), b);
    assert_eq!(version_of(store, &a).await.unwrap().1, Version::new(2));

    // Keys only read are checked: a moved read key stops the write.
    let outcome = commit(
        store,
        vec![
            write(&a, Expected::Version(Version::new(2)), json!({"n": 3})),
            check(&b, Expected::Version(Version::new(5))),
        ],
    )
    .await;
    assert_eq!(conflict(outcome), b);
    let outcome = commit(
        store,
        vec![
            write(&a, Expected::Version(Version::new(2)), json!({"n": 3})),
            check(&b, Expected::Version(Version::FIRST)),
            check(&ghost, Expected::Absent),
        ],
    )
    .await;
    let versions = committed(outcome);
    assert_eq!(versions[&a], Version::new(3));
    assert_eq!(
        versions[&b],
        Version::FIRST,
        "a checked key keeps its version"
    );
    assert!(
        !versions.contains_key(&ghost),
        "a key checked absent has no version"
    );
    assert_eq!(version_of(store, &b).await.unwrap().1, Version::FIRST);

    // One load reads several keys at once, absent ones left out.
    let snapshot = store
        .load(&[a.clone(), b.clone(), ghost.clone()], None)
        .await
        .unwrap();
    assert_eq!(snapshot.get(&a).unwrap().version, Version::new(3));
    assert_eq!(snapshot.get(&b).unwrap().version, Version::FIRST);
    assert!(snapshot.get(&ghost).is_none());

    // A load of more keys than a turn's three scopes reads every one of them.
    let (c, d) = (conversation("wide-1"), conversation("wide-2"));
    committed(
        commit(
            store,
            vec![
                write(&c, Expected::Absent, json!({"n": 1})),
                write(&d, Expected::Absent, json!({"n": 1})),
            ],
        )
        .await,
    );
    let snapshot = store
        .load(
            &[a.clone(), b.clone(), ghost.clone(), c.clone(), d.clone()],
            None,
        )
        .await
        .unwrap();
    assert_eq!(snapshot.get(&a).unwrap().version, Version::new(3));
    assert_eq!(snapshot.get(&b).unwrap().version, Version::FIRST);
    assert!(snapshot.get(&ghost).is_none());
    assert_eq!(snapshot.get(&c).unwrap().version, Version::FIRST);
    assert_eq!(snapshot.get(&d).unwrap().version, Version::FIRST);

    // JSON survives as written: nesting, unicode, numbers.
    let rich = json!({"order": ["mushroom", "cheese"], "who": {"name": "Zoë"}, "n": -1.5});
    committed(
        commit(
            store,
            vec![write(&a, Expected::Version(Version::new(3)), rich.clone())],
        )
        .await,
    );
    assert_eq!(version_of(store, &a).await.unwrap().0, state(rich));
}

/// Runs 16 commits at once, commit i built by `changes(i)`; returns how many committed.
async fn winners(store: &Arc<dyn Store>, changes: impl Fn(usize) -> Vec<KeyChange>) -> usize {
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let store = Arc::clone(store);
            let commit = Commit::new(changes(i));
            tokio::spawn(async move {
                let outcome = store.commit(commit).await.unwrap();
                matches!(outcome, CommitOutcome::Committed(_))
            })
        })
        .collect();
    let mut winners = 0;
    for t in tasks {
        winners += usize::from(t.await.unwrap());
    }
    winners
}

/// Many writers race on one key from the same starting point: exactly one wins, whether they
/// all create it or all update it, and a loser's other keys are not applied either.
async fn exactly_one_concurrent_writer_wins(store: Arc<dyn Store>) {
    let key = conversation("race");
    let created = winners(&store, |i| {
        vec![
            write(&key, Expected::Absent, json!({"creator": i})),
            write(&user(&format!("side{i}")), Expected::Absent, json!({})),
        ]
    })
    .await;
    assert_eq!(created, 1, "one create wins");
    let mut sides = 0;
    for i in 0..16 {
        sides += usize::from(
            version_of(store.as_ref(), &user(&format!("side{i}")))
                .await
                .is_some(),
        );
    }
    assert_eq!(sides, 1, "only the winner's other key was created");

    let updated = winners(&store, |i| {
        vec![write(
            &key,
            Expected::Version(Version::FIRST),
            json!({"winner": i}),
        )]
    })
    .await;
    assert_eq!(updated, 1, "one update wins");
    assert_eq!(
        version_of(store.as_ref(), &key).await.unwrap().1,
        Version::new(2)
    );
}

/// Two commits over the same two keys in either order never deadlock: keys are locked sorted.
async fn crossing_commits_do_not_deadlock(store: Arc<dyn Store>) {
    let a = conversation("cross-a");
    let b = conversation("cross-b");
    committed(
        commit(
            store.as_ref(),
            vec![
                write(&a, Expected::Absent, json!({})),
                write(&b, Expected::Absent, json!({})),
            ],
        )
        .await,
    );
    let mut tasks = Vec::new();
    for i in 0..20 {
        let store = Arc::clone(&store);
        let (first, second) = if i % 2 == 0 {
            (a.clone(), b.clone())
        } else {
            (b.clone(), a.clone())
        };
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let snapshot = store
                    .load(&[first.clone(), second.clone()], None)
                    .await
                    .unwrap();
                let changes = vec![
                    write(&first, snapshot.precondition(&first), json!({"by": i})),
                    write(&second, snapshot.precondition(&second), json!({"by": i})),
                ];
                let _ = store.commit(Commit::new(changes)).await.unwrap();
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(60), all)
        .await
        .expect("crossing commits finished");
    let va = version_of(store.as_ref(), &a).await.unwrap();
    let vb = version_of(store.as_ref(), &b).await.unwrap();
    assert_eq!(va.1, vb.1, "every commit moved both keys together");
    assert_eq!(va.0, vb.0, "and left the same writer's state in both");
}

fn receipt(id: &str) -> StateKey {
    StateKey::receipt(
        "bot",
        &ChannelId::parse("test", "channel_id").unwrap(),
        &ConversationId::parse("r", "conversation.id").unwrap(),
        &turnstile::activity::incoming::ActivityId::parse(id, "id").unwrap(),
    )
}

/// Receipts: stored with their commit, read back by a load that asks, never created twice, and
/// pruned by age.
async fn receipts(store: Arc<dyn Store>) {
    let store = store.as_ref();
    let state_key = conversation("r");
    let first = receipt("act-1");
    let payload = Receipt::from(json!({"activities": [{"type": "message", "text": "count: 1"}]}));

    let snapshot = store
        .load(std::slice::from_ref(&state_key), Some(&first))
        .await
        .unwrap();
    assert!(snapshot.receipt().is_none());
    let commit_1 = Commit::new(vec![write(
        &state_key,
        Expected::Absent,
        json!({"count": 1}),
    )])
    .with_receipt(first.clone(), payload.clone());
    committed(store.commit(commit_1).await.unwrap());

    let snapshot = store
        .load(std::slice::from_ref(&state_key), Some(&first))
        .await
        .unwrap();
    assert_eq!(
        snapshot.receipt(),
        Some(&payload),
        "the receipt comes with the state"
    );
    assert_eq!(snapshot.get(&state_key).unwrap().version, Version::FIRST);
    let without = store
        .load(std::slice::from_ref(&state_key), None)
        .await
        .unwrap();
    assert!(without.receipt().is_none(), "only when asked for");

    // The same activity again, even at the right version, conflicts on its receipt and applies
    // nothing.
    let again = Commit::new(vec![write(
        &state_key,
        Expected::Version(Version::FIRST),
        json!({"count": 2}),
    )])
    .with_receipt(first.clone(), json!({"other": true}));
    assert_eq!(conflict(store.commit(again).await.unwrap()), first);
    let snapshot = store
        .load(std::slice::from_ref(&state_key), Some(&first))
        .await
        .unwrap();
    assert_eq!(snapshot.get(&state_key).unwrap().version, Version::FIRST);
    assert_eq!(snapshot.receipt(), Some(&payload));

    // A write that conflicts leaves no receipt behind, whether it updates a key that moved or
    // creates one that exists: a receipt would answer the activity's redelivery as if committed.
    let stale = receipt("act-stale");
    for expected in [Expected::Version(Version::new(7)), Expected::Absent] {
        let lost = Commit::new(vec![write(&state_key, expected, json!({"count": 9}))])
            .with_receipt(stale.clone(), json!({"lost": true}));
        assert_eq!(conflict(store.commit(lost).await.unwrap()), state_key);
        let snapshot = store
            .load(std::slice::from_ref(&state_key), Some(&stale))
            .await
            .unwrap();
        assert!(snapshot.receipt().is_none(), "{expected:?}: no receipt");
        assert_eq!(snapshot.get(&state_key).unwrap().version, Version::FIRST);
    }

    // A receipt alone (a read-only turn) commits too.
    let read_only = Commit::new(vec![check(&state_key, Expected::Version(Version::FIRST))])
        .with_receipt(receipt("act-2"), json!({"activities": []}));
    committed(store.commit(read_only).await.unwrap());

    // Pruning keeps young receipts and removes old ones.
    assert_eq!(
        store
            .prune_receipts(std::time::Duration::from_secs(3600))
            .await
            .unwrap(),
        0
    );
    // A store may keep receipts somewhat past the retention (PostgreSQL empties a slot of them
    // at once, `store::postgres::receipts`), but not for ever: repeated passes remove both.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut pruned = 0;
    let snapshot = loop {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        pruned += store
            .prune_receipts(std::time::Duration::from_millis(10))
            .await
            .unwrap();
        let snapshot = store
            .load(std::slice::from_ref(&state_key), Some(&first))
            .await
            .unwrap();
        if snapshot.receipt().is_none() || std::time::Instant::now() > deadline {
            break snapshot;
        }
    };
    assert!(snapshot.receipt().is_none(), "still there after 20 s");
    assert_eq!(pruned, 2);
    assert_eq!(
        snapshot.get(&state_key).unwrap().version,
        Version::FIRST,
        "state is never pruned"
    );
}

/// Sixteen deliveries of one activity commit at once, each on its own fresh key: exactly one
/// receipt and one key result.
async fn one_receipt_per_activity_under_concurrency(store: Arc<dyn Store>) {
    let key = receipt("dup");
    let created = winners(&store, |i| {
        vec![write(
            &conversation(&format!("dup{i}")),
            Expected::Absent,
            json!({}),
        )]
    })
    .await;
    assert_eq!(created, 16, "different keys, no receipts: all commit");
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let store = Arc::clone(&store);
            let commit = Commit::new(vec![write(
                &user(&format!("dup{i}")),
                Expected::Absent,
                json!({}),
            )])
            .with_receipt(key.clone(), json!({"by": i}));
            tokio::spawn(async move {
                matches!(
                    store.commit(commit).await.unwrap(),
                    CommitOutcome::Committed(_)
                )
            })
        })
        .collect();
    let mut won = 0;
    for t in tasks {
        won += usize::from(t.await.unwrap());
    }
    assert_eq!(won, 1, "one delivery commits its receipt");
    let mut applied = 0;
    for i in 0..16 {
        applied += usize::from(
            version_of(store.as_ref(), &user(&format!("dup{i}")))
                .await
                .is_some(),
        );
    }
    assert_eq!(applied, 1, "the losers' state was not applied");
}

/// What an operator sees: rows as stored with when they were written, a conversation's
/// receipts newest first, and the conversations under a prefix a page at a time — and neither
/// holds nor other scopes among them.
async fn inspection(store: Arc<dyn Store>) {
    let store = store.as_ref();
    let before = std::time::SystemTime::now() - std::time::Duration::from_secs(5);
    for id in ["c1", "c2", "c3", "d1"] {
        committed(
            commit(
                store,
                vec![write(&conversation(id), Expected::Absent, json!({"n": id}))],
            )
            .await,
        );
    }
    committed(
        commit(
            store,
            vec![write(
                &user("ada"),
                Expected::Absent,
                json!({"name": "Ada"}),
            )],
        )
        .await,
    );
    for id in ["act-1", "act-2"] {
        let payload = Receipt::from(json!({"activities": [], "id": id}));
        let change = write(
            &conversation(&format!("r-{id}")),
            Expected::Absent,
            json!({}),
        );
        let outcome = store
            .commit(Commit::new(vec![change]).with_receipt(receipt(id), payload))
            .await
            .unwrap();
        committed(outcome);
        // Distinct times, for the order.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }

    let seen = store
        .inspect(
            &[conversation("c1"), user("ada"), conversation("nobody")],
            &format!("{}/activities/", conversation("r").as_str()),
            10,
        )
        .await
        .unwrap();
    let keys: Vec<&str> = seen.rows.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, [conversation("c1").as_str(), user("ada").as_str()]);
    assert_eq!(seen.rows[0].row.state.get("n"), Some(&json!("c1")));
    assert!(
        seen.rows
            .iter()
            .all(|r| r.updated_at.is_some_and(|t| t > before))
    );
    let receipts: Vec<&str> = seen.receipts.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(
        receipts,
        [receipt("act-2").as_str(), receipt("act-1").as_str()]
    );
    let one = store
        .inspect(
            &[],
            &format!("{}/activities/", conversation("r").as_str()),
            1,
        )
        .await
        .unwrap();
    assert_eq!(one.receipts.len(), 1);

    // Conversations of the bot on the channel starting with `c`, two to a page.
    let prefix = conversation("c").as_str().to_owned();
    let first = store.list_conversations(&prefix, None, 2).await.unwrap();
    let listed: Vec<&str> = first.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(
        listed,
        [conversation("c1").as_str(), conversation("c2").as_str()]
    );
    let next = store
        .list_conversations(&prefix, Some(listed[1]), 2)
        .await
        .unwrap();
    let listed: Vec<&str> = next.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(listed, [conversation("c3").as_str()]);
    let all = store
        .list_conversations("bot/test/conversations/", None, 100)
        .await
        .unwrap();
    assert!(all.iter().all(|r| r.key.is_conversation()), "{all:?}");
    assert_eq!(
        all.len(),
        6,
        "c1-3, d1 and the two receipts' conversations: {all:?}"
    );
}

fn private(conversation_id: &str, user_id: &str) -> StateKey {
    StateKey::private_conversation(
        "bot",
        &ChannelId::parse("test", "channel_id").unwrap(),
        &ConversationId::parse(conversation_id, "conversation.id").unwrap(),
        &UserId::parse(user_id, "from.id").unwrap(),
    )
}

fn other_bots_user(id: &str) -> StateKey {
    StateKey::user(
        "other",
        &ChannelId::parse("test", "channel_id").unwrap(),
        &UserId::parse(id, "from.id").unwrap(),
    )
}

fn receipt_in(conversation_id: &str, id: &str) -> StateKey {
    StateKey::receipt(
        "bot",
        &ChannelId::parse("test", "channel_id").unwrap(),
        &ConversationId::parse(conversation_id, "conversation.id").unwrap(),
        &turnstile::activity::incoming::ActivityId::parse(id, "id").unwrap(),
    )
}

/// Erasure: a user's rows (every bot's user scope, their private scopes) or a conversation's
/// (its scope, private scopes and hold) go with their receipts, and come back only above the
/// versions they had: a turn that read them cannot commit them back.
async fn erasure(store: Arc<dyn Store>) {
    let store = store.as_ref();
    let (ann, bob) = (user("ann"), user("bob"));
    let anns_elsewhere = other_bots_user("ann");
    let anns_private = private("c1", "ann");
    let c1 = conversation("c1");
    let hold = StateKey::hold(&c1);
    for key in [&ann, &bob, &anns_elsewhere, &anns_private, &c1, &hold] {
        committed(
            commit(
                store,
                vec![write(key, Expected::Absent, json!({"who": "ann"}))],
            )
            .await,
        );
    }
    // Ann's user scope reaches version 3.
    for v in 1..3 {
        committed(
            commit(
                store,
                vec![write(
                    &ann,
                    Expected::Version(Version::new(v)),
                    json!({"v": v}),
                )],
            )
            .await,
        );
    }
    let answered = |user: &str| Receipt::from(json!({"activities": [], "user": user}));
    let (r1, r2, r3) = (
        receipt_in("c1", "a1"),
        receipt_in("c1", "b1"),
        receipt_in("c2", "a2"),
    );
    for (key, who) in [(&r1, "test/ann"), (&r2, "test/bob"), (&r3, "test/ann")] {
        let c2 = conversation(&format!("for-{key}"));
        store
            .commit(
                Commit::new(vec![write(&c2, Expected::Absent, json!({}))])
                    .with_receipt(key.clone(), answered(who)),
            )
            .await
            .unwrap();
    }

    // A user nobody knows: nothing removed, and that is an answer, not an error.
    let none = store
        .erase(&Erasure::User("test/nobody".into()))
        .await
        .unwrap();
    assert_eq!((none.rows.len(), none.receipts), (0, 0));
    assert!(none.at.is_some());

    let erased = store
        .erase(&Erasure::User("test/ann".into()))
        .await
        .unwrap();
    let mut expected = vec![
        (ann.clone(), Version::new(3)),
        (anns_elsewhere.clone(), Version::FIRST),
        (anns_private.clone(), Version::FIRST),
    ];
    expected.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(erased.rows, expected);
    let expected: Vec<StateKey> = expected.into_iter().map(|(key, _)| key).collect();
    assert_eq!(
        erased.receipts, 2,
        "both of Ann's receipts, in two conversations"
    );
    for key in &expected {
        assert_eq!(version_of(store, key).await, None, "{key} erased");
    }
    assert!(version_of(store, &bob).await.is_some(), "Bob's scope stays");
    assert!(
        version_of(store, &c1).await.is_some(),
        "the conversation stays"
    );
    let loaded = store
        .load(&[ann.clone(), bob.clone()], Some(&r2))
        .await
        .unwrap();
    assert!(loaded.receipt().is_some(), "Bob's receipt stays");
    assert!(
        store
            .load(&[], Some(&r1))
            .await
            .unwrap()
            .receipt()
            .is_none()
    );

    // A turn that read Ann's scope before the erasure cannot write it back, alone or with
    // another key, nor create it as though it had never existed.
    let stale = json!({"v": "resurrected"});
    conflict(
        commit(
            store,
            vec![write(
                &ann,
                Expected::Version(Version::new(3)),
                stale.clone(),
            )],
        )
        .await,
    );
    conflict(
        commit(
            store,
            vec![
                write(&ann, Expected::Version(Version::new(3)), stale.clone()),
                write(&bob, Expected::Version(Version::FIRST), json!({})),
            ],
        )
        .await,
    );
    conflict(commit(store, vec![write(&ann, Expected::Absent, stale.clone())]).await);
    conflict(commit(store, vec![check(&ann, Expected::Version(Version::new(3)))]).await);
    assert_eq!(version_of(store, &ann).await, None);

    // The replay finds it gone at 3, and creates it at 4: above every version a turn saw.
    let snapshot = store.load(std::slice::from_ref(&ann), None).await.unwrap();
    assert_eq!(snapshot.precondition(&ann), Expected::Gone(Version::new(3)));
    // So does a turn loading under its conversation's lock (a store serving one replica needs
    // none), beside a key that has its row.
    let under_lock = [c1.clone(), ann.clone()];
    let wait = std::time::Duration::from_secs(5);
    match store.lock_conversation(&c1, &under_lock, None, wait).await {
        Ok(ConversationLock::Held { snapshot, turn }) => {
            assert_eq!(snapshot.precondition(&ann), Expected::Gone(Version::new(3)));
            assert_eq!(
                snapshot.precondition(&c1),
                Expected::Version(Version::FIRST)
            );
            turn.release().await;
        }
        Ok(ConversationLock::NotNeeded) => {}
        other => panic!("the conversation's lock: {other:?}"),
    }
    let versions = committed(
        commit(
            store,
            vec![write(
                &ann,
                Expected::Gone(Version::new(3)),
                json!({"new": true}),
            )],
        )
        .await,
    );
    assert_eq!(versions.get(&ann), Some(&Version::new(4)));
    assert_eq!(
        store
            .load(std::slice::from_ref(&ann), None)
            .await
            .unwrap()
            .precondition(&ann),
        Expected::Version(Version::new(4)),
        "a key created again is no longer gone"
    );
    // Erased again at 4: a create that saw it gone at 3 is stale.
    store
        .erase(&Erasure::User("test/ann".into()))
        .await
        .unwrap();
    conflict(
        commit(
            store,
            vec![write(&ann, Expected::Gone(Version::new(3)), json!({}))],
        )
        .await,
    );
    // Checked for absence, a gone key is as absent as any.
    committed(commit(store, vec![check(&ann, Expected::Gone(Version::new(4)))]).await);

    // A conversation: its scope, private scopes, hold and receipts, for every bot.
    let deleted = store
        .erase(&Erasure::Conversation("test/c1".into()))
        .await
        .unwrap();
    let mut expected = vec![c1.clone(), hold.clone()];
    expected.sort();
    let keys: Vec<StateKey> = deleted.rows.iter().map(|(key, _)| key.clone()).collect();
    assert_eq!(keys, expected, "Ann's private scope there went with Ann");
    assert_eq!(
        deleted.receipts, 1,
        "Bob's receipt in c1 (Ann's went with her)"
    );
    assert_eq!(version_of(store, &c1).await, None);
    assert!(
        version_of(store, &bob).await.is_some(),
        "a user scope is no conversation's"
    );
}

/// The suite's cases, each a test of its own on a store of its own from `$store` (an expression a
/// test may `return` from), and `expiry` on one from `$expiring`.
macro_rules! cases_on {
    (@each $store:expr => $($case:ident),+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                super::$case($store).await;
            }
        )+
    };
    ($store:expr $(, expiring: $expiring:expr)?) => {
        cases_on!(@each $store => versions_and_conflicts, exactly_one_concurrent_writer_wins,
            crossing_commits_do_not_deadlock, receipts, one_receipt_per_activity_under_concurrency,
            inspection, erasure);
        $(cases_on!(@each $expiring => expiry);)?
    };
}

/// The suite on the memory store: `store_conformance::on_memory::<case>`.
mod on_memory {
    cases_on!(
        std::sync::Arc::new(super::MemoryStore::new()),
        expiring: std::sync::Arc::new(super::MemoryStore::new().with_ttls(super::conversation_ttl()))
    );
}

/// A store over a fresh database, migrated.
async fn postgres_store() -> Arc<dyn Store> {
    let url = DatabaseUrl::new(support::pg::fresh_database().await);
    postgres::migrate(&url).await.unwrap();
    Arc::new(PostgresStore::connect(&url, 8).unwrap())
}

/// The suite on PostgreSQL: `store_conformance::on_postgres::<case>`.
mod on_postgres {
    cases_on!(
        super::postgres_store().await,
        expiring: super::expiring_store(&crate::support::pg::fresh_database().await).await
    );
}

/// The store as it runs behind a transaction-mode pooler: every statement unnamed, typed here.
async fn unprepared_postgres_store() -> Arc<dyn Store> {
    let url = DatabaseUrl::new(support::pg::fresh_database().await);
    postgres::migrate(&url).await.unwrap();
    Arc::new(PostgresStore::connect_with(&url, 8, Statements::Unprepared).unwrap())
}

/// The suite on PostgreSQL without prepared statements:
/// `store_conformance::on_postgres_unprepared::<case>`.
mod on_postgres_unprepared {
    cases_on!(super::unprepared_postgres_store().await);
}

/// A store over a database of the shared Citus cluster (a coordinator and 2 workers), laid out for
/// Citus by `migrate`; `None` where Citus is not installed (`support::citus::installed`).
async fn citus_store() -> Option<Arc<dyn Store>> {
    if !support::citus::installed() {
        return None;
    }
    let url = DatabaseUrl::new(support::citus::shared().fresh_database().await);
    let (_, citus) = postgres::migrate_with(&url, postgres::CitusLayout::Required)
        .await
        .unwrap();
    assert_eq!(citus, postgres::Citus::Distributed);
    Some(Arc::new(PostgresStore::connect(&url, 8).unwrap()))
}

/// The same contract on Citus, the tables distributed over two workers, each statement asking the
/// shards of its keys: `store_conformance::on_citus::<case>`.
mod on_citus {
    cases_on!(
        {
            let Some(store) = super::citus_store().await else {
                return;
            };
            store
        },
        expiring: {
            if !crate::support::citus::installed() {
                return;
            }
            super::expiring_store(&crate::support::citus::shared().fresh_database().await).await
        }
    );
}

#[tokio::test]
async fn migrations_are_idempotent_and_safe_when_replicas_start_together() {
    let url = DatabaseUrl::new(support::pg::fresh_database().await);
    let runs = futures::future::join_all((0..4).map(|_| postgres::migrate(&url))).await;
    let applied: Vec<usize> = runs.into_iter().map(Result::unwrap).collect();
    let migrations = std::fs::read_dir("migrations").unwrap().count();
    assert_eq!(
        applied.iter().filter(|&&n| n > 0).collect::<Vec<_>>(),
        [&migrations],
        "one replica applied every migration: {applied:?}"
    );
    assert_eq!(postgres::migrate(&url).await.unwrap(), 0);
}

/// A replica that starts while another migrates waits for that migration however long it takes,
/// and then migrates, both past its session's `statement_timeout`, which bounds turns. On a busy
/// Citus cluster a migration outlasts the timeout: a replica waiting for it in one
/// `pg_advisory_lock` statement stopped, cancelled, and so did a migration's longest statement.
#[tokio::test]
async fn a_replica_waits_for_another_replicas_migration_and_migrates_past_the_statement_timeout() {
    let url = support::pg::fresh_database().await;
    let holder = support::pg::session(&url).await;
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&postgres::MIGRATION_LOCK])
        .await
        .unwrap();
    // Every statement of the waiting replica's session is cancelled after 100 ms.
    let separator = if url.contains('?') { '&' } else { '?' };
    let impatient = DatabaseUrl::new(format!(
        "{url}{separator}options=-c%20statement_timeout%3D100"
    ));
    let waiting = tokio::spawn(async move { postgres::migrate(&impatient).await });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(!waiting.is_finished(), "it did not wait for the lock");
    holder
        .execute(
            "SELECT pg_advisory_unlock($1)",
            &[&postgres::MIGRATION_LOCK],
        )
        .await
        .unwrap();
    let applied = waiting.await.unwrap().unwrap();
    assert_eq!(applied, std::fs::read_dir("migrations").unwrap().count());
}

/// A conversation's row stays on its page as its turns rewrite it: every update is HOT (no index
/// entry, no dead page left behind), also for the rows created first, on pages that inserts
/// filled. At the default fillfactor the first update on a full page moved its row elsewhere.
#[tokio::test]
async fn turns_rewrite_a_conversations_row_in_place() {
    // A cluster of its own: a page's old versions are pruned only once no session could still
    // see them. On the shared cluster, beside the other tests' sessions, CI saw no page make room
    // in time and every row move.
    let cluster = support::pg::Cluster::start();
    let url = support::pg::fresh_database_in(&cluster).await;
    let db_url = DatabaseUrl::new(url.clone());
    postgres::migrate(&db_url).await.unwrap();
    let store = PostgresStore::connect(&db_url, 4).unwrap();
    let client = support::pg::session(&url).await;
    let page_of = async |key: &StateKey| -> String {
        let row = client
            .query_one(
                "SELECT split_part(ctid::text, ',', 1) FROM turnstile_state WHERE key = $1",
                &[&key.as_str()],
            )
            .await
            .unwrap();
        row.get(0)
    };
    let pad = ".".repeat(1024);
    let keys: Vec<StateKey> = (0..40).map(|i| conversation(&format!("c{i}"))).collect();
    // Round 0 creates each row; rounds 1 to 3 rewrite it over the version the one before made.
    let mut pages = Vec::new();
    for round in 0..=3u64 {
        let expected = match round {
            0 => Expected::Absent,
            _ => Expected::Version(Version::new(round)),
        };
        for key in &keys {
            let state = json!({"count": round, "pad": pad});
            committed(commit(&store, vec![write(key, expected, state)]).await);
            if round == 0 {
                pages.push(page_of(key).await);
            }
        }
    }
    let mut moved = Vec::new();
    for (key, page) in keys.iter().zip(&pages) {
        if page_of(key).await != *page {
            moved.push(key.as_str().to_owned());
        }
    }
    assert!(
        moved.is_empty(),
        "rows moved to another page as their conversations were updated: {moved:?}"
    );
}

#[tokio::test]
async fn an_unreachable_database_is_unavailable_not_a_hang() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = DatabaseUrl::new(format!("postgres://postgres@127.0.0.1:{port}/none"));
    let store = PostgresStore::connect(&url, 2).unwrap();
    let err = store
        .load(&[conversation("a")], None)
        .await
        .expect_err("nothing listens there");
    assert!(
        matches!(err, turnstile::store::StoreError::Unavailable(_)),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_silent_database_is_unavailable_within_a_bound() {
    // A server that accepts connections and never says a word.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let url = DatabaseUrl::new(format!("postgres://postgres@127.0.0.1:{port}/silent"));
    let store = PostgresStore::connect(&url, 2).unwrap();
    let started = std::time::Instant::now();
    let err = store
        .load(&[conversation("a")], None)
        .await
        .expect_err("no answer");
    assert!(
        matches!(err, turnstile::store::StoreError::Unavailable(_)),
        "{err:?}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(15),
        "gave up after {:?}",
        started.elapsed()
    );
    held.abort();
}

/// Sends `signal` (`STOP`, `CONT`) to each of `pids`.
fn signal_all(signal: &str, pids: &[String]) {
    for pid in pids {
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid)
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {pid}");
    }
}

#[tokio::test]
async fn a_database_that_stops_answering_fails_every_commit_within_a_bound() {
    // A cluster of its own: its processes are stopped.
    let cluster = support::pg::Cluster::start();
    let url = DatabaseUrl::new(support::pg::fresh_database_in(&cluster).await);
    postgres::migrate(&url).await.unwrap();
    let store = Arc::new(PostgresStore::connect(&url, 2).unwrap());
    committed(
        commit(
            &*store,
            vec![write(&conversation("warm"), Expected::Absent, json!({}))],
        )
        .await,
    );

    // Connections stay open and nobody answers: the postmaster and every backend stopped.
    let client = support::pg::session(&cluster.url("postgres")).await;
    let mut pids: Vec<String> = client
        .query(
            "SELECT pid::text FROM pg_stat_activity WHERE backend_type = 'client backend'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let postmaster = std::fs::read_to_string(cluster.data_dir().join("postmaster.pid")).unwrap();
    pids.push(postmaster.lines().next().unwrap().trim().to_owned());
    signal_all("STOP", &pids);

    // More commits than the pool has connections: some go at once, the rest queue for the
    // committer, behind statements that never return.
    let started = std::time::Instant::now();
    let outcomes = futures::future::join_all((0..12).map(|i| {
        let store = Arc::clone(&store);
        async move {
            let key = conversation(&format!("q{i}"));
            store
                .commit(Commit::new(vec![write(
                    &key,
                    Expected::Absent,
                    json!({"n": i}),
                )]))
                .await
        }
    }))
    .await;
    let elapsed = started.elapsed();
    signal_all("CONT", &pids);

    for outcome in outcomes {
        assert!(
            matches!(outcome, Err(turnstile::store::StoreError::Unavailable(_))),
            "{outcome:?}"
        );
    }
    // Each is answered within the store's call timeout (10 s) of being queued, however long
    // the slots stay busy.
    assert!(
        elapsed < std::time::Duration::from_secs(15),
        "answered after {elapsed:?}"
    );
}

/// The receipt stored for activity `act`, if any.
async fn stored_receipt(store: &dyn Store, act: &str) -> Option<serde_json::Value> {
    stored_receipt_of(store, &receipt(act)).await
}

async fn stored_receipt_of(store: &dyn Store, key: &StateKey) -> Option<serde_json::Value> {
    let snapshot = store.load(&[], Some(key)).await.unwrap();
    snapshot
        .receipt()
        .map(|r| r.to_value().expect("a stored receipt is JSON"))
}

/// A store of 4 connections over a fresh database of the machine's PostgreSQL, or of the shared
/// Citus cluster's, migrated. A pool of 4 runs one batch at a time, so commits sent together
/// while it runs queue up.
async fn group_commit_store(on: Engine) -> PostgresStore {
    let url = match on {
        Engine::Single => support::pg::fresh_database().await,
        Engine::Citus => support::citus::shared().fresh_database().await,
    };
    let url = DatabaseUrl::new(url);
    postgres::migrate(&url).await.unwrap();
    PostgresStore::connect(&url, 4).unwrap()
}

/// PostgreSQL's group load: loads that arrive while others run are read by one statement, and
/// each still gets its own snapshot — its keys' rows (a key two loads share given to both), its
/// tombstones, its receipt and no other's — as a load alone would.
#[tokio::test]
async fn group_load_gives_each_load_its_own_snapshot() {
    let store = group_commit_store(Engine::Single).await;
    let convs: Vec<StateKey> = (0..10).map(|i| conversation(&format!("l{i}"))).collect();
    for (i, key) in convs.iter().enumerate() {
        committed(commit(&store, vec![write(key, Expected::Absent, json!({"n": i}))]).await);
    }
    let shared = user("shared");
    committed(
        commit(
            &store,
            vec![write(&shared, Expected::Absent, json!({"u": 1}))],
        )
        .await,
    );
    // l1's last turn answered activity `done`: version 2, with its receipt.
    let done = receipt_in("l1", "done");
    store
        .commit(
            Commit::new(vec![write(
                &convs[1],
                Expected::Version(Version::FIRST),
                json!({"n": 1, "again": true}),
            )])
            .with_receipt(
                done.clone(),
                Receipt::from(json!({"activities": [], "n": 1})),
            ),
        )
        .await
        .unwrap();
    // An erased user: a tombstone at version 1.
    let erased = user("erased");
    committed(commit(&store, vec![write(&erased, Expected::Absent, json!({}))]).await);
    store
        .erase(&Erasure::User("test/erased".into()))
        .await
        .unwrap();
    let before = store.group_load_stats();

    let mut loads: Vec<(Vec<StateKey>, Option<StateKey>)> = convs
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let receipt = match i {
                1 => done.clone(),
                _ => receipt_in(&format!("l{i}"), "new"),
            };
            (
                vec![
                    key.clone(),
                    shared.clone(),
                    private(&format!("l{i}"), "shared"),
                ],
                Some(receipt),
            )
        })
        .collect();
    loads.push((vec![conversation("nowhere"), erased.clone()], None));
    loads.push((vec![], Some(done.clone())));
    let snapshots = futures::future::join_all(
        loads
            .iter()
            .map(|(keys, receipt)| store.load(keys, receipt.as_ref())),
    )
    .await;
    let snapshots: Vec<_> = snapshots.into_iter().map(Result::unwrap).collect();

    let after = store.group_load_stats();
    assert_eq!(after.loads - before.loads, 12, "{before:?} -> {after:?}");
    assert!(
        after.largest >= 8,
        "the queued loads went together: {before:?} -> {after:?}"
    );
    // The first loads took the free slots and went alone; every load that found them all taken
    // waited for one and went with the others, as one statement.
    assert_eq!(
        after.statements - before.statements,
        postgres::LOADS_IN_FLIGHT as u64 + 1,
        "{before:?} -> {after:?}"
    );
    for (i, snapshot) in snapshots.iter().take(10).enumerate() {
        let own = snapshot.get(&convs[i]).expect("its conversation's row");
        let (n, version) = match i {
            1 => (json!({"n": 1, "again": true}), Version::new(2)),
            _ => (json!({"n": i}), Version::FIRST),
        };
        assert_eq!(
            serde_json::Value::Object((*own.state).clone()),
            n,
            "load {i}"
        );
        assert_eq!(own.version, version, "load {i}");
        let user = snapshot.get(&shared).expect("the user both share");
        assert_eq!(*user.state, state(json!({"u": 1})));
        for (j, other) in convs.iter().enumerate() {
            assert_eq!(snapshot.get(other).is_some(), i == j, "load {i} has l{j}");
        }
        assert!(snapshot.get(&private(&format!("l{i}"), "shared")).is_none());
        assert!(
            snapshot.gone().is_empty(),
            "load {i}: {:?}",
            snapshot.gone()
        );
        let receipt = snapshot.receipt().map(|r| r.to_value().unwrap());
        match i {
            1 => assert_eq!(receipt, Some(json!({"activities": [], "n": 1}))),
            _ => assert_eq!(receipt, None, "load {i} has another's receipt"),
        }
    }
    let lost = &snapshots[10];
    assert!(lost.get(&conversation("nowhere")).is_none() && lost.get(&erased).is_none());
    assert_eq!(lost.gone(), [(erased.clone(), Version::FIRST)]);
    assert!(lost.receipt().is_none() && lost.get(&shared).is_none());
    let receipt_only = &snapshots[11];
    assert!(receipt_only.receipt().is_some() && receipt_only.gone().is_empty());
    assert!(receipt_only.get(&convs[1]).is_none());
}

/// Where a test's store keeps its tables.
#[derive(Clone, Copy)]
enum Engine {
    Single,
    Citus,
}

/// PostgreSQL's group commit: single-scope commits that arrive together are applied by one
/// statement, and each still gets its own outcome — a stale version or a key that appeared is
/// that commit's conflict alone, a receipt is stored only with a write that applied, and a second
/// commit of a key in the same batch waits for the next one.
#[tokio::test]
async fn group_commit_gives_each_commit_its_own_outcome() {
    each_commit_its_own_outcome(Engine::Single).await;
}

/// The same on Citus, where a batch is one statement per node, each run there whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_citus_group_commit_gives_each_commit_its_own_outcome() {
    if !support::citus::installed() {
        return;
    }
    each_commit_its_own_outcome(Engine::Citus).await;
}

async fn each_commit_its_own_outcome(on: Engine) {
    let store = group_commit_store(on).await;
    let ids: Vec<String> = (0..10).map(|i| format!("g{i}")).collect();
    let keys: Vec<StateKey> = ids.iter().map(|id| conversation(id)).collect();
    for key in &keys {
        committed(commit(&store, vec![write(key, Expected::Absent, json!({"n": 1}))]).await);
    }
    let before = store.group_commit_stats();

    // Each receipt in its commit's conversation, as a turn's is: on Citus, on the same shard.
    let mut receipts = std::collections::HashMap::new();
    let mut single = |id: &str, expected, n: i64, act: Option<&str>| {
        let commit = Commit::new(vec![write(&conversation(id), expected, json!({ "n": n }))]);
        match act {
            Some(act) => {
                let key = receipt_in(id, act);
                receipts.insert(act.to_owned(), key.clone());
                commit.with_receipt(key, json!({ "act": act }))
            }
            None => commit,
        }
    };
    let v1 = Expected::Version(Version::FIRST);
    let fresh: Vec<StateKey> = (0..3).map(|i| conversation(&format!("new{i}"))).collect();
    let commits = vec![
        // The first goes alone; the rest queue behind it and go together.
        single(&ids[9], v1, 2, None),
        single(&ids[0], v1, 2, Some("a0")),
        single(&ids[1], v1, 2, Some("a1")),
        single(&ids[2], v1, 2, None),
        single(
            &ids[3],
            Expected::Version(Version::new(7)),
            2,
            Some("stale"),
        ),
        single(&ids[4], Expected::Absent, 2, Some("appeared")),
        single("new0", Expected::Absent, 1, Some("n0")),
        single("new1", Expected::Absent, 1, None),
        single("new2", v1, 1, Some("absent")),
        single(&ids[5], v1, 2, Some("first")),
        single(&ids[5], v1, 3, Some("second")),
    ];
    let outcomes = futures::future::join_all(commits.into_iter().map(|c| store.commit(c))).await;
    let outcomes: Vec<CommitOutcome> = outcomes.into_iter().map(Result::unwrap).collect();

    let after = store.group_commit_stats();
    assert!(
        after.largest >= 8,
        "the queued commits went together: {before:?} -> {after:?}"
    );
    assert_eq!(after.commits - before.commits, 11, "{after:?}");

    let version = |i: usize| committed(outcomes[i].clone());
    assert_eq!(version(0)[&keys[9]], Version::new(2));
    assert_eq!(version(1)[&keys[0]], Version::new(2));
    assert_eq!(version(2)[&keys[1]], Version::new(2));
    assert_eq!(version(3)[&keys[2]], Version::new(2));
    assert_eq!(conflict(outcomes[4].clone()), keys[3]);
    assert_eq!(conflict(outcomes[5].clone()), keys[4]);
    assert_eq!(version(6)[&fresh[0]], Version::FIRST);
    assert_eq!(version(7)[&fresh[1]], Version::FIRST);
    assert_eq!(conflict(outcomes[8].clone()), fresh[2]);
    assert_eq!(version(9)[&keys[5]], Version::new(2));
    assert_eq!(
        conflict(outcomes[10].clone()),
        keys[5],
        "the second commit of a key saw the first's version"
    );

    // State and receipts are exactly those of the commits that applied.
    for (key, n, version) in [
        (&keys[0], 2, 2),
        (&keys[3], 1, 1),
        (&keys[4], 1, 1),
        (&keys[5], 2, 2),
        (&fresh[1], 1, 1),
    ] {
        assert_eq!(
            version_of(&store, key).await,
            Some((state(json!({ "n": n })), Version::new(version))),
            "{key}"
        );
    }
    assert_eq!(version_of(&store, &fresh[2]).await, None);
    for (act, stored) in [
        ("a0", true),
        ("a1", true),
        ("n0", true),
        ("first", true),
        ("stale", false),
        ("appeared", false),
        ("absent", false),
        ("second", false),
    ] {
        assert_eq!(
            stored_receipt_of(&store, &receipts[act]).await,
            stored.then(|| json!({ "act": act })),
            "receipt {act}"
        );
    }
}

/// A batch in which one commit's receipt exists already fails as a whole in the database; each
/// commit is then tried alone, so only that one conflicts (on its receipt) and the rest apply.
#[tokio::test]
async fn group_commit_isolates_a_receipt_that_exists() {
    isolates_a_receipt_that_exists(Engine::Single).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_citus_group_commit_isolates_a_receipt_that_exists() {
    if !support::citus::installed() {
        return;
    }
    isolates_a_receipt_that_exists(Engine::Citus).await;
}

async fn isolates_a_receipt_that_exists(on: Engine) {
    let store = group_commit_store(on).await;
    // The activity `taken` of conversation i3 committed already, on another key of i3.
    let taken = receipt_in("i3", "taken");
    committed(
        store
            .commit(
                Commit::new(vec![write(
                    &StateKey::private_conversation(
                        "bot",
                        &ChannelId::parse("test", "channel_id").unwrap(),
                        &ConversationId::parse("i3", "conversation.id").unwrap(),
                        &UserId::parse("ann", "from.id").unwrap(),
                    ),
                    Expected::Absent,
                    json!({}),
                )])
                .with_receipt(taken.clone(), json!({ "act": "taken" })),
            )
            .await
            .unwrap(),
    );
    batch_refuses_only(&store, "i", 3, &taken).await;
    assert_eq!(
        stored_receipt_of(&store, &taken).await,
        Some(json!({ "act": "taken" }))
    );
}

/// Commits six first turns of conversations `{prefix}0`… at once, so that the last five go as one
/// batch: the one at `at` with the receipt `taken`, which exists, the others each with a receipt
/// of its own. Only that one conflicts, on its receipt, and writes nothing; the others apply.
async fn batch_refuses_only(store: &PostgresStore, prefix: &str, at: usize, taken: &StateKey) {
    let keys: Vec<StateKey> = (0..6)
        .map(|i| conversation(&format!("{prefix}{i}")))
        .collect();
    let receipt_of = |i: usize| {
        if i == at {
            taken.clone()
        } else {
            receipt_in(&format!("{prefix}{i}"), &format!("{prefix}{i}"))
        }
    };
    let before = store.group_commit_stats();
    let commits = keys.iter().enumerate().map(|(i, key)| {
        Commit::new(vec![write(key, Expected::Absent, json!({ "i": i }))])
            .with_receipt(receipt_of(i), json!({ "act": i }))
    });
    let outcomes = futures::future::join_all(commits.map(|c| store.commit(c))).await;
    let after = store.group_commit_stats();
    assert!(after.largest >= 5, "{prefix}: {before:?} -> {after:?}");
    for (i, outcome) in outcomes.into_iter().enumerate() {
        let outcome = outcome.unwrap();
        if i == at {
            assert_eq!(conflict(outcome), *taken, "{prefix}");
            assert_eq!(version_of(store, &keys[i]).await, None, "{prefix}");
        } else {
            assert_eq!(committed(outcome)[&keys[i]], Version::FIRST, "{prefix}{i}");
            assert_eq!(
                stored_receipt_of(store, &receipt_of(i)).await,
                Some(json!({ "act": i })),
                "receipt of {prefix}{i}"
            );
        }
    }
}

/// A batch looks for each receipt in every slot, and in the receipts of the releases before the
/// slots, as a commit alone does: one committed in the slot before the one being written, and one
/// in `turnstile_receipt_legacy`, are each refused as taken, and the rest of their batch applies.
/// (One such receipt per batch: a batch that meets one goes commit by commit, which would find
/// the other.)
#[tokio::test]
async fn group_commit_finds_a_receipt_in_any_slot_and_from_before_the_slots() {
    let database = support::pg::fresh_database().await;
    let url = DatabaseUrl::new(database.clone());
    postgres::migrate(&url).await.unwrap();
    let store = PostgresStore::connect(&url, 4).unwrap();
    let db = support::pg::session(&database).await;
    // `earlier` committed in the slot before the one being written; `older` before the slots.
    let (earlier, older) = (receipt_in("e2", "earlier"), receipt_in("o2", "older"));
    committed(
        store
            .commit(
                Commit::new(vec![write(
                    &conversation("elsewhere"),
                    Expected::Absent,
                    json!({}),
                )])
                .with_receipt(earlier.clone(), json!({ "act": "earlier" })),
            )
            .await
            .unwrap(),
    );
    let moved = db
        .execute(
            "UPDATE turnstile_receipt SET slot = (slot + 3) % 4 WHERE key = $1",
            &[&earlier.as_str()],
        )
        .await
        .unwrap();
    assert_eq!(moved, 1);
    db.execute(
        "INSERT INTO turnstile_receipt_legacy (key, payload, created_at) \
         VALUES ($1, '{\"act\": \"older\"}', now())",
        &[&older.as_str()],
    )
    .await
    .unwrap();

    for (prefix, taken, act) in [("e", &earlier, "earlier"), ("o", &older, "older")] {
        batch_refuses_only(&store, prefix, 2, taken).await;
        assert_eq!(
            stored_receipt_of(&store, taken).await,
            Some(json!({ "act": act }))
        );
    }
}

/// `--commits-in-flight`: with one statement in flight (the default, set here explicitly), the
/// commits that arrive while it runs all wait for the next, however large the pool.
#[tokio::test]
async fn one_commit_in_flight_puts_every_waiting_commit_in_the_next_batch() {
    let url = DatabaseUrl::new(support::pg::fresh_database().await);
    postgres::migrate(&url).await.unwrap();
    let store = PostgresStore::connect(&url, 16)
        .unwrap()
        .with_commits_in_flight(Some(1));
    let commits = (0..8).map(|i| {
        let key = conversation(&format!("one-in-flight-{i}"));
        store.commit(Commit::new(vec![write(&key, Expected::Absent, json!({}))]))
    });
    for outcome in futures::future::join_all(commits).await {
        committed(outcome.unwrap());
    }
    let stats = store.group_commit_stats();
    assert_eq!(stats.commits, 8, "{stats:?}");
    assert!(
        stats.largest >= 6,
        "the commits behind the first did not wait for one batch: {stats:?}"
    );
}

/// A large state whose turn changed a few of its properties is sent as those alone, merged over
/// the row the version check says the turn read: by the batch statement and by the one a commit
/// runs alone. A property planted in the rows without a new version (no writer does that) shows
/// which writes merged: it survives a merge, and a write of the whole state removes it.
#[tokio::test]
async fn changed_properties_alone_are_merged_over_the_row_read() {
    let database = support::pg::fresh_database().await;
    let url = DatabaseUrl::new(database.clone());
    postgres::migrate(&url).await.unwrap();
    let store = PostgresStore::connect(&url, 16)
        .unwrap()
        .with_commits_in_flight(Some(1));
    let pad = ".".repeat(8192);
    let counted = |count: u64| state(json!({ "pad": pad, "count": count }));
    let change = |key: &StateKey, version: u64, count: u64, write: JsonMap| KeyChange {
        key: key.clone(),
        expected: Expected::Version(Version::new(version)),
        write: Some(StateWrite::new(write).changed_since(&counted(count - 1))),
    };
    let keys: Vec<StateKey> = (0..8)
        .map(|i| conversation(&format!("merged-{i}")))
        .collect();
    for key in &keys {
        let created = KeyChange {
            key: key.clone(),
            expected: Expected::Absent,
            write: Some(StateWrite::new(counted(0)).changed_since(&JsonMap::new())),
        };
        committed(commit(&store, vec![created]).await);
    }
    let db = support::pg::session(&database).await;
    db.batch_execute("UPDATE turnstile_state SET state = state || '{\"planted\": true}'")
        .await
        .unwrap();
    // A row's state, its padding shown as its length and first character.
    let stored = async |key: &StateKey| -> serde_json::Value {
        db.query_one(
            "SELECT (state || jsonb_build_object('pad', \
                     length(state->>'pad') || ' ' || left(state->>'pad', 1)))::text \
               FROM turnstile_state WHERE key = $1",
            &[&key.as_str()],
        )
        .await
        .map(|row| serde_json::from_str(row.get::<_, &str>(0)).unwrap())
        .unwrap()
    };

    // Together: the first goes alone, the others wait for it and go as one batch.
    let commits = keys
        .iter()
        .map(|key| store.commit(Commit::new(vec![change(key, 1, 1, counted(1))])));
    for outcome in futures::future::join_all(commits).await {
        committed(outcome.unwrap());
    }
    let stats = store.group_commit_stats();
    assert!(stats.largest >= 6, "no batch: {stats:?}");
    for key in &keys {
        assert_eq!(
            stored(key).await,
            json!({ "pad": "8192 .", "count": 1, "planted": true }),
            "{key}"
        );
    }

    // Alone, one after the other: merged; then most of the state changed, so written whole.
    committed(commit(&store, vec![change(&keys[0], 2, 2, counted(2))]).await);
    assert_eq!(
        stored(&keys[0]).await,
        json!({ "pad": "8192 .", "count": 2, "planted": true })
    );
    let rewritten = state(json!({ "pad": pad.replace('.', "-"), "count": 3 }));
    committed(commit(&store, vec![change(&keys[0], 3, 3, rewritten)]).await);
    assert_eq!(
        stored(&keys[0]).await,
        json!({ "pad": "8192 -", "count": 3 })
    );
    // A write over a version that moved is refused, merged or not.
    let stale = change(&keys[1], 1, 2, counted(2));
    assert_eq!(conflict(commit(&store, vec![stale]).await), keys[1]);
}

/// `n` conversations named `{prefix}{i}`, each created at the first version.
async fn created(store: &PostgresStore, prefix: &str, n: usize) -> Vec<StateKey> {
    let keys: Vec<StateKey> = (0..n)
        .map(|i| conversation(&format!("{prefix}{i}")))
        .collect();
    for key in &keys {
        committed(commit(store, vec![write(key, Expected::Absent, json!({}))]).await);
    }
    keys
}

/// A session of its own holding `key`'s row locked, in a transaction it has left open.
async fn locked(url: &str, key: &StateKey) -> tokio_postgres::Client {
    let session = support::pg::session(url).await;
    session
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM turnstile_state WHERE key = '{}' FOR UPDATE",
            key.as_str()
        ))
        .await
        .unwrap();
    session
}

/// While the only slot is taken, the next batch is sent behind the one running on its
/// connection once as many commits wait as that one holds — not before, so that batches do not
/// shrink — and PostgreSQL runs it the moment the first has committed. Every commit still gets
/// its own outcome, and a commit queued behind both sees what they wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_goes_behind_the_running_one_once_as_many_commits_wait() {
    batches_behind_the_running_one(Statements::Prepared).await;
}

/// Behind a pooler in transaction mode, which may hand a connection to another client between
/// two transactions, no batch is sent behind another: it waits for a lane of its own, with the
/// same outcomes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_prepared_statements_no_batch_goes_behind_another() {
    batches_behind_the_running_one(Statements::Unprepared).await;
}

async fn batches_behind_the_running_one(statements: Statements) {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(url.clone()))
        .await
        .unwrap();
    let store = Arc::new(
        PostgresStore::connect_with(&DatabaseUrl::new(url.clone()), 8, statements)
            .unwrap()
            .with_commits_in_flight(Some(1)),
    );
    let pipelines = statements == Statements::Prepared;
    let keys = created(store.as_ref(), "behind", 8).await;
    let send = |key: &StateKey, n: i64| {
        let store = Arc::clone(&store);
        let commit = Commit::new(vec![write(
            key,
            Expected::Version(Version::FIRST),
            json!({ "n": n }),
        )]);
        tokio::spawn(async move { store.commit(commit).await })
    };
    let settle = || tokio::time::sleep(std::time::Duration::from_millis(300));

    // The first commit goes alone and waits on a lock in the database, holding the only slot;
    // three queue behind it.
    let gate = locked(&url, &keys[0]).await;
    let blocker = locked(&url, &keys[1]).await;
    let alone = send(&keys[0], 2);
    settle().await;
    let first: Vec<_> = keys[1..4].iter().map(|key| send(key, 2)).collect();
    settle().await;
    // The gate opens: the three go as one batch, which waits on the second lock.
    gate.batch_execute("COMMIT").await.unwrap();
    settle().await;
    let before = store.group_commit_stats();
    assert_eq!(before.largest, 3, "{before:?}");

    // Two waiting are fewer than the running batch holds: they stay queued.
    let mut second: Vec<_> = keys[4..6].iter().map(|key| send(key, 2)).collect();
    settle().await;
    assert_eq!(store.group_commit_stats().pipelined, 0);
    // A third makes as many: the three go behind the running batch, on its connection.
    second.push(send(&keys[6], 2));
    settle().await;
    let after = store.group_commit_stats();
    if pipelines {
        assert_eq!(after.pipelined, 1, "{before:?} -> {after:?}");
        assert_eq!(after.batches, before.batches + 1, "{after:?}");
    } else {
        assert_eq!(after, before, "nothing went behind the running batch");
    }
    // A commit of a key the first batch writes, over the version both read: it waits for a
    // lane, since the only one is taken.
    let late = send(&keys[2], 3);
    settle().await;
    assert!(
        first
            .iter()
            .chain(&second)
            .chain([&late])
            .all(|c| !c.is_finished()),
        "nothing answered while the first batch waits on its lock"
    );

    blocker.batch_execute("COMMIT").await.unwrap();
    committed(alone.await.unwrap().unwrap());
    for (commit, key) in first.into_iter().chain(second).zip(&keys[1..7]) {
        assert_eq!(
            committed(commit.await.unwrap().unwrap())[key],
            Version::new(2)
        );
    }
    assert_eq!(
        conflict(late.await.unwrap().unwrap()),
        keys[2],
        "the late commit saw the first batch's write"
    );
    for key in &keys[..7] {
        assert_eq!(
            version_of(store.as_ref(), key).await,
            Some((state(json!({ "n": 2 })), Version::new(2))),
            "{key}"
        );
    }
    assert_eq!(
        version_of(store.as_ref(), &keys[7]).await.map(|(_, v)| v),
        Some(Version::FIRST)
    );
}

/// The committer task lives on the runtime that first needed it. A store that outlives that
/// runtime starts a new one on the next, instead of failing every commit that has to queue.
#[test]
fn group_commit_outlives_the_runtime_that_started_it() {
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let store = runtime().block_on(async {
        let url = DatabaseUrl::new(support::pg::fresh_database().await);
        postgres::migrate(&url).await.unwrap();
        PostgresStore::connect(&url, 4).unwrap()
    });
    for round in ["first", "second"] {
        let commits = (0..8).map(|i| {
            let key = conversation(&format!("{round}-{i}"));
            store.commit(Commit::new(vec![write(&key, Expected::Absent, json!({}))]))
        });
        for outcome in runtime().block_on(futures::future::join_all(commits)) {
            committed(outcome.unwrap());
        }
    }
    assert!(store.group_commit_stats().largest > 1);
}

/// A batch whose database goes away: every commit in it gets "unavailable" (an unknown outcome,
/// which the engine resolves by the receipt), none a conflict or a success it did not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_reports_a_lost_database_to_every_commit_of_a_batch() {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(url.clone()))
        .await
        .unwrap();
    let config: tokio_postgres::Config = url.parse().unwrap();
    let proxy = support::proxy::Proxy::start(([127, 0, 0, 1], config.get_ports()[0]).into()).await;
    let through_proxy = format!(
        "postgres://postgres@127.0.0.1:{}/{}",
        proxy.addr().port(),
        config.get_dbname().unwrap()
    );
    let store = Arc::new(PostgresStore::connect(&DatabaseUrl::new(through_proxy), 4).unwrap());
    let keys = created(store.as_ref(), "lost", 7).await;

    // The first key is locked elsewhere, so its commit, alone in the only slot, waits in the
    // database; the others queue behind it for one batch.
    let locker = locked(&url, &keys[0]).await;
    let send = |key: &StateKey| {
        let store = Arc::clone(&store);
        let commit = Commit::new(vec![write(
            key,
            Expected::Version(Version::FIRST),
            json!({"n": 2}),
        )]);
        tokio::spawn(async move { store.commit(commit).await })
    };
    let waiting = send(&keys[0]);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let queued: Vec<_> = keys[1..].iter().map(send).collect();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let before = store.group_commit_stats();

    assert!(
        proxy.cut(std::time::Duration::from_secs(2)) >= 1,
        "the commit's connection was cut"
    );
    for outcome in std::iter::once(waiting).chain(queued) {
        let outcome = outcome.await.unwrap();
        assert!(
            matches!(outcome, Err(turnstile::store::StoreError::Unavailable(_))),
            "{outcome:?}"
        );
    }
    let after = store.group_commit_stats();
    assert_eq!(
        after.largest, 6,
        "the queued six went as one batch: {before:?} -> {after:?}"
    );
    locker.batch_execute("ROLLBACK").await.unwrap();

    // The first commit's statement was already in the database, waiting for the lock: it may
    // have gone through after all, which is why its outcome is "unavailable", not "conflict".
    // The batch never reached the database.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    for key in &keys[1..] {
        assert_eq!(
            version_of(store.as_ref(), key).await.map(|(_, v)| v),
            Some(Version::FIRST),
            "{key} unchanged"
        );
    }
}

/// A replica of the release before tombstones, serving beside this one during a rolling upgrade,
/// creates keys at version 1 (`turnstile_commit` with 0, or its group commit's plain insert) and
/// checks that they landed there. Over a tombstone its create is refused — a conflict, which it
/// retries and then gives up on with a status its caller retries elsewhere — rather than made at a
/// version it would report as a failure after committing. Nor can it bring an erased row back.
/// Where no key was deleted, it creates as before.
#[tokio::test]
async fn an_older_releases_create_over_an_erased_row_conflicts() {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(url.clone()))
        .await
        .unwrap();
    let store = PostgresStore::connect(&DatabaseUrl::new(url.clone()), 2).unwrap();
    let (ann, anns, fresh) = (user("ann"), private("c", "ann"), user("fresh"));
    for key in [&ann, &anns] {
        committed(commit(&store, vec![write(key, Expected::Absent, json!({}))]).await);
    }
    store
        .erase(&Erasure::User("test/ann".into()))
        .await
        .unwrap();
    let db = support::pg::session(&url).await;
    let old_commit = |key: &StateKey| {
        let key = key.as_str().to_owned();
        let db = &db;
        async move {
            let row = db
                .query_one(
                    "SELECT conflict_key, versions FROM turnstile_commit($1, $2, $3, NULL, NULL)",
                    &[
                        &vec![key.as_str()],
                        &vec![0_i64],
                        &vec![tokio_postgres::types::Json(json!({}))],
                    ],
                )
                .await
                .unwrap();
            (
                row.get::<_, Option<String>>(0),
                row.get::<_, Option<Vec<i64>>>(1),
            )
        }
    };
    let old_insert = |key: &StateKey| {
        let key = key.as_str().to_owned();
        let db = &db;
        async move {
            db.query_opt(
                "INSERT INTO turnstile_state (key, state, version) VALUES ($1, '{}', 1) \
                 ON CONFLICT (key) DO NOTHING RETURNING version",
                &[&key.as_str()],
            )
            .await
            .unwrap()
            .map(|row| row.get::<_, i64>(0))
        }
    };
    assert_eq!(
        old_commit(&ann).await,
        (Some(ann.as_str().to_owned()), None)
    );
    assert_eq!(old_insert(&anns).await, None);
    assert_eq!(version_of(&store, &ann).await, None);
    // A key never deleted: created at 1, as that release expects.
    assert_eq!(old_commit(&fresh).await, (None, Some(vec![1])));
    assert_eq!(old_insert(&user("other")).await, Some(1));
}

/// Tombstones are pruned with the receipts, once a day old: no turn, nor cached guess, that read
/// the deleted row lives that long.
#[tokio::test]
async fn tombstones_go_after_a_day() {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(url.clone()))
        .await
        .unwrap();
    let store = PostgresStore::connect(&DatabaseUrl::new(url.clone()), 2).unwrap();
    for id in ["old", "new"] {
        committed(commit(&store, vec![write(&user(id), Expected::Absent, json!({}))]).await);
        store
            .erase(&Erasure::User(format!("test/{id}")))
            .await
            .unwrap();
    }
    let db = support::pg::session(&url).await;
    db.execute(
        "UPDATE turnstile_tombstone SET erased_at = now() - interval '25 hours' \
          WHERE key_hash = turnstile_key_hash($1)",
        &[&user("old").as_str()],
    )
    .await
    .unwrap();
    store
        .prune_receipts(std::time::Duration::from_secs(3600))
        .await
        .unwrap();
    let left = store.load(&[user("old"), user("new")], None).await.unwrap();
    assert_eq!(left.precondition(&user("old")), Expected::Absent);
    assert_eq!(
        left.precondition(&user("new")),
        Expected::Gone(Version::FIRST)
    );
}

/// Expiry: a row unwritten for its scope's time to live reads as absent — empty, at its version,
/// so that the turn's commit writes over it in place — while scopes without one are kept; the
/// sweep deletes it with a tombstone, after which a turn that read it expired conflicts and its
/// replay creates the key above the old version.
async fn expiry(store: Arc<dyn Store>) {
    let store = store.as_ref();
    let (c, u) = (conversation("expiring"), user("kept"));
    committed(commit(store, vec![write(&c, Expected::Absent, json!({"n": 1}))]).await);
    committed(
        commit(
            store,
            vec![write(
                &c,
                Expected::Version(Version::FIRST),
                json!({"n": 2}),
            )],
        )
        .await,
    );
    committed(
        commit(
            store,
            vec![write(&u, Expected::Absent, json!({"name": "ann"}))],
        )
        .await,
    );
    let fresh = store.load(&[c.clone(), u.clone()], None).await.unwrap();
    assert_eq!(
        JsonMap::clone(&fresh.get(&c).unwrap().state),
        state(json!({"n": 2}))
    );
    assert!(matches!(fresh.expiry(&c), Some(Some(_))), "{fresh:?}");
    assert_eq!(fresh.expiry(&u), None, "the user scope has no TTL");
    // Nothing to sweep yet.
    assert_eq!(store.sweep_expired(None, 100).await.unwrap().deleted, 0);

    tokio::time::sleep(std::time::Duration::from_millis(1300)).await;
    let expired = store.load(&[c.clone(), u.clone()], None).await.unwrap();
    let row = expired.get(&c).unwrap();
    assert!(row.state.is_empty(), "expired reads as empty: {row:?}");
    assert_eq!(row.version, Version::new(2), "at its version");
    assert_eq!(expired.expiry(&c), Some(None));
    assert_eq!(
        JsonMap::clone(&expired.get(&u).unwrap().state),
        state(json!({"name": "ann"}))
    );

    // Swept, a step of one key at a time through both.
    let first = store.sweep_expired(None, 1).await.unwrap();
    let second = store.sweep_expired(first.next.as_deref(), 1).await.unwrap();
    assert_eq!(first.deleted + second.deleted, 1, "{first:?} {second:?}");
    let end = store
        .sweep_expired(second.next.as_deref(), 1)
        .await
        .unwrap();
    assert_eq!(
        end,
        turnstile::store::Swept::default(),
        "the end of the keys"
    );
    // The turn that read it expired at 2 conflicts; its replay finds it gone at 2.
    conflict(
        commit(
            store,
            vec![write(&c, Expected::Version(Version::new(2)), json!({}))],
        )
        .await,
    );
    let gone = store.load(std::slice::from_ref(&c), None).await.unwrap();
    assert_eq!(gone.precondition(&c), Expected::Gone(Version::new(2)));
    let versions = committed(
        commit(
            store,
            vec![write(&c, Expected::Gone(Version::new(2)), json!({"n": 1}))],
        )
        .await,
    );
    assert_eq!(versions.get(&c), Some(&Version::new(3)));
    assert!(
        version_of(store, &u).await.is_some(),
        "the user scope stays"
    );
}

fn conversation_ttl() -> turnstile::store::Ttls {
    turnstile::store::Ttls {
        conversation: Some(std::time::Duration::from_secs(1)),
        ..turnstile::store::Ttls::NONE
    }
}

/// A store over database `url`, migrated, whose conversations live [`conversation_ttl`].
async fn expiring_store(url: &str) -> Arc<dyn Store> {
    let url = DatabaseUrl::new(url);
    postgres::migrate(&url).await.unwrap();
    Arc::new(
        PostgresStore::connect(&url, 2)
            .unwrap()
            .with_ttls(conversation_ttl()),
    )
}

/// A conversation's hold deleted with the conversation is taken again above its old fence: the
/// turn that held it cannot renew, commit or release it any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_deleted_with_its_conversation_is_taken_again_above_its_old_fence() {
    let text_url = support::pg::fresh_database().await;
    let url = DatabaseUrl::new(text_url.clone());
    postgres::migrate(&url).await.unwrap();
    let store = PostgresStore::connect(&url, 4).unwrap();
    let c = conversation("held");
    let keys = [c.clone()];
    let hold = |store: &PostgresStore| {
        let (store, c, keys) = (store.clone(), c.clone(), keys.clone());
        async move {
            match store
                .hold_conversation(
                    &c,
                    &keys,
                    None,
                    std::time::Duration::from_secs(5),
                    turnstile::store::Others::Wait,
                )
                .await
                .unwrap()
            {
                turnstile::store::ConversationLock::Held { turn, .. } => turn,
                other => panic!("not held: {other:?}"),
            }
        }
    };
    let first = hold(&store).await;
    let deleted = store
        .erase(&Erasure::Conversation("test/held".into()))
        .await
        .unwrap();
    assert_eq!(deleted.rows.len(), 1, "the hold's row: {deleted:?}");
    // The old holder's commit fails at its fence; the next turn takes the hold at once.
    let stale = first
        .commit(Commit::new(vec![write(
            &c,
            Expected::Absent,
            json!({"stale": true}),
        )]))
        .await
        .unwrap();
    conflict(stale);
    let second = hold(&store).await;
    committed(
        second
            .commit(Commit::new(vec![write(
                &c,
                Expected::Absent,
                json!({"n": 1}),
            )]))
            .await
            .unwrap(),
    );
    let db = support::pg::session(&text_url).await;
    let fence: i64 = db
        .query_one(
            "SELECT version FROM turnstile_state WHERE key = $1",
            &[&StateKey::hold(&c).as_str()],
        )
        .await
        .unwrap()
        .get(0);
    assert!(fence > deleted.rows[0].1.get() as i64, "fence {fence}");
}

/// This release's creates check a key's tombstone themselves: without the trigger that guards an
/// older release's creates (a distributed database has none), erasure keeps its contract.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_holds_without_the_trigger() {
    for statements in [Statements::Prepared, Statements::Unprepared] {
        let url = support::pg::fresh_database().await;
        postgres::migrate(&DatabaseUrl::new(url.clone()))
            .await
            .unwrap();
        support::pg::session(&url)
            .await
            .batch_execute("DROP TRIGGER turnstile_state_created ON turnstile_state")
            .await
            .unwrap();
        erasure(Arc::new(
            PostgresStore::connect_with(&DatabaseUrl::new(url), 4, statements).unwrap(),
        ))
        .await;
    }
}

/// PostgreSQL's receipt slots (`migrations/V5__receipt_slots.sql`), with a one-second slot: a
/// redelivery is refused whichever slot its receipt went to, every receipt within the retention is
/// found, and the table never holds more than about one and a half retentions of them however
/// long turns go on — slots are emptied whole, none row by row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_rotate_through_slots_and_stay_within_the_retention() {
    use std::time::{Duration, Instant};
    let database = support::pg::fresh_database().await;
    let url = DatabaseUrl::new(database.clone());
    postgres::migrate(&url).await.unwrap();
    let store = PostgresStore::connect(&url, 4).unwrap();
    let retention = Duration::from_secs(2);
    store.prune_receipts(retention).await.unwrap();
    let db = support::pg::session(&database).await;

    let started = Instant::now();
    let mut written: Vec<(Instant, String)> = Vec::new();
    let mut most = 0;
    let mut pruned = 0;
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(9) {
        let id = format!("slot{n}");
        n += 1;
        committed(
            store
                .commit(
                    Commit::new(vec![write(&conversation(&id), Expected::Absent, json!({}))])
                        .with_receipt(receipt(&id), json!({"n": n})),
                )
                .await
                .unwrap(),
        );
        written.push((Instant::now(), id));
        if n % 5 == 0 {
            pruned += store.prune_receipts(retention).await.unwrap();
            let held: i64 = db
                .query_one("SELECT count(DISTINCT key) FROM turnstile_receipt", &[])
                .await
                .unwrap()
                .get(0);
            most = most.max(held);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Within the retention: every one found, and a second commit of each refused, though most
    // now sit in a slot before the one being written.
    for (at, id) in written
        .iter()
        .rev()
        .take_while(|(at, _)| at.elapsed() < retention)
    {
        assert!(
            stored_receipt(&store, id).await.is_some(),
            "{id}, {:?} old",
            at.elapsed()
        );
        let again = Commit::new(vec![write(
            &conversation(&format!("{id}-again")),
            Expected::Absent,
            json!({}),
        )])
        .with_receipt(receipt(id), json!({"twice": true}));
        assert_eq!(conflict(store.commit(again).await.unwrap()), receipt(id));
    }
    // Storage is bounded: one write every ~20 ms over 9 s is ~400 receipts; 2 s of retention
    // plus a 1 s slot being written is ~150.
    let per_second = f64::from(n) / started.elapsed().as_secs_f64();
    assert!(pruned > 0, "no slot was emptied");
    #[allow(clippy::cast_precision_loss)]
    let held = most as f64;
    assert!(
        held <= per_second * 4.5,
        "held {most} receipts at most, writing {per_second:.0}/s with 2 s of retention"
    );
    let first = &written[0].1;
    assert!(
        stored_receipt(&store, first).await.is_none(),
        "{first} is 9 s old"
    );
}

/// The receipts of the releases before the slots (`turnstile_receipt_legacy`): a redelivery is
/// answered from them, and refused a second commit, while they are within the retention; once
/// none is, the table is emptied whole and no longer read.
#[tokio::test]
async fn receipts_from_before_the_slots_answer_until_they_expire() {
    let database = support::pg::fresh_database().await;
    let url = DatabaseUrl::new(database.clone());
    postgres::migrate(&url).await.unwrap();
    let store = PostgresStore::connect(&url, 2).unwrap();
    let db = support::pg::session(&database).await;
    let (young, old) = (receipt("legacy-young"), receipt("legacy-old"));
    db.execute(
        "INSERT INTO turnstile_receipt_legacy (key, payload, created_at) \
         VALUES ($1, '{\"n\": 1}', now()), ($2, '{\"n\": 2}', now() - interval '2 hours')",
        &[&young.as_str(), &old.as_str()],
    )
    .await
    .unwrap();
    assert_eq!(
        stored_receipt(&store, "legacy-young").await,
        Some(json!({"n": 1}))
    );
    let again = Commit::new(vec![write(
        &conversation("legacy-again"),
        Expected::Absent,
        json!({}),
    )])
    .with_receipt(young.clone(), json!({"twice": true}));
    assert_eq!(conflict(store.commit(again).await.unwrap()), young);

    // An hour's retention: the young one keeps the table.
    store
        .prune_receipts(std::time::Duration::from_secs(3600))
        .await
        .unwrap();
    let left: i64 = db
        .query_one("SELECT count(*) FROM turnstile_receipt_legacy", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 2);

    // Both past it: emptied, and no longer looked at.
    db.execute(
        "UPDATE turnstile_receipt_legacy SET created_at = now() - interval '2 hours'",
        &[],
    )
    .await
    .unwrap();
    store
        .prune_receipts(std::time::Duration::from_secs(3600))
        .await
        .unwrap();
    let (left, read): (i64, bool) = db
        .query_one(
            "SELECT (SELECT count(*) FROM turnstile_receipt_legacy), \
                    (SELECT legacy FROM turnstile_receipt_clock)",
            &[],
        )
        .await
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert_eq!((left, read), (0, false));
    assert_eq!(stored_receipt(&store, "legacy-young").await, None);
}
