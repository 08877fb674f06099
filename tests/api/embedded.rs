//! `turnstile serve` with its embedded gateway, as a newcomer runs it: the log says where to
//! chat, the chat page and Direct Line answer there and reach the pizza bot over the server's own
//! gRPC port, an open Direct Line stream does not hold SIGTERM up, and the gateway stays out when
//! turned off or when the gRPC port requires a token.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt as _;
use serde_json::{Value, json};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `turnstile` on free ports with a clean environment apart from `env`.
fn spawn(env: &[(&str, String)]) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
    command
        .env_clear()
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    command.spawn().unwrap()
}

fn sigterm(child: &Child) {
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// SIGTERM, then the exit status and the log; the process must exit within `limit`.
fn terminate(child: Child, limit: Duration) -> (std::process::ExitStatus, String) {
    sigterm(&child);
    wait_for_exit(child, limit)
}

fn wait_for_exit(mut child: Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("still running {limit:?} after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let log: Vec<String> = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .collect();
    (status, log.join("\n"))
}

/// GET `url` until it answers (the process is starting), then its status and body.
async fn get_when_up(url: &str) -> (reqwest::StatusCode, String) {
    for _ in 0..200 {
        if let Ok(response) = reqwest::get(url).await {
            let status = response.status();
            return (status, response.text().await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing answered at {url}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cargo_run_serves_the_chat_page_and_direct_line_to_the_pizza_bot() {
    let (grpc, web) = (free_port(), free_port());
    let child = spawn(&[
        ("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}")),
        ("TURNSTILE_GATEWAY_LISTEN", format!("127.0.0.1:{web}")),
    ]);
    let (status, page) = get_when_up(&format!("http://127.0.0.1:{web}/")).await;
    assert_eq!(status, reqwest::StatusCode::OK);
    assert!(page.contains("<script src=\"/chat.js\">"), "{page}");

    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{web}/v3/directline");
    let started: Value = http
        .post(format!("{base}/conversations"))
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let conversation = started["conversationId"].as_str().unwrap();
    let token = started["token"].as_str().unwrap();
    // A stream left open, as a browser tab would.
    let (mut stream, _) = tokio_tungstenite::connect_async(started["streamUrl"].as_str().unwrap())
        .await
        .unwrap();
    let posted = http
        .post(format!("{base}/conversations/{conversation}/activities"))
        .bearer_auth(token)
        .json(&json!({"type": "message", "from": {"id": "me"}, "text": "add mushroom"}))
        .send()
        .await
        .unwrap();
    assert_eq!(posted.status(), reqwest::StatusCode::OK);
    let group = loop {
        let message = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("the stream pushes the turn")
            .unwrap()
            .unwrap();
        if let tokio_tungstenite::tungstenite::Message::Text(text) = message {
            break serde_json::from_str::<Value>(&text).unwrap();
        }
    };
    assert_eq!(
        group["activities"][1]["text"],
        "Added mushroom. Your pizza has: mushroom."
    );

    // The open stream is closed properly, and does not keep the process from stopping.
    sigterm(&child);
    let closing = loop {
        let next = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("the stream ends after SIGTERM");
        match next {
            Some(Ok(tokio_tungstenite::tungstenite::Message::Ping(_))) => continue,
            other => break other,
        }
    };
    assert!(
        matches!(
            closing,
            Some(Ok(tokio_tungstenite::tungstenite::Message::Close(_)))
        ),
        "a Close frame, not a dropped connection: {closing:?}"
    );
    let (status, log) =
        tokio::task::spawn_blocking(move || wait_for_exit(child, Duration::from_secs(20)))
            .await
            .unwrap();
    assert!(status.success(), "{status}: {log}");
    assert!(
        log.contains(&format!("open http://127.0.0.1:{web}/ to chat")),
        "says where to chat: {log}"
    );
    assert!(
        log.contains("NO DirectLineSecret"),
        "warns it is open: {log}"
    );
    assert!(log.contains("gateway stopped"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_gateway_when_turned_off_or_when_the_server_requires_a_token() {
    for (env, expect) in [
        (("TURNSTILE_GATEWAY_LISTEN", "off".to_owned()), None),
        (
            ("TURNSTILE_AUTH_TOKENS", "t0ken".to_owned()),
            Some("requires TLS or a token"),
        ),
    ] {
        let (grpc, web) = (free_port(), free_port());
        let mut vars = vec![
            ("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}")),
            env.clone(),
        ];
        if env.0 != "TURNSTILE_GATEWAY_LISTEN" {
            vars.push(("TURNSTILE_GATEWAY_LISTEN", format!("127.0.0.1:{web}")));
        }
        let child = spawn(&vars);
        // Serving gRPC means the gateway, if any, was started before (and the signal handlers
        // are in place).
        let address = format!("http://127.0.0.1:{grpc}");
        let mut up = false;
        for _ in 0..200 {
            if support::health_check(&["--address", &address]).0 {
                up = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(up, "the server never served");
        let gateway = reqwest::get(format!("http://127.0.0.1:{web}/")).await;
        assert!(
            gateway.is_err(),
            "{env:?}: nothing listens on the gateway port"
        );
        let (status, log) =
            tokio::task::spawn_blocking(move || terminate(child, Duration::from_secs(20)))
                .await
                .unwrap();
        assert!(status.success(), "{status}: {log}");
        assert!(!log.contains("to chat"), "{log}");
        if let Some(warning) = expect {
            assert!(log.contains(warning), "{env:?}: {log}");
        }
    }
}
