//! Property tests for the activity conversions: any JSON object a channel might send, known
//! members well- or ill-typed and unknown members mixed in, survives JSON → `Activity` →
//! protobuf bytes → `Activity` → JSON unchanged; and whatever protobuf a client sends converts
//! without panicking into JSON that is itself stable under further round trips.

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::sample::subsequence;
use prost::Message;
use prost_types::value::Kind as PbKind;
use serde_json::Value;
use turnstile::activity::{
    Activity, Attachment, CardAction, ChannelAccount, ConversationAccount, ConversationReference,
    JsonMap, MessageReaction, SemanticAction, SuggestedActions, TextHighlight,
};
use turnstile::grpc::pb;

/// The JSON shape a known member expects.
#[derive(Clone, Copy, Debug)]
enum Shape {
    Str,
    Bool,
    Number,
    Any,
    Object(&'static [Member]),
    ObjectList(&'static [Member]),
    StrList,
    FreeObject,
    FreeObjectList,
}

type Member = (&'static str, Shape);

use Shape::*;

const CHANNEL_ACCOUNT: &[Member] = &[
    ("id", Str),
    ("name", Str),
    ("aadObjectId", Str),
    ("role", Str),
];
const CONVERSATION_ACCOUNT: &[Member] = &[
    ("id", Str),
    ("name", Str),
    ("isGroup", Bool),
    ("conversationType", Str),
    ("tenantId", Str),
    ("role", Str),
    ("aadObjectId", Str),
];
const MESSAGE_REACTION: &[Member] = &[("type", Str)];
const ATTACHMENT: &[Member] = &[
    ("contentType", Str),
    ("contentUrl", Str),
    ("content", Any),
    ("name", Str),
    ("thumbnailUrl", Str),
];
const CARD_ACTION: &[Member] = &[
    ("type", Str),
    ("title", Str),
    ("image", Str),
    ("text", Str),
    ("displayText", Str),
    ("value", Any),
    ("channelData", Any),
    ("imageAltText", Str),
];
const SUGGESTED_ACTIONS: &[Member] = &[("to", StrList), ("actions", ObjectList(CARD_ACTION))];
const CONVERSATION_REFERENCE: &[Member] = &[
    ("activityId", Str),
    ("user", Object(CHANNEL_ACCOUNT)),
    ("bot", Object(CHANNEL_ACCOUNT)),
    ("conversation", Object(CONVERSATION_ACCOUNT)),
    ("channelId", Str),
    ("serviceUrl", Str),
    ("locale", Str),
];
const TEXT_HIGHLIGHT: &[Member] = &[("text", Str), ("occurrence", Number)];
const SEMANTIC_ACTION: &[Member] = &[("id", Str), ("state", Str), ("entities", FreeObject)];
const ACTIVITY: &[Member] = &[
    ("type", Str),
    ("id", Str),
    ("timestamp", Str),
    ("localTimestamp", Str),
    ("localTimezone", Str),
    ("serviceUrl", Str),
    ("channelId", Str),
    ("from", Object(CHANNEL_ACCOUNT)),
    ("conversation", Object(CONVERSATION_ACCOUNT)),
    ("recipient", Object(CHANNEL_ACCOUNT)),
    ("textFormat", Str),
    ("attachmentLayout", Str),
    ("membersAdded", ObjectList(CHANNEL_ACCOUNT)),
    ("membersRemoved", ObjectList(CHANNEL_ACCOUNT)),
    ("reactionsAdded", ObjectList(MESSAGE_REACTION)),
    ("reactionsRemoved", ObjectList(MESSAGE_REACTION)),
    ("topicName", Str),
    ("historyDisclosed", Bool),
    ("locale", Str),
    ("text", Str),
    ("speak", Str),
    ("inputHint", Str),
    ("summary", Str),
    ("suggestedActions", Object(SUGGESTED_ACTIONS)),
    ("attachments", ObjectList(ATTACHMENT)),
    ("entities", FreeObjectList),
    ("channelData", Any),
    ("action", Str),
    ("replyToId", Str),
    ("label", Str),
    ("valueType", Str),
    ("value", Any),
    ("name", Str),
    ("relatesTo", Object(CONVERSATION_REFERENCE)),
    ("code", Str),
    ("expiration", Str),
    ("importance", Str),
    ("deliveryMode", Str),
    ("listenFor", StrList),
    ("textHighlights", ObjectList(TEXT_HIGHLIGHT)),
    ("semanticAction", Object(SEMANTIC_ACTION)),
    ("callerId", Str),
];

const MAX_SAFE_INTEGER: i64 = 1 << 53;

fn text() -> BoxedStrategy<String> {
    prop_oneof!["[a-zA-Z0-9 :_-]{0,8}", "\\PC{0,12}", any::<String>(),].boxed()
}

/// Member names: mostly unknown ones, but also known names in the wrong place.
fn member_name() -> BoxedStrategy<String> {
    let known: Vec<&'static str> = ACTIVITY
        .iter()
        .chain(CONVERSATION_ACCOUNT)
        .chain(CARD_ACTION)
        .chain(ATTACHMENT)
        .chain(SUGGESTED_ACTIONS)
        .chain(TEXT_HIGHLIGHT)
        .map(|(name, _)| *name)
        .collect();
    prop_oneof![
        3 => "[a-zA-Z_\\-ü€]{1,10}",
        1 => proptest::sample::select(known).prop_map(str::to_owned),
        1 => text(),
    ]
    .boxed()
}

/// Integers within ±2^53 and non-integral floats: the numbers `f64` carries exactly and gives
/// back in the same JSON form.
fn number() -> BoxedStrategy<Value> {
    let float = prop::num::f64::NORMAL | prop::num::f64::SUBNORMAL;
    prop_oneof![
        (-MAX_SAFE_INTEGER..=MAX_SAFE_INTEGER).prop_map(Value::from),
        (-1000_i64..1000).prop_map(Value::from),
        float.prop_map(|x| {
            // Scale integral values (all normals beyond 2^52 are) below 1, keeping them exact.
            let mut y = x;
            while y.fract() == 0.0 {
                y /= 1024.0;
            }
            Value::from(y)
        }),
    ]
    .boxed()
}

fn json_leaf() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text().prop_map(Value::String),
    ]
    .boxed()
}

fn to_map(members: impl IntoIterator<Item = (String, Value)>) -> JsonMap {
    members.into_iter().collect()
}

/// Any JSON value, nested at most four levels deep.
fn json() -> BoxedStrategy<Value> {
    json_leaf()
        .prop_recursive(4, 48, 5, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..5).prop_map(Value::Array),
                btree_map(member_name(), inner, 0..5).prop_map(|m| Value::Object(to_map(m))),
            ]
        })
        .boxed()
}

