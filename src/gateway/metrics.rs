//! What the gateway counts: HTTP requests by route and status, `ProcessTurn` calls by outcome,
//! deliveries to the channels, and the turns run after the channel was answered `202`, recorded through the `metrics` facade like the server's.
//!
//! `turnstile gateway --metrics-listen` serves them, with the `process_*` metrics, on a port of
//! its own (see `telemetry::metrics`): the gateway's HTTP port is the one an Ingress publishes,
//! and what a gateway counts (its routes, its failure rates) is no business of the channels'.
//!
//! Labels are bounded: a route is the matched route's template (`/v3/directline/conversations/
//! {id}/activities`), never the path a caller sent, and `_OTHER` for paths no route serves.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use tonic::Code;

use super::health::{HEALTHZ, READYZ};

/// HTTP requests answered, by `route` and `status` (the numeric HTTP status).
pub const REQUESTS: &str = "turnstile_gateway_requests_total";
/// Wall time of one HTTP request, by `route`: for `/api/messages`, the turn and the deliveries
/// included only when the caller waits for them (`expectReplies`, invokes), else the `202`'s.
pub const REQUEST_DURATION: &str = "turnstile_gateway_request_duration_seconds";
/// `ProcessTurn` calls (a turn, its retries included) by `code`, the gRPC status's name (`OK`,
/// `UNAVAILABLE`, …) of the last answer.
pub const TURNS: &str = "turnstile_gateway_turns_total";
/// `ProcessTurn` calls sent again after a retryable answer, by that answer's `code`.
pub const TURN_RETRIES: &str = "turnstile_gateway_turn_retries_total";
/// Replies posted to a channel, by `outcome`: `delivered`, `refused` (the channel said no, after
/// the retries), `unreachable`, `no_token` (the bot's own token could not be had).
pub const DELIVERIES: &str = "turnstile_gateway_deliveries_total";
/// Reply POSTs sent again, by `reason`: `refused` (429, 5xx, 401) or `unreachable`.
pub const DELIVERY_RETRIES: &str = "turnstile_gateway_delivery_retries_total";
/// Turns run after the channel was answered `202`, by `outcome`: `delivered` (every reply
/// reached the channel), `failed` (Turnstile refused the turn or its deadline ran out),
/// `bad_reply` (a reply is no activity), `undelivered` (the channel kept refusing a reply).
pub const BACKGROUND_TURNS: &str = "turnstile_gateway_background_turns_total";

/// The route label of a request no route serves.
const OTHER: &str = "_OTHER";

/// Describes the gateway's metrics and registers the retry and delivery series at zero, so that
/// a dashboard shows 0 instead of no data before the first retry (the codes are those
/// `turns` retries).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(REQUESTS, "HTTP requests answered, by route and status");
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "Wall time of one HTTP request, by route"
    );
    describe_counter!(
        TURNS,
        "ProcessTurn calls by the gRPC code of the last answer"
    );
    describe_counter!(
        TURN_RETRIES,
        "ProcessTurn calls retried, by the code retried"
    );
    describe_counter!(DELIVERIES, "Replies posted to a channel, by outcome");
    describe_counter!(DELIVERY_RETRIES, "Reply POSTs retried, by reason");
    describe_counter!(
        BACKGROUND_TURNS,
        "Turns run after the channel was answered 202, by outcome"
    );
    for code in [Code::Aborted, Code::Unavailable, Code::ResourceExhausted] {
        metrics::counter!(TURN_RETRIES, "code" => code_name(code)).absolute(0);
    }
    for reason in ["refused", "unreachable"] {
        metrics::counter!(DELIVERY_RETRIES, "reason" => reason).absolute(0);
    }
    for outcome in ["delivered", "refused", "unreachable", "no_token"] {
        metrics::counter!(DELIVERIES, "outcome" => outcome).absolute(0);
    }
    for outcome in ["delivered", "failed", "bad_reply", "undelivered"] {
        metrics::counter!(BACKGROUND_TURNS, "outcome" => outcome).absolute(0);
    }
}

/// Middleware: counts and times every request by its matched route and status, but the probes'
/// (a kubelet's every few seconds would drown the channels' requests).
pub async fn track(request: Request, next: Next) -> Response {
    let route = match request.extensions().get::<MatchedPath>() {
        Some(path) if [HEALTHZ, READYZ].contains(&path.as_str()) => {
            return next.run(request).await;
        }
        Some(path) => path.as_str().to_owned(),
        None => OTHER.to_owned(),
    };
    let started = Instant::now();
    let response = next.run(request).await;
    metrics::histogram!(REQUEST_DURATION, "route" => route.clone())
        .record(started.elapsed().as_secs_f64());
    metrics::counter!(
        REQUESTS,
        "route" => route,
        "status" => response.status().as_str().to_owned(),
    )
    .increment(1);
    response
}

/// Records a `ProcessTurn` call's last answer.
pub fn turn(code: Code) {
    metrics::counter!(TURNS, "code" => code_name(code)).increment(1);
}

/// Records a `ProcessTurn` call sent again after `code`.
pub fn turn_retried(code: Code) {
    metrics::counter!(TURN_RETRIES, "code" => code_name(code)).increment(1);
}

/// Records a reply's delivery, `outcome` being one of [`DELIVERIES`]'.
pub fn delivery(outcome: &'static str) {
    metrics::counter!(DELIVERIES, "outcome" => outcome).increment(1);
}

/// Records how a background turn ended, `outcome` being one of [`BACKGROUND_TURNS`]'.
pub fn background_turn(outcome: &'static str) {
    metrics::counter!(BACKGROUND_TURNS, "outcome" => outcome).increment(1);
}

/// Records a reply POST sent again, `reason` being one of [`DELIVERY_RETRIES`]'.
pub fn delivery_retried(reason: &'static str) {
    metrics::counter!(DELIVERY_RETRIES, "reason" => reason).increment(1);
}

/// The gRPC status code's canonical name.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_named_as_grpc_names_them() {
        assert_eq!(code_name(Code::Ok), "OK");
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        assert_eq!(code_name(Code::Unauthenticated), "UNAUTHENTICATED");
    }
}
