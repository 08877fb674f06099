//! The database URL, parsed once at the start into what connecting takes, with errors that name
//! the part that is wrong and the fix.
//!
//! tokio-postgres accepts both of libpq's forms, `postgres://user:password@host:port/dbname?k=v`
//! and `host=… port=… user=…`, and its errors stop at "invalid connection string" or "unknown
//! option". Some mistakes it even accepts, to fail later pointing elsewhere: an unencoded `@` in
//! a password makes the rest of the password part of the host name (then a DNS error for
//! `ss@db-host`), and `postgress://…` is read as key-value syntax. So the common mistakes are
//! caught here first, by name, and the rest is left to tokio-postgres. No error repeats the
//! string: it may hold a password. For the same reason [`DatabaseUrl`] keeps it in a
//! [`SecretString`], whose `Debug` shows `[REDACTED]`, and only [`DatabaseUrl::parse`] reads it.

use std::ops::Range;
use std::path::PathBuf;
use std::str::FromStr as _;

use secrecy::{ExposeSecret as _, SecretString};

use super::tls::{self, TlsSettings};

/// A PostgreSQL connection string (a URL or libpq's key-value form) as given on the command line
/// or in the environment, and where to read its password from when it has none. It may hold a
/// password: never printed.
#[derive(Debug, Clone)]
pub struct DatabaseUrl {
    text: SecretString,
    password_file: Option<PathBuf>,
    schema: Schema,
}

/// The PostgreSQL schema that holds Turnstile's tables (`--database-schema`, default
/// `turnstile`): a plain identifier, so that it goes into SQL as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema(String);

impl Schema {
    /// The schema's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `name` as a schema: lower-case letters, digits and `_`, not starting with a digit, at
    /// most 63 bytes (PostgreSQL's limit), and not one of PostgreSQL's own (`pg_…`,
    /// `information_schema`).
    ///
    /// # Errors
    /// A message saying what is wrong with the name.
    pub fn parse(name: &str) -> Result<Self, String> {
        let valid = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if !valid {
            return Err(format!(
                "`{name}` is not a plain schema name: lower-case letters, digits and `_`, \
                 not starting with a digit, at most 63 characters"
            ));
        }
        if name.starts_with("pg_") || name == "information_schema" {
            return Err(format!("`{name}` is PostgreSQL's own schema"));
        }
        Ok(Self(name.to_owned()))
    }
}

impl Default for Schema {
    fn default() -> Self {
        Self("turnstile".to_owned())
    }
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl DatabaseUrl {
    /// Wraps a connection string as given; [`DatabaseUrl::parse`] says what is wrong with it.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            text: SecretString::from(url.into()),
            password_file: None,
            schema: Schema::default(),
        }
    }

    /// This URL, its tables in `schema` (the default: `turnstile`).
    #[must_use]
    pub fn with_schema(self, schema: Schema) -> Self {
        Self { schema, ..self }
    }

    /// The schema of Turnstile's tables.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// This URL with its password read from `path` when the URL has none (as libpq's password
    /// file: a password in the URL wins). A Kubernetes Secret mounted as a file keeps the
    /// password off the command line, which `ps` shows, and out of the environment.
    #[must_use]
    pub fn with_password_file(self, path: Option<PathBuf>) -> Self {
        Self {
            password_file: path,
            ..self
        }
    }

    /// Parses the connection string: the driver's configuration, with the TLS settings (libpq's
    /// `sslmode` and `sslrootcert`, from the string or else from `PGSSLMODE` and
    /// `PGSSLROOTCERT`) taken out, and the password from the password file when the string has
    /// none.
    ///
    /// # Errors
    /// [`UrlError`], naming what is wrong without repeating the string.
    pub fn parse(&self) -> Result<ParsedUrl, UrlError> {
        let (mut config, tls) =
            parse_with(self.text.expose_secret(), |name| std::env::var(name).ok())?;
        if let Some(path) = &self.password_file
            && config.get_password().is_none()
        {
            config.password(read_password(path)?);
        }
        Ok(ParsedUrl { config, tls })
    }
}

/// A connection string taken apart: what tokio-postgres connects with, and the TLS settings it
/// does not know.
#[derive(Debug)]
pub struct ParsedUrl {
    /// The driver's configuration, TLS mode not yet set.
    pub config: tokio_postgres::Config,
    /// libpq's `sslmode` and `sslrootcert`, as given or from the environment.
    pub tls: TlsSettings,
}

