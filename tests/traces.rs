//! OTLP export: an OpenTelemetry collector in the test receives a turn's spans, in the trace the
//! caller named with a W3C `traceparent`.
#![allow(clippy::unwrap_used)]

mod support;

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

/// A collector that hands every exported span to the test.
struct Collector(mpsc::UnboundedSender<Span>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                for span in scope.spans {
                    let _ = self.0.send(span);
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse::default()))
    }
}

const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

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

    let server = support::TestServer::start(Config::default(), turnstile::bots::samples()).await;
    let mut client = server.client().await;
    let mut request = Request::new(support::request(support::message(
        "traced",
        "alice",
        "add cheese",
    )));
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-b7ad6b7169203331-01")
            .parse()
            .unwrap(),
    );
    client.process_turn(request).await.unwrap();
    tokio::task::spawn_blocking(move || provider.force_flush())
        .await
        .unwrap()
        .unwrap();

    let mut names = Vec::new();
    let mut turn = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !(names.contains(&"turn".to_owned()) && names.contains(&"attempt".to_owned())) {
        let span = tokio::time::timeout_at(deadline, spans.recv())
            .await
            .unwrap_or_else(|_| panic!("only these spans arrived: {names:?}"))
            .unwrap();
        names.push(span.name.clone());
        if span.name == "turn" {
            turn = Some(span);
        }
    }
    let turn = turn.unwrap();
    let trace_id: String = turn.trace_id.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(trace_id, TRACE_ID, "the turn joined the caller's trace");
    let attributes: Vec<String> = turn
        .attributes
        .iter()
        .map(|a| format!("{}={:?}", a.key, a.value))
        .collect();
    assert!(
        attributes.iter().any(|a| a.starts_with("outcome=")),
        "{attributes:?}"
    );
    assert!(
        !attributes.iter().any(|a| a.contains("cheese")),
        "message text in a span: {attributes:?}"
    );
}
