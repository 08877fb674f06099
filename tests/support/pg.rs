//! Throwaway PostgreSQL clusters for the tests, from the server binaries on the machine.
//!
//! Each test binary starts one shared cluster on first use and gives every test a fresh database
//! in it; a test that must stop and restart the database gets a private cluster. With
//! `TEST_DATABASE_URL` set, the shared cluster is that server instead. A cluster left behind by a
//! killed test process is stopped and deleted by a small watchdog that outlives it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_postgres::NoTls;

use super::free_port;

const INSTALL_HINT: &str = "the tests need PostgreSQL's server binaries (initdb, pg_ctl, postgres) on \
     PATH or in /usr/lib/postgresql/<version>/bin. Install them (Debian/Ubuntu: `apt-get install \
     postgresql`), or point TEST_DATABASE_URL at a server where the tests may create databases";

/// A running PostgreSQL cluster the tests own.
pub struct Cluster {
    bin: PathBuf,
    root: PathBuf,
    port: u16,
    as_postgres: bool,
    /// Server settings after the defaults on the command line, which they override.
    settings: Vec<String>,
}

impl Cluster {
    /// Initializes and starts a new cluster in a temporary directory.
    pub fn start() -> Cluster {
        Cluster::start_with(&[], |_| {})
    }

    /// Initializes a new cluster, lets `prepare` change its files (certificates, `pg_hba.conf`),
    /// and starts it with `settings` (`name=value`, overriding the defaults).
    pub fn start_with(settings: &[&str], prepare: impl FnOnce(&Cluster)) -> Cluster {
        let cluster = Cluster::empty(settings);
        let data = cluster.data_dir();
        run(cluster.command("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ]));
        cluster.spawn_watchdog();
        prepare(&cluster);
        cluster.first_start()
    }

    /// A streaming-replication standby of `primary` (`pg_basebackup -R -X stream`), started
    /// with `settings`; returns when it accepts connections.
    pub fn standby_of(primary: &Cluster, settings: &[&str]) -> Cluster {
        let cluster = Cluster::empty(settings);
        run(cluster
            .command("pg_basebackup")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
            ])
            .arg("-D")
            .arg(cluster.data_dir())
            .args(["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"]));
        cluster.spawn_watchdog();
        cluster.first_start()
    }

