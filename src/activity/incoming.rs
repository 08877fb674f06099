//! Parsing an inbound activity into what a turn needs to find its state.
//!
//! Proto3 has no required fields, so every activity that reaches us may lack anything. This module
//! is the one place that decides whether an activity can run as a turn: it has a `type`, a
//! `channel_id` and a `conversation.id`, and a message has a `from.id`. Ids become newtypes that
//! are known to be non-empty, of bounded length and free of control characters, so that the state
//! keys built from them (see `crate::state`) are always well formed.

use std::fmt;

use super::{Activity, scan, types};

/// The longest id (channel, conversation or user) accepted, in bytes. State keys are built from
/// up to three of them, and PostgreSQL's B-tree index caps an entry at about 2,700 bytes; 256
/// bytes each keeps the worst-case escaped key well under that while fitting every real channel's
/// ids (Teams' conversation ids, the longest seen, run to about 150 bytes).
pub const MAX_ID_BYTES: usize = 256;

/// Why an activity cannot run as a turn, naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid activity: `{field}` {problem}")]
pub struct InvalidActivity {
    field: String,
    problem: String,
}

impl InvalidActivity {
    /// An activity whose `field` (as named in the API, e.g. `conversation.id`) has `problem`.
    pub fn new(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            problem: problem.into(),
        }
    }

    /// The field at fault, as named in the API (`conversation.id`, `from.id`, …).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong with the field (`is missing`, `is 300 bytes, over the 256-byte limit`, …).
    pub fn problem(&self) -> &str {
        &self.problem
    }
}

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// Parses an id taken from the field named `field`.
            ///
            /// # Errors
            /// When the id is empty, longer than [`MAX_ID_BYTES`], or holds a control character.
            pub fn parse(value: &str, field: &str) -> Result<Self, InvalidActivity> {
                parse_id(value, field).map(|v| Self(v.to_owned()))
            }

            /// The id as the channel sent it.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

id_newtype!(
    /// A channel's id (`msteams`, `slack`, `directline`, …).
    ChannelId
);
id_newtype!(
    /// A conversation's id within its channel.
    ConversationId
);
id_newtype!(
    /// A user's id within its channel (the activity's `from.id`).
    UserId
);
id_newtype!(
    /// An activity's id, as the channel assigned it: what identifies a redelivery.
    ActivityId
);

fn parse_id<'a>(value: &'a str, field: &str) -> Result<&'a str, InvalidActivity> {
    if value.is_empty() {
        return Err(InvalidActivity::new(field, "is empty"));
    }
    if value.len() > MAX_ID_BYTES {
        return Err(InvalidActivity::new(
            field,
            format!(
                "is {} bytes, over the {MAX_ID_BYTES}-byte limit",
                value.len()
            ),
        ));
    }
    // Control characters are U+0000–U+001F, U+007F and U+0080–U+009F (in UTF-8, 0xC2 then
    // 0x80–0x9F). An id with none of the bytes 0x00–0x1F, 0x7F and 0xC2 has none, and is
    // passed after a check a word at a time; any other is searched a character at a time.
    if !may_hold_control(value.as_bytes()) {
        return Ok(value);
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(InvalidActivity::new(
            field,
            format!("contains the control character U+{:04X}", u32::from(c)),
        ));
    }
    Ok(value)
}

/// Whether `bytes` may encode a control character: it holds a byte below 0x20, 0x7F (DEL) or
/// 0xC2 (the lead byte of U+0080–U+00BF). Checked a word at a time: this runs for every id of
/// every turn.
fn may_hold_control(bytes: &[u8]) -> bool {
    scan::any_word(bytes, b'a', |w| {
        scan::byte_below(w, 0x20) | scan::byte_is(w, 0x7f) | scan::byte_is(w, 0xc2)
    })
}

/// Where a turn's state lives: the ids every state key is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnAddress {
    /// The channel the activity came through.
    pub channel: ChannelId,
    /// The conversation it belongs to.
    pub conversation: ConversationId,
    /// The user who sent it, when the activity names one (always, for a message).
    pub user: Option<UserId>,
}

/// An activity known to be runnable as a turn, with its parsed address.
///
/// The activity is boxed: it is two kilobytes, and the turn's task, its span wrapper and `spawn`
/// each moved it whole (`bench/RESULTS.md`); boxed as it is converted from the wire, it is
/// written once and only its address moves after that.
#[derive(Debug, Clone, PartialEq)]
pub struct IncomingActivity {
    activity: Box<Activity>,
    address: TurnAddress,
    id: Option<ActivityId>,
}

