//! Every way a turn can fail, each with the status a gateway acts on, and never a reply or a state
//! change from a turn that did not commit.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use async_trait::async_trait;
use support::{TestApp, message, request, say, texts, toppings};
use tonic::Code;
use tonic_types::StatusExt as _;
use turnstile::bots::PizzaBot;
use turnstile::grpc::pb;
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

fn assert_status(
    result: Result<tonic::Response<pb::ProcessTurnResponse>, tonic::Status>,
    code: Code,
    naming: &str,
) -> tonic::Status {
    let status = result.expect_err("the call should fail");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(naming),
        "the message should name `{naming}`: {:?}",
        status.message()
    );
    status
}

/// Checks the status's ErrorInfo reason and domain, and whether it advises a retry.
fn assert_details(status: &tonic::Status, reason: &str, retry: bool) {
    let info = status.get_details_error_info().expect("an ErrorInfo");
    assert_eq!(info.reason, reason, "{status:?}");
    assert_eq!(info.domain, turnstile::grpc::error::ERROR_DOMAIN);
    assert_eq!(
        status.get_details_retry_info().is_some(),
        retry,
        "RetryInfo on {status:?}"
    );
}

#[tokio::test]
async fn invalid_activities_get_invalid_argument_naming_the_field_and_change_nothing() {
    let mut app = TestApp::postgres()
        .config(|c| turnstile::Config {
            limits: turnstile::grpc::limits::Limits {
                max_activity_bytes: 4096,
                ..Default::default()
            },
            ..c
        })
        .spawn()
        .await;
    say(&mut app.client, "c1", "add ham").await;

    let base = || message("c1", "alice", "add pineapple");
    let cases: Vec<(&str, pb::ProcessTurnRequest)> = vec![
        ("activity", pb::ProcessTurnRequest::default()),
        (
            "type",
            request(pb::Activity {
                r#type: None,
                ..base()
            }),
        ),
        (
            "channel_id",
            request(pb::Activity {
                channel_id: None,
                ..base()
            }),
        ),
        (
            "conversation",
            request(pb::Activity {
                conversation: None,
                ..base()
            }),
        ),
        (
            "conversation.id",
            request(pb::Activity {
                conversation: Some(pb::ConversationAccount::default()),
                ..base()
            }),
        ),
        (
            "from.id",
            request(pb::Activity {
                from: None,
                ..base()
            }),
        ),
        (
            "conversation.id",
            request(pb::Activity {
                conversation: Some(pb::ConversationAccount {
                    id: Some("c1\u{7}".into()),
                    ..Default::default()
                }),
                ..base()
            }),
        ),
        (
            "text",
            request(pb::Activity {
                text: Some("add ".to_owned() + &"x".repeat(5000)),
                ..base()
            }),
        ),
    ];
    for (field, req) in cases {
        let status = app.client.process_turn(req).await.expect_err(field);
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(
            status.message().contains(&format!("`{field}`")),
            "the message should name `{field}`: {:?}",
            status.message()
        );
        assert_details(&status, "INVALID_ACTIVITY", false);
        let violations = status.get_details_bad_request().expect("a BadRequest");
        let named: Vec<&str> = violations
            .field_violations
            .iter()
            .map(|v| v.field.as_str())
            .collect();
        let expected = if field == "activity" {
            "activity".to_owned()
        } else {
            format!("activity.{field}")
        };
        assert_eq!(named, [expected.as_str()], "{status:?}");
    }
    let shown = say(&mut app.client, "c1", "show").await;
    assert_eq!(texts(&shown), ["Your pizza has: ham."]);
}

#[tokio::test]
async fn an_unknown_bot_is_not_found() {
    let mut app = TestApp::memory().spawn().await;
    let result = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("c1", "alice", "hi"),
            "calzone",
        ))
        .await;
    let status = assert_status(result, Code::NotFound, "calzone");
    assert_details(&status, "UNKNOWN_BOT", false);
}

/// Notes a value in conversation state; fails or panics after writing when asked to.
struct Notes;

