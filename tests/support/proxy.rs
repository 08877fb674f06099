//! A TCP proxy the test puts between the servers and PostgreSQL, so that it can cut the network:
//! every live connection reset at once, as a failing switch or a restarted load balancer does,
//! and new connections refused for a moment.
//!
//! A cut lands wherever the connections happen to be: idle in a pool, mid-load, or with a commit
//! sent whose answer never comes back. That last case is the one worth testing: the server
//! cannot know whether its commit applied.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A running proxy to one upstream address; stops, cutting everything, when dropped.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

#[derive(Default)]
struct Shared {
    /// Live connections: the sender that tells each one to reset.
    live: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    next: AtomicU64,
    refuse_until: Mutex<Option<Instant>>,
    opened: AtomicUsize,
    cut: AtomicUsize,
    refused: AtomicUsize,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(Shared::default());
        let accept = tokio::spawn(accept_loop(listener, upstream, Arc::clone(&shared)));
        Proxy {
            addr,
            shared,
            accept,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Resets every live connection, and refuses (resets at once) new ones for `refuse_for`.
    /// Returns how many connections were cut.
    pub fn cut(&self, refuse_for: Duration) -> usize {
        *lock(&self.shared.refuse_until) = Some(Instant::now() + refuse_for);
        let live: Vec<_> = lock(&self.shared.live).drain().collect();
        // A connection that ended meanwhile dropped its receiver: only live ones count.
        let cut = live
            .into_iter()
            .map(|(_, reset)| reset.send(()).is_ok())
            .filter(|sent| *sent)
            .count();
        self.shared.cut.fetch_add(cut, Ordering::Relaxed);
        cut
    }

    /// Connections forwarded so far.
    pub fn opened(&self) -> usize {
        self.shared.opened.load(Ordering::Relaxed)
    }

    /// Connections cut so far.
    pub fn cut_total(&self) -> usize {
        self.shared.cut.load(Ordering::Relaxed)
    }

    /// Connections refused so far.
    pub fn refused(&self) -> usize {
        self.shared.refused.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Dropping the senders resets every connection still open.
        lock(&self.shared.live).clear();
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<Shared>) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            continue;
        };
        let refusing = lock(&shared.refuse_until).is_some_and(|until| Instant::now() < until);
        if refusing {
            shared.refused.fetch_add(1, Ordering::Relaxed);
            let _ = inbound.set_zero_linger();
            drop(inbound);
            continue;
        }
        shared.opened.fetch_add(1, Ordering::Relaxed);
        let id = shared.next.fetch_add(1, Ordering::Relaxed);
        let (reset, reset_rx) = oneshot::channel();
        // Registered under the lock the task's own removal takes, so it cannot remove itself
        // before it is registered.
        let mut live = lock(&shared.live);
        let task_shared = Arc::clone(&shared);
        tokio::spawn(async move {
            forward(inbound, upstream, reset_rx).await;
            lock(&task_shared.live).remove(&id);
        });
        live.insert(id, reset);
    }
}

/// Copies both ways until either side closes, or until told to reset both sides.
async fn forward(mut inbound: TcpStream, upstream: SocketAddr, reset: oneshot::Receiver<()>) {
    let _ = inbound.set_nodelay(true);
    let mut outbound = match TcpStream::connect(upstream).await {
        Ok(outbound) => outbound,
        Err(_) => {
            let _ = inbound.set_zero_linger();
            return;
        }
    };
    let _ = outbound.set_nodelay(true);
    let cut = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
        _ = reset => true,
    };
    if cut {
        // A reset, not an orderly close: neither side gets a goodbye.
        let _ = inbound.set_zero_linger();
        let _ = outbound.set_zero_linger();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
