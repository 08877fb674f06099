//! The checker: from the gateway's record and the database's final state, proves that no turn
//! was lost, invented or doubled.
//!
//! With the `counter` bot a conversation's state is the number of turns applied to it, and each
//! reply `count: N` says "this turn was the N-th". So, once every turn has been acknowledged,
//! per conversation:
//! - every acknowledged change is in the state: each N is at most the final count;
//! - no reply was returned for a change that is not in the state: two turns never share an N
//!   (one of them would be a change that the other overwrote);
//! - no turn was applied twice: the final count equals the number of distinct turns.
//!
//! Together: the Ns of the distinct turns are exactly 1..=final. Besides, every redelivery of a
//! turn got the same N as its first delivery, and each turn left exactly one receipt, holding
//! the N it was acknowledged with.

use std::collections::{BTreeMap, HashMap};

use super::load::{Ack, BOT, CHANNEL, Record, conversation_id};

/// What the checker proved about one run, for the summary.
#[derive(Debug, Default)]
pub struct Proof {
    /// Distinct turns, each acknowledged.
    pub turns: usize,
    /// The sum of the conversations' final counts.
    pub applied: u64,
    /// Conversations with at least one turn.
    pub conversations: usize,
}

/// The conversation state key of conversation `i`, as `src/state/key.rs` builds it.
pub fn conversation_key(i: usize) -> String {
    [BOT, CHANNEL, "conversations", &conversation_id(i)]
        .map(escape)
        .join("/")
}

/// The receipt key of activity `id` in conversation `i`.
pub fn receipt_key(i: usize, id: &str) -> String {
    [
        BOT,
        CHANNEL,
        "conversations",
        &conversation_id(i),
        "activities",
        id,
    ]
    .map(escape)
    .join("/")
}

fn escape(part: &str) -> String {
    part.replace('%', "%25").replace('/', "%2F")
}

/// The final count of each of conversations `0..conversations` (0 for one never written), read
/// from PostgreSQL directly.
pub async fn final_counts(database_url: &str, conversations: usize) -> BTreeMap<usize, u64> {
    let client = super::pg::session(database_url).await;
    let keys: Vec<String> = (0..conversations).map(conversation_key).collect();
    let rows = client
        .query(
            "SELECT key, state FROM turnstile_state WHERE key = ANY($1)",
            &[&keys],
        )
        .await
        .expect("reading the final state");
    let by_key: HashMap<String, serde_json::Value> = rows
        .iter()
        .map(|row| (row.get::<_, String>(0), row.get(1)))
        .collect();
    (0..conversations)
        .map(|i| {
            let count = by_key.get(&conversation_key(i)).map_or(0, |state| {
                state["count"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("conversation {i}: state {state} has no count"))
            });
            (i, count)
        })
        .collect()
}

/// Every receipt of the `counter` bot: key → the N its stored reply says.
pub async fn receipts(database_url: &str) -> HashMap<String, Option<u64>> {
    let client = super::pg::session(database_url).await;
    let rows = client
        .query(
            "SELECT DISTINCT key, payload FROM (SELECT key, payload FROM turnstile_receipt \
             UNION ALL SELECT key, payload FROM turnstile_receipt_legacy) r WHERE key LIKE $1",
            &[&format!("{BOT}/%")],
        )
        .await
        .expect("reading the receipts");
    rows.iter()
        .map(|row| {
            let payload: serde_json::Value = row.get(1);
            let count = payload["activities"][0]["text"]
                .as_str()
                .and_then(|t| t.strip_prefix("count: "))
                .and_then(|n| n.parse().ok());
            (row.get::<_, String>(0), count)
        })
        .collect()
}

/// Checks `record` (every turn acknowledged by now) against the final `counts` and `receipts`.
///
/// # Panics
/// With every violation found, when there is one.
pub fn prove(
    record: &Record,
    counts: &BTreeMap<usize, u64>,
    receipts: &HashMap<String, Option<u64>>,
) -> Proof {
    let mut violations = Vec::new();

    // Each turn's answers: all the same N.
    let mut answers: BTreeMap<&str, Vec<&Ack>> = BTreeMap::new();
    for ack in &record.acks {
        answers.entry(&ack.id).or_default().push(ack);
    }
    for turn in &record.turns {
        if !answers.contains_key(turn.id.as_str()) {
            violations.push(format!("{turn:?} was never acknowledged"));
        }
    }
    let mut counted: BTreeMap<usize, Vec<(u64, &str)>> = BTreeMap::new();
    for (id, acks) in &answers {
        let first = acks[0];
        if let Some(other) = acks
            .iter()
            .find(|a| a.count != first.count || a.conversation != first.conversation)
        {
            violations.push(format!(
                "turn {id} was answered `count: {}` and later `count: {}` (conversations {} and {})",
                first.count, other.count, first.conversation, other.conversation
            ));
        }
        counted
            .entry(first.conversation)
            .or_default()
            .push((first.count, id));
    }

    // Per conversation: the Ns of its distinct turns are exactly 1..=final.
    let mut proof = Proof {
        turns: answers.len(),
        ..Proof::default()
    };
    for (&conversation, &count) in counts {
        proof.applied += count;
        let mut ns = counted.remove(&conversation).unwrap_or_default();
        if !ns.is_empty() {
            proof.conversations += 1;
        }
        ns.sort_unstable();
        for pair in ns.windows(2) {
            if pair[0].0 == pair[1].0 {
                violations.push(format!(
                    "conversation {conversation}: turns {} and {} were both told `count: {}` — \
                     one of those changes is not in the state",
                    pair[0].1, pair[1].1, pair[0].0
                ));
            }
        }
        for (n, id) in &ns {
            if *n > count || *n == 0 {
                violations.push(format!(
                    "conversation {conversation}: turn {id} was told `count: {n}` but the state \
                     says {count}: an acknowledged change is missing"
                ));
            }
        }
        if ns.len() as u64 != count {
            violations.push(format!(
                "conversation {conversation}: {} turns acknowledged, the state counted {count} — \
                 {}",
                ns.len(),
                if count > ns.len() as u64 {
                    "a turn was applied twice (or applied without an answer)"
                } else {
                    "acknowledged turns are missing from the state"
                }
            ));
        }
    }
    for (conversation, ns) in counted {
        violations.push(format!(
            "conversation {conversation} is outside the load: {} turns",
            ns.len()
        ));
    }

    // Each turn left exactly one receipt, holding the answer it was acknowledged with.
    for (id, acks) in &answers {
        let key = receipt_key(acks[0].conversation, id);
        match receipts.get(&key) {
            Some(Some(n)) if *n == acks[0].count => {}
            Some(stored) => violations.push(format!(
                "turn {id}: acknowledged `count: {}`, its receipt says {stored:?}",
                acks[0].count
            )),
            None => violations.push(format!("turn {id} left no receipt")),
        }
    }
    if receipts.len() != answers.len() {
        violations.push(format!(
            "{} receipts for {} turns",
            receipts.len(),
            answers.len()
        ));
    }

    assert!(
        violations.is_empty(),
        "{} violations (first 30):\n{}",
        violations.len(),
        violations
            .iter()
            .take(30)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    proof
}
