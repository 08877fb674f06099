//! Requests over the size limit get `RESOURCE_EXHAUSTED` (gRPC's convention), not tonic's
//! `OUT_OF_RANGE`.
//!
//! tonic checks `max_decoding_message_size` against the length prefix of the message, before a
//! byte of it is buffered, and answers `OUT_OF_RANGE`. That check is worth keeping exactly where
//! it is: it refuses a 2 GiB length prefix without reading it. The alternative, a second check in
//! `StrictCodec`'s decoder under a higher tonic ceiling, would buffer every request up to that
//! ceiling first, and the codec, built by generated code through `Default`, cannot even be told
//! the configured limit. So this thin layer around `TurnService` rewrites the answer instead:
//! nothing else on this service says `OUT_OF_RANGE` (no domain error maps to it, see
//! [`crate::grpc::error`]), so on this service the code means tonic's size check and nothing else.
//! The rewritten status carries the same details as every other refusal.
//!
//! The per-field limits of [`crate::grpc::limits`] stay `INVALID_ARGUMENT`: they name the field to
//! shrink in a `BadRequest`, which is a fix the caller can make, while a message over this limit
//! was never even decoded.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::server::NamedService;
use tonic::{Code, Status};
use tower::Service;

use crate::grpc::error::Refusal;

/// `TurnService` with tonic's `OUT_OF_RANGE` for an oversized request answered as
/// `RESOURCE_EXHAUSTED`.
#[derive(Debug, Clone)]
pub struct TooLarge<S> {
    inner: S,
    limit: usize,
}

impl<S> TooLarge<S> {
    /// Wraps `inner`, whose largest decoded message is `limit` bytes.
    pub fn new(inner: S, limit: usize) -> Self {
        Self { inner, limit }
    }
}

impl<S: NamedService> NamedService for TooLarge<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, ResBody> Service<http::Request<B>> for TooLarge<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResBody>>,
    ResBody: http_body::Body,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = Rewritten<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        Rewritten {
            inner: self.inner.call(request),
            limit: self.limit,
        }
    }
}

pin_project_lite::pin_project! {
    /// The inner service's answer, rewritten when it is tonic's size refusal. A future of its
    /// own rather than a boxed `async` block: that cost every call an allocation and a copy of
    /// the inner future (`bench/RESULTS.md`).
    #[derive(Debug)]
    pub struct Rewritten<F> {
        #[pin]
        inner: F,
        limit: usize,
    }
}

impl<F, ResBody, E> Future for Rewritten<F>
where
    F: Future<Output = Result<http::Response<ResBody>, E>>,
    ResBody: http_body::Body,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = std::task::ready!(this.inner.poll(cx))?;
        // Only an answer of headers alone can be the size refusal; one with a body (every turn's)
        // has its status in its trailers, and is not searched for one: the search by a `&str`
        // name cost every answer 170 instructions (`bench/RESULTS.md`).
        if response.body().is_end_stream() {
            rewrite(response.headers_mut(), *this.limit);
        }
        Poll::Ready(Ok(response))
    }
}

/// Rewrites a trailers-only `OUT_OF_RANGE` in `headers` (tonic answers a request it refuses to
/// decode with headers alone) into [`Refusal::MessageTooLarge`].
fn rewrite(headers: &mut http::HeaderMap, limit: usize) {
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    if status.code() != Code::OutOfRange {
        return;
    }
    let refusal = Status::from(Refusal::MessageTooLarge {
        limit,
        detail: status.message().to_owned(),
    });
    for name in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
        headers.remove(name);
    }
    if let Err(e) = refusal.add_header(headers) {
        // Only an unencodable message fails here; ours are plain ASCII.
        tracing::error!(error = %e, "could not encode the oversized-request status");
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_types::StatusExt as _;

    #[test]
    fn only_out_of_range_is_rewritten() {
        let mut headers = http::HeaderMap::new();
        Status::out_of_range("found 9 bytes, the limit is: 4 bytes")
            .add_header(&mut headers)
            .expect("encodable");
        rewrite(&mut headers, 4);
        let status = Status::from_header_map(&headers).expect("a status");
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("found 9 bytes"), "{status:?}");
        assert_eq!(
            status.get_details_error_info().map(|i| i.reason),
            Some("MESSAGE_TOO_LARGE".to_owned())
        );

        let mut headers = http::HeaderMap::new();
        Status::not_found("no such bot")
            .add_header(&mut headers)
            .expect("encodable");
        rewrite(&mut headers, 4);
        let status = Status::from_header_map(&headers).expect("a status");
        assert_eq!(status.code(), Code::NotFound);
    }
}
