//! `TurnService` over gRPC: decode and check the request, hand it to the engine, encode the
//! committed replies.

use prost::Message as _;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::pb;
use crate::activity::Activity;
use crate::activity::incoming::{IncomingActivity, InvalidActivity};
use crate::engine::Engine;

/// Limits on what a caller may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest activity accepted, in encoded protobuf bytes.
    pub max_activity_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_activity_bytes: 256 * 1024,
        }
    }
}

/// The `TurnService` implementation.
#[derive(Debug, Clone)]
pub struct TurnApi {
    engine: Engine,
    limits: Limits,
}

impl TurnApi {
    /// Serves turns through `engine`, refusing activities over `limits`.
    pub fn new(engine: Engine, limits: Limits) -> Self {
        Self { engine, limits }
    }
}

#[tonic::async_trait]
impl pb::turn_service_server::TurnService for TurnApi {
    #[tracing::instrument(name = "process_turn", skip_all)]
    async fn process_turn(
        &self,
        request: Request<pb::ProcessTurnRequest>,
    ) -> Result<Response<pb::ProcessTurnResponse>, Status> {
        let deadline = deadline(&request);
        let pb::ProcessTurnRequest { activity, bot } = request.into_inner();
        let activity = activity.ok_or_else(|| InvalidActivity::new("activity", "is missing"))?;
        check_size(&activity, self.limits)?;
        let incoming = IncomingActivity::parse(Activity::from(activity))?;
        // The turn runs on its own task, so that a caller who hangs up (a timed-out gateway)
        // does not cut it short mid-commit: it finishes, its receipt is stored, and the
        // gateway's retry gets the answer.
        let engine = self.engine.clone();
        let outcome =
            tokio::spawn(async move { engine.run_turn(Some(&bot), &incoming, deadline).await })
                .await
                .map_err(|e| {
                    tracing::error!(error = %e, "turn task failed");
                    Status::internal("the turn failed unexpectedly; state is untouched")
                })??;
        Ok(Response::new(pb::ProcessTurnResponse {
            activities: outcome.activities.into_iter().map(Into::into).collect(),
            attempts: outcome.attempts,
            version: outcome.conversation_version.map_or(0, |v| v.get()),
            replayed: outcome.replayed,
        }))
    }
}

/// The call's deadline, from the `grpc-timeout` header its client sent.
fn deadline<T>(request: &Request<T>) -> Option<Instant> {
    let value = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (amount, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = amount.parse().ok()?;
    let timeout = match unit {
        "H" => std::time::Duration::from_secs(amount.saturating_mul(3600)),
        "M" => std::time::Duration::from_secs(amount.saturating_mul(60)),
        "S" => std::time::Duration::from_secs(amount),
        "m" => std::time::Duration::from_millis(amount),
        "u" => std::time::Duration::from_micros(amount),
        "n" => std::time::Duration::from_nanos(amount),
        _ => return None,
    };
    Instant::now().checked_add(timeout)
}

/// Refuses an activity over the size limit, naming its largest field so that the caller knows
/// what to shrink.
fn check_size(activity: &pb::Activity, limits: Limits) -> Result<(), InvalidActivity> {
    let size = activity.encoded_len();
    if size <= limits.max_activity_bytes {
        return Ok(());
    }
    let fields: [(&str, usize); 10] = [
        ("text", activity.text.as_ref().map_or(0, String::len)),
        ("speak", activity.speak.as_ref().map_or(0, String::len)),
        ("summary", activity.summary.as_ref().map_or(0, String::len)),
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
            limits.max_activity_bytes
        ),
    ))
}
