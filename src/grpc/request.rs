//! `ProcessTurnRequest`'s two ways of carrying an activity, and the one reading of them.
//!
//! A gateway may send the activity typed (`activity`) or as the JSON text the channel POSTed
//! (`activity_json`). The JSON form exists because a gateway written with another language's
//! protobuf JSON parser silently drops every member the schema does not name (Teams' `legacy`,
//! `cci_*`, `recipients`, ...); passing the text through and reading it here, with the lossless
//! conversion of [`crate::activity::json`], keeps them. Both forms meet the same limits: the
//! JSON is checked in its typed form, so a limit means the same bytes whichever way they came.

use super::limits::Limits;
use super::pb;
use super::pb::process_turn_request::Input;
use crate::activity::incoming::InvalidActivity;
use crate::activity::{Activity, ActivityJsonError};

/// How many times the typed size limit JSON text may be before it is refused unread: JSON spells
/// the same activity in more bytes than protobuf (member names, quotes, `\u` escapes), and the
/// typed check after parsing is the real limit; this one only bounds the parsing work.
const JSON_TEXT_FACTOR: usize = 4;

impl pb::ProcessTurnRequest {
    /// A request carrying `activity` typed, for the hosted bot named `bot` (empty: the default).
    pub fn typed(activity: pb::Activity, bot: impl Into<String>) -> Self {
        Self {
            input: Some(Input::Activity(Box::new(activity))),
            bot: bot.into(),
            json_replies: false,
        }
    }

    /// A request carrying the activity as Bot Framework JSON text, for the hosted bot named
    /// `bot` (empty: the default).
    pub fn json(activity_json: impl Into<String>, bot: impl Into<String>) -> Self {
        Self {
            input: Some(Input::ActivityJson(activity_json.into())),
            bot: bot.into(),
            json_replies: false,
        }
    }

    /// The same request, asking for the replies as JSON text (`activities_json`).
    #[must_use]
    pub fn with_json_replies(self) -> Self {
        Self {
            json_replies: true,
            ..self
        }
    }
}

impl pb::StreamTurnRequest {
    /// A streaming request carrying `activity` typed, for the hosted bot named `bot` (empty:
    /// the default).
    pub fn typed(activity: pb::Activity, bot: impl Into<String>) -> Self {
        pb::ProcessTurnRequest::typed(activity, bot).into()
    }
}

impl From<pb::ProcessTurnRequest> for pb::StreamTurnRequest {
    fn from(request: pb::ProcessTurnRequest) -> Self {
        use pb::stream_turn_request::Input as Streamed;
        Self {
            input: request.input.map(|input| match input {
                Input::Activity(activity) => Streamed::Activity(*activity),
                Input::ActivityJson(json) => Streamed::ActivityJson(json),
            }),
            bot: request.bot,
            json_replies: request.json_replies,
        }
    }
}

/// A streaming request is a `ProcessTurnRequest` field for field, and is read as one.
impl From<pb::StreamTurnRequest> for pb::ProcessTurnRequest {
    fn from(request: pb::StreamTurnRequest) -> Self {
        use pb::stream_turn_request::Input as Streamed;
        Self {
            input: request.input.map(|input| match input {
                Streamed::Activity(activity) => Input::Activity(Box::new(activity)),
                Streamed::ActivityJson(json) => Input::ActivityJson(json),
            }),
            bot: request.bot,
            json_replies: request.json_replies,
        }
    }
}

/// The activity a request carries, within `limits`.
///
/// # Errors
/// [`InvalidActivity`] when there is none, when `activity_json` is not a JSON object, or when
/// the activity is over a limit; it names the field.
pub fn read_activity(input: Option<Input>, limits: &Limits) -> Result<Activity, InvalidActivity> {
    read_boxed_activity(input, limits, None).map(|activity| *activity)
}

