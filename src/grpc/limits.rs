//! What a caller may send: sizes and nesting, checked on the wire form before anything else.
//!
//! Channels cap their own messages (Bot Framework's connector refuses activities over about
//! 256 KB; Teams text over about 28 KB), so anything far beyond is a broken or hostile gateway.
//! Every refusal names the field to shrink. Nesting is limited too: JSON values arrive as nested
//! protobuf `Value`s, and every level costs the bot's serde and the database's jsonb a recursion.

use prost::Message as _;
use prost_types::value::Kind;

use super::pb;
use crate::activity::incoming::InvalidActivity;

/// Limits on one inbound activity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest activity, in encoded protobuf bytes.
    pub max_activity_bytes: usize,
    /// The longest `text`, `speak` or `summary`, in bytes.
    pub max_text_bytes: usize,
    /// The most bytes of all attachments together.
    pub max_attachments_bytes: usize,
    /// The most bytes of `channel_data`.
    pub max_channel_data_bytes: usize,
    /// The deepest nesting of any JSON value (`channel_data`, `value`, entities, attachment
    /// content, `properties`); a scalar is depth 0, `{"a": 1}` depth 1.
    pub max_json_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_activity_bytes: 256 * 1024,
            max_text_bytes: 64 * 1024,
            max_attachments_bytes: 192 * 1024,
            max_channel_data_bytes: 64 * 1024,
            max_json_depth: 32,
        }
    }
}

impl Limits {
    /// Checks `activity` against every limit.
    ///
    /// # Errors
    /// [`InvalidActivity`] naming the field over its limit.
    pub fn check(&self, activity: &pb::Activity) -> Result<(), InvalidActivity> {
        self.check_within(activity, None)
    }

    /// [`Limits::check`] for an activity whose encoding is at most `at_most` bytes, when that
    /// is known (the request that carried it, as received): every size limit the bound is within
    /// holds without measuring the activity, which walks every field of it (a hundredth of a
    /// turn's instructions, `bench/RESULTS.md`). Text lengths and nesting are checked whatever
    /// the bound.
    ///
    /// # Errors
    /// As [`Limits::check`].
    pub fn check_within(
        &self,
        activity: &pb::Activity,
        at_most: Option<usize>,
    ) -> Result<(), InvalidActivity> {
        let measure = |limit: usize| at_most.is_none_or(|bound| bound > limit);
        if measure(self.max_activity_bytes) {
            self.check_total(activity)?;
        }
        for (field, text) in [
            ("text", &activity.text),
            ("speak", &activity.speak),
            ("summary", &activity.summary),
        ] {
            over(
                field,
                text.as_ref().map_or(0, String::len),
                self.max_text_bytes,
            )?;
        }
        if measure(self.max_attachments_bytes) {
            over(
                "attachments",
                activity.attachments.iter().map(|a| a.encoded_len()).sum(),
                self.max_attachments_bytes,
            )?;
        }
        if measure(self.max_channel_data_bytes) {
            over(
                "channel_data",
                activity
                    .channel_data
                    .as_ref()
                    .map_or(0, |v| v.encoded_len()),
                self.max_channel_data_bytes,
            )?;
        }
        self.check_depth(activity)
    }

    /// The whole activity's size, naming its largest field.
    fn check_total(&self, activity: &pb::Activity) -> Result<(), InvalidActivity> {
        let size = activity.encoded_len();
        if size <= self.max_activity_bytes {
            return Ok(());
        }
        let len = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        let fields: [(&str, usize); 10] = [
            ("text", len(&activity.text)),
            ("speak", len(&activity.speak)),
            ("summary", len(&activity.summary)),
            (
                "attachments",
                activity.attachments.iter().map(|a| a.encoded_len()).sum(),
            ),
            (
                "entities",
                activity.entities.iter().map(|e| e.encoded_len()).sum(),
            ),
            (
                "channel_data",
                activity
                    .channel_data
                    .as_ref()
                    .map_or(0, |v| v.encoded_len()),
            ),
            (
                "value",
                activity.value.as_ref().map_or(0, |v| v.encoded_len()),
            ),
            (
                "suggested_actions",
                activity
                    .suggested_actions
                    .as_ref()
                    .map_or(0, |v| v.encoded_len()),
            ),
            (
                "properties",
                activity.properties.as_ref().map_or(0, |v| v.encoded_len()),
            ),
            (
                "members_added",
                activity.members_added.iter().map(|m| m.encoded_len()).sum(),
            ),
        ];
        let (field, field_size) = fields
            .into_iter()
            .max_by_key(|(_, s)| *s)
            .unwrap_or(("activity", size));
        Err(InvalidActivity::new(
            field,
            format!(
                "is {field_size} bytes, making the activity {size} bytes, over the {}-byte limit",
                self.max_activity_bytes
            ),
        ))
    }

