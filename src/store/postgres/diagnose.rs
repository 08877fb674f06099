//! Why a connection to PostgreSQL failed, in words that name the host and port and the fix.
//!
//! The driver's own errors ("error connecting to server", "error communicating with the server",
//! "db error") say which step failed, not what to change. So a failed connection is sorted here by
//! what it is — the server's SQLSTATE, the kind of the I/O error underneath, the TLS library's
//! error, whether the host name resolves — never by message text, which PostgreSQL translates
//! (`lc_messages`) and drivers reword.

use std::net::IpAddr;
use std::time::Duration;

use tokio_postgres::config::Host;
use tokio_postgres::error::SqlState;

use super::tls::{self, SslMode, TlsSettings};

/// Why no connection could be made, naming where to and what to check.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Nothing listens at the address.
    #[error(
        "connection to {at} refused: is PostgreSQL running and listening there? (check the \
         database URL's host and port, and the server's listen_addresses and port)"
    )]
    Refused {
        /// `host:port`, each of them when the URL names several.
        at: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The host name does not resolve.
    #[error(
        "cannot resolve the database host `{host}`: check the host name in the database URL \
         (and that this machine's DNS knows it)"
    )]
    UnknownHost {
        /// The name.
        host: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// The TCP connection was not answered in time.
    #[error(
        "no answer from {at} within {timeout:?}: is the host right, and is a firewall dropping \
         the connection?"
    )]
    TimedOut {
        /// `host:port`.
        at: String,
        /// The connect timeout.
        timeout: Duration,
    },
    /// The network says the address cannot be reached.
    #[error("cannot reach {at}: {source}")]
    Unreachable {
        /// `host:port`.
        at: String,
        /// The network's error.
        source: std::io::Error,
    },
    /// Something answered, but not as PostgreSQL does: an HTTP server, SSH, a proxy without a
    /// backend.
    #[error(
        "{at} accepted the connection but does not speak PostgreSQL (it answered the startup \
         message with something else, or closed the connection): is that PostgreSQL's port? \
         (its default is 5432)"
    )]
    NotPostgres {
        /// `host:port`.
        at: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server's certificate was refused.
    #[error(
        "the TLS handshake with PostgreSQL at {at} failed ({tried}): the server's certificate {problem}"
    )]
    Certificate {
        /// `host:port`.
        at: String,
        /// The TLS settings in effect.
        tried: String,
        /// What is wrong with the certificate, and what to do.
        problem: String,
    },
    /// TLS failed otherwise.
    #[error("the TLS handshake with PostgreSQL at {at} failed ({tried})")]
    Tls {
        /// `host:port`.
        at: String,
        /// The TLS settings in effect.
        tried: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// 28P01: the password is wrong (or the user does not exist, which PostgreSQL does not tell
    /// apart under password authentication).
    #[error(
        "password authentication failed for user `{user}` at {at} (SQLSTATE 28P01): check the \
         password (in --database-password-file, or percent-encoded in the URL) and the user name"
    )]
    WrongPassword {
        /// `host:port`.
        at: String,
        /// The user name.
        user: String,
    },
    /// The server asks for a password and none was given.
    #[error(
        "PostgreSQL at {at} asks user `{user}` for a password and none was given: put it in \
         --database-password-file (TURNSTILE_DATABASE_PASSWORD_FILE), or percent-encoded in the \
         URL"
    )]
    PasswordMissing {
        /// `host:port`.
        at: String,
        /// The user name.
        user: String,
    },
    /// 28000: the role does not exist, or `pg_hba.conf` has no entry that lets it in.
    #[error(
        "PostgreSQL at {at} does not let user `{user}` connect ({tried}): {message} (SQLSTATE \
         28000: the role does not exist, or pg_hba.conf has no entry for this host, user, \
         database and encryption)"
    )]
    NotAuthorized {
        /// `host:port`.
        at: String,
        /// The user name.
        user: String,
        /// The TLS settings in effect (`pg_hba.conf` tells `host`, `hostssl` and `hostnossl`
        /// apart).
        tried: String,
        /// The server's message.
        message: String,
    },
    /// 3D000: no such database.
    #[error(
        "database `{database}` does not exist on PostgreSQL at {at} (SQLSTATE 3D000): create it \
         (`createdb {database}`) or fix the database name in the URL"
    )]
    UnknownDatabase {
        /// `host:port`.
        at: String,
        /// The database name.
        database: String,
    },
    /// Any other refusal by the server (too many connections, starting up).
    #[error("PostgreSQL at {at} refused the connection: {message} (SQLSTATE {code})")]
    Server {
        /// `host:port`.
        at: String,
        /// The SQLSTATE.
        code: String,
        /// The server's message.
        message: String,
    },
    /// The connection was made, but the server never finished the startup.
    #[error(
        "no PostgreSQL answer from {at} within {timeout:?} ({tried}): is that PostgreSQL's port, \
         or is a TLS handshake stuck?"
    )]
    NoAnswer {
        /// `host:port`.
        at: String,
        /// The TLS settings in effect.
        tried: String,
        /// How long it was given.
        timeout: Duration,
    },
    /// Anything else.
    #[error("connecting to PostgreSQL at {at} failed ({tried})")]
    Other {
        /// `host:port`.
        at: String,
        /// The TLS settings in effect.
        tried: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
}

