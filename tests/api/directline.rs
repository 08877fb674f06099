//! Direct Line 3.0 as `botframework-directlinejs` and Web Chat call it: tokens made from a secret
//! and refreshed, refused when wrong, expired or for another conversation; the transcript read by
//! watermark; replies in it only after their turn committed; conversations kept apart; the
//! WebSocket stream; and a streamed turn's drafts pushed as a Web Chat livestream that the
//! transcript never keeps. Turns run in a real Turnstile server over PostgreSQL, reached only through
//! gRPC by the gateway.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures::{SinkExt as _, StreamExt as _};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::TestApp;
use support::bots::Gated;
use tokio::sync::{Semaphore, oneshot};
use turnstile::bots::{LlmBot, PizzaBot};
use turnstile::gateway::{GatewayConfig, Secret};
use turnstile::grpc::pb;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

const SECRET: &str = "dl-secret-one";
const OLD_SECRET: &str = "dl-secret-old";

/// Says something, then fails the turn when told to: its reply must never be seen.
struct Flaky;

#[async_trait]
impl Bot for Flaky {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let text = turn.text().to_owned();
        turn.send_text(format!("about to handle: {text}"));
        if text == "fail" {
            return Err(BotError::msg("told to fail"));
        }
        Ok(())
    }
}

struct World {
    /// The gateway running the pizza bot, Direct Line secrets configured.
    pizza: SocketAddr,
    /// The gateway running the flaky bot, Direct Line secrets configured.
    flaky: SocketAddr,
    /// A development gateway (no secret, no app id): Direct Line is open.
    open: SocketAddr,
    /// The gateway running the `llm` bot, which drafts its answer word by word.
    llm: SocketAddr,
    /// The same, drafting a word every 100 ms: time for a user to press Stop, or to send
    /// another message, which it refuses while it answers (double-text policy `reject`).
    slow_llm: SocketAddr,
    /// The same bot behind a gateway whose POSTs wait 500 ms for their turn: its ~3.5 s turns
    /// run on after the POST is answered.
    impatient: SocketAddr,
    http: reqwest::Client,
    /// The database.
    url: String,
    _app: TestApp,
    _stops: Vec<oneshot::Sender<()>>,
}

impl World {
    async fn start() -> World {
        let app = TestApp::postgres()
            .bots(
                BotRegistry::new("pizza", PizzaBot)
                    .with("flaky", Flaky)
                    .with("llm", LlmBot::new(Duration::from_millis(10)))
                    .with("slow-llm", LlmBot::new(Duration::from_millis(100)))
                    .with_double_text("slow-llm", turnstile::DoubleText::Reject)
                    .unwrap(),
            )
            .spawn()
            .await;
        let turnstile = format!("http://{}", app.addr);
        let mut stops = Vec::new();
        let mut gateway = |bot: &str, secrets: &[&str], wait: Duration| {
            let mut config = GatewayConfig::development(turnstile.clone());
            config.turn_timeout = wait;
            config.bot = bot.to_owned();
            config.direct_line_secrets = secrets.iter().map(|s| Secret::new(*s)).collect();
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            let addr = listener.local_addr().unwrap();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let (stop, stopped) = oneshot::channel::<()>();
            tokio::spawn(turnstile::gateway::serve(config, listener, async {
                let _ = stopped.await;
            }));
            stops.push(stop);
            addr
        };
        let wait = Duration::from_secs(8);
        let pizza = gateway("", &[SECRET, OLD_SECRET], wait);
        let flaky = gateway("flaky", &[SECRET], wait);
        let open = gateway("", &[], wait);
        let llm = gateway("llm", &[SECRET], wait);
        let slow_llm = gateway("slow-llm", &[SECRET], wait);
        let impatient = gateway("slow-llm", &[SECRET], Duration::from_millis(500));
        World {
            pizza,
            flaky,
            open,
            llm,
            slow_llm,
            impatient,
            http: reqwest::Client::new(),
            url: app.database_url().to_owned(),
            _app: app,
            _stops: stops,
        }
    }

