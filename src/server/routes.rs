//! The server's gRPC services, each call sent to its service by the service name in its path.
//!
//! tonic's own router (`Server::add_service`) is an axum `Router` with a wildcard route per
//! service: for every call it matches the path, collects the wildcard into a `UrlParams`
//! extension (an allocation and a hash-map insert), clones a boxed copy of the service, and
//! converts the request body into axum's type and back, and the response's likewise: a
//! twentieth of a health check under callgrind (`bench/RESULTS.md`).
//! A gRPC path is always `/{package.Service}/{Method}` and this server has four services, so a
//! comparison of the path's first segment does the same job: `TurnService`, which carries the
//! load, is compared first and called as it is; the health and reflection services are boxed,
//! and a call to any other service is answered `UNIMPLEMENTED` naming it, as tonic's router
//! answered (without the name).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::Service;
use tower::util::{BoxCloneSyncService, Oneshot, ServiceExt as _};

use super::admission::Received;

/// A service of the server other than `TurnService`, boxed.
type Boxed = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// `TurnService` (`T`) and the server's other services, routed by service name.
#[derive(Clone)]
pub struct Services<T> {
    name: &'static str,
    turns: T,
    others: Arc<[(&'static str, Boxed)]>,
}

impl<T> std::fmt::Debug for Services<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.others.iter().map(|(name, _)| *name).collect();
        f.debug_struct("Services")
            .field("others", &names)
            .finish_non_exhaustive()
    }
}

impl<T> Services<T> {
    /// Routes calls to the service `name` to `turns` (`TurnService`, perhaps behind layers that
    /// do not name it), and nothing else yet.
    pub fn new(name: &'static str, turns: T) -> Self {
        Self {
            name,
            turns,
            others: Arc::new([]),
        }
    }

    /// Adds `service`, called for paths under its [`NamedService::NAME`].
    #[must_use]
    pub fn with<S>(self, service: S) -> Self
    where
        S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        let mut others = self.others.to_vec();
        others.push((S::NAME, BoxCloneSyncService::new(service)));
        Self {
            others: others.into(),
            ..self
        }
    }
}

/// A call's answer: from `TurnService`, from another service, or `UNIMPLEMENTED`.
type Answer<F> = Either<
    F,
    Either<Oneshot<Boxed, http::Request<Body>>, Ready<Result<http::Response<Body>, Infallible>>>,
>;

/// Calls come counted or not from admission ([`Received`]); `TurnService` takes the count with
/// the body, the other services the body as it came.
impl<T> Service<http::Request<Received>> for Services<T>
where
    T: Service<http::Request<Received>, Response = http::Response<Body>, Error = Infallible>,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Answer<T::Future>;

    /// Ready when `TurnService` is: another service is called on a clone of its own, made ready
    /// by [`Oneshot`].
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.turns.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Received>) -> Self::Future {
        if method_of(request.uri().path(), self.name).is_some() {
            return Either::Left(self.turns.call(request));
        }
        let name = service_name(request.uri().path());
        match self.others.iter().find(|(other, _)| *other == name) {
            Some((_, service)) => Either::Right(Either::Left(
                service.clone().oneshot(request.map(Received::into_inner)),
            )),
            None => Either::Right(Either::Right(ready(Ok(unimplemented(name))))),
        }
    }
}

/// The method of a gRPC path, `/{package.Service}/{Method}`, when it is one of `service`'s:
/// compared in place, without the search for the second `/` that [`service_name`] makes (a
/// hundred and eighty instructions at every turn, `bench/RESULTS.md`).
pub(super) fn method_of<'a>(path: &'a str, service: &str) -> Option<&'a str> {
    path.strip_prefix('/')?
        .strip_prefix(service)?
        .strip_prefix('/')
}

/// The service name in a gRPC path, `/{package.Service}/{Method}`: its first segment.
fn service_name(path: &str) -> &str {
    let path = path.strip_prefix('/').unwrap_or(path);
    path.split_once('/').map_or(path, |(service, _)| service)
}

/// `UNIMPLEMENTED` for a call to a service this server does not have.
fn unimplemented(service: &str) -> http::Response<Body> {
    let (parts, ()) = Status::unimplemented(format!("unknown service {service:?}"))
        .into_http::<()>()
        .into_parts();
    http::Response::from_parts(parts, Body::empty())
}

#[cfg(test)]
mod tests {
    use super::{method_of, service_name};

    #[test]
    fn a_path_is_of_a_service_only_with_its_whole_name_and_a_method() {
        let turns = "turnstile.v1.TurnService";
        let is_of = |path| method_of(path, turns).is_some();
        assert_eq!(
            method_of("/turnstile.v1.TurnService/ProcessTurn", turns),
            Some("ProcessTurn")
        );
        assert!(is_of("/turnstile.v1.TurnService/"));
        assert!(!is_of("/turnstile.v1.TurnServiceX/ProcessTurn"));
        assert!(!is_of("/turnstile.v1.TurnService"));
        assert!(!is_of("turnstile.v1.TurnService/ProcessTurn"));
        assert!(!is_of("/turnstile.v1/TurnService/ProcessTurn"));
        assert!(!is_of("/"));
    }

    #[test]
    fn the_service_name_is_the_paths_first_segment() {
        assert_eq!(
            service_name("/turnstile.v1.TurnService/ProcessTurn"),
            "turnstile.v1.TurnService"
        );
        assert_eq!(
            service_name("/grpc.health.v1.Health/Check"),
            "grpc.health.v1.Health"
        );
        assert_eq!(
            service_name("/grpc.health.v1.Health"),
            "grpc.health.v1.Health"
        );
        assert_eq!(service_name("/"), "");
        assert_eq!(service_name(""), "");
    }
}