/// Where a connection goes and as whom, for the words of a [`ConnectError`]. Holds no password.
#[derive(Debug, Clone)]
pub(super) struct Target {
    /// Every `host:port` tried, comma-separated.
    at: String,
    user: String,
    database: String,
    /// The TLS settings in words.
    tried: String,
    /// Whether TLS is required (a server without it then fails the handshake, not the login).
    tls_required: bool,
    /// Host names (not addresses) to resolve when the connection failed without a cause found.
    names: Vec<(String, u16)>,
    has_password: bool,
    connect_timeout: Option<Duration>,
}

impl Target {
    /// The target `config` (with `tls`) describes.
    pub(super) fn of(config: &tokio_postgres::Config, tls: &TlsSettings) -> Self {
        let hosts = config.get_hosts();
        let addrs = config.get_hostaddrs();
        let ports = config.get_ports();
        let mut at = Vec::new();
        let mut names = Vec::new();
        for i in 0..hosts.len().max(addrs.len()) {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            let address = |a: &IpAddr| match a {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            };
            at.push(match (hosts.get(i), addrs.get(i)) {
                (Some(Host::Tcp(name)), Some(addr)) => {
                    format!("{name} ({}):{port}", address(addr))
                }
                (Some(Host::Tcp(name)), None) => {
                    if name.parse::<IpAddr>().is_err() {
                        names.push((name.clone(), port));
                    }
                    if name.contains(':') {
                        format!("[{name}]:{port}")
                    } else {
                        format!("{name}:{port}")
                    }
                }
                #[cfg(unix)]
                (Some(Host::Unix(dir)), _) => format!("{}/.s.PGSQL.{port}", dir.display()),
                (None, Some(addr)) => format!("{}:{port}", address(addr)),
                _ => continue,
            });
        }
        let user = config
            .get_user()
            .map_or_else(|| "(this process's OS user)".to_owned(), str::to_owned);
        Self {
            at: at.join(", "),
            database: config
                .get_dbname()
                .map_or_else(|| user.clone(), str::to_owned),
            user,
            tried: tls::describe(tls),
            tls_required: matches!(
                tls.mode,
                SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
            ),
            names,
            has_password: config.get_password().is_some(),
            connect_timeout: config.get_connect_timeout().copied(),
        }
    }

    /// The error for a startup that did not finish within `timeout`.
    pub(super) fn no_answer(&self, timeout: Duration) -> ConnectError {
        ConnectError::NoAnswer {
            at: self.at.clone(),
            tried: self.tried.clone(),
            timeout,
        }
    }

