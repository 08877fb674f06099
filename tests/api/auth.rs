//! Bearer tokens: with tokens configured, `TurnService` answers `UNAUTHENTICATED` to a call
//! without a valid token and serves one with; health stays reachable for probes.
#![allow(clippy::unwrap_used)]

use crate::support::{self, TestApp};

use std::io::Write as _;

use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use turnstile::config::Config;
use turnstile::grpc::auth::Token;
use turnstile::grpc::pb;

fn with_token(token: Option<&str>) -> tonic::Request<pb::ProcessTurnRequest> {
    let mut request = tonic::Request::new(support::request(support::message(
        "auth-conv",
        "alice",
        "hi",
    )));
    if let Some(token) = token {
        let value: MetadataValue<_> = format!("Bearer {token}").parse().unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    request
}

#[tokio::test]
async fn turns_need_a_valid_token_and_health_does_not() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    writeln!(file, "from-the-file\n").unwrap();
    let mut app = TestApp::memory()
        .config(|c| Config {
            auth_tokens: vec![Token::new("from-the-env")],
            auth_tokens_file: Some(file.path().to_owned()),
            ..c
        })
        .spawn()
        .await;

    let missing = app.client.process_turn(with_token(None)).await.unwrap_err();
    assert_eq!(missing.code(), Code::Unauthenticated, "{missing:?}");
    let wrong = app
        .client
        .process_turn(with_token(Some("from-the-envX")))
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), Code::Unauthenticated, "{wrong:?}");
    assert!(!wrong.message().contains("from-the-env"));
    let mut basic = with_token(None);
    basic
        .metadata_mut()
        .insert("authorization", "Basic ZnJvbS10aGUtZW52".parse().unwrap());
    let basic = app.client.process_turn(basic).await.unwrap_err();
    assert_eq!(basic.code(), Code::Unauthenticated);

    for token in ["from-the-env", "from-the-file"] {
        let ok = app.client.process_turn(with_token(Some(token))).await;
        assert!(ok.is_ok(), "{token}: {ok:?}");
    }

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "turnstile.v1.TurnService".into(),
        })
        .await
        .unwrap();
    assert_eq!(health.into_inner().status(), ServingStatus::Serving);
}

#[tokio::test]
async fn without_tokens_calls_need_none() {
    let mut app = TestApp::memory().spawn().await;
    app.client.process_turn(with_token(None)).await.unwrap();
}

#[tokio::test]
async fn an_unreadable_tokens_file_stops_the_start() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = Config {
        auth_tokens_file: Some("/nonexistent/turnstile-tokens".into()),
        ..Config::default()
    };
    let result = turnstile::serve(config, turnstile::bots::samples(), listener, async {}).await;
    assert!(
        matches!(
            result,
            Err(turnstile::server::ServeError::AuthTokens { .. })
        ),
        "{result:?}"
    );
}