    /// A cluster not yet initialized: its directory, owned by the server's user, and a port.
    fn empty(settings: &[&str]) -> Cluster {
        let bin = find_bin_dir().unwrap_or_else(|| panic!("{INSTALL_HINT}"));
        let as_postgres = is_root();
        let root = tempfile::Builder::new()
            .prefix("turnstile-pg-")
            .tempdir()
            .expect("creating a temporary directory for PostgreSQL")
            .keep();
        if as_postgres {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&root));
        }
        Cluster {
            bin,
            port: free_port(),
            root,
            as_postgres,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// The cluster's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    /// Writes `contents` to `path` as a file the server can read and nobody else can (the
    /// server refuses a private key that others may read).
    pub fn write_private(&self, path: &Path, contents: &[u8]) {
        std::fs::write(path, contents).unwrap_or_else(|e| panic!("writing {path:?}: {e}"));
        run(Command::new("chmod").arg("0600").arg(path));
        if self.as_postgres {
            run(Command::new("chown").arg("postgres:postgres").arg(path));
        }
    }

    /// Crashes the server (immediate shutdown: no checkpoint, connections cut).
    pub fn crash(&self) {
        run(self.command("pg_ctl").arg("-D").arg(self.data_dir()).args([
            "-m",
            "immediate",
            "-w",
            "stop",
        ]));
    }

    /// Promotes this standby to a primary; returns when it accepts writes.
    pub fn promote(&self) {
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-w", "-t", "60", "promote"]));
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("server.log")).unwrap_or_default()
    }

    /// Starts the cluster for the first time. Its port was free when it was chosen, but the
    /// other tests' connections take ephemeral ports all the while (initdb runs for seconds in
    /// between), so a port found taken is replaced by another, a few times.
    fn first_start(mut self) -> Cluster {
        let mut attempts = 1;
        loop {
            match self.try_resume() {
                Ok(()) => return self,
                Err(_) if attempts < 5 && self.log().contains("could not bind") => {
                    self.port = free_port();
                    attempts += 1;
                }
                Err(failure) => panic!("{failure}"),
            }
        }
    }

    /// Starts the stopped cluster again, on the same port; returns when it accepts connections.
    pub fn resume(&self) {
        if let Err(failure) = self.try_resume() {
            panic!("{failure}");
        }
    }

    /// [`Cluster::resume`], with what went wrong and the server's log when it did not start.
    fn try_resume(&self) -> Result<(), String> {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
             -c full_page_writes=off -c max_connections=300 -c shared_buffers=64MB",
            self.port,
            self.root.display()
        );
        for setting in &self.settings {
            options.push_str(" -c ");
            options.push_str(setting);
        }
        try_run(
            self.command("pg_ctl")
                .arg("-D")
                .arg(self.data_dir())
                .arg("-l")
                .arg(self.root.join("server.log"))
                .args(["-o", &options, "-w", "-t", "60", "start"]),
        )
        .map_err(|failure| format!("{failure}\nserver log:\n{}", self.log()))
    }

    /// Stops the cluster (fast shutdown: open connections are closed).
    pub fn stop(&self) {
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", "fast", "-w", "stop"]));
    }

    /// The URL of database `name` in this cluster.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    fn command(&self, program: &str) -> Command {
        // PATH may hold links to a few of the server's programs only (initdb, pg_ctl): the
        // others sit beside what they link to.
        let path = std::fs::canonicalize(self.bin.join("pg_ctl"))
            .ok()
            .and_then(|real| real.parent().map(|dir| dir.join(program)))
            .filter(|path| path.is_file())
            .unwrap_or_else(|| self.bin.join(program));
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// A detached shell that waits for this test process to exit, then stops the cluster and
    /// deletes its files: the tests' statics are never dropped, and a killed process runs nothing.
    fn spawn_watchdog(&self) {
        let pg_ctl = self.bin.join("pg_ctl");
        let runner = if self.as_postgres {
            "runuser -u postgres -- "
        } else {
            ""
        };
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
             {runner}'{pg_ctl}' -D '{data}' -m immediate stop >/dev/null 2>&1; rm -rf '{root}'",
            pid = std::process::id(),
            pg_ctl = pg_ctl.display(),
            data = self.data_dir().display(),
            root = self.root.display(),
        );
        // `setsid -f` forks the shell into its own session and returns at once.
        let started = Command::new("setsid")
            .args(["-f", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("starting the cluster watchdog");
        assert!(
            started.success(),
            "starting the cluster watchdog: {started}"
        );
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Where fresh test databases are created: the URL of a server and a database to connect to.
enum Server {
    Url(String),
    Cluster(Cluster),
}

fn shared() -> &'static Server {
    static SHARED: OnceLock<Server> = OnceLock::new();
    SHARED.get_or_init(|| match std::env::var("TEST_DATABASE_URL") {
        Ok(url) if !url.is_empty() => Server::Url(url),
        _ => Server::Cluster(Cluster::start()),
    })
}

/// A new, empty database on the shared server; returns its URL.
pub async fn fresh_database() -> String {
    create_database(&admin_url()).await
}

/// The shared server's URL for creating databases.
fn admin_url() -> String {
    match shared() {
        Server::Url(url) => url.clone(),
        Server::Cluster(c) => c.url("postgres"),
    }
}

/// A session of the test's own on `url`, its connection driven on a task of its own.
pub async fn session(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting to the test PostgreSQL server: {e}"));
    tokio::spawn(connection);
    // Turnstile's tables are in their own schema (its default).
    client
        .batch_execute("SET search_path TO turnstile, public")
        .await
        .unwrap_or_else(|e| panic!("setting the search path: {e}"));
    client
}

/// A new, empty database in `cluster`; returns its URL.
pub async fn fresh_database_in(cluster: &Cluster) -> String {
    create_database(&cluster.url("postgres")).await
}

/// A new, empty database on the shared server that compares text by ICU's rules for `locale`
/// (`en-US`), as a packaged or hosted PostgreSQL's databases compare it by their locale's, where
/// the shared cluster's compare bytewise (`C`); returns its URL. ICU's collations are built into
/// PostgreSQL, so no locale need be installed on the machine.
pub async fn fresh_database_collated(locale: &str) -> String {
    create_database_with(
        &admin_url(),
        &format!("TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE '{locale}'"),
    )
    .await
}

async fn create_database(admin_url: &str) -> String {
    create_database_with(admin_url, "").await
}

async fn create_database_with(admin_url: &str, options: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "turnstile_test_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    session(admin_url)
        .await
        .batch_execute(&format!("CREATE DATABASE {name} {options}"))
        .await
        .expect("creating a test database");
    let mut config: tokio_postgres::Config = admin_url.parse().expect("a valid admin URL");
    config.dbname(&name);
    to_url(&config)
}

/// Rebuilds a URL from a parsed configuration (host, port, user, password, database).
fn to_url(config: &tokio_postgres::Config) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "127.0.0.1".to_owned());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or("postgres");
    let password = config
        .get_password()
        .map(|p| format!(":{}", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    let db = config.get_dbname().unwrap_or("postgres");
    format!("postgres://{user}{password}@{host}:{port}/{db}")
}

/// The directory of the server's loadable modules (`citus.so`, when Citus is installed), beside
/// the directory of its programs.
pub fn lib_dir() -> Option<PathBuf> {
    let bin = find_bin_dir()?;
    let real = std::fs::canonicalize(bin.join("pg_ctl")).ok()?;
    Some(real.parent()?.parent()?.join("lib"))
}

fn find_bin_dir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())
    });
    on_path.or_else(|| {
        let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|bin| bin.join("initdb").is_file())
            .collect();
        versions.sort_by_key(|p| version_of(p));
        versions.pop()
    })
}

