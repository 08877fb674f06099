//! Expiry as a server runs it, on real PostgreSQL and in memory: with `--conversation-ttl`, a
//! conversation idle for longer starts again from nothing at its next turn — at once, through
//! the replica's own cache of what it last wrote — while the scopes without a TTL are kept; and
//! the replica's sweep deletes the expired rows in the background.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use async_trait::async_trait;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

use crate::support::{self, TestApp, say, texts};

/// Answers `conversation N, user M`: the conversation's count and the user's, each one more.
struct Counts;

#[async_trait]
impl Bot for Counts {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let conversation: u64 = turn.conversation_property("n")?;
        turn.conversation_state().set("n", &(conversation + 1))?;
        let user: u64 = turn.user_state()?.get("n")?.unwrap_or(0);
        turn.user_state()?.set("n", &(user + 1))?;
        turn.send_text(format!(
            "conversation {}, user {}",
            conversation + 1,
            user + 1
        ));
        Ok(())
    }
}

const TTL: Duration = Duration::from_secs(2);

/// `config` with a conversation TTL of [`TTL`], swept every `sweep`.
fn expiring(config: turnstile::Config, sweep: Duration) -> turnstile::Config {
    turnstile::Config {
        ttls: turnstile::store::Ttls {
            conversation: Some(TTL),
            ..turnstile::store::Ttls::NONE
        },
        expiry_sweep_every: sweep,
        ..config
    }
}

async fn idle_conversations_start_again(app: &TestApp) {
    let mut client = app.client.clone();
    let mut answers = Vec::new();
    for _ in 0..2 {
        answers.extend(texts(&say(&mut client, "c", "hi").await));
    }
    tokio::time::sleep(TTL + Duration::from_millis(300)).await;
    answers.extend(texts(&say(&mut client, "c", "hi").await));
    answers.extend(texts(&say(&mut client, "c", "hi").await));
    assert_eq!(
        answers,
        [
            "conversation 1, user 1",
            "conversation 2, user 2",
            // Idle past the TTL: the conversation starts again; the user scope has no TTL.
            "conversation 1, user 3",
            "conversation 2, user 4",
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_conversation_expires_and_is_swept_on_postgres() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("counts", Counts))
        .config(|c| expiring(c, Duration::from_millis(300)))
        .spawn()
        .await;
    idle_conversations_start_again(&app).await;

    // Left idle again, its row is swept away within a few sweeps of expiring, leaving a
    // tombstone; the user's row stays.
    let db = support::pg::session(app.database_url()).await;
    let count = |sql: &'static str| {
        let db = &db;
        async move { db.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let deadline = tokio::time::Instant::now() + TTL + Duration::from_secs(10);
    while count("SELECT count(*) FROM turnstile_state WHERE key LIKE '%/conversations/c'").await > 0
    {
        assert!(tokio::time::Instant::now() < deadline, "never swept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(count("SELECT count(*) FROM turnstile_tombstone").await, 1);
    assert_eq!(
        count("SELECT count(*) FROM turnstile_state WHERE key LIKE '%/users/alice'").await,
        1
    );
    // And it starts again above its old versions.
    let answer = say(&mut app.client, "c", "hi").await;
    assert_eq!(texts(&answer), ["conversation 1, user 5"]);
    let version: i64 = db
        .query_one(
            "SELECT version FROM turnstile_state WHERE key LIKE '%/conversations/c'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Written at versions 1 to 4 (the expired row was written over in place), swept at 4.
    assert_eq!(version, 5, "created above the version it was swept at");
    app.stop().await.unwrap();
}

/// With no sweep before the next turn (its first is at the start, when nothing has expired), the
/// replica's cache of the state it last wrote must itself stop guessing at the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_conversation_expires_in_memory_at_once_without_a_sweep() {
    let app = TestApp::memory()
        .bots(BotRegistry::new("counts", Counts))
        .config(|c| expiring(c, Duration::from_secs(3600)))
        .spawn()
        .await;
    idle_conversations_start_again(&app).await;
    app.stop().await.unwrap();
}

/// Remembers the user's name on `name X`, and says it back otherwise, reading the user scope only.
struct Names;

#[async_trait]
impl Bot for Names {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let text = turn.text().to_owned();
        if let Some(name) = text.strip_prefix("name ") {
            turn.user_state()?.set("name", &name)?;
            turn.send_text("noted");
        } else {
            let name: Option<String> = turn.user_state()?.get("name")?;
            turn.send_text(name.unwrap_or_else(|| "who?".into()));
        }
        Ok(())
    }
}

/// The TTL counts from the scope's last use: a user who keeps talking keeps a user state that
/// never changes, read again at least every half TTL; left alone longer than the TTL, it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_only_read_lives_while_it_is_used() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("names", Names))
        .config(|c| turnstile::Config {
            ttls: turnstile::store::Ttls {
                user: Some(TTL),
                ..turnstile::store::Ttls::NONE
            },
            expiry_sweep_every: Duration::from_secs(3600),
            ..c
        })
        .spawn()
        .await;
    assert_eq!(
        texts(&say(&mut app.client, "c", "name Ada").await),
        ["noted"]
    );
    // Read every 0.6 s for twice the TTL: each read past half of it writes the scope again.
    for _ in 0..7 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(texts(&say(&mut app.client, "c", "who am I").await), ["Ada"]);
    }
    tokio::time::sleep(TTL + Duration::from_millis(300)).await;
    assert_eq!(
        texts(&say(&mut app.client, "c", "who am I").await),
        ["who?"]
    );
    app.stop().await.unwrap();
}
