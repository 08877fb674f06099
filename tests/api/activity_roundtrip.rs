//! Activities must survive the gateway unchanged: Bot Framework JSON → `Activity` → JSON, and
//! JSON → `Activity` → protobuf bytes → `Activity` → JSON, for the Bot Framework SDK's own
//! conformance transcripts and for a hand-written activity that uses every member.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use prost::Message;
use serde_json::{Value, json};
use turnstile::activity::{Activity, JsonMap};
use turnstile::grpc::pb;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read_json(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

fn from_json(v: &Value) -> Activity {
    Activity::from_json(v.clone()).expect("fixture activities are JSON objects")
}

/// JSON → Activity → pb::Activity → bytes → pb::Activity → Activity → JSON.
fn through_protobuf(v: &Value) -> Value {
    let bytes = pb::Activity::from(from_json(v)).encode_to_vec();
    let decoded = pb::Activity::decode(bytes.as_slice()).expect("our own encoding decodes");
    Activity::from(decoded).to_json()
}

/// Every activity of every `*.transcript`, with the file it came from.
fn transcript_activities() -> Vec<(String, Value)> {
    let dir = fixtures().join("transcripts");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/fixtures/transcripts exists")
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "transcript"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 9,
        "expected the 9 conformance transcripts, found {}",
        files.len()
    );
    let mut activities = Vec::new();
    for file in files {
        let name = file
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let Value::Array(items) = read_json(&file) else {
            panic!("{name} is not a JSON array of activities");
        };
        assert!(!items.is_empty(), "{name} has no activities");
        activities.extend(items.into_iter().map(|item| (name.clone(), item)));
    }
    assert!(!activities.is_empty());
    activities
}

#[test]
fn transcripts_round_trip_through_json() {
    let activities = transcript_activities();
    for (file, original) in &activities {
        assert_eq!(&from_json(original).to_json(), original, "in {file}");
    }
}

#[test]
fn transcripts_round_trip_through_protobuf_bytes() {
    for (file, original) in &transcript_activities() {
        assert_eq!(&through_protobuf(original), original, "in {file}");
    }
}

#[test]
fn transcripts_fill_the_typed_fields() {
    for (file, original) in &transcript_activities() {
        let activity = from_json(original);
        // The only leftovers in these transcripts are the SDK's empty `membersRemoved` lists.
        for (key, value) in &activity.properties {
            assert_eq!(
                (key.as_str(), value),
                ("membersRemoved", &json!([])),
                "unexpected leftover in {file}"
            );
        }
        assert!(activity.activity_type.is_some(), "type in {file}");
        assert!(activity.id.is_some(), "id in {file}");
        assert!(activity.timestamp.is_some(), "timestamp in {file}");
        assert_eq!(
            activity.channel_id.as_deref(),
            original["channelId"].as_str()
        );
        assert_eq!(
            activity.conversation_id(),
            original["conversation"]["id"].as_str()
        );
        assert!(
            activity.conversation_id().is_some(),
            "conversation.id in {file}"
        );
        assert_eq!(activity.from_id(), original["from"]["id"].as_str());
        assert_eq!(activity.text.as_deref(), original["text"].as_str());
        let accounts = activity
            .from
            .iter()
            .chain(&activity.recipient)
            .chain(&activity.members_added);
        for account in accounts {
            assert!(account.id.is_some() && account.role.is_some(), "in {file}");
            assert!(account.properties.is_empty(), "in {file}");
        }
        if activity.is_type("message") {
            assert!(
                activity.from_id().is_some(),
                "message without from.id in {file}"
            );
            assert!(activity.text.is_some(), "message without text in {file}");
        } else {
            assert!(!activity.members_added.is_empty(), "in {file}");
        }
    }
}

/// The members an activity's JSON has from its typed fields alone.
fn typed_members(activity: &Activity) -> BTreeSet<String> {
    let typed_only = Activity {
        properties: JsonMap::new(),
        ..activity.clone()
    }
    .to_json();
    typed_only
        .as_object()
        .expect("activities are written as objects")
        .keys()
        .cloned()
        .collect()
}

fn full() -> Value {
    read_json(&fixtures().join("activities/full.json"))
}

