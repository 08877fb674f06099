//! Health means ready to turn: a server started without migrating over a database whose schema
//! is behind reports `TurnService` NOT_SERVING and refuses turns with UNAVAILABLE
//! (`SCHEMA_BEHIND`), until a migration (the chart's Job) has run — then it serves, without a
//! restart. A schema newer than the binary (a rolling upgrade) is served.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_types::StatusExt as _;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::store::postgres::{self, DatabaseUrl};

use crate::support::{self, TestApp, message, request, say, texts};

const TURNS: &str = "turnstile.v1.TurnService";

async fn health(app: &TestApp) -> HealthClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

async fn status(health: &mut HealthClient<Channel>, service: &str) -> ServingStatus {
    let status = health
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    ServingStatus::try_from(status).unwrap()
}

/// Waits up to 15 s (the check runs every 2 s) for `TurnService` to report `wanted`.
async fn until(health: &mut HealthClient<Channel>, wanted: ServingStatus) {
    for _ in 0..150 {
        if status(health, TURNS).await == wanted {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("TurnService never reported {wanted:?}");
}

/// A turn's error status, once the server has checked the schema (before the first check, a
/// turn is refused as STORE_UNAVAILABLE).
async fn refused_turn(client: &mut TurnServiceClient<Channel>) -> tonic::Status {
    for _ in 0..150 {
        let status = client
            .process_turn(request(message("c1", "alice", "add ham")))
            .await
            .expect_err("a turn over a schema behind was served");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        let reason = status.get_details_error_info().unwrap().reason;
        if reason == "SCHEMA_BEHIND" {
            return status;
        }
        assert_eq!(reason, "STORE_UNAVAILABLE", "{status:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("turns were never refused as SCHEMA_BEHIND");
}

/// `config`, not migrating on start.
fn unmigrated(mut config: turnstile::Config) -> turnstile::Config {
    config.migrate_on_start = false;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmigrated_database_is_not_served_until_migrate_runs() {
    let mut app = TestApp::postgres().config(unmigrated).spawn().await;
    let url = app.database_url().to_owned();
    let mut health = health(&app).await;

    assert_eq!(status(&mut health, TURNS).await, ServingStatus::NotServing);
    assert_eq!(
        status(&mut health, "").await,
        ServingStatus::Serving,
        "the process is up: liveness must not restart it while it waits for the migration"
    );
    let refused = refused_turn(&mut app.client).await;
    assert!(
        refused.message().contains("turnstile migrate")
            && refused.message().contains("no migration has run"),
        "{}",
        refused.message()
    );
    let info = refused.get_details_error_info().unwrap();
    assert_eq!(info.metadata["schema_version"], "none");
    let needed = std::fs::read_dir("migrations").unwrap().count().to_string();
    assert_eq!(info.metadata["needed_version"], needed);
    assert!(refused.get_details_retry_info().is_some());

    // The migration Job runs; the server notices without a restart.
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    until(&mut health, ServingStatus::Serving).await;
    let reply = say(&mut app.client, "c1", "add ham").await;
    assert_eq!(texts(&reply), ["Added ham. Your pizza has: ham."]);
    app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_one_migration_behind_names_both_versions() {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    let needed = postgres::schema::needed_version();
    // As if this binary's last migration had not run yet: its history row gone (the last
    // migration is written to run again harmlessly).
    let admin = support::pg::session(&url).await;
    admin
        .execute(
            "DELETE FROM refinery_schema_history WHERE version = $1",
            &[&i32::try_from(needed).unwrap()],
        )
        .await
        .unwrap();

    let mut app = TestApp::on(&url).config(unmigrated).spawn().await;
    let mut health = health(&app).await;
    assert_eq!(status(&mut health, TURNS).await, ServingStatus::NotServing);
    let refused = refused_turn(&mut app.client).await;
    let info = refused.get_details_error_info().unwrap();
    assert_eq!(info.metadata["schema_version"], (needed - 1).to_string());
    assert!(
        refused.message().contains(&format!(
            "at version {} and this server needs version {needed}",
            needed - 1
        )),
        "{}",
        refused.message()
    );

    assert_eq!(postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap(), 1);
    until(&mut health, ServingStatus::Serving).await;
    say(&mut app.client, "c1", "add ham").await;
    app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_newer_than_the_binary_is_served() {
    let url = support::pg::fresh_database().await;
    postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap();
    // A newer release's migration, applied by its rolling upgrade.
    let admin = support::pg::session(&url).await;
    admin
        .execute(
            "INSERT INTO refinery_schema_history (version, name, applied_on, checksum) \
             VALUES (999, 'from_the_future', now()::text, '0')",
            &[],
        )
        .await
        .unwrap();

    // Without migrating on start, and with: migrate leaves the newer schema alone.
    for migrate_on_start in [false, true] {
        let mut app = TestApp::on(&url)
            .config(move |mut c| {
                c.migrate_on_start = migrate_on_start;
                c
            })
            .spawn()
            .await;
        let mut health = health(&app).await;
        until(&mut health, ServingStatus::Serving).await;
        say(&mut app.client, &format!("c-{migrate_on_start}"), "add ham").await;
        app.stop().await.unwrap();
    }
    assert_eq!(postgres::migrate(&DatabaseUrl::new(&url)).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_at_start_is_not_serving_and_turns_are_unavailable() {
    let port = support::free_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/nothing");
    let mut app = TestApp::on(&url).config(unmigrated).spawn().await;
    let mut health = health(&app).await;
    assert_eq!(status(&mut health, TURNS).await, ServingStatus::NotServing);
    let status = app
        .client
        .process_turn(request(message("c1", "alice", "add ham")))
        .await
        .expect_err("a turn without a database was served");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "STORE_UNAVAILABLE"
    );
    app.stop().await.unwrap();
}
