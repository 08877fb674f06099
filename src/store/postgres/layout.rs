//! Where Turnstile's objects live: a schema of their own (`--database-schema`, default
//! `turnstile`), so that the tables of the application sharing the database — `\dt` in its
//! schema — are not buried under Turnstile's 1,028.
//!
//! Releases up to 0.1.0 created everything in `public`. `migrate` adopts such a database before
//! it applies migrations: in one transaction, under the migration lock, it moves the tables (the
//! rows stay where they are: a move renames, nothing is copied), the functions and the migration
//! history into the schema, and leaves behind in `public`, for the replicas of the older release
//! that serve until the rollout ends, views of the same names and a `turnstile_commit` that calls
//! the moved one. Those replicas' statements — inserts with `ON CONFLICT`, updates, `FOR
//! UPDATE`, `LOCK TABLE` — work through the views as on the tables (PostgreSQL's simple views
//! are updatable, and locking one locks its table). `turnstile migrate --drop-compat` removes
//! them once no such replica is left.
//!
//! A session finds the schema by its `search_path`: a pooled connection sets it at startup, and
//! for sessions through a transaction-mode pooler, which cannot carry startup options, `migrate`
//! sets it for the role in this database, unless the role has a setting there already; the
//! planner settings of the service's sessions likewise.

use tokio_postgres::Client;

use super::Schema;

/// The tables Turnstile creates, besides its 1,024 lock tables: those of 0.1.0 first, which its
/// replicas use by these names ([`OLDER_RELEASE`]), then those of later migrations, which a
/// database laid out in `public` by a release after 0.1.0 (`--database-schema public`) has.
const TABLES: [&str; 10] = [
    "turnstile_state",
    "turnstile_receipt",
    "turnstile_tombstone",
    "refinery_schema_history",
    "turnstile_receipt_legacy",
    "turnstile_receipt_clock",
    "turnstile_receipt_0",
    "turnstile_receipt_1",
    "turnstile_receipt_2",
    "turnstile_receipt_3",
];

/// The tables an older release's replicas use, by these names, besides the lock tables.
const OLDER_RELEASE: [&str; 2] = ["turnstile_state", "turnstile_receipt"];

/// Its functions, with their arguments.
const FUNCTIONS: [&str; 7] = [
    "turnstile_commit(text[], bigint[], jsonb[], text, jsonb)",
    "turnstile_state_created()",
    "turnstile_key_hash(text)",
    "turnstile_key_conversation(text)",
    "turnstile_key_user(text)",
    "turnstile_receipt_slot(timestamptz)",
    "turnstile_receipt_slots(text, boolean)",
];

/// Its functions that read tables, whose names they must find whoever calls them. Not
/// `turnstile_receipt_slots`, called at every commit: a function's own `search_path` costs each
/// call a change of setting and back; its callers (this release's statements, and the functions
/// here) have the schema on theirs.
const READING: [&str; 3] = [
    "turnstile_commit(text[], bigint[], jsonb[], text, jsonb)",
    "turnstile_state_created()",
    "turnstile_receipt_slot(timestamptz)",
];

/// Prepares `schema` before the migrations run: creates it, adopts a database laid out in
/// `public` by an older release, and points this session at it. Returns whether it adopted.
///
/// # Errors
/// A statement failed; an adoption is undone whole.
pub(super) async fn prepare(
    client: &mut Client,
    schema: &Schema,
) -> Result<bool, tokio_postgres::Error> {
    client
        .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .await?;
    let legacy = schema.as_str() != "public"
        && client
            .query_opt(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                  WHERE n.nspname = 'public' AND c.relname = 'turnstile_state' AND c.relkind = 'r'",
                &[],
            )
            .await?
            .is_some();
    if legacy {
        let transaction = client.transaction().await?;
        transaction.batch_execute(&adoption(schema)).await?;
        transaction.commit().await?;
    }
    client
        .batch_execute(&format!("SET search_path TO {schema}, public"))
        .await?;
    Ok(legacy)
}

/// Once the migrations ran: the functions that read tables find them in `schema` whoever calls
/// them (an older replica through `public`), and the role's sessions get without startup options
/// what a pooled connection's carry — the schema on their path only once no older replica may
/// need `public` first ([`older_replicas_served`]). Run again by `--drop-compat`, which ends that.
///
/// # Errors
/// A statement failed.
pub(super) async fn settle(client: &Client, schema: &Schema) -> Result<(), tokio_postgres::Error> {
    let mut sql = String::new();
    for function in READING {
        sql.push_str(&format!(
            "ALTER FUNCTION {schema}.{function} SET search_path = {schema}, public;\n"
        ));
    }
    // For the role, in this database only, and each only where nothing is set: an operator's own
    // setting wins. These are what a pooled connection of the service's own carries as startup
    // options, which a transaction-mode pooler cannot: the schema, and plans that find rows by
    // index ([`super::PLANS_BY_INDEX`]). Through such a pooler the statements are planned at each
    // execution, but the receipt check's function keeps its plans on the session as a prepared
    // statement does, and a plan it made while a slot was analyzed empty read the slot whole at
    // every commit.
    let search_path = format!("{schema}, public");
    let older = older_replicas_served(client, schema).await?;
    if older {
        // An older replica's sessions get the role's settings too. With the schema first on its
        // path, its `turnstile_receipt` is the slots' table, not its view: its receipts skip the
        // check across the slots and the legacy table (a redelivery of an activity committed
        // before the move would run again), and a race's loser fails on a slot's own index,
        // which it answers INTERNAL for a turn that committed (seen: tests/third_party/
        // upgrade.rs). So no path for the role while the views stand, and one an earlier build
        // set then is taken back.
        sql.push_str(&format!(
            "DO $$ BEGIN
               IF {}
               THEN
                   EXECUTE format('ALTER ROLE %I IN DATABASE %I RESET search_path',
                                  current_user, current_database());
               END IF;
             END $$;\n",
            role_has(&format!("'search_path={search_path}' = ANY (s.setconfig)"))
        ));
    }
    // In `public`, a session's default path reaches the tables already.
    let path =
        (!older && schema.as_str() != "public").then_some(("search_path", search_path.as_str()));
    for (name, value) in path.into_iter().chain(super::PLANS_BY_INDEX) {
        sql.push_str(&format!(
            "DO $$ BEGIN
               IF NOT {}
               THEN
                   EXECUTE format('ALTER ROLE %I IN DATABASE %I SET {name} = {value}',
                                  current_user, current_database());
               END IF;
             END $$;\n",
            role_has(&format!(
                "EXISTS (SELECT 1 FROM unnest(s.setconfig) c WHERE c LIKE '{name}=%')"
            ))
        ));
    }
    client.batch_execute(&sql).await
}

