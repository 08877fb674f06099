//! Lossless conversion between the activity types and Bot Framework JSON (camelCase members).
//!
//! Channels and the Bot Framework SDKs send members no schema names, explicit `null`s, empty
//! lists, and now and then a value of the wrong shape. A gateway that parsed strictly would
//! either reject such activities or drop the odd parts; we want neither, so the conversion
//! follows one rule:
//!
//! > A known member goes into its typed field only if the typed field writes back exactly the
//! > same JSON. Everything else is kept verbatim in `properties` under its JSON name.
//!
//! Concretely: a string field takes only a string, a bool field only a bool, a list only a
//! non-empty array whose every item fits, a sub-type only an object (whose own odd members then go
//! to the sub-type's `properties`), a free-form value anything but `null`, and
//! `TextHighlight.occurrence` only a number that [`number_to_json`] writes back unchanged (so `1`
//! is typed but `1.0` is not). Hence `Activity::from_json(v)?.to_json() == v` for every JSON
//! object `v`.
//!
//! When writing, a typed field that is set wins over a `properties` entry of the same JSON name.
//! [`Activity::from_json`] never produces both; code that sets a typed field on a parsed activity
//! means the typed value.

use std::fmt::Write as _;

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::Value;

use super::scan;

use super::{
    Activity, Attachment, CardAction, ChannelAccount, ConversationAccount, ConversationReference,
    JsonMap, MessageReaction, SemanticAction, SuggestedActions, TextHighlight,
};

/// JSON that cannot be an activity (or one of its parts) at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActivityJsonError {
    /// Activities and their parts are JSON objects; anything else has no members to read.
    #[error("{what} must be a JSON object, found {found}")]
    NotAnObject {
        /// The type that was being read, e.g. `Activity`.
        what: &'static str,
        /// The JSON kind found instead, e.g. `array`.
        found: &'static str,
    },
}

/// The largest magnitude below which every integer is exactly representable as an `f64`.
const MAX_SAFE_INTEGER: f64 = 9_007_199_254_740_992.0; // 2^53

/// Writes an `f64` as the JSON number a reader most likely sent.
///
/// Integral values within ±2^53 become JSON integers (so `1` read as `1.0` is written as `1`);
/// other finite values stay floats, and so does `-0.0`, which no integer can represent.
/// Non-finite values have no JSON form and become `null`.
pub fn number_to_json(x: f64) -> Value {
    if !x.is_finite() {
        return Value::Null;
    }
    let negative_zero = x == 0.0 && x.is_sign_negative();
    if x.fract() == 0.0 && x.abs() <= MAX_SAFE_INTEGER && !negative_zero {
        // Exact: integral and within ±2^53, hence within i64.
        Value::from(x as i64)
    } else {
        serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn object(value: Value, what: &'static str) -> Result<JsonMap, ActivityJsonError> {
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ActivityJsonError::NotAnObject {
            what,
            found: json_kind(&other),
        }),
    }
}

// Readers: each moves `value` into `slot` if the typed form writes it back unchanged, and hands
// it back otherwise so that the caller keeps it in `properties`.

fn read_string(slot: &mut Option<String>, value: Value) -> Result<(), Value> {
    match value {
        Value::String(s) => {
            *slot = Some(s);
            Ok(())
        }
        other => Err(other),
    }
}

fn read_bool(slot: &mut Option<bool>, value: Value) -> Result<(), Value> {
    match value {
        Value::Bool(b) => {
            *slot = Some(b);
            Ok(())
        }
        other => Err(other),
    }
}

fn read_number(slot: &mut Option<f64>, value: Value) -> Result<(), Value> {
    if let Value::Number(n) = &value
        && let Some(x) = n.as_f64()
        && number_to_json(x) == value
    {
        *slot = Some(x);
        Ok(())
    } else {
        Err(value)
    }
}

/// Any value but `null`: a typed `None` could not write an explicit `null` back.
fn read_value(slot: &mut Option<Value>, value: Value) -> Result<(), Value> {
    if value.is_null() {
        Err(value)
    } else {
        *slot = Some(value);
        Ok(())
    }
}

fn read_object<T>(
    slot: &mut Option<T>,
    value: Value,
    convert: fn(JsonMap) -> T,
) -> Result<(), Value> {
    match value {
        Value::Object(map) => {
            *slot = Some(convert(map));
            Ok(())
        }
        other => Err(other),
    }
}

