//! Wake-ups for turns waiting for a conversation's hold (`hold`): when a hold is released, its
//! releaser sends `NOTIFY turnstile_hold, '<hold key>'`, and each replica's one listening session
//! passes it to the turns waiting here for that key, which ask again at once instead of at their
//! next pause. So a held conversation passes from turn to turn, across replicas, within a round
//! trip or two of its release. The same session hears `turnstile_interrupt`: a later message
//! asking the holder of a conversation to stop (the double-text policy `interrupt`), which the
//! holder's turn hears within milliseconds instead of at its next renewal.
//!
//! Best effort, by design: the waiters still ask again on their own every so often, so a lost
//! notification, a listener that is reconnecting, or a transaction-mode pooler in front of
//! PostgreSQL (which cannot pass `LISTEN` on) costs a pause, never a turn. The listening session
//! is opened when the first turn waits, not before.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use tokio::sync::broadcast;
use tokio_postgres::AsyncMessage;
use tokio_postgres_rustls::MakeRustlsConnect;

/// The channel releases are announced on.
pub(super) const CHANNEL: &str = "turnstile_hold";
/// The channel a hold's holder is asked to stop on (the double-text policy `interrupt`).
pub(super) const INTERRUPT_CHANNEL: &str = "turnstile_interrupt";

/// What a notification announced about a hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum News {
    Released,
    Interrupted,
}
/// How many announcements may wait for a slow waiter before it misses some (and then asks again,
/// as if woken).
const BACKLOG: usize = 1024;
/// How long the listener waits before opening a session again after one failed or ended.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// The replica's listener, started on first use.
pub(super) struct Waker {
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    released: broadcast::Sender<(News, Arc<str>)>,
    started: Mutex<bool>,
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waker").finish_non_exhaustive()
    }
}

impl Waker {
    /// A waker that listens with `config` and `tls`, once a turn waits.
    pub(super) fn new(config: tokio_postgres::Config, tls: MakeRustlsConnect) -> Self {
        Self {
            config,
            tls,
            released: broadcast::channel(BACKLOG).0,
            started: Mutex::new(false),
        }
    }

    /// The announcements of releases from now on; starts the listener if it is not running.
    pub(super) fn subscribe(self: &Arc<Self>) -> Released {
        let mut started = self
            .started
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !*started {
            *started = true;
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(listen(Arc::downgrade(self)));
            }
        }
        Released(self.released.subscribe())
    }
}

/// The releases and interruptions a turn hears of.
pub(super) struct Released(broadcast::Receiver<(News, Arc<str>)>);

impl Released {
    /// Resolves when hold `key` is announced released (or announcements were missed, which may
    /// have held it); never otherwise.
    pub(super) async fn of(&mut self, key: &str) {
        self.heard(News::Released, key).await;
    }

    /// Resolves when the holder of hold `key` is asked to stop (or announcements were missed,
    /// which may have asked it: the holder then reads its hold to tell); never otherwise.
    pub(super) async fn interrupt_of(&mut self, key: &str) {
        self.heard(News::Interrupted, key).await;
    }

    async fn heard(&mut self, news: News, key: &str) {
        loop {
            match self.0.recv().await {
                Ok((heard, about)) if heard == news && &*about == key => return,
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => return,
                // The listener is gone: the pauses alone wake the waiter.
                Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
            }
        }
    }
}

/// Listens for releases as long as the store lives, opening its session again when it ends.
async fn listen(waker: std::sync::Weak<Waker>) {
    loop {
        let Some(strong) = waker.upgrade() else {
            return;
        };
        let (config, tls, released) = (
            strong.config.clone(),
            strong.tls.clone(),
            strong.released.clone(),
        );
        drop(strong);
        if let Err(e) = session(&config, tls, &released).await {
            tracing::debug!(error = %e, "the hold listener's session ended; reopening");
        }
        tokio::time::sleep(RECONNECT_AFTER).await;
    }
}

/// One listening session: `LISTEN`, then every notification passed on, until it ends.
async fn session(
    config: &tokio_postgres::Config,
    tls: MakeRustlsConnect,
    released: &broadcast::Sender<(News, Arc<str>)>,
) -> Result<(), tokio_postgres::Error> {
    let (client, mut connection) = config.connect(tls).await?;
    let (messages_tx, mut messages) = futures::channel::mpsc::unbounded();
    // Polling for messages drives the session too: the `LISTEN` below is answered through it.
    let driving = tokio::spawn(async move {
        let mut incoming = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = incoming.next().await {
            if messages_tx.unbounded_send(message).is_err() {
                return;
            }
        }
    });
    let listened = client
        .batch_execute(&format!("LISTEN {CHANNEL}; LISTEN {INTERRUPT_CHANNEL}"))
        .await;
    if let Err(e) = listened {
        driving.abort();
        return Err(e);
    }
    while let Some(message) = messages.next().await {
        match message {
            Ok(AsyncMessage::Notification(n)) => {
                let news = if n.channel() == INTERRUPT_CHANNEL {
                    News::Interrupted
                } else {
                    News::Released
                };
                // Nobody waiting: nothing to wake.
                let _ = released.send((news, Arc::from(n.payload())));
            }
            Ok(_) => {}
            Err(e) => {
                driving.abort();
                return Err(e);
            }
        }
    }
    driving.abort();
    Ok(())
}