#[async_trait]
impl Bot for Notes {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let text = turn.text().to_owned();
        let (command, arg) = text.split_once(' ').unwrap_or((text.as_str(), ""));
        match command {
            "read" => {
                let note: String = turn.conversation_property("note")?;
                turn.send_text(format!("note: {note}"));
            }
            "note" => {
                turn.conversation_state().set("note", arg)?;
                turn.send_text("noted");
            }
            "fail" => {
                turn.conversation_state().set("note", arg)?;
                turn.send_text("this reply must never leave");
                return Err(BotError::msg("the bot's own failure"));
            }
            "panic" => {
                turn.conversation_state().set("note", arg)?;
                turn.send_text("this reply must never leave");
                panic!("the bot blew up");
            }
            _ => {}
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_failing_or_panicking_bot_is_internal_and_leaves_state_untouched() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("notes", Notes))
        .spawn()
        .await;
    say(&mut app.client, "c1", "note first").await;

    let failed = app
        .client
        .process_turn(request(message("c1", "alice", "fail second")))
        .await;
    let status = assert_status(failed, Code::Internal, "the bot failed");
    assert_details(&status, "BOT_FAILED", false);
    let panicked = app
        .client
        .process_turn(request(message("c1", "alice", "panic third")))
        .await;
    let status = assert_status(panicked, Code::Internal, "the bot failed");
    assert_details(&status, "BOT_FAILED", false);

    let read = say(&mut app.client, "c1", "read").await;
    assert_eq!(texts(&read), ["note: first"]);
    assert_eq!(read.version, 1, "only the first note committed");
}

/// The pizza bot, slowed so that turns on different replicas overlap.
struct SlowPizza;

#[async_trait]
impl Bot for SlowPizza {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        tokio::time::sleep(Duration::from_millis(5)).await;
        PizzaBot.on_turn(turn).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_attempt_under_contention_aborts_and_commits_nothing_for_the_aborted() {
    let a = TestApp::postgres()
        .bots(BotRegistry::new("pizza", SlowPizza))
        .config(|mut c| {
            c.retry.max_attempts = 1;
            c
        })
        .spawn()
        .await;
    let b = a.replica(BotRegistry::new("pizza", SlowPizza)).await;
    let c = a.replica(BotRegistry::new("pizza", SlowPizza)).await;
    let mut clients = [a.client.clone(), b.client.clone(), c.client.clone()];
    let calls: Vec<_> = (0..30)
        .map(|i| {
            let mut client = clients[i % 3].clone();
            tokio::spawn(async move {
                let topping = format!("t{i:02}");
                let result = client
                    .process_turn(request(message(
                        "hot",
                        &format!("u{i}"),
                        &format!("add {topping}"),
                    )))
                    .await;
                (topping, result)
            })
        })
        .collect();
    let mut acknowledged = BTreeSet::new();
    let mut aborted = BTreeSet::new();
    for call in calls {
        let (topping, result) = call.await.unwrap();
        match result {
            Ok(response) => {
                let response = response.into_inner();
                assert_eq!(response.attempts, 1);
                assert!(toppings(&texts(&response)[0]).contains(&topping));
                acknowledged.insert(topping);
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                assert!(
                    status.message().contains("nothing was committed"),
                    "{status:?}"
                );
                assert_details(&status, "CONFLICT_RETRIES_EXHAUSTED", true);
                aborted.insert(topping);
            }
        }
    }
    assert!(
        !aborted.is_empty(),
        "with one attempt, some turns must lose the race"
    );
    let shown = say(&mut clients[0], "hot", "show").await;
    let order: BTreeSet<String> = toppings(&texts(&shown)[0]).into_iter().collect();
    assert_eq!(
        order, acknowledged,
        "exactly the acknowledged toppings, none of the aborted"
    );
}

#[tokio::test]
async fn a_stopped_database_is_unavailable_and_state_survives_its_restart() {
    let cluster = support::pg::Cluster::start();
    let url = support::pg::fresh_database_in(&cluster).await;
    let mut app = TestApp::on(&url).spawn().await;
    say(&mut app.client, "c1", "add ham").await;

    cluster.stop();
    let result = app
        .client
        .process_turn(request(message("c1", "alice", "add olive")))
        .await;
    let status = assert_status(result, Code::Unavailable, "state store is unavailable");
    assert_details(&status, "STORE_UNAVAILABLE", true);

    cluster.resume();
    let added = say(&mut app.client, "c1", "add mushroom").await;
    assert_eq!(
        texts(&added),
        ["Added mushroom. Your pizza has: ham, mushroom."]
    );
    assert_eq!(added.version, 2, "the olive never committed");
}

#[tokio::test]
async fn health_and_reflection_answer_without_the_proto_file() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let app = TestApp::memory().spawn().await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "turnstile.v1.TurnService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }

