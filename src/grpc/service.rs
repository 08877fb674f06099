//! `TurnService` over gRPC: decode and check the request, hand it to the engine, encode the
//! committed replies — in one answer (`ProcessTurn`), or after the drafts the bot showed while it
//! ran (`StreamTurn`).

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::mpsc;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::limits::Limits;
use super::pb;
use super::pb::process_turn_request::Input;
use super::request;
use crate::activity::incoming::IncomingActivity;
use crate::activity::incoming::InvalidActivity;
use crate::drafts::{DRAFT_BUFFER, DraftEvent, DraftKind, Drafts};
use crate::engine::{Engine, StopError, StopOutcome, TurnError, TurnOutcome};
use crate::server::admission::Admitted;

/// The events of one `StreamTurn` call: drafts and resets, then the outcome or an error status.
pub type TurnEvents = Pin<Box<dyn Stream<Item = Result<pb::StreamTurnResponse, Status>> + Send>>;

/// The `TurnService` implementation.
#[derive(Debug, Clone)]
pub struct TurnApi {
    /// Shared, not cloned per turn: an `Engine` clone copies its bot registry's maps, and its
    /// drop frees them, on every turn (`bench/RESULTS.md`).
    engine: Arc<Engine>,
    limits: Limits,
}

impl TurnApi {
    /// Serves turns through `engine`, refusing activities over `limits`. Turns reach it
    /// admitted ([`crate::server::admission`]), or refused before it.
    pub fn new(engine: Engine, limits: Limits) -> Self {
        Self {
            engine: Arc::new(engine),
            limits,
        }
    }
}

impl TurnApi {
    /// The request's activity (typed or JSON), parsed, or why it is refused. The activity is
    /// boxed from the wire on (an activity is two kilobytes, and the turn's task, the span
    /// wrapper and `spawn` each moved it whole, `bench/RESULTS.md`); what is parsed around it is
    /// a few words.
    /// `received` is how many bytes of the request were received, which bounds the activity's
    /// size ([`Admitted::received_bytes`]).
    fn check(&self, input: Option<Input>, received: usize) -> Result<IncomingActivity, Status> {
        let activity = request::read_boxed_activity(input, &self.limits, Some(received))?;
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
        let span = tracing::debug_span!("process_turn");
        let json_replies = request.get_ref().json_replies;
        let turn = span.in_scope(|| self.start(request, None))?;
        let outcome = turn
            .instrument(span)
            .await
            .map_err(|e| super::error::turn_task_failed(&e))??;
        Ok(Response::new(response(outcome, json_replies)))
    }

    type StreamTurnStream = TurnEvents;

    async fn stream_turn(
        &self,
        request: Request<pb::StreamTurnRequest>,
    ) -> Result<Response<TurnEvents>, Status> {
        let span = tracing::debug_span!("stream_turn");
        let request = request.map(pb::ProcessTurnRequest::from);
        let json_replies = request.get_ref().json_replies;
        // A client's deadline bounds a stream only until its headers, on both sides: the call
        // is ended here when it passes, as a unary call's would be.
        let until = deadline(&request);
        let (drafts, events) = Drafts::channel(DRAFT_BUFFER, self.limits.max_text_bytes);
        let turn = span.in_scope(|| self.start(request, Some(drafts)))?;
        Ok(Response::new(Box::pin(stream_events(
            turn,
            events,
            json_replies,
            until,
        ))))
    }