/// A non-empty array whose items all `fit`; an empty list could not write `[]` back.
fn read_list<T>(
    slot: &mut Vec<T>,
    value: Value,
    fits: fn(&Value) -> bool,
    convert: fn(Value) -> Option<T>,
) -> Result<(), Value> {
    match value {
        Value::Array(items) if !items.is_empty() && items.iter().all(fits) => {
            // Every item fits, so `convert` accepts every item and nothing is filtered out.
            *slot = items.into_iter().filter_map(convert).collect();
            Ok(())
        }
        other => Err(other),
    }
}

fn string_item(value: Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s),
        _ => None,
    }
}

fn object_item(value: Value) -> Option<JsonMap> {
    match value {
        Value::Object(map) => Some(map),
        _ => None,
    }
}

fn object_list<T>(slot: &mut Vec<T>, value: Value, convert: fn(JsonMap) -> T) -> Result<(), Value> {
    match value {
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object) => {
            *slot = items
                .into_iter()
                .filter_map(object_item)
                .map(convert)
                .collect();
            Ok(())
        }
        other => Err(other),
    }
}

/// A typed field's name, and its text as a member that follows another: `,"name":`. Made by
/// [`key!`] when compiled, so that [`Text`] writes a member's start with one copy rather than
/// three (a reply's twenty members are written into every turn's receipt).
#[derive(Debug, Clone, Copy)]
struct Key {
    name: &'static str,
    member: &'static str,
}

/// The [`Key`] of the field named `$name`.
macro_rules! key {
    ($name:literal) => {
        Key {
            name: $name,
            member: concat!(",\"", $name, "\":"),
        }
    };
}

/// Where a type's typed fields go: a JSON object being built ([`Writer`], for `to_json`) or a
/// serializer writing JSON text ([`Stream`], for `Serialize`). Each type lists its fields once,
/// in `fields`, so the two cannot disagree on names or on which fields are written.
trait Fields {
    fn string(&mut self, key: Key, value: &Option<String>);
    fn bool(&mut self, key: Key, value: Option<bool>);
    fn number(&mut self, key: Key, value: Option<f64>);
    fn value(&mut self, key: Key, value: &Option<Value>);
    fn object<T: JsonObject>(&mut self, key: Key, value: &Option<T>);
    fn list<T: JsonItem>(&mut self, key: Key, items: &[T]);
}

/// A type written as a JSON object: its typed fields merged over its `properties`.
trait JsonObject: Serialize {
    fn properties(&self) -> &JsonMap;

    fn fields<W: Fields>(&self, w: &mut W);

    fn to_map(&self) -> JsonMap {
        let mut w = Writer::new(self.properties());
        self.fields(&mut w);
        w.finish()
    }

    /// Appends the object's JSON text to `out` through a [`Text`]: the same text as `Serialize`
    /// through serde_json.
    fn write_text(&self, out: &mut String) {
        let properties = self.properties();
        out.push('{');
        let mut text = Text {
            out,
            any: false,
            written: (!properties.is_empty()).then(Vec::new),
        };
        self.fields(&mut text);
        let Text { out, any, written } = text;
        let written = written.unwrap_or_default();
        let mut any = any;
        for (key, value) in properties {
            if !written.contains(&key.as_str()) {
                if any {
                    out.push(',');
                }
                any = true;
                write_str(key, out);
                out.push(':');
                write_value(value, out);
            }
        }
        out.push('}');
    }
}

/// A free-form object (an entity, `SemanticAction.entities`): all properties, no typed fields.
impl JsonObject for JsonMap {
    fn properties(&self) -> &JsonMap {
        self
    }

    fn fields<W: Fields>(&self, _: &mut W) {}
}

/// An item of a list field.
trait JsonItem: Serialize {
    fn to_item(&self) -> Value;

    /// Appends the item's JSON text to `out`.
    fn write_item(&self, out: &mut String);
}

impl JsonItem for String {
    fn to_item(&self) -> Value {
        Value::String(self.clone())
    }

    fn write_item(&self, out: &mut String) {
        write_str(self, out);
    }
}

impl JsonItem for JsonMap {
    fn to_item(&self) -> Value {
        Value::Object(self.clone())
    }

    fn write_item(&self, out: &mut String) {
        JsonObject::write_text(self, out);
    }
}

/// Builds one JSON object: `properties` first, then the typed fields that are set, which
/// overwrite `properties` entries of the same name.
struct Writer(JsonMap);

impl Writer {
    fn new(properties: &JsonMap) -> Self {
        Writer(properties.clone())
    }

