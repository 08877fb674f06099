//! Trace export and propagation: spans go to an OpenTelemetry collector over OTLP/gRPC when one
//! is configured, and a gateway's W3C `traceparent` makes a turn part of the gateway's trace.
//!
//! Export is set up by `main` (a library must not install global subscribers); propagation is
//! read per call from the gRPC metadata, with no global state, so that it works the same in tests.

use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The environment variable that turns on OTLP export: the collector's gRPC endpoint.
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// A `tracing` layer exporting spans in batches over OTLP/gRPC to `endpoint`, and the provider
/// to shut down (which flushes what is buffered) when the process exits. Call it within a tokio
/// runtime: the exporter's connection lives there.
///
/// # Errors
/// When the exporter cannot be built (an invalid endpoint, say).
pub fn otlp_layer<S>(
    endpoint: &str,
) -> Result<(impl tracing_subscriber::Layer<S>, SdkTracerProvider), anyhow::Error>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("turnstile")
                .build(),
        )
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("turnstile"));
    Ok((layer, provider))
}

/// Makes `span` a child of the trace named by the W3C `traceparent` (and `tracestate`) in
/// `metadata`, when there is one. Without an OpenTelemetry layer this does nothing.
pub fn continue_trace(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    if metadata.get("traceparent").is_none() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&Metadata(metadata));
    // Fails only when no OpenTelemetry layer is installed: then there is no trace to join.
    let _ = span.set_parent(parent);
}

/// gRPC metadata read as W3C trace-context carrier.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)?.to_str().ok()
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}