    async fn stop_turn(
        &self,
        request: Request<pb::StopTurnRequest>,
    ) -> Result<Response<pb::StopTurnResponse>, Status> {
        let pb::StopTurnRequest {
            bot,
            channel_id,
            conversation_id,
            activity_id,
            shown_text,
        } = request.into_inner();
        let limit = self.limits.max_text_bytes;
        if let Some(size) = shown_text.as_ref().map(String::len).filter(|&s| s > limit) {
            return Err(StopError::from(InvalidActivity::new(
                "shown_text",
                format!("is {size} bytes, over the {limit}-byte limit (--max-text-bytes)"),
            ))
            .into());
        }
        let outcome = self.engine.stop_turn(
            Some(&bot),
            &channel_id,
            &conversation_id,
            &activity_id,
            shown_text.as_deref(),
        )?;
        let result = match outcome {
            StopOutcome::Stopped => pb::StopTurnResult::Stopped,
            StopOutcome::TooLate => pb::StopTurnResult::TooLate,
            StopOutcome::NotRunning => pb::StopTurnResult::NotRunning,
        };
        Ok(Response::new(pb::StopTurnResponse {
            result: result.into(),
        }))
    }
}

/// The answer to a committed (or redelivered) turn.
fn response(outcome: TurnOutcome, json_replies: bool) -> pb::ProcessTurnResponse {
    let (activities, activities_json) = request::replies(outcome.activities, json_replies);
    pb::ProcessTurnResponse {
        activities,
        activities_json,
        attempts: outcome.attempts,
        version: outcome.conversation_version.map_or(0, |v| v.get()),
        redelivered: outcome.redelivered,
        stopped: outcome.stopped,
        superseded: outcome.superseded,
        coalesced: outcome.coalesced,
    }
}

/// A streamed turn's events: each draft and reset as the bot's attempts offer them, then — once
/// the turn has ended, which closes its draft channel, so that nothing can follow — the outcome,
/// or the status a unary call would have got; or, when `until` passes first, `DEADLINE_EXCEEDED`
/// while the turn goes on (its receipt answers a redelivery).
fn stream_events(
    turn: JoinHandle<Result<TurnOutcome, TurnError>>,
    events: mpsc::Receiver<DraftEvent>,
    json_replies: bool,
    until: Option<Instant>,
) -> impl Stream<Item = Result<pb::StreamTurnResponse, Status>> + Send + 'static {
    use pb::stream_turn_response::Event;
    struct Streaming {
        turn: JoinHandle<Result<TurnOutcome, TurnError>>,
        events: mpsc::Receiver<DraftEvent>,
        sequence: u32,
    }
    let streaming = Streaming {
        turn,
        events,
        sequence: 0,
    };
    futures::stream::unfold(Some(streaming), move |streaming| async move {
        let mut streaming = streaming?;
        let next = match until {
            Some(until) => tokio::time::timeout_at(until, streaming.events.recv()).await,
            None => Ok(streaming.events.recv().await),
        };
        let Ok(next) = next else {
            return Some((Err(super::error::stream_deadline_passed()), None));
        };
        let event = match next {
            Some(DraftEvent::Draft {
                attempt,
                kind,
                text,
            }) => {
                streaming.sequence += 1;
                Event::Draft(pb::Draft {
                    stream_id: stream_id(attempt),
                    sequence: streaming.sequence,
                    kind: match kind {
                        DraftKind::Informative => pb::DraftKind::Informative,
                        DraftKind::Text => pb::DraftKind::Text,
                    }
                    .into(),
                    text,
                    attempt,
                })
            }
            Some(DraftEvent::Reset { attempt }) => Event::Reset(pb::DraftReset {
                stream_id: stream_id(attempt),
                attempt,
            }),
            None => {
                // The draft channel closed with the turn: its outcome is ready, or all but.
                let outcome = match (&mut streaming.turn).await {
                    Ok(Ok(outcome)) => Ok(pb::StreamTurnResponse {
                        event: Some(Event::Outcome(response(outcome, json_replies))),
                    }),
                    Ok(Err(e)) => Err(Status::from(e)),
                    Err(e) => Err(super::error::turn_task_failed(&e)),
                };
                return Some((outcome, None));
            }
        };
        Some((
            Ok(pb::StreamTurnResponse { event: Some(event) }),
            Some(streaming),
        ))
    })
}

/// The stream id of attempt `attempt`'s drafts: one reply being written per attempt.
fn stream_id(attempt: u32) -> String {
    format!("attempt-{attempt}")
}

