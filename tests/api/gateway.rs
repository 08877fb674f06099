//! `turnstile gateway` against stand-ins for everything Bot Framework runs: the test serves the
//! OpenID metadata and signing keys, the token endpoint and the Connector on 127.0.0.1, signs
//! channel tokens with an RSA key it generates, and calls `/api/messages` as a channel would;
//! and Teams' streaming of a bot that drafts its reply (the `llm` bot), against the Connector
//! stand-in.
//! Turns run in a real Turnstile server over PostgreSQL, reached only through gRPC.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use axum::extract::{Form, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::routing::{get, post};
use axum::{Json, Router};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};
use support::{TestApp, free_port};
use tokio::sync::oneshot;
use turnstile::activity::{Activity, types};
use turnstile::bots::LlmBot;
use turnstile::gateway::{AppCredentials, AppType, GatewayConfig, Secret};
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

const APP_ID: &str = "app-1234";
const ISSUER: &str = "https://api.botframework.com";
const SERVICE_URL_PATH: &str = "/connector";
const TENANT: &str = "tenant";

/// How the gateway under test authenticates.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Development,
    MultiTenant,
    SingleTenant,
}

/// Counts its runs; a message gets two replies and a trace, an invoke an `invokeResponse`.
struct Echo {
    runs: Arc<AtomicUsize>,
}

#[async_trait]
impl Bot for Echo {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let activity = turn.activity().clone();
        if activity.is_type(types::INVOKE) {
            turn.send_text("working on it");
            turn.send(Activity {
                activity_type: Some(types::INVOKE_RESPONSE.into()),
                value: Some(json!({"status": 202, "body": {"accepted": activity.name}})),
                ..Activity::default()
            });
            return Ok(());
        }
        let text = turn.text().to_owned();
        turn.send_text(format!("first: {text}"));
        turn.send(Activity {
            activity_type: Some(types::TRACE.into()),
            name: Some("diagnostics".into()),
            ..Activity::default()
        });
        turn.send_text(format!("second: {text}"));
        Ok(())
    }
}

/// Counts its runs and waits for the gate's permit before it answers `gated: <text>`: a bot as
/// slow as the test wants, without a sleep.
struct Gated {
    runs: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
}

#[async_trait]
impl Bot for Gated {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        if let Ok(permit) = self.gate.acquire().await {
            permit.forget();
        }
        let text = turn.text().to_owned();
        turn.send_text(format!("gated: {text}"));
        Ok(())
    }
}

/// What the Connector stand-in received: (path, authorization header, body).
type Received = Arc<Mutex<Vec<(String, Option<String>, Value)>>>;
/// The forms the token endpoint received.
type TokenRequests = Arc<Mutex<Vec<Vec<(String, String)>>>>;

#[derive(Clone)]
struct Channel {
    addr: SocketAddr,
    jwks: Value,
    /// The single-tenant app's Entra ID keys.
    entra_jwks: Value,
    received: Received,
    token_requests: TokenRequests,
    /// How many of the next Connector POSTs answer 503.
    fail_next: Arc<AtomicUsize>,
    /// Once this many streamed `typing` activities were received, every activity carrying a
    /// `streaminfo` entity is refused `403 ContentStreamNotAllowed`, as Teams does after Stop.
    stop_streams_after: Arc<Mutex<Option<usize>>>,
    /// Refuse `403` a message that ends a stream.
    refuse_final: Arc<std::sync::atomic::AtomicBool>,
}

async fn openid(State(ch): State<Channel>) -> Json<Value> {
    Json(json!({"issuer": ISSUER, "jwks_uri": format!("http://{}/keys", ch.addr)}))
}

async fn keys(State(ch): State<Channel>) -> Json<Value> {
    Json(ch.jwks.clone())
}

async fn entra_openid(State(ch): State<Channel>) -> Json<Value> {
    Json(
        json!({"issuer": format!("http://{}/{TENANT}/v2.0", ch.addr),
                "jwks_uri": format!("http://{}/entra-keys", ch.addr)}),
    )
}

async fn entra_keys(State(ch): State<Channel>) -> Json<Value> {
    Json(ch.entra_jwks.clone())
}

async fn token(State(ch): State<Channel>, Form(form): Form<Vec<(String, String)>>) -> Json<Value> {
    ch.token_requests.lock().unwrap().push(form);
    Json(json!({"token_type": "Bearer", "expires_in": 3600, "access_token": "bot-token-1"}))
}

async fn connector(
    State(ch): State<Channel>,
    uri: Uri,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    if ch
        .fail_next
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({})));
    }
    // The path as sent, percent-encoding included.
    let path = uri.path().strip_prefix(SERVICE_URL_PATH).unwrap();
    let auth = headers
        .get("authorization")
        .map(|h| h.to_str().unwrap().to_owned());
    let mut received = ch.received.lock().unwrap();
    let streamed = |b: &Value| {
        b["entities"]
            .as_array()
            .is_some_and(|e| e.iter().any(|e| e["type"] == "streaminfo"))
    };
    let forbidden = |limit: usize| {
        streamed(&body)
            && received
                .iter()
                .filter(|(_, _, b)| b["type"] == "typing" && streamed(b))
                .count()
                >= limit
    };
    if ch.stop_streams_after.lock().unwrap().is_some_and(forbidden) {
        return (
            StatusCode::FORBIDDEN,
            Json(json!({"error": {"code": "ContentStreamNotAllowed",
                                  "message": "Content stream is not allowed"}})),
        );
    }
    let ends_stream = stream_info(&body).is_some_and(|i| i["streamType"] == "final");
    if ch.refuse_final.load(Ordering::SeqCst) && ends_stream {
        return (
            StatusCode::FORBIDDEN,
            Json(json!({"error": {"code": "ContentStreamNotAllowed",
                                  "message": "Content stream finished due to exceeded streaming time."}})),
        );
    }
    received.push((path.to_owned(), auth, body));
    // Each activity gets its own id, as the Connector gives them.
    (
        StatusCode::OK,
        Json(json!({"id": format!("a-{}", received.len())})),
    )
}

