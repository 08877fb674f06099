//! Turnstile behind PgBouncer in transaction mode, the way Kubernetes deployments put a pooler
//! in front of PostgreSQL: PgBouncer 1.18 (Debian's, installed by the test when missing, with no
//! prepared-statement support) started here over a throwaway cluster, with a small server pool
//! so that the replicas' client connections share a few server connections and a session's
//! statements land on whichever is free.
//!
//! Two replicas go through it with `--prepared-statements=false` and the recommended setup —
//! PgBouncer's defaults for startup parameters, `ALTER ROLE … SET statement_timeout` for the
//! server-side limit, migrations straight to PostgreSQL (`--migration-database-url`): the pizza
//! race stays exact and redeliveries are answered from their receipts once. With prepared
//! statements on, the same setup fails, so the setting is what makes it work.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::pg::{self, Cluster};
use support::{TestApp, message, request, say, texts, toppings};
use tokio_postgres::NoTls;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;
use turnstile::store::postgres::{DatabaseUrl, Statements};

/// Server connections PgBouncer keeps per database and user: far fewer than the replicas'
/// client connections.
const SERVER_POOL: usize = 2;

/// Where Debian's package puts the binary.
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// The pgbouncer binary, installed with apt when missing, its service stopped and disabled:
/// the test runs its own.
fn pgbouncer() -> PathBuf {
    static INSTALLED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            let on_path = Command::new("sh")
                .args(["-c", "command -v pgbouncer"])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
            if let Some(found) = on_path.or_else(|| {
                Path::new(PGBOUNCER)
                    .is_file()
                    .then(|| PathBuf::from(PGBOUNCER))
            }) {
                return found;
            }
            let install = || {
                Command::new("apt-get")
                    .args(["install", "-y", "-q", "pgbouncer"])
                    .env("DEBIAN_FRONTEND", "noninteractive")
                    .status()
                    .is_ok_and(|s| s.success())
            };
            if !install() {
                let _ = Command::new("apt-get").args(["update", "-q"]).status();
                assert!(
                    install(),
                    "the pooler tests need PgBouncer and could not install it \
                     (`apt-get install -y pgbouncer` failed; install it, as root)"
                );
            }
            // The package may have started its own service; only the test's bouncer may run.
            for stop in [
                &["service", "pgbouncer", "stop"][..],
                &["update-rc.d", "pgbouncer", "disable"][..],
                &["systemctl", "disable", "pgbouncer"][..],
            ] {
                let _ = Command::new(stop[0])
                    .args(&stop[1..])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            assert!(
                Path::new(PGBOUNCER).is_file(),
                "apt installed pgbouncer, but not at {PGBOUNCER}"
            );
            PathBuf::from(PGBOUNCER)
        })
        .clone()
}

/// A PgBouncer in transaction mode in front of `cluster`, stopped when dropped.
struct Bouncer {
    dir: PathBuf,
    port: u16,
}

impl Bouncer {
    /// Starts PgBouncer with `ignore_startup_parameters` as given, and waits until it answers.
    async fn start(cluster: &Cluster, ignore_startup_parameters: &str) -> Bouncer {
        let binary = pgbouncer();
        let dir = tempfile::Builder::new()
            .prefix("turnstile-pgbouncer-")
            .tempdir()
            .unwrap()
            .keep();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ini = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={pg}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             pool_mode = transaction\n\
             default_pool_size = {SERVER_POOL}\n\
             max_client_conn = 500\n\
             ignore_startup_parameters = {ignore_startup_parameters}\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            pg = cluster.port(),
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        std::fs::write(dir.join("userlist.txt"), "\"postgres\" \"\"\n").unwrap();
        let as_root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        // PgBouncer refuses to run as root.
        let mut command = if as_root {
            let chown = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            assert!(chown.success(), "chown of the PgBouncer directory");
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&binary);
            c
        } else {
            Command::new(&binary)
        };
        let started = command
            .arg("-d")
            .arg(dir.join("pgbouncer.ini"))
            .output()
            .expect("starting pgbouncer");
        assert!(
            started.status.success(),
            "pgbouncer did not start: {}{}",
            String::from_utf8_lossy(&started.stderr),
            std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
        );
        let bouncer = Bouncer { dir, port };
        bouncer.spawn_watchdog();
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return bouncer;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("pgbouncer never listened:\n{}", bouncer.log());
    }

    /// The URL of `database` through the bouncer.
    fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn pid(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("pgbouncer.pid"))
            .ok()
            .map(|p| p.trim().to_owned())
    }

    /// Stops the bouncer when this test process exits, however it exits.
    fn spawn_watchdog(&self) {
        let Some(pid) = self.pid() else { return };
        let script = format!(
            "while kill -0 {me} 2>/dev/null; do sleep 1; done; kill {pid} 2>/dev/null; \
             rm -rf '{dir}'",
            me = std::process::id(),
            dir = self.dir.display()
        );
        let _ = Command::new("setsid")
            .args(["-f", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").arg(&pid).status();
        }
    }
}

