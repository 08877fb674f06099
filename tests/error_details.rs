//! The richer error model: every refusal carries `google.rpc.Status` details that a client
//! decodes (here tonic-types' `StatusExt`) — an `ErrorInfo` with a stable reason in the
//! `turnstile.dev` domain, a `BadRequest` naming the field on `INVALID_ARGUMENT`, and a
//! `RetryInfo` only where retrying can help. Oversized messages get `RESOURCE_EXHAUSTED`.
#![allow(clippy::unwrap_used)]

mod support;

use support::{TestServer, message, request};
use tonic::Code;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic_types::StatusExt as _;
use turnstile::config::Config;
use turnstile::grpc::auth::Token;
use turnstile::grpc::error::ERROR_DOMAIN;
use turnstile::grpc::pb;

/// The status's ErrorInfo reason, checking its domain.
fn reason(status: &tonic::Status) -> String {
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo on {status:?}"));
    assert_eq!(info.domain, ERROR_DOMAIN, "{status:?}");
    info.reason
}

/// The fields a BadRequest names.
fn bad_fields(status: &tonic::Status) -> Vec<String> {
    status
        .get_details_bad_request()
        .unwrap_or_else(|| panic!("no BadRequest on {status:?}"))
        .field_violations
        .into_iter()
        .map(|v| v.field)
        .collect()
}

fn with_token(activity: pb::Activity) -> tonic::Request<pb::ProcessTurnRequest> {
    let mut request = tonic::Request::new(request(activity));
    request
        .metadata_mut()
        .insert("authorization", "Bearer t0ken".parse().unwrap());
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_carries_details_a_client_can_decode() {
    let config = Config {
        auth_tokens: vec![Token::new("t0ken")],
        ..Config::default()
    };
    let server = TestServer::start(config, turnstile::bots::samples()).await;
    let mut client = server.client().await;
    let ok = message("details", "alice", "hi");
    client.process_turn(with_token(ok.clone())).await.unwrap();

    // A missing field: INVALID_ARGUMENT naming it from the request, no retry advice.
    let missing = pb::Activity {
        conversation: Some(pb::ConversationAccount::default()),
        ..ok.clone()
    };
    let status = client.process_turn(with_token(missing)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(reason(&status), "INVALID_ACTIVITY");
    assert_eq!(bad_fields(&status), ["activity.conversation.id"]);
    assert!(status.get_details_retry_info().is_none());

    // A field over its limit stays INVALID_ARGUMENT: the caller can shrink the field named.
    let long = pb::Activity {
        text: Some("x".repeat(turnstile::grpc::limits::Limits::default().max_text_bytes + 1)),
        ..ok.clone()
    };
    let status = client.process_turn(with_token(long)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(bad_fields(&status), ["activity.text"]);

    // No activity at all.
    let mut empty = with_token(ok.clone());
    empty.get_mut().activity = None;
    let status = client.process_turn(empty).await.unwrap_err();
    assert_eq!(bad_fields(&status), ["activity"]);

    // A bot not hosted here.
    let mut unknown = with_token(ok.clone());
    unknown.get_mut().bot = "calzone".into();
    let status = client.process_turn(unknown).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(reason(&status), "UNKNOWN_BOT");
    let info = status.get_details_error_info().unwrap();
    assert_eq!(
        info.metadata.get("bot").map(String::as_str),
        Some("calzone")
    );

    // No token.
    let status = client.process_turn(request(ok.clone())).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert_eq!(reason(&status), "UNAUTHENTICATED");

    // A message over the decoding limit: RESOURCE_EXHAUSTED, not tonic's OUT_OF_RANGE, and no
    // retry advice, since the same bytes can never pass.
    let huge = pb::Activity {
        text: Some("x".repeat(5 << 20)),
        ..ok.clone()
    };
    let status = client.process_turn(with_token(huge)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(reason(&status), "MESSAGE_TOO_LARGE");
    assert!(status.get_details_retry_info().is_none(), "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");

    // Bytes that are no protobuf.
    let status = send_raw(&server, vec![0xff, 0xff, 0xff, 0xff, 0x0f, 0x01]).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(reason(&status), "MALFORMED_REQUEST");

    // The connection survived all of it.
    client.process_turn(with_token(ok)).await.unwrap();
}

/// Sends raw bytes as a ProcessTurn request body.
async fn send_raw(server: &TestServer, body: Vec<u8>) -> tonic::Status {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(body);
    request
        .metadata_mut()
        .insert("authorization", "Bearer t0ken".parse().unwrap());
    grpc.unary(
        request,
        PathAndQuery::from_static("/turnstile.v1.TurnService/ProcessTurn"),
        RawCodec,
    )
    .await
    .expect_err("not a valid request")
}

/// Sends raw bytes, decodes nothing (every call here fails).
#[derive(Default)]
struct RawCodec;

struct RawEncoder;
struct NoDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = ();
    type Encoder = RawEncoder;
    type Decoder = NoDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> NoDecoder {
        NoDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        use bytes::BufMut as _;
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for NoDecoder {
    type Item = ();
    type Error = tonic::Status;
    fn decode(&mut self, _: &mut DecodeBuf<'_>) -> Result<Option<()>, tonic::Status> {
        Ok(Some(()))
    }
}
