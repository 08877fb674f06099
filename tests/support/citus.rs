//! Citus clusters for the tests: a coordinator and workers, each a throwaway PostgreSQL cluster
//! ([`pg::Cluster`]) with Citus preloaded, on loopback.
//!
//! Citus is not a Debian package: `.ci/run` installs it from `../shared/citus` when that exists
//! (`install.sh`). On a machine without it, the Citus tests say how to install it and pass without
//! running ([`installed`]); under CI with `../shared/citus` beside the checkout, a missing Citus
//! is a failure, so an install that went wrong cannot pass unnoticed.

use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::pg::{self, Cluster};

/// Whether Citus is installed in the PostgreSQL the tests run. When it is not, says how to
/// install it and returns `false`; the caller returns without testing.
///
/// # Panics
/// Under CI (`CI` set) when `../shared/citus` exists beside the checkout and Citus is not
/// installed: `.ci/run` should have installed it.
pub fn installed() -> bool {
    if pg::lib_dir().is_some_and(|lib| lib.join("citus.so").is_file()) {
        return true;
    }
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/citus/install.sh");
    assert!(
        std::env::var_os("CI").is_none() || !shared.is_file(),
        "Citus is not installed, though {} is there: .ci/run installs it before the tests",
        shared.display()
    );
    eprintln!(
        "Citus is not installed, so the Citus tests did not run. To run them, install Citus \
         13.2 for this PostgreSQL: `../shared/citus/install.sh` as root (what .ci/run does), or \
         your distribution's or Citus' own packages"
    );
    false
}

/// A coordinator and its workers.
pub struct CitusCluster {
    pub coordinator: Cluster,
    pub workers: Vec<Cluster>,
}

impl CitusCluster {
    /// Starts a coordinator and `workers` workers (no database of Turnstile's yet: see
    /// [`CitusCluster::fresh_database`]).
    pub fn start(workers: usize) -> CitusCluster {
        CitusCluster::start_with(workers, &[])
    }

    /// [`CitusCluster::start`], every node with `settings` (`name=value`) too.
    pub fn start_with(workers: usize, settings: &[&str]) -> CitusCluster {
        let settings: Vec<&str> = ["shared_preload_libraries=citus"]
            .into_iter()
            .chain(settings.iter().copied())
            .collect();
        let node = || Cluster::start_with(&settings, |_| {});
        CitusCluster {
            coordinator: node(),
            workers: (0..workers).map(|_| node()).collect(),
        }
    }

    /// A new database on every node, with the `citus` extension, the coordinator's, and the
    /// workers added to it: Citus' metadata is per database. Returns the coordinator's URL of it.
    pub async fn fresh_database(&self) -> String {
        let url = self.plain_database().await;
        self.make_distributed(&url).await;
        url
    }

    /// A new database on the coordinator only, without the `citus` extension: a single
    /// PostgreSQL's, until [`CitusCluster::make_distributed`]. Returns its URL.
    pub async fn plain_database(&self) -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "turnstile_citus_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        pg::session(&self.coordinator.url("postgres"))
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("creating a database on the coordinator");
        self.coordinator.url(&name)
    }

    /// Makes the coordinator's database `url` a Citus one, as an operator does with a single
    /// PostgreSQL that becomes a coordinator: the database on every worker, the `citus` extension
    /// everywhere, the coordinator named and the workers added.
    pub async fn make_distributed(&self, url: &str) {
        let config: tokio_postgres::Config = url.parse().expect("a database URL");
        let name = config.get_dbname().expect("a database name").to_owned();
        for worker in &self.workers {
            pg::session(&worker.url("postgres"))
                .await
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .await
                .expect("creating a database on a Citus worker");
            create_citus(worker, &name).await;
        }
        create_citus(&self.coordinator, &name).await;
        let coordinator = pg::session(&self.coordinator.url(&name)).await;
        coordinator
            .execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', $1)",
                &[&i32::from(self.coordinator.port())],
            )
            .await
            .expect("naming the Citus coordinator");
        for worker in &self.workers {
            // Citus syncs its metadata to the worker as it adds it, and on a machine busy with
            // the rest of the suite that sync sometimes fails ("failure on connection marked as
            // essential", CI). The add is undone whole then, so it is asked again.
            let mut tries = 0;
            loop {
                tries += 1;
                match coordinator
                    .execute(
                        "SELECT citus_add_node('127.0.0.1', $1)",
                        &[&i32::from(worker.port())],
                    )
                    .await
                {
                    Ok(_) => break,
                    Err(e) if tries < 5 => {
                        eprintln!("adding a Citus worker failed ({e}); again");
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                    Err(e) => panic!("adding a Citus worker: {e:?}"),
                }
            }
        }
    }
}

/// Creates the `citus` extension in database `name` of `node`.
async fn create_citus(node: &Cluster, name: &str) {
    pg::session(&node.url(name))
        .await
        .batch_execute("CREATE EXTENSION citus")
        .await
        .expect("creating the citus extension");
}

/// The Citus cluster this test process shares (a coordinator and 2 workers), started on first use;
/// each test takes a database of its own in it ([`CitusCluster::fresh_database`]).
pub fn shared() -> &'static CitusCluster {
    static SHARED: OnceLock<CitusCluster> = OnceLock::new();
    SHARED.get_or_init(|| CitusCluster::start(2))
}