/// What is wrong with a database URL. None repeats the URL, which may hold a password.
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    /// Nothing, or only spaces.
    #[error(
        "the database URL (--database-url, DATABASE_URL) is empty: give one like \
         postgres://USER@HOST:5432/DATABASE, with the password in --database-password-file"
    )]
    Empty,
    /// A URL whose scheme is not `postgres` or `postgresql`.
    #[error("the database URL's scheme `{scheme}://` is not PostgreSQL's: {}", scheme_hint(.scheme))]
    UnknownScheme {
        /// What came before `://`.
        scheme: String,
    },
    /// Neither a URL nor `key=value` pairs.
    #[error(
        "the database URL is neither a URL (postgres://USER@HOST:5432/DATABASE) nor libpq's \
         key=value pairs (host=HOST port=5432 user=USER dbname=DATABASE)"
    )]
    Unrecognized,
    /// More than one `@` before the host: a password with an `@` in it, not percent-encoded.
    #[error(
        "the database URL has more than one `@` before its host: an `@` in the user name or \
         password must be percent-encoded as %40 (postgres://user:p%40ss@host/db), or put the \
         password in --database-password-file"
    )]
    UnencodedAt,
    /// A port that is not a number.
    #[error("the database URL's port `{port}` is not a number from 0 to 65535")]
    InvalidPort {
        /// The port as written (a port is no secret).
        port: String,
    },
    /// A parameter neither libpq nor Turnstile knows.
    #[error("the database URL has an unknown parameter `{name}`: {}", parameter_hint(.suggestion))]
    UnknownParameter {
        /// The parameter's name (its value is not repeated: it could be a password).
        name: String,
        /// The known parameter it most likely means.
        suggestion: Option<&'static str>,
    },
    /// No host and no `hostaddr`.
    #[error(
        "the database URL names no host: postgres://USER@HOST:5432/DATABASE (or host=HOST in \
         key=value form)"
    )]
    NoHost,
    /// `sslmode` or `sslrootcert` (or `PGSSLMODE`, `PGSSLROOTCERT`) is not valid.
    #[error("the database URL's TLS settings are not valid: {0}")]
    Tls(String),
    /// The TLS settings are valid but cannot be put to use (an unreadable `sslrootcert`).
    #[error("TLS to PostgreSQL cannot be set up: {0}")]
    TlsSetup(String),
    /// Anything else tokio-postgres refuses, in its words (which never repeat values).
    #[error("the database URL is not valid: {0}")]
    Invalid(String),
    /// The password file cannot be read.
    #[error("reading the database password file {} failed", .path.display())]
    PasswordFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The password file holds nothing.
    #[error("the database password file {} is empty", .path.display())]
    EmptyPasswordFile {
        /// The file.
        path: PathBuf,
    },
}

/// Every parameter a connection string may carry: tokio-postgres's, and the TLS ones Turnstile
/// takes out first (`sslrootcert`; `sslmode` with libpq's `verify-ca` and `verify-full`).
const PARAMETERS: &[&str] = &[
    "user",
    "password",
    "dbname",
    "host",
    "hostaddr",
    "port",
    "sslmode",
    "sslrootcert",
    "sslnegotiation",
    "options",
    "application_name",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
];

/// Names other drivers and habits use for a parameter, and the parameter.
const ALIASES: &[(&str, &str)] = &[
    ("ssl", "sslmode"),
    ("tls", "sslmode"),
    ("sslca", "sslrootcert"),
    ("database", "dbname"),
    ("db", "dbname"),
    ("username", "user"),
    ("pass", "password"),
    ("pwd", "password"),
    ("timeout", "connect_timeout"),
    ("connectiontimeout", "connect_timeout"),
    ("appname", "application_name"),
];

fn scheme_hint(scheme: &str) -> String {
    let lower = scheme.to_ascii_lowercase();
    if let Some(rest) = lower.strip_prefix("jdbc:")
        && rest.starts_with("postgres")
    {
        return "drop the JDBC prefix `jdbc:` (postgres://…)".to_owned();
    }
    if let Some((base, driver)) = lower.split_once('+')
        && base.starts_with("postgres")
    {
        return format!("drop SQLAlchemy's driver suffix `+{driver}` (postgres://…)");
    }
    let close = ["postgres", "postgresql"]
        .iter()
        .any(|known| distance(&lower, known) <= 3)
        || lower.starts_with("postgres")
        || ["pg", "pgsql", "psql"].contains(&lower.as_str());
    if close {
        "did you mean postgres:// or postgresql://?".to_owned()
    } else {
        "use postgres:// or postgresql://".to_owned()
    }
}

