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
//! An admitted turn's body is counted on its way to the decoder ([`Received`]): the handler then
//! knows how many bytes carried the activity, a bound on every size it must check
//! ([`crate::grpc::limits::Limits::check_within`]). Without it the handler measured each
//! activity's encoding again, walking every field: about 660 instructions a turn, a
//! hundredth of the turn (`bench/RESULTS.md`), for an answer the transport already had.
//!
//! HTTP/2 bounds the rest: a connection carries at most `--max-concurrent-streams` calls at once
//! (`Server::max_concurrent_streams`), so one caller cannot queue calls without bound where no
//! limit sees them.
//!
//! Refused at once and unread, a refusal still costs the replica HTTP/2's work for a call. Callers
//! that retry at once send the next call as soon as the refusal lands: under 16 times the load,
//! about 73,000 refusals a second took a core from the admitted turns, whose p99 rose 5–6 times
//! (`bench/overload.sh`). So in a storm of refusals ([`Pacing`]: more than [`STORM_REFUSALS`] in
//! [`STORM_WINDOW`]) an overload refusal is held back [`HOLD`] before it is sent, its `RetryInfo`
//! delay shortened by as much. A caller that waits as `RetryInfo` asks retries when it would
//! have; one that retries at once is slowed to a call per [`HOLD`] per stream. Outside a storm a
//! refusal goes at once, so that a caller can move on to another replica without waiting.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf as _, Bytes};
use futures::future::{BoxFuture, Either};
use http_body::{Body, Frame, SizeHint};
use tower::{Layer, Service};

use super::drain::{Drain, InFlight};
use crate::grpc::error::Refusal;
use crate::grpc::pb::turn_service_server;
use crate::telemetry::metrics::REFUSALS_HELD;

/// The paths of `TurnService`'s turn methods: the calls that run a turn and count against
/// `max_in_flight` (`StopTurn` only asks a running turn to stop).
fn is_turn(path: &str) -> bool {
    matches!(
        super::routes::method_of(path, turn_service_server::SERVICE_NAME),
        Some("ProcessTurn" | "StreamTurn")
    )
}

/// A turn's place in the drain, taken by [`Admission`] and carried to the handler in the
/// request's extensions (which need `Clone`: the place is shared, and given back when the last
/// holder drops it), with the count of its request's bytes received so far.
#[derive(Debug, Clone)]
pub struct Admitted {
    place: Arc<Place>,
}

#[derive(Debug)]
struct Place {
    _in_flight: InFlight,
    /// The bytes of the request's body that have passed [`Received`] so far.
    received: AtomicUsize,
}

impl Admitted {
    fn new(in_flight: InFlight) -> Self {
        Self {
            place: Arc::new(Place {
                _in_flight: in_flight,
                received: AtomicUsize::new(0),
            }),
        }
    }

    /// How many bytes of the request's body have been received: once its first message is
    /// decoded, at least that message's encoded size. The server accepts no compressed
    /// requests (tonic refuses them unless `accept_compressed` is set, and it is not), so the
    /// bytes received are the encoding itself.
    pub fn received_bytes(&self) -> usize {
        self.place.received.load(Ordering::Relaxed)
    }
}

/// A request's body as the services behind [`Admission`] get it: an admitted turn's counted
/// into its [`Admitted`] place as it is read, any other call's as it came.
#[derive(Debug)]
pub struct Received {
    body: tonic::body::Body,
    counted: Option<Arc<Place>>,
}

impl Received {
    /// `body`, not counted.
    pub fn uncounted(body: tonic::body::Body) -> Self {
        Self {
            body,
            counted: None,
        }
    }

    /// The body as it came, for a service that does not count it.
    pub fn into_inner(self) -> tonic::body::Body {
        self.body
    }
}

