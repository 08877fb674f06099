//! Whether the database's schema is the one this binary's statements were written for, and the
//! gate that keeps turns off a database whose schema is behind.
//!
//! The schema's version is the highest version in refinery's history table (`migrations/`,
//! applied by `turnstile migrate` or on start). A schema behind the binary fails every turn (a
//! missing table or function), so a server started without migrating (the chart's pods, whose
//! migration Job may not have run yet) holds its turns at the gate until a check finds the
//! migrations applied; the server reports `NOT_SERVING` meanwhile (`server.rs`). A schema ahead
//! of the binary is one a newer replica migrated during a rolling upgrade: migrations are
//! forward-only and additive, so the older replica keeps serving beside it.
//!
//! The gate is one atomic load per store call; the check is a query of its own, a few seconds
//! apart, off the turns' path.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};

use tokio_postgres::error::SqlState;

/// The schema version this binary's migrations reach: the highest of `migrations/`.
pub fn needed_version() -> i64 {
    super::embedded::migrations::runner()
        .get_migrations()
        .iter()
        .map(|m| i64::from(m.version()))
        .max()
        .unwrap_or(0)
}

/// The database's schema against this binary's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaStatus {
    /// Exactly the binary's.
    Current {
        /// The version.
        version: i64,
    },
    /// Migrations this binary needs have not run.
    Behind(SchemaBehind),
    /// A newer binary migrated past this one (a rolling upgrade): served all the same.
    Ahead {
        /// The database's version.
        found: i64,
        /// This binary's.
        known: i64,
    },
}

impl SchemaStatus {
    /// The status of a database whose history reaches `found` (`None`: no history table).
    pub fn of(found: Option<i64>) -> Self {
        let needed = needed_version();
        match found {
            Some(found) if found == needed => Self::Current { version: found },
            Some(found) if found > needed => Self::Ahead {
                found,
                known: needed,
            },
            found => Self::Behind(SchemaBehind { found, needed }),
        }
    }

    /// Whether turns can be served over it.
    pub fn is_servable(&self) -> bool {
        !matches!(self, Self::Behind(_))
    }
}

impl std::fmt::Display for SchemaStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Current { version } => write!(f, "the database schema is at version {version}"),
            Self::Behind(behind) => behind.fmt(f),
            Self::Ahead { found, known } => write!(
                f,
                "the database schema is at version {found}, newer than this binary's {known} (a \
                 newer release migrated it)"
            ),
        }
    }
}

/// The database's schema is behind this binary's: the error a turn gets, and the reason the
/// server is not serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub struct SchemaBehind {
    /// The database's version; `None` when no migration has ever run there.
    pub found: Option<i64>,
    /// The version this binary needs.
    pub needed: i64,
}

impl std::fmt::Display for SchemaBehind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.found {
            None => write!(
                f,
                "the database has no Turnstile schema (no migration has run there)"
            )?,
            Some(found) => write!(f, "the database schema is at version {found}")?,
        }
        write!(
            f,
            " and this server needs version {}: run `turnstile migrate` (the chart's migration \
             Job), or start with --migrate-on-start true",
            self.needed
        )
    }
}

/// The highest version in refinery's history, `None` when there is no history table. One simple
/// query: no prepared statement, so behind a transaction-mode pooler too.
///
/// # Errors
/// When the query fails for another reason than a missing history table.
pub(super) async fn applied_version(
    client: &tokio_postgres::Client,
) -> Result<Option<i64>, tokio_postgres::Error> {
    let rows = match client
        .simple_query("SELECT max(version) FROM refinery_schema_history")
        .await
    {
        Ok(rows) => rows,
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => return Ok(None),
        Err(e) => return Err(e),
    };
    let version = rows.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).and_then(|v| v.parse().ok()),
        _ => None,
    });
    Ok(version)
}

/// Where Turnstile's tables are when this session's `search_path` does not reach them: the
/// schema holding a migration history that is not on the path, and the path. `None` when there is
/// no such schema. One simple query, as [`applied_version`].
///
/// # Errors
/// When the query fails.
pub(super) async fn unreached(
    client: &tokio_postgres::Client,
) -> Result<Option<(String, String)>, tokio_postgres::Error> {
    let rows = client
        .simple_query(
            "SELECT n.nspname, current_setting('search_path') \
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
              WHERE c.relname = 'refinery_schema_history' \
                AND n.nspname <> ALL (current_schemas(false)) \
              ORDER BY n.nspname = 'turnstile' DESC, n.nspname LIMIT 1",
        )
        .await?;
    Ok(rows.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => {
            Some((row.get(0)?.to_owned(), row.get(1)?.to_owned()))
        }
        _ => None,
    }))
}