/// [`read_activity`], boxed, as a turn keeps it: a typed activity goes from its box on the wire
/// into its box in the turn without being moved whole on the way. `received`, when known, is
/// the size of the request the input was decoded from, which bounds the typed activity's
/// ([`Limits::check_within`]).
///
/// # Errors
/// As [`read_activity`].
pub fn read_boxed_activity(
    input: Option<Input>,
    limits: &Limits,
    received: Option<usize>,
) -> Result<Box<Activity>, InvalidActivity> {
    match input {
        None => Err(InvalidActivity::new(
            "activity",
            "is missing (set `activity` or `activity_json`)",
        )),
        Some(Input::Activity(activity)) => {
            limits.check_within(&activity, received)?;
            Ok(super::convert::boxed_activity(activity))
        }
        Some(Input::ActivityJson(text)) => {
            let activity = parse_json(&text, limits)?;
            // The typed form only measures; the turn gets the activity as parsed, so numbers
            // keep their JSON spelling (`1.0` stays `1.0`), which the typed form cannot. Its
            // encoding can be larger than the text it came from: measured, whatever `received`.
            limits.check(&pb::Activity::from(activity.clone()))?;
            Ok(Box::new(activity))
        }
    }
}

fn parse_json(text: &str, limits: &Limits) -> Result<Activity, InvalidActivity> {
    let most = limits.max_activity_bytes.saturating_mul(JSON_TEXT_FACTOR);
    if text.len() > most {
        return Err(InvalidActivity::new(
            "activity_json",
            format!("is {} bytes, over the {most}-byte limit", text.len()),
        ));
    }
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| InvalidActivity::new("activity_json", format!("is not valid JSON: {e}")))?;
    Activity::from_json(value).map_err(|e| match e {
        ActivityJsonError::NotAnObject { found, .. } => {
            InvalidActivity::new("activity_json", format!("is a JSON {found}, not an object"))
        }
    })
}

/// The replies of a turn as the request asked for them: `(activities, activities_json)`.
pub fn replies(activities: Vec<Activity>, json: bool) -> (Vec<pb::Activity>, Vec<String>) {
    if json {
        let texts = activities.iter().map(|a| a.to_json().to_string()).collect();
        (Vec::new(), texts)
    } else {
        (activities.into_iter().map(Into::into).collect(), Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(input: Input) -> String {
        read_activity(Some(input), &Limits::default())
            .expect_err("refused")
            .field()
            .to_owned()
    }

    #[test]
    fn json_that_is_not_an_object_is_refused_naming_activity_json() {
        assert_eq!(
            field(Input::ActivityJson("{\"type\":".into())),
            "activity_json"
        );
        assert_eq!(field(Input::ActivityJson("[1]".into())), "activity_json");
        assert_eq!(field(Input::ActivityJson(String::new())), "activity_json");
        let err = read_activity(
            Some(Input::ActivityJson("\"hi\"".into())),
            &Limits::default(),
        )
        .expect_err("a string");
        assert!(
            err.to_string().contains("JSON string, not an object"),
            "{err}"
        );
    }

    #[test]
    fn json_meets_the_typed_limits() {
        let limits = Limits {
            max_text_bytes: 10,
            ..Limits::default()
        };
        let long = serde_json::json!({"type": "message", "text": "x".repeat(11)}).to_string();
        let err = read_activity(Some(Input::ActivityJson(long)), &limits).expect_err("long");
        assert_eq!(err.field(), "text");
        let huge = " ".repeat(limits.max_activity_bytes * JSON_TEXT_FACTOR + 1);
        assert_eq!(field(Input::ActivityJson(huge)), "activity_json");
    }

    #[test]
    fn json_keeps_unknown_members_and_number_spelling() {
        let text = r#"{"type":"message","legacy":{"replyToId":"1:x"},"n":1.0,"recipients":[]}"#;
        let activity =
            read_activity(Some(Input::ActivityJson(text.into())), &Limits::default()).expect("ok");
        assert_eq!(activity.to_json().to_string().len(), text.len());
        assert_eq!(
            activity.to_json(),
            serde_json::from_str::<serde_json::Value>(text).expect("json")
        );
        assert_eq!(activity.properties["n"].to_string(), "1.0");
    }
}
