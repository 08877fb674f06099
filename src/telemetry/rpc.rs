//! OpenTelemetry's RPC conventions for every call the gRPC server answers, as a tower layer.
//!
//! It wraps the whole server (`Server::builder().layer(..)`), outside authentication, decoding,
//! the in-flight limit and the drain, so that a call refused by any of them is seen like one
//! that ran: a server span named `service/method` (`turnstile.v1.TurnService/ProcessTurn`) with
//! `rpc.system`, `rpc.service`, `rpc.method` and `rpc.grpc.status_code`, parented on the
//! caller's W3C `traceparent`; and one sample of [`RPC_SERVER_DURATION`] labelled by service,
//! method and status code.
//!
//! The status comes from the response headers when the answer is trailers-only (every refusal
//! and error of a unary call), else from the trailers at the end of the body. A call whose
//! client went away before either is counted as `CANCELLED`, as grpc-go does.
//!
//! Labels are bounded: a path that names no service or method this server hosts (a scanner, a
//! client built from another proto) is labelled `_OTHER`, as the conventions say, so that a
//! caller cannot grow the metric without bound.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http_body::{Body, Frame};
use tokio::time::Instant;
use tonic::Code;
use tower::{Layer, Service};

/// Wall time of one gRPC call on the server, from its request headers to its status, by
/// `rpc_service`, `rpc_method` and `rpc_grpc_status_code` (the numeric gRPC code).
pub const RPC_SERVER_DURATION: &str = "rpc_server_duration_seconds";

/// The label of a service or method this server does not host.
const OTHER: &str = "_OTHER";

/// The methods this server hosts: (service, method, span name).
const METHODS: &[(&str, &str, &str)] = &[
    (
        "turnstile.v1.TurnService",
        "ProcessTurn",
        "turnstile.v1.TurnService/ProcessTurn",
    ),
    (
        "grpc.health.v1.Health",
        "Check",
        "grpc.health.v1.Health/Check",
    ),
    (
        "grpc.health.v1.Health",
        "Watch",
        "grpc.health.v1.Health/Watch",
    ),
    (
        "grpc.reflection.v1.ServerReflection",
        "ServerReflectionInfo",
        "grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    ),
    (
        "grpc.reflection.v1alpha.ServerReflection",
        "ServerReflectionInfo",
        "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ),
];

/// gRPC status codes as labels: `OK` is 0, `UNAUTHENTICATED` 16.
const CODES: [&str; 17] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
];

/// The layer: wraps a service in [`RpcTelemetry`].
#[derive(Debug, Clone, Default)]
pub struct RpcTelemetryLayer {
    durations: Arc<Durations>,
}

impl<S> Layer<S> for RpcTelemetryLayer {
    type Service = RpcTelemetry<S>;

    fn layer(&self, inner: S) -> RpcTelemetry<S> {
        RpcTelemetry {
            inner,
            durations: Arc::clone(&self.durations),
        }
    }
}

/// The [`RPC_SERVER_DURATION`] handles of the hosted methods, one per method and status code,
/// each taken on its first use (by then `serve` has installed the recorder) and kept: a lookup
/// by name and labels at every call hashed three labels, one of them formatted, and searched
/// the recorder's registry.
#[derive(Debug)]
struct Durations([[OnceLock<metrics::Histogram>; CODES.len()]; METHODS.len()]);

impl Default for Durations {
    fn default() -> Self {
        Self(std::array::from_fn(|_| {
            std::array::from_fn(|_| OnceLock::new())
        }))
    }
}

impl Durations {
    fn record(&self, service: &'static str, method: &'static str, code: Code, seconds: f64) {
        let number = code as usize;
        let index = METHODS
            .iter()
            .position(|&(s, m, _)| s == service && m == method);
        match (index, CODES.get(number)) {
            (Some(index), Some(&label)) => self.0[index][number]
                .get_or_init(|| histogram(service, method, label))
                .record(seconds),
            (_, label) => {
                let label = label.map_or_else(|| number.to_string(), |l| (*l).to_owned());
                histogram(service, method, label).record(seconds);
            }
        }
    }
}

fn histogram(
    service: &'static str,
    method: &'static str,
    code: impl Into<metrics::SharedString>,
) -> metrics::Histogram {
    metrics::histogram!(
        RPC_SERVER_DURATION,
        "rpc_service" => service,
        "rpc_method" => method,
        "rpc_grpc_status_code" => code.into(),
    )
}

/// A gRPC server (or part of one) whose calls are traced and timed.
#[derive(Debug, Clone)]
pub struct RpcTelemetry<S> {
    inner: S,
    durations: Arc<Durations>,
}

impl<S, B, ResBody> Service<http::Request<B>> for RpcTelemetry<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResBody>>,
{
    type Response = http::Response<RecordedBody<ResBody>>;
    type Error = S::Error;
    type Future = RpcFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let call = Call::start(
            request.uri().path(),
            request.headers(),
            Arc::clone(&self.durations),
        );
        // Entered while the inner service starts the call, so that the handler's spans are
        // children of this one.
        let inner = call.span.in_scope(|| self.inner.call(request));
        RpcFuture {
            inner,
            call: Some(call),
        }
    }
}

/// One call being answered: its span, and when it started.
#[derive(Debug)]
struct Call {
    span: tracing::Span,
    service: &'static str,
    method: &'static str,
    started: Instant,
    finished: bool,
    durations: Arc<Durations>,
}