const OPEN: u8 = 0;
const BEHIND: u8 = 1;
const UNCHECKED: u8 = 2;

/// Whether store calls may reach the database: open unless a check found the schema behind, or
/// the server asked for a first check before serving.
#[derive(Debug)]
pub(super) struct SchemaGate {
    state: AtomicU8,
    /// What the last check found behind, for the error (read on refusal only).
    behind: Mutex<Option<SchemaBehind>>,
}

impl SchemaGate {
    /// An open gate: a store built by hand serves at once, as before any check.
    pub(super) fn open() -> Self {
        Self {
            state: AtomicU8::new(OPEN),
            behind: Mutex::new(None),
        }
    }

    /// Closes the gate until [`SchemaGate::record`] records a servable schema.
    pub(super) fn close_until_checked(&self) {
        self.state.store(UNCHECKED, Ordering::Release);
    }

    /// Opens or closes the gate as `status` says.
    pub(super) fn record(&self, status: SchemaStatus) {
        match status {
            SchemaStatus::Behind(behind) => {
                *self.behind.lock().unwrap_or_else(PoisonError::into_inner) = Some(behind);
                self.state.store(BEHIND, Ordering::Release);
            }
            SchemaStatus::Current { .. } | SchemaStatus::Ahead { .. } => {
                self.state.store(OPEN, Ordering::Release);
            }
        }
    }

    /// `Ok` when open; the reason it is closed otherwise. One atomic load on the open path.
    #[inline]
    pub(super) fn admit(&self) -> Result<(), super::StoreError> {
        if self.state.load(Ordering::Relaxed) == OPEN {
            Ok(())
        } else {
            Err(self.refusal())
        }
    }

    #[cold]
    fn refusal(&self) -> super::StoreError {
        let behind = *self.behind.lock().unwrap_or_else(PoisonError::into_inner);
        match (self.state.load(Ordering::Acquire), behind) {
            (BEHIND, Some(behind)) => super::StoreError::Unavailable(behind.into()),
            _ => super::StoreError::Unavailable(anyhow::anyhow!(
                "the database schema has not been checked yet (PostgreSQL has not been reached \
                 since the start)"
            )),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_needed_version_is_the_last_migration() {
        let files = std::fs::read_dir("migrations").unwrap().count();
        assert_eq!(needed_version(), i64::try_from(files).unwrap());
    }

    #[test]
    fn behind_current_and_ahead() {
        let needed = needed_version();
        assert_eq!(
            SchemaStatus::of(None),
            SchemaStatus::Behind(SchemaBehind {
                found: None,
                needed
            })
        );
        assert!(!SchemaStatus::of(Some(needed - 1)).is_servable());
        assert_eq!(
            SchemaStatus::of(Some(needed)),
            SchemaStatus::Current { version: needed }
        );
        assert!(SchemaStatus::of(Some(needed + 1)).is_servable());
        let message = SchemaStatus::of(Some(1)).to_string();
        assert!(
            message.contains("version 1") && message.contains(&format!("needs version {needed}")),
            "{message}"
        );
        assert!(message.contains("turnstile migrate"), "{message}");
    }

    #[test]
    fn the_gate_refuses_with_the_reason_and_opens_when_current() {
        let gate = SchemaGate::open();
        assert!(gate.admit().is_ok());
        gate.close_until_checked();
        let Err(super::super::StoreError::Unavailable(e)) = gate.admit() else {
            panic!("an unchecked gate admitted a call");
        };
        assert!(!e.is::<SchemaBehind>());
        gate.record(SchemaStatus::of(Some(1)));
        let Err(super::super::StoreError::Unavailable(e)) = gate.admit() else {
            panic!("a gate behind admitted a call");
        };
        assert_eq!(e.downcast_ref::<SchemaBehind>().unwrap().found, Some(1));
        gate.record(SchemaStatus::of(Some(needed_version())));
        assert!(gate.admit().is_ok());
    }
}