    fn finish(self) -> JsonMap {
        self.0
    }
}

impl Fields for Writer {
    fn string(&mut self, key: Key, value: &Option<String>) {
        if let Some(s) = value {
            self.0.insert(key.name.to_owned(), Value::String(s.clone()));
        }
    }

    fn bool(&mut self, key: Key, value: Option<bool>) {
        if let Some(b) = value {
            self.0.insert(key.name.to_owned(), Value::Bool(b));
        }
    }

    fn number(&mut self, key: Key, value: Option<f64>) {
        if let Some(x) = value {
            self.0.insert(key.name.to_owned(), number_to_json(x));
        }
    }

    fn value(&mut self, key: Key, value: &Option<Value>) {
        if let Some(v) = value {
            self.0.insert(key.name.to_owned(), v.clone());
        }
    }

    fn object<T: JsonObject>(&mut self, key: Key, value: &Option<T>) {
        if let Some(v) = value {
            self.0
                .insert(key.name.to_owned(), Value::Object(v.to_map()));
        }
    }

    fn list<T: JsonItem>(&mut self, key: Key, items: &[T]) {
        if !items.is_empty() {
            self.0.insert(
                key.name.to_owned(),
                items.iter().map(JsonItem::to_item).collect(),
            );
        }
    }
}

/// Writes one JSON object's text through a serializer: the typed fields that are set, then the
/// `properties` entries that no typed field wrote (the same members as [`Writer`]'s object, in
/// another order), without building a [`Value`] first. Why: a turn's receipt is JSON text of its
/// replies, and building it as a `Value` only to write and drop it cost every turn
/// (`bench/RESULTS.md`).
struct Stream<M: SerializeMap> {
    map: M,
    /// The names written, kept only when `properties` has entries they could shadow.
    written: Option<Vec<&'static str>>,
    error: Option<M::Error>,
}

impl<M: SerializeMap> Stream<M> {
    fn entry<V: Serialize + ?Sized>(&mut self, key: &'static str, value: &V) {
        if self.error.is_some() {
            return;
        }
        if let Err(e) = self.map.serialize_entry(key, value) {
            self.error = Some(e);
        }
        if let Some(written) = &mut self.written {
            written.push(key);
        }
    }
}

/// Serializes `object` whole through a [`Stream`].
fn write_object<T: JsonObject + ?Sized, S: Serializer>(
    object: &T,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let properties = object.properties();
    let mut stream = Stream {
        map: serializer.serialize_map(None)?,
        written: (!properties.is_empty()).then(Vec::new),
        error: None,
    };
    object.fields(&mut stream);
    let Stream {
        mut map,
        written,
        error,
    } = stream;
    if let Some(e) = error {
        return Err(e);
    }
    let written = written.unwrap_or_default();
    for (key, value) in properties {
        if !written.contains(&key.as_str()) {
            map.serialize_entry(key, value)?;
        }
    }
    map.end()
}

impl<M: SerializeMap> Fields for Stream<M> {
    fn string(&mut self, key: Key, value: &Option<String>) {
        if let Some(s) = value {
            self.entry(key.name, s.as_str());
        }
    }

    fn bool(&mut self, key: Key, value: Option<bool>) {
        if let Some(b) = value {
            self.entry(key.name, &b);
        }
    }

    fn number(&mut self, key: Key, value: Option<f64>) {
        if let Some(x) = value {
            self.entry(key.name, &number_to_json(x));
        }
    }

    fn value(&mut self, key: Key, value: &Option<Value>) {
        if let Some(v) = value {
            self.entry(key.name, v);
        }
    }

    fn object<T: JsonObject>(&mut self, key: Key, value: &Option<T>) {
        if let Some(v) = value {
            self.entry(key.name, v);
        }
    }

    fn list<T: JsonItem>(&mut self, key: Key, items: &[T]) {
        if !items.is_empty() {
            self.entry(key.name, items);
        }
    }
}

/// Writes one JSON object's text straight into a string, as serde_json would write it through
/// [`Stream`] (the same members in the same order, the same escapes and numbers), but with
/// strings that need no escaping copied whole ([`scan::needs_escape`]). Why: a turn's receipt is
/// the JSON text of its replies, and serde_json's string escaping looks at a byte at a time
/// (`bench/RESULTS.md`).
struct Text<'a> {
    out: &'a mut String,
    /// Whether a member was written, so that the next one follows a comma.
    any: bool,
    /// The names written, kept only when `properties` has entries they could shadow.
    written: Option<Vec<&'static str>>,
}