    fn check_depth(&self, activity: &pb::Activity) -> Result<(), InvalidActivity> {
        let limit = self.max_json_depth;
        let value = |field: &str, v: &Option<prost_types::Value>| {
            depth_within(field, v.as_ref().map_or(0, value_depth), limit)
        };
        let object = |field: &str, s: &Option<prost_types::Struct>| {
            depth_within(field, s.as_ref().map_or(0, struct_depth), limit)
        };
        value("channel_data", &activity.channel_data)?;
        value("value", &activity.value)?;
        object("properties", &activity.properties)?;
        for (i, entity) in activity.entities.iter().enumerate() {
            depth_within(&format!("entities[{i}]"), struct_depth(entity), limit)?;
        }
        for (i, attachment) in activity.attachments.iter().enumerate() {
            value(&format!("attachments[{i}].content"), &attachment.content)?;
        }
        Ok(())
    }
}

fn over(field: &str, size: usize, limit: usize) -> Result<(), InvalidActivity> {
    if size > limit {
        return Err(InvalidActivity::new(
            field,
            format!("is {size} bytes, over the {limit}-byte limit"),
        ));
    }
    Ok(())
}

fn depth_within(field: &str, depth: usize, limit: usize) -> Result<(), InvalidActivity> {
    if depth > limit {
        return Err(InvalidActivity::new(
            field,
            format!("is nested {depth} levels deep, over the limit of {limit}"),
        ));
    }
    Ok(())
}

/// Nesting depth of a value. prost refuses to decode past its recursion limit, so the recursion
/// here is bounded by that.
fn value_depth(value: &prost_types::Value) -> usize {
    match &value.kind {
        Some(Kind::StructValue(s)) => struct_depth(s),
        Some(Kind::ListValue(l)) => 1 + l.values.iter().map(value_depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn struct_depth(s: &prost_types::Struct) -> usize {
    1 + s.fields.values().map(value_depth).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(levels: usize) -> prost_types::Value {
        let mut v = prost_types::Value {
            kind: Some(Kind::NumberValue(1.0)),
        };
        for _ in 0..levels {
            v = prost_types::Value {
                kind: Some(Kind::ListValue(prost_types::ListValue { values: vec![v] })),
            };
        }
        v
    }

    #[test]
    fn depth_counts_levels_of_objects_and_lists() {
        assert_eq!(value_depth(&nested(0)), 0);
        assert_eq!(value_depth(&nested(3)), 3);
    }

    #[test]
    fn each_limit_names_its_field() {
        let limits = Limits {
            max_json_depth: 4,
            ..Limits::default()
        };
        let deep = pb::Activity {
            channel_data: Some(nested(5)),
            ..Default::default()
        };
        let err = limits.check(&deep).expect_err("too deep");
        assert_eq!(err.field(), "channel_data");
        assert!(
            limits
                .check(&pb::Activity {
                    channel_data: Some(nested(4)),
                    ..Default::default()
                })
                .is_ok()
        );

        let long = pb::Activity {
            speak: Some("x".repeat(limits.max_text_bytes + 1)),
            ..Default::default()
        };
        assert_eq!(limits.check(&long).expect_err("too long").field(), "speak");
    }

    #[test]
    fn a_received_size_within_a_limit_answers_it_and_one_over_it_is_measured() {
        let limits = Limits {
            max_activity_bytes: 1000,
            max_attachments_bytes: 100,
            max_channel_data_bytes: 100,
            max_text_bytes: 10,
            max_json_depth: 4,
        };
        let big = pb::Activity {
            channel_data: Some(prost_types::Value {
                kind: Some(Kind::StringValue("x".repeat(200))),
            }),
            ..Default::default()
        };
        let size = big.encoded_len();
        assert_eq!(
            limits
                .check_within(&big, Some(size))
                .expect_err("measured")
                .field(),
            "channel_data",
            "a bound over the limit is no answer"
        );
        assert_eq!(
            limits.check(&big).expect_err("measured").field(),
            "channel_data"
        );
        let huge = pb::Activity {
            attachments: vec![pb::Attachment {
                content_url: Some("x".repeat(2000)),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(
            limits
                .check_within(&huge, Some(huge.encoded_len() + 5))
                .expect_err("measured")
                .field(),
            "attachments",
            "the largest field of an activity over its limit"
        );
        let small = pb::Activity {
            channel_data: Some(prost_types::Value {
                kind: Some(Kind::StringValue("x".repeat(50))),
            }),
            ..Default::default()
        };
        assert!(
            limits
                .check_within(&small, Some(small.encoded_len()))
                .is_ok()
        );

        // Text lengths and nesting are not sizes of the encoding: checked whatever the bound.
        let long = pb::Activity {
            text: Some("x".repeat(11)),
            ..Default::default()
        };
        assert_eq!(
            limits
                .check_within(&long, Some(20))
                .expect_err("long")
                .field(),
            "text"
        );
        let deep = pb::Activity {
            value: Some(nested(5)),
            ..Default::default()
        };
        assert_eq!(
            limits
                .check_within(&deep, Some(20))
                .expect_err("deep")
                .field(),
            "value"
        );
    }
}