/// A private cluster (the role setting below is cluster-wide) with a fresh database, set up as
/// the README recommends behind a pooler: the statement timeout on the role.
async fn cluster_with_database() -> (Cluster, String, String) {
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let direct = pg::fresh_database_in(&cluster).await;
    let (client, connection) = tokio_postgres::connect(&direct, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
        .batch_execute("ALTER ROLE postgres SET statement_timeout = '8s'")
        .await
        .unwrap();
    let database = direct.rsplit('/').next().unwrap().to_owned();
    (cluster, direct, database)
}

/// A replica whose store goes through `pooled`, migrating straight to `direct` on start.
async fn replica(pooled: &str, direct: &str, statements: Statements) -> TestApp {
    TestApp::on(pooled)
        .config(|mut c| {
            c.statements = statements;
            c.migration_url = Some(DatabaseUrl::new(direct));
            c
        })
        .spawn()
        .await
}

fn counted(id: &str, conversation: &str) -> pb::ProcessTurnRequest {
    pb::ProcessTurnRequest::typed(
        pb::Activity {
            id: Some(id.into()),
            ..message(conversation, "alice", "hi")
        },
        "counter",
    )
}

/// `add t00` … `add t39` at once, alternating between `clients`; the replies.
async fn pizza_race(
    clients: &[TurnServiceClient<tonic::transport::Channel>],
    conversation: &str,
) -> Vec<Result<pb::ProcessTurnResponse, tonic::Status>> {
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let mut client = clients[i % clients.len()].clone();
            let activity = message(conversation, &format!("user{i}"), &format!("add t{i:02}"));
            tokio::spawn(async move {
                client
                    .process_turn(request(activity))
                    .await
                    .map(tonic::Response::into_inner)
            })
        })
        .collect();
    let mut replies = Vec::new();
    for call in calls {
        replies.push(call.await.unwrap());
    }
    replies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_through_pgbouncer_in_transaction_mode_are_exact_without_prepared_statements()
{
    let (cluster, direct, database) = cluster_with_database().await;
    // PgBouncer's default: only extra_float_digits may be sent besides what it tracks.
    let bouncer = Bouncer::start(&cluster, "extra_float_digits").await;
    let pooled = bouncer.url(&database);
    let (a, b) = tokio::join!(
        replica(&pooled, &direct, Statements::Unprepared),
        replica(&pooled, &direct, Statements::Unprepared),
    );
    let clients = [a.client.clone(), b.client.clone()];

    // The pizza race: every acknowledged topping survives, one version per commit.
    let replies = pizza_race(&clients, "pooled-pizza").await;
    let mut orders = Vec::new();
    let mut versions = Vec::new();
    let mut replays = 0;
    for (i, reply) in replies.into_iter().enumerate() {
        let reply =
            reply.unwrap_or_else(|s| panic!("add t{i:02} failed: {s:?}\n{}", bouncer.log()));
        let text = texts(&reply).join("\n");
        assert!(text.starts_with(&format!("Added t{i:02}.")), "{text}");
        orders.push(toppings(&text).into_iter().collect::<BTreeSet<_>>());
        versions.push(reply.version);
        replays += usize::from(reply.attempts > 1);
        // A conflict sends the replay to the conversation lock, a transaction-scoped one that
        // works through the pooler: the replay commits.
        assert!(
            reply.attempts <= 2,
            "add t{i:02} ran {} times",
            reply.attempts
        );
    }
    orders.sort_by_key(BTreeSet::len);
    for pair in orders.windows(2) {
        assert!(
            pair[0].len() < pair[1].len() && pair[0].is_subset(&pair[1]),
            "an acknowledged order was lost: {:?} then {:?}",
            pair[0],
            pair[1]
        );
    }
    versions.sort_unstable();
    assert_eq!(
        versions,
        (1..=40).collect::<Vec<u64>>(),
        "one version per commit"
    );
    assert!(replays > 0, "no turn conflicted: the race never happened");
    let mut client = clients[0].clone();
    let shown = say(&mut client, "pooled-pizza", "show").await;
    assert_eq!(toppings(&texts(&shown)[0]).len(), 40, "`show` lists all 40");

    // Redeliveries, ten at once over both replicas: the bot runs once, nine get its receipt.
    let calls: Vec<_> = (0..10)
        .map(|i| {
            let mut client = clients[i % 2].clone();
            tokio::spawn(async move {
                client
                    .process_turn(counted("burst", "pooled-counter"))
                    .await
                    .unwrap()
                    .into_inner()
            })
        })
        .collect();
    let mut responses = Vec::new();
    for call in calls {
        responses.push(call.await.unwrap());
    }
    assert_eq!(responses.iter().filter(|r| !r.redelivered).count(), 1);
    for r in &responses {
        assert_eq!(texts(r), ["count: 1"]);
        assert_eq!(r.version, responses[0].version);
    }
    // And one more time, later, through the other replica.
    let mut other = clients[1].clone();
    let again = other
        .process_turn(counted("burst", "pooled-counter"))
        .await
        .unwrap()
        .into_inner();
    assert!(
        again.redelivered && texts(&again) == ["count: 1"],
        "{again:?}"
    );
    let next = other
        .process_turn(counted("after-burst", "pooled-counter"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&next), ["count: 2"], "the redeliveries did not count");

    // The server-side statement limit reaches the pooled sessions through the role.
    let (check, connection) = tokio_postgres::connect(&pooled, NoTls).await.unwrap();
    tokio::spawn(connection);
    let timeout = check.simple_query("SHOW statement_timeout").await.unwrap();
    let shown = timeout.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
        _ => None,
    });
    assert_eq!(shown.as_deref(), Some("8s"));

    // Receipts are emptied a slot at a time through the pooler too: the detach (two
    // transactions of its own), the truncate and the attach, each one statement.
    let store = turnstile::store::postgres::PostgresStore::connect_with(
        &DatabaseUrl::new(&pooled),
        2,
        Statements::Unprepared,
    )
    .unwrap();
    let receipts = || async {
        let n: i64 = check
            .query_one("SELECT count(*) FROM turnstile.turnstile_receipt", &[])
            .await
            .unwrap()
            .get(0);
        n
    };
    assert!(receipts().await > 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut pruned = 0;
    while receipts().await > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        pruned += turnstile::store::Store::prune_receipts(&store, Duration::from_millis(10))
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", bouncer.log()));
    }
    assert_eq!(receipts().await, 0, "the slots were not emptied");
    assert!(pruned > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_prepared_statements_the_same_setup_fails() {
    let (cluster, direct, database) = cluster_with_database().await;

    // PgBouncer refuses the connection outright: prepared mode sends the statement timeout as
    // the `options` startup parameter.
    let strict = Bouncer::start(&cluster, "extra_float_digits").await;
    let mut server = replica(&strict.url(&database), &direct, Statements::Prepared).await;
    let status = server
        .client
        .process_turn(counted("refused", "prepared"))
        .await
        .expect_err("a turn through PgBouncer with `options` succeeded");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        strict.log().contains("unsupported startup parameter"),
        "{}",
        strict.log()
    );
    drop(server);

    // Told to ignore `options`, PgBouncer lets it in, and prepared statements break: a
    // statement prepared on one server connection is executed on another.
    let lenient = Bouncer::start(&cluster, "extra_float_digits, options").await;
    let pooled = lenient.url(&database);
    let (a, b) = tokio::join!(
        replica(&pooled, &direct, Statements::Prepared),
        replica(&pooled, &direct, Statements::Prepared),
    );
    let clients = [a.client.clone(), b.client.clone()];
    let replies = pizza_race(&clients, "prepared-pizza").await;
    let failed: Vec<tonic::Status> = replies.into_iter().filter_map(Result::err).collect();
    assert!(
        !failed.is_empty(),
        "every turn succeeded with prepared statements behind a transaction pooler"
    );
    let prepared = failed
        .iter()
        .filter(|s| s.code() == tonic::Code::Internal)
        .count();
    eprintln!(
        "{} of 40 turns failed with prepared statements ({prepared} INTERNAL): {:?}",
        failed.len(),
        failed.first()
    );
}