/// The JSON names of every member of `definitions.Activity` in the Bot Framework schema, plus
/// `callerId`, which the SDKs send although the schema predates it.
const ACTIVITY_MEMBERS: [&str; 42] = [
    "type",
    "id",
    "timestamp",
    "localTimestamp",
    "localTimezone",
    "serviceUrl",
    "channelId",
    "from",
    "conversation",
    "recipient",
    "textFormat",
    "attachmentLayout",
    "membersAdded",
    "membersRemoved",
    "reactionsAdded",
    "reactionsRemoved",
    "topicName",
    "historyDisclosed",
    "locale",
    "text",
    "speak",
    "inputHint",
    "summary",
    "suggestedActions",
    "attachments",
    "entities",
    "channelData",
    "action",
    "replyToId",
    "label",
    "valueType",
    "value",
    "name",
    "relatesTo",
    "code",
    "expiration",
    "importance",
    "deliveryMode",
    "listenFor",
    "textHighlights",
    "semanticAction",
    "callerId",
];

#[test]
fn full_activity_round_trips_through_json() {
    let original = full();
    assert_eq!(from_json(&original).to_json(), original);
}

#[test]
fn full_activity_round_trips_through_protobuf_bytes() {
    let original = full();
    assert_eq!(through_protobuf(&original), original);
}

#[test]
fn full_activity_uses_every_typed_field() {
    let activity = from_json(&full());
    assert_eq!(
        typed_members(&activity),
        BTreeSet::from(ACTIVITY_MEMBERS.map(String::from))
    );

    let leftovers: BTreeSet<&str> = activity.properties.keys().map(String::as_str).collect();
    assert_eq!(
        leftovers,
        BTreeSet::from([
            "Text",
            "membersAddedCount",
            "x-empty-list",
            "x-explicit-null",
            "x-unknown-top"
        ])
    );
    assert_eq!(activity.properties["x-explicit-null"], Value::Null);
    assert_eq!(activity.properties["x-empty-list"], json!([]));
}

