//! The `turnstile` binary: parse the configuration, set up logging, then serve, migrate or run
//! the Bot Framework gateway.

use std::io::IsTerminal as _;

use anyhow::Context as _;
use clap::Parser as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use turnstile::config::{Cli, Command, GatewayListen};
use turnstile::store::postgres;
use turnstile::telemetry::{self, traces};

/// mimalloc: glibc malloc took a third of the server's CPU under load (bench/RESULTS.md).
#[global_allocator]
static ALLOCATOR: turnstile::allocator::Mimalloc = turnstile::allocator::Mimalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Each layer filters for itself: the log at `RUST_LOG`, trace export at its own filter, so
    // that a turn's DEBUG spans are created only when export is on (see `telemetry`).
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(telemetry::log_filter());
    let (otlp, provider) = match std::env::var(traces::OTLP_ENDPOINT_ENV) {
        Ok(endpoint) if !endpoint.is_empty() => {
            let (layer, provider) = traces::otlp_layer(&endpoint)
                .with_context(|| format!("setting up OTLP export to {endpoint}"))?;
            (
                Some(layer.with_filter(telemetry::traces_filter())),
                Some(provider),
            )
        }
        _ => (None, None),
    };
    tracing_subscriber::registry().with(fmt).with(otlp).init();

    let result = run(cli).await;
    if let Some(provider) = provider {
        // Flushes the spans still buffered.
        if let Err(e) = provider.shutdown() {
            tracing::warn!(error = %e, "flushing traces failed");
        }
    }
    result
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Some(Command::Migrate(args)) if args.drop_compat => {
            postgres::drop_compat(&args.database_url()).await?;
            tracing::info!("removed what public kept for replicas of 0.1.0");
            Ok(())
        }
        Some(Command::Migrate(args)) => {
            let layout = if args.citus {
                postgres::CitusLayout::Required
            } else {
                postgres::CitusLayout::Detect
            };
            let (applied, citus) = postgres::migrate_with(&args.database_url(), layout).await?;
            tracing::info!(applied, ?citus, "migrations applied");
            Ok(())
        }
        Some(Command::Serve(args)) => serve(args).await,
        Some(Command::HealthCheck(args)) => health_check(&args).await,
        Some(Command::Gateway(args)) => gateway(args).await,
        Some(Command::State(args)) => turnstile::admin_cli::run(&args).await,
        None => serve(cli.serve).await,
    }
}

async fn serve(args: turnstile::config::ServeArgs) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let metrics = match args.metrics_listen {
        Some(address) => Some(
            tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("binding {address} for metrics"))?,
        ),
        None => None,
    };
    let config = args.config();
    let gateway = match args.gateway_listen {
        GatewayListen::At(_) if config.tls.is_some() || config.has_auth_tokens() => {
            tracing::warn!(
                "no embedded gateway: it speaks plaintext gRPC without a token, and this server \
                 requires TLS or a token; run `turnstile gateway` with --turnstile-url and \
                 --turnstile-token instead, or set --gateway-listen off to silence this"
            );
            None
        }
        GatewayListen::At(address) => {
            let grpc = listener
                .local_addr()
                .context("the gRPC listener's address")?;
            // Credentials set for a bot are enforced here as in `turnstile gateway`; without
            // them, an address beyond loopback is refused: that mistake exposes a bot.
            let gateway = args
                .embedded_gateway(grpc, address)
                .context("the embedded gateway (--gateway-listen off serves gRPC only)")?;
            bind_gateway(address)
                .await
                .map(|listener| (gateway, listener))
        }
        GatewayListen::Off => None,
    };
    let shutdown = futures::FutureExt::shared(shutdown_signal());
    // The gateway is a gRPC client of this server over loopback, exactly as it is in its own
    // process; serving both here only saves a newcomer the second command.
    let gateway = gateway.map(|(gateway, gateway_listener)| {
        tokio::spawn(turnstile::gateway::serve(
            gateway,
            gateway_listener,
            shutdown.clone(),
        ))
    });
    turnstile::serve(
        config,
        args.bots(),
        turnstile::server::Listeners {
            grpc: listener,
            metrics,
        },
        shutdown,
    )
    .await?;
    if let Some(gateway) = gateway {
        gateway.await.context("the embedded gateway's task")??;
    }
    Ok(())
}

/// The embedded gateway's listener. A convenience must not keep `TurnService` from serving: a
/// second server on this machine (or a test fleet) finds the port taken and goes on without it.
async fn bind_gateway(address: std::net::SocketAddr) -> Option<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(address).await {
        Ok(listener) => Some(listener),
        Err(e) => {
            tracing::warn!(
                %address, error = %e,
                "no embedded gateway: its address cannot be bound; serving gRPC only \
                 (--gateway-listen sets another address, `off` silences this)"
            );
            None
        }
    }
}

/// Prints the status and exits 0 when serving, 1 when not or when no status could be had.
async fn health_check(args: &turnstile::config::HealthCheckArgs) -> anyhow::Result<()> {
    let status = args
        .probe()
        .check()
        .await
        .with_context(|| format!("checking the health of {}", args.address))?;
    println!("{}", status.as_str_name());
    if status == tonic_health::pb::health_check_response::ServingStatus::Serving {
        Ok(())
    } else {
        anyhow::bail!("{} is not serving", args.address)
    }
}

/// Serves the Bot Framework gateway until SIGINT or SIGTERM.
async fn gateway(args: turnstile::gateway::GatewayArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    config.check_exposure(args.listen, args.insecure, "--insecure")?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let metrics = match args.metrics_listen {
        Some(address) => Some(
            tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("binding {address} for metrics"))?,
        ),
        None => None,
    };
    let listeners = turnstile::gateway::Listeners {
        http: listener,
        metrics,
    };
    turnstile::gateway::serve(config, listeners, shutdown_signal()).await?;
    Ok(())
}

/// Completes at the first SIGINT or SIGTERM. The handlers are in place from this call on, not
/// from the future's first poll: a server answers as soon as it is up, and a SIGTERM sent the
/// moment it answered must stop it gracefully rather than kill it (its first poll can come later,
/// on a busy machine).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let handlers = signal(SignalKind::interrupt()).and_then(|interrupt| {
            signal(SignalKind::terminate()).map(|terminate| (interrupt, terminate))
        });
        async move {
            match handlers {
                Ok((mut interrupt, mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {},
                        _ = terminate.recv() => {},
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM; only SIGINT stops the server");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
