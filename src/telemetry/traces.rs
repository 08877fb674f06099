//! Trace export and propagation: spans go to an OpenTelemetry collector over OTLP/gRPC when one
//! is configured, and a gateway's W3C `traceparent` makes a turn part of the gateway's trace.
//!
//! Export is set up by `main` (a library must not install global subscribers); propagation is
//! read per call from the request headers (by the RPC layer, [`super::rpc`]), with no global
//! state, so that it works the same in tests.

use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The environment variable that turns on OTLP export: the collector's gRPC endpoint.
pub const OTLP_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The trace resource's `service.name` when the environment names none.
pub const DEFAULT_SERVICE_NAME: &str = "turnstile";

/// The trace resource's `service.name`: `OTEL_SERVICE_NAME`, else a `service.name` in
/// `OTEL_RESOURCE_ATTRIBUTES`, else [`DEFAULT_SERVICE_NAME`] — the precedence the OpenTelemetry
/// specification gives, with our default in place of `unknown_service`. `env` looks a variable
/// up (`std::env::var(..).ok()` in production).
pub fn service_name(env: impl Fn(&str) -> Option<String>) -> String {
    let non_empty = |v: String| (!v.trim().is_empty()).then(|| v.trim().to_owned());
    if let Some(name) = env("OTEL_SERVICE_NAME").and_then(non_empty) {
        return name;
    }
    env("OTEL_RESOURCE_ATTRIBUTES")
        .and_then(|attributes| {
            attributes.split(',').find_map(|pair| {
                let (key, value) = pair.split_once('=')?;
                (key.trim() == "service.name").then(|| value.trim().to_owned())
            })
        })
        .and_then(non_empty)
        .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned())
}

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
                .with_service_name(service_name(|key| std::env::var(key).ok()))
                .build(),
        )
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("turnstile"));
    Ok((layer, provider))
}

/// Makes `span` a child of the trace named by the W3C `traceparent` (and `tracestate`) in
/// `headers`, when there is one. Call it before the span is first entered. Without an
/// OpenTelemetry layer this does nothing.
pub fn continue_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    // A span no subscriber records has no trace to join, so the header is not even looked up;
    // when it is, by a name taken once rather than parsed from a `&str` at every call
    // (`bench/RESULTS.md`).
    if span.is_disabled() || !headers.contains_key(&TRACEPARENT) {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&Headers(headers));
    // Fails only when no OpenTelemetry layer is installed: then there is no trace to join.
    let _ = span.set_parent(parent);
}

/// The W3C trace-context header a caller's trace comes in.
static TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

/// Request headers (gRPC metadata) read as W3C trace-context carrier.
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)?.to_str().ok()
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_name_follows_the_environment_then_defaults() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |key: &str| {
                vars.iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        assert_eq!(service_name(env(&[])), "turnstile");
        assert_eq!(
            service_name(env(&[("OTEL_SERVICE_NAME", "turns-eu")])),
            "turns-eu"
        );
        assert_eq!(
            service_name(env(&[
                ("OTEL_SERVICE_NAME", " "),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "team=chat, service.name=turns-us"
                )
            ])),
            "turns-us"
        );
        assert_eq!(
            service_name(env(&[
                ("OTEL_SERVICE_NAME", "a"),
                ("OTEL_RESOURCE_ATTRIBUTES", "service.name=b")
            ])),
            "a"
        );
    }
}