impl Text<'_> {
    /// Starts member `key`; its value follows. A typed field's name is a camelCase word, which
    /// JSON writes as it is: its member text is copied whole, comma and quotes included.
    fn key(&mut self, key: Key) {
        debug_assert!(!scan::needs_escape(key.name.as_bytes()), "{}", key.name);
        let member = if self.any {
            key.member
        } else {
            key.member.get(1..).unwrap_or_default()
        };
        self.out.push_str(member);
        self.any = true;
        if let Some(written) = &mut self.written {
            written.push(key.name);
        }
    }
}

impl Fields for Text<'_> {
    fn string(&mut self, key: Key, value: &Option<String>) {
        if let Some(s) = value {
            self.key(key);
            write_str(s, self.out);
        }
    }

    fn bool(&mut self, key: Key, value: Option<bool>) {
        if let Some(b) = value {
            self.key(key);
            self.out.push_str(if b { "true" } else { "false" });
        }
    }

    fn number(&mut self, key: Key, value: Option<f64>) {
        if let Some(x) = value {
            self.key(key);
            write_value(&number_to_json(x), self.out);
        }
    }

    fn value(&mut self, key: Key, value: &Option<Value>) {
        if let Some(v) = value {
            self.key(key);
            write_value(v, self.out);
        }
    }

    fn object<T: JsonObject>(&mut self, key: Key, value: &Option<T>) {
        if let Some(v) = value {
            self.key(key);
            v.write_text(self.out);
        }
    }

    fn list<T: JsonItem>(&mut self, key: Key, items: &[T]) {
        if !items.is_empty() {
            self.key(key);
            self.out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                item.write_item(self.out);
            }
            self.out.push(']');
        }
    }
}

/// Appends `value`'s JSON text to `out`, as serde_json writes it.
fn write_value(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        // serde_json's own text for a number: an integer by itoa (as it serializes one, without
        // the formatting machinery: a counter in a state is written every turn), any other by
        // its `Display` (ryu); writing to a `String` cannot fail.
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => out.push_str(itoa::Buffer::new().format(u)),
            (None, Some(i)) => out.push_str(itoa::Buffer::new().format(i)),
            (None, None) => {
                let _ = write!(out, "{n}");
            }
        },
        Value::String(s) => write_str(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => JsonObject::write_text(map, out),
    }
}

/// Appends `map` as a JSON object, the text serde_json writes for it (a state's text,
/// [`crate::state::json_text`]).
pub(crate) fn write_map(map: &JsonMap, out: &mut String) {
    write_entries(map, out);
}

/// Appends `entries` as one JSON object, the text serde_json writes for a map of them: a whole
/// state ([`write_map`]), or some of its properties (a write of those changed,
/// [`crate::store::StateWrite`]).
pub(crate) fn write_entries<'a>(
    entries: impl IntoIterator<Item = (&'a String, &'a Value)>,
    out: &mut String,
) {
    out.push('{');
    for (i, (key, value)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_str(key, out);
        out.push(':');
        write_value(value, out);
    }
    out.push('}');
}

/// Appends `s` as a JSON string, with serde_json's escapes: a string with nothing to escape,
/// checked a block at a time, is copied whole.
pub(crate) fn write_str(s: &str, out: &mut String) {
    out.reserve(s.len() + 2);
    out.push('"');
    if scan::needs_escape(s.as_bytes()) {
        write_escaped(s, out);
    } else {
        out.push_str(s);
    }
    out.push('"');
}

/// The contents of a JSON string with what serde_json escapes escaped as it does: `"`, `\`,
/// the five short escapes, and every other control character as `\u00xx`.
fn write_escaped(s: &str, out: &mut String) {
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0x00..=0x1f => "",
            _ => continue,
        };
        // Every byte escaped is ASCII, so `i` is a character boundary.
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            let _ = write!(out, "\\u{b:04x}");
        } else {
            out.push_str(escape);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
}

