//! Activities as JSON text over gRPC: what a channel sent reaches the bot verbatim — members no
//! schema names, `null`s, empty lists, numbers as spelled — and what the bot sends comes back as
//! JSON just as verbatim, first time and on a redelivery answered from the receipt.
#![allow(clippy::unwrap_used)]

use crate::support;

use async_trait::async_trait;
use serde_json::{Value, json};
use support::TestApp;
use tonic::Code;
use turnstile::activity::Activity;
use turnstile::grpc::pb;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

/// Replies twice: once with the activity it saw, as JSON, in `value`; once as a Teams-style
/// message carrying the inbound activity's unnamed members and channel data as its own.
struct Mirror;

#[async_trait]
impl Bot for Mirror {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let seen = turn.activity().clone();
        turn.send(Activity {
            value: Some(seen.to_json()),
            ..Activity::message("seen")
        });
        turn.send(Activity {
            channel_data: seen.channel_data.clone(),
            properties: seen.properties.clone(),
            ..Activity::message("echo")
        });
        Ok(())
    }
}

/// A Teams message as Teams posts it (trimmed), with the members a protobuf JSON parser drops.
fn teams_message(id: &str) -> Value {
    json!({
        "type": "message",
        "id": id,
        "timestamp": "2026-11-23T10:15:00.1234567Z",
        "localTimestamp": "2026-11-23T11:15:00.1234567+01:00",
        "serviceUrl": "https://smba.trafficmanager.net/emea/",
        "channelId": "msteams",
        "from": {"id": "29:1abc", "name": "Ada", "aadObjectId": "6f1e", "userPrincipalName": "ada@example.com"},
        "conversation": {"id": "a:1xyz", "conversationType": "personal", "tenantId": "72f9"},
        "recipient": {"id": "28:bot", "name": "Pizza"},
        "text": "add ham",
        "textFormat": "plain",
        "locale": "en-GB",
        "entities": [{"type": "clientInfo", "locale": "en-GB", "country": "GB", "platform": "Web"}],
        "channelData": {"tenant": {"id": "72f9"}, "legacy": {"replyToId": "1:x"}},
        "legacy": {"replyToId": "1:1abc", "version": 1.0},
        "cci_trace_id": "c0ffee",
        "cci_weight": 2.50,
        "recipients": [],
        "attachments": [],
        "speak": null
    })
}

async fn turn(
    client: &mut pb::turn_service_client::TurnServiceClient<tonic::transport::Channel>,
    activity_json: &str,
) -> pb::ProcessTurnResponse {
    client
        .process_turn(pb::ProcessTurnRequest::json(activity_json, "mirror").with_json_replies())
        .await
        .unwrap()
        .into_inner()
}

fn parsed(texts: &[String]) -> Vec<Value> {
    texts
        .iter()
        .map(|t| serde_json::from_str(t).unwrap())
        .collect()
}

#[tokio::test]
async fn unnamed_members_reach_the_bot_and_come_back_verbatim() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("mirror", Mirror))
        .spawn()
        .await;
    let sent = teams_message("1700000000001");
    let text = sent.to_string();

    let first = turn(&mut app.client, &text).await;
    assert!(first.activities.is_empty(), "replies come as JSON only");
    let replies = parsed(&first.activities_json);
    assert_eq!(replies.len(), 2);
    assert_eq!(
        replies[0]["value"], sent,
        "the bot saw exactly what the channel sent"
    );
    assert!(
        first.activities_json[0].contains(r#""version":1.0"#)
            && first.activities_json[0].contains(r#""cci_weight":2.5"#),
        "numbers keep their spelling: {}",
        first.activities_json[0]
    );
    for member in [
        "legacy",
        "cci_trace_id",
        "cci_weight",
        "recipients",
        "attachments",
        "speak",
    ] {
        assert_eq!(replies[1][member], sent[member], "`{member}` came back");
        assert!(replies[1].get(member).is_some(), "`{member}` is present");
    }
    assert_eq!(replies[1]["channelData"], sent["channelData"]);
    assert_eq!(replies[1]["replyToId"], "1700000000001");
    assert_eq!(replies[1]["conversation"], sent["conversation"]);

    let again = turn(&mut app.client, &text).await;
    assert!(again.redelivered, "answered from the receipt");
    assert_eq!(
        parsed(&again.activities_json),
        replies,
        "the same JSON replies"
    );
}

#[tokio::test]
async fn typed_and_json_forms_mix_and_the_reply_form_follows_the_flag() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("mirror", Mirror))
        .spawn()
        .await;
    let typed = app
        .client
        .process_turn(pb::ProcessTurnRequest::json(
            teams_message("j1").to_string(),
            "mirror",
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(typed.activities_json.is_empty());
    assert_eq!(typed.activities.len(), 2);
    assert_eq!(typed.activities[1].text.as_deref(), Some("echo"));
    let legacy = typed.activities[1]
        .properties
        .as_ref()
        .and_then(|p| p.fields.get("legacy"));
    assert!(
        legacy.is_some(),
        "unnamed members ride in typed `properties` too"
    );

    let json = app
        .client
        .process_turn(
            pb::ProcessTurnRequest::typed(support::message("c2", "alice", "hi"), "mirror")
                .with_json_replies(),
        )
        .await
        .unwrap()
        .into_inner();
    assert!(json.activities.is_empty());
    let replies = parsed(&json.activities_json);
    assert_eq!(replies[0]["value"]["text"], "hi");
}

#[tokio::test]
async fn broken_json_is_invalid_argument_naming_activity_json_and_runs_nothing() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("mirror", Mirror))
        .spawn()
        .await;
    let no_conversation = {
        let mut v = teams_message("j2");
        v.as_object_mut().unwrap().remove("conversation");
        v.to_string()
    };
    for (text, field) in [
        ("{\"type\": \"message\",", "`activity_json`"),
        ("[{\"type\": \"message\"}]", "`activity_json`"),
        ("null", "`activity_json`"),
        (no_conversation.as_str(), "`conversation`"),
    ] {
        let status = app
            .client
            .process_turn(pb::ProcessTurnRequest::json(text, "mirror"))
            .await
            .expect_err(text);
        assert_eq!(status.code(), Code::InvalidArgument, "{text}: {status:?}");
        assert!(
            status.message().contains(field),
            "{text}: {}",
            status.message()
        );
    }
    let long = {
        let mut v = teams_message("j3");
        v["text"] = json!("x".repeat(65 * 1024));
        v.to_string()
    };
    let status = app
        .client
        .process_turn(pb::ProcessTurnRequest::json(long, "mirror"))
        .await
        .expect_err("over the text limit");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("`text`"), "{}", status.message());
}
