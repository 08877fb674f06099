//! The `turnstile` binary as an operator runs it: flags and environment, `migrate`, `serve`, and
//! a clean stop on SIGTERM.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::{free_port, health_check, say, texts};
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

/// `turnstile` with a clean environment apart from what the test sets.
fn turnstile() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
    command
        .env_clear()
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

async fn connect(port: u16) -> TurnServiceClient<tonic::transport::Channel> {
    for _ in 0..200 {
        if let Ok(client) = TurnServiceClient::connect(format!("http://127.0.0.1:{port}")).await {
            return client;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the binary never listened on port {port}");
}

/// Sends SIGTERM and returns the exit status and everything the process logged.
fn terminate(mut child: Child) -> (std::process::ExitStatus, String) {
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let stderr = child.stderr.take().unwrap();
    let log: Vec<String> = BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
        .collect();
    let status = child.wait().unwrap();
    (status, log.join("\n"))
}

#[tokio::test]
async fn serves_the_pizza_bot_from_memory_and_stops_on_sigterm() {
    let port = free_port();
    let child = turnstile()
        .env("TURNSTILE_LISTEN", format!("127.0.0.1:{port}"))
        .spawn()
        .unwrap();
    let mut client = connect(port).await;
    let reply = say(&mut client, "c1", "add mushroom").await;
    assert_eq!(texts(&reply), ["Added mushroom. Your pizza has: mushroom."]);
    drop(client);

    let (status, log) = tokio::task::spawn_blocking(move || terminate(child))
        .await
        .unwrap();
    assert!(status.success(), "{status}: {log}");
    assert!(
        log.contains("serves one replica only"),
        "warns about the memory store: {log}"
    );
    assert!(log.contains("stopped"), "{log}");
}

/// A fresh process, as deployed: every metric the README lists for turns is recorded, the
/// store's call durations included (they were taken before the recorder was installed, and
/// stayed empty, while the tests in one process, where a recorder already ran, saw them).
#[tokio::test]
async fn the_binarys_metrics_record_turns_and_store_calls() {
    let (port, metrics) = (free_port(), free_port());
    let child = turnstile()
        .env("TURNSTILE_LISTEN", format!("127.0.0.1:{port}"))
        .env("TURNSTILE_METRICS_LISTEN", format!("127.0.0.1:{metrics}"))
        .spawn()
        .unwrap();
    let mut client = connect(port).await;
    say(&mut client, "metrics-1", "add mushroom").await;
    say(&mut client, "metrics-2", "add cheese").await;
    let scrape = reqwest::get(format!("http://127.0.0.1:{metrics}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let count = |series: &str| {
        scrape
            .lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    drop(client);
    let _ = tokio::task::spawn_blocking(move || terminate(child)).await;
    assert!(
        count("turnstile_turn_duration_seconds_count") >= 2.0,
        "{scrape}"
    );
    for op in ["load", "commit"] {
        assert!(
            count(&format!(
                "turnstile_store_duration_seconds_count{{op=\"{op}\"}}"
            )) >= 2.0,
            "no {op} timed: {scrape}"
        );
    }
}

#[tokio::test]
async fn migrate_then_serve_without_migrating_on_start() {
    let url = support::pg::fresh_database().await;
    let password_url = url.replacen("postgres@", "postgres:hunter2@", 1);

    let migrated = turnstile()
        .args(["migrate", "--database-url", &password_url])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&migrated.stderr);
    assert!(migrated.status.success(), "{log}");
    let migrations = std::fs::read_dir("migrations").unwrap().count();
    assert!(log.contains(&format!("applied={migrations}")), "{log}");
    assert!(
        !log.contains("hunter2"),
        "the password never reaches the log: {log}"
    );

    let port = free_port();
    let child = turnstile()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--migrate-on-start", "false", "--max-attempts", "3"])
        .env("DATABASE_URL", &password_url)
        .spawn()
        .unwrap();
    let mut client = connect(port).await;
    say(&mut client, "c1", "add ham").await;
    let shown = say(&mut client, "c1", "show").await;
    assert_eq!(texts(&shown), ["Your pizza has: ham."]);
    assert_eq!(shown.version, 1);
    drop(client);

    let (status, log) = tokio::task::spawn_blocking(move || terminate(child))
        .await
        .unwrap();
    assert!(status.success(), "{status}: {log}");
    assert!(
        !log.contains("migrations up to date"),
        "did not migrate on start: {log}"
    );
    assert!(!log.contains("hunter2"), "{log}");
}

#[test]
fn a_bad_flag_is_refused_with_a_message() {
    let out = turnstile().args(["--max-attempts", "0"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max-attempts"), "{err}");
}

#[tokio::test]
async fn the_load_generator_drives_the_counter_bot_and_verifies_it() {
    let port = free_port();
    let server = turnstile()
        .env("TURNSTILE_LISTEN", format!("127.0.0.1:{port}"))
        .spawn()
        .unwrap();
    drop(connect(port).await);
    let server_pid = server.id().to_string();
    let bench = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_turnstile-bench"))
            .args(["--target", &format!("127.0.0.1:{port}")])
            .args([
                "--turns",
                "300",
                "--concurrency",
                "8",
                "--conversations",
                "20",
            ])
            .args(["--hot-share", "0.5", "--prefill", "--json"])
            .args(["--cpu-of", &format!("server={server_pid}")])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&bench.stdout);
    assert!(
        bench.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["statuses"]["OK"], 300, "{report}");
    let check = &report["verification"];
    assert_eq!(
        check["acknowledged"], 320,
        "300 turns and 20 prefills: {report}"
    );
    assert_eq!(
        (&check["lost"], &check["doubled"]),
        (&0.into(), &0.into()),
        "{report}"
    );
    assert!(report["latency_ms"]["p99"].as_f64().unwrap() > 0.0);
    let cpu = &report["cpu_us_per_turn"];
    assert!(
        cpu["server"].as_f64().is_some() && cpu["turnstile-bench"].as_f64().is_some(),
        "CPU per turn of the server and of the load generator: {report}"
    );
    let (status, log) = tokio::task::spawn_blocking(move || terminate(server))
        .await
        .unwrap();
    assert!(status.success(), "{log}");
}

#[tokio::test]
async fn health_check_exits_zero_only_for_a_serving_server() {
    let port = free_port();
    let address = format!("http://127.0.0.1:{port}");
    let (ok, out) = tokio::task::spawn_blocking({
        let address = address.clone();
        move || health_check(&["--address", &address, "--timeout-secs", "2"])
    })
    .await
    .unwrap();
    assert!(!ok, "nothing listens yet: {out}");
    assert!(out.contains("connecting to"), "{out}");

    let server = turnstile()
        .env("TURNSTILE_LISTEN", format!("127.0.0.1:{port}"))
        .spawn()
        .unwrap();
    drop(connect(port).await);
    let (whole, turns, unknown) = tokio::task::spawn_blocking({
        let address = address.clone();
        move || {
            (
                health_check(&["--address", &address]),
                health_check(&[
                    "--address",
                    &address,
                    "--service",
                    "turnstile.v1.TurnService",
                ]),
                health_check(&["--address", &address, "--service", "no.such.Service"]),
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(whole, (true, "SERVING\n".to_owned()));
    assert_eq!(turns, (true, "SERVING\n".to_owned()));
    assert!(
        !unknown.0,
        "an unknown service is no success: {}",
        unknown.1
    );
    assert!(unknown.1.contains("NotFound"), "{}", unknown.1);

    let (status, log) = tokio::task::spawn_blocking(move || terminate(server))
        .await
        .unwrap();
    assert!(status.success(), "{log}");
}

/// What `turnstile migrate` and `turnstile serve` (which migrates on start) print when they
/// cannot use the database `configure` sets: both fail, with the same headline (the `Error:`
/// line), which is returned with what follows it. Neither prints the password `hunter2`.
fn database_error(configure: impl Fn(&mut Command) -> &mut Command) -> String {
    let migrate = configure(turnstile().arg("migrate")).output().unwrap();
    let serve = configure(turnstile().args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--gateway-listen",
        "off",
    ]))
    .output()
    .unwrap();
    let mut headlines = Vec::new();
    for (command, out) in [("migrate", migrate), ("serve", serve)] {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{command} succeeded: {stderr}");
        assert!(
            !stderr.contains("hunter2"),
            "{command} printed the password: {stderr}"
        );
        let at = stderr
            .find("Error: ")
            .unwrap_or_else(|| panic!("{command} printed no error: {stderr}"));
        headlines.push(stderr[at..].to_owned());
    }
    let first_line = |s: &str| s.lines().next().unwrap_or_default().to_owned();
    assert_eq!(
        first_line(&headlines[0]),
        first_line(&headlines[1]),
        "migrate and serve headline the same problem"
    );
    headlines.swap_remove(0)
}

fn with_url(url: &str) -> impl Fn(&mut Command) -> &mut Command + '_ {
    move |command| command.args(["--database-url", url])
}

/// The `Error:` line alone.
fn headline(error: &str) -> &str {
    error.lines().next().unwrap_or_default()
}

#[test]
fn a_refused_connection_names_the_host_and_port() {
    let port = free_port();
    let error = database_error(with_url(&format!(
        "postgres://app:hunter2@127.0.0.1:{port}/turnstile"
    )));
    assert!(
        headline(&error).contains(&format!("connection to 127.0.0.1:{port} refused"))
            && headline(&error).contains("is PostgreSQL running and listening there?"),
        "{error}"
    );
    assert!(!error.contains("migrating the database failed"), "{error}");
}

#[test]
fn an_unknown_host_is_named() {
    let error = database_error(with_url("postgres://app:hunter2@db-host.invalid/turnstile"));
    assert!(
        headline(&error).contains("cannot resolve the database host `db-host.invalid`"),
        "{error}"
    );
}

#[test]
fn an_unencoded_at_in_the_password_says_to_percent_encode_it() {
    let error = database_error(with_url("postgres://app:hunter2@x@db-host/turnstile"));
    assert!(
        headline(&error).contains("more than one `@`") && headline(&error).contains("%40"),
        "{error}"
    );
    assert!(!error.contains("x@db-host"), "{error}");
}

#[test]
fn a_misspelt_scheme_gets_a_did_you_mean() {
    let error = database_error(with_url("postgress://app:hunter2@db-host/turnstile"));
    assert!(
        headline(&error).contains("`postgress://`")
            && headline(&error).contains("did you mean postgres:// or postgresql://?"),
        "{error}"
    );
}

#[test]
fn unknown_parameters_get_a_did_you_mean() {
    let error = database_error(with_url(
        "postgres://app:hunter2@db-host/turnstile?ssl=true",
    ));
    assert!(
        headline(&error).contains("unknown parameter `ssl`: did you mean `sslmode`?"),
        "{error}"
    );
    let error = database_error(with_url(
        "host=db-host user=app password=hunter2 connect_timout=5",
    ));
    assert!(
        headline(&error)
            .contains("unknown parameter `connect_timout`: did you mean `connect_timeout`?"),
        "{error}"
    );
}

#[test]
fn an_empty_database_url_says_so() {
    let error = database_error(|command| command.env("DATABASE_URL", ""));
    assert!(
        headline(&error).contains("the database URL (--database-url, DATABASE_URL) is empty"),
        "{error}"
    );
}

/// A port on 127.0.0.1 where every connection gets `greeting` (after the client's first bytes,
/// when `listen_first`), then is closed: something that is not PostgreSQL.
fn impostor(greeting: &'static [u8], listen_first: bool) -> u16 {
    use std::io::{Read as _, Write as _};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().map_while(Result::ok) {
            if listen_first {
                let _ = stream.read(&mut [0; 64]);
            }
            let _ = stream.write_all(greeting);
        }
    });
    port
}

#[test]
fn a_port_that_does_not_speak_postgresql_is_named() {
    let http = impostor(
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        true,
    );
    let ssh = impostor(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n", false);
    for port in [http, ssh] {
        let error = database_error(with_url(&format!(
            "postgres://app:hunter2@127.0.0.1:{port}/turnstile"
        )));
        assert!(
            headline(&error).contains(&format!(
                "127.0.0.1:{port} accepted the connection but does not speak PostgreSQL"
            )),
            "{error}"
        );
    }
}

#[tokio::test]
async fn an_unknown_database_or_user_is_named_by_sqlstate() {
    let url = support::pg::fresh_database().await;
    let (server, _) = url.rsplit_once('/').unwrap();
    let error = database_error(with_url(&format!("{server}/no_such_database")));
    assert!(
        headline(&error).contains("database `no_such_database` does not exist")
            && headline(&error).contains("3D000"),
        "{error}"
    );
    let error = database_error(with_url(&url.replacen("postgres@", "nobody:hunter2@", 1)));
    assert!(
        headline(&error).contains("does not let user `nobody` connect")
            && headline(&error).contains("28000"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_password_is_named() {
    // A cluster of its own that asks every user but `postgres` for a password.
    let cluster = tokio::task::spawn_blocking(|| {
        support::pg::Cluster::start_with(&["password_encryption=scram-sha-256"], |cluster| {
            cluster.write_private(
                &cluster.data_dir().join("pg_hba.conf"),
                b"local all all trust\n\
                  host all postgres 127.0.0.1/32 trust\n\
                  host all all 127.0.0.1/32 scram-sha-256\n",
            );
        })
    })
    .await
    .unwrap();
    let admin = support::pg::session(&cluster.url("postgres")).await;
    // Two statements: CREATE DATABASE cannot run in the transaction a batch of them is.
    for statement in [
        "CREATE ROLE app LOGIN PASSWORD 'right'",
        "CREATE DATABASE app OWNER app",
    ] {
        admin.batch_execute(statement).await.unwrap();
    }
    let at = format!("127.0.0.1:{}", cluster.port());

    let error = database_error(with_url(&format!("postgres://app:hunter2@{at}/postgres")));
    assert!(
        headline(&error).contains(&format!(
            "password authentication failed for user `app` at {at}"
        )) && headline(&error).contains("28P01"),
        "{error}"
    );
    let error = database_error(with_url(&format!("postgres://app@{at}/postgres")));
    assert!(
        headline(&error).contains(&format!(
            "PostgreSQL at {at} asks user `app` for a password and none was given"
        )),
        "{error}"
    );

    // The password from a file (a mounted Secret), as the README says; a password in the URL
    // wins over it, as over libpq's password file.
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("password");
    std::fs::write(&password_file, "right\n").unwrap();
    let migrated = turnstile()
        .args(["migrate", "--database-password-file"])
        .arg(&password_file)
        .env("DATABASE_URL", format!("postgres://app@{at}/app"))
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&migrated.stderr);
    assert!(migrated.status.success(), "{log}");
    let error = database_error(|command| {
        command
            .args([
                "--database-url",
                &format!("postgres://app:hunter2@{at}/app"),
            ])
            .env("TURNSTILE_DATABASE_PASSWORD_FILE", &password_file)
    });
    assert!(headline(&error).contains("28P01"), "{error}");
    drop(cluster);
}

#[tokio::test]
async fn without_migrating_on_start_turns_wait_for_the_migration_job_and_the_log_says_why_once() {
    let url = support::pg::fresh_database().await;
    let port = free_port();
    let server = turnstile()
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--migrate-on-start", "false", "--gateway-listen", "off"])
        .env("DATABASE_URL", &url)
        .spawn()
        .unwrap();
    drop(connect(port).await);
    let address = format!("http://127.0.0.1:{port}");
    let turns_health = move || {
        let address = address.clone();
        tokio::task::spawn_blocking(move || {
            health_check(&[
                "--address",
                &address,
                "--service",
                "turnstile.v1.TurnService",
            ])
        })
    };
    let (serving, out) = turns_health().await.unwrap();
    assert!(!serving, "{out}");
    assert!(out.starts_with("NOT_SERVING"), "{out}");
    // The log line is written by the first check, moments after the start.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let job = turnstile()
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(
        job.status.success(),
        "{}",
        String::from_utf8_lossy(&job.stderr)
    );
    let mut serving = false;
    for _ in 0..40 {
        let (ok, _) = turns_health().await.unwrap();
        if ok {
            serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        serving,
        "TurnService never became SERVING after the migration"
    );
    let mut client = TurnServiceClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    say(&mut client, "c1", "add ham").await;
    drop(client);

    let (status, log) = tokio::task::spawn_blocking(move || terminate(server))
        .await
        .unwrap();
    assert!(status.success(), "{log}");
    let needed = std::fs::read_dir("migrations").unwrap().count();
    let reason = format!(
        "the database has no Turnstile schema (no migration has run there) and this server needs \
         version {needed}: run `turnstile migrate`"
    );
    assert_eq!(log.matches(&reason).count(), 1, "logged once: {log}");
    assert!(log.contains("serving turns"), "{log}");
}