/// `from_json`/`to_json` for a type whose members are read by `from_map`/`to_map`.
macro_rules! json_object {
    ($ty:ident) => {
        impl $ty {
            #[doc = concat!("Reads a `", stringify!($ty), "` from Bot Framework JSON, keeping")]
            /// whatever the typed fields cannot carry exactly in `properties`.
            ///
            /// # Errors
            ///
            /// [`ActivityJsonError::NotAnObject`] if `value` is not a JSON object.
            pub fn from_json(value: Value) -> Result<Self, ActivityJsonError> {
                Ok(Self::from_map(object(value, stringify!($ty))?))
            }

            /// Writes Bot Framework JSON: the typed fields that are set, merged with
            /// `properties`.
            pub fn to_json(&self) -> Value {
                Value::Object(self.to_map())
            }
        }

        /// The same JSON as `to_json`, written without building a `Value`.
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                write_object(self, serializer)
            }
        }

        impl JsonItem for $ty {
            fn to_item(&self) -> Value {
                self.to_json()
            }

            fn write_item(&self, out: &mut String) {
                self.write_text(out);
            }
        }
    };
}

json_object!(Activity);
json_object!(ChannelAccount);
json_object!(ConversationAccount);
json_object!(MessageReaction);
json_object!(Attachment);
json_object!(SuggestedActions);
json_object!(CardAction);
json_object!(ConversationReference);
json_object!(TextHighlight);
json_object!(SemanticAction);

impl Activity {
    /// Appends the activity's Bot Framework JSON to `out`: the same text as its `Serialize`
    /// through serde_json, written without serde's escaping a byte at a time (a turn's receipt
    /// is written this way).
    pub fn write_json(&self, out: &mut String) {
        self.write_text(out);
    }

    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut a = Activity::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "type" => read_string(&mut a.activity_type, value),
                "id" => read_string(&mut a.id, value),
                "timestamp" => read_string(&mut a.timestamp, value),
                "localTimestamp" => read_string(&mut a.local_timestamp, value),
                "localTimezone" => read_string(&mut a.local_timezone, value),
                "serviceUrl" => read_string(&mut a.service_url, value),
                "channelId" => read_string(&mut a.channel_id, value),
                "from" => read_object(&mut a.from, value, ChannelAccount::from_map),
                "conversation" => {
                    read_object(&mut a.conversation, value, ConversationAccount::from_map)
                }
                "recipient" => read_object(&mut a.recipient, value, ChannelAccount::from_map),
                "textFormat" => read_string(&mut a.text_format, value),
                "attachmentLayout" => read_string(&mut a.attachment_layout, value),
                "membersAdded" => {
                    object_list(&mut a.members_added, value, ChannelAccount::from_map)
                }
                "membersRemoved" => {
                    object_list(&mut a.members_removed, value, ChannelAccount::from_map)
                }
                "reactionsAdded" => {
                    object_list(&mut a.reactions_added, value, MessageReaction::from_map)
                }
                "reactionsRemoved" => {
                    object_list(&mut a.reactions_removed, value, MessageReaction::from_map)
                }
                "topicName" => read_string(&mut a.topic_name, value),
                "historyDisclosed" => read_bool(&mut a.history_disclosed, value),
                "locale" => read_string(&mut a.locale, value),
                "text" => read_string(&mut a.text, value),
                "speak" => read_string(&mut a.speak, value),
                "inputHint" => read_string(&mut a.input_hint, value),
                "summary" => read_string(&mut a.summary, value),
                "suggestedActions" => {
                    read_object(&mut a.suggested_actions, value, SuggestedActions::from_map)
                }
                "attachments" => object_list(&mut a.attachments, value, Attachment::from_map),
                "entities" => object_list(&mut a.entities, value, |map| map),
                "channelData" => read_value(&mut a.channel_data, value),
                "action" => read_string(&mut a.action, value),
                "replyToId" => read_string(&mut a.reply_to_id, value),
                "label" => read_string(&mut a.label, value),
                "valueType" => read_string(&mut a.value_type, value),
                "value" => read_value(&mut a.value, value),
                "name" => read_string(&mut a.name, value),
                "relatesTo" => {
                    read_object(&mut a.relates_to, value, ConversationReference::from_map)
                }
                "code" => read_string(&mut a.code, value),
                "expiration" => read_string(&mut a.expiration, value),
                "importance" => read_string(&mut a.importance, value),
                "deliveryMode" => read_string(&mut a.delivery_mode, value),
                "listenFor" => read_list(&mut a.listen_for, value, Value::is_string, string_item),
                "textHighlights" => {
                    object_list(&mut a.text_highlights, value, TextHighlight::from_map)
                }
                "semanticAction" => {
                    read_object(&mut a.semantic_action, value, SemanticAction::from_map)
                }
                "callerId" => read_string(&mut a.caller_id, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                a.properties.insert(key, value);
            }
        }
        a
    }
}

