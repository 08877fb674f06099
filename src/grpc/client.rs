//! How Turnstile's own gRPC clients — of a `TurnService` (the gateway, `turnstile health-check`)
//! and of a bot worker (a remote bot) — turn an address and TLS settings into a channel endpoint,
//! in one place.
//!
//! A deployment that serves gRPC over TLS (and perhaps requires client certificates) must be
//! reachable by its own gateway and probe with the same files the chart mounts, so both read
//! them the same way: `http://` is plaintext HTTP/2, `https://` is TLS verified against the given
//! CA (or, without one, the Mozilla roots, for a server behind a public certificate), with an
//! optional name to verify instead of the address's host and an optional client identity. A
//! remote bot's connections to its worker are made here too ([`endpoint_to`], for the URL it
//! parsed at start), so that every client reads its certificate files, and refuses TLS settings
//! on a plaintext address, the same way.
//!
//! A client with many calls in flight on one connection (the gateway's turns, a remote bot's)
//! opens it with [`channel`]: its connections write the calls that become ready together in one
//! system call, as the server writes its answers ([`crate::grpc::coalesce`]), and not one each.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tonic::codegen::http::Uri;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tower::Service;

use crate::grpc::coalesce::Coalesced;

/// TLS settings of a client; unused for `http://` addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// PEM CA certificate(s) the server's certificate must chain to; `None` trusts the Mozilla
    /// roots.
    pub ca_cert: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the address's host.
    pub domain: Option<String>,
    /// A PEM client certificate and its key, for a server that requires mutual TLS.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// Why no endpoint could be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is no valid URI.
    #[error("the address `{address}` is not a valid URI")]
    Address {
        /// The address given.
        address: String,
        /// Why.
        #[source]
        source: tonic::codegen::http::uri::InvalidUri,
    },
    /// A certificate or key file could not be read.
    #[error("reading {path} failed")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// TLS settings were given for a plaintext address, which would silently not use them.
    #[error("TLS settings were given but `{0}` is a plaintext http:// address; use https://")]
    TlsOnPlaintext(String),
    /// The TLS configuration was refused.
    #[error("configuring TLS for {address} failed")]
    Tls {
        /// The address.
        address: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
}

impl ClientTls {
    /// Whether any TLS setting was given.
    pub fn is_set(&self) -> bool {
        self.ca_cert.is_some() || self.domain.is_some() || self.identity.is_some()
    }
}

/// A lazy-connecting endpoint for `address` with `tls` applied to `https://` addresses.
///
/// # Errors
/// [`ClientError`] when the address is invalid, a file cannot be read, or TLS settings were given
/// for a plaintext address.
pub fn endpoint(address: &str, tls: &ClientTls) -> Result<Endpoint, ClientError> {
    let endpoint =
        Channel::from_shared(address.to_owned()).map_err(|source| ClientError::Address {
            address: address.to_owned(),
            source,
        })?;
    secured(endpoint, address, tls)
}

/// The same for an address parsed already (a bot worker's, from `--remote-bot`): `tls` applies
/// when its scheme is `https`.
///
/// # Errors
/// [`ClientError`] when a file cannot be read, or TLS settings were given for a plaintext
/// address.
pub fn endpoint_to(url: &Uri, tls: &ClientTls) -> Result<Endpoint, ClientError> {
    secured(Endpoint::from(url.clone()), &url.to_string(), tls)
}

/// `endpoint` (for `address`) with `tls` applied when its scheme is `https` (as parsed, so in
/// any case), else refused if any is set.
fn secured(endpoint: Endpoint, address: &str, tls: &ClientTls) -> Result<Endpoint, ClientError> {
    if endpoint.uri().scheme_str() != Some("https") {
        if tls.is_set() {
            return Err(ClientError::TlsOnPlaintext(address.to_owned()));
        }
        return Ok(endpoint);
    }
    let mut config = match &tls.ca_cert {
        Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?)),
        None => ClientTlsConfig::new().with_webpki_roots(),
    };
    if let Some(domain) = &tls.domain {
        config = config.domain_name(domain.clone());
    }
    if let Some((cert, key)) = &tls.identity {
        config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    endpoint
        .tls_config(config)
        .map_err(|source| ClientError::Tls {
            address: address.to_owned(),
            source,
        })
}