/// SQL: whether the session's role has, in this database, settings for which `condition` (on
/// `s.setconfig`) holds.
fn role_has(condition: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole
                   JOIN pg_database d ON d.oid = s.setdatabase
                  WHERE r.rolname = current_user AND d.datname = current_database()
                    AND {condition})"
    )
}

/// Whether `public` still holds what [`adoption`] left there for an older release's replicas
/// (its views), which may be serving: until `migrate --drop-compat` says none is left.
async fn older_replicas_served(
    client: &Client,
    schema: &Schema,
) -> Result<bool, tokio_postgres::Error> {
    if schema.as_str() == "public" {
        return Ok(false);
    }
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_views WHERE schemaname = 'public' \
                              AND viewname = ANY ($1))",
            &[&OLDER_RELEASE.as_slice()],
        )
        .await?;
    Ok(row.get(0))
}

/// The statements that move an older release's objects from `public` into `schema` and leave
/// views and a wrapper behind for its replicas.
fn adoption(schema: &Schema) -> String {
    let mut sql = String::new();
    // The lock tables first, in the order a turn takes its locks: a turn holding a lock table
    // then reads and writes the state, so a move that held the state while it waited for a
    // lock table would deadlock with it. Once the move holds every lock table, no turn holds
    // one, and the state's turns are short.
    let mut tables: Vec<String> = (0..1024)
        .map(|i| format!("turnstile_lock_{i:04}"))
        .collect();
    tables.extend(TABLES.iter().map(|t| (*t).to_owned()));
    for table in &tables {
        sql.push_str(&format!(
            "ALTER TABLE IF EXISTS public.{table} SET SCHEMA {schema};\n"
        ));
    }
    for function in FUNCTIONS {
        // A function of a release after 0.1.0 may be missing (the database's migrations stop
        // before it): moved if there.
        sql.push_str(&format!(
            "DO $$ BEGIN
               IF to_regprocedure('public.{function}') IS NOT NULL THEN
                   ALTER FUNCTION public.{function} SET SCHEMA {schema};
               END IF;
             END $$;\n"
        ));
    }
    // What an older replica uses, by the names it uses: not the tables it never had, nor the
    // history (an older release that migrates on start refuses this database's newer migrations
    // anyway).
    for table in tables
        .iter()
        .filter(|t| t.starts_with("turnstile_lock_") || OLDER_RELEASE.contains(&t.as_str()))
    {
        sql.push_str(&format!(
            "CREATE VIEW public.{table} AS SELECT * FROM {schema}.{table};\n"
        ));
    }
    sql.push_str(&format!(
        "CREATE FUNCTION public.turnstile_commit(
             p_keys text[], p_expected bigint[], p_states jsonb[], p_receipt_key text,
             p_receipt jsonb, OUT conflict_key text, OUT versions bigint[])
         LANGUAGE sql AS $$
             SELECT * FROM {schema}.turnstile_commit(p_keys, p_expected, p_states, p_receipt_key,
                                                     p_receipt)
         $$;\n"
    ));
    sql
}

/// The statements that remove what [`adoption`] left in `public` for an older release.
pub(super) fn compat_removal() -> String {
    let mut sql = String::from(
        "DROP FUNCTION IF EXISTS public.turnstile_commit(text[], bigint[], jsonb[], text, jsonb);\n",
    );
    let mut tables: Vec<String> = OLDER_RELEASE.iter().map(|t| (*t).to_owned()).collect();
    tables.extend((0..1024).map(|i| format!("turnstile_lock_{i:04}")));
    for table in tables {
        // Views only: a table of that name is an application's, or a release's that never
        // moved, and is left alone.
        sql.push_str(&format!(
            "DO $$ BEGIN
               IF EXISTS (SELECT 1 FROM pg_views WHERE schemaname = 'public' AND viewname = '{table}')
               THEN DROP VIEW public.{table}; END IF;
             END $$;\n"
        ));
    }
    // What V5 added for the views' inserts (`migrations/V5__receipt_slots.sql`), gone with them.
    sql.push_str("DROP FUNCTION IF EXISTS turnstile_receipt_compat_insert();\n");
    sql
}
