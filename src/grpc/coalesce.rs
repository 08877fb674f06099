//! A connection's frames written together: the first write after a flush waits for the tasks
//! already ready to run. The server's accepted connections gather a batch's answers, and
//! Turnstile's own clients' connections (`grpc::client::channel`: the gateway's turns, a remote
//! bot's, turnstile-bench's) the calls their callers send at once.
//!
//! A batch of turns commits at once (`store/postgres/group_commit.rs`), and its turns then finish
//! one after another. Each finished turn wakes its HTTP/2 connection's task, and tokio runs a
//! task just woken next (its LIFO slot), so the connection wrote each answer as soon as it was
//! ready: one `sendto` an answer, and on the client one wake-up and one read an answer
//! (`bench/RESULTS.md`, 2026-11-30: 0.84 `sendto` a turn with four connections, 0.22 with one).
//! The system calls and wake-ups were the largest share of the server's CPU per turn.
//!
//! So the first write after a flush yields instead: the connection's task wakes itself and is
//! put behind the tasks ready to run (tokio reschedules a task that woke itself at the back of
//! its run queue), the batch's other turns finish meanwhile and add their answers to HTTP/2's
//! buffer, and the next poll writes them all in one call. With nothing else ready, the task is
//! polled again at once: a lone answer waits for one more poll of its connection, not for
//! anything else. Reads are untouched.
//!
//! A connection with one call in flight at a time (a client that opens a connection per caller,
//! as k6 does) has nothing to gather, and each yield only costs a poll: 4,500 instructions a
//! turn in the card's k6 count. So a connection judges its yields: one after which the write was
//! no larger than the data waiting before it gathered nothing (a miss), one after which it was
//! larger gathered (a hit). A hit earns [`HIT`] misses of credit, up to [`CREDIT`]; once a
//! connection's misses outrun its credit by [`MISSES`], it writes at once for the next
//! [`SKIPPED`] flushes, then tries again. So it goes on yielding while about one yield in five
//! gathers something (a wasted yield costs a poll; a gathered write saves a system call here and
//! a wake-up and a read in the client), and a connection with one call in flight yields at about
//! one flush in fourteen.
//! Misses are counted against hits, not in a row: a connection's control frames (window updates,
//! pings) often go alone, and counted in a row they stopped the yields of the load generator's
//! connections, whose answers gather (`bench/RESULTS.md`).
//!
//! A client gathers for the same reason from the other side: a batch of answers arriving together
//! wakes that many callers, and each one's next call woke the connection's task, which wrote it
//! alone (`bench/RESULTS.md`, 2026-11-30: turnstile-bench wrote 0.8 times a turn, 0.2 with this).
//!
//! Not with TLS: tonic's TLS wraps this connection, and tokio-rustls takes a write that had to
//! wait as done, then writes again at its flush in the same poll, so a yield there would hold
//! nothing back and cost a poll. With TLS the connection's writes go as they come.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// Misses beyond its credit after which a connection stops yielding for a while.
const MISSES: i16 = 5;
/// The credit a hit earns, in misses.
const HIT: i16 = 4;
/// The most credit a connection holds.
const CREDIT: i16 = 32;
/// How many flushes it then writes at once before it tries a yield again.
const SKIPPED: u16 = 64;

/// Where a connection is between two flushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writes {
    /// Flushed: the next write yields first.
    Flushed,
    /// The write yielded once: the next goes through.
    Yielded,
    /// Writing, until the next flush.
    Writing,
    /// Never yielding.
    Passing,
}

/// `inner`, whose first write after each flush yields once, if it coalesces.
#[derive(Debug)]
pub struct Coalesced<T> {
    inner: T,
    writes: Writes,
    /// The bytes waiting to be written when the last yield began.
    waiting: usize,
    /// Credit left, in misses: hits earn it, misses spend it.
    credit: i16,
    /// Flushes still to write at once before the next yield.
    skipping: u16,
}

impl<T> Coalesced<T> {
    /// `inner`, its writes coalesced.
    pub fn new(inner: T) -> Self {
        Self::in_state(inner, Writes::Flushed)
    }

    /// `inner`, its writes going as they come (beneath TLS).
    pub fn passing(inner: T) -> Self {
        Self::in_state(inner, Writes::Passing)
    }

    /// `inner`, coalesced unless TLS is to wrap it, when its writes go as they come.
    pub fn unless_tls(inner: T, tls: bool) -> Self {
        if tls {
            Self::passing(inner)
        } else {
            Self::new(inner)
        }
    }

    /// Whether its writes are coalesced (not [`Coalesced::passing`]).
    pub fn coalesces(&self) -> bool {
        self.writes != Writes::Passing
    }