    async fn call(
        &self,
        gateway: SocketAddr,
        method: reqwest::Method,
        path: &str,
        bearer: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut request = self
            .http
            .request(method, format!("http://{gateway}/v3/directline{path}"));
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// Starts a conversation with `bearer`; returns (conversationId, token, streamUrl).
    async fn start_conversation(
        &self,
        gateway: SocketAddr,
        bearer: Option<&str>,
    ) -> (String, String, String) {
        let (status, body) = self
            .call(
                gateway,
                reqwest::Method::POST,
                "/conversations",
                bearer,
                None,
            )
            .await;
        assert!(status.is_success(), "{status} {body}");
        (
            body["conversationId"].as_str().unwrap().to_owned(),
            body["token"].as_str().unwrap().to_owned(),
            body["streamUrl"].as_str().unwrap().to_owned(),
        )
    }

    async fn say(
        &self,
        gateway: SocketAddr,
        conversation: &str,
        bearer: &str,
        text: &str,
    ) -> (StatusCode, Value) {
        self.call(
            gateway,
            reqwest::Method::POST,
            &format!("/conversations/{conversation}/activities"),
            Some(bearer),
            Some(json!({"type": "message", "from": {"id": "user1", "role": "user"}, "text": text})),
        )
        .await
    }

    async fn read(
        &self,
        gateway: SocketAddr,
        conversation: &str,
        bearer: &str,
        watermark: &str,
    ) -> (Vec<Value>, String) {
        let (status, body) = self
            .call(
                gateway,
                reqwest::Method::GET,
                &format!("/conversations/{conversation}/activities?watermark={watermark}"),
                Some(bearer),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        (
            body["activities"].as_array().unwrap().clone(),
            body["watermark"].as_str().unwrap().to_owned(),
        )
    }
}

fn texts(activities: &[Value]) -> Vec<&str> {
    activities
        .iter()
        .map(|a| a["text"].as_str().unwrap_or_default())
        .collect()
}

#[tokio::test]
async fn tokens_are_made_from_a_secret_refreshed_and_bound_to_their_conversation() {
    let world = World::start().await;
    let gw = world.pizza;
    let post = reqwest::Method::POST;

    // No credentials, a wrong secret, a token another key signed: refused, nothing started.
    let (status, _) = world
        .call(gw, post.clone(), "/tokens/generate", None, None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = world
        .call(
            gw,
            post.clone(),
            "/conversations",
            Some("wrong-secret"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let forge = |key: &str, conv: &str, exp: u64| {
        let claims = json!({"iss": "turnstile-directline", "aud": "turnstile-directline",
                            "conv": conv, "user": "dl_x", "iat": now, "nbf": now, "exp": exp});
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(key.as_bytes()),
        )
        .unwrap()
    };

    // A token from the secret; the rotated-out secret still works.
    let (status, generated) = world
        .call(
            gw,
            post.clone(),
            "/tokens/generate",
            Some(OLD_SECRET),
            Some(json!({"user": {"id": "dl_ada"}})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{generated}");
    let conversation = generated["conversationId"].as_str().unwrap().to_owned();
    let token = generated["token"].as_str().unwrap().to_owned();
    assert_eq!(generated["expires_in"], 1800);

    // Starting the conversation with the token gives that conversation back.
    let (status, started) = world
        .call(gw, post.clone(), "/conversations", Some(&token), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{started}");
    assert_eq!(started["conversationId"], conversation.as_str());
    assert!(started["streamUrl"].as_str().unwrap().starts_with(&format!(
        "ws://{gw}/v3/directline/conversations/{conversation}/stream?t="
    )));

    // The token's holder posts as the token's user, whatever it claims.
    let (status, posted) = world.say(gw, &conversation, &token, "add ham").await;
    assert_eq!(status, StatusCode::OK, "{posted}");
    assert_eq!(posted["id"], format!("{conversation}|0000001"));
    let (activities, _) = world.read(gw, &conversation, &token, "").await;
    assert_eq!(activities[0]["from"]["id"], "dl_ada");
    assert_eq!(activities[0]["channelId"], "directline");
    assert_eq!(activities[1]["text"], "Added ham. Your pizza has: ham.");

    // Refreshing gives a new token for the same conversation; a secret cannot be refreshed.
    let (status, refreshed) = world
        .call(gw, post.clone(), "/tokens/refresh", Some(&token), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{refreshed}");
    assert_eq!(refreshed["conversationId"], conversation.as_str());
    let fresh = refreshed["token"].as_str().unwrap();
    let (activities, _) = world.read(gw, &conversation, fresh, "").await;
    assert_eq!(activities.len(), 2);
    let (status, _) = world
        .call(gw, post.clone(), "/tokens/refresh", Some(SECRET), None)
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // A token is for its own conversation only, cannot mint tokens, and must be ours and fresh.
    let (other, _, _) = world.start_conversation(gw, Some(SECRET)).await;
    let wrong_conversation = world
        .call(
            gw,
            reqwest::Method::GET,
            &format!("/conversations/{other}/activities"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(wrong_conversation.0, StatusCode::FORBIDDEN);
    let (status, _) = world.say(gw, &other, &token, "add olives").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = world
        .call(gw, post.clone(), "/tokens/generate", Some(&token), None)
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let forged = forge("not-the-secret", &conversation, now + 600);
    let (status, _) = world.say(gw, &conversation, &forged, "add olives").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let expired = forge(SECRET, &conversation, now - 3600);
    let (status, body) = world.say(gw, &conversation, &expired, "add olives").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body["error"]["code"], "TokenExpired");
    let (activities, _) = world.read(gw, &conversation, SECRET, "").await;
    assert_eq!(
        texts(&activities),
        ["add ham", "Added ham. Your pizza has: ham."],
        "no refused post ran a turn"
    );

    // A conversation nobody started.
    let (status, _) = world.say(gw, "no-such-conversation", SECRET, "hi").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let valid_elsewhere = forge(SECRET, "no-such-conversation", now + 600);
    let (status, _) = world
        .call(
            gw,
            reqwest::Method::GET,
            "/conversations/no-such-conversation",
            Some(&valid_elsewhere),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Development: no credentials needed.
    let (_, open_token, _) = world.start_conversation(world.open, None).await;
    assert!(!open_token.is_empty());
}

#[tokio::test]
async fn the_transcript_pages_by_watermark_and_conversations_are_kept_apart() {
    let world = World::start().await;
    let gw = world.pizza;
    let (a, token_a, _) = world.start_conversation(gw, Some(SECRET)).await;
    let (b, token_b, _) = world.start_conversation(gw, Some(SECRET)).await;
    assert_ne!(a, b);
    for topping in ["ham", "mushroom", "olives"] {
        let (status, _) = world.say(gw, &a, &token_a, &format!("add {topping}")).await;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, _) = world.say(gw, &b, &token_b, "add pineapple").await;
    assert_eq!(status, StatusCode::OK);

    let (all, watermark) = world.read(gw, &a, &token_a, "").await;
    assert_eq!(
        texts(&all),
        [
            "add ham",
            "Added ham. Your pizza has: ham.",
            "add mushroom",
            "Added mushroom. Your pizza has: ham, mushroom.",
            "add olives",
            "Added olives. Your pizza has: ham, mushroom, olives.",
        ]
    );
    assert_eq!(watermark, "6");
    let ids: Vec<&str> = all.iter().map(|a| a["id"].as_str().unwrap()).collect();
    assert_eq!(ids[0], format!("{a}|0000001"));
    assert_eq!(all[1]["replyToId"], ids[0], "a reply names what it answers");
    assert_eq!(all[1]["from"]["role"], "bot");
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 6, "every activity has its own id");

    let (rest, watermark) = world.read(gw, &a, &token_a, "4").await;
    assert_eq!(
        texts(&rest),
        [
            "add olives",
            "Added olives. Your pizza has: ham, mushroom, olives."
        ]
    );
    assert_eq!(watermark, "6");
    let (none, watermark) = world.read(gw, &a, &token_a, "6").await;
    assert!(none.is_empty());
    assert_eq!(watermark, "6");

    // B saw none of A's turns, and its pizza is its own.
    let (only_b, _) = world.read(gw, &b, &token_b, "").await;
    assert_eq!(
        texts(&only_b),
        [
            "add pineapple",
            "Added pineapple. Your pizza has: pineapple."
        ]
    );
    let (status, _) = world.say(gw, &b, &token_b, "show").await;
    assert_eq!(status, StatusCode::OK);
    let (shown, _) = world.read(gw, &b, &token_b, "2").await;
    assert_eq!(texts(&shown)[1], "Your pizza has: pineapple.");
}

#[tokio::test]
async fn a_failed_turn_leaves_nothing_in_the_transcript() {
    let world = World::start().await;
    let gw = world.flaky;
    let (conversation, token, _) = world.start_conversation(gw, Some(SECRET)).await;
    let (status, _) = world.say(gw, &conversation, &token, "first").await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = world.say(gw, &conversation, &token, "fail").await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_eq!(body["error"]["code"], "BotError");
    let (status, _) = world.say(gw, &conversation, &token, "third").await;
    assert_eq!(status, StatusCode::OK);
    let (activities, watermark) = world.read(gw, &conversation, &token, "").await;
    assert_eq!(
        texts(&activities),
        [
            "first",
            "about to handle: first",
            "third",
            "about to handle: third"
        ],
        "neither the failed turn's message nor its reply"
    );
    assert_eq!(watermark, "4");
}

#[tokio::test]
async fn the_stream_pushes_each_committed_turn_as_an_activity_group() {
    let world = World::start().await;
    let gw = world.pizza;
    let (conversation, token, stream_url) = world.start_conversation(gw, Some(SECRET)).await;
    let (status, _) = world.say(gw, &conversation, &token, "add ham").await;
    assert_eq!(status, StatusCode::OK);

    // A stream without a valid token is refused before the upgrade.
    let refused = tokio_tungstenite::connect_async(stream_url.replace("?t=", "?t=x")).await;
    assert!(refused.is_err(), "a bad token opens no stream");

    let (mut socket, _) = tokio_tungstenite::connect_async(&stream_url).await.unwrap();
    let mut next_group = async || loop {
        let message = tokio::time::timeout(Duration::from_secs(30), socket.next())
            .await
            .expect("an activity group within 30 s")
            .unwrap()
            .unwrap();
        if let tokio_tungstenite::tungstenite::Message::Text(text) = message {
            return serde_json::from_str::<Value>(&text).unwrap();
        }
    };
    // What was there before the stream opened comes first.
    let group = next_group().await;
    assert_eq!(
        texts(group["activities"].as_array().unwrap()),
        ["add ham", "Added ham. Your pizza has: ham."]
    );
    assert_eq!(group["watermark"], "2");
    let (status, _) = world.say(gw, &conversation, &token, "add olives").await;
    assert_eq!(status, StatusCode::OK);
    let group = next_group().await;
    assert_eq!(
        texts(group["activities"].as_array().unwrap()),
        ["add olives", "Added olives. Your pizza has: ham, olives."]
    );
    assert_eq!(group["watermark"], "4");
    socket
        .send(tokio_tungstenite::tungstenite::Message::Close(None))
        .await
        .unwrap();

    // Reconnecting at watermark 2 gives a fresh token and a stream that resumes there.
    let (status, resumed) = world
        .call(
            gw,
            reqwest::Method::GET,
            &format!("/conversations/{conversation}?watermark=2"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{resumed}");
    assert_eq!(resumed["conversationId"], conversation.as_str());
    let (mut socket, _) = tokio_tungstenite::connect_async(resumed["streamUrl"].as_str().unwrap())
        .await
        .unwrap();
    let message = tokio::time::timeout(Duration::from_secs(30), socket.next())
        .await
        .expect("an activity group within 30 s")
        .unwrap()
        .unwrap();
    let group: Value = serde_json::from_str(message.to_text().unwrap()).unwrap();
    assert_eq!(
        texts(group["activities"].as_array().unwrap()),
        ["add olives", "Added olives. Your pizza has: ham, olives."]
    );
}

/// The next activity group on `socket`, within 30 s.
async fn next_group(
    socket: &mut tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
) -> Value {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(30), socket.next())
            .await
            .expect("an activity group within 30 s")
            .unwrap()
            .unwrap();
        if let tokio_tungstenite::tungstenite::Message::Text(text) = message {
            return serde_json::from_str::<Value>(&text).unwrap();
        }
    }
}

#[tokio::test]
async fn a_streamed_turn_is_a_livestream_on_the_socket_and_never_in_the_transcript() {
    let world = World::start().await;
    let gw = world.llm;
    let (conversation, token, stream_url) = world.start_conversation(gw, Some(SECRET)).await;
    let (mut socket, _) = tokio_tungstenite::connect_async(&stream_url).await.unwrap();
    let (status, posted) = world.say(gw, &conversation, &token, "hello").await;
    assert_eq!(status, StatusCode::OK, "{posted}");

    // Interim activities, each a group of its own without a watermark, until the final.
    let mut interims = Vec::new();
    let committed = loop {
        let group = next_group(&mut socket).await;
        let activities = group["activities"].as_array().unwrap();
        if activities[0]["type"] == "typing" {
            assert_eq!(activities.len(), 1, "{group}");
            assert!(
                group.get("watermark").is_none(),
                "interims move no watermark"
            );
            interims.push(activities[0].clone());
        } else {
            assert_eq!(group["watermark"], "2", "{group}");
            break activities.clone();
        }
    };
    assert!(interims.len() > 3, "the answer was drafted word by word");
    let stream_id = interims[0]["id"].as_str().unwrap().to_owned();
    assert_eq!(interims[0]["channelData"]["streamType"], "informative");
    assert_eq!(interims[0]["text"], "Thinking…");
    assert!(
        interims[0]["channelData"].get("streamId").is_none(),
        "the first interim activity's id is the stream's"
    );
    let mut previous = String::new();
    for (i, interim) in interims.iter().enumerate() {
        assert_eq!(interim["from"]["role"], "bot");
        assert_eq!(interim["replyToId"], posted["id"]);
        assert_eq!(interim["channelData"]["streamSequence"], json!(i + 1));
        assert_eq!(interim["entities"][0]["type"], "streaminfo");
        if i == 0 {
            continue;
        }
        assert_eq!(interim["channelData"]["streamId"], stream_id.as_str());
        assert_eq!(interim["channelData"]["streamType"], "streaming");
        let text = interim["text"].as_str().unwrap();
        assert!(text.starts_with(&previous), "each draft is the text so far");
        previous = text.to_owned();
    }

    // The final message ends the livestream, with the whole answer.
    assert_eq!(texts(&committed)[0], "hello");
    let answer = &committed[1];
    assert_eq!(answer["type"], "message");
    assert_eq!(answer["text"].as_str().unwrap(), previous);
    assert_eq!(answer["channelData"]["streamId"], stream_id.as_str());
    assert_eq!(answer["channelData"]["streamType"], "final");
    assert!(answer["channelData"].get("streamSequence").is_none());

    // Neither a poll nor a stream opened afterwards sees an interim activity.
    let (read, watermark) = world.read(gw, &conversation, &token, "").await;
    assert_eq!(read, committed, "the committed messages only");
    assert_eq!(watermark, "2");
    let (mut replay, _) = tokio_tungstenite::connect_async(&stream_url).await.unwrap();
    let group = next_group(&mut replay).await;
    assert_eq!(group["activities"].as_array().unwrap(), &committed);

    // Without an open stream nobody could see a draft: the turn is not streamed.
    drop(socket);
    drop(replay);
    let (polled, token, _) = world.start_conversation(gw, Some(SECRET)).await;
    let (status, _) = world.say(gw, &polled, &token, "hello").await;
    assert_eq!(status, StatusCode::OK);
    let (read, _) = world.read(gw, &polled, &token, "").await;
    assert_eq!(read.len(), 2);
    assert!(
        read[1]["text"]
            .as_str()
            .unwrap()
            .starts_with("You said \"hello\"")
    );
    assert!(
        read[1].get("channelData").is_none(),
        "no livestream to end: {}",
        read[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_livestream_ends_with_what_the_client_showed_and_the_transcript_keeps_it() {
    let world = World::start().await;
    let gw = world.slow_llm;
    let (conversation, token, stream_url) = world.start_conversation(gw, Some(SECRET)).await;
    let (other, other_token, _) = world.start_conversation(gw, Some(SECRET)).await;
    let (mut socket, _) = tokio_tungstenite::connect_async(&stream_url).await.unwrap();
    let stop_path =
        |activity: &str| format!("/conversations/{conversation}/activities/{activity}/stop");

    let user = async {
        // The client shows a draft of a few words, then its user presses Stop.
        let draft = loop {
            let group = next_group(&mut socket).await;
            let interim = &group["activities"][0];
            let text = interim["text"].as_str().unwrap_or_default();
            if interim["channelData"]["streamType"] == "streaming" && text.split(' ').count() >= 3 {
                break interim.clone();
            }
        };
        let activity = draft["replyToId"].as_str().unwrap();
        let shown = draft["text"].as_str().unwrap().to_owned();
        // Another conversation's token cannot stop it; an activity not streaming is not found.
        let post = reqwest::Method::POST;
        let (status, _) = world
            .call(
                gw,
                post.clone(),
                &stop_path(activity),
                Some(&other_token),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        let (status, body) = world
            .call(gw, post.clone(), &stop_path("nope"), Some(&token), None)
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
        let (status, body) = world
            .call(
                gw,
                post,
                &stop_path(activity),
                Some(&token),
                Some(json!({"shownText": shown})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["result"], "stopped");
        (draft, shown)
    };
    let ((status, posted), (draft, shown)) =
        tokio::join!(world.say(gw, &conversation, &token, "hello"), user);
    assert_eq!(status, StatusCode::OK, "{posted}");
    assert_eq!(draft["replyToId"], posted["id"]);

    // The committed reply is what the client showed, and it ends the livestream.
    let (read, _) = world.read(gw, &conversation, &token, "").await;
    assert_eq!(texts(&read), ["hello", shown.as_str()]);
    let answer = &read[1];
    assert_eq!(answer["channelData"]["streamType"], "final");
    let stream_id = draft["channelData"]["streamId"].as_str().unwrap();
    assert_eq!(answer["channelData"]["streamId"], stream_id);
    let whole = turnstile::bots::llm::answer("hello", 1);
    assert!(whole.starts_with(&shown) && shown.len() < whole.len());
    // The stopped turn left the state as it was: the next answer is still the first. (Its hold
    // is released on a task of its own after its commit: until then a message is refused as a
    // double text, so the user's next one waits for that.)
    support::pg::until_released(&world.url, &conversation).await;
    let (status, _) = world.say(gw, &conversation, &token, "hello").await;
    assert_eq!(status, StatusCode::OK);
    let (read, _) = world.read(gw, &conversation, &token, "").await;
    assert_eq!(read[3]["text"].as_str().unwrap(), whole);
    // Nothing streams now: nothing to stop.
    let (status, _) = world
        .call(
            gw,
            reqwest::Method::POST,
            &stop_path(posted["id"].as_str().unwrap()),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let _ = other;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_refused_while_the_bot_answers_shows_the_busy_text_and_commits_nothing() {
    let world = World::start().await;
    let gw = world.slow_llm;
    let (conversation, token, _) = world.start_conversation(gw, Some(SECRET)).await;
    let double_text = async {
        // Once the first message's turn runs, whatever the machine's load.
        support::pg::until_held(&world.url, &conversation).await;
        world
            .say(gw, &conversation, &token, "wait, make it large")
            .await
    };
    let ((first, _), (second, refused)) =
        tokio::join!(world.say(gw, &conversation, &token, "hello"), double_text);
    assert_eq!(first, StatusCode::OK);
    assert_eq!(second, StatusCode::OK, "{refused}");
    let (read, _) = world.read(gw, &conversation, &token, "").await;
    let busy = turnstile::gateway::BUSY_TEXT;
    let whole = turnstile::bots::llm::answer("hello", 1);
    assert_eq!(
        texts(&read),
        ["wait, make it large", busy, "hello", whole.as_str()],
        "the refusal came at once, the answer after"
    );
    assert_eq!(read[1]["from"]["role"], "bot");
    assert_eq!(read[1]["replyToId"], refused["id"]);
    // The refused message was not committed: the next answer is the second.
    let (status, _) = world.say(gw, &conversation, &token, "hello").await;
    assert_eq!(status, StatusCode::OK);
    let (read, _) = world.read(gw, &conversation, &token, "").await;
    assert_eq!(
        read[5]["text"].as_str().unwrap(),
        turnstile::bots::llm::answer("hello", 2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_longer_than_the_posts_wait_is_answered_at_once_and_its_reply_comes_after() {
    let world = World::start().await;
    let gw = world.impatient;
    let (conversation, token, stream_url) = world.start_conversation(gw, Some(SECRET)).await;
    let (mut socket, _) = tokio_tungstenite::connect_async(&stream_url).await.unwrap();
    let posted_at = std::time::Instant::now();
    let (status, posted) = world.say(gw, &conversation, &token, "hello").await;
    let answered_in = posted_at.elapsed();
    assert_eq!(status, StatusCode::OK, "{posted}");
    assert!(answered_in < Duration::from_secs(2), "{answered_in:?}");

    // The user's message is in the transcript at once; the bot's reply is not, yet.
    let (read, watermark) = world.read(gw, &conversation, &token, "").await;
    assert_eq!(texts(&read), ["hello"]);
    assert_eq!(read[0]["id"], posted["id"]);
    // The socket shows the message, the drafts, and at last the committed reply, in the
    // livestream's place.
    let whole = turnstile::bots::llm::answer("hello", 1);
    let (mut drafts, mut seen_message) = (0, false);
    let last = loop {
        let group = next_group(&mut socket).await;
        let activity = group["activities"][0].clone();
        if activity["type"] == "typing" {
            drafts += 1;
        } else if activity["text"] == "hello" {
            seen_message = true;
        } else {
            break activity;
        }
    };
    assert!(seen_message && drafts > 5, "{drafts} drafts");
    assert_eq!(last["text"].as_str().unwrap(), whole);
    assert_eq!(last["channelData"]["streamType"], "final");
    assert!(
        posted_at.elapsed() > Duration::from_secs(2),
        "the turn ran on"
    );
    let (read, _) = world.read(gw, &conversation, &token, &watermark).await;
    assert_eq!(texts(&read), [whole.as_str()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_erases_the_draft_and_the_replay_goes_on_in_the_same_livestream() {
    let gate = Arc::new(Semaphore::new(0));
    let bots = || {
        BotRegistry::new(
            "gated",
            Gated {
                gate: Arc::clone(&gate),
            },
        )
    };
    let a = TestApp::postgres().bots(bots()).spawn().await;
    let mut b = a.replica(bots()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gw = listener.local_addr().unwrap();
    let (_stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(turnstile::gateway::serve(
        GatewayConfig::development(format!("http://{}", a.addr)),
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    let http = reqwest::Client::new();
    let started: Value = http
        .post(format!("http://{gw}/v3/directline/conversations"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let conversation = started["conversationId"].as_str().unwrap().to_owned();
    let (mut socket, _) = tokio_tungstenite::connect_async(started["streamUrl"].as_str().unwrap())
        .await
        .unwrap();
    // Another replica's turn of the same conversation, straight through gRPC.
    let other_turn = |text: &str| {
        let mut activity = support::message(&conversation, "bob", text);
        activity.channel_id = Some("directline".into());
        pb::ProcessTurnRequest::typed(activity, "")
    };
    b.client.process_turn(other_turn("first")).await.unwrap();

    let post = {
        let http = http.clone();
        let url = format!("http://{gw}/v3/directline/conversations/{conversation}/activities");
        tokio::spawn(async move {
            http.post(url)
                .json(&json!({"type": "message", "from": {"id": "ada"}, "text": "wait"}))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    let first = next_group(&mut socket).await["activities"][0].clone();
    assert_eq!(first["text"], "writing first, wait", "{first}");
    b.client.process_turn(other_turn("other")).await.unwrap();
    gate.add_permits(1);

    let mut interims = vec![first];
    let committed = loop {
        let group = next_group(&mut socket).await;
        let activity = &group["activities"][0];
        if activity["type"] == "typing" {
            interims.push(activity.clone());
        } else {
            break group["activities"].as_array().unwrap().clone();
        }
    };
    assert_eq!(post.await.unwrap(), StatusCode::OK);
    let shown: Vec<(&str, &Value)> = interims
        .iter()
        .map(|i| {
            (
                i["text"].as_str().unwrap(),
                &i["channelData"]["streamSequence"],
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            ("writing first, wait", &json!(1)),
            ("", &json!(2)),
            ("writing first, other, wait", &json!(3)),
        ],
        "the void draft, erased in place, then the replay's"
    );
    let stream_id = &interims[0]["id"];
    for interim in &interims[1..] {
        assert_eq!(&interim["channelData"]["streamId"], stream_id);
    }
    let answer = committed.last().unwrap();
    assert_eq!(answer["text"], "first, other, wait");
    assert_eq!(&answer["channelData"]["streamId"], stream_id);
    assert_eq!(answer["channelData"]["streamType"], "final");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

#[tokio::test]
async fn with_an_app_id_and_no_secret_there_is_no_direct_line_and_no_page() {
    // Nothing is ever fetched from these: no call reaches `/api/messages`.
    let mut config = GatewayConfig::development("http://127.0.0.1:9");
    config.credentials = Some(turnstile::gateway::AppCredentials {
        app_id: "app".into(),
        password: Secret::new("password"),
        app_type: turnstile::gateway::AppType::MultiTenant,
        tenant_id: None,
        openid_metadata_url: "http://127.0.0.1:9/openid".into(),
        token_issuer: "https://api.botframework.com".into(),
        login_url: "http://127.0.0.1:9/tenant".into(),
        oauth_scope: "https://api.botframework.com".into(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(turnstile::gateway::serve(config, listener, async {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();
    let started = http
        .post(format!("http://{addr}/v3/directline/conversations"))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status(), StatusCode::NOT_FOUND);
    let page = http.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::NOT_FOUND);
    let messages = http
        .post(format!("http://{addr}/api/messages"))
        .json(&json!({"type": "message"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        messages.status(),
        StatusCode::UNAUTHORIZED,
        "the channel endpoint is there"
    );
}
