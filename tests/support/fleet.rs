//! Real `turnstile serve` processes sharing one database, as replicas run in production: each
//! started from the built binary (or another, such as the previous release's, see [`Program`])
//! with a clean environment, added, killed, restarted or stopped with SIGTERM on demand. Whatever happens to the test, no process outlives it: dropping the fleet
//! SIGKILLs every server still running.
//!
//! Each server's log goes to a file (a pipe nobody reads would fill and stall the server); after a
//! failed test the files are kept and their directory printed.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::free_port;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// How long a server may take to start serving (migrations included).
const READY_WITHIN: Duration = Duration::from_secs(30);
/// How long a server may take to exit after SIGTERM.
const STOP_WITHIN: Duration = Duration::from_secs(20);

/// What a server runs: a `turnstile` binary, with arguments after `serve` and environment of its
/// own beyond the fleet's.
#[derive(Debug, Clone)]
pub struct Program {
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Program {
    /// This build's `turnstile` binary.
    pub fn this_build() -> Program {
        Program::binary(env!("CARGO_BIN_EXE_turnstile"))
    }

    /// The `turnstile` binary at `path` (another release's, say).
    pub fn binary(path: impl Into<PathBuf>) -> Program {
        Program {
            binary: path.into(),
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Also passes `arg` after `serve`.
    pub fn arg(mut self, arg: impl Into<String>) -> Program {
        self.args.push(arg.into());
        self
    }

    /// Also sets the environment variable `key` (after the fleet's, so it wins).
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Program {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The binary's path.
    pub fn path(&self) -> &Path {
        &self.binary
    }
}

/// Server processes of the `turnstile` binary, all with the same database. Its blocking waits use
/// `block_in_place`, so it needs a multi-thread runtime: the test's other tasks (the load) keep
/// running meanwhile.
pub struct Fleet {
    servers: Vec<Server>,
    database_url: String,
    /// Further environment every server gets.
    env: Vec<(String, String)>,
    logs: Option<tempfile::TempDir>,
}

struct Server {
    program: Program,
    port: u16,
    child: Option<Child>,
    starts: usize,
    log: PathBuf,
}

impl Fleet {
    /// Starts `n` servers of the `counter` and sample bots on free ports with state in
    /// `database_url`, and waits until each serves.
    pub async fn start(n: usize, database_url: &str) -> Fleet {
        Self::start_with_env(n, database_url, &[]).await
    }

    /// [`Fleet::start`], each server also getting the environment variables `env`.
    pub async fn start_with_env(n: usize, database_url: &str, env: &[(&str, &str)]) -> Fleet {
        let mut fleet = Fleet::new_with_env(database_url, env);
        for _ in 0..n {
            fleet.servers.push(Server {
                program: Program::this_build(),
                port: 0,
                child: None,
                starts: 0,
                log: PathBuf::new(),
            });
        }
        for i in 0..n {
            fleet.first_start(i).await;
        }
        fleet
    }

    /// A fleet of no server yet, with state in `database_url`; [`Fleet::add`] starts them.
    pub fn new(database_url: &str) -> Fleet {
        Self::new_with_env(database_url, &[])
    }

    /// [`Fleet::new`], each server also getting the environment variables `env`.
    pub fn new_with_env(database_url: &str, env: &[(&str, &str)]) -> Fleet {
        let logs = tempfile::Builder::new()
            .prefix("turnstile-fleet-")
            .tempdir()
            .expect("creating a directory for server logs");
        Fleet {
            servers: Vec::new(),
            database_url: database_url.to_owned(),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            logs: Some(logs),
        }
    }

    /// Starts one more server, running `program`, on a free port and waits until it serves;
    /// returns its index.
    pub async fn add(&mut self, program: Program) -> usize {
        self.servers.push(Server {
            program,
            port: 0,
            child: None,
            starts: 0,
            log: PathBuf::new(),
        });
        let i = self.servers.len() - 1;
        self.first_start(i).await;
        i
    }

    /// Starts server `i` for the first time and waits until it serves. A free port found by
    /// binding port 0 can be taken by someone else before the server binds it; then the server
    /// exits at once, and a new port is tried.
    async fn first_start(&mut self, i: usize) {
        let mut tries = 0;
        loop {
            tries += 1;
            self.servers[i].port = free_port();
            self.spawn(i);
            match self.wait_ready(i).await {
                Ok(()) => break,
                Err(why) if tries < 3 => {
                    eprintln!("server {i} did not start ({why}); retrying")
                }
                Err(why) => panic!("server {i} did not start: {why}"),
            }
        }
    }

    /// The servers' gRPC addresses, by index.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.servers
            .iter()
            .map(|s| SocketAddr::from(([127, 0, 0, 1], s.port)))
            .collect()
    }

    /// SIGKILLs server `i`: no drain, no goodbye, in-flight turns cut wherever they were.
    pub fn kill(&mut self, i: usize) {
        let mut child = self.servers[i].child.take().expect("server is running");
        child.kill().expect("SIGKILL the server");
        tokio::task::block_in_place(|| child.wait()).expect("reaping the killed server");
    }

    /// Starts server `i` again on its port and waits until it serves.
    pub async fn restart(&mut self, i: usize) {
        assert!(self.servers[i].child.is_none(), "server {i} is running");
        let mut tries = 0;
        loop {
            tries += 1;
            self.spawn(i);
            match self.wait_ready(i).await {
                Ok(()) => return,
                Err(why) if tries < 3 => {
                    eprintln!("server {i} did not restart ({why}); retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(why) => panic!("server {i} did not restart: {why}"),
            }
        }
    }

    /// SIGTERMs every server and waits for each to exit; returns their exit statuses with the
    /// end of their logs.
    pub fn stop(&mut self) -> Vec<(ExitStatus, String)> {
        for server in &self.servers {
            server.sigterm();
        }
        let deadline = std::time::Instant::now() + STOP_WITHIN;
        self.servers
            .iter_mut()
            .filter_map(|server| server.exit_by(deadline))
            .collect()
    }

    /// SIGTERMs server `i` alone, as a rollout stops a pod, and waits for it to exit (to drain);
    /// returns its exit status with the end of its log.
    pub fn terminate(&mut self, i: usize) -> (ExitStatus, String) {
        let server = &mut self.servers[i];
        assert!(server.child.is_some(), "server {i} is running");
        server.sigterm();
        server
            .exit_by(std::time::Instant::now() + STOP_WITHIN)
            .expect("a running server exits")
    }

    /// Server `i`'s whole log since its last start.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.servers[i].log).unwrap_or_default()
    }

    /// Starts server `i`'s process on its port, its output in a fresh log file.
    fn spawn(&mut self, i: usize) {
        let dir = self.logs.as_ref().expect("log directory").path();
        let server = &mut self.servers[i];
        server.starts += 1;
        server.log = dir.join(format!("server-{i}.{}.log", server.starts));
        let log = File::create(&server.log).expect("creating a server log");
        let child = Command::new(&server.program.binary)
            .arg("serve")
            .args(&server.program.args)
            .env_clear()
            .env("TURNSTILE_LISTEN", format!("127.0.0.1:{}", server.port))
            .env("DATABASE_URL", &self.database_url)
            .env("RUST_LOG", "warn")
            .env("TURNSTILE_SHUTDOWN_GRACE_SECS", "5")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(server.program.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("log file handle")))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("starting {:?}: {e}", server.program.binary));
        server.child = Some(child);
    }

    /// Waits until server `i` answers its health check with SERVING, or explains why not.
    async fn wait_ready(&mut self, i: usize) -> Result<(), String> {
        let deadline = Instant::now() + READY_WITHIN;
        let endpoint = format!("http://127.0.0.1:{}", self.servers[i].port);
        loop {
            let server = &mut self.servers[i];
            let child = server.child.as_mut().expect("server is running");
            if let Some(status) = child.try_wait().expect("polling a server") {
                server.child = None;
                return Err(format!("exited with {status}:\n{}", tail(&server.log)));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = tokio::task::block_in_place(|| child.wait());
                server.child = None;
                return Err(format!(
                    "not serving after {READY_WITHIN:?}:\n{}",
                    tail(&server.log)
                ));
            }
            if serving(&endpoint).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Server {
    /// Sends SIGTERM, if the server runs.
    fn sigterm(&self) {
        if let Some(child) = &self.child {
            let sent = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status()
                .expect("running kill");
            assert!(sent.success(), "SIGTERM to server on port {}", self.port);
        }
    }

    /// Waits for the server to exit, SIGKILLing it at `deadline`; its exit status and the end of
    /// its log, or `None` when it was not running.
    fn exit_by(&mut self, deadline: std::time::Instant) -> Option<(ExitStatus, String)> {
        let mut child = self.child.take()?;
        let status = tokio::task::block_in_place(|| {
            loop {
                if let Some(status) = child.try_wait().expect("polling a server") {
                    return status;
                }
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let status = child.wait().expect("reaping a server");
                    eprintln!("server on port {} ignored SIGTERM; killed", self.port);
                    return status;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Some((status, tail(&self.log)))
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for server in &mut self.servers {
            if let Some(mut child) = server.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if std::thread::panicking()
            && let Some(logs) = self.logs.take()
        {
            eprintln!("server logs kept in {}", logs.keep().display());
        }
    }
}

/// Whether the server at `endpoint` reports `TurnService` as serving.
async fn serving(endpoint: &str) -> bool {
    let check = async {
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
            .ok()?
            .connect()
            .await
            .ok()?;
        let mut client = HealthClient::new(channel);
        let response = client
            .check(HealthCheckRequest {
                service: "turnstile.v1.TurnService".into(),
            })
            .await
            .ok()?;
        Some(response.into_inner().status == ServingStatus::Serving as i32)
    };
    tokio::time::timeout(Duration::from_secs(1), check)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// The last lines of a log file.
pub fn tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
