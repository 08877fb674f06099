//! A turn's state: which scopes it has, how their keys are built, and the typed property bag a
//! bot reads and writes.
//!
//! Each scope's state is one JSON object of named properties, as in Bot Framework's property
//! accessors (`conversationState.createProperty("order")`). The bag remembers what it was loaded
//! with, so the engine writes back only the scopes a turn actually changed.

mod key;

pub use key::{Scope, StateKey, TurnKeys, subject};

use std::cell::Cell;
use std::sync::Arc;

use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;

use crate::activity::JsonMap;

/// A property could not be converted between its stored JSON and the type the bot asked for.
#[derive(Debug, thiserror::Error)]
#[error("state property `{name}` in {scope} state: {source}")]
pub struct PropertyError {
    scope: Scope,
    name: String,
    #[source]
    source: serde_json::Error,
}

/// One scope's state during a turn: named JSON properties, read and written with serde.
///
/// It records whether the turn looked at it at all: a scope the bot never read or wrote cannot
/// have influenced the turn, so its commit need not check that scope's version (and a concurrent
/// change there need not cost a replay).
///
/// The loaded state is shared with the snapshot it came from (and the state cache's entry), and
/// copied only when the turn first changes it: a turn's state was copied four times before
/// (`bench/RESULTS.md`).
#[derive(Debug, Clone)]
pub struct ScopeState {
    scope: Scope,
    /// The properties as the turn changed them; `None` while it has not (they are `loaded`).
    changed: Option<JsonMap>,
    loaded: Arc<JsonMap>,
    used: Cell<bool>,
    stored: bool,
}

/// Equal when the same scope holds the same properties, loaded the same, used and stored alike,
/// whether or not a change was made and undone.
impl PartialEq for ScopeState {
    fn eq(&self, other: &Self) -> bool {
        self.scope == other.scope
            && self.current() == other.current()
            && self.loaded == other.loaded
            && self.used == other.used
            && self.stored == other.stored
    }
}

impl ScopeState {
    /// The state of `scope` as loaded (an empty object for a key never written); a shared
    /// `Arc<JsonMap>` is not copied unless the turn changes it.
    pub fn new(scope: Scope, loaded: impl Into<Arc<JsonMap>>) -> Self {
        Self {
            scope,
            changed: None,
            loaded: loaded.into(),
            used: Cell::new(false),
            stored: false,
        }
    }

    /// The same state, saying whether it had been written before this turn (a bot worker is told;
    /// see `proto/turnstile/v1/worker.proto`).
    #[must_use]
    pub fn stored(mut self, stored: bool) -> Self {
        self.stored = stored;
        self
    }

    /// Whether this scope's state had ever been written before this turn (an empty object that
    /// was written is stored; a key never written is not).
    pub fn was_stored(&self) -> bool {
        self.stored
    }

    /// Which scope this is.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// Reads property `name`, or `None` when it is not set.
    ///
    /// # Errors
    /// When the stored JSON does not deserialize into `T`.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, PropertyError> {
        self.used.set(true);
        self.current()
            .get(name)
            .map(|v| T::deserialize(v).map_err(|e| self.error(name, e)))
            .transpose()
    }

    /// Reads property `name`, or `T::default()` when it is not set.
    ///
    /// # Errors
    /// When the stored JSON does not deserialize into `T`.
    pub fn get_or_default<T: DeserializeOwned + Default>(
        &self,
        name: &str,
    ) -> Result<T, PropertyError> {
        Ok(self.get(name)?.unwrap_or_default())
    }

    /// Sets property `name` to `value`.
    ///
    /// # Errors
    /// When `value` does not serialize to JSON (a map with non-string keys, say).
    pub fn set<T: Serialize + ?Sized>(
        &mut self,
        name: &str,
        value: &T,
    ) -> Result<(), PropertyError> {
        self.used.set(true);
        let json = serde_json::to_value(value).map_err(|e| self.error(name, e))?;
        let properties = self.changing();
        // A property set before keeps its name: `insert` would allocate a new one only to drop it.
        match properties.get_mut(name) {
            Some(slot) => *slot = json,
            None => {
                properties.insert(name.to_owned(), json);
            }
        }
        Ok(())
    }

    /// Removes property `name`; a no-op when it is not set.
    pub fn remove(&mut self, name: &str) {
        self.used.set(true);
        if self.current().contains_key(name) {
            self.changing().remove(name);
        }
    }

    /// Removes every property of this scope.
    pub fn clear(&mut self) {
        self.used.set(true);
        self.changed = Some(JsonMap::new());
    }

    /// The properties as they stand now.
    pub fn properties(&self) -> &JsonMap {
        self.used.set(true);
        self.current()
    }

    /// Replaces every property with `properties`, as one write.
    pub fn replace(&mut self, properties: JsonMap) {
        self.used.set(true);
        self.changed = Some(properties);
    }

    /// The properties as they were loaded, without counting as a read (for handing them to a
    /// bot worker, whose answer says whether it read them).
    pub fn loaded(&self) -> &JsonMap {
        &self.loaded
    }

    /// The properties as they were loaded, shared, without counting as a read (for the commit,
    /// which may write only the properties changed since).
    pub fn loaded_shared(&self) -> &Arc<JsonMap> {
        &self.loaded
    }

    /// Whether the turn read or wrote this scope at all.
    pub fn was_used(&self) -> bool {
        self.used.get()
    }

    /// Whether the turn changed this scope since it was loaded.
    pub fn is_changed(&self) -> bool {
        self.changed.as_ref().is_some_and(|c| c != &*self.loaded)
    }

    /// The properties, consuming the state.
    pub fn into_properties(self) -> JsonMap {
        self.changed
            .unwrap_or_else(|| Arc::unwrap_or_clone(self.loaded))
    }

    /// The properties as they stand now, without counting as a use.
    fn current(&self) -> &JsonMap {
        self.changed.as_ref().unwrap_or(&self.loaded)
    }

    /// The properties to change: a copy of the loaded ones, made on the first change.
    fn changing(&mut self) -> &mut JsonMap {
        self.changed
            .get_or_insert_with(|| JsonMap::clone(&self.loaded))
    }

    fn error(&self, name: &str, source: serde_json::Error) -> PropertyError {
        PropertyError {
            scope: self.scope,
            name: name.to_owned(),
            source,
        }
    }
}

