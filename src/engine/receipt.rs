//! A committed turn's answer, as stored with its commit so that a redelivered activity gets the
//! same answer without running the bot again.
//!
//! The store keeps it as opaque JSON text; this is its one reader and writer. Activities are kept
//! in Bot Framework JSON, the lossless form, so a redelivered activity's answer is the original to
//! the field. The text is written once, straight from the replies (their `Serialize`, the same
//! JSON as `Activity::to_json`), and parsed only when a redelivery reads it.

use anyhow::{Context as _, anyhow};
use serde::Serialize;
use serde_json::Value;

use super::TurnOutcome;
use crate::activity::Activity;
use crate::store::{Receipt, StoreError, Version};

/// What a receipt holds, as written.
#[derive(Serialize)]
struct Written<'a> {
    activities: &'a [Activity],
    attempts: u32,
    version: u64,
}

/// The receipt of `outcome`. Activities write only string keys and `Value`s, which serde_json
/// always writes, so the error is one the turn fails with, before its commit, rather than one
/// to expect.
pub(super) fn encode(outcome: &TurnOutcome) -> Result<Receipt, super::TurnError> {
    Receipt::write(&Written {
        activities: &outcome.activities,
        attempts: outcome.attempts,
        version: outcome.conversation_version.map_or(0, Version::get),
    })
    .context("the turn's receipt cannot be written as JSON")
    .map_err(|e| super::TurnError::Store(StoreError::Unexpected(e)))
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
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

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
        };
        let back = decode(&encode(&outcome).expect("writable")).expect("readable");
        assert_eq!(
            back,
            TurnOutcome {
                redelivered: true,
                ..outcome
            }
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
