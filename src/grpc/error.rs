//! The one place where domain outcomes become gRPC statuses.
//!
//! A caller's mistake keeps its message, which names the problem. A failure on our side is
//! logged with its whole cause chain and answered with a generic message: the caller learns what
//! to do (retry or not), never our internals.
//!
//! Every error status also carries `google.rpc.Status` details (the richer error model, read with
//! tonic-types' `StatusExt` or any gRPC library's status-details helper), so that a gateway can
//! branch on data instead of parsing messages:
//! - an `ErrorInfo` whose `reason` is one of [`Reason`] (stable: renaming one is a breaking
//!   change) and whose `domain` is [`ERROR_DOMAIN`];
//! - a `BadRequest` naming the request field at fault on `INVALID_ARGUMENT`, as a path from the
//!   request (`activity.conversation.id`);
//! - a `RetryInfo` on `ABORTED`, `UNAVAILABLE` and `RESOURCE_EXHAUSTED`, saying how long to wait
//!   before retrying — except on [`Reason::MessageTooLarge`], which the same bytes can never get
//!   past, so no retry is advertised.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt as _};

use crate::activity::incoming::InvalidActivity;
use crate::bot::{BotErrorKind, UnknownBot};
use crate::engine::{StopError, TurnError};
use crate::store::StoreError;
use crate::store::postgres::SchemaBehind;

/// The `ErrorInfo.domain` of every error this service returns.
pub const ERROR_DOMAIN: &str = "turnstile.dev";

/// How long a caller should wait before retrying a turn whose every attempt lost a conflict: a
/// few turns of the conversation's other writers (the engine's own backoff caps at 200 ms).
const RETRY_ABORTED: Duration = Duration::from_millis(250);
/// Before retrying when the store is unavailable: a pool wait or a database restart is over in
/// seconds, and hammering a recovering database slows it down.
const RETRY_STORE_UNAVAILABLE: Duration = Duration::from_secs(1);
/// Before retrying when the database's schema is behind this server's: a migration Job takes
/// seconds to minutes, and this replica reports NOT_SERVING meanwhile, so a retry is better sent
/// elsewhere or a little later.
const RETRY_SCHEMA_BEHIND: Duration = Duration::from_secs(5);
/// Before retrying a turn whose bot worker could not be reached: a worker restarting or being
/// rescheduled is back within seconds.
const RETRY_BOT_UNAVAILABLE: Duration = Duration::from_secs(1);
/// Before retrying a turn refused by a replica that is shutting down: at once, since a fresh
/// connection reaches another replica.
const RETRY_SHUTTING_DOWN: Duration = Duration::ZERO;
/// Before sending again a message refused because its conversation's turn still runs: a
/// language model's answer takes seconds.
const RETRY_CONVERSATION_BUSY: Duration = Duration::from_secs(2);
/// Before retrying a turn refused because too many are in flight: most turns finish within a
/// few tens of milliseconds, so half a second frees the slots without a retry storm.
const RETRY_OVERLOADED: Duration = Duration::from_millis(500);