impl TurnApi {
    /// Checks the request and starts its turn on a task of its own, in the current span.
    ///
    /// The turn runs on its own task so that a caller who hangs up (a timed-out gateway) does
    /// not cut it short mid-commit: it finishes, its receipt is stored, and the gateway's retry
    /// gets the answer. This part is not `async`, so that the call's future, which tonic's
    /// layers move and box, does not also carry the parsed activity and the turn's own future:
    /// moving those was a tenth of the server's instructions per turn (callgrind).
    /// A streamed turn drafts to `drafts`, which it drops when it ends.
    fn start(
        &self,
        request: Request<pb::ProcessTurnRequest>,
        drafts: Option<Drafts>,
    ) -> Result<JoinHandle<Result<TurnOutcome, TurnError>>, Status> {
        // The turn's place among those in flight, taken before its request was read.
        let in_flight = request
            .extensions()
            .get::<Admitted>()
            .cloned()
            .ok_or_else(|| Status::internal("a turn reached TurnService without admission"))?;
        let deadline = deadline(&request);
        let pb::ProcessTurnRequest { input, bot, .. } = request.into_inner();
        let incoming = self
            .check(input, in_flight.received_bytes())
            .inspect_err(|_| self.engine.refused_invalid())?;
        let engine = Arc::clone(&self.engine);
        Ok(tokio::spawn(
            async move {
                // Boxed: the turn's future is several kilobytes, and unboxed it made this task's
                // future as large, which `spawn` and the span wrapper then copied whole; boxed,
                // the task stays a few words (`bench/RESULTS.md`).
                let outcome = Box::pin(engine.run_turn_drafting(
                    Some(&bot),
                    &incoming,
                    deadline,
                    drafts.as_ref(),
                ))
                .await;
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

/// The call's deadline, from the `grpc-timeout` header its client sent: at most eight digits and
/// a unit, as the gRPC spec writes it and tonic's own timeout reads it; anything else is no
/// deadline, as it is to tonic.
///
/// Read byte by byte: through `to_str` and `str::parse` it was two scans and a search more, a
/// hundred instructions per turn (`bench/RESULTS.md`).
fn deadline<T>(request: &Request<T>) -> Option<Instant> {
    let headers: &http::HeaderMap = request.metadata().as_ref();
    let timeout = parse_timeout(headers.get(&GRPC_TIMEOUT)?.as_bytes())?;
    Instant::now().checked_add(timeout)
}

/// A `grpc-timeout` value: `TimeoutValue TimeoutUnit`, one to eight ASCII digits and one of
/// `H M S m u n`.
fn parse_timeout(value: &[u8]) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (&unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let mut amount: u64 = 0;
    for &digit in digits {
        if !digit.is_ascii_digit() {
            return None;
        }
        // Eight digits at most: no overflow.
        amount = amount * 10 + u64::from(digit - b'0');
    }
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_timeout;
    use std::time::Duration;

    #[test]
    fn a_timeout_is_read_in_each_unit() {
        for (value, expected) in [
            ("2H", Duration::from_secs(7200)),
            ("3M", Duration::from_secs(180)),
            ("15S", Duration::from_secs(15)),
            ("250m", Duration::from_millis(250)),
            ("7u", Duration::from_micros(7)),
            ("99999999n", Duration::from_nanos(99_999_999)),
            ("00000001S", Duration::from_secs(1)),
        ] {
            assert_eq!(parse_timeout(value.as_bytes()), Some(expected), "{value}");
        }
    }

    #[test]
    fn a_timeout_outside_the_spec_is_no_deadline() {
        for value in [
            "",
            "S",
            "5",
            "5s",
            "5x",
            "+5S",
            "-5S",
            " 5S",
            "5 S",
            "123456789S",
            "1.5S",
            "5SS",
        ] {
            assert_eq!(parse_timeout(value.as_bytes()), None, "{value:?}");
        }
    }
}
