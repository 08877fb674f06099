//! Conversions between the generated protobuf types (`pb`) and the domain types of
//! [`crate::activity`], plus `google.protobuf.Value`/`Struct` ↔ `serde_json`.
//!
//! The proto mirrors the domain types field by field, so these conversions are total (`From`,
//! not `TryFrom`) and structural: they neither validate nor drop anything. Checking that a turn's
//! activity has what a turn needs is a separate step, so that a malformed activity is still
//! representable (and can be logged or echoed) exactly as it arrived.
//!
//! An empty `properties` map travels as an absent `Struct`, and an absent one reads back as an
//! empty map; the two are the same thing.
//!
//! # Numbers
//!
//! `google.protobuf.Value` has only `f64` numbers, while JSON text distinguishes `1` from `1.0`.
//! Going through protobuf therefore normalizes numbers in two ways, the only lossy spots of the
//! JSON → proto → JSON path:
//!
//! - an integral value within ±2^53 comes back as a JSON integer, so a float written `2.0` comes
//!   back as `2` (`-0.0` stays a float, as no integer can represent it);
//! - integers beyond ±2^53 are rounded to the nearest `f64` (and come back as floats once that
//!   lies beyond ±2^53).
//!
//! Non-finite numbers (possible in protobuf, impossible in JSON) become `null`, and so does a
//! `Value` with no `kind` set.
//!
//! # Nesting
//!
//! prost's decoder refuses messages nested more than 100 deep, and every JSON array or object
//! level costs two (`Value` plus `ListValue`/`Struct`). A `channelData` nested about 50 levels
//! deep therefore encodes fine but fails to decode on the receiving side; JSON itself (serde_json
//! parses up to 128 levels) has no such limit this low.

use prost_types::value::Kind;

use super::pb;
use crate::activity::json::number_to_json;
use crate::activity::{
    Activity, Attachment, CardAction, ChannelAccount, ConversationAccount, ConversationReference,
    JsonMap, MessageReaction, SemanticAction, SuggestedActions, TextHighlight,
};