    /// The connection it wraps.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    fn in_state(inner: T, writes: Writes) -> Self {
        Self {
            inner,
            writes,
            waiting: 0,
            credit: 0,
            skipping: 0,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Coalesced<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> Coalesced<T> {
    /// Pending once after a flush, with the task woken to come back; ready after that. `len`:
    /// the bytes waiting to be written.
    fn yielded(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<()> {
        match self.writes {
            Writes::Flushed if self.skipping > 0 => {
                self.skipping -= 1;
                self.writes = Writes::Writing;
            }
            Writes::Flushed => {
                self.writes = Writes::Yielded;
                self.waiting = len;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Writes::Yielded => {
                if len > self.waiting {
                    self.credit = (self.credit + HIT).min(CREDIT);
                } else {
                    self.credit -= 1;
                    if self.credit <= -MISSES {
                        self.credit = 0;
                        self.skipping = SKIPPED;
                    }
                }
                self.writes = Writes::Writing;
            }
            Writes::Writing | Writes::Passing => {}
        }
        Poll::Ready(())
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesced<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.yielded(cx, buf.len()));
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let len = bufs.iter().map(|b| b.len()).sum();
        std::task::ready!(self.yielded(cx, len));
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        if flushed.is_ready() && self.writes != Writes::Passing {
            self.writes = Writes::Flushed;
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<T: Connected> Connected for Coalesced<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    /// Counts its wakes.
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records each write it is given.
    #[derive(Default)]
    struct Recorded(Vec<Vec<u8>>);

    impl AsyncWrite for Recorded {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[test]
    fn the_first_write_after_a_flush_yields_once_with_its_task_woken() {
        let wakes = Arc::new(Counting(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut conn = Coalesced::new(Recorded::default());
        let mut write = |conn: &mut Coalesced<Recorded>, data: &[u8]| {
            Pin::new(conn)
                .poll_write(&mut cx, data)
                .map(|n| n.expect("a recorded write"))
        };

        assert_eq!(write(&mut conn, b"one"), Poll::Pending);
        assert_eq!(wakes.0.load(Ordering::Relaxed), 1, "woken to come back");
        assert!(conn.inner.0.is_empty(), "nothing written yet");
        // Back after the others ran: this write and the rest go through until a flush.
        assert_eq!(write(&mut conn, b"one two"), Poll::Ready(7));
        assert_eq!(write(&mut conn, b"three"), Poll::Ready(5));
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut conn).poll_flush(&mut cx).is_ready());
        assert_eq!(wakes.0.load(Ordering::Relaxed), 1);

        // The next write after the flush yields again.
        assert!(
            Pin::new(&mut conn)
                .poll_write(&mut cx, b"four")
                .is_pending()
        );
        assert_eq!(wakes.0.load(Ordering::Relaxed), 2);
        assert_eq!(conn.inner.0, vec![b"one two".to_vec(), b"three".to_vec()]);
    }

    #[test]
    fn yields_that_gather_nothing_stop_for_a_while_then_are_tried_again() {
        let wakes = Arc::new(Counting(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut conn = Coalesced::new(Recorded::default());
        let mut flush_cycle = |conn: &mut Coalesced<Recorded>| {
            let mut polls = 0;
            loop {
                polls += 1;
                // The same one answer each time: nothing joins it.
                if Pin::new(&mut *conn)
                    .poll_write(&mut cx, b"answer")
                    .is_ready()
                {
                    break;
                }
            }
            assert!(Pin::new(&mut *conn).poll_flush(&mut cx).is_ready());
            polls
        };
        for _ in 0..MISSES {
            assert_eq!(flush_cycle(&mut conn), 2, "a yield, then the write");
        }
        for _ in 0..SKIPPED {
            assert_eq!(flush_cycle(&mut conn), 1, "written at once");
        }
        assert_eq!(flush_cycle(&mut conn), 2, "tried again");
        assert_eq!(
            wakes.0.load(Ordering::Relaxed),
            usize::try_from(MISSES).expect("small") + 1
        );
    }

    #[test]
    fn a_hit_in_five_keeps_a_connection_yielding() {
        let waker = Waker::from(Arc::new(Counting(AtomicUsize::new(0))));
        let mut cx = Context::from_waker(&waker);
        let mut conn = Coalesced::new(Recorded::default());
        for cycle in 0..200 {
            // Pending first, then the write: larger (another answer joined) one time in five.
            assert!(
                Pin::new(&mut conn).poll_write(&mut cx, b"a").is_pending(),
                "{cycle}"
            );
            let joined: &[u8] = if cycle % 5 == 0 { b"a b" } else { b"a" };
            assert!(Pin::new(&mut conn).poll_write(&mut cx, joined).is_ready());
            assert!(Pin::new(&mut conn).poll_flush(&mut cx).is_ready());
        }
    }

    #[test]
    fn a_passing_connection_never_yields() {
        let wakes = Arc::new(Counting(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut conn = Coalesced::passing(Recorded::default());
        for _ in 0..2 {
            assert!(Pin::new(&mut conn).poll_write(&mut cx, b"x").is_ready());
            assert!(Pin::new(&mut conn).poll_flush(&mut cx).is_ready());
        }
        assert_eq!(wakes.0.load(Ordering::Relaxed), 0);
        assert_eq!(conn.inner.0.len(), 2);
    }

    #[tokio::test]
    async fn what_is_written_arrives_whole() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (near, mut far) = tokio::io::duplex(64);
        let mut conn = Coalesced::new(near);
        let sent: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let sent = sent.clone();
            tokio::spawn(async move {
                for chunk in sent.chunks(100) {
                    conn.write_all(chunk).await.expect("written");
                    conn.flush().await.expect("flushed");
                }
                conn.shutdown().await.expect("shut down");
            })
        };
        let mut got = Vec::new();
        far.read_to_end(&mut got).await.expect("read");
        writer.await.expect("the writer ran");
        assert_eq!(got, sent);
    }
}