/// The stable `ErrorInfo.reason` of each kind of error status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// `INVALID_ARGUMENT`: the activity lacks a field or one is malformed or over its limit.
    InvalidActivity,
    /// `INVALID_ARGUMENT`: the request bytes are not a protobuf `ProcessTurnRequest`.
    MalformedRequest,
    /// `INVALID_ARGUMENT`: a `StopTurn` request lacks an id or one is malformed.
    InvalidStop,
    /// `INVALID_ARGUMENT`: an `AdminService` request lacks an id, has a malformed one, asks for
    /// too much, or carries a page token this service did not issue for it.
    InvalidAdminRequest,
    /// `NOT_FOUND`: the request names a bot this server does not host.
    UnknownBot,
    /// `ABORTED`: every attempt lost a conflict with another writer.
    ConflictRetriesExhausted,
    /// `ABORTED`: other turns held the conversation for all of the time a call without a
    /// deadline waits for it.
    ConversationHeld,
    /// `FAILED_PRECONDITION`: another message's turn of the conversation is still running, and
    /// the bot refuses messages meanwhile (double-text policy `reject`).
    ConversationBusy,
    /// `FAILED_PRECONDITION`: the bot would have written a scope's state larger than
    /// `--max-scope-bytes`; nothing was committed.
    StateTooLarge,
    /// `UNAVAILABLE`: the state store cannot be reached.
    StoreUnavailable,
    /// `UNAVAILABLE`: the database's schema is behind this server's (`turnstile migrate` has not
    /// run yet).
    SchemaBehind,
    /// `UNAVAILABLE`: this replica is draining before it stops.
    ShuttingDown,
    /// `UNAVAILABLE`: the bot is a bot worker that cannot be reached.
    BotUnavailable,
    /// `RESOURCE_EXHAUSTED`: too many turns are in flight on this replica.
    Overloaded,
    /// `RESOURCE_EXHAUSTED`: the request is larger than the server decodes at all.
    MessageTooLarge,
    /// `UNAUTHENTICATED`: no valid bearer token.
    Unauthenticated,
    /// `DEADLINE_EXCEEDED`: the caller's deadline passed before the turn could commit (or before
    /// the bot worker answered).
    DeadlineExceeded,
    /// `INTERNAL`: the bot (or its bot worker) failed; nothing was committed.
    BotFailed,
    /// `INTERNAL`: the state store answered something it never should.
    StoreFailed,
    /// `INTERNAL`: the turn's task ended without an answer (a panic outside the bot).
    TurnFailed,
}

impl Reason {
    /// The reason as it appears in `ErrorInfo.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidActivity => "INVALID_ACTIVITY",
            Self::MalformedRequest => "MALFORMED_REQUEST",
            Self::InvalidStop => "INVALID_STOP",
            Self::InvalidAdminRequest => "INVALID_ADMIN_REQUEST",
            Self::UnknownBot => "UNKNOWN_BOT",
            Self::ConflictRetriesExhausted => "CONFLICT_RETRIES_EXHAUSTED",
            Self::ConversationHeld => "CONVERSATION_HELD",
            Self::ConversationBusy => "CONVERSATION_BUSY",
            Self::StateTooLarge => "STATE_TOO_LARGE",
            Self::StoreUnavailable => "STORE_UNAVAILABLE",
            Self::SchemaBehind => "SCHEMA_BEHIND",
            Self::ShuttingDown => "SHUTTING_DOWN",
            Self::BotUnavailable => "BOT_UNAVAILABLE",
            Self::Overloaded => "OVERLOADED",
            Self::MessageTooLarge => "MESSAGE_TOO_LARGE",
            Self::Unauthenticated => "UNAUTHENTICATED",
            Self::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Self::BotFailed => "BOT_FAILED",
            Self::StoreFailed => "STORE_FAILED",
            Self::TurnFailed => "TURN_FAILED",
        }
    }
}

/// A call refused before its turn started, for reasons of the server rather than the activity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The replica is draining.
    ShuttingDown,
    /// `limit` turns are already in flight.
    Overloaded {
        /// The configured `--max-in-flight`.
        limit: usize,
    },
    /// The request is over `limit` bytes; `detail` is what the decoder said.
    MessageTooLarge {
        /// The largest request decoded.
        limit: usize,
        /// The decoder's own words (the sizes).
        detail: String,
    },
    /// The request's bytes do not decode; `detail` is what prost found wrong.
    Malformed {
        /// What the decoder said.
        detail: String,
    },
    /// The call has no valid bearer token; the message says which part is wrong.
    Unauthenticated(&'static str),
}

impl From<Refusal> for Status {
    fn from(refusal: Refusal) -> Self {
        refusal.into_status_after(Duration::ZERO)
    }
}

