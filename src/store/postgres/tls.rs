//! TLS to PostgreSQL, with libpq's meaning of `sslmode` and `sslrootcert`.
//!
//! Why a module of its own: managed PostgreSQL services document libpq connection strings —
//! `sslmode=verify-full&sslrootcert=/path/ca.pem` — and libpq's environment variables, while
//! tokio-postgres knows only `disable`, `prefer` and `require` and rejects `verify-ca`,
//! `verify-full` and `sslrootcert` outright. So both are taken out of the connection string here
//! (or read from `PGSSLMODE` / `PGSSLROOTCERT` when the string does not say, as libpq does), the
//! rest goes to tokio-postgres, and the certificate checks they ask for are made here, by rustls:
//!
//! | `sslmode`     | encrypted              | server certificate checked                  |
//! |---------------|------------------------|---------------------------------------------|
//! | `disable`     | never                  | —                                           |
//! | `prefer`      | when the server offers | no                                          |
//! | `require`     | always                 | no; with `sslrootcert`, as `verify-ca`       |
//! | `verify-ca`   | always                 | chains to a trusted CA                      |
//! | `verify-full` | always                 | chains to a trusted CA and names the host   |
//!
//! `prefer` is the default, as in libpq. The trusted CAs are `sslrootcert`'s certificates, or
//! Mozilla's roots (webpki-roots) without it or with `sslrootcert=system` (which, as in libpq,
//! defaults the mode to `verify-full` and refuses a weaker one). Unlike libpq, a missing
//! `~/.postgresql/root.crt` is never looked for: a server's image has no such home directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context as _, bail};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::url::{UrlParts, key_values, percent_decode};

/// How a connection uses TLS: libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// Encrypted when the server offers TLS, plaintext otherwise; the certificate is not checked.
    Prefer,
    /// Encrypted; the certificate is not checked.
    Require,
    /// Encrypted; the certificate must chain to a trusted CA.
    VerifyCa,
    /// Encrypted; the certificate must chain to a trusted CA and name the host connected to.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> anyhow::Result<Self> {
        Ok(match value {
            "disable" => Self::Disable,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            // libpq's `allow` tries plaintext first; nothing here needs it.
            other => bail!(
                "sslmode `{other}` is not supported: use disable, prefer, require, verify-ca or \
                 verify-full"
            ),
        })
    }

    /// libpq's name of the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }
}

/// The CAs a server certificate must chain to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// The PEM certificates of this file.
    File(PathBuf),
    /// Mozilla's roots, as shipped in webpki-roots (`sslrootcert=system`, or none given).
    System,
}

/// What a connection string and the environment say about TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// The mode in effect (`require` with an `sslrootcert` already turned into `verify-ca`).
    pub mode: SslMode,
    /// The trusted CAs.
    pub roots: RootCerts,
}

impl TlsSettings {
    /// The mode tokio-postgres is told: whether to ask for TLS and whether to insist on it.
    pub(super) fn driver_mode(&self) -> tokio_postgres::config::SslMode {
        match self.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        }
    }

    /// The TLS connector these settings describe; reads the `sslrootcert` file.
    ///
    /// # Errors
    /// When the root certificate file cannot be read or holds no certificate.
    pub(super) fn connector(&self) -> anyhow::Result<MakeRustlsConnect> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match self.mode {
            SslMode::Disable | SslMode::Prefer | SslMode::Require => {
                Arc::new(EncryptOnly(Arc::clone(&provider)))
            }
            SslMode::VerifyCa => Arc::new(ChainOnly(self.webpki_verifier(&provider)?)),
            SslMode::VerifyFull => self.webpki_verifier(&provider)?,
        };
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("configuring TLS to PostgreSQL")?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(MakeRustlsConnect::new(config))
    }

    fn webpki_verifier(
        &self,
        provider: &Arc<CryptoProvider>,
    ) -> anyhow::Result<Arc<WebPkiServerVerifier>> {
        let roots = match &self.roots {
            RootCerts::File(path) => roots_from(path)?,
            RootCerts::System => RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            },
        };
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(provider))
            .build()
            .context("configuring TLS certificate verification for PostgreSQL")
    }
}