fn json_object() -> BoxedStrategy<Value> {
    btree_map(member_name(), json(), 0..5)
        .prop_map(|m| Value::Object(to_map(m)))
        .boxed()
}

/// A value for a member of `shape`: usually well-typed (lists possibly empty), sometimes any
/// JSON at all.
fn member_value(shape: Shape) -> BoxedStrategy<Value> {
    let well_typed = match shape {
        Str => text().prop_map(Value::String).boxed(),
        Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        Number => number(),
        Any => json(),
        Object(members) => object_of(members),
        ObjectList(members) => vec(object_of(members), 0..4).prop_map(Value::Array).boxed(),
        StrList => vec(text().prop_map(Value::String), 0..4)
            .prop_map(Value::Array)
            .boxed(),
        FreeObject => json_object(),
        FreeObjectList => vec(json_object(), 0..4).prop_map(Value::Array).boxed(),
    };
    prop_oneof![4 => well_typed, 1 => json()].boxed()
}

/// A JSON object with some of `members` and some unknown members.
fn object_of(members: &'static [Member]) -> BoxedStrategy<Value> {
    let known = subsequence(members.to_vec(), 0..=members.len()).prop_flat_map(|chosen| {
        chosen
            .into_iter()
            .map(|(name, shape)| member_value(shape).prop_map(move |v| (name.to_owned(), v)))
            .collect::<Vec<_>>()
    });
    let unknown = btree_map(member_name(), json(), 0..3);
    (known, unknown)
        .prop_map(|(known, unknown)| {
            // Known members last, so that they win over an unknown one of the same name.
            Value::Object(to_map(unknown.into_iter().chain(known)))
        })
        .boxed()
}

fn through_protobuf(activity: Activity) -> Value {
    let bytes = pb::Activity::from(activity).encode_to_vec();
    let decoded = pb::Activity::decode(bytes.as_slice()).expect("our own encoding decodes");
    Activity::from(decoded).to_json()
}

/// `google.protobuf.Value`s JSON cannot produce: no kind, odd null enums, NaN, infinities,
/// huge integers, `-0.0`, integral floats.
fn pb_value() -> BoxedStrategy<prost_types::Value> {
    let leaf = prop_oneof![
        Just(None),
        any::<i32>().prop_map(|n| Some(PbKind::NullValue(n))),
        any::<f64>().prop_map(|x| Some(PbKind::NumberValue(x))),
        prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
            Just(2.0),
            Just(1e300),
            Just(9_007_199_254_740_993.0),
        ]
        .prop_map(|x| Some(PbKind::NumberValue(x))),
        text().prop_map(|s| Some(PbKind::StringValue(s))),
        any::<bool>().prop_map(|b| Some(PbKind::BoolValue(b))),
    ]
    .prop_map(|kind| prost_types::Value { kind });
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(|values| prost_types::Value {
                kind: Some(PbKind::ListValue(prost_types::ListValue { values }))
            }),
            pb_struct_of(inner).prop_map(|s| prost_types::Value {
                kind: Some(PbKind::StructValue(s))
            }),
        ]
    })
    .boxed()
}

fn pb_struct_of(
    values: impl Strategy<Value = prost_types::Value>,
) -> impl Strategy<Value = prost_types::Struct> {
    btree_map(member_name(), values, 0..4).prop_map(|fields| prost_types::Struct { fields })
}

