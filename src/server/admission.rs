//! Admission: a turn is admitted, or refused, before its request is read.
//!
//! Past `max_in_flight` turns a call is refused with `RESOURCE_EXHAUSTED` ([`Drain::enter`]).
//! Refused in the handler, an overloaded replica still read every refused call's body and decoded
//! it first, so the callers that retry at once without waiting (as `RetryInfo` asks them to)
//! took CPU from the admitted turns: under 16 times the load the replica can serve, the admitted
//! turns' p99 rose 6.7 times. This layer decides at the request's headers instead, from its path
//! alone: a turn method takes a place in the drain or is refused, its body never decoded (only
//! read to its end and dropped, [`REFUSED_BODY_READ`]). The place it took goes with the request
//! to the handler ([`Admitted`]), which keeps it until the turn ends.
//!
//! HTTP/2 bounds the rest: a connection carries at most `--max-concurrent-streams` calls at once
//! (`Server::max_concurrent_streams`), so one caller cannot queue calls without bound where no
//! limit sees them.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{BoxFuture, Either};
use http_body::Body;
use tower::{Layer, Service};

use super::drain::{Drain, InFlight};
use crate::grpc::pb::turn_service_server;

/// The paths of `TurnService`'s turn methods: the calls that run a turn and count against
/// `max_in_flight` (`StopTurn` only asks a running turn to stop).
fn is_turn(path: &str) -> bool {
    let Some(method) = path
        .strip_prefix('/')
        .and_then(|path| path.strip_prefix(turn_service_server::SERVICE_NAME))
        .and_then(|path| path.strip_prefix('/'))
    else {
        return false;
    };
    matches!(method, "ProcessTurn" | "StreamTurn")
}

/// A turn's place in the drain, taken by [`Admission`] and carried to the handler in the
/// request's extensions (which need `Clone`: the place is shared, and given back when the last
/// holder drops it).
#[derive(Debug, Clone)]
pub struct Admitted {
    _place: Arc<InFlight>,
}

/// Admits the turn methods' calls of the service it wraps, or refuses them unread.
#[derive(Debug, Clone)]
pub struct AdmissionLayer {
    drain: Arc<Drain>,
}

impl AdmissionLayer {
    pub fn new(drain: Arc<Drain>) -> Self {
        Self { drain }
    }
}

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admission<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admission {
            inner,
            drain: Arc::clone(&self.drain),
        }
    }
}

/// See [`AdmissionLayer`].
#[derive(Debug, Clone)]
pub struct Admission<S> {
    inner: S,
    drain: Arc<Drain>,
}

/// How much of a refused call's body is read, and dropped, before the refusal is sent. A turn's
/// request is one small message, which is usually in by then: answering while a client still
/// sends made some clients see the stream reset (`UNKNOWN`) instead of the refusal, about one
/// call in 200 under 16 times the load (`bench/overload.sh`). A larger body is not waited for.
const REFUSED_BODY_READ: usize = 64 << 10;

impl<S, B> Service<http::Request<B>> for Admission<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Error: Send + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<BoxFuture<'static, Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if !is_turn(request.uri().path()) {
            return Either::Right(self.inner.call(request));
        }
        match self.drain.enter() {
            Ok(in_flight) => {
                request.extensions_mut().insert(Admitted {
                    _place: Arc::new(in_flight),
                });
                Either::Right(self.inner.call(request))
            }
            Err(refusal) => {
                let refused = tonic::Status::from(refusal).into_http();
                let body = request.into_body();
                Either::Left(Box::pin(async move {
                    drop_body(body, REFUSED_BODY_READ).await;
                    Ok(refused)
                }))
            }
        }
    }
}

/// Reads `body` to its end, or past `limit` bytes, or to its first error, dropping what it reads:
/// never decoded.
async fn drop_body<B: Body + Unpin>(mut body: B, limit: usize) {
    let mut read = 0;
    while read <= limit {
        match std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await {
            Some(Ok(frame)) => {
                read += frame.data_ref().map_or(0, bytes::Buf::remaining);
            }
            Some(Err(_)) | None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_turn_methods_are_admitted() {
        assert!(is_turn("/turnstile.v1.TurnService/ProcessTurn"));
        assert!(is_turn("/turnstile.v1.TurnService/StreamTurn"));
        assert!(!is_turn("/turnstile.v1.TurnService/StopTurn"));
        assert!(!is_turn("/turnstile.v1.TurnServiceX/ProcessTurn"));
        assert!(!is_turn("/grpc.health.v1.Health/Check"));
        assert!(!is_turn("/turnstile.v1.TurnService/ProcessTurn/"));
        assert!(!is_turn(""));
    }
}
