//! TLS to PostgreSQL, against a throwaway cluster that takes TLS connections only: `ssl = on`,
//! a `pg_hba.conf` whose only TCP line is `hostssl`, and a CA and server certificate made here
//! with rcgen (SAN `localhost` and `127.0.0.1`). Turns are served over `require`, `verify-ca`,
//! `verify-full` and the default (`prefer`), and every connection the service holds is
//! encrypted; a wrong CA, a wrong host name and plaintext are refused, each with an error that
//! says why; the binary's `migrate` reads `PGSSLMODE` and `PGSSLROOTCERT` as libpq does.
#![allow(clippy::unwrap_used)]

use crate::support;
use crate::support::pki::{leaf, new_ca};

use std::path::{Path, PathBuf};
use std::process::Command;

use support::pg::Cluster;
use tokio_postgres::NoTls;
use turnstile::activity::incoming::{ChannelId, ConversationId};
use turnstile::config::StoreConfig;
use turnstile::state::StateKey;
use turnstile::store::Store as _;
use turnstile::store::postgres::{self, DatabaseUrl, PostgresStore, Statements};

/// A cluster that takes TCP connections over TLS only, with the CA its certificate chains to
/// and a CA it does not chain to.
struct TlsCluster {
    cluster: Cluster,
    /// Holds the client's copies of the CAs.
    _dir: tempfile::TempDir,
    ca: PathBuf,
    wrong_ca: PathBuf,
}

impl TlsCluster {
    fn start() -> TlsCluster {
        let ca = new_ca("Turnstile test PostgreSQL CA");
        let server = leaf(&ca, &["localhost", "127.0.0.1"]);
        Self::serving(&server.cert, &server.key, &ca.pem(), &[])
    }

