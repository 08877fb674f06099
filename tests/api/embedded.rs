//! `turnstile serve` with its embedded gateway, as a newcomer runs it: the log says where to
//! chat, the chat page and Direct Line answer there and reach the pizza bot over the server's own
//! gRPC port, an open Direct Line stream does not hold SIGTERM up, and the gateway stays out when
//! turned off or when the gRPC port requires a token. A bot's `MicrosoftAppId` and
//! `MicrosoftAppPassword` are enforced by the embedded gateway as by `turnstile gateway`, and
//! without them neither serves beyond loopback unless told to.
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
    spawn_with(&[], env)
}

/// `turnstile ARGS…` with a clean environment apart from `env`.
fn spawn_with(args: &[&str], env: &[(&str, String)]) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turnstile"));
    command
        .args(args)
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

/// SIGTERM, then the exit status and the log, off the runtime's threads; within 20 s.
async fn stop(child: Child) -> (std::process::ExitStatus, String) {
    tokio::task::spawn_blocking(move || terminate(child, Duration::from_secs(20)))
        .await
        .unwrap()
}

/// The exit status and the log of a process that exits by itself; within 20 s.
async fn exited(child: Child) -> (std::process::ExitStatus, String) {
    tokio::task::spawn_blocking(move || wait_for_exit(child, Duration::from_secs(20)))
        .await
        .unwrap()
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
    let (status, log) = exited(child).await;
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
        let (status, log) = stop(child).await;
        assert!(status.success(), "{status}: {log}");
        assert!(!log.contains("to chat"), "{log}");
        if let Some(warning) = expect {
            assert!(log.contains(warning), "{env:?}: {log}");
        }
    }
}