impl Refusal {
    /// The refusal's status, sent `held` after it was decided (`server::admission` holds
    /// refusals back in a storm of them): its `RetryInfo` delay is shortened by as much, so that
    /// a caller that waits as asked retries when it would have had the refusal come at once.
    pub fn into_status_after(self, held: Duration) -> Status {
        match self {
            Refusal::ShuttingDown => with_details(
                Code::Unavailable,
                "this server is shutting down; send the turn to another replica",
                Reason::ShuttingDown,
                Some(RETRY_SHUTTING_DOWN.saturating_sub(held)),
                HashMap::new(),
            ),
            Refusal::Overloaded { limit } => with_details(
                Code::ResourceExhausted,
                format!(
                    "this server already has {limit} turns in flight; retry shortly or on another \
                     replica"
                ),
                Reason::Overloaded,
                Some(RETRY_OVERLOADED.saturating_sub(held)),
                HashMap::from([("max_in_flight".to_owned(), limit.to_string())]),
            ),
            Refusal::MessageTooLarge { limit, detail } => with_details(
                Code::ResourceExhausted,
                format!("the request is too large: {detail}"),
                Reason::MessageTooLarge,
                None,
                HashMap::from([("max_message_bytes".to_owned(), limit.to_string())]),
            ),
            Refusal::Malformed { detail } => with_details(
                Code::InvalidArgument,
                detail,
                Reason::MalformedRequest,
                None,
                HashMap::new(),
            ),
            Refusal::Unauthenticated(message) => with_details(
                Code::Unauthenticated,
                message,
                Reason::Unauthenticated,
                None,
                HashMap::new(),
            ),
        }
    }
}

impl From<InvalidActivity> for Status {
    fn from(e: InvalidActivity) -> Self {
        // Fields are named from the activity; BadRequest paths start at the request.
        let field = match e.field() {
            "activity" => "activity".to_owned(),
            field => format!("activity.{field}"),
        };
        let mut details = ErrorDetails::new();
        details
            .set_error_info(
                Reason::InvalidActivity.as_str(),
                ERROR_DOMAIN,
                HashMap::from([("field".to_owned(), field.clone())]),
            )
            .add_bad_request_violation(field, e.problem());
        Status::with_error_details(Code::InvalidArgument, e.to_string(), details)
    }
}

impl From<StopError> for Status {
    fn from(e: StopError) -> Self {
        match e {
            StopError::UnknownBot(e) => unknown_bot(&e),
            // The fields are the request's own (`channel_id`, …), named as they are.
            StopError::Invalid(e) => {
                let message = e.to_string();
                invalid_field(Reason::InvalidStop, &e, message)
            }
        }
    }
}

/// `INVALID_ARGUMENT` with `reason`, for a request whose field (named as in the request) is
/// missing or malformed: an `ErrorInfo` naming it and a `BadRequest` violation.
fn invalid_field(reason: Reason, e: &InvalidActivity, message: String) -> Status {
    let mut details = ErrorDetails::new();
    details
        .set_error_info(
            reason.as_str(),
            ERROR_DOMAIN,
            HashMap::from([("field".to_owned(), e.field().to_owned())]),
        )
        .add_bad_request_violation(e.field(), e.problem());
    Status::with_error_details(Code::InvalidArgument, message, details)
}

/// Why an `AdminService` call was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The request names a bot this server does not host.
    #[error(transparent)]
    UnknownBot(#[from] UnknownBot),
    /// A field of the request is missing or malformed (named as in the request).
    #[error("invalid request: `{}` {}", .0.field(), .0.problem())]
    Invalid(#[from] InvalidActivity),
    /// The store could not answer.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

impl From<AdminError> for Status {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::UnknownBot(e) => unknown_bot(&e),
            AdminError::Invalid(invalid) => {
                let message = AdminError::Invalid(invalid.clone()).to_string();
                invalid_field(Reason::InvalidAdminRequest, &invalid, message)
            }
            AdminError::Store(e) => TurnError::Store(e).into(),
        }
    }
}

/// `NOT_FOUND` for a request naming a bot that is not hosted here.
fn unknown_bot(e: &UnknownBot) -> Status {
    with_details(
        Code::NotFound,
        e.to_string(),
        Reason::UnknownBot,
        None,
        HashMap::from([("bot".to_owned(), e.name().to_owned())]),
    )
}