fn parameter_hint(suggestion: &Option<&'static str>) -> String {
    match *suggestion {
        Some("sslmode") => "did you mean `sslmode`? (disable, prefer, require, verify-ca or \
                            verify-full; sslmode=require to insist on TLS)"
            .to_owned(),
        Some(known) => format!("did you mean `{known}`?"),
        None => format!("the known ones are {}", PARAMETERS.join(", ")),
    }
}

/// The known parameter `name` most likely means: the same name spelled another way
/// (`applicationName`, `ssl_mode`), a habit of another driver (`ssl`, `database`), or a typo.
fn suggest(name: &str) -> Option<&'static str> {
    let squash = |s: &str| -> String {
        s.chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect()
    };
    let wanted = squash(name);
    if let Some(known) = PARAMETERS.iter().find(|p| squash(p) == wanted) {
        return Some(known);
    }
    if let Some((_, known)) = ALIASES.iter().find(|(alias, _)| *alias == wanted) {
        return Some(known);
    }
    PARAMETERS
        .iter()
        .map(|p| (distance(&wanted, &squash(p)), *p))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, p)| p)
}

/// Edit distance (insertions, deletions, substitutions and swaps of neighbours) between two
/// short ASCII names.
fn distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = d;
        }
    }
    rows[a.len()][b.len()]
}

/// [`DatabaseUrl::parse`] without the password file, with the environment looked up by `env`.
pub(super) fn parse_with(
    text: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(tokio_postgres::Config, TlsSettings), UrlError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(UrlError::Empty);
    }
    let names: Vec<String> = match Form::of(text)? {
        Form::Url(parts) => {
            if parts.host.contains('@') {
                return Err(UrlError::UnencodedAt);
            }
            check_ports(parts.host)?;
            parts.params().into_iter().map(|(key, _)| key).collect()
        }
        Form::KeyValues(pairs) => pairs.into_iter().map(|pair| pair.key).collect(),
    };
    if let Some(name) = names.iter().find(|n| !PARAMETERS.contains(&n.as_str())) {
        return Err(UrlError::UnknownParameter {
            suggestion: suggest(name),
            name: name.clone(),
        });
    }
    let (rest, settings) = tls::split(text, env).map_err(|e| UrlError::Tls(format!("{e:#}")))?;
    let config = tokio_postgres::Config::from_str(&rest).map_err(|e| {
        let mut text = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        UrlError::Invalid(text)
    })?;
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        return Err(UrlError::NoHost);
    }
    Ok((config, settings))
}

/// Each host's port in a URL's host list (`h1:5432,[::1]:5433`) is empty or a number.
fn check_ports(hosts: &str) -> Result<(), UrlError> {
    for chunk in hosts.split(',') {
        let port = match chunk.strip_prefix('[') {
            Some(bracketed) => bracketed
                .split_once(']')
                .and_then(|(_, rest)| rest.strip_prefix(':')),
            None => chunk.split_once(':').map(|(_, port)| port),
        };
        if let Some(port) = port {
            let decoded = percent_decode(port);
            if !decoded.is_empty() && decoded.parse::<u16>().is_err() {
                return Err(UrlError::InvalidPort { port: decoded });
            }
        }
    }
    Ok(())
}

/// Which of libpq's two forms a connection string is written in.
enum Form<'a> {
    Url(UrlParts<'a>),
    KeyValues(Vec<Pair>),
}

impl<'a> Form<'a> {
    /// # Errors
    /// [`UrlError::UnknownScheme`] for `something://…`, [`UrlError::Unrecognized`] for text that
    /// is no `key=value` list either.
    fn of(text: &'a str) -> Result<Self, UrlError> {
        if let Some(parts) = UrlParts::of(text) {
            return Ok(Self::Url(parts));
        }
        if let Some((scheme, _)) = text.split_once("://")
            && !scheme.is_empty()
            && !scheme.contains(|c: char| c == '=' || c.is_whitespace())
        {
            return Err(UrlError::UnknownScheme {
                scheme: scheme.to_owned(),
            });
        }
        key_values(text)
            .map(Self::KeyValues)
            .ok_or(UrlError::Unrecognized)
    }
}

/// A `postgres://` URL cut where tokio-postgres cuts it: the credentials run to the first `@`
/// (wherever it is), the hosts from there to the first `/` or `?`, the database name to the
/// first `?`, and the rest is the query.
pub(super) struct UrlParts<'a> {
    /// The hosts and ports.
    pub host: &'a str,
    /// After the `?`, when there is one.
    pub query: Option<&'a str>,
}