/// Waits for `turnstile serve` on `grpc` to report SERVING.
async fn wait_serving(grpc: u16) {
    let address = format!("http://127.0.0.1:{grpc}");
    for _ in 0..200 {
        if support::health_check(&["--address", &address]).0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the server never served");
}

/// A message activity as a channel POSTs it to `/api/messages`.
fn channel_activity() -> Value {
    json!({
        "type": "message", "id": "m1", "channelId": "msteams",
        "serviceUrl": "http://127.0.0.1:9/unused",
        "conversation": {"id": "c1"}, "from": {"id": "ada"}, "recipient": {"id": "bot"},
        "text": "add ham",
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bots_app_credentials_are_enforced_by_the_embedded_gateway_on_any_address() {
    for direct_line_secret in [None, Some("dl-secret")] {
        let (grpc, web) = (free_port(), free_port());
        let mut env = vec![
            ("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}")),
            ("TURNSTILE_GATEWAY_LISTEN", format!("0.0.0.0:{web}")),
            ("MicrosoftAppId", "9c5d3e4a-app".to_owned()),
            ("MicrosoftAppPassword", "app-password".to_owned()),
        ];
        if let Some(secret) = direct_line_secret {
            env.push(("DirectLineSecret", secret.to_owned()));
        }
        let child = spawn(&env);
        wait_serving(grpc).await;
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{web}");
        let unsigned = http
            .post(format!("{base}/api/messages"))
            .json(&channel_activity())
            .send()
            .await
            .unwrap();
        assert_eq!(
            unsigned.status(),
            reqwest::StatusCode::UNAUTHORIZED,
            "a call without the channel's token runs no turn"
        );
        let forged = http
            .post(format!("{base}/api/messages"))
            .bearer_auth("eyJhbGciOiJub25lIn0.e30.")
            .json(&channel_activity())
            .send()
            .await
            .unwrap();
        assert_eq!(forged.status(), reqwest::StatusCode::UNAUTHORIZED);
        let open = http
            .post(format!("{base}/v3/directline/conversations"))
            .send()
            .await
            .unwrap();
        let page = http.get(format!("{base}/")).send().await.unwrap();
        match direct_line_secret {
            // With an app id and no Direct Line secret, Direct Line and the page are off.
            None => {
                assert_eq!(open.status(), reqwest::StatusCode::NOT_FOUND);
                assert_eq!(page.status(), reqwest::StatusCode::NOT_FOUND);
            }
            Some(secret) => {
                assert_eq!(open.status(), reqwest::StatusCode::UNAUTHORIZED);
                let started = http
                    .post(format!("{base}/v3/directline/conversations"))
                    .bearer_auth(secret)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(started.status(), reqwest::StatusCode::CREATED);
            }
        }
        let (status, log) = stop(child).await;
        assert!(status.success(), "{status}: {log}");
        assert!(!log.contains("NO MicrosoftAppId"), "{log}");
        assert!(!log.contains("WITHOUT AUTHENTICATION"), "{log}");
        assert!(
            !log.contains("app-password"),
            "the secret is never logged: {log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_credentials_an_address_beyond_loopback_stops_the_start_naming_the_fix() {
    let (grpc, web) = (free_port(), free_port());
    let serve = spawn(&[
        ("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}")),
        ("TURNSTILE_GATEWAY_LISTEN", format!("0.0.0.0:{web}")),
    ]);
    let gateway = spawn_with(
        &["gateway", "--listen", &format!("0.0.0.0:{}", free_port())],
        &[],
    );
    for (child, flag) in [(serve, "--gateway-insecure"), (gateway, "--insecure")] {
        let (status, log) = exited(child).await;
        assert!(!status.success(), "{flag}: it must not serve: {log}");
        assert!(
            log.contains("refusing to serve the gateway on 0.0.0.0:"),
            "{flag}: {log}"
        );
        assert!(log.contains("MicrosoftAppId"), "{flag}: {log}");
        assert!(log.contains(flag), "{flag}: names the way out: {log}");
    }
    assert!(
        reqwest::get(format!("http://127.0.0.1:{web}/"))
            .await
            .is_err(),
        "nothing was served"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_insecure_serves_beyond_loopback_and_warns() {
    let (grpc, web) = (free_port(), free_port());
    let child = spawn(&[
        ("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}")),
        ("TURNSTILE_GATEWAY_LISTEN", format!("0.0.0.0:{web}")),
        ("TURNSTILE_GATEWAY_INSECURE", "true".to_owned()),
    ]);
    let (status, page) = get_when_up(&format!("http://127.0.0.1:{web}/")).await;
    assert_eq!(status, reqwest::StatusCode::OK);
    assert!(page.contains("<script src=\"/chat.js\">"), "{page}");
    let (status, log) = stop(child).await;
    assert!(status.success(), "{status}: {log}");
    assert!(
        log.contains(
            "--gateway-insecure: the gateway serves WITHOUT AUTHENTICATION beyond loopback"
        ),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chat_page_talks_to_the_bot_named_by_gateway_bot() {
    let (grpc, web) = (free_port(), free_port());
    let child = spawn(&[
        ("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}")),
        ("TURNSTILE_GATEWAY_LISTEN", format!("127.0.0.1:{web}")),
        ("TURNSTILE_GATEWAY_BOT", "counter".to_owned()),
    ]);
    let (status, _) = get_when_up(&format!("http://127.0.0.1:{web}/")).await;
    assert_eq!(status, reqwest::StatusCode::OK);
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{web}/v3/directline");
    let started: Value = http
        .post(format!("{base}/conversations"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let conversation = started["conversationId"].as_str().unwrap();
    let token = started["token"].as_str().unwrap();
    for text in ["hello", "again"] {
        let posted = http
            .post(format!("{base}/conversations/{conversation}/activities"))
            .bearer_auth(token)
            .json(&json!({"type": "message", "from": {"id": "me"}, "text": text}))
            .send()
            .await
            .unwrap();
        assert_eq!(posted.status(), reqwest::StatusCode::OK);
    }
    let transcript: Value = http
        .get(format!("{base}/conversations/{conversation}/activities"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let replies: Vec<&str> = transcript["activities"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["from"]["role"] == "bot")
        .filter_map(|a| a["text"].as_str())
        .collect();
    assert_eq!(replies, ["count: 1", "count: 2"], "{transcript}");
    let (status, log) = stop(child).await;
    assert!(status.success(), "{status}: {log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_bot_that_is_not_hosted_stops_the_start_naming_it() {
    let child = spawn(&[
        ("TURNSTILE_LISTEN", format!("127.0.0.1:{}", free_port())),
        (
            "TURNSTILE_GATEWAY_LISTEN",
            format!("127.0.0.1:{}", free_port()),
        ),
        ("TURNSTILE_GATEWAY_BOT", "calzone".to_owned()),
    ]);
    let (status, log) = exited(child).await;
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("the gateway's bot `calzone` is not hosted here"),
        "{log}"
    );
    assert!(log.contains("pizza"), "lists the hosted bots: {log}");
    assert!(log.contains("--remote-bot calzone="), "{log}");
}