impl Call {
    fn start(path: &str, headers: &http::HeaderMap, durations: Arc<Durations>) -> Self {
        let (service, method, name) = names(path);
        let span = tracing::debug_span!(
            "rpc",
            otel.name = name,
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        // Before the span is first entered, which fixes its parent.
        super::traces::continue_trace(&span, headers);
        Self {
            span,
            service,
            method,
            started: Instant::now(),
            finished: false,
            durations,
        }
    }

    /// Records the call's status, once.
    fn finish(&mut self, code: Code) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let number = code as i32;
        self.span.record("rpc.grpc.status_code", i64::from(number));
        // The conventions' server-side errors; a caller's mistake leaves the status unset.
        if matches!(
            code,
            Code::Unknown
                | Code::DeadlineExceeded
                | Code::Unimplemented
                | Code::Internal
                | Code::Unavailable
                | Code::DataLoss
        ) {
            self.span.record("otel.status_code", "error");
        }
        self.durations.record(
            self.service,
            self.method,
            code,
            self.started.elapsed().as_secs_f64(),
        );
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // Neither a status nor the end of the body: the client went away first.
        self.finish(Code::Cancelled);
    }
}

/// The service, method and span name of a request path, `_OTHER` for what is not hosted here.
///
/// A hosted method's path is its span name after the `/`, so it is found by comparing whole
/// paths; only a path that is none of them is split into its service and method (a search for
/// `/` at every call cost a hundred and eighty instructions, `bench/RESULTS.md`).
fn names(path: &str) -> (&'static str, &'static str, &'static str) {
    let path = path.strip_prefix('/').unwrap_or("");
    if let Some(&known) = METHODS.iter().find(|&&(_, _, name)| name == path) {
        return known;
    }
    // Not a hosted method: a hosted service's name is kept, anything else is `_OTHER`.
    let service = path.split_once('/').map_or("", |(service, _)| service);
    let known = METHODS.iter().find(|&&(s, _, _)| s == service);
    (known.map_or(OTHER, |&(s, _, _)| s), OTHER, OTHER)
}

/// The name of the header (or trailer) carrying a call's gRPC status. Looked up by a `&str`,
/// a name is parsed and checked again at every lookup, twice per call (`bench/RESULTS.md`).
static GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

/// The gRPC status in `headers`, if they carry one.
fn status_code(headers: &http::HeaderMap) -> Option<Code> {
    headers
        .get(&GRPC_STATUS)
        .map(|v| Code::from_bytes(v.as_bytes()))
}

pin_project_lite::pin_project! {
    /// The response future of [`RpcTelemetry`].
    pub struct RpcFuture<F> {
        #[pin]
        inner: F,
        call: Option<Call>,
    }
}

impl<F, ResBody, E> Future for RpcFuture<F>
where
    F: Future<Output = Result<http::Response<ResBody>, E>>,
{
    type Output = Result<http::Response<RecordedBody<ResBody>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let polled = match this.call.as_ref() {
            Some(call) => call.span.in_scope(|| this.inner.poll(cx)),
            None => this.inner.poll(cx),
        };
        let result = std::task::ready!(polled);
        let mut call = this.call.take();
        Poll::Ready(match result {
            Ok(response) => {
                if let (Some(call), Some(code)) = (call.as_mut(), status_code(response.headers())) {
                    // Trailers-only: the status is all there is.
                    call.finish(code);
                }
                Ok(response.map(|inner| RecordedBody { inner, call }))
            }
            Err(e) => {
                if let Some(call) = call.as_mut() {
                    call.finish(Code::Unknown);
                }
                Err(e)
            }
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that records the call's status from its trailers.
    pub struct RecordedBody<B> {
        #[pin]
        inner: B,
        call: Option<Call>,
    }
}

impl<B: Body> Body for RecordedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = std::task::ready!(this.inner.poll_frame(cx));
        if let Some(call) = this.call.as_mut() {
            match &frame {
                Some(Ok(frame)) => {
                    if let Some(code) = frame.trailers_ref().and_then(status_code) {
                        call.finish(code);
                    }
                }
                Some(Err(_)) => call.finish(Code::Unknown),
                // The body ended without trailers: no status reached the client.
                None => call.finish(Code::Unknown),
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_bounded_names() {
        assert_eq!(
            names("/turnstile.v1.TurnService/ProcessTurn"),
            (
                "turnstile.v1.TurnService",
                "ProcessTurn",
                "turnstile.v1.TurnService/ProcessTurn"
            )
        );
        assert_eq!(
            names("/turnstile.v1.TurnService/Nope"),
            ("turnstile.v1.TurnService", OTHER, OTHER)
        );
        assert_eq!(names("/evil.Service/Anything"), (OTHER, OTHER, OTHER));
        assert_eq!(names("/"), (OTHER, OTHER, OTHER));
        assert_eq!(
            names("/turnstile.v1.TurnService/ProcessTurn/"),
            ("turnstile.v1.TurnService", OTHER, OTHER)
        );
    }

    /// `names` finds a hosted method by its span name: each must be its service and method.
    #[test]
    fn every_hosted_methods_span_name_is_its_path() {
        for &(service, method, name) in METHODS {
            assert_eq!(name, format!("{service}/{method}"));
            assert_eq!(names(&format!("/{name}")), (service, method, name));
        }
    }
}
