//! Erasure through the admin service, on real PostgreSQL: `EraseUser` and `DeleteConversation`
//! remove exactly what they say, for every bot, leave nothing of the ids behind in a full scan,
//! answer an unknown id with a record of nothing removed, and — the point of tombstones — a turn
//! that read the data before the erasure cannot write it back, even once the key's new rows have
//! reached the version that turn read. The CLI's `erase-user` and `delete-conversation` too.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, Semaphore};
use tonic::Code;
use turnstile::grpc::auth::Token;
use turnstile::grpc::pb;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

use crate::admin::{ADMIN, ServerAddr, TURNS, admin_client, cli_at, with_token};
use crate::support::{self, TestApp, message, request, texts};

/// Keeps every message a user sent in their user state; for `hello`, also counts the
/// conversation's, and the user's in it. On the text `racing`, the first run stops after reading the state
/// until the test lets it go.
struct Remembers {
    held: AtomicBool,
    reading: Notify,
    go: Semaphore,
}

impl Remembers {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            held: AtomicBool::new(false),
            reading: Notify::new(),
            go: Semaphore::new(0),
        })
    }
}

#[async_trait]
impl Bot for Remembers {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let text = turn.activity().text.clone().unwrap_or_default();
        let mut said: Vec<String> = turn.user_state()?.get("said")?.unwrap_or_default();
        if text == "racing" && !self.held.swap(true, Ordering::SeqCst) {
            self.reading.notify_one();
            let _ = self.go.acquire().await;
        }
        // Only "hello" touches the conversation's scopes: the race below is over the user's.
        if text == "hello" {
            let count: u64 = turn.conversation_property("count")?;
            turn.conversation_state().set("count", &(count + 1))?;
            let mine: u64 = turn.private_conversation_state()?.get("mine")?.unwrap_or(0);
            turn.private_conversation_state()?
                .set("mine", &(mine + 1))?;
        }
        said.push(text);
        turn.user_state()?.set("said", &said)?;
        turn.send_text(said.join(","));
        Ok(())
    }
}

/// Forwards to a shared [`Remembers`], so that the test keeps a handle on it.
struct Shared(Arc<Remembers>);

#[async_trait]
impl Bot for Shared {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.0.on_turn(turn).await
    }
}

async fn spawn_app(bot: Arc<Remembers>) -> TestApp {
    let bots = BotRegistry::new("remembers", Shared(Arc::clone(&bot))).with("other", Shared(bot));
    TestApp::postgres()
        .bots(bots)
        .config(|c| turnstile::Config {
            auth_tokens: vec![Token::new(TURNS)],
            admin_tokens: vec![Token::new(ADMIN)],
            ..c
        })
        .spawn()
        .await
}

async fn say(
    app: &TestApp,
    bot: &str,
    conversation: &str,
    user: &str,
    text: &str,
) -> pb::ProcessTurnResponse {
    let mut client = app.client.clone();
    let mut turn = request(message(conversation, user, text));
    turn.bot = bot.into();
    client
        .process_turn(with_token(turn, TURNS))
        .await
        .unwrap()
        .into_inner()
}

fn erase(user: &str) -> pb::EraseUserRequest {
    pb::EraseUserRequest {
        channel_id: "test".into(),
        user_id: user.into(),
    }
}

