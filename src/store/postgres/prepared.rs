//! The statements prepared on each connection, found by the statement and the connection rather
//! than by the statement's text.
//!
//! Why: deadpool's statement cache (`ClientWrapper::prepare_cached`) finds a prepared statement by
//! hashing its whole text with SipHash. Turnstile's statements run to kilobytes, and each lookup
//! cost about 3,000 instructions: some 300 of a warm turn's and 800 of a cold one's
//! (`bench/RESULTS.md`). Here the key is two addresses: the statement's text, a `&'static str`
//! (with its length), and the connection's statement cache (`ClientWrapper::statement_cache`), one
//! per connection.
//!
//! A connection's address could be taken by a later connection once the first's memory is freed.
//! Each entry therefore keeps a `Weak` of its connection's cache, which keeps that memory, and so
//! the address, from being reused while the entry exists: a live connection never finds the entry
//! of a closed one. Entries of closed connections are swept whenever a statement is prepared.
//! deadpool's own cache still prepares each statement once per connection, as before.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};

use deadpool_postgres::{ClientWrapper, StatementCache};
use tokio_postgres::Statement;

/// A statement's text, by address and length, and a connection's statement cache, by address.
type Key = (usize, usize, usize);

type Table = HashMap<Key, (Weak<StatementCache>, Statement), foldhash::fast::RandomState>;

/// Every connection's prepared statements, in this process.
static PREPARED: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

/// `text` prepared on `client`: found, or prepared there now (through deadpool's cache) and kept.
pub(super) async fn statement(
    client: &ClientWrapper,
    text: &'static str,
) -> Result<Statement, tokio_postgres::Error> {
    let key = (text.as_ptr() as usize, text.len(), connection(client));
    if let Some((_, statement)) = table().get(&key) {
        return Ok(statement.clone());
    }
    let statement = client.prepare_cached(text).await?;
    let mut table = table();
    table.retain(|_, (cache, _)| cache.strong_count() > 0);
    table.insert(
        key,
        (Arc::downgrade(&client.statement_cache), statement.clone()),
    );
    Ok(statement)
}

/// The address that tells `client`'s connection from every other live one.
fn connection(client: &ClientWrapper) -> usize {
    Arc::as_ptr(&client.statement_cache) as usize
}

/// The table's lock guards plain map operations only, never an `.await`; a poisoned lock is used
/// as is.
fn table() -> MutexGuard<'static, Table> {
    PREPARED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