/// A channel to `endpoint`, connecting on first use, whose connections write the calls ready
/// together ([`crate::grpc::coalesce`]; not beneath TLS, as on the server). TCP_NODELAY is on,
/// the endpoint's connect timeout applies.
pub fn channel(endpoint: &Endpoint) -> Channel {
    endpoint.connect_with_connector_lazy(Connector::new())
}

/// The same, connected now.
///
/// # Errors
/// When the connection cannot be made.
pub async fn connect(endpoint: &Endpoint) -> Result<Channel, tonic::transport::Error> {
    endpoint.connect_with_connector(Connector::new()).await
}

/// TCP connections, coalesced for `http://` and passing beneath `https://`'s TLS, which tonic
/// adds around them.
#[derive(Clone)]
struct Connector(HttpConnector);

impl Connector {
    fn new() -> Self {
        let mut http = HttpConnector::new();
        // `https://` reaches it too: tonic adds TLS around the connection it makes.
        http.enforce_http(false);
        http.set_nodelay(true);
        Self(http)
    }
}

impl Service<Uri> for Connector {
    type Response = TokioIo<Coalesced<TcpStream>>;
    type Error = <HttpConnector as Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = uri.scheme_str() == Some("https");
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let stream = connecting.await?.into_inner();
            Ok(TokioIo::new(Coalesced::unless_tls(stream, tls)))
        })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|source| ClientError::File {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// TLS settings naming only a CA file.
    fn with_ca(path: &str) -> ClientTls {
        ClientTls {
            ca_cert: Some(path.into()),
            ..ClientTls::default()
        }
    }

    /// What `Connector` makes of a connection to `scheme://` a listener here.
    async fn connected(scheme: &str) -> TokioIo<Coalesced<TcpStream>> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("{scheme}://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let connection = Connector::new().call(uri).await.unwrap();
        assert!(connection.inner().inner().nodelay().unwrap());
        connection
    }

    #[tokio::test]
    async fn plaintext_connections_coalesce_and_tls_ones_pass() {
        assert!(connected("http").await.inner().coalesces());
        // tonic's TLS wraps the connection, and writes again at its flush in the same poll.
        assert!(!connected("https").await.inner().coalesces());
    }

    #[test]
    fn tls_settings_on_a_plaintext_address_are_refused_not_ignored() {
        let tls = with_ca("ca.pem");
        let err = endpoint("http://127.0.0.1:50051", &tls).unwrap_err();
        assert!(matches!(err, ClientError::TlsOnPlaintext(_)), "{err}");
        assert!(endpoint("http://127.0.0.1:50051", &ClientTls::default()).is_ok());
    }

    #[test]
    fn an_unreadable_ca_is_named() {
        let tls = with_ca("/nonexistent/ca.pem");
        let err = endpoint("https://turnstile.example:443", &tls).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_parsed_url_gets_tls_by_its_scheme() {
        let tls = with_ca("/nonexistent/ca.pem");
        let plain: Uri = "http://127.0.0.1:50061".parse().unwrap();
        let err = endpoint_to(&plain, &tls).unwrap_err();
        assert!(matches!(err, ClientError::TlsOnPlaintext(_)), "{err}");
        assert!(endpoint_to(&plain, &ClientTls::default()).is_ok());
        let secure: Uri = "HTTPS://worker.example:50061".parse().unwrap();
        let err = endpoint_to(&secure, &tls).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn an_address_gets_tls_by_its_parsed_scheme_in_any_case() {
        let tls = with_ca("/nonexistent/ca.pem");
        // TLS applies (the CA is read, and found missing) rather than being refused as settings
        // on a plaintext address.
        let err = endpoint("HTTPS://turnstile.example:443", &tls).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn https_without_a_ca_uses_the_public_roots() {
        assert!(endpoint("https://turnstile.example:443", &ClientTls::default()).is_ok());
    }
}