    use tonic_reflection::pb::v1::ServerReflectionRequest as V1Req;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient as V1;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest as V1Request;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse as V1Response;
    let mut v1 = V1::new(channel.clone());
    let request = V1Req {
        host: String::new(),
        message_request: Some(V1Request::ListServices(String::new())),
    };
    let mut stream = v1
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = stream.message().await.unwrap().unwrap();
    let Some(V1Response::ListServicesResponse(list)) = response.message_response else {
        panic!("not a service list: {response:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"turnstile.v1.TurnService".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );

    use tonic_reflection::pb::v1alpha::ServerReflectionRequest as AlphaReq;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as V1Alpha;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as AlphaRequest;
    let mut alpha = V1Alpha::new(channel);
    let request = AlphaReq {
        host: String::new(),
        message_request: Some(AlphaRequest::FileContainingSymbol(
            "turnstile.v1.TurnService".into(),
        )),
    };
    let mut stream = alpha
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = stream.message().await.unwrap().unwrap();
    assert!(
        matches!(
            response.message_response,
            Some(tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse::FileDescriptorResponse(_))
        ),
        "{response:?}"
    );
}

#[tokio::test]
async fn calls_to_an_unknown_service_or_method_are_unimplemented() {
    let app = TestApp::memory().spawn().await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    for (path, named) in [
        (
            "/turnstile.v1.NoSuchService/ProcessTurn",
            "turnstile.v1.NoSuchService",
        ),
        ("/turnstile.v1.TurnService/NoSuchMethod", ""),
        ("/grpc.health.v1.Health/NoSuchMethod", ""),
    ] {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.unwrap();
        let status = grpc
            .unary::<_, (), _>(
                tonic::Request::new(()),
                http::uri::PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented, "{path}: {status:?}");
        assert!(status.message().contains(named), "{path}: {status:?}");
    }
    // The server still serves turns on the same connection.
    let mut client = pb::turn_service_client::TurnServiceClient::new(channel);
    let reply = say(&mut client, "c1", "hello").await;
    assert!(!texts(&reply).is_empty());
}

/// Writes a conversation-scope `blob` as long as the message's text says, and its user scope's
/// `name`; replies with the blob's length before.
struct Blob;

#[async_trait]
impl Bot for Blob {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let length: usize = turn.text().parse().unwrap_or(0);
        let before: String = turn.conversation_property("blob")?;
        turn.conversation_state().set("blob", &"x".repeat(length))?;
        turn.user_state()?.set("name", &"ada")?;
        turn.send_text(before.len().to_string());
        Ok(())
    }
}

#[tokio::test]
async fn a_scope_written_past_the_size_limit_fails_naming_it_and_commits_nothing() {
    let mut app = TestApp::postgres()
        .bots(BotRegistry::new("blob", Blob))
        .config(|c| turnstile::Config {
            max_scope_bytes: 1000,
            ..c
        })
        .spawn()
        .await;
    // `{"blob":"x…x"}` is the length plus 11 bytes.
    let fits = app
        .client
        .process_turn(request(message("big", "ada", "989")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&fits), ["0"]);
    let too_large = app
        .client
        .process_turn(request(message("big", "ada", "990")))
        .await;
    let status = assert_status(too_large, Code::FailedPrecondition, "conversation state");
    assert!(status.message().contains("1001 bytes"), "{status:?}");
    assert_details(&status, "STATE_TOO_LARGE", false);
    let info = status.get_details_error_info().unwrap();
    assert_eq!(
        info.metadata.get("scope").map(String::as_str),
        Some("conversation")
    );
    assert_eq!(info.metadata.get("bytes").map(String::as_str), Some("1001"));
    assert_eq!(info.metadata.get("limit").map(String::as_str), Some("1000"));
    // Nothing of it was committed: the blob is the one before, at its version.
    let after = app
        .client
        .process_turn(request(message("big", "ada", "1")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&after), ["989"]);
    assert_eq!(after.version, fits.version + 1);
}
