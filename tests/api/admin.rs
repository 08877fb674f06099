//! The admin service on real PostgreSQL: off without admin tokens; with them, only for a caller
//! presenting one (not a `TurnService` token); a conversation's and a user's scopes and its
//! receipts as stored; a bot's conversations a page at a time, with page tokens that cannot be
//! tampered with; and a clear refusal, naming the field, for every bad request.
#![allow(clippy::unwrap_used)]

use crate::support;

use async_trait::async_trait;
use support::{TestApp, message, request};
use tonic::Code;
use tonic_types::StatusExt as _;
use turnstile::grpc::auth::Token;
use turnstile::grpc::pb;
use turnstile::grpc::pb::admin_service_client::AdminServiceClient;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

pub(crate) const ADMIN: &str = "admin-secret";
pub(crate) const TURNS: &str = "turn-secret";

/// Counts the conversation's messages, and writes the user's name and the user's count here.
struct Scopes;

#[async_trait]
impl Bot for Scopes {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let count: u64 = turn.conversation_property("count")?;
        turn.conversation_state().set("count", &(count + 1))?;
        let name = turn.activity().from.as_ref().and_then(|f| f.name.clone());
        turn.user_state()?.set("name", &name)?;
        let mine: u64 = turn.private_conversation_state()?.get("mine")?.unwrap_or(0);
        turn.private_conversation_state()?
            .set("mine", &(mine + 1))?;
        turn.send_text(format!("{}", count + 1));
        Ok(())
    }
}

async fn spawn_app(admin: bool) -> TestApp {
    TestApp::postgres()
        .bots(BotRegistry::new("scopes", Scopes))
        .config(move |c| turnstile::Config {
            auth_tokens: vec![Token::new(TURNS)],
            admin_tokens: if admin {
                vec![Token::new(ADMIN)]
            } else {
                Vec::new()
            },
            ..c
        })
        .spawn()
        .await
}

/// `message` with `token` as its bearer token.
pub(crate) fn with_token<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

pub(crate) async fn admin_client(app: &TestApp) -> AdminServiceClient<tonic::transport::Channel> {
    AdminServiceClient::connect(format!("http://{}", app.addr))
        .await
        .unwrap()
}

pub(crate) async fn turn(app: &TestApp, conversation: &str, user: &str) -> pb::ProcessTurnResponse {
    app.client
        .clone()
        .process_turn(with_token(
            request(message(conversation, user, "hi")),
            TURNS,
        ))
        .await
        .unwrap()
        .into_inner()
}