    /// What `e`, the error of a connection attempt to this target, means. Resolves the host
    /// names when nothing else explains it.
    pub(super) async fn diagnose(&self, e: tokio_postgres::Error) -> ConnectError {
        let at = self.at.clone();
        if let Some(db) = e.as_db_error() {
            return self.refused_by_server(db);
        }
        if let Some(tls_error) = rustls_error(&e) {
            return match tls_error {
                // The peer's bytes are no TLS record: it took the SSLRequest's answer byte from
                // something that is not PostgreSQL (an SSH banner starts with `S`).
                rustls::Error::InvalidMessage(_) => ConnectError::NotPostgres { at, source: e },
                rustls::Error::InvalidCertificate(problem) => ConnectError::Certificate {
                    at,
                    tried: self.tried.clone(),
                    problem: certificate_problem(problem),
                },
                _ => ConnectError::Tls {
                    at,
                    tried: self.tried.clone(),
                    source: e,
                },
            };
        }
        let kind = io_error(&e).map(std::io::Error::kind);
        let e = match kind {
            Some(kind) => match self.io_failure(kind, e) {
                Ok(found) => return found,
                Err(e) => e,
            },
            None => e,
        };
        if e.is_closed() {
            return ConnectError::NotPostgres { at, source: e };
        }
        if kind.is_some() {
            // An I/O error of no kind above: a failed name lookup has none of its own.
            for (name, port) in &self.names {
                if let Err(source) = tokio::net::lookup_host((name.as_str(), *port)).await {
                    return ConnectError::UnknownHost {
                        host: name.clone(),
                        source,
                    };
                }
            }
        } else if std::error::Error::source(&e).is_some()
            && !self.has_password
            && !self.tls_required
        {
            // No server error, no I/O error, no TLS error: the driver's own refusal to go on,
            // which after a successful connection is its "password missing" — the server asked
            // for one. (With TLS required, a server without TLS fails the same way.)
            return ConnectError::PasswordMissing {
                at,
                user: self.user.clone(),
            };
        }
        ConnectError::Other {
            at,
            tried: self.tried.clone(),
            source: e,
        }
    }

    /// The server answered, and refused: by its SQLSTATE.
    fn refused_by_server(&self, db: &tokio_postgres::error::DbError) -> ConnectError {
        let at = self.at.clone();
        let code = db.code();
        if *code == SqlState::INVALID_PASSWORD {
            ConnectError::WrongPassword {
                at,
                user: self.user.clone(),
            }
        } else if *code == SqlState::INVALID_AUTHORIZATION_SPECIFICATION {
            ConnectError::NotAuthorized {
                at,
                user: self.user.clone(),
                tried: self.tried.clone(),
                message: db.message().to_owned(),
            }
        } else if *code == SqlState::INVALID_CATALOG_NAME {
            ConnectError::UnknownDatabase {
                at,
                database: self.database.clone(),
            }
        } else {
            ConnectError::Server {
                at,
                code: code.code().to_owned(),
                message: db.message().to_owned(),
            }
        }
    }

    /// An I/O error of a `kind` that says what happened, or `e` back when its kind does not.
    fn io_failure(
        &self,
        kind: std::io::ErrorKind,
        e: tokio_postgres::Error,
    ) -> Result<ConnectError, tokio_postgres::Error> {
        use std::io::ErrorKind;
        let at = self.at.clone();
        Ok(match kind {
            ErrorKind::ConnectionRefused => ConnectError::Refused { at, source: e },
            ErrorKind::TimedOut => ConnectError::TimedOut {
                at,
                timeout: self.connect_timeout.unwrap_or_default(),
            },
            ErrorKind::HostUnreachable
            | ErrorKind::NetworkUnreachable
            | ErrorKind::NetworkDown
            | ErrorKind::AddrNotAvailable => {
                let source = io_error(&e).map_or_else(
                    || std::io::Error::other("unreachable"),
                    |io| std::io::Error::new(io.kind(), io.to_string()),
                );
                ConnectError::Unreachable { at, source }
            }
            // Garbage where PostgreSQL's messages should be, or the connection closed before the
            // server said anything.
            ErrorKind::UnexpectedEof
            | ErrorKind::InvalidData
            | ErrorKind::InvalidInput
            | ErrorKind::Other
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => ConnectError::NotPostgres { at, source: e },
            _ => return Err(e),
        })
    }
}

/// What is wrong with a refused certificate, and what to do about it.
fn certificate_problem(problem: &rustls::CertificateError) -> String {
    use rustls::CertificateError as C;
    match problem {
        C::UnknownIssuer => "is not signed by a CA this client trusts: set sslrootcert to the \
                             PEM file of the CA that signed it"
            .to_owned(),
        C::NotValidForName | C::NotValidForNameContext { .. } => {
            "does not name the host connected to: connect by a name the certificate holds, or use \
             sslmode=verify-ca to check the chain only"
                .to_owned()
        }
        C::Expired | C::ExpiredContext { .. } => "has expired".to_owned(),
        C::NotValidYet | C::NotValidYetContext { .. } => {
            "is not valid yet (check both machines' clocks)".to_owned()
        }
        other => format!("was refused: {other:?}"),
    }
}