/// `state` as JSON text, the same text serde_json writes: what the store keeps, and by its
/// length what the scope size limit and the state-size histogram measure
/// ([`crate::store::StateWrite`]).
///
/// Written by hand ([`crate::activity::json`]'s writer): a string with nothing to escape — almost
/// every string a bot stores — is found so a block at a time and copied whole, where serde_json
/// looks at every byte on its own (`bench/RESULTS.md`).
pub fn json_text(state: &JsonMap) -> String {
    // Sized first, so that the text is written without growing: growing a 1 KB state's text from
    // a guess cost as much as the walk it saved (`bench/RESULTS.md`).
    let mut text = String::with_capacity(object_room(state));
    crate::activity::json::write_map(state, &mut text);
    text
}

/// Room for `map`'s JSON text, counted without looking inside a string: its length and quotes,
/// exact unless it has something to escape (then the text grows); 24 for a number, the longest
/// text serde_json writes for one (`-1.7976931348623157e308` is 23).
fn object_room(map: &JsonMap) -> usize {
    map.iter()
        .fold(2, |room, (key, value)| room + property_room(key, value))
}

/// Room for one property of an object's JSON text, counted as [`object_room`] counts it: so
/// that a write of some properties can tell it would be large before writing it
/// ([`crate::store::StateWrite::changed_since`]).
pub(crate) fn property_room(key: &str, value: &Value) -> usize {
    key.len() + 4 + value_room(value)
}

fn value_room(value: &Value) -> usize {
    match value {
        Value::Null | Value::Bool(_) => 5,
        Value::Number(_) => 24,
        Value::String(s) => s.len() + 2,
        Value::Array(items) => items
            .iter()
            .fold(2, |room, item| room + 1 + value_room(item)),
        Value::Object(map) => object_room(map),
    }
}

/// The length of `state` as JSON text ([`json_text`]): the admin service's sizes.
pub fn json_len(state: &JsonMap) -> usize {
    json_text(state).len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// Any JSON value, strings with escapes and numbers of every kind included.
    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|f| json!(f)),
            "\\PC*|[\\x00-\\x7f]*".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                proptest::collection::vec(("\\PC*|[\\x00-\\x7f]*", inner), 0..8)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn json_text_is_the_text_serde_json_writes(values in proptest::collection::vec(any_json(), 0..6)) {
            let state: JsonMap = values
                .into_iter()
                .enumerate()
                .map(|(i, value)| (format!("k{i}\"\u{1}"), value))
                .collect();
            let text = json_text(&state);
            prop_assert_eq!(&text, &serde_json::to_string(&state).expect("json"));
            prop_assert_eq!(json_len(&state), text.len());
        }
    }

    #[test]
    fn a_state_with_nothing_to_escape_is_written_without_growing() {
        let state = json!({
            "pad": ".".repeat(1024),
            "count": 12345,
            "order": ["mushroom", "cheese", {"size": "large", "extra": null, "hot": true}],
            "n": -7,
        });
        let state = state.as_object().expect("an object");
        let text = json_text(state);
        assert_eq!(text, serde_json::to_string(state).expect("json"));
        assert_eq!(text.capacity(), object_room(state), "grown while written");
        assert!(
            object_room(state) - text.len() <= 24 * 2,
            "room far beyond the text"
        );
    }

    #[test]
    fn typed_properties_round_trip_and_track_changes() {
        let mut state = ScopeState::new(Scope::Conversation, JsonMap::new());
        assert!(!state.is_changed());
        assert!(!state.was_used());
        assert_eq!(state.get::<Vec<String>>("order").expect("readable"), None);
        assert!(state.was_used(), "a read is a use");
        state
            .set("order", &vec!["ham".to_owned()])
            .expect("writable");
        assert!(state.is_changed());
        let order: Vec<String> = state.get_or_default("order").expect("readable");
        assert_eq!(order, ["ham"]);
        state.remove("order");
        assert!(!state.is_changed(), "back to what was loaded");
    }

    #[test]
    fn a_property_of_the_wrong_type_names_itself() {
        let mut loaded = JsonMap::new();
        loaded.insert("count".into(), serde_json::json!("three"));
        let state = ScopeState::new(Scope::User, loaded);
        let err = state
            .get::<u32>("count")
            .expect_err("a string is no number");
        assert!(
            err.to_string()
                .starts_with("state property `count` in user state"),
            "{err}"
        );
    }
}