/// The CA certificates of the PEM file at `path`.
fn roots_from(path: &Path) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading sslrootcert {}", path.display()))?;
    for cert in certs {
        let cert = cert.with_context(|| format!("reading sslrootcert {}", path.display()))?;
        roots
            .add(cert)
            .with_context(|| format!("sslrootcert {} holds an unusable CA", path.display()))?;
    }
    if roots.is_empty() {
        bail!("sslrootcert {} holds no PEM certificate", path.display());
    }
    Ok(roots)
}

/// Takes `sslmode` and `sslrootcert` out of `conn` (a URL or key-value connection string);
/// returns the rest, for tokio-postgres, and the TLS settings they and `env` (libpq's
/// `PGSSLMODE` and `PGSSLROOTCERT`, looked up by name) describe.
///
/// # Errors
/// When the mode is unknown or contradicts `sslrootcert=system`.
pub(super) fn split(
    conn: &str,
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<(String, TlsSettings)> {
    let (rest, given) = match UrlParts::of(conn) {
        Some(parts) => split_url(&parts, conn),
        None => split_key_values(conn),
    };
    let nonempty = |v: Option<String>| v.filter(|v| !v.is_empty());
    let mode = nonempty(given.mode).or_else(|| nonempty(env("PGSSLMODE")));
    let root = nonempty(given.root_cert).or_else(|| nonempty(env("PGSSLROOTCERT")));
    let mode = mode.as_deref().map(SslMode::parse).transpose()?;
    let settings = match root.as_deref() {
        Some("system") => {
            let mode = mode.unwrap_or(SslMode::VerifyFull);
            if mode != SslMode::VerifyFull {
                bail!(
                    "sslmode `{}` may not be used with sslrootcert=system: use verify-full",
                    mode.as_str()
                );
            }
            TlsSettings {
                mode,
                roots: RootCerts::System,
            }
        }
        Some(path) => TlsSettings {
            // libpq: `require` with a root certificate verifies the chain, as `verify-ca`.
            mode: match mode.unwrap_or(SslMode::Prefer) {
                SslMode::Require => SslMode::VerifyCa,
                other => other,
            },
            roots: RootCerts::File(PathBuf::from(path)),
        },
        None => TlsSettings {
            mode: mode.unwrap_or(SslMode::Prefer),
            roots: RootCerts::System,
        },
    };
    Ok((rest, settings))
}

/// `sslmode` and `sslrootcert` as a connection string gives them.
#[derive(Default)]
struct Given {
    mode: Option<String>,
    root_cert: Option<String>,
}

impl Given {
    /// Takes `key`'s value when it is one of ours; says whether it was.
    fn take(&mut self, key: &str, value: String) -> bool {
        match key {
            "sslmode" => self.mode = Some(value),
            "sslrootcert" => self.root_cert = Some(value),
            _ => return false,
        }
        true
    }
}

/// `postgres://…?a=b&sslmode=…`: the query's parameters are `&`-separated and percent-encoded.
/// The query starts where tokio-postgres finds it, after the credentials, so that a `?` in a
/// password is not taken for it.
fn split_url(parts: &UrlParts<'_>, url: &str) -> (String, Given) {
    let mut given = Given::default();
    let Some(query) = parts.query else {
        return (url.to_owned(), given);
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            !given.take(&percent_decode(key), percent_decode(value))
        })
        .collect();
    let base = &url[..url.len() - query.len() - 1];
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (rest, given)
}

/// `host=… sslmode=… sslrootcert='/a path'`: the pairs of ours are cut out; everything else is
/// left exactly as written for tokio-postgres to parse (and to reject, if it is malformed).
fn split_key_values(conn: &str) -> (String, Given) {
    let mut given = Given::default();
    let Some(pairs) = key_values(conn) else {
        // Not key-value syntax after all: leave it all to tokio-postgres's error.
        return (conn.to_owned(), given);
    };
    let mut rest = String::with_capacity(conn.len());
    let mut kept_from = 0;
    for pair in pairs {
        if given.take(&pair.key, pair.value) {
            rest.push_str(&conn[kept_from..pair.span.start]);
            kept_from = pair.span.end;
        }
    }
    rest.push_str(&conn[kept_from..]);
    (rest.trim().to_owned(), given)
}