impl Body for Received {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let frame = std::task::ready!(Pin::new(&mut self.body).poll_frame(cx));
        if let (Some(place), Some(Ok(frame))) = (&self.counted, &frame) {
            let size = frame.data_ref().map_or(0, Bytes::remaining);
            place.received.fetch_add(size, Ordering::Relaxed);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Admits the turn methods' calls of the service it wraps, or refuses them unread.
#[derive(Debug, Clone)]
pub struct AdmissionLayer {
    drain: Arc<Drain>,
    pacing: Arc<Pacing>,
}

impl AdmissionLayer {
    pub fn new(drain: Arc<Drain>) -> Self {
        Self {
            drain,
            pacing: Arc::new(Pacing::new(tokio::time::Instant::now())),
        }
    }
}

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admission<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admission {
            inner,
            drain: Arc::clone(&self.drain),
            pacing: Arc::clone(&self.pacing),
        }
    }
}

/// See [`AdmissionLayer`].
#[derive(Debug, Clone)]
pub struct Admission<S> {
    inner: S,
    drain: Arc<Drain>,
    pacing: Arc<Pacing>,
}

/// How much of a refused call's body is read, and dropped, before the refusal is sent. A turn's
/// request is one small message, which is usually in by then: answering while a client still
/// sends made some clients see the stream reset (`UNKNOWN`) instead of the refusal, about one
/// call in 200 under 16 times the load (`bench/overload.sh`). A larger body is not waited for.
const REFUSED_BODY_READ: usize = 64 << 10;

impl<S> Service<http::Request<tonic::body::Body>> for Admission<S>
where
    S: Service<http::Request<Received>, Response = http::Response<tonic::body::Body>>,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<BoxFuture<'static, Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        if !is_turn(request.uri().path()) {
            return Either::Right(self.inner.call(request.map(Received::uncounted)));
        }
        match self.drain.enter() {
            Ok(in_flight) => {
                let admitted = Admitted::new(in_flight);
                let (mut parts, body) = request.into_parts();
                let body = Received {
                    body,
                    counted: Some(Arc::clone(&admitted.place)),
                };
                parts.extensions.insert(admitted);
                Either::Right(self.inner.call(http::Request::from_parts(parts, body)))
            }
            Err(refusal) => {
                let hold = match refusal {
                    Refusal::Overloaded { .. } => self.pacing.hold(tokio::time::Instant::now()),
                    _ => None,
                };
                let held = hold.as_ref().map_or(Duration::ZERO, |_| HOLD);
                let refused = refusal.into_status_after(held).into_http();
                let body = request.into_body();
                Either::Left(Box::pin(async move {
                    drop_body(body, REFUSED_BODY_READ).await;
                    if let Some(hold) = hold {
                        tokio::time::sleep_until(hold.until).await;
                    }
                    Ok(refused)
                }))
            }
        }
    }
}

/// How long a window [`Pacing`] counts refusals in.
pub(crate) const STORM_WINDOW: Duration = Duration::from_millis(100);
/// Refusals in one [`STORM_WINDOW`] past which the replica is in a storm of them: 1,000 a second,
/// more than a thousand callers that each wait the 500 ms `RetryInfo` asks would make.
pub(crate) const STORM_REFUSALS: usize = 100;
/// How long an overload refusal is held back in a storm: 200 of the 500 ms `RetryInfo` asks a
/// caller to wait before retrying.
pub(crate) const HOLD: Duration = Duration::from_millis(200);
/// The most refusals held back at once; past it they go at once. Each is a call's headers, its
/// refusal and a timer (about a kilobyte), so memory stays bounded whoever calls.
pub(crate) const MAX_HELD: usize = 8192;

/// Whether refusals are coming in a storm, counted in fixed windows of [`STORM_WINDOW`], and
/// how many are held back now.
#[derive(Debug)]
pub(crate) struct Pacing {
    /// Window `n` starts `n` windows after `epoch`.
    epoch: tokio::time::Instant,
    /// The window `in_window` counts.
    window: AtomicU64,
    in_window: AtomicUsize,
    /// What the window before it counted (0 if it was not the one just before).
    last_window: AtomicUsize,
    held: AtomicUsize,
    held_total: metrics::Counter,
}

