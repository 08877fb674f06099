//! The chat page at `/`: the project's own small Direct Line client (HTML, plain JavaScript and
//! CSS compiled into the binary, nothing fetched from elsewhere), so that a newcomer who ran
//! `cargo run --release` can talk to the pizza bot in a browser, and so that the gateway's
//! Direct Line has a client that ships with it.

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

const INDEX: &str = include_str!("page/index.html");
const SCRIPT: &str = include_str!("page/chat.js");
const STYLE: &str = include_str!("page/chat.css");

/// `/`, `/chat.js` and `/chat.css`.
pub(super) fn routes() -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/chat.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/chat.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            // The page runs only its own script and talks only to its own origin.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; img-src 'self' https: data:; connect-src 'self' ws: wss:",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
}
