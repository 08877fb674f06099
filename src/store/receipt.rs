//! A receipt as the store keeps it: JSON text, opaque to the store.
//!
//! Why text and not a `serde_json::Value`: every committed turn of an activity with an id writes a
//! receipt, and almost none is ever read back (only a redelivery reads it). Building it as a
//! `Value`, writing that as jsonb and dropping it cost every turn (`bench/RESULTS.md`); as text it is written once, straight from the turn's replies, and sent to
//! PostgreSQL as it is. Its reader (`engine::receipt`) parses it only on the redelivery path.

use std::fmt;

use serde::Serialize;
use serde_json::value::RawValue;

/// A turn's receipt: one JSON value as text, known to be well-formed.
///
/// A `String`, not a `Box<str>`: the engine writes a receipt into a string with room to spare, and
/// boxing it gave the spare room back by moving the text (a reallocation per turn,
/// `bench/RESULTS.md`). PostgreSQL's store drops a receipt once sent; the in-memory store keeps
/// it with its room, a few hundred bytes.
#[derive(Clone)]
pub struct Receipt(String);

impl Receipt {
    /// The receipt whose JSON is `value` serialized.
    ///
    /// # Errors
    /// When `value` cannot be written as JSON (a map whose keys are not strings, say).
    pub fn write<T: Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        serde_json::to_string(value).map(Self)
    }

    /// The receipt stored as `text`, as read back from a store.
    ///
    /// # Errors
    /// When `text` is not one JSON value.
    pub fn from_text(text: String) -> Result<Self, serde_json::Error> {
        RawValue::from_string(text).map(|raw| Self(Box::<str>::from(raw).into()))
    }

    /// The receipt whose JSON text the engine wrote by hand (`Activity::write_json`, numbers,
    /// punctuation): one JSON value by construction, so not parsed again to check.
    pub(crate) fn from_written(text: String) -> Self {
        debug_assert!(
            RawValue::from_string(text.clone()).is_ok(),
            "a written receipt is one JSON value: {text}"
        );
        Self(text)
    }

    /// The JSON text.
    pub fn text(&self) -> &str {
        &self.0
    }

    /// The JSON, parsed.
    ///
    /// # Errors
    /// When the text nests deeper than serde_json reads.
    pub fn to_value(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(self.text())
    }
}

impl From<&serde_json::Value> for Receipt {
    fn from(value: &serde_json::Value) -> Self {
        // A `Value`'s own text is always one JSON value.
        Self(value.to_string())
    }
}

impl From<serde_json::Value> for Receipt {
    fn from(value: serde_json::Value) -> Self {
        Self::from(&value)
    }
}

/// Receipts are equal when their JSON is: a store may give back other text for the same value
/// (PostgreSQL's jsonb orders members and spaces them its own way).
impl PartialEq for Receipt {
    fn eq(&self, other: &Self) -> bool {
        self.text() == other.text()
            || matches!((self.to_value(), other.to_value()), (Ok(a), Ok(b)) if a == b)
    }
}

impl fmt::Debug for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Receipt").field(&self.text()).finish()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_receipt_is_its_json_whatever_the_spacing() {
        let value = json!({"b": [1, "x"], "a": null});
        let written = Receipt::write(&value).expect("serializable");
        assert_eq!(written.to_value().expect("valid"), value);
        let spaced = Receipt::from_text(r#"{"a": null, "b": [1, "x"]}"#.into()).expect("valid");
        assert_eq!(written, spaced);
        assert_ne!(written, Receipt::from(json!({"a": null, "b": [1]})));
        assert!(Receipt::from_text("{\"a\":".into()).is_err());
    }
}
