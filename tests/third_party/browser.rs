//! Real browsers through Direct Line: headless Chromium orders a pizza on the project's own chat
//! page (from a development gateway, as `cargo run --release` serves it) and in Microsoft's Web
//! Chat (its npm bundle, served by the test from another origin, with a token a website's backend
//! would have made from the Direct Line secret), and the bot's replies are read from each page;
//! and on both pages the `llm` bot's answer is seen as a draft while it is written, then settled
//! (the livestream). Screenshots go to `<target>/artifacts/browser/`.
//!
//! The tools install themselves on first use: Debian's `chromium` with apt when
//! `/usr/bin/chromium` is missing, and npm's `puppeteer-core` and `botframework-webchat` into
//! `<target>/tools/`. That needs root (or chromium already installed), `npm`, `tar`, `node` and
//! the registries; without them the test fails and says what is missing.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::Router;
use axum::http::header;
use axum::response::Html;
use axum::routing::get;
use serde_json::{Value, json};
use support::TestApp;
use tokio::sync::oneshot;
use turnstile::activity::Activity;
use turnstile::bots::LlmBot;
use turnstile::gateway::{GatewayConfig, Secret};
use turnstile::{Bot, BotError, TurnContext};

const PUPPETEER: &str = "puppeteer-core@24.43.1";
const WEBCHAT: &str = "botframework-webchat@4.18.1";
const CHROMIUM: &str = "/usr/bin/chromium";
const SECRET: &str = "browser-test-direct-line-secret";
const DRIVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/browser/drive.js"
);
const STREAM_DRIVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/browser/stream.js"
);
/// How long the browser may take for both pages, installs excluded; far above the seconds it
/// needs, so that only a hang fails the test.
const BROWSER_LIMIT: Duration = Duration::from_secs(300);

const REPLIES: [&str; 3] = [
    "Added mushroom. Your pizza has: mushroom.",
    "Added cheese. Your pizza has: mushroom, cheese.",
    "Your pizza has: mushroom, cheese.",
];
const SAID: [&str; 3] = ["add mushroom", "add cheese", "show"];

/// Answers `menu` with a hero card and suggested actions, anything else with what it heard: what
/// the own page must render as buttons, and what a click must send.
struct Menu;

#[async_trait]
impl Bot for Menu {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let text = turn.text().to_owned();
        if text != "menu" {
            turn.send_text(format!("You said: {text}"));
            return Ok(());
        }
        let menu = Activity::from_json(json!({
            "type": "message",
            "text": "Today's pizza",
            "attachments": [{
                "contentType": "application/vnd.microsoft.card.hero",
                "content": {
                    "title": "Margherita",
                    "subtitle": "Tomato, mozzarella, basil",
                    "text": "Baked to order.",
                    "buttons": [{"type": "imBack", "title": "Order it", "value": "order margherita"}],
                },
            }],
            "suggestedActions": {"actions": [
                {"type": "imBack", "title": "Small", "value": "small"},
                {"type": "imBack", "title": "Large", "value": "large"},
            ]},
        }))
        .map_err(|e| BotError::msg(e.to_string()))?;
        turn.send(menu);
        Ok(())
    }
}

struct Tools {
    puppeteer: PathBuf,
    webchat_js: PathBuf,
}

fn tools() -> &'static Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS.get_or_init(|| {
        if !Path::new(CHROMIUM).exists() {
            install_chromium();
        }
        let puppeteer = support::tools::installed("puppeteer-core-24.43.1", |into| {
            support::tools::run(
                Command::new("npm")
                    .args(["install", "--no-audit", "--no-fund", "--silent", "--prefix"])
                    .arg(into)
                    .arg(PUPPETEER),
                "npm install puppeteer-core (is npm installed and the registry reachable?)",
            );
        });
        let webchat = support::tools::installed("botframework-webchat-4.18.1", |into| {
            support::tools::run(
                Command::new("npm")
                    .args(["pack", "--silent", WEBCHAT])
                    .current_dir(into),
                "npm pack botframework-webchat (is npm installed and the registry reachable?)",
            );
            support::tools::run(
                Command::new("tar")
                    .args([
                        "xzf",
                        "botframework-webchat-4.18.1.tgz",
                        "package/dist/webchat.js",
                    ])
                    .current_dir(into),
                "tar xzf",
            );
            std::fs::rename(
                into.join("package/dist/webchat.js"),
                into.join("webchat.js"),
            )
            .unwrap();
            std::fs::remove_dir_all(into.join("package")).unwrap();
            std::fs::remove_file(into.join("botframework-webchat-4.18.1.tgz")).unwrap();
        });
        Tools {
            puppeteer: puppeteer.join("node_modules/puppeteer-core"),
            webchat_js: webchat.join("webchat.js"),
        }
    })
}

