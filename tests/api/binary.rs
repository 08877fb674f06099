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