/// The first I/O error in `e`'s chain of sources.
pub(super) fn io_error(e: &tokio_postgres::Error) -> Option<&std::io::Error> {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        source = cause.source();
    }
    None
}

/// The TLS library's error in `e`'s chain, also where an I/O error carries it (tokio-rustls
/// wraps it so).
fn rustls_error(e: &tokio_postgres::Error) -> Option<&rustls::Error> {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(tls) = cause.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(tls) = cause
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(tls);
        }
        source = cause.source();
    }
    None
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::str::FromStr as _;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    fn target(conn: &str) -> (tokio_postgres::Config, Target) {
        let (config, tls) = super::super::url::parse_with(conn, |_| None).unwrap();
        let target = Target::of(&config, &tls);
        (config, target)
    }

    /// Connects as the server would (TLS preferred, rustls), and diagnoses the failure.
    async fn diagnose(conn: &str) -> ConnectError {
        let (mut config, target) = target(conn);
        config.ssl_mode(tokio_postgres::config::SslMode::Prefer);
        let tls = tls::split(conn, |_| None).unwrap().1.connector().unwrap();
        let Err(e) = config.connect(tls).await else {
            panic!("{conn} connected");
        };
        target.diagnose(e).await
    }

    /// A port on 127.0.0.1 where `greeting` is written to every connection (after reading
    /// what the client sends first, when `listen_first`), and the connection then closed.
    async fn impostor(greeting: &'static [u8], listen_first: bool) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if listen_first {
                        let _ = stream.read(&mut [0; 64]).await;
                    }
                    let _ = stream.write_all(greeting).await;
                });
            }
        });
        port
    }

    #[test]
    fn the_target_names_every_host_and_port() {
        let (_, t) = target("postgres://app@db1,db2:6432,[::1]:7/x");
        assert_eq!(t.at, "db1:5432, db2:6432, [::1]:7");
        assert_eq!(t.names, [("db1".into(), 5432), ("db2".into(), 6432)]);
        let (_, t) = target("host=db.invalid hostaddr=127.0.0.1 port=6 user=u");
        assert_eq!(t.at, "db.invalid (127.0.0.1):6");
        assert_eq!((t.user.as_str(), t.database.as_str()), ("u", "u"));
        let (_, t) = target("host=/run/postgresql dbname=x");
        assert_eq!(t.at, "/run/postgresql/.s.PGSQL.5432");
    }

    #[tokio::test]
    async fn a_closed_port_is_refused_naming_it() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = diagnose(&format!("postgres://app@127.0.0.1:{port}/x")).await;
        assert!(matches!(e, ConnectError::Refused { .. }), "{e:?}");
        assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    }

    #[tokio::test]
    async fn an_unknown_host_is_named() {
        let e = diagnose("postgres://app@db-host.invalid/x").await;
        let ConnectError::UnknownHost { host, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(host, "db-host.invalid");
    }

    #[tokio::test]
    async fn http_ssh_and_silent_closes_are_not_postgres() {
        let http = impostor(
            b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n",
            true,
        )
        .await;
        let ssh = impostor(b"SSH-2.0-OpenSSH_9.2p1\r\n", false).await;
        let silent = impostor(b"", true).await;
        for port in [http, ssh, silent] {
            for mode in ["prefer", "disable"] {
                let e = diagnose(&format!(
                    "postgres://app@127.0.0.1:{port}/x?sslmode={mode}&connect_timeout=5"
                ))
                .await;
                assert!(
                    matches!(e, ConnectError::NotPostgres { .. }),
                    "port {port}, {mode}: {e:?}"
                );
            }
        }
    }

    #[test]
    fn certificate_problems_say_what_to_do() {
        let unknown = certificate_problem(&rustls::CertificateError::UnknownIssuer);
        assert!(unknown.contains("sslrootcert"), "{unknown}");
        let name = certificate_problem(&rustls::CertificateError::NotValidForName);
        assert!(name.contains("verify-ca"), "{name}");
    }

    #[test]
    fn a_config_error_is_not_taken_for_an_io_error() {
        let e = tokio_postgres::Config::from_str("port=x").unwrap_err();
        assert!(io_error(&e).is_none());
        assert!(rustls_error(&e).is_none());
    }
}
