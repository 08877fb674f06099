//! Hostile and broken input: every case gets a clear status naming the problem, the server stays
//! up, and no state changes.
#![allow(clippy::unwrap_used)]

use crate::support;

use async_trait::async_trait;
use prost::Message as _;
use prost_types::value::Kind;
use support::raw::send_raw;
use support::{TestApp, message, request, say, spawn_app, texts};
use tonic::Code;
use turnstile::grpc::pb;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

fn nested_list(levels: usize) -> prost_types::Value {
    let mut v = prost_types::Value {
        kind: Some(Kind::StringValue("deep".into())),
    };
    for _ in 0..levels {
        v = prost_types::Value {
            kind: Some(Kind::ListValue(prost_types::ListValue { values: vec![v] })),
        };
    }
    v
}

fn expect_invalid(
    result: Result<tonic::Response<pb::ProcessTurnResponse>, tonic::Status>,
    naming: &str,
) {
    let status = result.expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains(naming),
        "should name {naming}: {:?}",
        status.message()
    );
}

#[tokio::test]
async fn broken_and_oversized_input_is_refused_by_name_and_changes_nothing() {
    let mut app = spawn_app().await;
    say(&mut app.client, "c1", "add ham").await;
    let add = || message("c1", "alice", "add pineapple");

    // Bytes that are no protobuf at all, and a truncated valid request.
    let status = send_raw(app.addr, vec![0xff, 0xff, 0xff, 0xff, 0x0f, 0x01], None).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("not a valid ProcessTurnRequest"),
        "{status:?}"
    );
    let whole = request(add()).encode_to_vec();
    let status = send_raw(app.addr, whole[..whole.len() / 2].to_vec(), None).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    // Oversized fields, each named.
    let limits = turnstile::grpc::limits::Limits::default();
    let big_text = pb::Activity {
        text: Some("add ".to_owned() + &"x".repeat(limits.max_text_bytes)),
        ..add()
    };
    expect_invalid(app.client.process_turn(request(big_text)).await, "`text`");
    let big_attachment = pb::Activity {
        attachments: vec![pb::Attachment {
            content_type: Some("text/plain".into()),
            content: Some(prost_types::Value {
                kind: Some(Kind::StringValue("a".repeat(limits.max_attachments_bytes))),
            }),
            ..Default::default()
        }],
        ..add()
    };
    expect_invalid(
        app.client.process_turn(request(big_attachment)).await,
        "`attachments`",
    );
    let big_channel_data = pb::Activity {
        channel_data: Some(prost_types::Value {
            kind: Some(Kind::StringValue(
                "c".repeat(limits.max_channel_data_bytes + 1),
            )),
        }),
        ..add()
    };
    expect_invalid(
        app.client.process_turn(request(big_channel_data)).await,
        "`channel_data`",
    );
    let everything_big = pb::Activity {
        text: Some("t".repeat(limits.max_activity_bytes)),
        ..add()
    };
    expect_invalid(
        app.client.process_turn(request(everything_big)).await,
        "over the 262144-byte limit",
    );

    // Deep nesting: past our limit, a named refusal; past prost's recursion limit, the codec's.
    let deep = pb::Activity {
        value: Some(nested_list(limits.max_json_depth + 1)),
        ..add()
    };
    expect_invalid(
        app.client.process_turn(request(deep)).await,
        "`value` is nested 33 levels deep",
    );
    let deeper = request(pb::Activity {
        channel_data: Some(nested_list(200)),
        ..add()
    });
    let status = send_raw(app.addr, deeper.encode_to_vec(), None).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("recursion limit"), "{status:?}");

    // Ids with control characters.
    for (field, activity) in [
        (
            "`id`",
            pb::Activity {
                id: Some("a\nb".into()),
                ..add()
            },
        ),
        (
            "`channel_id`",
            pb::Activity {
                channel_id: Some("te\u{1b}st".into()),
                ..add()
            },
        ),
        (
            "`from.id`",
            pb::Activity {
                from: Some(pb::ChannelAccount {
                    id: Some("al\u{0}ice".into()),
                    ..Default::default()
                }),
                ..add()
            },
        ),
    ] {
        expect_invalid(app.client.process_turn(request(activity)).await, field);
    }

    // The server is still up, and nothing above changed the order.
    let shown = say(&mut app.client, "c1", "show").await;
    assert_eq!(texts(&shown), ["Your pizza has: ham."]);
    assert_eq!(shown.version, 1);
}

/// Keeps a secret in private conversation state and tells anyone what is in conversation state.
struct Secrets;

#[async_trait]
impl Bot for Secrets {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let text = turn.text().to_owned();
        if let Some(secret) = text.strip_prefix("secret ") {
            turn.private_conversation_state()?.set("secret", secret)?;
            turn.send_text("kept");
        } else {
            let shared = serde_json::Value::Object(turn.conversation_state().properties().clone());
            let private =
                serde_json::Value::Object(turn.private_conversation_state()?.properties().clone());
            turn.send_text(format!("shared: {shared} private: {private}"));
        }
        Ok(())
    }
}

#[tokio::test]
async fn ids_with_separators_cannot_reach_anyone_elses_state() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("secrets", Secrets))
        .spawn()
        .await;
    let send =
        |conversation: &str, user: &str, text: &str| request(message(conversation, user, text));

    let kept = app
        .client
        .process_turn(send("c", "alice", "secret 4711"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&kept), ["kept"]);

    // Mallory crafts a conversation whose conversation-scope key would, unescaped, be Alice's
    // private key in `c`; and a user id that would make his private key hers.
    for (conversation, user) in [
        ("c/users/alice", "mallory"),
        ("c", "alice/../alice"),
        ("c%2Fusers%2Falice", "mallory"),
    ] {
        let peek = app
            .client
            .process_turn(send(conversation, user, "peek"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            texts(&peek),
            ["shared: {} private: {}"],
            "{conversation} / {user} saw someone else's state"
        );
    }
    let alice = app
        .client
        .process_turn(send("c", "alice", "peek"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&alice), [r#"shared: {} private: {"secret":"4711"}"#]);
}
