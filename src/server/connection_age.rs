//! The hard end of an aged connection: `max_connection_age` + its grace.
//!
//! tonic 0.14.9 sends the graceful GOAWAY at `max_connection_age` only when no
//! `max_connection_age_grace` is set; with one, it waits age + grace and then closes the
//! connection outright, so clients never hear GOAWAY and never move early (its
//! `connection_timeout_future` sleeps through both before reporting the forceful step). So the
//! server gives tonic the age alone — GOAWAY at `max_age`, calls in flight left to finish — and
//! enforces the grace here, beneath HTTP/2: every accepted socket gets a deadline of age + grace,
//! after which its reads and writes fail, which ends the connection and whatever still runs on
//! it. A turn cut this way still finishes on its own task (see `service.rs`); only its answer is
//! lost, and the gateway's retry gets it from the turn's receipt.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted connection that fails every read and write once its deadline has passed.
#[derive(Debug)]
pub struct Deadlined {
    inner: TcpStream,
    /// Boxed so that the connection stays `Unpin`, as tonic requires.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl Deadlined {
    /// `stream`, closed `lifetime` from now; never when `lifetime` is `None`.
    pub fn new(stream: TcpStream, lifetime: Option<Duration>) -> Self {
        Self {
            inner: stream,
            deadline: lifetime.map(|l| Box::pin(tokio::time::sleep(l))),
        }
    }

    /// An error once the deadline has passed; otherwise registers for a wake-up at it.
    fn expired(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let passed = self
            .deadline
            .as_mut()
            .is_some_and(|sleep| sleep.as_mut().poll(cx).is_ready());
        if passed {
            return Err(aged_out());
        }
        Ok(())
    }

    /// Fails once the timer has fired, without registering for its wake-up: polling the timer at
    /// every read and write cost every call (`bench/RESULTS.md`). The wake-up is
    /// registered by a read that has to wait, which every idle connection is in, and which then
    /// ends with the error.
    fn fired(&self) -> io::Result<()> {
        if self
            .deadline
            .as_ref()
            .is_some_and(|sleep| sleep.is_elapsed())
        {
            return Err(aged_out());
        }
        Ok(())
    }
}

fn aged_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the connection outlived its maximum age and grace period",
    )
}

impl AsyncRead for Deadlined {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.fired()?;
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if read.is_pending() {
            self.expired(cx)?;
        }
        read
    }
}

impl AsyncWrite for Deadlined {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.fired()?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.fired()?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Connected for Deadlined {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn reads_and_writes_fail_after_the_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = tokio::spawn(async move { TcpStream::connect(addr).await });
        let (accepted, _) = listener.accept().await.expect("accept");
        let _client = client.await.expect("join").expect("connect");
        let mut stream = Deadlined::new(accepted, Some(Duration::from_millis(50)));
        stream.write_all(b"before").await.expect("in time");
        // Nothing to read: the read waits, and the deadline ends it.
        let mut buf = [0u8; 8];
        let err = stream.read(&mut buf).await.expect_err("past the deadline");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(stream.write_all(b"after").await.is_err());
    }
}