impl JsonObject for Activity {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("type"), &self.activity_type);
        w.string(key!("id"), &self.id);
        w.string(key!("timestamp"), &self.timestamp);
        w.string(key!("localTimestamp"), &self.local_timestamp);
        w.string(key!("localTimezone"), &self.local_timezone);
        w.string(key!("serviceUrl"), &self.service_url);
        w.string(key!("channelId"), &self.channel_id);
        w.object(key!("from"), &self.from);
        w.object(key!("conversation"), &self.conversation);
        w.object(key!("recipient"), &self.recipient);
        w.string(key!("textFormat"), &self.text_format);
        w.string(key!("attachmentLayout"), &self.attachment_layout);
        w.list(key!("membersAdded"), &self.members_added);
        w.list(key!("membersRemoved"), &self.members_removed);
        w.list(key!("reactionsAdded"), &self.reactions_added);
        w.list(key!("reactionsRemoved"), &self.reactions_removed);
        w.string(key!("topicName"), &self.topic_name);
        w.bool(key!("historyDisclosed"), self.history_disclosed);
        w.string(key!("locale"), &self.locale);
        w.string(key!("text"), &self.text);
        w.string(key!("speak"), &self.speak);
        w.string(key!("inputHint"), &self.input_hint);
        w.string(key!("summary"), &self.summary);
        w.object(key!("suggestedActions"), &self.suggested_actions);
        w.list(key!("attachments"), &self.attachments);
        w.list(key!("entities"), &self.entities);
        w.value(key!("channelData"), &self.channel_data);
        w.string(key!("action"), &self.action);
        w.string(key!("replyToId"), &self.reply_to_id);
        w.string(key!("label"), &self.label);
        w.string(key!("valueType"), &self.value_type);
        w.value(key!("value"), &self.value);
        w.string(key!("name"), &self.name);
        w.object(key!("relatesTo"), &self.relates_to);
        w.string(key!("code"), &self.code);
        w.string(key!("expiration"), &self.expiration);
        w.string(key!("importance"), &self.importance);
        w.string(key!("deliveryMode"), &self.delivery_mode);
        w.list(key!("listenFor"), &self.listen_for);
        w.list(key!("textHighlights"), &self.text_highlights);
        w.object(key!("semanticAction"), &self.semantic_action);
        w.string(key!("callerId"), &self.caller_id);
    }
}

impl ChannelAccount {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut a = ChannelAccount::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "id" => read_string(&mut a.id, value),
                "name" => read_string(&mut a.name, value),
                "aadObjectId" => read_string(&mut a.aad_object_id, value),
                "role" => read_string(&mut a.role, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                a.properties.insert(key, value);
            }
        }
        a
    }
}

impl JsonObject for ChannelAccount {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("id"), &self.id);
        w.string(key!("name"), &self.name);
        w.string(key!("aadObjectId"), &self.aad_object_id);
        w.string(key!("role"), &self.role);
    }
}

impl ConversationAccount {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut c = ConversationAccount::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "id" => read_string(&mut c.id, value),
                "name" => read_string(&mut c.name, value),
                "isGroup" => read_bool(&mut c.is_group, value),
                "conversationType" => read_string(&mut c.conversation_type, value),
                "tenantId" => read_string(&mut c.tenant_id, value),
                "role" => read_string(&mut c.role, value),
                "aadObjectId" => read_string(&mut c.aad_object_id, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                c.properties.insert(key, value);
            }
        }
        c
    }
}

impl JsonObject for ConversationAccount {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("id"), &self.id);
        w.string(key!("name"), &self.name);
        w.bool(key!("isGroup"), self.is_group);
        w.string(key!("conversationType"), &self.conversation_type);
        w.string(key!("tenantId"), &self.tenant_id);
        w.string(key!("role"), &self.role);
        w.string(key!("aadObjectId"), &self.aad_object_id);
    }
}

impl MessageReaction {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut r = MessageReaction::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "type" => read_string(&mut r.kind, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                r.properties.insert(key, value);
            }
        }
        r
    }
}

impl JsonObject for MessageReaction {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("type"), &self.kind);
    }
}

impl Attachment {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut a = Attachment::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "contentType" => read_string(&mut a.content_type, value),
                "contentUrl" => read_string(&mut a.content_url, value),
                "content" => read_value(&mut a.content, value),
                "name" => read_string(&mut a.name, value),
                "thumbnailUrl" => read_string(&mut a.thumbnail_url, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                a.properties.insert(key, value);
            }
        }
        a
    }
}