fn install_chromium() {
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-q", "chromium"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .unwrap_or_else(|e| panic!("{CHROMIUM} is missing and apt-get cannot run: {e}"))
    };
    if !install().status.success() {
        let _ = Command::new("apt-get").args(["update", "-q"]).output();
        let output = install();
        assert!(
            output.status.success(),
            "{CHROMIUM} is missing and `apt-get install chromium` failed (run it as root):\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    assert!(
        Path::new(CHROMIUM).exists(),
        "chromium installed no {CHROMIUM}"
    );
}

/// Starts a gateway with `config` on a free port.
async fn gateway(config: GatewayConfig, stops: &mut Vec<oneshot::Sender<()>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(turnstile::gateway::serve(config, listener, async {
        let _ = stopped.await;
    }));
    stops.push(stop);
    addr
}

/// The page a website embedding Web Chat would serve: the bundle, and a Direct Line client on
/// the gateway's domain with a token the site's backend got from the secret.
fn web_chat_page(gateway: SocketAddr, token: &str, web_socket: bool) -> String {
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Web Chat</title>
<style>html, body, #webchat {{ height: 100%; margin: 0; }}</style></head>
<body><div id="webchat" role="main"></div>
<script src="/webchat.js"></script>
<script>
  const directLine = window.WebChat.createDirectLine({{
    domain: 'http://{gateway}/v3/directline',
    token: {token},
    webSocket: {web_socket},
  }});
  directLine.connectionStatus$.subscribe((status) => {{ window.directLineStatus = status; }});
  window.WebChat.renderWebChat({{ directLine }}, document.getElementById('webchat'));
</script></body></html>"#,
        token = Value::from(token),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pizza_is_ordered_on_the_own_page_and_in_web_chat() {
    let tools = tokio::task::spawn_blocking(tools).await.unwrap();
    let app = TestApp::postgres()
        .bots(turnstile::bots::samples().with("menu", Menu))
        .spawn()
        .await;
    let mut stops = Vec::new();
    // The own page from the gateway `turnstile serve` embeds: development, the default bot.
    let own = gateway(GatewayConfig::embedded(app.addr), &mut stops).await;
    let mut menu_config = GatewayConfig::embedded(app.addr);
    menu_config.bot = "menu".into();
    let menu = gateway(menu_config, &mut stops).await;
    // Web Chat against a gateway with a Direct Line secret, as a site would embed it.
    let mut with_secret = GatewayConfig::embedded(app.addr);
    with_secret.direct_line_secrets = vec![Secret::new(SECRET)];
    let secured = gateway(with_secret, &mut stops).await;

    let http = reqwest::Client::new();
    let generated: Value = http
        .post(format!("http://{secured}/v3/directline/tokens/generate"))
        .bearer_auth(SECRET)
        .json(&json!({"user": {"id": "dl_browser"}}))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    let conversation = generated["conversationId"].as_str().unwrap().to_owned();
    let token = generated["token"].as_str().unwrap();
    let page = web_chat_page(secured, token, true);
    // Polling too, as `webSocket: false` asks; its own conversation (a token is for one).
    let polling_page = web_chat_page(secured, &generate(&http, secured).await, false);
    let bundle = std::fs::read(&tools.webchat_js).unwrap();
    let site = Router::new()
        .route("/", get(move || async move { Html(page) }))
        .route("/polling", get(move || async move { Html(polling_page) }))
        .route(
            "/webchat.js",
            get(move || async move { ([(header::CONTENT_TYPE, "text/javascript")], bundle) }),
        );
    let site_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let site_addr = site_listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(site_listener, site).await.unwrap() });

    let artifacts = support::tools::target_dir().join("artifacts/browser");
    std::fs::create_dir_all(&artifacts).unwrap();
    let driven = {
        let puppeteer = tools.puppeteer.clone();
        let artifacts = artifacts.clone();
        tokio::task::spawn_blocking(move || {
            drive(
                &puppeteer,
                &format!("http://{own}/"),
                &format!("http://{menu}/"),
                &format!("http://{site_addr}/"),
                &artifacts,
            )
        })
        .await
        .unwrap()
    };
    eprintln!("browser: {driven}");

    let own_page = &driven["own"];
    assert_eq!(
        own_page["bot"],
        json!(REPLIES),
        "the own page's bot replies"
    );
    assert_eq!(own_page["user"], json!(SAID), "every message confirmed");
    assert_eq!(own_page["focused"], "message", "the input has the focus");
    assert_eq!(own_page["label"], "Message");
    assert_eq!(own_page["errors"], json!([]), "no script errors");
    let cards = &driven["menu"];
    assert_eq!(
        cards["card"],
        json!(["Margherita", "Tomato, mozzarella, basil"])
    );
    assert_eq!(cards["suggested"], json!(["Small", "Large"]));
    assert_eq!(
        cards["bot"],
        json!([
            "Today's pizza",
            "You said: large",
            "You said: order margherita"
        ]),
        "a suggested action and a card button send their values"
    );
    assert_eq!(
        cards["suggestedAfter"],
        json!([]),
        "used suggestions go away"
    );
    assert_eq!(cards["errors"], json!([]), "no script errors");
    for (name, web_chat) in [
        ("WebSocket", &driven["webchat"]),
        ("polling", &driven["polling"]),
    ] {
        assert_eq!(
            web_chat["bot"],
            json!(REPLIES),
            "Web Chat's bot replies ({name})"
        );
        assert_eq!(web_chat["user"], json!(SAID), "{name}");
        assert_eq!(web_chat["errors"], json!([]), "no script errors ({name})");
    }
    for name in ["own-page.png", "web-chat.png"] {
        let size = std::fs::metadata(artifacts.join(name)).unwrap().len();
        assert!(size > 1000, "{name} is a screenshot");
    }

    // Web Chat's turns went through the token's conversation, as the token's user.
    let transcript: Value = http
        .get(format!(
            "http://{secured}/v3/directline/conversations/{conversation}/activities"
        ))
        .bearer_auth(SECRET)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let activities = transcript["activities"].as_array().unwrap();
    let from_user: Vec<&str> = activities
        .iter()
        .filter(|a| a["from"]["id"] == "dl_browser")
        .map(|a| a["text"].as_str().unwrap())
        .collect();
    assert_eq!(from_user, SAID);
    let millis = |page: &Value| -> Vec<u64> {
        page["millis"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_u64().unwrap())
            .collect()
    };
    eprintln!(
        "Direct Line round trips (Enter to the reply on the page), ms: own page {:?}, \
         Web Chat over WebSocket {:?}, Web Chat polling {:?}",
        millis(own_page),
        millis(&driven["webchat"]),
        millis(&driven["polling"]),
    );
    drop(stops);
    app.stop().await.unwrap();
}

