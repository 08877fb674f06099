//! `TurnService` over gRPC: decode and check the request, hand it to the engine, encode the
//! committed replies.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::drain::Drain;
use super::limits::Limits;
use super::pb;
use super::pb::process_turn_request::Input;
use super::request;
use crate::activity::incoming::IncomingActivity;
use crate::engine::{Engine, TurnError, TurnOutcome};

/// The `TurnService` implementation.
#[derive(Debug, Clone)]
pub struct TurnApi {
    /// Shared, not cloned per turn: an `Engine` clone copies its bot registry's maps, and its
    /// drop frees them (3,600 instructions per turn, `bench/RESULTS.md`).
    engine: Arc<Engine>,
    limits: Limits,
    drain: Arc<Drain>,
}

impl TurnApi {
    /// Serves turns through `engine`, refusing activities over `limits`, and new turns once
    /// `drain` has started.
    pub fn new(engine: Engine, limits: Limits, drain: Arc<Drain>) -> Self {
        Self {
            engine: Arc::new(engine),
            limits,
            drain,
        }
    }
}

impl TurnApi {
    /// The request's activity (typed or JSON), parsed, or why it is refused. The activity is
    /// boxed from the wire on (an activity is two kilobytes, and the turn's task, the span
    /// wrapper and `spawn` each moved it whole, `bench/RESULTS.md`); what is parsed around it is
    /// a few words.
    fn check(&self, input: Option<Input>) -> Result<IncomingActivity, Status> {
        let activity = request::read_boxed_activity(input, &self.limits)?;
        Ok(IncomingActivity::parse(activity)?)
    }
}

#[tonic::async_trait]
impl pb::turn_service_server::TurnService for TurnApi {
    async fn process_turn(
        &self,
        request: Request<pb::ProcessTurnRequest>,
    ) -> Result<Response<pb::ProcessTurnResponse>, Status> {
        // A child of the RPC layer's server span, which joined the caller's trace.
        let span = tracing::info_span!("process_turn");
        let json_replies = request.get_ref().json_replies;
        let turn = span.in_scope(|| self.start(request))?;
        let outcome = turn
            .instrument(span)
            .await
            .map_err(|e| super::error::turn_task_failed(&e))??;
        let (activities, activities_json) = request::replies(outcome.activities, json_replies);
        Ok(Response::new(pb::ProcessTurnResponse {
            activities,
            activities_json,
            attempts: outcome.attempts,
            version: outcome.conversation_version.map_or(0, |v| v.get()),
            redelivered: outcome.redelivered,
        }))
    }
}

impl TurnApi {
    /// Checks the request and starts its turn on a task of its own, in the current span.
    ///
    /// The turn runs on its own task so that a caller who hangs up (a timed-out gateway) does
    /// not cut it short mid-commit: it finishes, its receipt is stored, and the gateway's retry
    /// gets the answer. This part is not `async`, so that the call's future, which tonic's
    /// layers move and box, does not also carry the parsed activity and the turn's own future:
    /// moving those was a tenth of the server's instructions per turn (callgrind).
    fn start(
        &self,
        request: Request<pb::ProcessTurnRequest>,
    ) -> Result<JoinHandle<Result<TurnOutcome, TurnError>>, Status> {
        let in_flight = self.drain.enter()?;
        let deadline = deadline(&request);
        let pb::ProcessTurnRequest { input, bot, .. } = request.into_inner();
        let incoming = self.check(input).inspect_err(|_| {
            metrics::counter!(crate::telemetry::metrics::TURNS, "outcome" => "invalid")
                .increment(1);
        })?;
        let engine = Arc::clone(&self.engine);
        Ok(tokio::spawn(
            async move {
                // Boxed: the turn's future is several kilobytes, and unboxed it made this task's
                // future as large, which `spawn` and the span wrapper then copied whole; boxed,
                // the task stays a few words (`bench/RESULTS.md`).
                let outcome = Box::pin(engine.run_turn(Some(&bot), &incoming, deadline)).await;
                // Only now, committed or not, has this turn left the drain.
                drop(in_flight);
                outcome
            }
            .in_current_span(),
        ))
    }
}

/// The header a client's deadline comes in, as a name taken once rather than parsed from a
/// `&str` at every call.
static GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// The call's deadline, from the `grpc-timeout` header its client sent.
fn deadline<T>(request: &Request<T>) -> Option<Instant> {
    let headers: &http::HeaderMap = request.metadata().as_ref();
    let value = headers.get(&GRPC_TIMEOUT)?.to_str().ok()?;
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