    /// A cluster serving `cert` (PEM) with `key`, whose CA is `ca` (PEM), with `settings` too.
    fn serving(cert: &str, key: &str, ca: &str, settings: &[&str]) -> TlsCluster {
        let wrong = new_ca("Somebody else's CA");
        let (cert, key) = (cert.to_owned(), key.to_owned());
        let mut all = vec![
            "ssl=on",
            "ssl_cert_file=server.crt",
            "ssl_key_file=server.key",
        ];
        all.extend_from_slice(settings);
        let cluster = Cluster::start_with(&all, |cluster| {
            let data = cluster.data_dir();
            cluster.write_private(&data.join("server.crt"), cert.as_bytes());
            cluster.write_private(&data.join("server.key"), key.as_bytes());
            // TCP only with TLS; the Unix socket (the tests' own door) without.
            cluster.write_private(
                &data.join("pg_hba.conf"),
                b"local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            );
        });
        let dir = tempfile::tempdir().unwrap();
        let ca_path = dir.path().join("ca.pem");
        let wrong_path = dir.path().join("wrong-ca.pem");
        std::fs::write(&ca_path, ca).unwrap();
        std::fs::write(&wrong_path, wrong.pem()).unwrap();
        TlsCluster {
            cluster,
            _dir: dir,
            ca: ca_path,
            wrong_ca: wrong_path,
        }
    }

    /// A connection over the Unix socket, which needs no TLS: the test's view of the server.
    async fn admin(&self, database: &str) -> tokio_postgres::Client {
        let socket_dir = self.cluster.data_dir().parent().unwrap().to_owned();
        let (client, connection) = tokio_postgres::Config::new()
            .host_path(&socket_dir)
            .port(self.cluster.port())
            .user("postgres")
            .dbname(database)
            .connect(NoTls)
            .await
            .expect("connecting over the Unix socket");
        tokio::spawn(connection);
        client
    }

    /// A new database; returns its name.
    async fn database(&self) -> String {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = format!(
            "tls_{}",
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        self.admin("postgres")
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        name
    }

    /// A URL for `database` over TCP with `params` as its query.
    fn url(&self, host: &str, database: &str, params: &str) -> String {
        format!(
            "postgres://postgres@{host}:{}/{database}{params}",
            self.cluster.port()
        )
    }

    /// How many of the service's connections to `database` there are, and how many use TLS.
    async fn service_connections(&self, database: &str) -> (i64, i64) {
        let row = self
            .admin("postgres")
            .await
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE s.ssl) \
                   FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                  WHERE a.application_name = 'turnstile' AND a.datname = $1",
                &[&database],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    }
}

/// Serves a few turns over `url` (migrations on start included) and returns the app.
async fn serve_turns(url: &str) -> support::TestApp {
    let mut app = support::TestApp::on(url).spawn().await;
    for text in ["hi", "a", "b"] {
        support::say(&mut app.client, "tls-conversation", text).await;
    }
    app
}

fn key() -> StateKey {
    StateKey::conversation(
        "bot",
        &ChannelId::parse("test", "channel_id").unwrap(),
        &ConversationId::parse("c", "conversation.id").unwrap(),
    )
}

fn pem_path(path: &Path) -> String {
    path.display().to_string().replace('/', "%2F")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_verify_ca_verify_full_and_the_default_serve_turns_over_tls_only() {
    let tls = tokio::task::spawn_blocking(TlsCluster::start)
        .await
        .unwrap();
    let ca = pem_path(&tls.ca);
    for params in [
        "?sslmode=require".to_owned(),
        format!("?sslmode=verify-ca&sslrootcert={ca}"),
        format!("?sslmode=verify-full&sslrootcert={ca}"),
        // No sslmode: libpq's default, prefer, encrypts when the server offers TLS.
        String::new(),
    ] {
        let database = tls.database().await;
        let server = serve_turns(&tls.url("127.0.0.1", &database, &params)).await;
        let (all, encrypted) = tls.service_connections(&database).await;
        assert!(all > 0, "{params}: the service holds no connection");
        assert_eq!(
            encrypted, all,
            "{params}: {all} service connections, {encrypted} of them encrypted"
        );
        server.stop().await.unwrap();
    }

    // verify-full also by name: `localhost` is in the certificate.
    let database = tls.database().await;
    let url = tls.url(
        "localhost",
        &database,
        &format!("?sslmode=verify-full&sslrootcert={ca}"),
    );
    serve_turns(&url).await.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_refused_naming_the_certificate() {
    let tls = tokio::task::spawn_blocking(TlsCluster::start)
        .await
        .unwrap();
    let database = tls.database().await;
    let wrong = pem_path(&tls.wrong_ca);
    for mode in ["verify-ca", "verify-full", "require"] {
        // `require` with a root certificate verifies the chain, as in libpq.
        let url = tls.url(
            "127.0.0.1",
            &database,
            &format!("?sslmode={mode}&sslrootcert={wrong}"),
        );
        let err = postgres::migrate(&DatabaseUrl::new(&url))
            .await
            .expect_err(&format!("{mode} with the wrong CA connected"));
        let message = format!("{err:#}");
        eprintln!("{mode}, wrong CA: {message}");
        assert!(
            message.contains("TLS") && message.contains("certificate"),
            "{mode}: {message}"
        );

        // The server's start fails with that cause.
        let mut config = support::postgres_config(&url);
        config.migrate_on_start = true;
        let Err(err) = turnstile::server::open_store(&config).await else {
            panic!("{mode}: the server started with the wrong CA");
        };
        let message = format!("{:#}", anyhow::Error::from(err));
        assert!(message.contains("certificate"), "{mode}: {message}");

        // A store that skipped the migration says so on its first call.
        let store =
            PostgresStore::connect_with(&DatabaseUrl::new(&url), 2, Statements::Prepared).unwrap();
        let err = store
            .load(&[key()], None)
            .await
            .expect_err("a load over a refused connection");
        let message = format!("{:#}", anyhow::Error::from(err));
        assert!(
            message.contains("TLS") && message.contains("certificate"),
            "{mode}: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let tls = tokio::task::spawn_blocking(TlsCluster::start)
        .await
        .unwrap();
    let database = tls.database().await;
    // Connects to 127.0.0.1 but checks the certificate against a name it does not hold.
    let url = |mode: &str| {
        format!(
            "host=db.invalid hostaddr=127.0.0.1 port={} user=postgres dbname={database} \
             sslmode={mode} sslrootcert='{}'",
            tls.cluster.port(),
            tls.ca.display()
        )
    };
    let err = postgres::migrate(&DatabaseUrl::new(url("verify-full")))
        .await
        .expect_err("verify-full accepted a certificate for another name");
    let message = format!("{err:#}");
    assert!(
        message.contains("TLS") && message.contains("certificate"),
        "{message}"
    );
    postgres::migrate(&DatabaseUrl::new(url("verify-ca")))
        .await
        .expect("verify-ca checks the chain only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_is_refused_by_the_server_and_the_error_says_so() {
    let tls = tokio::task::spawn_blocking(TlsCluster::start)
        .await
        .unwrap();
    let database = tls.database().await;
    let url = tls.url("127.0.0.1", &database, "?sslmode=disable");
    let err = postgres::migrate(&DatabaseUrl::new(&url))
        .await
        .expect_err("a plaintext connection was accepted");
    let message = format!("{err:#}");
    eprintln!("plaintext: {message}");
    assert!(
        message.contains("no encryption") && message.contains("sslmode=disable"),
        "{message}"
    );
    let config = support::postgres_config(&url);
    assert!(matches!(config.store, StoreConfig::Postgres { .. }));
    let Err(err) = turnstile::server::open_store(&config).await else {
        panic!("the server started over plaintext");
    };
    let message = format!("{:#}", anyhow::Error::from(err));
    assert!(message.contains("no encryption"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_migrates_with_pgsslmode_and_pgsslrootcert_from_the_environment() {
    let tls = tokio::task::spawn_blocking(TlsCluster::start)
        .await
        .unwrap();
    let database = tls.database().await;
    let url = tls.url("127.0.0.1", &database, "");
    let migrate = |ca: &Path| {
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .arg("migrate")
            .env_clear()
            .env("DATABASE_URL", &url)
            .env("PGSSLMODE", "verify-full")
            .env("PGSSLROOTCERT", ca)
            .env("RUST_LOG", "info")
            .output()
            .expect("running turnstile migrate")
    };

    let refused = migrate(&tls.wrong_ca);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "migrated with the wrong CA");
    assert!(
        stderr.contains("TLS") && stderr.contains("certificate"),
        "{stderr}"
    );

    let done = migrate(&tls.ca);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let tables: i64 = tls
        .admin(&database)
        .await
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'turnstile_state'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 1, "the migration did not run");
}

/// A self-signed X.509 version 1 certificate for `localhost` and its key, PEM, made by the
/// `openssl` command as Citus makes its nodes' (rcgen makes version 3 only).
fn version_1_certificate() -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir.path())
            .output()
            .expect("the `openssl` command (Debian: openssl) makes the version 1 certificate");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    run(&[
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "key.pem",
        "-subj",
        "/CN=localhost",
        "-out",
        "csr.pem",
    ]);
    run(&[
        "x509", "-req", "-in", "csr.pem", "-signkey", "key.pem", "-days", "2", "-out", "cert.pem",
    ]);
    let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap();
    let cert = read("cert.pem");
    let text = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in", "cert.pem"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("Version: 1 (0x0)"),
        "not a version 1 certificate"
    );
    (cert, read("key.pem"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_and_require_accept_a_version_1_certificate_as_libpq_does() {
    // Citus gives its nodes self-signed X.509 v1 certificates, which webpki will not parse;
    // `prefer` (the default) and `require` check no certificate, so they must not need to.
    let (cert, key) = version_1_certificate();
    // TLS 1.3 as PostgreSQL negotiates it, and TLS 1.2, whose signatures are checked otherwise.
    for settings in [&[][..], &["ssl_max_protocol_version='TLSv1.2'"][..]] {
        let (cert, key) = (cert.clone(), key.clone());
        let tls =
            tokio::task::spawn_blocking(move || TlsCluster::serving(&cert, &key, &cert, settings))
                .await
                .unwrap();
        for params in ["?sslmode=require", ""] {
            let database = tls.database().await;
            let server = serve_turns(&tls.url("127.0.0.1", &database, params)).await;
            let (all, encrypted) = tls.service_connections(&database).await;
            assert!(
                all > 0 && encrypted == all,
                "{settings:?} {params}: {encrypted} of {all} encrypted"
            );
            server.stop().await.unwrap();
        }
    }
}