impl From<TurnError> for Status {
    fn from(e: TurnError) -> Self {
        match e {
            TurnError::UnknownBot(e) => unknown_bot(&e),
            e @ TurnError::Aborted { .. } => with_details(
                Code::Aborted,
                e.to_string(),
                Reason::ConflictRetriesExhausted,
                Some(RETRY_ABORTED),
                HashMap::new(),
            ),
            e @ TurnError::ConversationHeld { .. } => with_details(
                Code::Aborted,
                e.to_string(),
                Reason::ConversationHeld,
                Some(RETRY_ABORTED),
                HashMap::new(),
            ),
            TurnError::ConversationBusy { bot } => with_details(
                Code::FailedPrecondition,
                TurnError::ConversationBusy { bot: bot.clone() }.to_string(),
                Reason::ConversationBusy,
                Some(RETRY_CONVERSATION_BUSY),
                HashMap::from([("bot".to_owned(), bot)]),
            ),
            e @ TurnError::StateTooLarge {
                scope,
                bytes,
                limit,
            } => with_details(
                Code::FailedPrecondition,
                e.to_string(),
                Reason::StateTooLarge,
                None,
                HashMap::from([
                    ("scope".to_owned(), scope.to_string()),
                    ("bytes".to_owned(), bytes.to_string()),
                    ("limit".to_owned(), limit.to_string()),
                ]),
            ),
            e @ TurnError::DeadlineExceeded { .. } => with_details(
                Code::DeadlineExceeded,
                e.to_string(),
                Reason::DeadlineExceeded,
                None,
                HashMap::new(),
            ),
            TurnError::Bot(e) => bot_failed(&e),
            TurnError::Store(e) => store_failed(e),
        }
    }
}

/// The status for a turn whose bot failed, logged as the kind of failure deserves; nothing was
/// committed.
fn bot_failed(e: &crate::bot::BotError) -> Status {
    match e.kind() {
        BotErrorKind::Unavailable => {
            tracing::warn!(error = %e, "bot worker unavailable; nothing was committed");
            with_details(
                Code::Unavailable,
                format!("{}; the turn was not committed, retry later", e.message()),
                Reason::BotUnavailable,
                Some(RETRY_BOT_UNAVAILABLE),
                HashMap::new(),
            )
        }
        BotErrorKind::DeadlineExceeded => {
            tracing::warn!(error = %e, "bot worker missed the deadline; nothing was committed");
            with_details(
                Code::DeadlineExceeded,
                format!("{}; nothing was committed", e.message()),
                Reason::DeadlineExceeded,
                None,
                HashMap::new(),
            )
        }
        BotErrorKind::WorkerFailed => {
            tracing::error!(error = %e, "bot worker failed; nothing was committed");
            with_details(
                Code::Internal,
                format!("{}; state is untouched", e.message()),
                Reason::BotFailed,
                None,
                HashMap::new(),
            )
        }
        _ => {
            tracing::error!(error = %e, "bot failed; nothing was committed");
            with_details(
                Code::Internal,
                "the bot failed to handle the activity; state is untouched",
                Reason::BotFailed,
                None,
                HashMap::new(),
            )
        }
    }
}

/// The status for a turn the store could not commit: unavailable (retry later), its schema
/// behind, or failed.
fn store_failed(e: StoreError) -> Status {
    match e {
        StoreError::Unavailable(e) if e.is::<SchemaBehind>() => {
            schema_behind(e.downcast_ref::<SchemaBehind>())
        }
        e @ StoreError::Unavailable(_) => {
            tracing::warn!(error = ?anyhow_chain(&e), "state store unavailable");
            with_details(
                Code::Unavailable,
                "the state store is unavailable; the turn was not committed, retry later",
                Reason::StoreUnavailable,
                Some(RETRY_STORE_UNAVAILABLE),
                HashMap::new(),
            )
        }
        e @ StoreError::Unexpected(_) => {
            tracing::error!(error = ?anyhow_chain(&e), "state store failed");
            with_details(
                Code::Internal,
                "the state store failed; the turn was not committed",
                Reason::StoreFailed,
                None,
                HashMap::new(),
            )
        }
    }
}