/// Converts any JSON value to a `google.protobuf.Value`; numbers become `f64`.
pub fn json_to_proto_value(value: serde_json::Value) -> prost_types::Value {
    use serde_json::Value as J;
    let kind = match value {
        J::Null => Kind::NullValue(prost_types::NullValue::NullValue.into()),
        J::Bool(b) => Kind::BoolValue(b),
        // Without serde_json's `arbitrary_precision` every number has an `f64` form.
        J::Number(n) => n.as_f64().map_or(
            Kind::NullValue(prost_types::NullValue::NullValue.into()),
            Kind::NumberValue,
        ),
        J::String(s) => Kind::StringValue(s),
        J::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.into_iter().map(json_to_proto_value).collect(),
        }),
        J::Object(map) => Kind::StructValue(json_map_to_struct(map)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// Converts a `google.protobuf.Value` to JSON, normalizing numbers as the module docs describe.
pub fn proto_value_to_json(value: prost_types::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match value.kind {
        None | Some(Kind::NullValue(_)) => J::Null,
        Some(Kind::BoolValue(b)) => J::Bool(b),
        Some(Kind::NumberValue(x)) => number_to_json(x),
        Some(Kind::StringValue(s)) => J::String(s),
        Some(Kind::ListValue(list)) => {
            J::Array(list.values.into_iter().map(proto_value_to_json).collect())
        }
        Some(Kind::StructValue(s)) => J::Object(struct_to_json_map(s)),
    }
}

/// Converts a JSON object to a `google.protobuf.Struct`, inserting as [`struct_to_json_map`] does.
pub fn json_map_to_struct(map: JsonMap) -> prost_types::Struct {
    let mut fields = std::collections::BTreeMap::new();
    for (k, v) in map {
        fields.insert(k, json_to_proto_value(v));
    }
    prost_types::Struct { fields }
}

/// Converts a `google.protobuf.Struct` to a JSON object.
///
/// Both maps are ordered by key, and each is built by inserting: `collect` gathers the entries
/// into a vector, sorts it and builds the tree from it, which for the one key of the benchmark's
/// `value` cost a quarter more (`bench/RESULTS.md`).
pub fn struct_to_json_map(s: prost_types::Struct) -> JsonMap {
    let mut map = JsonMap::new();
    for (k, v) in s.fields {
        map.insert(k, proto_value_to_json(v));
    }
    map
}

/// `properties` to the wire: an empty map is sent as no `Struct` at all.
fn properties_to_proto(properties: JsonMap) -> Option<prost_types::Struct> {
    (!properties.is_empty()).then(|| json_map_to_struct(properties))
}

/// `properties` from the wire: no `Struct` is an empty map.
fn properties_from_proto(properties: Option<prost_types::Struct>) -> JsonMap {
    properties.map(struct_to_json_map).unwrap_or_default()
}

fn value_to_proto(value: Option<serde_json::Value>) -> Option<prost_types::Value> {
    value.map(json_to_proto_value)
}

fn value_from_proto(value: Option<prost_types::Value>) -> Option<serde_json::Value> {
    value.map(proto_value_to_json)
}

/// Every item converted. Most of an activity's lists are empty, and an empty one is answered
/// without the iterator and its collection, which cost about 70 instructions each for nothing
/// (an activity has eight lists each way; `bench/RESULTS.md`).
fn convert_all<A, B: From<A>>(items: Vec<A>) -> Vec<B> {
    if items.is_empty() {
        return Vec::new();
    }
    items.into_iter().map(B::from).collect()
}

impl From<pb::Activity> for Activity {
    fn from(mut p: pb::Activity) -> Self {
        take_activity(&mut p)
    }
}

/// The domain activity of a boxed wire activity, boxed: the new activity is written into its box
/// once, its fields taken out of `p` where they lie. `Activity::from(*p)` copied the two
/// kilobytes out of the box first, and the result was moved twice more on its way into the
/// turn's box (`bench/RESULTS.md`).
pub fn boxed_activity(mut p: Box<pb::Activity>) -> Box<Activity> {
    Box::new(take_activity(&mut p))
}

/// The fields of `p` as a domain activity, leaving `p` empty.
fn take_activity(p: &mut pb::Activity) -> Activity {
    use std::mem::take;
    Activity {
        activity_type: take(&mut p.r#type),
        id: take(&mut p.id),
        timestamp: take(&mut p.timestamp),
        local_timestamp: take(&mut p.local_timestamp),
        local_timezone: take(&mut p.local_timezone),
        service_url: take(&mut p.service_url),
        channel_id: take(&mut p.channel_id),
        from: take(&mut p.from).map(Into::into),
        conversation: take(&mut p.conversation).map(Into::into),
        recipient: take(&mut p.recipient).map(Into::into),
        text_format: take(&mut p.text_format),
        attachment_layout: take(&mut p.attachment_layout),
        members_added: convert_all(take(&mut p.members_added)),
        members_removed: convert_all(take(&mut p.members_removed)),
        reactions_added: convert_all(take(&mut p.reactions_added)),
        reactions_removed: convert_all(take(&mut p.reactions_removed)),
        topic_name: take(&mut p.topic_name),
        history_disclosed: take(&mut p.history_disclosed),
        locale: take(&mut p.locale),
        text: take(&mut p.text),
        speak: take(&mut p.speak),
        input_hint: take(&mut p.input_hint),
        summary: take(&mut p.summary),
        suggested_actions: take(&mut p.suggested_actions).map(Into::into),
        attachments: convert_all(take(&mut p.attachments)),
        entities: take(&mut p.entities)
            .into_iter()
            .map(struct_to_json_map)
            .collect(),
        channel_data: value_from_proto(take(&mut p.channel_data)),
        action: take(&mut p.action),
        reply_to_id: take(&mut p.reply_to_id),
        label: take(&mut p.label),
        value_type: take(&mut p.value_type),
        value: value_from_proto(take(&mut p.value)),
        name: take(&mut p.name),
        relates_to: take(&mut p.relates_to).map(Into::into),
        code: take(&mut p.code),
        expiration: take(&mut p.expiration),
        importance: take(&mut p.importance),
        delivery_mode: take(&mut p.delivery_mode),
        listen_for: take(&mut p.listen_for),
        text_highlights: convert_all(take(&mut p.text_highlights)),
        semantic_action: take(&mut p.semantic_action).map(Into::into),
        caller_id: take(&mut p.caller_id),
        properties: properties_from_proto(take(&mut p.properties)),
    }
}

impl From<Activity> for pb::Activity {
    fn from(a: Activity) -> Self {
        pb::Activity {
            r#type: a.activity_type,
            id: a.id,
            timestamp: a.timestamp,
            local_timestamp: a.local_timestamp,
            local_timezone: a.local_timezone,
            service_url: a.service_url,
            channel_id: a.channel_id,
            from: a.from.map(Into::into),
            conversation: a.conversation.map(Into::into),
            recipient: a.recipient.map(Into::into),
            text_format: a.text_format,
            attachment_layout: a.attachment_layout,
            members_added: convert_all(a.members_added),
            members_removed: convert_all(a.members_removed),
            reactions_added: convert_all(a.reactions_added),
            reactions_removed: convert_all(a.reactions_removed),
            topic_name: a.topic_name,
            history_disclosed: a.history_disclosed,
            locale: a.locale,
            text: a.text,
            speak: a.speak,
            input_hint: a.input_hint,
            summary: a.summary,
            suggested_actions: a.suggested_actions.map(Into::into),
            attachments: convert_all(a.attachments),
            entities: a.entities.into_iter().map(json_map_to_struct).collect(),
            channel_data: value_to_proto(a.channel_data),
            action: a.action,
            reply_to_id: a.reply_to_id,
            label: a.label,
            value_type: a.value_type,
            value: value_to_proto(a.value),
            name: a.name,
            relates_to: a.relates_to.map(Into::into),
            code: a.code,
            expiration: a.expiration,
            importance: a.importance,
            delivery_mode: a.delivery_mode,
            listen_for: a.listen_for,
            text_highlights: convert_all(a.text_highlights),
            semantic_action: a.semantic_action.map(Into::into),
            caller_id: a.caller_id,
            properties: properties_to_proto(a.properties),
        }
    }
}

impl From<pb::ChannelAccount> for ChannelAccount {
    fn from(p: pb::ChannelAccount) -> Self {
        ChannelAccount {
            id: p.id,
            name: p.name,
            aad_object_id: p.aad_object_id,
            role: p.role,
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<ChannelAccount> for pb::ChannelAccount {
    fn from(a: ChannelAccount) -> Self {
        pb::ChannelAccount {
            id: a.id,
            name: a.name,
            aad_object_id: a.aad_object_id,
            role: a.role,
            properties: properties_to_proto(a.properties),
        }
    }
}

impl From<pb::ConversationAccount> for ConversationAccount {
    fn from(p: pb::ConversationAccount) -> Self {
        ConversationAccount {
            id: p.id,
            name: p.name,
            is_group: p.is_group,
            conversation_type: p.conversation_type,
            tenant_id: p.tenant_id,
            role: p.role,
            aad_object_id: p.aad_object_id,
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<ConversationAccount> for pb::ConversationAccount {
    fn from(c: ConversationAccount) -> Self {
        pb::ConversationAccount {
            id: c.id,
            name: c.name,
            is_group: c.is_group,
            conversation_type: c.conversation_type,
            tenant_id: c.tenant_id,
            role: c.role,
            aad_object_id: c.aad_object_id,
            properties: properties_to_proto(c.properties),
        }
    }
}

impl From<pb::MessageReaction> for MessageReaction {
    fn from(p: pb::MessageReaction) -> Self {
        MessageReaction {
            kind: p.r#type,
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<MessageReaction> for pb::MessageReaction {
    fn from(r: MessageReaction) -> Self {
        pb::MessageReaction {
            r#type: r.kind,
            properties: properties_to_proto(r.properties),
        }
    }
}

impl From<pb::Attachment> for Attachment {
    fn from(p: pb::Attachment) -> Self {
        Attachment {
            content_type: p.content_type,
            content_url: p.content_url,
            content: value_from_proto(p.content),
            name: p.name,
            thumbnail_url: p.thumbnail_url,
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<Attachment> for pb::Attachment {
    fn from(a: Attachment) -> Self {
        pb::Attachment {
            content_type: a.content_type,
            content_url: a.content_url,
            content: value_to_proto(a.content),
            name: a.name,
            thumbnail_url: a.thumbnail_url,
            properties: properties_to_proto(a.properties),
        }
    }
}

impl From<pb::SuggestedActions> for SuggestedActions {
    fn from(p: pb::SuggestedActions) -> Self {
        SuggestedActions {
            to: p.to,
            actions: convert_all(p.actions),
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<SuggestedActions> for pb::SuggestedActions {
    fn from(s: SuggestedActions) -> Self {
        pb::SuggestedActions {
            to: s.to,
            actions: convert_all(s.actions),
            properties: properties_to_proto(s.properties),
        }
    }
}

impl From<pb::CardAction> for CardAction {
    fn from(p: pb::CardAction) -> Self {
        CardAction {
            kind: p.r#type,
            title: p.title,
            image: p.image,
            text: p.text,
            display_text: p.display_text,
            value: value_from_proto(p.value),
            channel_data: value_from_proto(p.channel_data),
            image_alt_text: p.image_alt_text,
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<CardAction> for pb::CardAction {
    fn from(c: CardAction) -> Self {
        pb::CardAction {
            r#type: c.kind,
            title: c.title,
            image: c.image,
            text: c.text,
            display_text: c.display_text,
            value: value_to_proto(c.value),
            channel_data: value_to_proto(c.channel_data),
            image_alt_text: c.image_alt_text,
            properties: properties_to_proto(c.properties),
        }
    }
}

impl From<pb::ConversationReference> for ConversationReference {
    fn from(p: pb::ConversationReference) -> Self {
        ConversationReference {
            activity_id: p.activity_id,
            user: p.user.map(Into::into),
            bot: p.bot.map(Into::into),
            conversation: p.conversation.map(Into::into),
            channel_id: p.channel_id,
            service_url: p.service_url,
            locale: p.locale,
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<ConversationReference> for pb::ConversationReference {
    fn from(r: ConversationReference) -> Self {
        pb::ConversationReference {
            activity_id: r.activity_id,
            user: r.user.map(Into::into),
            bot: r.bot.map(Into::into),
            conversation: r.conversation.map(Into::into),
            channel_id: r.channel_id,
            service_url: r.service_url,
            locale: r.locale,
            properties: properties_to_proto(r.properties),
        }
    }
}

impl From<pb::TextHighlight> for TextHighlight {
    fn from(p: pb::TextHighlight) -> Self {
        TextHighlight {
            text: p.text,
            occurrence: p.occurrence,
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<TextHighlight> for pb::TextHighlight {
    fn from(t: TextHighlight) -> Self {
        pb::TextHighlight {
            text: t.text,
            occurrence: t.occurrence,
            properties: properties_to_proto(t.properties),
        }
    }
}

impl From<pb::SemanticAction> for SemanticAction {
    fn from(p: pb::SemanticAction) -> Self {
        SemanticAction {
            id: p.id,
            state: p.state,
            entities: p.entities.map(struct_to_json_map),
            properties: properties_from_proto(p.properties),
        }
    }
}

impl From<SemanticAction> for pb::SemanticAction {
    fn from(s: SemanticAction) -> Self {
        pb::SemanticAction {
            id: s.id,
            state: s.state,
            entities: s.entities.map(json_map_to_struct),
            properties: properties_to_proto(s.properties),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn through_proto(v: serde_json::Value) -> serde_json::Value {
        proto_value_to_json(json_to_proto_value(v))
    }

    #[test]
    fn values_survive_except_for_the_documented_number_normalizations() {
        let v = json!({"a": [1, -2, 0.5, "ü", true, null, {}], "b": {"c": []}});
        assert_eq!(through_proto(v.clone()), v);
        assert_eq!(through_proto(json!(2.0)), json!(2));
        // 2^53 + 1 has no f64 form: it rounds to 2^53, which still reads back as an integer.
        assert_eq!(
            through_proto(json!(9_007_199_254_740_993_u64)),
            json!(9_007_199_254_740_992_u64)
        );
        assert!(through_proto(json!(-0.0)).is_f64());
        assert_eq!(through_proto(json!(u64::MAX)), json!(u64::MAX as f64));
    }

    #[test]
    fn kindless_and_non_finite_values_become_null() {
        assert_eq!(
            proto_value_to_json(prost_types::Value { kind: None }),
            json!(null)
        );
        for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let v = prost_types::Value {
                kind: Some(Kind::NumberValue(x)),
            };
            assert_eq!(proto_value_to_json(v), json!(null));
        }
    }

    #[test]
    fn empty_properties_travel_as_no_struct() {
        let pb: pb::ChannelAccount = ChannelAccount::default().into();
        assert_eq!(pb.properties, None);
        let mut account = ChannelAccount::default();
        account.properties.insert("x".into(), json!(null));
        let pb: pb::ChannelAccount = account.clone().into();
        assert!(pb.properties.is_some());
        assert_eq!(ChannelAccount::from(pb), account);
    }
}