/// An RSA key made by `openssl`, as PEM and as a JWK with `kid`.
fn rsa_key(dir: &std::path::Path, kid: &str) -> (EncodingKey, Value) {
    let pem = dir.join(format!("{kid}.pem"));
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl is needed to make test keys (apt-get install -y openssl)");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let pem_path = pem.to_str().unwrap();
    run(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        pem_path,
    ]);
    let modulus = run(&["rsa", "-in", pem_path, "-noout", "-modulus"]);
    let hex = modulus.trim().strip_prefix("Modulus=").unwrap();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let jwk = json!({
        "kty": "RSA", "use": "sig", "kid": kid,
        "n": base64url(&bytes), "e": "AQAB",
        "endorsements": ["test", "emulator", "msteams"],
    });
    let key = EncodingKey::from_rsa_pem(&std::fs::read(&pem).unwrap()).unwrap();
    (key, jwk)
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

struct World {
    gateway: SocketAddr,
    /// A gateway whose turns run the `llm` bot, which drafts its answer word by word.
    llm_gateway: SocketAddr,
    _llm_stop: oneshot::Sender<()>,
    channel: Channel,
    runs: Arc<AtomicUsize>,
    /// The `gated` bot's runs and gate.
    gated_runs: Arc<AtomicUsize>,
    gate: Arc<tokio::sync::Semaphore>,
    /// The configuration of the gateways above.
    config: GatewayConfig,
    key: EncodingKey,
    stranger: EncodingKey,
    entra: EncodingKey,
    _server: TestApp,
    _stop: oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

impl World {
    /// A Turnstile server, the channel stand-ins, and a gateway: authenticated with `auth`.
    async fn start(mode: Mode) -> World {
        let dir = tempfile::tempdir().unwrap();
        let (key, jwk) = rsa_key(dir.path(), "k1");
        let (stranger, _) = rsa_key(dir.path(), "k2");
        let (entra, mut entra_jwk) = rsa_key(dir.path(), "k3");
        entra_jwk.as_object_mut().unwrap().remove("endorsements");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let channel = Channel {
            addr: listener.local_addr().unwrap(),
            jwks: json!({"keys": [jwk]}),
            entra_jwks: json!({"keys": [entra_jwk]}),
            received: Arc::default(),
            token_requests: Arc::default(),
            fail_next: Arc::default(),
            stop_streams_after: Arc::default(),
            refuse_final: Arc::default(),
        };
        let app = Router::new()
            .route("/openid", get(openid))
            .route("/keys", get(keys))
            .route(
                &format!("/{TENANT}/v2.0/.well-known/openid-configuration"),
                get(entra_openid),
            )
            .route("/entra-keys", get(entra_keys))
            .route("/tenant/oauth2/v2.0/token", post(token))
            .route(
                &format!("{SERVICE_URL_PATH}/v3/conversations/{{*rest}}"),
                post(connector),
            )
            .with_state(channel.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

        let runs = Arc::new(AtomicUsize::new(0));
        let gated_runs = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        // Without the state cache, a redelivery's first load finds the receipt, so the bot does
        // not run at all; with it, the bot may run once more and its result is discarded when
        // the commit meets the receipt, which `runs` could not tell from a second turn.
        let server = TestApp::postgres()
            .bots(
                BotRegistry::new(
                    "echo",
                    Echo {
                        runs: Arc::clone(&runs),
                    },
                )
                .with("llm", LlmBot::new(Duration::from_millis(100)))
                // A later message cancels the running answer (double-text `interrupt`).
                .with_double_text("llm", turnstile::DoubleText::Interrupt)
                .unwrap()
                .with(
                    "gated",
                    Gated {
                        runs: Arc::clone(&gated_runs),
                        gate: Arc::clone(&gate),
                    },
                )
                // The same bot, refusing messages while it answers one (double-text `reject`).
                .with(
                    "busy",
                    Gated {
                        runs: Arc::clone(&gated_runs),
                        gate: Arc::clone(&gate),
                    },
                )
                .with_double_text("busy", turnstile::DoubleText::Reject)
                .unwrap(),
            )
            .config(|c| turnstile::Config {
                state_cache_entries: 0,
                ..c
            })
            .spawn()
            .await;
        let mut config = GatewayConfig::development(format!("http://{}", server.addr));
        config.delivery.base_delay = Duration::from_millis(20);
        if mode != Mode::Development {
            let base = format!("http://{}", channel.addr);
            config.credentials = Some(AppCredentials {
                app_id: APP_ID.into(),
                password: Secret::new("s3cret"),
                app_type: if mode == Mode::SingleTenant {
                    AppType::SingleTenant
                } else {
                    AppType::MultiTenant
                },
                tenant_id: Some(TENANT.into()).filter(|_| mode == Mode::SingleTenant),
                openid_metadata_url: format!("{base}/openid"),
                token_issuer: ISSUER.into(),
                login_url: format!("{base}/{TENANT}"),
                oauth_scope: "https://api.botframework.com".into(),
            });
        }
        let mut llm_config = config.clone();
        llm_config.bot = "llm".into();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(turnstile::gateway::serve(config.clone(), listener, async {
            let _ = stopped.await;
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let llm_gateway = listener.local_addr().unwrap();
        let (llm_stop, llm_stopped) = oneshot::channel::<()>();
        tokio::spawn(turnstile::gateway::serve(llm_config, listener, async {
            let _ = llm_stopped.await;
        }));
        World {
            gateway,
            llm_gateway,
            _llm_stop: llm_stop,
            channel,
            runs,
            gated_runs,
            gate,
            config,
            key,
            stranger,
            entra,
            _server: server,
            _stop: stop,
            _dir: dir,
        }
    }

    fn service_url(&self) -> String {
        format!("http://{}{SERVICE_URL_PATH}", self.channel.addr)
    }

    fn activity(&self, id: &str, text: &str) -> Value {
        json!({
            "type": "message",
            "id": id,
            "channelId": "test",
            "serviceUrl": self.service_url(),
            "conversation": {"id": "19:conv@thread.skype"},
            "from": {"id": "user-1", "name": "Ada"},
            "recipient": {"id": APP_ID, "name": "bot"},
            "text": text,
        })
    }

    /// A channel token: valid unless `claims` overrides something, signed with `key`.
    fn token(&self, key: &EncodingKey, kid: &str, claims: Value) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let mut all = json!({
            "iss": ISSUER, "aud": APP_ID, "exp": now + 600, "nbf": now - 10,
            "serviceurl": self.service_url(),
        });
        for (k, v) in claims.as_object().unwrap() {
            all[k] = v.clone();
        }
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(kid.into());
        jsonwebtoken::encode(&header, &all, key).unwrap()
    }

    fn valid_token(&self) -> String {
        self.token(&self.key, "k1", json!({}))
    }

    async fn post(&self, activity: &Value, token: Option<&str>) -> (StatusCode, String) {
        self.post_to(self.gateway, activity, token).await
    }

    async fn post_to(
        &self,
        gateway: SocketAddr,
        activity: &Value,
        token: Option<&str>,
    ) -> (StatusCode, String) {
        let mut request = reqwest::Client::new()
            .post(format!("http://{gateway}/api/messages"))
            .json(activity);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
        (status, response.text().await.unwrap())
    }

    fn delivered(&self) -> Vec<(String, Option<String>, Value)> {
        self.channel.received.lock().unwrap().clone()
    }

    /// What the Connector received, once it is at least `count` activities: a turn answered
    /// `202` delivers after the answer.
    async fn delivered_at_least(&self, count: usize) -> Vec<(String, Option<String>, Value)> {
        eventually(&format!("{count} activities delivered"), || {
            self.delivered().len() >= count
        })
        .await;
        self.delivered()
    }

    /// The bodies the Connector received, once one of them is a `message`: the reply that ends
    /// a Teams turn.
    async fn delivered_until_message(&self) -> Vec<Value> {
        eventually("a message delivered", || {
            self.delivered().iter().any(|d| d.2["type"] == "message")
        })
        .await;
        self.delivered().into_iter().map(|(_, _, b)| b).collect()
    }

    /// A gateway in front of the `gated` bot whose waiting calls have 200 ms and whose
    /// background turns 5 s (then `configure`d), with its shutdown and its task.
    fn gated_gateway(
        &self,
        listener: tokio::net::TcpListener,
        configure: impl FnOnce(&mut GatewayConfig),
    ) -> (
        oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<(), turnstile::gateway::GatewayError>>,
    ) {
        let mut config = self.config.clone();
        config.bot = "gated".into();
        config.turn_timeout = Duration::from_millis(200);
        config.bot_turn_timeout = Duration::from_secs(5);
        configure(&mut config);
        let (stop, stopped) = oneshot::channel::<()>();
        let served = tokio::spawn(turnstile::gateway::serve(config, listener, async {
            let _ = stopped.await;
        }));
        (stop, served)
    }
}

/// Polls until `done` holds, for up to 30 s; fails naming `what` otherwise.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..1500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never happened: {what}");
}

fn texts(delivered: &[(String, Option<String>, Value)]) -> Vec<String> {
    delivered
        .iter()
        .map(|(_, _, body)| body["text"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[tokio::test]
async fn a_valid_token_runs_the_turn_and_replies_reach_the_channel_in_order_with_a_token() {
    let world = World::start(Mode::MultiTenant).await;
    let (status, body) = world
        .post(&world.activity("a1", "hi"), Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert!(body.is_empty(), "{body}");
    let delivered = world.delivered_at_least(2).await;
    assert_eq!(world.runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        texts(&delivered),
        ["first: hi", "second: hi"],
        "in order, no trace"
    );
    for (path, auth, body) in &delivered {
        assert_eq!(
            path, "/v3/conversations/19%3Aconv%40thread.skype/activities/a1",
            "a reply to a1"
        );
        assert_eq!(auth.as_deref(), Some("Bearer bot-token-1"));
        assert_eq!(body["replyToId"], "a1");
        assert_eq!(body["recipient"]["id"], "user-1");
    }
    let requests = world.channel.token_requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 1, "the bot's token is cached");
    let form: std::collections::HashMap<_, _> = requests[0].iter().cloned().collect();
    assert_eq!(form["grant_type"], "client_credentials");
    assert_eq!(form["client_id"], APP_ID);
    assert_eq!(form["client_secret"], "s3cret");
    assert_eq!(form["scope"], "https://api.botframework.com/.default");

    // Within the five minutes of clock skew, an expired token still passes.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let late = world.token(&world.key, "k1", json!({"exp": now - 120}));
    let (status, _) = world.post(&world.activity("a2", "late"), Some(&late)).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    world.delivered_at_least(4).await;
    assert_eq!(world.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn every_bad_token_is_401_and_runs_nothing() {
    let world = World::start(Mode::MultiTenant).await;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let cases = [
        ("no token", None),
        ("garbage", Some("not.a.jwt".to_owned())),
        (
            "expired",
            Some(world.token(&world.key, "k1", json!({"exp": now - 600}))),
        ),
        (
            "wrong audience",
            Some(world.token(&world.key, "k1", json!({"aud": "another-app"}))),
        ),
        (
            "wrong issuer",
            Some(world.token(&world.key, "k1", json!({"iss": "https://evil.example"}))),
        ),
        (
            "unknown key",
            Some(world.token(&world.stranger, "k2", json!({}))),
        ),
        (
            "known kid, wrong key",
            Some(world.token(&world.stranger, "k1", json!({}))),
        ),
        (
            "serviceUrl mismatch",
            Some(world.token(
                &world.key,
                "k1",
                json!({"serviceurl": "https://evil.example/"}),
            )),
        ),
        (
            "no serviceurl claim",
            Some(world.token(&world.key, "k1", json!({"serviceurl": null}))),
        ),
    ];
    for (i, (case, token)) in cases.iter().enumerate() {
        let (status, body) = world
            .post(&world.activity(&format!("bad-{i}"), "hi"), token.as_deref())
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{case}: {body}");
    }
    assert_eq!(world.runs.load(Ordering::SeqCst), 0, "no turn ran");
    assert!(world.delivered().is_empty(), "nothing was delivered");

    // A channel not endorsed for the key is refused too.
    let mut other_channel = world.activity("bad-channel", "hi");
    other_channel["channelId"] = json!("slack");
    let (status, _) = world.post(&other_channel, Some(&world.valid_token())).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(world.runs.load(Ordering::SeqCst), 0);

    let (status, _) = world
        .post(&world.activity("good", "hi"), Some(&world.valid_token()))
        .await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "the same gateway accepts a valid token"
    );
}

#[tokio::test]
async fn a_503_from_the_channel_is_retried_and_a_redelivery_runs_nothing_and_delivers_nothing_twice()
 {
    let world = World::start(Mode::MultiTenant).await;
    world.channel.fail_next.store(1, Ordering::SeqCst);
    let activity = world.activity("r1", "again");
    let (status, _) = world.post(&activity, Some(&world.valid_token())).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let delivered = world.delivered_at_least(2).await;
    assert_eq!(
        world.channel.fail_next.load(Ordering::SeqCst),
        0,
        "the 503 was served"
    );
    assert_eq!(texts(&delivered), ["first: again", "second: again"]);

    // Redelivered once the replies were delivered: answered from the receipt, not delivered
    // again (the user has them).
    let (status, _) = world.post(&activity, Some(&world.valid_token())).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(world.runs.load(Ordering::SeqCst), 1, "the bot ran once");
    assert_eq!(world.delivered().len(), 2, "{:?}", world.delivered());
}

#[tokio::test]
async fn a_channel_that_keeps_failing_gets_its_replies_on_redelivery_from_the_receipt() {
    let world = World::start(Mode::MultiTenant).await;
    world.channel.fail_next.store(100, Ordering::SeqCst);
    let (status, _) = world
        .post(&world.activity("f1", "lost"), Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "answered before delivery");
    // The policy's four POSTs of the first reply, all refused: the failure is only logged.
    eventually("the first reply's four attempts", || {
        world.channel.fail_next.load(Ordering::SeqCst) == 96
    })
    .await;
    world.channel.fail_next.store(0, Ordering::SeqCst);
    let (status, _) = world
        .post(&world.activity("f1", "lost"), Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let delivered = world.delivered_at_least(2).await;
    assert_eq!(texts(&delivered), ["first: lost", "second: lost"]);
    assert_eq!(world.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn expect_replies_answers_in_the_body_and_invoke_with_the_invoke_response() {
    let world = World::start(Mode::MultiTenant).await;
    let mut activity = world.activity("e1", "inline");
    activity["deliveryMode"] = json!("expectReplies");
    let (status, body) = world.post(&activity, Some(&world.valid_token())).await;
    assert_eq!(status, StatusCode::OK);
    let body: Value = serde_json::from_str(&body).unwrap();
    let replies = body["activities"].as_array().unwrap();
    let texts: Vec<_> = replies
        .iter()
        .map(|r| r["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["first: inline", "second: inline"]);
    assert!(
        world.delivered().is_empty(),
        "nothing went through the Connector"
    );

    let mut invoke = world.activity("i1", "");
    invoke["type"] = json!("invoke");
    invoke["name"] = json!("adaptiveCard/action");
    let (status, body) = world.post(&invoke, Some(&world.valid_token())).await;
    assert_eq!(status.as_u16(), 202, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap(),
        json!({"accepted": "adaptiveCard/action"})
    );
    assert_eq!(
        texts_of(&world),
        ["working on it"],
        "other replies were delivered"
    );
}

fn texts_of(world: &World) -> Vec<String> {
    texts(&world.delivered())
}

#[tokio::test]
async fn development_mode_needs_no_token_and_the_emulator_gets_traces() {
    let world = World::start(Mode::Development).await;
    let mut activity = world.activity("d1", "dev");
    activity["channelId"] = json!("emulator");
    let (status, _) = world.post(&activity, None).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let delivered = world.delivered_at_least(3).await;
    let kinds: Vec<_> = delivered.iter().map(|d| d.2["type"].clone()).collect();
    assert_eq!(
        kinds,
        ["message", "trace", "message"],
        "the emulator sees traces"
    );
    assert!(
        delivered.iter().all(|d| d.1.is_none()),
        "no token in development"
    );
}

/// `turnstile …` with a clean environment apart from `env`.
fn spawn_turnstile(args: &[&str], env: &[(&str, String)]) -> std::process::Child {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_turnstile"));
    command
        .args(args)
        .env_clear()
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    command.spawn().unwrap()
}

/// SIGTERM, then the exit status and the log.
fn terminate(mut child: std::process::Child) -> (std::process::ExitStatus, String) {
    use std::io::Read as _;
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    (child.wait().unwrap(), log)
}

#[tokio::test]
async fn the_binary_orders_a_pizza_through_the_gateway_in_development_mode() {
    let grpc = free_port();
    let http = free_port();
    let server = spawn_turnstile(
        &["serve"],
        &[("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}"))],
    );
    let gateway = spawn_turnstile(
        &["gateway"],
        &[
            ("TURNSTILE_GATEWAY_LISTEN", format!("127.0.0.1:{http}")),
            ("TURNSTILE_URL", format!("http://127.0.0.1:{grpc}")),
        ],
    );
    let activity = json!({
        "type": "message", "id": "p1", "channelId": "emulator",
        "serviceUrl": "http://127.0.0.1:9/unused", "deliveryMode": "expectReplies",
        "conversation": {"id": "pizza-1"}, "from": {"id": "ada"}, "recipient": {"id": "bot"},
        "text": "add ham",
    });
    let client = reqwest::Client::new();
    let mut answer = None;
    // Both processes start in parallel; the gateway answers 503 until the server listens.
    for _ in 0..200 {
        if let Ok(response) = client
            .post(format!("http://127.0.0.1:{http}/api/messages"))
            .json(&activity)
            .send()
            .await
            && response.status().is_success()
        {
            answer = Some(response.json::<Value>().await.unwrap());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = answer.expect("the gateway answered");
    assert_eq!(
        answer["activities"][0]["text"],
        "Added ham. Your pizza has: ham."
    );
    let (status, log) = terminate(gateway);
    assert!(status.success(), "the gateway stopped cleanly: {log}");
    assert!(
        log.contains("WITHOUT AUTHENTICATION"),
        "the loud warning: {log}"
    );
    let (status, _) = terminate(server);
    assert!(status.success());
}

#[tokio::test]
async fn a_single_tenant_app_also_accepts_its_tenants_entra_id_tokens() {
    let world = World::start(Mode::SingleTenant).await;
    let entra_v1 = world.token(
        &world.entra,
        "k3",
        json!({"iss": format!("https://sts.windows.net/{TENANT}/")}),
    );
    let (status, body) = world
        .post(&world.activity("s1", "entra"), Some(&entra_v1))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let (status, _) = world
        .post(&world.activity("s2", "channel"), Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "channel tokens still work");
    world.delivered_at_least(4).await;
    assert_eq!(world.runs.load(Ordering::SeqCst), 2);

    // An Entra ID key does not vouch for the channel's issuer, nor a channel key for Entra's.
    let crossed = world.token(&world.entra, "k3", json!({}));
    let (status, _) = world.post(&world.activity("s3", "x"), Some(&crossed)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let crossed = world.token(
        &world.key,
        "k1",
        json!({"iss": format!("https://sts.windows.net/{TENANT}/")}),
    );
    let (status, _) = world.post(&world.activity("s4", "x"), Some(&crossed)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(world.runs.load(Ordering::SeqCst), 2);
    let requests = world.channel.token_requests.lock().unwrap().clone();
    assert!(
        !requests.is_empty(),
        "replies were sent with the tenant's token"
    );
}

#[tokio::test]
async fn a_multi_tenant_app_refuses_entra_id_tokens() {
    let world = World::start(Mode::MultiTenant).await;
    let entra_v1 = world.token(
        &world.entra,
        "k3",
        json!({"iss": format!("https://sts.windows.net/{TENANT}/")}),
    );
    let (status, _) = world
        .post(&world.activity("m1", "entra"), Some(&entra_v1))
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(world.runs.load(Ordering::SeqCst), 0);
}

/// A `TurnService` that answers every turn with no replies and keeps the conversation metadata
/// each call carried, so that a test sees what a mesh in front of Turnstile would hash on; it
/// has no `StreamTurn` (a server from before streaming), so a streamed turn falls back.
#[derive(Default, Clone)]
struct MetadataRecorder(Arc<Mutex<Vec<Option<String>>>>);

#[tonic::async_trait]
impl turnstile::grpc::pb::turn_service_server::TurnService for MetadataRecorder {
    async fn process_turn(
        &self,
        request: tonic::Request<turnstile::grpc::pb::ProcessTurnRequest>,
    ) -> Result<tonic::Response<turnstile::grpc::pb::ProcessTurnResponse>, tonic::Status> {
        let seen = request
            .metadata()
            .get(turnstile::grpc::affinity::CONVERSATION_METADATA)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        self.0.lock().unwrap().push(seen);
        Ok(tonic::Response::new(Default::default()))
    }

    type StreamTurnStream = turnstile::grpc::service::TurnEvents;

    async fn stream_turn(
        &self,
        request: tonic::Request<turnstile::grpc::pb::StreamTurnRequest>,
    ) -> Result<tonic::Response<Self::StreamTurnStream>, tonic::Status> {
        let seen = request
            .metadata()
            .get(turnstile::grpc::affinity::CONVERSATION_METADATA)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        self.0.lock().unwrap().push(seen);
        Err(tonic::Status::unimplemented(
            "the gateway does not stream here",
        ))
    }

    async fn stop_turn(
        &self,
        _: tonic::Request<turnstile::grpc::pb::StopTurnRequest>,
    ) -> Result<tonic::Response<turnstile::grpc::pb::StopTurnResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("nothing streams here"))
    }
}

#[tokio::test]
async fn every_turn_carries_its_conversation_as_metadata_a_mesh_can_hash_on() {
    let recorder = MetadataRecorder::default();
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_addr = grpc.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                turnstile::grpc::pb::turn_service_server::TurnServiceServer::new(recorder.clone()),
            )
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc)),
    );
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = http.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(turnstile::gateway::serve(
        GatewayConfig::development(format!("http://{grpc_addr}")),
        http,
        async {
            let _ = stopped.await;
        },
    ));

    for (id, conversation) in [("a1", "room/42"), ("a2", "café 7"), ("a3", "dm 1")] {
        let mut activity = json!({
            "type": "message", "id": id, "channelId": "msteams",
            "serviceUrl": "http://127.0.0.1:9", "deliveryMode": "expectReplies",
            "conversation": {"id": conversation}, "from": {"id": "alice"},
            "recipient": {"id": "bot"}, "text": "hi"
        });
        if id == "a3" {
            // A personal chat is streamed: StreamTurn, then ProcessTurn when it is missing.
            activity["conversation"]["conversationType"] = json!("personal");
            activity.as_object_mut().unwrap().remove("deliveryMode");
        }
        let status = reqwest::Client::new()
            .post(format!("http://{http_addr}/api/messages"))
            .json(&activity)
            .send()
            .await
            .unwrap()
            .status();
        // The streamed one runs after its 202; the shutdown below waits for it.
        let expected = if id == "a3" {
            StatusCode::ACCEPTED
        } else {
            StatusCode::OK
        };
        assert_eq!(status, expected);
    }
    let _ = stop.send(());
    served.await.unwrap().unwrap();

    let seen = recorder.0.lock().unwrap().clone();
    let expected: Vec<Option<String>> = [
        ("msteams", "room/42"),
        ("msteams", "café 7"),
        ("msteams", "dm 1"),
        ("msteams", "dm 1"),
    ]
    .iter()
    .map(|(channel, conversation)| {
        turnstile::grpc::affinity::conversation_value(channel, conversation)
            .map(|v| v.to_str().unwrap().to_owned())
    })
    .collect();
    assert_eq!(
        seen, expected,
        "one header per call, naming its conversation"
    );
    assert_ne!(seen[0], seen[1], "different conversations hash apart");
}

impl World {
    /// A Teams message in a conversation of `conversation_type`, to the `llm` gateway.
    async fn ask_in_teams(&self, id: &str, conversation_type: &str) -> StatusCode {
        let mut activity = self.activity(id, "hello");
        activity["channelId"] = json!("msteams");
        activity["conversation"] =
            json!({"id": format!("a:{conversation_type}"), "conversationType": conversation_type});
        let response = reqwest::Client::new()
            .post(format!("http://{}/api/messages", self.llm_gateway))
            .json(&activity)
            .send()
            .await
            .unwrap();
        StatusCode::from_u16(response.status().as_u16()).unwrap()
    }
}

impl World {
    /// The replies to Teams personal-chat message `id` (`hello`), sent again with
    /// `expectReplies` to the `llm` gateway, which answers once the turn has committed.
    async fn ask_in_teams_waiting(&self, id: &str) -> Vec<Value> {
        let mut activity = self.activity(id, "hello");
        activity["channelId"] = json!("msteams");
        activity["conversation"] = json!({"id": "a:personal", "conversationType": "personal"});
        activity["deliveryMode"] = json!("expectReplies");
        let response = reqwest::Client::new()
            .post(format!("http://{}/api/messages", self.llm_gateway))
            .json(&activity)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let body: Value = response.json().await.unwrap();
        body["activities"].as_array().unwrap().clone()
    }
}

fn stream_info(body: &Value) -> Option<&Value> {
    body["entities"]
        .as_array()?
        .iter()
        .find(|e| e["type"] == "streaminfo")
}

#[tokio::test]
async fn teams_streams_a_drafted_answer_in_a_personal_chat_at_most_every_one_and_a_half_seconds() {
    let world = World::start(Mode::Development).await;
    let started = std::time::Instant::now();
    assert_eq!(
        world.ask_in_teams("t1", "personal").await,
        StatusCode::ACCEPTED
    );
    let delivered = world.delivered_until_message().await;
    let took = started.elapsed();
    let (drafts, last) = delivered.split_at(delivered.len() - 1);
    let answer = turnstile::bots::llm::answer("hello", 1);

    // The llm bot drafts some forty times in about four seconds: Teams gets the first draft at
    // once, then the latest every 1.5 s.
    assert!(drafts.len() >= 2, "{delivered:#?}");
    let most = usize::try_from(took.as_millis() / 1500).unwrap() + 1;
    assert!(drafts.len() <= most, "{} drafts in {took:?}", drafts.len());
    let stream_id = "a-1";
    for (i, draft) in drafts.iter().enumerate() {
        assert_eq!(draft["type"], "typing");
        assert_eq!(draft["replyToId"], "t1");
        let info = stream_info(draft).unwrap();
        assert_eq!(info["streamSequence"], json!(i + 1));
        if i == 0 {
            assert_eq!(info["streamType"], "informative");
            assert_eq!(draft["text"], "Thinking…");
            assert!(
                info.get("streamId").is_none(),
                "the first POST's answer gives the id"
            );
        } else {
            assert_eq!(info["streamType"], "streaming");
            assert_eq!(info["streamId"], stream_id);
            let text = draft["text"].as_str().unwrap();
            assert!(
                answer.starts_with(text) && text.len() < answer.len(),
                "{text}"
            );
        }
    }
    let last = &last[0];
    assert_eq!(last["type"], "message");
    assert_eq!(last["text"], answer.as_str());
    let info = stream_info(last).unwrap();
    assert_eq!(info["streamType"], "final");
    assert_eq!(info["streamId"], stream_id);
    assert!(info.get("streamSequence").is_none());

    // Teams redelivers (its 202 was lost): the bot does not run again, nothing is drafted, and
    // the reply this gateway delivered already is not delivered twice.
    world.channel.received.lock().unwrap().clear();
    let replies = world.ask_in_teams_waiting("t1").await;
    let texts: Vec<&str> = replies
        .iter()
        .map(|r| r["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, [answer.as_str()], "the receipt's answer");
    assert_eq!(
        world.ask_in_teams("t1", "personal").await,
        StatusCode::ACCEPTED
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        world.delivered().is_empty(),
        "delivered again: {:?}",
        world.delivered()
    );
}

#[tokio::test]
async fn a_teams_stream_whose_turn_a_later_message_interrupted_is_ended_saying_so() {
    let world = World::start(Mode::Development).await;
    assert_eq!(
        world.ask_in_teams("i1", "personal").await,
        StatusCode::ACCEPTED
    );
    // Its stream is open (Teams gave it an id), showing the first answer being written.
    eventually("a streamed draft", || {
        world
            .delivered()
            .iter()
            .any(|d| stream_info(&d.2).is_some_and(|i| i["streamType"] == "streaming"))
    })
    .await;
    // The user sends another message: it interrupts the first answer.
    assert_eq!(
        world.ask_in_teams("i2", "personal").await,
        StatusCode::ACCEPTED
    );
    eventually("both streams ended", || {
        let finals = world
            .delivered()
            .iter()
            .filter(|d| stream_info(&d.2).is_some_and(|i| i["streamType"] == "final"))
            .count();
        finals == 2
    })
    .await;
    let finals: Vec<Value> = world
        .delivered()
        .into_iter()
        .map(|(_, _, body)| body)
        .filter(|b| stream_info(b).is_some_and(|i| i["streamType"] == "final"))
        .collect();
    // The first stream ends saying why; the second with the answer, to both messages.
    assert_eq!(finals[0]["replyToId"], "i1");
    assert_eq!(finals[0]["text"], turnstile::gateway::SUPERSEDED_TEXT);
    assert_eq!(stream_info(&finals[0]).unwrap()["streamId"], "a-1");
    assert_eq!(finals[1]["replyToId"], "i2");
    assert_ne!(finals[1]["text"], turnstile::gateway::SUPERSEDED_TEXT);
}

#[tokio::test]
async fn a_teams_group_chat_gets_the_final_only_and_a_403_stops_the_drafts() {
    let world = World::start(Mode::Development).await;
    let answer = turnstile::bots::llm::answer("hello", 1);
    assert_eq!(
        world.ask_in_teams("g1", "groupChat").await,
        StatusCode::ACCEPTED
    );
    let delivered = world.delivered_until_message().await;
    assert_eq!(delivered.len(), 1, "no typing, no draft: {delivered:#?}");
    assert_eq!(delivered[0]["text"], answer.as_str());
    assert!(stream_info(&delivered[0]).is_none());

    // The user presses Stop after the first words: Teams refuses the rest of the stream, and
    // the turn is stopped at what Teams shows, which is what it commits.
    world.channel.received.lock().unwrap().clear();
    *world.channel.stop_streams_after.lock().unwrap() = Some(2);
    assert_eq!(
        world.ask_in_teams("p1", "personal").await,
        StatusCode::ACCEPTED
    );
    // The same activity, its caller waiting for the replies: once the turn has committed, its
    // receipt answers. (Sent once the stream is under way: the `llm` bot holds its conversations,
    // and a redelivery that reached the hold first would run the turn itself, unstreamed.)
    world.delivered_at_least(2).await;
    let replies = world.ask_in_teams_waiting("p1").await;
    let delivered = world.delivered();
    assert_eq!(delivered.len(), 2, "two drafts, no reply: {delivered:#?}");
    assert_eq!(
        stream_info(&delivered[0].2).unwrap()["streamType"],
        "informative"
    );
    assert_eq!(
        stream_info(&delivered[1].2).unwrap()["streamType"],
        "streaming"
    );
    let shown = delivered[1].2["text"].as_str().unwrap();
    assert!(
        answer.starts_with(shown) && shown.len() < answer.len(),
        "{shown}"
    );
    let texts: Vec<&str> = replies
        .iter()
        .map(|r| r["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, [shown], "the committed reply is what the user saw");
    // Nothing more comes: the committed reply is on the user's screen, in the closed stream.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(world.delivered().len(), 2);
    *world.channel.stop_streams_after.lock().unwrap() = None;

    // Teams closes the stream just before its end (the two minutes ran out): the final that
    // would end it is refused, and the reply goes as a plain message instead.
    world.channel.received.lock().unwrap().clear();
    *world.channel.stop_streams_after.lock().unwrap() = None;
    world.channel.refuse_final.store(true, Ordering::SeqCst);
    assert_eq!(
        world.ask_in_teams("p2", "personal").await,
        StatusCode::ACCEPTED
    );
    let delivered = world.delivered_until_message().await;
    let (drafts, last) = delivered.split_at(delivered.len() - 1);
    assert!(drafts.iter().all(|d| d["type"] == "typing") && !drafts.is_empty());
    // The stopped turn committed no state: this is still the conversation's first answer.
    assert_eq!(last[0]["text"], answer.as_str());
    assert!(stream_info(&last[0]).is_none(), "{:?}", last[0]);
}

#[tokio::test]
async fn a_message_refused_while_the_bot_answers_gets_the_busy_text_and_runs_nothing() {
    let world = World::start(Mode::MultiTenant).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let (_stop, _served) = world.gated_gateway(listener, |config| {
        config.bot = "busy".into();
        "Still on it!".clone_into(&mut config.busy_text);
    });
    let token = world.valid_token();
    let (status, _) = world
        .post_to(
            gateway,
            &world.activity("b1", "take your time"),
            Some(&token),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    eventually("the bot started", || {
        world.gated_runs.load(Ordering::SeqCst) == 1
    })
    .await;

    // A second message while the first is answered: refused, and the user is told so.
    let (status, _) = world
        .post_to(
            gateway,
            &world.activity("b2", "make it large"),
            Some(&token),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let delivered = world.delivered_at_least(1).await;
    assert_eq!(texts(&delivered), ["Still on it!"]);
    assert_eq!(delivered[0].2["replyToId"], "b2");
    // A caller that waits for its replies gets the same answer in the body.
    let mut waits = world.activity("b3", "and olives");
    waits["deliveryMode"] = json!("expectReplies");
    let (status, body) = world.post_to(gateway, &waits, Some(&token)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["activities"][0]["text"], "Still on it!");

    world.gate.add_permits(1);
    let delivered = world.delivered_at_least(2).await;
    assert_eq!(texts(&delivered), ["Still on it!", "gated: take your time"]);
    assert_eq!(
        world.gated_runs.load(Ordering::SeqCst),
        1,
        "the bot ran once"
    );
}

#[tokio::test]
async fn the_channel_gets_202_before_a_bot_slower_than_its_budget_and_the_reply_comes_after() {
    let world = World::start(Mode::MultiTenant).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let (_stop, _served) = world.gated_gateway(listener, |_| {});

    let (status, body) = world
        .post_to(
            gateway,
            &world.activity("slow-1", "take your time"),
            Some(&world.valid_token()),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert!(body.is_empty(), "{body}");
    eventually("the bot started", || {
        world.gated_runs.load(Ordering::SeqCst) == 1
    })
    .await;
    assert!(world.delivered().is_empty(), "the bot is still at its gate");
    // Longer than the 200 ms a waiting call may take; well within the bot's 5 s.
    tokio::time::sleep(Duration::from_millis(500)).await;
    world.gate.add_permits(1);
    let delivered = world.delivered_at_least(1).await;
    assert_eq!(texts(&delivered), ["gated: take your time"]);
    let (path, auth, reply) = &delivered[0];
    assert_eq!(
        path,
        "/v3/conversations/19%3Aconv%40thread.skype/activities/slow-1"
    );
    assert_eq!(auth.as_deref(), Some("Bearer bot-token-1"));
    assert_eq!(reply["replyToId"], "slow-1");
    assert_eq!(world.gated_runs.load(Ordering::SeqCst), 1);

    // A caller that waits still has the 200 ms: expectReplies with the bot at its gate fails.
    let mut waits = world.activity("slow-2", "inline");
    waits["deliveryMode"] = json!("expectReplies");
    let (status, _) = world
        .post_to(gateway, &waits, Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    world.gate.add_permits(1);
}

#[tokio::test]
async fn a_redelivery_while_or_after_the_turn_ran_runs_the_bot_once_and_delivers_its_replies_once()
{
    let world = World::start(Mode::MultiTenant).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let (_stop, _served) = world.gated_gateway(listener, |_| {});
    let activity = world.activity("twice-1", "once");

    let (status, _) = world
        .post_to(gateway, &activity, Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    eventually("the bot started", || {
        world.gated_runs.load(Ordering::SeqCst) == 1
    })
    .await;
    // Redelivered while the bot runs: answered at once, and it waits for the first.
    let (status, _) = world
        .post_to(gateway, &activity, Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    // Permits enough for a second run, which the count would then show.
    world.gate.add_permits(10);
    let delivered = world.delivered_at_least(1).await;
    assert_eq!(texts(&delivered), ["gated: once"]);
    // Redelivered after: answered from the receipt, whose replies were delivered already.
    let (status, _) = world
        .post_to(gateway, &activity, Some(&world.valid_token()))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        texts(&world.delivered()),
        ["gated: once"],
        "the replies were delivered once, for three sendings"
    );
    assert_eq!(
        world.gated_runs.load(Ordering::SeqCst),
        1,
        "the bot ran once"
    );
}

#[tokio::test]
async fn a_graceful_shutdown_waits_for_a_turn_running_in_the_background() {
    let world = World::start(Mode::MultiTenant).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let (stop, mut served) = world.gated_gateway(listener, |_| {});

    let (status, _) = world
        .post_to(
            gateway,
            &world.activity("last-1", "before you go"),
            Some(&world.valid_token()),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    eventually("the bot started", || {
        world.gated_runs.load(Ordering::SeqCst) == 1
    })
    .await;
    stop.send(()).unwrap();
    // However long it is given, `serve` cannot return while the turn waits at its gate.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut served)
            .await
            .is_err(),
        "serve returned with a turn in flight"
    );
    world.gate.add_permits(1);
    served.await.unwrap().unwrap();
    assert_eq!(
        texts(&world.delivered()),
        ["gated: before you go"],
        "delivered before serve returned"
    );
}

#[tokio::test]
async fn on_sigterm_the_gateway_binary_delivers_the_turn_it_answered_202_for_before_it_exits() {
    let world = World::start(Mode::Development).await;
    let (grpc, http) = (free_port(), free_port());
    let server = spawn_turnstile(
        &["serve"],
        &[
            ("TURNSTILE_LISTEN", format!("127.0.0.1:{grpc}")),
            ("TURNSTILE_GATEWAY_LISTEN", "off".to_owned()),
            ("TURNSTILE_SLOW_BOT_DELAY_MS", "2000".to_owned()),
        ],
    );
    let gateway = spawn_turnstile(
        &["gateway"],
        &[
            ("TURNSTILE_GATEWAY_LISTEN", format!("127.0.0.1:{http}")),
            ("TURNSTILE_URL", format!("http://127.0.0.1:{grpc}")),
            ("TURNSTILE_BOT", "slow".to_owned()),
        ],
    );
    let client = reqwest::Client::new();
    let mut ready = false;
    for _ in 0..200 {
        if let Ok(response) = client
            .get(format!("http://127.0.0.1:{http}/readyz"))
            .send()
            .await
            && response.status().is_success()
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ready, "the gateway never saw Turnstile serving");
    let response = client
        .post(format!("http://127.0.0.1:{http}/api/messages"))
        .json(&world.activity("term-1", "count"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    // The bot takes 2 s: the turn is in flight when the signal comes, and its reply must still
    // reach the channel, which will not resend an activity it has its 202 for.
    // Off this runtime's thread, which serves the Connector stand-in meanwhile.
    let (status, log) = tokio::task::spawn_blocking(move || terminate(gateway))
        .await
        .unwrap();
    assert!(status.success(), "the gateway stopped cleanly: {log}");
    let delivered = world.delivered();
    assert_eq!(delivered.len(), 1, "delivered before the exit: {log}");
    assert_eq!(delivered[0].2["replyToId"], "term-1");
    let (status, _) = terminate(server);
    assert!(status.success());
}

#[tokio::test]
async fn past_its_bound_of_background_turns_the_gateway_answers_503_and_runs_nothing() {
    let world = World::start(Mode::MultiTenant).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let (_stop, _served) = world.gated_gateway(listener, |config| {
        config.max_background_turns = 1;
    });
    let token = world.valid_token();

    let (status, _) = world
        .post_to(gateway, &world.activity("full-1", "first"), Some(&token))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    eventually("the bot started", || {
        world.gated_runs.load(Ordering::SeqCst) == 1
    })
    .await;
    let second = world.activity("full-2", "second");
    let (status, body) = world.post_to(gateway, &second, Some(&token)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");

    world.gate.add_permits(1);
    world.delivered_at_least(1).await;
    // The channel retries; once the first turn's task has ended, the activity is taken.
    let mut accepted = false;
    for _ in 0..250 {
        let (status, _) = world.post_to(gateway, &second, Some(&token)).await;
        if status == StatusCode::ACCEPTED {
            accepted = true;
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(accepted, "the place never came free");
    world.gate.add_permits(1);
    let delivered = world.delivered_at_least(2).await;
    assert_eq!(texts(&delivered), ["gated: first", "gated: second"]);
    assert_eq!(
        world.gated_runs.load(Ordering::SeqCst),
        2,
        "a refused activity ran nothing"
    );
}
