//! JSON parameters (`jsonb`) sent as the text written already, and receipts read back as text.
//!
//! Why: the store sends JSON it has as text, never a value to serialize — a written state's text
//! ([`crate::store::StateWrite`], written when the engine measured its size) and a receipt's
//! (written once from the replies) — and keeps receipts opaque, so it copies bytes both ways.
//! tokio-postgres's own `Json` would serialize a value again, looking at every byte of every
//! string on its own.

use bytes::{BufMut as _, BytesMut};
use tokio_postgres::types::{FromSql, IsNull, ToSql, Type, to_sql_checked};

/// UTF-8 JSON text sent as a `jsonb` (or `json`) parameter, as it is.
#[derive(Debug, Clone, Copy)]
pub(super) struct Jsonb<'a>(pub &'a [u8]);

impl<'a> Jsonb<'a> {
    /// JSON text (a receipt's).
    pub(super) fn text(text: &'a str) -> Self {
        Self(text.as_bytes())
    }
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
        out.put_slice(self.0);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonb_is_its_version_byte_then_the_text_and_json_the_text_alone() {
        let text = r#"{"a":"b\"c"}"#;
        let mut out = BytesMut::new();
        Jsonb::text(text)
            .to_sql(&Type::JSONB, &mut out)
            .expect("written");
        assert_eq!(out[0], 1, "jsonb's version byte");
        assert_eq!(&out[1..], text.as_bytes());
        let mut out = BytesMut::new();
        Jsonb::text(text)
            .to_sql(&Type::JSON, &mut out)
            .expect("written");
        assert_eq!(&out[..], text.as_bytes());
        let read =
            JsonbText::from_sql(&Type::JSONB, &[&[1], text.as_bytes()].concat()).expect("read");
        assert_eq!(read.0, text);
        assert!(JsonbText::from_sql(&Type::JSONB, &[2, b'{', b'}']).is_err());
    }
}
