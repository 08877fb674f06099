//! OTLP export: an OpenTelemetry collector in the test receives a turn's spans, in the trace the
//! caller named with a W3C `traceparent`.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use turnstile::config::Config;

/// A collector that hands every exported span to the test, with its resource's service name.
struct Collector(mpsc::UnboundedSender<(String, Span)>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .map(|a| format!("{:?}", a.value))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for span in scope.spans {
                    let _ = self.0.send((service.clone(), span));
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse::default()))
    }
}

const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";
const REFUSED_TRACE_ID: &str = "1bf7651916cd43dd8448eb211c80319d";
const RPC_SPAN: &str = "turnstile.v1.TurnService/ProcessTurn";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The span's attributes as `key=value` (values in their Debug form).
fn attributes(span: &Span) -> Vec<String> {
    span.attributes
        .iter()
        .map(|a| format!("{}={:?}", a.key, a.value))
        .collect()
}

fn request_in_trace(
    trace_id: &str,
    token: Option<&str>,
) -> Request<turnstile::grpc::pb::ProcessTurnRequest> {
    let mut request = Request::new(support::request(support::message(
        "traced",
        "alice",
        "add cheese",
    )));
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-{CALLER_SPAN}-01").parse().unwrap(),
    );
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_receives_the_spans_of_a_turn_in_the_callers_trace() {
    let (tx, mut spans) = mpsc::unbounded_channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Collector(tx)))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let (layer, provider) =
        turnstile::telemetry::traces::otlp_layer(&format!("http://{collector}")).unwrap();
    tracing_subscriber::registry().with(layer).init();

    let mut app = support::TestApp::memory()
        .config(|c| Config {
            auth_tokens: vec![turnstile::grpc::auth::Token::new("trace-token")],
            ..c
        })
        .spawn()
        .await;
    app.client
        .process_turn(request_in_trace(TRACE_ID, Some("trace-token")))
        .await
        .unwrap();
    let refused = app
        .client
        .process_turn(request_in_trace(REFUSED_TRACE_ID, None))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    tokio::task::spawn_blocking(move || provider.force_flush())
        .await
        .unwrap()
        .unwrap();

    let mut all = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let wanted = |all: &[(String, Span)]| {
        let has = |name: &str| all.iter().filter(|(_, s)| s.name == name).count();
        has("turn") >= 1 && has("attempt") >= 1 && has("process_turn") >= 1 && has(RPC_SPAN) >= 2
    };
    while !wanted(&all) {
        let names: Vec<&str> = all.iter().map(|(_, s)| s.name.as_str()).collect();
        let span = tokio::time::timeout_at(deadline, spans.recv())
            .await
            .unwrap_or_else(|_| panic!("only these spans arrived: {names:?}"))
            .unwrap();
        all.push(span);
    }
    let find = |name: &str, trace: &str| {
        all.iter()
            .map(|(_, s)| s)
            .find(|s| s.name == name && hex(&s.trace_id) == trace)
            .unwrap_or_else(|| panic!("no {name} span in trace {trace}"))
    };

    // The server span: named by the RPC, kind server, the rpc.* attributes, in the caller's
    // trace as the child of the caller's span; the handler's spans are its children.
    let rpc = find(RPC_SPAN, TRACE_ID);
    assert_eq!(
        rpc.kind,
        opentelemetry_proto::tonic::trace::v1::span::SpanKind::Server as i32
    );
    assert_eq!(hex(&rpc.parent_span_id), CALLER_SPAN);
    let rpc_attributes = attributes(rpc);
    for expected in [
        "rpc.system=Some(AnyValue { value: Some(StringValue(\"grpc\")) })",
        "rpc.service=Some(AnyValue { value: Some(StringValue(\"turnstile.v1.TurnService\")) })",
        "rpc.method=Some(AnyValue { value: Some(StringValue(\"ProcessTurn\")) })",
        "rpc.grpc.status_code=Some(AnyValue { value: Some(IntValue(0)) })",
    ] {
        assert!(
            rpc_attributes.contains(&expected.to_owned()),
            "{expected} not in {rpc_attributes:?}"
        );
    }
    let handler = find("process_turn", TRACE_ID);
    assert_eq!(
        handler.parent_span_id, rpc.span_id,
        "the handler's span is the RPC's child"
    );

    // A call refused by authentication gets its server span too, with its status.
    let refused = find(RPC_SPAN, REFUSED_TRACE_ID);
    assert!(
        attributes(refused).contains(
            &"rpc.grpc.status_code=Some(AnyValue { value: Some(IntValue(16)) })".to_owned()
        ),
        "{:?}",
        attributes(refused)
    );
    assert_eq!(hex(&refused.parent_span_id), CALLER_SPAN);

    // The resource names the service (OTEL_SERVICE_NAME is unset here: the default).
    assert!(
        all.iter()
            .all(|(service, _)| service.contains("StringValue(\"turnstile\")")),
        "{:?}",
        all.iter().map(|(service, _)| service).collect::<Vec<_>>()
    );

    let turn = find("turn", TRACE_ID);
    let attributes = attributes(turn);
    assert!(
        attributes.iter().any(|a| a.starts_with("outcome=")),
        "{attributes:?}"
    );
    assert!(
        !all.iter()
            .flat_map(|(_, s)| s.attributes.iter())
            .any(|a| format!("{:?}", a.value).contains("cheese")),
        "message text in a span"
    );
}

/// The binary as shipped (no `RUST_LOG`: the log at `info`) still exports a turn's spans, which
/// are at DEBUG so that the log does not pay for them: trace export filters for itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exports_a_turns_debug_spans_while_its_log_stays_at_info() {
    let (tx, mut spans) = mpsc::unbounded_channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Collector(tx)))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let port = support::free_port();
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .env_clear()
        .env("TURNSTILE_LISTEN", format!("127.0.0.1:{port}"))
        .env("TURNSTILE_GATEWAY_LISTEN", "off")
        // Batches every 100 ms (the SDK's default is 5 s), so the spans arrive while it runs.
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env(
            turnstile::telemetry::traces::OTLP_ENDPOINT_ENV,
            format!("http://{collector}"),
        )
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let address = format!("http://127.0.0.1:{port}");
    let mut client = loop {
        if let Ok(client) =
            turnstile::grpc::pb::turn_service_client::TurnServiceClient::connect(address.clone())
                .await
        {
            break client;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    client
        .process_turn(request_in_trace(TRACE_ID, None))
        .await
        .unwrap();
    let mut names = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let wanted = ["turn", "attempt", "process_turn", RPC_SPAN];
    while !wanted.iter().all(|w| names.iter().any(|n| n == w)) {
        let (_, span) = tokio::time::timeout_at(deadline, spans.recv())
            .await
            .unwrap_or_else(|_| panic!("only these spans arrived: {names:?}"))
            .unwrap();
        if hex(&span.trace_id) == TRACE_ID {
            names.push(span.name);
        }
    }
    drop(client);
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let exited = tokio::task::spawn_blocking(move || server.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exited.success(), "{exited}");
}
