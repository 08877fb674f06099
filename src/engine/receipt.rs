//! A committed turn's answer, as stored with its commit so that a redelivered activity gets the
//! same answer without running the bot again.
//!
//! The store keeps it as opaque JSON text; this is its one reader and writer. Activities are kept
//! in Bot Framework JSON, the lossless form, so a redelivered activity's answer is the original to
//! the field. The text is written once, straight from the replies (their `Serialize`, the same
//! JSON as `Activity::to_json`), and parsed only when a redelivery reads it.

use anyhow::{Context as _, anyhow};
use serde_json::Value;

use super::TurnOutcome;
use crate::activity::Activity;
use crate::store::{Receipt, StoreError, Version};

/// The receipt of `outcome`: `{"activities":[…],"attempts":…,"version":…}`, the replies as
/// [`Activity::write_json`] writes them (the same text as serde_json), written by hand into one
/// string, and `"user"`, whose activity it answered ([`StateKey::user_subject`]), by which an
/// erasure finds it. Nothing in it can fail to be written.
///
/// [`StateKey::user_subject`]: crate::state::StateKey::user_subject
pub(super) fn encode(outcome: &TurnOutcome, user: Option<&str>) -> Receipt {
    // Room for a reply with its addresses and ids (about 700 bytes), so that the text rarely
    // grows while written: growing it was a tenth of the receipt's cost (`bench/RESULTS.md`).
    let mut text = String::with_capacity(128 + 1024 * outcome.activities.len());
    text.push_str("{\"activities\":[");
    for (i, activity) in outcome.activities.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        activity.write_json(&mut text);
    }
    let version = outcome.conversation_version.map_or(0, Version::get);
    text.push_str("],\"attempts\":");
    push_decimal(&mut text, u64::from(outcome.attempts));
    text.push_str(",\"version\":");
    push_decimal(&mut text, version);
    if outcome.stopped {
        // Only when set: the receipts of turns nobody stopped stay as they were, and a replica
        // from before stops reads this one (as an ordinary answer).
        text.push_str(",\"stopped\":true");
    }
    if outcome.superseded {
        text.push_str(",\"superseded\":true");
    }
    if let Some(user) = user {
        text.push_str(",\"user\":");
        crate::activity::json::write_str(user, &mut text);
    }
    if !outcome.coalesced.is_empty() {
        text.push_str(",\"coalesced\":");
        // Activity ids: strings, which serde_json writes escaped; nothing in them can fail.
        text.push_str(&Value::from(outcome.coalesced.clone()).to_string());
    }
    text.push('}');
    Receipt::from_written(text)
}