/// A token for a new conversation, as a site's backend gets it with the secret.
async fn generate(http: &reqwest::Client, gateway: SocketAddr) -> String {
    let generated: Value = http
        .post(format!("http://{gateway}/v3/directline/tokens/generate"))
        .bearer_auth(SECRET)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    generated["token"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_shows_as_a_draft_then_settles_on_the_own_page_and_in_web_chat() {
    let tools = tokio::task::spawn_blocking(tools).await.unwrap();
    // Slow enough that a browser sees the draft: about six seconds for the whole answer.
    let app = TestApp::postgres()
        .bots(turnstile::BotRegistry::new(
            "llm",
            LlmBot::new(Duration::from_millis(150)),
        ))
        .spawn()
        .await;
    let mut stops = Vec::new();
    let own = gateway(GatewayConfig::embedded(app.addr), &mut stops).await;
    let mut with_secret = GatewayConfig::embedded(app.addr);
    with_secret.direct_line_secrets = vec![Secret::new(SECRET)];
    let secured = gateway(with_secret, &mut stops).await;
    let http = reqwest::Client::new();
    let page = web_chat_page(secured, &generate(&http, secured).await, true);
    let site = Router::new()
        .route("/", get(move || async move { Html(page) }))
        .route(
            "/webchat.js",
            get(|| async { ([(header::CONTENT_TYPE, "text/javascript")], bundle()) }),
        );
    let site_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let site_addr = site_listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(site_listener, site).await.unwrap() });

    let artifacts = support::tools::target_dir().join("artifacts/browser");
    std::fs::create_dir_all(&artifacts).unwrap();
    let driven = {
        let puppeteer = tools.puppeteer.clone();
        let artifacts = artifacts.clone();
        tokio::task::spawn_blocking(move || {
            let own = format!("http://{own}/");
            let web_chat = format!("http://{site_addr}/");
            let puppeteer = puppeteer.to_str().unwrap();
            node(
                STREAM_DRIVER,
                &[puppeteer, CHROMIUM, &own, &web_chat],
                &artifacts,
                "stream-driver",
            )
        })
        .await
        .unwrap()
    };
    eprintln!("browser: {driven}");

    let answer = turnstile::bots::llm::answer("hello", 1);
    // Web Chat renders Markdown, with typographic quotes.
    let plain = |shown: &Value| -> Vec<String> {
        shown
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().replace(['“', '”'], "\""))
            .collect()
    };
    for (name, page) in [
        ("own page", &driven["own"]),
        ("Web Chat", &driven["webchat"]),
    ] {
        let draft = plain(&page["draft"]);
        assert_eq!(draft.len(), 1, "one bubble for the draft ({name}): {page}");
        let draft = draft[0].trim_end_matches('▍');
        assert!(
            draft.len() < answer.len() && answer.starts_with(draft),
            "the draft is the answer's beginning ({name}): {draft:?}"
        );
        assert_eq!(
            plain(&page["final"]),
            vec![answer.clone()],
            "the final took the draft's place ({name})"
        );
        assert_eq!(page["errors"], json!([]), "no script errors ({name})");
    }
    assert_eq!(
        driven["own"]["drafting"], 0,
        "no draft left on the own page"
    );
    // Stop under the second answer's draft: what was on screen is the reply that settles it.
    let stopped = &driven["own"]["stopped"];
    let at = stopped["at"].as_str().unwrap().trim_end_matches('▍');
    let second = turnstile::bots::llm::answer("hello", 2);
    assert!(
        at.len() < second.len() && second.starts_with(at),
        "Stop was pressed mid-answer: {stopped}"
    );
    assert_eq!(
        stopped["final"], at,
        "the committed reply is what was shown"
    );
    assert_eq!(stopped["bots"], 2, "one bubble per answer: {stopped}");
    for name in [
        "own-page-stopped.png",
        "own-page-stream-draft.png",
        "own-page-stream-final.png",
        "web-chat-stream-draft.png",
        "web-chat-stream-final.png",
    ] {
        let size = std::fs::metadata(artifacts.join(name)).unwrap().len();
        assert!(size > 1000, "{name} is a screenshot");
    }
    drop(stops);
    app.stop().await.unwrap();
}