impl JsonObject for Attachment {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("contentType"), &self.content_type);
        w.string(key!("contentUrl"), &self.content_url);
        w.value(key!("content"), &self.content);
        w.string(key!("name"), &self.name);
        w.string(key!("thumbnailUrl"), &self.thumbnail_url);
    }
}

impl SuggestedActions {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut s = SuggestedActions::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "to" => read_list(&mut s.to, value, Value::is_string, string_item),
                "actions" => object_list(&mut s.actions, value, CardAction::from_map),
                _ => Err(value),
            };
            if let Err(value) = kept {
                s.properties.insert(key, value);
            }
        }
        s
    }
}

impl JsonObject for SuggestedActions {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.list(key!("to"), &self.to);
        w.list(key!("actions"), &self.actions);
    }
}

impl CardAction {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut c = CardAction::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "type" => read_string(&mut c.kind, value),
                "title" => read_string(&mut c.title, value),
                "image" => read_string(&mut c.image, value),
                "text" => read_string(&mut c.text, value),
                "displayText" => read_string(&mut c.display_text, value),
                "value" => read_value(&mut c.value, value),
                "channelData" => read_value(&mut c.channel_data, value),
                "imageAltText" => read_string(&mut c.image_alt_text, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                c.properties.insert(key, value);
            }
        }
        c
    }
}

impl JsonObject for CardAction {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("type"), &self.kind);
        w.string(key!("title"), &self.title);
        w.string(key!("image"), &self.image);
        w.string(key!("text"), &self.text);
        w.string(key!("displayText"), &self.display_text);
        w.value(key!("value"), &self.value);
        w.value(key!("channelData"), &self.channel_data);
        w.string(key!("imageAltText"), &self.image_alt_text);
    }
}

impl ConversationReference {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut r = ConversationReference::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "activityId" => read_string(&mut r.activity_id, value),
                "user" => read_object(&mut r.user, value, ChannelAccount::from_map),
                "bot" => read_object(&mut r.bot, value, ChannelAccount::from_map),
                "conversation" => {
                    read_object(&mut r.conversation, value, ConversationAccount::from_map)
                }
                "channelId" => read_string(&mut r.channel_id, value),
                "serviceUrl" => read_string(&mut r.service_url, value),
                "locale" => read_string(&mut r.locale, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                r.properties.insert(key, value);
            }
        }
        r
    }
}

impl JsonObject for ConversationReference {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("activityId"), &self.activity_id);
        w.object(key!("user"), &self.user);
        w.object(key!("bot"), &self.bot);
        w.object(key!("conversation"), &self.conversation);
        w.string(key!("channelId"), &self.channel_id);
        w.string(key!("serviceUrl"), &self.service_url);
        w.string(key!("locale"), &self.locale);
    }
}

impl TextHighlight {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut t = TextHighlight::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "text" => read_string(&mut t.text, value),
                "occurrence" => read_number(&mut t.occurrence, value),
                _ => Err(value),
            };
            if let Err(value) = kept {
                t.properties.insert(key, value);
            }
        }
        t
    }
}

impl JsonObject for TextHighlight {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("text"), &self.text);
        w.number(key!("occurrence"), self.occurrence);
    }
}

impl SemanticAction {
    pub(crate) fn from_map(map: JsonMap) -> Self {
        let mut s = SemanticAction::default();
        for (key, value) in map {
            let kept = match key.as_str() {
                "id" => read_string(&mut s.id, value),
                "state" => read_string(&mut s.state, value),
                "entities" => read_object(&mut s.entities, value, |map| map),
                _ => Err(value),
            };
            if let Err(value) = kept {
                s.properties.insert(key, value);
            }
        }
        s
    }
}

impl JsonObject for SemanticAction {
    fn properties(&self) -> &JsonMap {
        &self.properties
    }

