//! A steady mixed load of `counter` turns, sent the way a channel gateway sends them, with every
//! answer recorded for the checker.
//!
//! Each turn is one message with an activity id of its own. A worker delivers it like a gateway
//! that wants it delivered exactly once: on UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED, CANCELLED or
//! a transport failure it sends the same activity again — to the next server, after a short
//! jittered backoff — until it is acknowledged or a time bound passes. A turn that never got an
//! OK is recorded as such; the checker delivers it later.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng as _;
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

/// The bot every turn goes to.
pub const BOT: &str = "counter";
/// The channel every turn comes from.
pub const CHANNEL: &str = "test";

/// The shape of a load.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Concurrent gateway workers.
    pub workers: usize,
    /// How long workers start new turns at least.
    pub duration: Duration,
    /// Conversations, hot ones included.
    pub conversations: usize,
    /// Conversations `0..hot` are hot.
    pub hot: usize,
    /// The share of turns that go to a hot conversation.
    pub hot_share: f64,
    /// Each call's deadline.
    pub call_timeout: Duration,
    /// How long a worker keeps retrying one turn before it records it as never acknowledged.
    pub turn_bound: Duration,
}

/// The id of conversation `i`.
pub fn conversation_id(i: usize) -> String {
    format!("conv-{i:02}")
}

/// One turn to deliver: an activity id and the conversation it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// The activity id, unique to this turn.
    pub id: String,
    /// The conversation's index.
    pub conversation: usize,
}

/// One OK answer.
#[derive(Debug, Clone)]
pub struct Ack {
    /// The turn's activity id.
    pub id: String,
    /// The turn's conversation.
    pub conversation: usize,
    /// N of the reply `count: N`.
    pub count: u64,
    /// Whether the server said it answered from the turn's receipt.
    pub redelivered: bool,
    /// Which server answered.
    pub server: usize,
    /// When the answer arrived.
    pub at: Instant,
}

/// How a call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// A status the server sent.
    Status(Code),
    /// No status from a server: the connection failed or the client's deadline passed first.
    Transport(Code),
}

impl Failure {
    fn of(status: &tonic::Status) -> Failure {
        // A status decoded from a server's trailers has no source; one the client made up from
        // a connection or timeout error carries that error.
        if std::error::Error::source(status).is_some() || status.code() == Code::Cancelled {
            Failure::Transport(status.code())
        } else {
            Failure::Status(status.code())
        }
    }

    /// Whether a gateway sends the same activity again after this.
    pub fn is_retried(self) -> bool {
        match self {
            Failure::Transport(_) => true,
            Failure::Status(code) => matches!(
                code,
                Code::Unavailable | Code::Aborted | Code::DeadlineExceeded | Code::Cancelled
            ),
        }
    }
}

/// Everything the gateway saw.
#[derive(Debug, Default)]
pub struct Record {
    /// Every turn started, in no particular order.
    pub turns: Vec<Turn>,
    /// Every OK answer.
    pub acks: Vec<Ack>,
    /// Every failed call, with when it failed.
    pub failures: Vec<(Instant, Failure)>,
    /// Turns whose delivery ended without an OK.
    pub unacked: Vec<Turn>,
    /// Calls made.
    pub calls: u64,
}

impl Record {
    /// Failed calls by kind.
    pub fn failures_by_kind(&self) -> HashMap<Failure, usize> {
        let mut by_kind = HashMap::new();
        for (_, failure) in &self.failures {
            *by_kind.entry(*failure).or_insert(0) += 1;
        }
        by_kind
    }
}

/// A channel gateway in front of several servers.
#[derive(Clone)]
pub struct Gateway {
    channels: Arc<Vec<Channel>>,
    record: Arc<Mutex<Record>>,
    call_timeout: Duration,
}

impl Gateway {
    /// A gateway to the servers at `addrs`; connections are made, and remade, on demand.
    pub fn new(addrs: &[SocketAddr], call_timeout: Duration) -> Gateway {
        let channels = addrs
            .iter()
            .map(|addr| {
                Endpoint::from_shared(format!("http://{addr}"))
                    .expect("a valid endpoint")
                    .connect_timeout(Duration::from_millis(500))
                    .tcp_nodelay(true)
                    .connect_lazy()
            })
            .collect();
        Gateway {
            channels: Arc::new(channels),
            record: Arc::new(Mutex::new(Record::default())),
            call_timeout,
        }
    }