/// Web Chat's bundle, as npm ships it.
fn bundle() -> Vec<u8> {
    std::fs::read(&tools().webchat_js).unwrap()
}

/// Runs the puppeteer driver; its JSON result.
fn drive(puppeteer: &Path, own: &str, menu: &str, web_chat: &str, artifacts: &Path) -> Value {
    let puppeteer = puppeteer.to_str().unwrap();
    node(
        DRIVER,
        &[puppeteer, CHROMIUM, own, menu, web_chat],
        artifacts,
        "driver",
    )
}

/// Runs the node `script` with `args` and then `artifacts`, its output kept in
/// `artifacts/<name>.out` and `.err`; the JSON object its last line prints.
fn node(script: &str, args: &[&str], artifacts: &Path, name: &str) -> Value {
    let stdout_path = artifacts.join(format!("{name}.out"));
    let stderr_path = artifacts.join(format!("{name}.err"));
    let mut child = Command::new("node")
        .arg(script)
        .args(args)
        .arg(artifacts)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("node is needed to drive the browser (apt-get install -y nodejs npm)");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > BROWSER_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the browser did not finish within {BROWSER_LIMIT:?}; see {}",
                stderr_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = std::fs::read_to_string(&stdout_path).unwrap();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(
        status.success(),
        "the browser driver failed ({status}):\n{stderr}\n{stdout}"
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("the driver printed no JSON ({e}):\n{stdout}\n{stderr}"))
}
