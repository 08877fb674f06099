//! TLS on the gRPC port, and mutual TLS: certificates made here with rcgen — a CA, a server
//! certificate for `localhost`, a client certificate from that CA and one from another CA.
#![allow(clippy::unwrap_used)]

use crate::support;
use crate::support::pki::{Pem, leaf, new_ca};

use std::net::SocketAddr;
use std::path::PathBuf;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use turnstile::config::{Config, TlsFiles};
use turnstile::gateway::GatewayConfig;
use turnstile::grpc::client::ClientTls;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

struct Pki {
    dir: tempfile::TempDir,
    ca: String,
    client: Pem,
    stranger: Pem,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = new_ca("turnstile test CA");
        let other = new_ca("another CA");
        let server = leaf(&ca, &["localhost", "127.0.0.1"]);
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("server.pem"), &server.cert).unwrap();
        std::fs::write(dir.path().join("server.key"), &server.key).unwrap();
        Pki {
            ca: ca.pem(),
            client: leaf(&ca, &["gateway"]),
            stranger: leaf(&other, &["gateway"]),
            dir,
        }
    }

    fn files(&self, mutual: bool) -> TlsFiles {
        TlsFiles {
            cert: self.path("server.pem"),
            key: self.path("server.key"),
            client_ca: mutual.then(|| self.path("ca.pem")),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

async fn tls_channel(
    addr: SocketAddr,
    ca: &str,
    identity: Option<&Pem>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(&id.cert, &id.key));
    }
    Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

/// Whether a turn over `channel` (or its connection) succeeds.
async fn turn(channel: Result<Channel, tonic::transport::Error>) -> Result<(), String> {
    let channel = channel.map_err(|e| format!("connect: {e:?}"))?;
    TurnServiceClient::new(channel)
        .process_turn(support::request(support::message("tls", "alice", "hi")))
        .await
        .map(|_| ())
        .map_err(|s| format!("{s:?}"))
}

async fn start(pki: &Pki, mutual: bool) -> support::TestServer {
    let config = Config {
        tls: Some(pki.files(mutual)),
        ..Config::default()
    };
    support::TestServer::start(config, turnstile::bots::samples()).await
}

#[tokio::test]
async fn tls_serves_tls_clients_only() {
    let pki = Pki::new();
    let server = start(&pki, false).await;
    let ok = turn(tls_channel(server.addr, &pki.ca, None).await).await;
    assert!(ok.is_ok(), "{ok:?}");

    let plaintext = Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await;
    assert!(turn(plaintext).await.is_err());
}

#[tokio::test]
async fn mutual_tls_needs_a_client_certificate_from_the_configured_ca() {
    let pki = Pki::new();
    let server = start(&pki, true).await;

    let with_client = turn(tls_channel(server.addr, &pki.ca, Some(&pki.client)).await).await;
    assert!(with_client.is_ok(), "{with_client:?}");

    let without = turn(tls_channel(server.addr, &pki.ca, None).await).await;
    assert!(
        without.is_err(),
        "a client without a certificate got through"
    );

    let stranger = turn(tls_channel(server.addr, &pki.ca, Some(&pki.stranger)).await).await;
    assert!(
        stranger.is_err(),
        "a certificate from another CA got through"
    );
}

#[tokio::test]
async fn a_missing_key_file_stops_the_start() {
    let pki = Pki::new();
    let mut files = pki.files(false);
    files.key = pki.path("absent.key");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = Config {
        tls: Some(files),
        ..Config::default()
    };
    let result = turnstile::serve(config, turnstile::bots::samples(), listener, async {}).await;
    assert!(
        matches!(result, Err(turnstile::server::ServeError::TlsFile { .. })),
        "{result:?}"
    );
}

/// `turnstile health-check` with these arguments, off the runtime's threads.
async fn health_check(args: Vec<String>) -> (bool, String) {
    tokio::task::spawn_blocking(move || support::health_check(&args))
        .await
        .unwrap()
}

#[tokio::test]
async fn the_health_check_command_speaks_mutual_tls() {
    let pki = Pki::new();
    let server = start(&pki, true).await;
    std::fs::write(pki.path("client.pem"), &pki.client.cert).unwrap();
    std::fs::write(pki.path("client.key"), &pki.client.key).unwrap();
    let path = |name: &str| pki.path(name).display().to_string();
    let base = vec![
        "--address".to_owned(),
        format!("https://localhost:{}", server.addr.port()),
        "--service".to_owned(),
        "turnstile.v1.TurnService".to_owned(),
        "--ca-cert".to_owned(),
        path("ca.pem"),
    ];

    let mut with_identity = base.clone();
    with_identity.extend([
        "--cert".to_owned(),
        path("client.pem"),
        "--key".to_owned(),
        path("client.key"),
    ]);
    let (ok, out) = health_check(with_identity).await;
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "SERVING");

    let (ok, out) = health_check(base.clone()).await;
    assert!(
        !ok,
        "a probe without a client certificate got an answer: {out}"
    );

    let (ok, out) = health_check(base[..4].to_vec()).await;
    assert!(!ok);
    assert!(out.contains("--ca-cert"), "says what is missing: {out}");
}

/// What the gateway answers for one `expectReplies` message, in development mode, in front of
/// the mutual-TLS server at `addr` with `tls`.
async fn through_gateway(addr: SocketAddr, tls: ClientTls) -> (u16, serde_json::Value) {
    let mut config = GatewayConfig::development(format!("https://localhost:{}", addr.port()));
    config.turnstile_tls = tls;
    config.turn_timeout = std::time::Duration::from_secs(5);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(turnstile::gateway::serve(config, listener, async {
        let _ = stopped.await;
    }));
    let activity = serde_json::json!({
        "type": "message", "id": "tls-1", "channelId": "directline",
        "serviceUrl": "http://127.0.0.1:9", "deliveryMode": "expectReplies",
        "conversation": {"id": "tls-gateway"}, "from": {"id": "alice"},
        "recipient": {"id": "bot"}, "text": "hi"
    });
    let response = reqwest::Client::new()
        .post(format!("http://{gateway}/api/messages"))
        .json(&activity)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(serde_json::Value::Null);
    let _ = stop.send(());
    served.await.unwrap().unwrap();
    (status, body)
}

#[tokio::test]
async fn the_gateway_reaches_a_mutual_tls_server_with_its_ca_and_client_certificate() {
    let pki = Pki::new();
    let server = start(&pki, true).await;
    std::fs::write(pki.path("client.pem"), &pki.client.cert).unwrap();
    std::fs::write(pki.path("client.key"), &pki.client.key).unwrap();
    let tls = ClientTls {
        ca_cert: Some(pki.path("ca.pem")),
        domain: None,
        identity: Some((pki.path("client.pem"), pki.path("client.key"))),
    };

    let (status, body) = through_gateway(server.addr, tls.clone()).await;
    assert_eq!(status, 200, "{body}");
    let replies = body["activities"].as_array().expect("expectReplies body");
    assert!(!replies.is_empty(), "the bot answered: {body}");

    let without_identity = ClientTls {
        identity: None,
        ..tls
    };
    let (status, body) = through_gateway(server.addr, without_identity).await;
    assert!(
        status >= 500,
        "a gateway without a client certificate got a turn through: {status} {body}"
    );
}