    fn fields<W: Fields>(&self, w: &mut W) {
        w.string(key!("id"), &self.id);
        w.string(key!("state"), &self.state);
        w.object(key!("entities"), &self.entities);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn strings_and_values_are_written_as_serde_json_writes_them() {
        let text = |v: &Value| {
            let mut out = String::new();
            write_value(v, &mut out);
            out
        };
        // Every ASCII character, where a run before it, after it or none must be copied, and
        // in a string long enough for more than one scanned block.
        for b in 0u8..0x80 {
            let c = char::from(b);
            for s in [
                format!("{c}"),
                format!("ab{c}"),
                format!("{c}é💡"),
                format!("{}{c}{c}x", ".".repeat(70)),
            ] {
                let v = json!({ s.clone(): [s, 1, -2.5, null, true, {}] });
                assert_eq!(text(&v), v.to_string(), "{b:#x}");
            }
        }
    }

    #[test]
    fn numbers_are_written_as_integers_when_exact() {
        assert_eq!(number_to_json(1.0), json!(1));
        assert_eq!(number_to_json(-3.0), json!(-3));
        assert_eq!(number_to_json(1.5), json!(1.5));
        assert_eq!(
            number_to_json(MAX_SAFE_INTEGER),
            json!(9_007_199_254_740_992_i64)
        );
        assert_eq!(
            number_to_json(2.0 * MAX_SAFE_INTEGER),
            json!(2.0 * MAX_SAFE_INTEGER)
        );
        assert_eq!(number_to_json(f64::NAN), Value::Null);
        assert_eq!(number_to_json(f64::NEG_INFINITY), Value::Null);
        assert!(
            number_to_json(-0.0)
                .as_f64()
                .is_some_and(f64::is_sign_negative)
        );
        assert!(number_to_json(-0.0).is_f64());
    }

    #[test]
    fn serializing_writes_to_jsons_members_once_each() {
        let mut a = Activity::message("typed");
        a.properties.insert("text".into(), json!("shadowed"));
        a.properties.insert("odd".into(), json!({"k": [1, null]}));
        a.from = Some(ChannelAccount {
            id: Some("bot".into()),
            properties: JsonMap::from_iter([("id".into(), json!(7)), ("x".into(), json!(true))]),
            ..ChannelAccount::default()
        });
        a.entities
            .push(JsonMap::from_iter([("type".into(), json!("mention"))]));
        a.listen_for.push("yes".into());
        a.text_highlights.push(TextHighlight {
            occurrence: Some(2.0),
            ..TextHighlight::default()
        });
        let text = serde_json::to_string(&a).expect("serializable");
        assert_eq!(
            serde_json::from_str::<Value>(&text).expect("JSON"),
            a.to_json()
        );
        assert!(!text.contains("shadowed"), "{text}");
        assert_eq!(text.matches("\"id\"").count(), 1, "{text}");
        assert!(text.contains("\"occurrence\":2}"), "{text}");
    }

    #[test]
    fn non_objects_are_rejected_with_their_kind() {
        assert_eq!(
            Activity::from_json(json!([1])),
            Err(ActivityJsonError::NotAnObject {
                what: "Activity",
                found: "array"
            })
        );
        assert_eq!(
            ChannelAccount::from_json(json!("x"))
                .map_err(|e| e.to_string())
                .err()
                .as_deref(),
            Some("ChannelAccount must be a JSON object, found string")
        );
    }

    #[test]
    fn odd_members_stay_in_properties() -> Result<(), ActivityJsonError> {
        let v = json!({
            "type": "message",
            "historyDisclosed": "yes",
            "membersAdded": [],
            "membersRemoved": [{"id": "u", "name": null}],
            "listenFor": ["a", 1],
            "value": null,
            "textHighlights": [{"text": "t", "occurrence": 1}, {"occurrence": 2.0}],
            "x-extra": {"deep": [true]}
        });
        let a = Activity::from_json(v.clone())?;
        assert_eq!(a.activity_type.as_deref(), Some("message"));
        assert_eq!(a.history_disclosed, None);
        assert_eq!(a.members_removed.len(), 1);
        assert_eq!(a.members_removed[0].id.as_deref(), Some("u"));
        assert_eq!(
            a.members_removed[0].properties.get("name"),
            Some(&Value::Null)
        );
        assert_eq!(a.text_highlights[0].occurrence, Some(1.0));
        assert_eq!(a.text_highlights[1].occurrence, None);
        let mut keys: Vec<&str> = a.properties.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "historyDisclosed",
                "listenFor",
                "membersAdded",
                "value",
                "x-extra"
            ]
        );
        assert_eq!(a.to_json(), v);
        Ok(())
    }

    #[test]
    fn typed_field_wins_over_properties_entry() {
        let mut a = Activity::message("typed");
        a.properties.insert("text".into(), json!(5));
        a.properties.insert("extra".into(), json!(1));
        assert_eq!(
            a.to_json(),
            json!({"type": "message", "text": "typed", "extra": 1})
        );
    }
}