/// Appends `n` in decimal, the text `Display` (and serde_json) writes, by `itoa` (serde_json's own
/// integer writer) rather than `write!`'s formatting machinery, which was dear for these two
/// numbers (`bench/RESULTS.md`).
fn push_decimal(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// The outcome a receipt recorded, marked as a redelivery's.
pub(super) fn decode(receipt: &Receipt) -> Result<TurnOutcome, super::TurnError> {
    receipt
        .to_value()
        .map_err(anyhow::Error::from)
        .and_then(|value| read(&value))
        .context("a stored turn receipt is unreadable")
        .map_err(|e| super::TurnError::Store(StoreError::Unexpected(e)))
}

fn read(receipt: &Value) -> anyhow::Result<TurnOutcome> {
    let activities = receipt
        .get("activities")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("no activities"))?
        .iter()
        .map(|a| Activity::from_json(a.clone()).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let attempts = receipt
        .get("attempts")
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| anyhow!("no attempts"))?;
    let version = receipt
        .get("version")
        .and_then(Value::as_u64)
        .ok_or_else(|| anyhow!("no version"))?;
    Ok(TurnOutcome {
        activities,
        attempts,
        conversation_version: (version > 0).then(|| Version::new(version)),
        redelivered: true,
        stopped: receipt.get("stopped").and_then(Value::as_bool) == Some(true),
        superseded: receipt.get("superseded").and_then(Value::as_bool) == Some(true),
        coalesced: receipt
            .get("coalesced")
            .and_then(Value::as_array)
            .map(|ids| {
                ids.iter()
                    .filter_map(|id| id.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn numbers_are_written_as_display_writes_them() {
        let mut edges = vec![
            0,
            1,
            9,
            10,
            99,
            100,
            u64::from(u32::MAX),
            u64::MAX - 1,
            u64::MAX,
        ];
        edges.extend((0..64).map(|bit| 1u64 << bit));
        edges.extend((1..20).map(|digits| 10u64.pow(digits) - 1));
        for n in edges {
            let mut text = String::from("x");
            push_decimal(&mut text, n);
            assert_eq!(text, format!("x{n}"));
        }
    }

    #[test]
    fn a_receipt_gives_back_the_outcome_it_recorded() {
        let mut reply = Activity::message("count: 3");
        reply
            .properties
            .insert("futureField".into(), json!({"kept": [1, 2]}));
        let outcome = TurnOutcome {
            activities: vec![reply, Activity::message("second")],
            attempts: 2,
            conversation_version: Some(Version::new(3)),
            redelivered: false,
            stopped: false,
            superseded: false,
            coalesced: Vec::new(),
        };
        let back = decode(&encode(&outcome, None)).expect("readable");
        assert_eq!(
            back,
            TurnOutcome {
                redelivered: true,
                ..outcome.clone()
            }
        );
        // The user it answered, for erasure to find it by; JSON-escaped, and ignored on reading.
        let named = encode(&outcome, Some("test/a\"da"));
        assert!(
            named.text().ends_with(r#","user":"test/a\"da"}"#),
            "{}",
            named.text()
        );
        assert_eq!(decode(&named).expect("readable"), back);
        let stopped = TurnOutcome {
            stopped: true,
            ..outcome.clone()
        };
        assert!(
            encode(&stopped, None)
                .text()
                .ends_with(",\"stopped\":true}")
        );
        assert_eq!(
            decode(&encode(&stopped, None)).expect("readable"),
            TurnOutcome {
                redelivered: true,
                ..stopped
            }
        );
        let superseded = TurnOutcome {
            activities: Vec::new(),
            superseded: true,
            ..outcome.clone()
        };
        assert_eq!(
            decode(&encode(&superseded, None)).expect("readable"),
            TurnOutcome {
                redelivered: true,
                ..superseded
            }
        );
        let coalesced = TurnOutcome {
            coalesced: vec!["a\"1".into(), "b".into()],
            ..outcome
        };
        assert!(
            encode(&coalesced, None)
                .text()
                .ends_with(r#","coalesced":["a\"1","b"]}"#)
        );
        assert_eq!(
            decode(&encode(&coalesced, None)).expect("readable"),
            TurnOutcome {
                redelivered: true,
                ..coalesced
            }
        );
    }

    #[test]
    fn a_receipt_is_the_text_serde_json_wrote_for_it() {
        let mut reply = Activity::message("a \"quoted\"\n\u{1}reply");
        reply
            .properties
            .insert("n".into(), json!([1.5, -0.0, 1e300]));
        let outcome = TurnOutcome {
            activities: vec![reply.clone(), Activity::message("second")],
            attempts: 1,
            conversation_version: None,
            redelivered: false,
            stopped: false,
            superseded: false,
            coalesced: Vec::new(),
        };
        let serde = |a: &Activity| serde_json::to_string(a).expect("serializable");
        assert_eq!(
            encode(&outcome, None).text(),
            format!(
                "{{\"activities\":[{},{}],\"attempts\":1,\"version\":0}}",
                serde(&reply),
                serde(&Activity::message("second"))
            )
        );
    }

    #[test]
    fn an_unreadable_receipt_is_an_unexpected_store_error() {
        let err = decode(&json!({"activities": "nope"}).into()).expect_err("unreadable");
        assert!(matches!(
            err,
            super::super::TurnError::Store(StoreError::Unexpected(_))
        ));
    }
}