impl IncomingActivity {
    /// Checks that `activity` can run as a turn.
    ///
    /// # Errors
    /// [`InvalidActivity`] naming the first field that is missing or malformed.
    pub fn parse(activity: impl Into<Box<Activity>>) -> Result<Self, InvalidActivity> {
        let activity = activity.into();
        let kind = match activity.activity_type.as_deref() {
            None => return Err(InvalidActivity::new("type", "is missing")),
            Some("") => return Err(InvalidActivity::new("type", "is empty")),
            Some(kind) => kind,
        };
        let channel = match activity.channel_id.as_deref() {
            Some(id) => ChannelId::parse(id, "channel_id")?,
            None => return Err(InvalidActivity::new("channel_id", "is missing")),
        };
        let conversation = match activity.conversation.as_ref() {
            None => return Err(InvalidActivity::new("conversation", "is missing")),
            Some(c) => match c.id.as_deref() {
                Some(id) => ConversationId::parse(id, "conversation.id")?,
                None => return Err(InvalidActivity::new("conversation.id", "is missing")),
            },
        };
        let user = match activity.from.as_ref().and_then(|f| f.id.as_deref()) {
            Some(id) => Some(UserId::parse(id, "from.id")?),
            None if kind == types::MESSAGE => {
                return Err(InvalidActivity::new("from.id", "is missing on a message"));
            }
            None => None,
        };
        let id = match activity.id.as_deref() {
            Some(id) => Some(ActivityId::parse(id, "id")?),
            None => None,
        };
        Ok(Self {
            id,
            address: TurnAddress {
                channel,
                conversation,
                user,
            },
            activity,
        })
    }

    /// The activity as received.
    pub fn activity(&self) -> &Activity {
        &self.activity
    }

    /// Where the turn's state lives.
    pub fn address(&self) -> &TurnAddress {
        &self.address
    }

    /// The activity's id, which makes a redelivery recognizable; `None` when the channel sent
    /// none (such activities are not deduplicated).
    pub fn id(&self) -> Option<&ActivityId> {
        self.id.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::{ChannelAccount, ConversationAccount};

    fn message() -> Activity {
        Activity {
            channel_id: Some("test".into()),
            conversation: Some(ConversationAccount {
                id: Some("c1".into()),
                ..Default::default()
            }),
            from: Some(ChannelAccount {
                id: Some("u1".into()),
                ..Default::default()
            }),
            ..Activity::message("hi")
        }
    }

    fn field_of(activity: Activity) -> String {
        IncomingActivity::parse(activity)
            .expect_err("should be invalid")
            .field()
            .to_owned()
    }

    #[test]
    fn a_complete_message_parses() {
        let parsed = IncomingActivity::parse(message()).expect("valid");
        assert_eq!(parsed.address().conversation.as_str(), "c1");
        assert_eq!(
            parsed.address().user.as_ref().map(UserId::as_str),
            Some("u1")
        );
    }

    #[test]
    fn each_missing_required_field_is_named() {
        assert_eq!(
            field_of(Activity {
                activity_type: None,
                ..message()
            }),
            "type"
        );
        assert_eq!(
            field_of(Activity {
                channel_id: None,
                ..message()
            }),
            "channel_id"
        );
        assert_eq!(
            field_of(Activity {
                conversation: None,
                ..message()
            }),
            "conversation"
        );
        let no_conversation_id = Activity {
            conversation: Some(ConversationAccount::default()),
            ..message()
        };
        assert_eq!(field_of(no_conversation_id), "conversation.id");
        assert_eq!(
            field_of(Activity {
                from: None,
                ..message()
            }),
            "from.id"
        );
    }

    #[test]
    fn a_non_message_may_omit_the_user() {
        let update = Activity {
            activity_type: Some("conversationUpdate".into()),
            from: None,
            ..message()
        };
        let parsed = IncomingActivity::parse(update).expect("valid");
        assert_eq!(parsed.address().user, None);
    }

    #[test]
    fn ids_with_control_characters_or_too_long_are_refused() {
        let err = ConversationId::parse("a\u{0}b", "conversation.id").expect_err("control");
        assert!(err.to_string().contains("U+0000"), "{err}");
        let long = "x".repeat(MAX_ID_BYTES + 1);
        let err = UserId::parse(&long, "from.id").expect_err("too long");
        assert!(err.to_string().contains("over the 256-byte limit"), "{err}");
        assert!(ChannelId::parse("", "channel_id").is_err());
        assert!(ConversationId::parse("19:abc@thread.skype/users/x", "conversation.id").is_ok());
    }

    #[test]
    fn every_control_character_is_refused_at_every_position_and_nothing_else() {
        // Every character, in a block-sized id at each place a block boundary can fall.
        for c in (0..=0x10_ffff).filter_map(char::from_u32) {
            for pad in [0, 31, 40] {
                let id = format!("{}{c}b", "a".repeat(pad));
                assert_eq!(
                    ConversationId::parse(&id, "conversation.id").is_err(),
                    c.is_control(),
                    "U+{:04X} after {pad} bytes",
                    u32::from(c)
                );
            }
        }
    }
}