/// `prefer` and `require`: encrypted, but any certificate is accepted — libpq's meaning, which
/// protects against eavesdropping but not against an impostor. The handshake's signatures are
/// still checked, so the peer holds the key of the certificate it showed: with the key taken out
/// of the certificate here, not by webpki, which refuses certificates libpq takes — the X.509 v1
/// self-signed certificates that Citus gives its nodes (`UnsupportedCertVersion`).
#[derive(Debug)]
struct EncryptOnly(Arc<CryptoProvider>);

impl EncryptOnly {
    /// The public key of `cert`, as its DER `SubjectPublicKeyInfo`, whatever its version and
    /// extensions.
    fn key_of(cert: &CertificateDer<'_>) -> Result<Vec<u8>, rustls::Error> {
        use x509_cert::der::{Decode as _, Encode as _};
        let unreadable = |_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding);
        let cert = x509_cert::Certificate::from_der(cert.as_ref()).map_err(unreadable)?;
        cert.tbs_certificate
            .subject_public_key_info
            .to_der()
            .map_err(unreadable)
    }
}

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    /// TLS 1.2 names a signature scheme that may map to several algorithms: the signature is
    /// valid when one of them, given the certificate's key, accepts it.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        use x509_cert::der::Decode as _;
        use x509_cert::spki::SubjectPublicKeyInfoOwned;
        let der = Self::key_of(cert)?;
        let spki = SubjectPublicKeyInfoOwned::from_der(&der)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        let key = spki.subject_public_key.raw_bytes();
        let candidates = self
            .0
            .signature_verification_algorithms
            .mapping
            .iter()
            .find(|(scheme, _)| *scheme == dss.scheme)
            .map(|(_, algorithms)| *algorithms)
            .ok_or(rustls::Error::PeerMisbehaved(
                rustls::PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme,
            ))?;
        if candidates
            .iter()
            .any(|alg| alg.verify_signature(key, message, dss.signature()).is_ok())
        {
            Ok(HandshakeSignatureValid::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::BadSignature,
            ))
        }
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let key = Self::key_of(cert)?;
        rustls::crypto::verify_tls13_signature_with_raw_key(
            message,
            &rustls::pki_types::SubjectPublicKeyInfoDer::from(key.as_slice()),
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain is checked as for `verify-full`, the host name is not. webpki checks
/// the chain before the name, so a name mismatch is the only failure to forgive.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The settings in words, for an error about a connection that failed: tokio-postgres's own
/// ("error performing TLS handshake: invalid peer certificate: UnknownIssuer", or the server's
/// "no pg_hba.conf entry … no encryption") then says what was tried.
pub(super) fn describe(settings: &TlsSettings) -> String {
    match (&settings.mode, &settings.roots) {
        (SslMode::VerifyCa | SslMode::VerifyFull, RootCerts::File(path)) => format!(
            "sslmode={}, sslrootcert={}",
            settings.mode.as_str(),
            path.display()
        ),
        (SslMode::VerifyCa | SslMode::VerifyFull, RootCerts::System) => {
            format!("sslmode={}, system roots", settings.mode.as_str())
        }
        (mode, _) => format!("sslmode={}", mode.as_str()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn split_ok(conn: &str, env: impl Fn(&str) -> Option<String>) -> (String, TlsSettings) {
        split(conn, env).unwrap()
    }

    #[test]
    fn a_url_without_tls_parameters_prefers_tls_without_verifying() {
        let (rest, tls) = split_ok("postgres://u@db.example/app", no_env);
        assert_eq!(rest, "postgres://u@db.example/app");
        assert_eq!(tls.mode, SslMode::Prefer);
    }

    #[test]
    fn url_parameters_are_taken_out_and_the_rest_kept_in_order() {
        let (rest, tls) = split_ok(
            "postgresql://u:p@h1:5432,h2:5433/app?application_name=x&sslmode=verify-full\
             &sslrootcert=%2Fetc%2Fca%20dir%2Fca.pem&target_session_attrs=read-write",
            no_env,
        );
        assert_eq!(
            rest,
            "postgresql://u:p@h1:5432,h2:5433/app?application_name=x&target_session_attrs=read-write"
        );
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.roots, RootCerts::File("/etc/ca dir/ca.pem".into()));
        let config: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(config.get_hosts().len(), 2);
        assert_eq!(
            config.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
    }

    #[test]
    fn a_question_mark_in_the_password_is_not_the_query() {
        let (rest, tls) = split_ok("postgres://u:p?w@h/app?sslmode=require", no_env);
        assert_eq!(rest, "postgres://u:p?w@h/app");
        assert_eq!(tls.mode, SslMode::Require);
        let config: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(config.get_password(), Some(&b"p?w"[..]));
    }

    #[test]
    fn only_tls_parameters_leave_no_query() {
        let (rest, tls) = split_ok("postgres://h/app?sslmode=require", no_env);
        assert_eq!(rest, "postgres://h/app");
        assert_eq!(tls.mode, SslMode::Require);
        assert_eq!(tls.driver_mode(), tokio_postgres::config::SslMode::Require);
    }

    #[test]
    fn key_values_are_taken_out_quoted_or_not() {
        let (rest, tls) = split_ok(
            r"host=h port=5432 sslmode = verify-ca  sslrootcert='/a b/it\'s.pem' dbname=app",
            no_env,
        );
        let words: Vec<&str> = rest.split_whitespace().collect();
        assert_eq!(words, ["host=h", "port=5432", "dbname=app"]);
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(tls.roots, RootCerts::File("/a b/it's.pem".into()));
        let config: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(config.get_dbname(), Some("app"));
    }

    #[test]
    fn the_environment_fills_in_what_the_string_does_not_say() {
        let env = |name: &str| match name {
            "PGSSLMODE" => Some("verify-full".to_owned()),
            "PGSSLROOTCERT" => Some("/ca/ca.pem".to_owned()),
            _ => None,
        };
        let (_, tls) = split_ok("postgres://h/app", env);
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.roots, RootCerts::File("/ca/ca.pem".into()));

        let (_, tls) = split_ok("postgres://h/app?sslmode=disable", env);
        assert_eq!(tls.mode, SslMode::Disable, "the string wins over PGSSLMODE");
        assert_eq!(tls.roots, RootCerts::File("/ca/ca.pem".into()));

        let (_, tls) = split_ok("host=h sslrootcert=/mine.pem", env);
        assert_eq!(tls.roots, RootCerts::File("/mine.pem".into()));
    }

    #[test]
    fn require_with_a_root_certificate_verifies_the_chain_as_libpq_does() {
        let (_, tls) = split_ok(
            "postgres://h/app?sslmode=require&sslrootcert=/ca.pem",
            no_env,
        );
        assert_eq!(tls.mode, SslMode::VerifyCa);
        let env = |name: &str| (name == "PGSSLROOTCERT").then(|| "/ca.pem".to_owned());
        let (_, tls) = split_ok("postgres://h/app?sslmode=require", env);
        assert_eq!(tls.mode, SslMode::VerifyCa);
        let (_, tls) = split_ok("postgres://h/app?sslrootcert=/ca.pem", no_env);
        assert_eq!(tls.mode, SslMode::Prefer, "only require is upgraded");
    }

    #[test]
    fn system_roots_mean_verify_full() {
        let (_, tls) = split_ok("postgres://h/app?sslrootcert=system", no_env);
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.roots, RootCerts::System);
        let weak = split(
            "postgres://h/app?sslrootcert=system&sslmode=require",
            no_env,
        );
        assert!(weak.unwrap_err().to_string().contains("verify-full"));
    }

    #[test]
    fn an_unknown_mode_is_refused_by_name() {
        let err = split("postgres://h/app?sslmode=verify", no_env).unwrap_err();
        assert!(err.to_string().contains("sslmode `verify`"), "{err}");
        let err = split("host=h", |_| Some("bogus".to_owned())).unwrap_err();
        assert!(err.to_string().contains("sslmode `bogus`"), "{err}");
    }

    #[test]
    fn a_missing_root_certificate_file_is_named() {
        let (_, tls) = split_ok(
            "postgres://h/app?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            no_env,
        );
        let err = tls.connector().err().unwrap();
        assert!(
            format!("{err:#}").contains("/nonexistent/ca.pem"),
            "{err:#}"
        );
    }
}