    /// How many servers it sends to.
    pub fn servers(&self) -> usize {
        self.channels.len()
    }

    /// Takes what was recorded so far, leaving an empty record.
    pub fn take_record(&self) -> Record {
        std::mem::take(&mut *self.lock())
    }

    /// Delivers `turn`, first to server `first`, retrying as a gateway does until OK or until
    /// `bound` has passed. Returns the acknowledgement, or `None` (recorded as unacknowledged).
    ///
    /// # Panics
    /// On a status a gateway would not retry other than INTERNAL (the test sent something
    /// wrong), and on an OK answer that is not one `count: N` reply.
    pub async fn deliver(&self, turn: &Turn, first: usize, bound: Duration) -> Option<Ack> {
        let started = Instant::now();
        let mut server = first % self.servers();
        let mut backoff = Duration::from_millis(10);
        loop {
            let mut client = TurnServiceClient::new(self.channels[server].clone());
            let mut request = tonic::Request::new(request_for(turn));
            request.set_timeout(self.call_timeout);
            let result = client.process_turn(request).await;
            let at = Instant::now();
            let failure = match result {
                Ok(response) => {
                    let response = response.into_inner();
                    let ack = Ack {
                        id: turn.id.clone(),
                        conversation: turn.conversation,
                        count: count_of(&response).unwrap_or_else(|| {
                            panic!("{turn:?}: not a counter reply: {response:?}")
                        }),
                        redelivered: response.redelivered,
                        server,
                        at,
                    };
                    let mut record = self.lock();
                    record.calls += 1;
                    record.acks.push(ack.clone());
                    return Some(ack);
                }
                Err(status) => {
                    let failure = Failure::of(&status);
                    assert!(
                        !matches!(
                            failure,
                            Failure::Status(Code::InvalidArgument | Code::NotFound)
                        ),
                        "{turn:?}: the test sent a bad request: {status:?}"
                    );
                    let mut record = self.lock();
                    record.calls += 1;
                    record.failures.push((at, failure));
                    failure
                }
            };
            if !failure.is_retried() || started.elapsed() + backoff > bound {
                self.lock().unacked.push(turn.clone());
                return None;
            }
            let pause = rand::rng().random_range(backoff / 2..=backoff);
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(Duration::from_millis(250));
            server = (server + 1) % self.servers();
        }
    }

    /// Runs `shape`'s load until `stop` is set, but for `shape.duration` at least; turn ids start
    /// with `prefix`. Returns when every worker has finished its last turn.
    pub async fn run(&self, shape: Shape, prefix: &str, stop: Arc<AtomicBool>) {
        let end = Instant::now() + shape.duration;
        let workers: Vec<_> = (0..shape.workers)
            .map(|worker| {
                let gateway = self.clone();
                let prefix = prefix.to_owned();
                let stop = Arc::clone(&stop);
                tokio::spawn(async move {
                    let mut seq = 0u64;
                    while Instant::now() < end || !stop.load(Ordering::Relaxed) {
                        seq += 1;
                        let (conversation, first) = {
                            let mut rng = rand::rng();
                            let conversation = if rng.random_bool(shape.hot_share) {
                                rng.random_range(0..shape.hot)
                            } else {
                                rng.random_range(shape.hot..shape.conversations)
                            };
                            (conversation, rng.random_range(0..gateway.servers()))
                        };
                        let turn = Turn {
                            id: format!("{prefix}-w{worker}-{seq}"),
                            conversation,
                        };
                        gateway.lock().turns.push(turn.clone());
                        gateway.deliver(&turn, first, shape.turn_bound).await;
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.await.expect("a load worker panicked");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The request that delivers `turn`: a message from one user, to the `counter` bot.
pub fn request_for(turn: &Turn) -> pb::ProcessTurnRequest {
    let activity = super::message(
        &conversation_id(turn.conversation),
        &format!("user-{}", turn.conversation),
        "hi",
    );
    debug_assert_eq!(activity.channel_id.as_deref(), Some(CHANNEL));
    pb::ProcessTurnRequest::typed(
        pb::Activity {
            id: Some(turn.id.clone()),
            ..activity
        },
        BOT,
    )
}

/// N of a response that is exactly one `count: N` reply.
fn count_of(response: &pb::ProcessTurnResponse) -> Option<u64> {
    match response.activities.as_slice() {
        [reply] => reply.text.as_deref()?.strip_prefix("count: ")?.parse().ok(),
        _ => None,
    }
}