/// How many rows of Turnstile's tables mention `needle` anywhere, keys and JSON alike.
async fn mentions(url: &str, needle: &str) -> i64 {
    let db = support::pg::session(url).await;
    let pattern = format!("%{needle}%");
    let mut total = 0;
    for table in [
        "turnstile_state",
        "turnstile_receipt",
        "turnstile_receipt_legacy",
    ] {
        let n: i64 = db
            .query_one(
                &format!("SELECT count(*) FROM {table} t WHERE t::text LIKE $1"),
                &[&pattern],
            )
            .await
            .unwrap()
            .get(0);
        total += n;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erase_user_removes_the_user_everywhere_and_nothing_else() {
    let app = spawn_app(Remembers::new()).await;
    let url = app.database_url().to_owned();
    for (bot, conversation, user) in [
        ("remembers", "room", "ada-5e1"),
        ("remembers", "room", "bob"),
        ("remembers", "hall", "ada-5e1"),
        ("other", "room", "ada-5e1"),
    ] {
        say(&app, bot, conversation, user, "hello").await;
    }
    assert!(mentions(&url, "ada-5e1").await > 0);
    let mut admin = admin_client(&app).await;
    let record = admin
        .erase_user(with_token(erase("ada-5e1"), ADMIN))
        .await
        .unwrap()
        .into_inner()
        .record
        .unwrap();
    let mut scopes: Vec<(String, String)> = record
        .scopes
        .iter()
        .map(|s| (s.bot.clone(), s.scope.clone()))
        .collect();
    scopes.sort();
    assert_eq!(
        scopes,
        [
            ("other".into(), "private_conversation".into()),
            ("other".into(), "user".into()),
            ("remembers".into(), "private_conversation".into()),
            ("remembers".into(), "private_conversation".into()),
            ("remembers".into(), "user".into()),
        ] as [(String, String); 5],
        "{record:?}"
    );
    assert_eq!(record.receipts, 3, "each of Ada's three turns");
    assert_eq!(record.erasure_id.len(), 32);
    let at = std::time::SystemTime::try_from(record.erased_at.unwrap()).unwrap();
    assert!(at.elapsed().unwrap() < Duration::from_secs(60));

    // A full scan finds her id nowhere; Bob and the conversations are as they were.
    assert_eq!(mentions(&url, "ada-5e1").await, 0);
    let bob = admin
        .get_state(with_token(
            pb::GetStateRequest {
                channel_id: "test".into(),
                conversation_id: "room".into(),
                user_id: "bob".into(),
                bot: "remembers".into(),
                ..Default::default()
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    let scopes: Vec<&str> = bob.scopes.iter().map(|s| s.state_json.as_str()).collect();
    assert_eq!(
        scopes,
        [r#"{"count":2}"#, r#"{"said":["hello"]}"#, r#"{"mine":1}"#]
    );
    assert_eq!(bob.receipts.len(), 1, "Bob's receipt only");

    // She comes back as new: nothing of her remembered, the conversation's count going on.
    let again = say(&app, "remembers", "room", "ada-5e1", "hi again").await;
    assert_eq!(texts(&again), ["hi again"]);

    // A user never seen: a record of nothing, not an error.
    let nothing = admin
        .erase_user(with_token(erase("nobody"), ADMIN))
        .await
        .unwrap()
        .into_inner()
        .record
        .unwrap();
    assert!(
        nothing.scopes.is_empty() && nothing.receipts == 0,
        "{nothing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_conversation_removes_its_scopes_and_receipts_for_every_bot() {
    let app = spawn_app(Remembers::new()).await;
    let url = app.database_url().to_owned();
    for (bot, conversation, user) in [
        ("remembers", "room-77a", "ada"),
        ("remembers", "room-77a", "bob"),
        ("other", "room-77a", "ada"),
        ("remembers", "hall", "ada"),
    ] {
        say(&app, bot, conversation, user, "hello").await;
    }
    let mut admin = admin_client(&app).await;
    let record = admin
        .delete_conversation(with_token(
            pb::DeleteConversationRequest {
                channel_id: "test".into(),
                conversation_id: "room-77a".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner()
        .record
        .unwrap();
    let mut scopes: Vec<(&str, &str)> = record
        .scopes
        .iter()
        .map(|s| (s.bot.as_str(), s.scope.as_str()))
        .collect();
    scopes.sort_unstable();
    assert_eq!(
        scopes,
        [
            ("other", "conversation"),
            ("other", "private_conversation"),
            ("remembers", "conversation"),
            ("remembers", "private_conversation"),
            ("remembers", "private_conversation"),
        ]
    );
    assert_eq!(record.receipts, 3);
    assert_eq!(mentions(&url, "room-77a").await, 0);
    // The users' own scopes and the other conversation stay.
    let db = support::pg::session(&url).await;
    let left: i64 = db
        .query_one("SELECT count(*) FROM turnstile_state", &[])
        .await
        .unwrap()
        .get(0);
    // Ada's and Bob's user scopes of `remembers`, Ada's of `other`, and `hall`'s two.
    assert_eq!(left, 5);
}

/// The race erasure must win: a turn that read Ada's data before she was erased, committing
/// after her new data has reached the version it read, must not write the old data back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_read_the_user_before_the_erasure_cannot_write_it_back() {
    let bot = Remembers::new();
    let app = spawn_app(Arc::clone(&bot)).await;
    let url = app.database_url().to_owned();
    for i in 1..=4 {
        say(&app, "remembers", "room", "ada", &format!("secret-{i}")).await;
    }
    // The fifth turn reads her four secrets (user scope at version 4) and waits.
    let racing = tokio::spawn({
        let mut client = app.client.clone();
        async move {
            let mut turn = request(message("room", "ada", "racing"));
            turn.bot = "remembers".into();
            client
                .process_turn(with_token(turn, TURNS))
                .await
                .map(tonic::Response::into_inner)
        }
    });
    bot.reading.notified().await;
    let mut admin = admin_client(&app).await;
    admin
        .erase_user(with_token(erase("ada"), ADMIN))
        .await
        .unwrap();
    // Meanwhile she writes again, in another conversation: her user scope is created anew and
    // written four times, up to the version the waiting turn read were versions to start again
    // at 1. (The waiting turn uses her user scope only.)
    for i in 1..=4 {
        say(&app, "remembers", "hall", "ada", &format!("fresh-{i}")).await;
    }
    bot.go.add_permits(1);
    let answered = racing.await.unwrap().unwrap();
    assert!(
        answered.attempts >= 2,
        "the racing turn replayed: {answered:?}"
    );
    assert_eq!(
        texts(&answered),
        ["fresh-1,fresh-2,fresh-3,fresh-4,racing"],
        "it ran again on the state after the erasure"
    );
    assert_eq!(
        mentions(&url, "secret-").await,
        0,
        "nothing erased came back"
    );
}

#[tokio::test]
async fn erasure_requests_are_refused_without_the_admin_token_or_with_bad_ids() {
    let app = spawn_app(Remembers::new()).await;
    let mut admin = admin_client(&app).await;
    for token in [None, Some("wrong"), Some(TURNS)] {
        let call = match token {
            Some(token) => with_token(erase("ada"), token),
            None => tonic::Request::new(erase("ada")),
        };
        let status = admin.erase_user(call).await.unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{token:?}: {status:?}"
        );
    }
    for (bad, field) in [
        (erase(""), "user_id"),
        (
            pb::EraseUserRequest {
                channel_id: String::new(),
                ..erase("ada")
            },
            "channel_id",
        ),
    ] {
        let status = admin.erase_user(with_token(bad, ADMIN)).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(field), "{status:?}");
    }
    let status = admin
        .delete_conversation(with_token(
            pb::DeleteConversationRequest {
                channel_id: "test".into(),
                conversation_id: String::new(),
            },
            ADMIN,
        ))
        .await
        .unwrap_err();
    assert!(status.message().contains("conversation_id"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_erases_a_user_and_deletes_a_conversation() {
    let app = spawn_app(Remembers::new()).await;
    let url = app.database_url().to_owned();
    say(&app, "remembers", "room", "ada", "hello").await;
    say(&app, "remembers", "hall", "bob", "hello").await;
    let addr = app.addr;
    let (erased, deleted) = tokio::task::spawn_blocking(move || {
        let server = ServerAddr(addr);
        (
            cli_at(
                &server,
                ADMIN,
                &["erase-user", "--channel", "test", "--user", "ada"],
            ),
            cli_at(
                &server,
                ADMIN,
                &[
                    "delete-conversation",
                    "--channel",
                    "test",
                    "--conversation",
                    "hall",
                ],
            ),
        )
    })
    .await
    .unwrap();
    let erased: serde_json::Value = serde_json::from_str(&erased.unwrap()).unwrap();
    assert_eq!(erased["scopes"].as_array().unwrap().len(), 2, "{erased}");
    assert_eq!(erased["receipts"], 1);
    let deleted: serde_json::Value = serde_json::from_str(&deleted.unwrap()).unwrap();
    assert_eq!(deleted["scopes"].as_array().unwrap().len(), 2, "{deleted}");
    assert_eq!(mentions(&url, "ada").await, 0);
    assert_eq!(mentions(&url, "hall").await, 0);
}