impl<'a> UrlParts<'a> {
    /// `url` taken apart, or `None` if it does not start with `postgres://` or `postgresql://`.
    pub fn of(url: &'a str) -> Option<Self> {
        let after = ["postgres://", "postgresql://"]
            .iter()
            .find_map(|scheme| url.strip_prefix(scheme))?;
        let scheme_len = url.len() - after.len();
        let credentials = after.find('@').map_or(0, |at| at + 1);
        let host_start = scheme_len + credentials;
        let host_end = url[host_start..]
            .find(['/', '?'])
            .map_or(url.len(), |i| host_start + i);
        let query_start = url[host_end..].find('?').map(|i| host_end + i);
        Some(Self {
            host: &url[host_start..host_end],
            query: query_start.map(|q| &url[q + 1..]),
        })
    }

    /// The query's parameters, `&`-separated, names and values percent-decoded.
    pub fn params(&self) -> Vec<(String, String)> {
        self.query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(key), percent_decode(value))
            })
            .collect()
    }
}

/// One `key=value` of libpq's key-value form, and where it stands in the string.
#[derive(Debug)]
pub(super) struct Pair {
    pub key: String,
    pub value: String,
    /// From the key's first character to just after the value.
    pub span: Range<usize>,
}

/// `host=… sslmode = require sslrootcert='/a path'`: libpq's key-value syntax — spaces around
/// `=` allowed, values single-quoted or not, a backslash escaping the next character. `None`
/// when the text is not in that syntax (a key without `=`).
pub(super) fn key_values(conn: &str) -> Option<Vec<Pair>> {
    let mut pairs = Vec::new();
    let mut chars = conn.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = chars.peek() else {
            return Some(pairs);
        };
        let mut key = String::new();
        while let Some((_, c)) = chars.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        chars.next_if(|(_, c)| *c == '=')?;
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match chars.next() {
                    Some((_, '\'')) | None => break,
                    Some((_, '\\')) => value.extend(chars.next().map(|(_, c)| c)),
                    Some((_, c)) => value.push(c),
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next().map(|(_, c)| c));
                } else {
                    value.push(c);
                }
            }
        }
        let end = chars.peek().map_or(conn.len(), |(i, _)| *i);
        pairs.push(Pair {
            key,
            value,
            span: start..end,
        });
    }
}