#[test]
fn full_activity_typed_values_reach_the_proto() {
    let p = pb::Activity::from(from_json(&full()));
    let from = p.from.as_ref().expect("from");
    assert_eq!(from.id.as_deref(), Some("29:1abcUser"));
    assert_eq!(from.name.as_deref(), Some("Zoë Example"));
    assert_eq!(
        from.aad_object_id.as_deref(),
        Some("6d5e2a0b-0000-4000-8000-000000000001")
    );
    assert!(
        from.properties
            .as_ref()
            .is_some_and(|s| s.fields.contains_key("x-nickname"))
    );
    let conversation = p.conversation.as_ref().expect("conversation");
    assert_eq!(conversation.id.as_deref(), Some("19:meeting_abc@thread.v2"));
    assert_eq!(
        conversation.tenant_id.as_deref(),
        Some("72f988bf-0000-4000-8000-000000000002")
    );
    assert_eq!(conversation.is_group, Some(true));
    assert_eq!(conversation.conversation_type.as_deref(), Some("groupChat"));
    assert_eq!(
        p.recipient.as_ref().and_then(|r| r.role.as_deref()),
        Some("bot")
    );
    assert_eq!(p.r#type.as_deref(), Some("message"));
    assert_eq!(
        p.local_timestamp.as_deref(),
        Some("2019-07-01T10:15:00.123-07:00")
    );
    assert_eq!(p.timestamp.as_deref(), Some("2019-07-01T17:15:00.1234567Z"));
    assert_eq!(p.history_disclosed, Some(false));
    assert_eq!(p.delivery_mode.as_deref(), Some("expectReplies"));
    assert_eq!(p.caller_id.as_deref(), Some("urn:botframework:azure"));
    assert_eq!(p.listen_for.len(), 3);

    // The second member added has a null name and a numeric role: both stay in its properties.
    assert_eq!(p.members_added.len(), 2);
    let odd = &p.members_added[1];
    assert_eq!(odd.id.as_deref(), Some("29:odd-member"));
    assert_eq!((odd.name.as_deref(), odd.role.as_deref()), (None, None));
    let odd_props = odd.properties.as_ref().expect("odd member properties");
    assert_eq!(
        odd_props
            .fields
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        ["name", "role"]
    );
    assert_eq!(p.members_removed.len(), 1);
    assert_eq!(p.reactions_added[1].r#type.as_deref(), Some("plusOne"));
    assert_eq!(p.reactions_removed[0].r#type.as_deref(), Some("heart"));

    assert!(matches!(
        p.attachments[0]
            .content
            .as_ref()
            .and_then(|c| c.kind.as_ref()),
        Some(prost_types::value::Kind::StructValue(_))
    ));
    assert!(matches!(
        p.attachments[1].content.as_ref().and_then(|c| c.kind.as_ref()),
        Some(prost_types::value::Kind::StringValue(s)) if s.starts_with("plain string")
    ));
    assert_eq!(
        p.attachments[0].thumbnail_url.as_deref(),
        Some("https://example.com/thumb.png")
    );

    let entity_types: Vec<_> = p
        .entities
        .iter()
        .map(
            |e| match e.fields.get("type").and_then(|v| v.kind.as_ref()) {
                Some(prost_types::value::Kind::StringValue(s)) => s.as_str(),
                _ => "",
            },
        )
        .collect();
    assert_eq!(
        entity_types,
        ["mention", "clientInfo", "https://schema.org/Place"]
    );

    let suggested = p.suggested_actions.as_ref().expect("suggestedActions");
    assert_eq!(suggested.to, ["29:1abcUser", "29:new-member"]);
    assert_eq!(suggested.actions.len(), 2);
    let first = &suggested.actions[0];
    assert_eq!(first.r#type.as_deref(), Some("imBack"));
    assert_eq!(
        first.display_text.as_deref(),
        Some("I'll take a Margherita")
    );
    assert_eq!(first.image_alt_text.as_deref(), Some("A Margherita pizza"));
    assert!(first.channel_data.is_some() && first.value.is_some());

    let relates_to = p.relates_to.as_ref().expect("relatesTo");
    assert_eq!(relates_to.activity_id.as_deref(), Some("1234567890abcdee"));
    assert_eq!(relates_to.locale.as_deref(), Some("en-US"));
    assert_eq!(
        relates_to.bot.as_ref().and_then(|b| b.id.as_deref()),
        Some("28:bot-app-id")
    );
    // `"isGroup": "yes"` is not a bool: typed conversation, odd member kept beside it.
    let related_conversation = relates_to.conversation.as_ref().expect("conversation");
    assert_eq!(related_conversation.is_group, None);
    assert!(related_conversation.properties.is_some());

    assert_eq!(p.text_highlights[0].occurrence, Some(1.0));
    assert_eq!(p.text_highlights[1].occurrence, Some(2.5));

    let semantic = p.semantic_action.as_ref().expect("semanticAction");
    assert_eq!(semantic.state.as_deref(), Some("continue"));
    assert_eq!(semantic.entities.as_ref().map(|e| e.fields.len()), Some(2));

    // Leftover top-level members travel in `properties`, the explicit null included.
    let properties = p.properties.as_ref().expect("properties");
    assert!(matches!(
        properties.fields["x-explicit-null"].kind,
        Some(prost_types::value::Kind::NullValue(_))
    ));
    assert_eq!(properties.fields.len(), 5);
}

#[test]
fn ill_shaped_known_members_are_kept_verbatim() {
    let original = read_json(&fixtures().join("activities/odd.json"));
    let activity = from_json(&original);
    assert_eq!(activity.to_json(), original);
    assert_eq!(through_protobuf(&original), original);

    // Only `type`, `from`, `suggestedActions`, `textHighlights`, `semanticAction` and `relatesTo`
    // fit their typed fields; everything else is left as it came.
    let typed = typed_members(&activity);
    assert_eq!(
        typed,
        BTreeSet::from(
            [
                "type",
                "from",
                "suggestedActions",
                "textHighlights",
                "semanticAction",
                "relatesTo"
            ]
            .map(String::from)
        )
    );
    assert_eq!(activity.properties["historyDisclosed"], json!("yes"));
    assert_eq!(activity.properties["membersAdded"], json!([]));
    assert_eq!(activity.properties["text"], Value::Null);
    assert_eq!(activity.properties["listenFor"], json!(["a", 1]));
    assert_eq!(
        activity.properties["membersRemoved"],
        json!([{"id": "u2"}, "u3"])
    );

    let from = activity.from.as_ref().expect("from is an object");
    assert_eq!(from.id.as_deref(), Some("u1"));
    assert_eq!(from.properties["name"], Value::Null);
    assert_eq!(from.properties["role"], json!(["user"]));
    let suggested = activity
        .suggested_actions
        .as_ref()
        .expect("suggestedActions");
    assert!(suggested.to.is_empty());
    assert_eq!(suggested.properties["to"], json!([]));
    assert_eq!(suggested.actions[0].kind.as_deref(), Some("imBack"));
    assert_eq!(suggested.actions[0].properties["title"], json!(false));
    assert_eq!(activity.text_highlights[0].occurrence, None);
    let semantic = activity.semantic_action.as_ref().expect("semanticAction");
    assert_eq!(semantic.entities, None);
    assert_eq!(
        semantic.properties["entities"],
        json!(["not", "an", "object"])
    );
}

#[test]
fn non_objects_are_not_activities() {
    for v in [json!(null), json!([]), json!("message"), json!(1)] {
        assert!(Activity::from_json(v).is_err());
    }
    assert_eq!(
        Activity::from_json(json!({})).ok(),
        Some(Activity::default())
    );
}