fn version_of(bin: &Path) -> u32 {
    bin.parent()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// initdb refuses to run as root; as root the cluster runs as the `postgres` user.
fn is_root() -> bool {
    let out = Command::new("id")
        .arg("-u")
        .output()
        .expect("running `id -u`");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

fn run(command: &mut Command) {
    if let Err(failure) = try_run(command) {
        panic!("{failure}");
    }
}

/// Runs `command`; what it printed when it failed.
fn try_run(command: &mut Command) -> Result<(), String> {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("running {command:?}: {e}. {INSTALL_HINT}"));
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "{command:?} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    ))
}

/// Waits until a turn holds `conversation` (its hold row in the database names a holder whose
/// time has not run out): the turn sent first is then running, whatever the machine's load.
pub async fn until_held(url: &str, conversation: &str) {
    let db = session(url).await;
    let key = format!("%/conversations/{conversation}/%hold");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        // (An error: the servers have not migrated the database yet.)
        let held = db
            .query_one(
                "SELECT count(*) FROM turnstile_state WHERE key LIKE $1 \
                    AND state ? 'holder' \
                    AND (state->>'until')::float8 > extract(epoch FROM clock_timestamp())",
                &[&key],
            )
            .await
            .map(|row| row.get::<_, i64>(0));
        if held.is_ok_and(|held| held > 0) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{conversation} never held"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits until no turn holds `conversation` any more (its hold row's time is over, or it has
/// none): a hold is released on a task of its own after its turn's commit.
pub async fn until_released(url: &str, conversation: &str) {
    let db = session(url).await;
    let key = format!("%/conversations/{conversation}/%hold");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let held: i64 = db
            .query_one(
                "SELECT count(*) FROM turnstile_state WHERE key LIKE $1 \
                    AND (state->>'until')::float8 > extract(epoch FROM clock_timestamp())",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        if held == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{conversation} never released"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