/// One refusal held back until `until`; its place among the held is given back when it is
/// dropped (sent, or its caller gone).
#[derive(Debug)]
pub(crate) struct Hold {
    pacing: Arc<Pacing>,
    pub(crate) until: tokio::time::Instant,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.pacing.held.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Pacing {
    pub(crate) fn new(epoch: tokio::time::Instant) -> Self {
        Self {
            epoch,
            window: AtomicU64::new(0),
            in_window: AtomicUsize::new(0),
            last_window: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            held_total: metrics::counter!(REFUSALS_HELD),
        }
    }

    /// Counts an overload refusal decided at `now`, and holds it back if refusals come in a
    /// storm and fewer than [`MAX_HELD`] are held already.
    pub(crate) fn hold(self: &Arc<Self>, now: tokio::time::Instant) -> Option<Hold> {
        if !self.storm(now) {
            return None;
        }
        if self.held.fetch_add(1, Ordering::Relaxed) >= MAX_HELD {
            self.held.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        self.held_total.increment(1);
        Some(Hold {
            pacing: Arc::clone(self),
            until: now + HOLD,
        })
    }

    /// Counts a refusal at `now`: whether this window or the one before counted more than
    /// [`STORM_REFUSALS`]. Approximate where refusals race a window's turn, which a storm
    /// outnumbers.
    fn storm(&self, now: tokio::time::Instant) -> bool {
        let since = now.saturating_duration_since(self.epoch);
        let window = u64::try_from(since.as_nanos() / STORM_WINDOW.as_nanos()).unwrap_or(u64::MAX);
        let current = self.window.load(Ordering::Relaxed);
        if window > current
            && self
                .window
                .compare_exchange(current, window, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let counted = self.in_window.swap(0, Ordering::Relaxed);
            let last = if window == current + 1 { counted } else { 0 };
            self.last_window.store(last, Ordering::Relaxed);
        }
        let counted = self.in_window.fetch_add(1, Ordering::Relaxed) + 1;
        counted > STORM_REFUSALS || self.last_window.load(Ordering::Relaxed) > STORM_REFUSALS
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

    /// Refusals at `at` until one is held, or `n` of them; the holds are kept.
    fn refuse(pacing: &Arc<Pacing>, at: tokio::time::Instant, n: usize) -> Vec<Hold> {
        (0..n).filter_map(|_| pacing.hold(at)).collect()
    }

    #[test]
    fn refusals_are_held_back_only_in_a_storm_and_a_quiet_window_ends_it() {
        let epoch = tokio::time::Instant::now();
        let pacing = Arc::new(Pacing::new(epoch));
        // Window 0: the first STORM_REFUSALS go at once, the rest are held until HOLD after.
        let held = refuse(&pacing, epoch, STORM_REFUSALS + 5);
        assert_eq!(held.len(), 5);
        assert!(held.iter().all(|h| h.until == epoch + HOLD));
        // Window 1, right after a storm: held from the first refusal.
        let next = epoch + STORM_WINDOW;
        assert_eq!(refuse(&pacing, next, 3).len(), 3);
        // Window 2: window 1 counted 3, so this one starts calm.
        let calm = epoch + STORM_WINDOW * 2;
        assert!(refuse(&pacing, calm, STORM_REFUSALS).is_empty());
        // A gap of windows after a storm: calm too.
        assert_eq!(
            refuse(&pacing, calm, 1).len(),
            1,
            "past the count in window 2"
        );
        let later = epoch + STORM_WINDOW * 5;
        assert!(refuse(&pacing, later, STORM_REFUSALS).is_empty());
        assert_eq!(
            pacing.held.load(Ordering::Relaxed),
            5,
            "window 0's, still held"
        );
        drop(held);
        assert_eq!(pacing.held.load(Ordering::Relaxed), 0, "holds dropped");
    }

    #[test]
    fn at_most_max_held_refusals_are_held_and_each_place_is_given_back() {
        let epoch = tokio::time::Instant::now();
        let pacing = Arc::new(Pacing::new(epoch));
        let held = refuse(&pacing, epoch, STORM_REFUSALS + MAX_HELD + 10);
        assert_eq!(held.len(), MAX_HELD);
        assert!(pacing.hold(epoch).is_none(), "the held are at the bound");
        drop(held);
        assert_eq!(pacing.held.load(Ordering::Relaxed), 0);
        assert!(pacing.hold(epoch).is_some(), "places given back");
    }

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