/// A protobuf activity built from a JSON one, with odd values planted where `Value`s, `Struct`s
/// and doubles live.
fn odd_pb_activity() -> impl Strategy<Value = pb::Activity> {
    (
        object_of(ACTIVITY),
        proptest::option::of(pb_value()),
        proptest::option::of(pb_value()),
        proptest::option::of(pb_struct_of(pb_value())),
        vec(pb_struct_of(pb_value()), 0..3),
        proptest::option::of(any::<f64>()),
        proptest::option::of(pb_value()),
    )
        .prop_map(
            |(json, channel_data, value, properties, entities, occurrence, content)| {
                let activity = Activity::from_json(json).expect("strategy makes objects");
                let mut p = pb::Activity::from(activity);
                p.channel_data = channel_data;
                p.value = value;
                p.properties = properties;
                p.entities.extend(entities);
                p.text_highlights.push(pb::TextHighlight {
                    text: None,
                    occurrence,
                    properties: None,
                });
                p.attachments.push(pb::Attachment {
                    content,
                    ..pb::Attachment::default()
                });
                p
            },
        )
}

/// `activity` written by its `Serialize` (how a receipt writes replies), read back as a `Value`.
fn serialized(activity: &Activity) -> Value {
    let text = serde_json::to_string(activity).expect("activities serialize");
    serde_json::from_str(&text).expect("the text is JSON")
}

/// `value` written as text and read back, as [`serialized`] reads: serde_json's float parsing
/// may land one ulp off some floats it wrote, on both sides alike.
fn through_text(value: &Value) -> Value {
    serde_json::from_str(&value.to_string()).expect("the text is JSON")
}

/// Converting a protobuf activity gives JSON that further round trips leave unchanged.
fn assert_stable(p: pb::Activity) -> Result<(), TestCaseError> {
    let activity = Activity::from(p);
    let json = activity.to_json();
    prop_assert_eq!(serialized(&activity), through_text(&json));
    let again = Activity::from_json(json.clone()).expect("activities are written as objects");
    prop_assert_eq!(&again.to_json(), &json);
    prop_assert_eq!(&through_protobuf(again), &json);
    Ok(())
}

proptest! {
    #[test]
    fn json_activities_round_trip_exactly(original in object_of(ACTIVITY)) {
        let activity = Activity::from_json(original.clone()).expect("strategy makes objects");
        prop_assert_eq!(&activity.to_json(), &original);
        prop_assert_eq!(serialized(&activity), through_text(&original));
        prop_assert_eq!(&through_protobuf(activity), &original);
    }

    #[test]
    fn write_json_writes_the_text_serde_json_writes(
        original in object_of(ACTIVITY),
        odd in odd_pb_activity(),
    ) {
        for activity in [
            Activity::from_json(original).expect("strategy makes objects"),
            Activity::from(odd),
        ] {
            let mut text = String::from("prefix ");
            activity.write_json(&mut text);
            let serde = serde_json::to_string(&activity).expect("activities serialize");
            prop_assert_eq!(text, format!("prefix {serde}"));
        }
    }

    #[test]
    fn sub_objects_round_trip_exactly(
        (which, original) in (0..9_usize).prop_flat_map(|which| {
            let members = [
                CHANNEL_ACCOUNT, CONVERSATION_ACCOUNT, MESSAGE_REACTION, ATTACHMENT,
                SUGGESTED_ACTIONS, CARD_ACTION, CONVERSATION_REFERENCE, TEXT_HIGHLIGHT,
                SEMANTIC_ACTION,
            ][which];
            (Just(which), object_of(members))
        })
    ) {
        let v = original.clone();
        let back = match which {
            0 => ChannelAccount::from_json(v).map(|x| x.to_json()),
            1 => ConversationAccount::from_json(v).map(|x| x.to_json()),
            2 => MessageReaction::from_json(v).map(|x| x.to_json()),
            3 => Attachment::from_json(v).map(|x| x.to_json()),
            4 => SuggestedActions::from_json(v).map(|x| x.to_json()),
            5 => CardAction::from_json(v).map(|x| x.to_json()),
            6 => ConversationReference::from_json(v).map(|x| x.to_json()),
            7 => TextHighlight::from_json(v).map(|x| x.to_json()),
            _ => SemanticAction::from_json(v).map(|x| x.to_json()),
        };
        prop_assert_eq!(back.ok(), Some(original));
    }

    #[test]
    fn any_json_value_is_an_activity_or_a_clean_error(v in json()) {
        let result = Activity::from_json(v.clone());
        prop_assert_eq!(result.is_ok(), v.is_object());
        if let Ok(activity) = result {
            prop_assert_eq!(activity.to_json(), v);
        }
    }

    #[test]
    fn odd_protobuf_values_convert_without_panicking(p in odd_pb_activity()) {
        assert_stable(p)?;
    }

    #[test]
    fn damaged_protobuf_bytes_convert_without_panicking(
        original in object_of(ACTIVITY),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let activity = Activity::from_json(original).expect("strategy makes objects");
        let mut bytes = pb::Activity::from(activity).encode_to_vec();
        if !bytes.is_empty() {
            for (at, byte) in edits {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        if let Ok(p) = pb::Activity::decode(bytes.as_slice()) {
            assert_stable(p)?;
        }
    }
}
