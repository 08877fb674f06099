//! JSON parameters (`jsonb`) written straight into the driver's buffer, the same text serde_json
//! writes, but with strings that need no escaping copied whole.
//!
//! Why: a turn's state is written back on every commit, and serde_json looks at every byte of
//! every string, one at a time, to find the few it must escape: with the benchmark's 1 KB state,
//! a large share of the server's work per turn (callgrind, `bench/RESULTS.md`). Here a
//! string is first checked for such bytes a block at a time; one with nothing to escape — almost every
//! string a bot stores — is copied as it is, and any other is left to serde_json. Numbers are
//! always serde_json's, so the text is exactly what `tokio_postgres::types::Json` would send.

use bytes::{BufMut as _, BytesMut};
use serde_json::Value;
use tokio_postgres::types::{FromSql, IsNull, ToSql, Type, to_sql_checked};

use crate::activity::JsonMap;
use crate::activity::scan::needs_escape;

/// A JSON object or value sent as a `jsonb` parameter.
#[derive(Debug, Clone, Copy)]
pub(super) enum Jsonb<'a> {
    /// A state object.
    Map(&'a JsonMap),
    /// JSON text written already (a receipt), sent as it is.
    Text(&'a str),
}

impl ToSql for Jsonb<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            // The jsonb binary format: a version byte, then the text.
            out.put_u8(1);
        }
        match self {
            Jsonb::Map(map) => write_object(map, out)?,
            Jsonb::Text(text) => out.put_slice(text.as_bytes()),
        }
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::JSONB | Type::JSON)
    }

    to_sql_checked!();
}

/// A `jsonb` (or `json`) column read as its JSON text, unparsed: a receipt, which the store keeps
/// opaque and only a redelivery parses.
#[derive(Debug)]
pub(super) struct JsonbText(pub String);

impl<'a> FromSql<'a> for JsonbText {
    fn from_sql(
        ty: &Type,
        mut raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            // The jsonb binary format: a version byte, then the text.
            match raw.split_first() {
                Some((1, text)) => raw = text,
                _ => return Err("unsupported jsonb encoding version".into()),
            }
        }
        Ok(Self(std::str::from_utf8(raw)?.to_owned()))
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::JSONB | Type::JSON)
    }
}

fn write_value(value: &Value, out: &mut BytesMut) -> serde_json::Result<()> {
    match value {
        Value::Null => out.put_slice(b"null"),
        Value::Bool(true) => out.put_slice(b"true"),
        Value::Bool(false) => out.put_slice(b"false"),
        Value::Number(n) => serde_json::to_writer((&mut *out).writer(), n)?,
        Value::String(s) => write_str(s, out)?,
        Value::Array(items) => {
            out.put_u8(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put_u8(b',');
                }
                write_value(item, out)?;
            }
            out.put_u8(b']');
        }
        Value::Object(map) => write_object(map, out)?,
    }
    Ok(())
}

fn write_object(map: &JsonMap, out: &mut BytesMut) -> serde_json::Result<()> {
    out.put_u8(b'{');
    for (i, (key, value)) in map.iter().enumerate() {
        if i > 0 {
            out.put_u8(b',');
        }
        write_str(key, out)?;
        out.put_u8(b':');
        write_value(value, out)?;
    }
    out.put_u8(b'}');
    Ok(())
}

fn write_str(s: &str, out: &mut BytesMut) -> serde_json::Result<()> {
    if needs_escape(s.as_bytes()) {
        return serde_json::to_writer((&mut *out).writer(), s);
    }
    out.reserve(s.len() + 2);
    out.put_u8(b'"');
    out.put_slice(s.as_bytes());
    out.put_u8(b'"');
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn text(value: &Value) -> Vec<u8> {
        let mut out = BytesMut::new();
        Jsonb::Map(value.as_object().expect("an object"))
            .to_sql(&Type::JSON, &mut out)
            .expect("serializable");
        out.to_vec()
    }

    #[test]
    fn the_text_is_serde_jsons() {
        let value = json!({
            "pad": ".".repeat(1024),
            "quote\"d": "a\"b\\c\nd\u{1}e\u{7f}é💡",
            "n": [1, -2, 1.5, 1e300, null, true, false, {}, []],
            "nested": {"k": "exactly eight", "": ""},
        });
        assert_eq!(text(&value), serde_json::to_vec(&value).expect("json"));
        let mut out = BytesMut::new();
        Jsonb::Map(value.as_object().expect("an object"))
            .to_sql(&Type::JSONB, &mut out)
            .expect("serializable");
        assert_eq!(out[0], 1, "jsonb's version byte");
        assert_eq!(&out[1..], serde_json::to_vec(&value).expect("json"));
    }

    #[test]
    fn every_byte_that_needs_escaping_is_found_at_every_position() {
        for special in (0u8..0x20).chain([b'"', b'\\']) {
            for len in 1..20 {
                for at in 0..len {
                    let mut bytes = vec![b'x'; len];
                    bytes[at] = special;
                    assert!(needs_escape(&bytes), "{special:#x} at {at} of {len}");
                }
            }
        }
        for clean in [0x20u8, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xff] {
            assert!(!needs_escape(&[clean; 17]), "{clean:#x}");
        }
    }

    proptest! {
        #[test]
        fn any_string_is_written_as_serde_json_writes_it(s in "\\PC*|[\\x00-\\x7f]*") {
            let value = json!({ s.clone(): s });
            prop_assert_eq!(text(&value), serde_json::to_vec(&value).expect("json"));
        }
    }
}