/// Decodes `%XX` escapes (and leaves a malformed one as written).
pub(super) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The password in `path`: the file's bytes without one trailing line break (`echo` and
/// editors add one; a Kubernetes Secret has none).
fn read_password(path: &std::path::Path) -> Result<Vec<u8>, UrlError> {
    let mut bytes = std::fs::read(path).map_err(|source| UrlError::PasswordFile {
        path: path.to_owned(),
        source,
    })?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    if bytes.is_empty() {
        return Err(UrlError::EmptyPasswordFile {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<tokio_postgres::Config, UrlError> {
        parse_with(text, |_| None).map(|(config, _)| config)
    }

    fn error(text: &str) -> String {
        let e = parse(text).unwrap_err();
        let message = e.to_string();
        assert!(
            !message.contains("s3cret"),
            "the password is never repeated: {message}"
        );
        message
    }

    #[test]
    fn both_forms_parse() {
        let config =
            parse("postgresql://app:s3cret@db-host:6432,db2/turnstile?application_name=x").unwrap();
        assert_eq!(config.get_user(), Some("app"));
        assert_eq!(config.get_password(), Some(&b"s3cret"[..]));
        assert_eq!(config.get_ports(), [6432, 5432]);
        assert_eq!(config.get_dbname(), Some("turnstile"));
        let config =
            parse("host=db-host port=5433 user=app dbname='tu rn' sslmode=require").unwrap();
        assert_eq!(config.get_dbname(), Some("tu rn"));
        assert_eq!(config.get_ports(), [5433]);
        let encoded = parse("postgres://app:p%40ss@db-host/turnstile").unwrap();
        assert_eq!(encoded.get_password(), Some(&b"p@ss"[..]));
        let ipv6 = parse("postgres://app@[::1]:5432/turnstile").unwrap();
        assert_eq!(ipv6.get_ports(), [5432]);
    }

    #[test]
    fn an_empty_url_says_so() {
        for text in ["", "   "] {
            assert!(matches!(parse(text), Err(UrlError::Empty)));
        }
        assert!(error("").contains("empty"));
    }

    #[test]
    fn a_misspelt_scheme_gets_a_did_you_mean() {
        let message = error("postgress://app:s3cret@db-host/turnstile");
        assert!(message.contains("`postgress://`"), "{message}");
        assert!(
            message.contains("did you mean postgres:// or postgresql://?"),
            "{message}"
        );
        assert!(error("mysql://app:s3cret@h/db").contains("use postgres://"));
        assert!(error("jdbc:postgresql://h/db").contains("jdbc:"));
        assert!(error("postgresql+asyncpg://app:s3cret@h/db").contains("+asyncpg"));
    }

    #[test]
    fn an_unencoded_at_in_the_password_says_to_percent_encode_it() {
        for text in [
            "postgres://app:p@ss@db-host/turnstile",
            "postgres://app:s3cret@x@db-host:5432",
            "postgres://app:a/b@c@db-host/turnstile",
        ] {
            assert!(matches!(parse(text), Err(UrlError::UnencodedAt)), "{text}");
        }
        let message = error("postgres://app:s3cret@@db-host/turnstile");
        assert!(message.contains("%40"), "{message}");
    }

    #[test]
    fn unknown_parameters_are_named_with_the_likely_one() {
        let message = error("postgres://app:s3cret@db-host/turnstile?ssl=true");
        assert!(message.contains("unknown parameter `ssl`"), "{message}");
        assert!(message.contains("did you mean `sslmode`?"), "{message}");
        for (name, meant) in [
            ("sslmdoe", "sslmode"),
            ("ssl_mode", "sslmode"),
            ("applicationName", "application_name"),
            ("connect_timout", "connect_timeout"),
            ("database", "dbname"),
            ("sslrootcrt", "sslrootcert"),
        ] {
            let Err(UrlError::UnknownParameter { suggestion, .. }) =
                parse(&format!("postgres://h/db?{name}=1"))
            else {
                panic!("{name} was accepted");
            };
            assert_eq!(suggestion, Some(meant), "{name}");
        }
        let message = error("host=h user=app pwd=s3cret frobnicate=1");
        assert!(
            message.contains("`pwd`: did you mean `password`?"),
            "{message}"
        );
        let message = error("host=h frobnicate=1");
        assert!(
            message.contains("the known ones are user, password"),
            "{message}"
        );
    }

    #[test]
    fn a_port_that_is_no_number_is_named() {
        let message = error("postgres://app:s3cret@db-host:54x2/turnstile");
        assert!(message.contains("port `54x2`"), "{message}");
    }

    #[test]
    fn neither_form_nor_host_is_refused_clearly() {
        assert!(matches!(
            parse("db-host:5432/turnstile"),
            Err(UrlError::Unrecognized)
        ));
        assert!(matches!(
            parse("postgres:///turnstile"),
            Err(UrlError::NoHost)
        ));
        assert!(matches!(parse("user=app dbname=x"), Err(UrlError::NoHost)));
        let message = error("host=h port=");
        assert!(message.starts_with("the database URL"), "{message}");
    }

    #[test]
    fn the_parts_are_cut_where_the_driver_cuts_them() {
        let parts = UrlParts::of("postgres://u:p?w@h1,h2:6/db?a=b&c=%3D").unwrap();
        assert_eq!(parts.host, "h1,h2:6");
        assert_eq!(
            parts.params(),
            [("a".into(), "b".into()), ("c".into(), "=".into())]
        );
        let bare = UrlParts::of("postgresql://h").unwrap();
        assert_eq!((bare.host, bare.query), ("h", None));
    }

    #[test]
    fn the_password_file_fills_in_a_missing_password_only() {
        let dir = std::env::temp_dir().join(format!("turnstile-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "from file\r\n").unwrap();
        let url = |text: &str| DatabaseUrl::new(text).with_password_file(Some(file.clone()));
        let parsed = url("postgres://app@h/db").parse().unwrap();
        assert_eq!(parsed.config.get_password(), Some(&b"from file"[..]));
        let parsed = url("postgres://app:inline@h/db").parse().unwrap();
        assert_eq!(parsed.config.get_password(), Some(&b"inline"[..]));

        std::fs::write(&file, "\n").unwrap();
        let e = url("postgres://app@h/db").parse().unwrap_err();
        assert!(matches!(e, UrlError::EmptyPasswordFile { .. }), "{e}");
        let missing =
            DatabaseUrl::new("postgres://app@h/db").with_password_file(Some(dir.join("absent")));
        let e = missing.parse().unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debug_output_is_redacted() {
        let url = DatabaseUrl::new("postgres://app:s3cret@h/db");
        assert!(!format!("{url:?}").contains("s3cret"));
    }
}