/// The status for a turn refused because the database's schema is behind: the server logged why
/// when it found out (and reports NOT_SERVING), so the turn itself is not logged.
fn schema_behind(behind: Option<&SchemaBehind>) -> Status {
    let mut metadata = HashMap::new();
    let message = match behind {
        Some(behind) => {
            let found = behind
                .found
                .map_or_else(|| "none".to_owned(), |v| v.to_string());
            metadata.insert("schema_version".to_owned(), found);
            metadata.insert("needed_version".to_owned(), behind.needed.to_string());
            format!("{behind}; the turn was not committed, retry later")
        }
        None => "the database schema is behind this server's; the turn was not committed, retry \
                 later"
            .to_owned(),
    };
    with_details(
        Code::Unavailable,
        message,
        Reason::SchemaBehind,
        Some(RETRY_SCHEMA_BEHIND),
        metadata,
    )
}

/// The status that ends a `StreamTurn` call whose deadline passed before its turn ended. The
/// turn is not abandoned: it goes on, and commits or not as any turn, and a redelivery of the
/// activity gets its receipt's answer.
pub fn stream_deadline_passed() -> Status {
    with_details(
        Code::DeadlineExceeded,
        "the call's deadline passed before the turn ended; it goes on, and a redelivery of the \
         activity gets its answer once it committed",
        Reason::DeadlineExceeded,
        None,
        HashMap::new(),
    )
}

/// The status for a turn whose task ended without an answer: it panicked outside the bot (the
/// engine turns a bot's panic into [`TurnError::Bot`]) or was cancelled.
pub fn turn_task_failed(e: &tokio::task::JoinError) -> Status {
    tracing::error!(error = %e, "turn task failed");
    with_details(
        Code::Internal,
        "the turn failed unexpectedly; state is untouched",
        Reason::TurnFailed,
        None,
        HashMap::new(),
    )
}

fn with_details(
    code: Code,
    message: impl Into<String>,
    reason: Reason,
    retry: Option<Duration>,
    metadata: HashMap<String, String>,
) -> Status {
    let mut details = ErrorDetails::new();
    details.set_error_info(reason.as_str(), ERROR_DOMAIN, metadata);
    if retry.is_some() {
        details.set_retry_info(retry);
    }
    Status::with_error_details(code, message, details)
}

/// The error and its sources, one line.
fn anyhow_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_activities_name_the_request_field() {
        let status = Status::from(InvalidActivity::new("conversation.id", "is missing"));
        assert_eq!(status.code(), Code::InvalidArgument);
        let bad = status.get_details_bad_request().expect("a BadRequest");
        assert_eq!(bad.field_violations[0].field, "activity.conversation.id");
        assert_eq!(bad.field_violations[0].description, "is missing");
        let info = status.get_details_error_info().expect("an ErrorInfo");
        assert_eq!(
            (info.reason.as_str(), info.domain.as_str()),
            ("INVALID_ACTIVITY", ERROR_DOMAIN)
        );
    }

    #[test]
    fn a_schema_behind_is_unavailable_naming_the_versions_and_the_fix() {
        let behind = SchemaBehind {
            found: Some(2),
            needed: 3,
        };
        let status = Status::from(TurnError::Store(StoreError::Unavailable(behind.into())));
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("turnstile migrate"),
            "{}",
            status.message()
        );
        let info = status.get_details_error_info().expect("an ErrorInfo");
        assert_eq!(info.reason, "SCHEMA_BEHIND");
        assert_eq!(info.metadata["schema_version"], "2");
        assert_eq!(info.metadata["needed_version"], "3");
        assert_eq!(
            status.get_details_retry_info().and_then(|r| r.retry_delay),
            Some(RETRY_SCHEMA_BEHIND)
        );
    }

    #[test]
    fn retryable_refusals_say_when_and_oversized_ones_do_not() {
        let overloaded = Status::from(Refusal::Overloaded { limit: 8 });
        assert_eq!(overloaded.code(), Code::ResourceExhausted);
        assert_eq!(
            overloaded
                .get_details_retry_info()
                .and_then(|r| r.retry_delay),
            Some(RETRY_OVERLOADED)
        );
        let too_large = Status::from(Refusal::MessageTooLarge {
            limit: 10,
            detail: "11 > 10".into(),
        });
        assert_eq!(too_large.code(), Code::ResourceExhausted);
        assert!(too_large.get_details_retry_info().is_none());
        assert_eq!(
            too_large.get_details_error_info().map(|i| i.reason),
            Some("MESSAGE_TOO_LARGE".to_owned())
        );
    }
}