fn get(conversation: &str, user: &str) -> pb::GetStateRequest {
    pb::GetStateRequest {
        channel_id: "test".into(),
        conversation_id: conversation.into(),
        user_id: user.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn without_admin_tokens_the_service_is_off() {
    let app = spawn_app(false).await;
    let status = admin_client(&app)
        .await
        .get_state(with_token(get("c", ""), TURNS))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    assert!(status.message().contains("admin tokens"), "{status:?}");
}

#[tokio::test]
async fn only_an_admin_token_opens_it() {
    let mut app = spawn_app(true).await;
    let mut admin = admin_client(&app).await;
    for presented in [None, Some("wrong"), Some(TURNS)] {
        let call = match presented {
            None => tonic::Request::new(get("c", "")),
            Some(token) => with_token(get("c", ""), token),
        };
        let status = admin.get_state(call).await.unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{presented:?}: {status:?}"
        );
    }
    admin
        .get_state(with_token(get("c", ""), ADMIN))
        .await
        .unwrap();
    // And the admin token does not run turns.
    let status = app
        .client
        .process_turn(with_token(request(message("c", "ada", "hi")), ADMIN))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn get_state_shows_each_scope_and_the_recent_receipts_as_stored() {
    let app = spawn_app(true).await;
    let started = std::time::SystemTime::now() - std::time::Duration::from_secs(5);
    for _ in 0..3 {
        turn(&app, "room", "ada").await;
    }
    turn(&app, "room", "bob").await;
    let mut admin = admin_client(&app).await;
    let state = admin
        .get_state(with_token(
            pb::GetStateRequest {
                receipts: 2,
                ..get("room", "ada")
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    let scopes: Vec<(&str, &str, u64)> = state
        .scopes
        .iter()
        .map(|s| (s.scope.as_str(), s.state_json.as_str(), s.version))
        .collect();
    assert_eq!(
        scopes,
        [
            ("conversation", r#"{"count":4}"#, 4),
            // Written once: the same name since.
            ("user", r#"{"name":"ada"}"#, 1),
            ("private_conversation", r#"{"mine":3}"#, 3),
        ]
    );
    assert_eq!(state.scopes[0].key, "scopes/test/conversations/room");
    for scope in &state.scopes {
        let at = std::time::SystemTime::try_from(scope.updated_at.unwrap()).unwrap();
        assert!(at > started, "{scope:?}");
    }
    // The two newest receipts, newest first: bob's turn, then ada's last.
    assert_eq!(state.receipts.len(), 2);
    let newest: serde_json::Value = serde_json::from_str(&state.receipts[0].payload_json).unwrap();
    assert_eq!(newest["activities"][0]["text"], "4");
    let at =
        |r: &pb::StoredReceipt| std::time::SystemTime::try_from(r.created_at.unwrap()).unwrap();
    assert!(at(&state.receipts[0]) >= at(&state.receipts[1]));
    assert!(state.receipts[0].activity_id.starts_with("act-"));

    // A conversation nobody wrote: no scopes, no receipts, no error.
    let empty = admin
        .get_state(with_token(get("nowhere", ""), ADMIN))
        .await
        .unwrap()
        .into_inner();
    assert!(
        empty.scopes.is_empty() && empty.receipts.is_empty(),
        "{empty:?}"
    );
}

#[tokio::test]
async fn conversations_are_listed_a_page_at_a_time_and_page_tokens_cannot_be_forged() {
    let app = spawn_app(true).await;
    for conversation in ["a1", "a2", "a3", "a4", "a5", "b1"] {
        turn(&app, conversation, "ada").await;
    }
    let mut admin = admin_client(&app).await;
    let list = |prefix: &str, token: &str| pb::ListConversationsRequest {
        channel_id: "test".into(),
        conversation_prefix: prefix.into(),
        page_size: 2,
        page_token: token.into(),
        ..Default::default()
    };
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = admin
            .list_conversations(with_token(list("a", &token), ADMIN))
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        seen.extend(page.conversations.iter().map(|c| c.conversation_id.clone()));
        assert!(
            page.conversations
                .iter()
                .all(|c| c.version == 1 && c.state_bytes == 11)
        );
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen, ["a1", "a2", "a3", "a4", "a5"]);
    assert_eq!(pages, 3);

    // A token from the first page, changed by hand, or carried to another listing: refused.
    let first = admin
        .list_conversations(with_token(list("a", ""), ADMIN))
        .await
        .unwrap()
        .into_inner()
        .next_page_token;
    let (key, tag) = first.split_once('.').unwrap();
    let forged_key = {
        use base64::Engine as _;
        let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        engine.encode("scopes/test/conversations/a4")
    };
    for (tampered, listing) in [
        (format!("{forged_key}.{tag}"), "a"),
        (format!("{key}.{}", &tag[1..]), "a"),
        ("nonsense".to_owned(), "a"),
        (first.clone(), "b"),
    ] {
        let status = admin
            .list_conversations(with_token(list(listing, &tampered), ADMIN))
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{tampered}: {status:?}"
        );
        let info = status.get_details_error_info().unwrap();
        assert_eq!(info.reason, "INVALID_ADMIN_REQUEST");
        assert_eq!(info.metadata["field"], "page_token");
    }
}

#[tokio::test]
async fn bad_admin_requests_are_refused_naming_the_field() {
    let app = spawn_app(true).await;
    let mut admin = admin_client(&app).await;
    for (bad, field) in [
        (get("", ""), "conversation_id"),
        (
            pb::GetStateRequest {
                channel_id: String::new(),
                ..get("c", "")
            },
            "channel_id",
        ),
        (
            pb::GetStateRequest {
                receipts: 101,
                ..get("c", "")
            },
            "receipts",
        ),
    ] {
        let status = admin.get_state(with_token(bad, ADMIN)).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(status.message().contains(field), "{status:?}");
    }
    let status = admin
        .list_conversations(with_token(
            pb::ListConversationsRequest {
                channel_id: "test".into(),
                page_size: 1001,
                ..Default::default()
            },
            ADMIN,
        ))
        .await
        .unwrap_err();
    assert!(status.message().contains("page_size"), "{status:?}");
    let status = admin
        .get_state(with_token(
            pb::GetStateRequest {
                bot: "nobody".into(),
                ..get("c", "")
            },
            ADMIN,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_cli_reads_a_running_server() {
    let app = spawn_app(true).await;
    for conversation in ["x1", "x2", "x3"] {
        turn(&app, conversation, "ada").await;
    }
    turn(&app, "x1", "ada").await;
    let got = tokio::task::spawn_blocking({
        let server_addr = app.addr;
        move || {
            let server = ServerAddr(server_addr);
            (
                cli_at(
                    &server,
                    ADMIN,
                    &[
                        "get",
                        "--channel",
                        "test",
                        "--conversation",
                        "x1",
                        "--user",
                        "ada",
                    ],
                ),
                cli_at(
                    &server,
                    ADMIN,
                    &["ls", "--channel", "test", "--prefix", "x"],
                ),
                cli_at(&server, "wrong", &["ls", "--channel", "test"]),
                cli_at(
                    &server,
                    ADMIN,
                    &["get", "--channel", "test", "--conversation", ""],
                ),
            )
        }
    })
    .await
    .unwrap();
    let state: serde_json::Value = serde_json::from_str(&got.0.unwrap()).unwrap();
    assert_eq!(state["scopes"][0]["state"]["count"], 2, "{state}");
    assert_eq!(state["scopes"][1]["state"]["name"], "ada", "{state}");
    assert_eq!(
        state["receipts"][0]["answer"]["activities"][0]["text"], "2",
        "{state}"
    );
    let listed: Vec<serde_json::Value> = got
        .1
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let ids: Vec<&str> = listed
        .iter()
        .map(|c| c["conversationId"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["x1", "x2", "x3"]);
    assert_eq!(listed[0]["version"], 2);
    assert!(got.2.unwrap_err().contains("Unauthenticated"));
    assert!(got.3.unwrap_err().contains("conversation_id"));
}

/// A server's address, for the CLI run on a blocking thread.
pub(crate) struct ServerAddr(pub(crate) std::net::SocketAddr);

/// `turnstile state …` against `server`, with `token`: its stdout, or its stderr when it failed.
pub(crate) fn cli_at(server: &ServerAddr, token: &str, args: &[&str]) -> Result<String, String> {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("state")
        .args(args)
        .args(["--address", &format!("http://{}", server.0)])
        .env("TURNSTILE_ADMIN_TOKEN", token)
        .output()
        .unwrap();
    if output.status.success() {
        Ok(String::from_utf8(output.stdout).unwrap())
    } else {
        Err(String::from_utf8(output.stderr).unwrap())
    }
}
