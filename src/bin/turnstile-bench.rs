//! `turnstile-bench`: a load generator for `TurnService`, like ghz for any gRPC API, plus the check
//! ghz cannot make — that no acknowledged turn was lost or applied twice.
//!
//! It drives the `counter` bot (every message adds one to a conversation counter): each worker
//! sends messages with unique activity ids to a chosen conversation, behaving like a gateway on
//! failure (the same activity again, a few times). At the end it reads every conversation's
//! counter (an `event` named `read`) and compares it with the turns the service acknowledged.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use rand::Rng as _;
use serde_json::json;
use tokio::sync::Mutex;
use tonic::transport::{Channel, Endpoint};
use turnstile::grpc::client;
use turnstile::grpc::convert::json_to_proto_value;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

/// Load generator for Turnstile's TurnService.
#[derive(Debug, Parser)]
#[command(name = "turnstile-bench", version)]
struct Args {
    /// Server addresses (host:port), comma-separated or repeated: several addresses are several
    /// replicas, and turns are spread over them.
    #[arg(
        long = "target",
        value_delimiter = ',',
        default_value = "127.0.0.1:50051"
    )]
    targets: Vec<String>,
    /// Calls in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// HTTP/2 connections per target.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// How long to run, in seconds (ignored with --turns).
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Stop after this many turns instead of after --duration.
    #[arg(long)]
    turns: Option<u64>,
    /// Seconds of load before measuring starts (not counted in the results).
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// Number of distinct conversations.
    #[arg(long, default_value_t = 10_000)]
    conversations: u64,
    /// Fraction of turns sent to one hot conversation (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    hot_share: f64,
    /// The bot to drive; it must count like `counter` for the check to mean anything.
    #[arg(long, default_value = "counter")]
    bot: String,
    /// Bytes of padding each conversation's state carries.
    #[arg(long, default_value_t = 1024)]
    state_bytes: u64,
    /// Deadline of each call, in seconds.
    #[arg(long, default_value_t = 10.0)]
    call_timeout: f64,
    /// Before measuring, send one turn to every conversation, so that the measured turns update
    /// existing state (as in a service that has been running) instead of creating it.
    #[arg(long)]
    prefill: bool,
    /// A shell command run once the prefill is done, before the measured turns; the run fails if
    /// it does. `bench/run.sh` runs `ANALYZE` there: the plans a server made while its tables were
    /// empty are then remade, as autovacuum has them remade within a minute or so of a running
    /// service's start (`bench/RESULTS.md`).
    #[arg(long, value_name = "COMMAND", requires = "prefill")]
    after_prefill: Option<String>,
    /// Skip the final check of the counters.
    #[arg(long)]
    no_verify: bool,
    /// Print the results as one JSON object.
    #[arg(long)]
    json: bool,
    /// Also report the CPU time per measured turn of process PID and all its descendants, as
    /// NAME=PID (repeatable; Linux, from /proc). Point it at the server, or at PostgreSQL's
    /// postmaster to count every backend. The load generator's own is always reported.
    #[arg(long = "cpu-of", value_name = "NAME=PID", value_parser = parse_cpu_of)]
    cpu_of: Vec<(String, u32)>,
    /// Send each turn as a channel would, `POST /api/messages` with `deliveryMode:
    /// expectReplies`, to the `turnstile gateway` at this URL (e.g. `http://127.0.0.1:3978`,
    /// started with `TURNSTILE_BOT=counter`) instead of over gRPC; the counters are still read
    /// over gRPC from --target, which must be the gateway's server.
    #[arg(long)]
    gateway: Option<String>,
    /// Names this run's conversations (eight hex digits; random by default), so that a second
    /// run can continue the conversations of a first (a warm-up run, say).
    #[arg(long)]
    run_id: Option<String>,
    /// Instead of turns, send --turns `grpc.health.v1.Health/Check` calls over the same
    /// connections and concurrency, and print how many succeeded: the transport's own cost.
    #[arg(long)]
    health: bool,
    /// Call `StreamTurn` instead of `ProcessTurn`, for a bot that drafts (`--bot llm`): records
    /// per call the time from the request to its first `draft` and to its `outcome`, and counts
    /// drafts, resets and outcomes. Call N goes to conversation N modulo --conversations (all
    /// distinct while --turns ≤ --conversations; --hot-share still applies), without retries;
    /// the counters are not verified. Fails if a stream ends with an error status, or without
    /// exactly one outcome as its last event.
    #[arg(long, conflicts_with_all = ["gateway", "health"])]
    stream: bool,
    /// Send call N to conversation N modulo --conversations, as --stream does, instead of
    /// drawing conversations at random: with --turns ≤ --conversations every call has a
    /// conversation of its own, so that none waits for another's turn.
    #[arg(long)]
    distinct: bool,
    /// Retry a refused or failed call at once, without the back-off a gateway waits: a caller
    /// that ignores `RetryInfo`, as an overload test wants (`bench/overload.sh`).
    #[arg(long, conflicts_with = "stream")]
    retry_at_once: bool,
}

fn parse_cpu_of(s: &str) -> Result<(String, u32), String> {
    let (name, pid) = s
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=PID, got {s:?}"))?;
    let pid = pid
        .parse()
        .map_err(|_| format!("{pid:?} is not a process id"))?;
    Ok((name.to_owned(), pid))
}

/// What the workers saw, merged.
#[derive(Debug, Default)]
struct Tally {
    latencies: Vec<Duration>,
    statuses: BTreeMap<String, u64>,
    attempts: BTreeMap<u32, u64>,
    redelivered: u64,
    retries: u64,
    /// Per conversation: acknowledged turns, and turns never acknowledged.
    acked: HashMap<u64, u64>,
    unacked: HashMap<u64, u64>,
    /// With --stream: what the streams showed.
    stream: StreamTally,
}

/// With --stream, per measured call: the time to its first draft, and the events it carried.
#[derive(Debug, Default)]
struct StreamTally {
    first_drafts: Vec<Duration>,
    drafts: u64,
    resets: u64,
    outcomes: u64,
    /// Streams that ended OK without a draft (a drafting bot's turn should have one).
    without_draft: u64,
    /// Streams that ended OK without exactly one outcome, or with an event after the outcome or
    /// an empty event.
    malformed: u64,
}

impl StreamTally {
    fn merge(&mut self, other: StreamTally) {
        self.first_drafts.extend(other.first_drafts);
        self.drafts += other.drafts;
        self.resets += other.resets;
        self.outcomes += other.outcomes;
        self.without_draft += other.without_draft;
        self.malformed += other.malformed;
    }
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.latencies.extend(other.latencies);
        for (k, v) in other.statuses {
            *self.statuses.entry(k).or_default() += v;
        }
        for (k, v) in other.attempts {
            *self.attempts.entry(k).or_default() += v;
        }
        self.redelivered += other.redelivered;
        self.retries += other.retries;
        for (k, v) in other.acked {
            *self.acked.entry(k).or_default() += v;
        }
        for (k, v) in other.unacked {
            *self.unacked.entry(k).or_default() += v;
        }
        self.stream.merge(other.stream);
    }
}

/// How many gateway-style retries of one activity before it counts as unacknowledged.
const RETRIES: u32 = 5;

/// mimalloc, as in the server (whose profile had glibc malloc at a third of its CPU): the load
/// generator shares the machine with what it measures, so its own cost matters too.
#[global_allocator]
static ALLOCATOR: turnstile::allocator::Mimalloc = turnstile::allocator::Mimalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    args.check()?;
    let channels = connect(&args).await?;
    if args.health {
        return health_checks(&args, &channels).await;
    }
    let run = args
        .run_id
        .clone()
        .unwrap_or_else(|| format!("{:08x}", rand::rng().random::<u32>()));
    let next_id = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(args.warmup <= 0.0));
    let stop = Arc::new(AtomicBool::new(false));
    let budget = Arc::new(AtomicU64::new(args.turns.unwrap_or(u64::MAX)));
    let args = Arc::new(args);

    let mut prefilled = Tally::default();
    if args.prefill {
        prefilled = prefill(&args, &channels, &run, &next_id).await?;
    }
    if let Some(command) = &args.after_prefill {
        let mut sh = std::process::Command::new("sh");
        sh.arg("-c").arg(command);
        let status = tokio::task::spawn_blocking(move || sh.status())
            .await?
            .with_context(|| format!("starting --after-prefill {command:?}"))?;
        if !status.success() {
            bail!("--after-prefill {command:?} failed: {status}");
        }
    }

    let worker = Worker {
        gateway: gateway_client(&args)?,
        args: Arc::clone(&args),
        run: run.clone(),
        next_id: Arc::clone(&next_id),
        measuring: Arc::clone(&measuring),
        stop: Arc::clone(&stop),
        budget: Arc::clone(&budget),
    };
    let started = Instant::now();
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let client = TurnServiceClient::new(channels[w % channels.len()].clone());
            tokio::spawn(worker.clone().run(client))
        })
        .collect();

    let warmup = Duration::from_secs_f64(args.warmup.max(0.0));
    if !warmup.is_zero() {
        tokio::time::sleep(warmup).await;
        measuring.store(true, Ordering::SeqCst);
    }
    let measure_start = Instant::now();
    let cpu_start = cpu::Usage::now(&args.cpu_of);
    if args.turns.is_none() {
        tokio::time::sleep(Duration::from_secs_f64(args.duration.max(0.0))).await;
        stop.store(true, Ordering::SeqCst);
    }
    let mut tally = Tally {
        acked: prefilled.acked,
        ..Tally::default()
    };
    for worker in workers {
        tally.merge(worker.await.context("a worker failed")?);
    }
    let elapsed = measure_start.elapsed();
    let total_elapsed = started.elapsed();
    let measured_calls = tally.statuses.values().sum();
    let cpu = cpu::Usage::now(&args.cpu_of).per_call_since(&cpu_start, measured_calls);
    // The streamed bot (`llm`) does not count: there is nothing to verify.
    let verify_it = !(args.no_verify || args.stream);
    let verification = match verify_it {
        true => Some(verify(&args, &channels, &run, &tally).await?),
        false => None,
    };
    report(
        &args,
        &tally,
        elapsed,
        total_elapsed,
        &cpu,
        verification.as_ref(),
    )
}

impl Args {
    /// Refuses arguments that make no run.
    fn check(&self) -> anyhow::Result<()> {
        if !(0.0..=1.0).contains(&self.hot_share) {
            bail!("--hot-share must be between 0 and 1");
        }
        if self.concurrency == 0 || self.conversations == 0 {
            bail!("--concurrency and --conversations must be at least 1");
        }
        Ok(())
    }
}

/// One `ProcessTurn` call: the turn's attempts and whether it was a redelivery, or its status
/// and whether that is final (no retry helps).
async fn process(
    client: &mut TurnServiceClient<Channel>,
    request: &pb::ProcessTurnRequest,
    timeout: Duration,
) -> Result<(u32, bool), (String, bool)> {
    let mut call = tonic::Request::new(request.clone());
    call.set_timeout(timeout);
    match client.process_turn(call).await {
        Ok(response) => {
            let response = response.into_inner();
            Ok((response.attempts, response.redelivered))
        }
        Err(status) => Err((
            format!("{:?}", status.code()),
            matches!(
                status.code(),
                tonic::Code::InvalidArgument | tonic::Code::NotFound | tonic::Code::Internal
            ),
        )),
    }
}

/// With `--gateway`, one HTTP/1.1 client — a pool of keep-alive connections, as a channel's
/// would be — and the gateway's `/api/messages`.
fn gateway_client(args: &Args) -> anyhow::Result<Option<(reqwest::Client, String)>> {
    let Some(url) = &args.gateway else {
        return Ok(None);
    };
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .build()
        .context("building the HTTP client")?;
    Ok(Some((
        client,
        format!("{}/api/messages", url.trim_end_matches('/')),
    )))
}

/// --health: `--turns` health checks, `concurrency` at a time over the connections; fails on the
/// first that does not answer SERVING.
async fn health_checks(args: &Args, channels: &[Channel]) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let budget = Arc::new(AtomicU64::new(args.turns.unwrap_or(10_000)));
    let started = Instant::now();
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let mut client = HealthClient::new(channels[w % channels.len()].clone());
            let budget = Arc::clone(&budget);
            tokio::spawn(async move {
                let mut done = 0u64;
                while budget
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
                    .is_ok()
                {
                    let status = client
                        .check(HealthCheckRequest {
                            service: String::new(),
                        })
                        .await
                        .context("a health check failed")?
                        .into_inner()
                        .status;
                    if status != ServingStatus::Serving as i32 {
                        bail!("the server answered status {status}, not SERVING");
                    }
                    done += 1;
                }
                Ok::<_, anyhow::Error>(done)
            })
        })
        .collect();
    let mut done = 0;
    for worker in workers {
        done += worker.await.context("a worker failed")??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "{done} health checks in {elapsed:.1} s ({:.0}/s)",
        done as f64 / elapsed
    );
    Ok(())
}

/// One turn for every conversation, `concurrency` at a time.
async fn prefill(
    args: &Arc<Args>,
    channels: &[Channel],
    run: &str,
    next_id: &Arc<AtomicU64>,
) -> anyhow::Result<Tally> {
    let queue = Arc::new(Mutex::new((0..args.conversations).collect::<Vec<_>>()));
    let fillers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let mut client = TurnServiceClient::new(channels[w % channels.len()].clone());
            let queue = Arc::clone(&queue);
            let worker = Worker {
                gateway: None,
                args: Arc::clone(args),
                run: run.to_owned(),
                next_id: Arc::clone(next_id),
                measuring: Arc::new(AtomicBool::new(false)),
                stop: Arc::new(AtomicBool::new(false)),
                budget: Arc::new(AtomicU64::new(0)),
            };
            tokio::spawn(async move {
                let mut acked = HashMap::new();
                loop {
                    let Some(conversation) = queue.lock().await.pop() else {
                        return Ok::<_, anyhow::Error>(acked);
                    };
                    let id = worker.next_id.fetch_add(1, Ordering::Relaxed);
                    client
                        .process_turn(worker.request(conversation, id))
                        .await
                        .with_context(|| format!("prefilling conversation {conversation}"))?;
                    acked.insert(conversation, 1);
                }
            })
        })
        .collect();
    let mut tally = Tally::default();
    for filler in fillers {
        tally
            .acked
            .extend(filler.await.context("a prefill worker failed")??);
    }
    Ok(tally)
}

async fn connect(args: &Args) -> anyhow::Result<Vec<Channel>> {
    let mut channels = Vec::new();
    for target in &args.targets {
        let uri = if target.contains("://") {
            target.clone()
        } else {
            format!("http://{target}")
        };
        for _ in 0..args.connections.max(1) {
            let endpoint = Endpoint::from_shared(uri.clone())
                .with_context(|| format!("bad target {target}"))?;
            let channel = client::connect(&endpoint)
                .await
                .with_context(|| format!("connecting to {target}"))?;
            channels.push(channel);
        }
    }
    Ok(channels)
}

/// One caller of the load: what it shares with the others (cloned for each).
#[derive(Clone)]
struct Worker {
    args: Arc<Args>,
    /// The HTTP client and `/api/messages` URL, with --gateway.
    gateway: Option<(reqwest::Client, String)>,
    run: String,
    next_id: Arc<AtomicU64>,
    measuring: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    budget: Arc<AtomicU64>,
}

impl Worker {
    async fn run(self, mut client: TurnServiceClient<Channel>) -> Tally {
        if self.args.stream {
            return self.run_streams(client).await;
        }
        let mut tally = Tally::default();
        let timeout = Duration::from_secs_f64(self.args.call_timeout);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            if self
                .budget
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
                .is_err()
            {
                break;
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let conversation = if self.args.distinct && self.args.hot_share <= 0.0 {
                id % self.args.conversations
            } else {
                self.pick_conversation()
            };
            let request = self.request(conversation, id);
            let measuring = self.measuring.load(Ordering::Relaxed);
            let mut acked = false;
            for attempt in 0..=RETRIES {
                if attempt > 0 {
                    tally.retries += 1;
                    if !self.args.retry_at_once {
                        tokio::time::sleep(Duration::from_millis(20 << attempt.min(5))).await;
                    }
                }
                let sent = Instant::now();
                let outcome = match &self.gateway {
                    Some((http, url)) => post(http, url, &request, timeout).await,
                    None => process(&mut client, &request, timeout).await,
                };
                match outcome {
                    Ok((attempts, redelivered)) => {
                        if measuring {
                            tally.latencies.push(sent.elapsed());
                            *tally.statuses.entry("OK".into()).or_default() += 1;
                            *tally.attempts.entry(attempts).or_default() += 1;
                        }
                        tally.redelivered += u64::from(redelivered);
                        acked = true;
                        break;
                    }
                    Err((status, final_)) => {
                        if measuring {
                            *tally.statuses.entry(status).or_default() += 1;
                        }
                        if final_ {
                            break;
                        }
                    }
                }
            }
            let counts = if acked {
                &mut tally.acked
            } else {
                &mut tally.unacked
            };
            *counts.entry(conversation).or_default() += 1;
        }
        tally
    }

    /// --stream: one `StreamTurn` call at a time until the budget or the time is spent, each to
    /// its own conversation, no retries.
    async fn run_streams(self, mut client: TurnServiceClient<Channel>) -> Tally {
        let mut tally = Tally::default();
        let timeout = Duration::from_secs_f64(self.args.call_timeout);
        loop {
            if self.stop.load(Ordering::Relaxed)
                || self
                    .budget
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
                    .is_err()
            {
                break;
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let conversation = if self.args.hot_share > 0.0 {
                self.pick_conversation()
            } else {
                id % self.args.conversations
            };
            let request = pb::StreamTurnRequest::from(self.request(conversation, id));
            let measuring = self.measuring.load(Ordering::Relaxed);
            let call = stream_turn(&mut client, request, timeout).await;
            let ok = call.status == "OK";
            if measuring {
                let s = &mut tally.stream;
                s.drafts += call.drafts;
                s.resets += call.resets;
                s.outcomes += call.outcomes;
                if ok {
                    match call.first_draft {
                        Some(first) => s.first_drafts.push(first),
                        None => s.without_draft += 1,
                    }
                    if call.malformed || call.outcomes != 1 {
                        s.malformed += 1;
                    }
                    if let Some((turn, attempts)) = call.outcome {
                        tally.latencies.push(turn);
                        *tally.attempts.entry(attempts).or_default() += 1;
                    }
                }
                *tally.statuses.entry(call.status).or_default() += 1;
            }
            let counts = if ok {
                &mut tally.acked
            } else {
                &mut tally.unacked
            };
            *counts.entry(conversation).or_default() += 1;
        }
        tally
    }

    /// Conversation 0 is the hot one; the rest are drawn uniformly.
    fn pick_conversation(&self) -> u64 {
        let mut rng = rand::rng();
        if self.args.hot_share > 0.0 && rng.random_bool(self.args.hot_share) {
            0
        } else {
            rng.random_range(0..self.args.conversations)
        }
    }

    fn request(&self, conversation: u64, id: u64) -> pb::ProcessTurnRequest {
        let mut activity = base_activity(&self.run, conversation);
        activity.r#type = Some("message".into());
        // The conversations are the run's, which a later process may continue (--run-id); the
        // activities are this process's own, so that a second run's are not redeliveries of
        // the first's.
        activity.id = Some(format!("{}-{}-{id}", self.run, process_tag()));
        activity.text = Some("count".into());
        if self.args.state_bytes > 0 {
            activity.value = Some(json_to_proto_value(json!({ "pad": self.args.state_bytes })));
        }
        pb::ProcessTurnRequest::typed(activity, self.args.bot.clone())
    }
}

/// What one `StreamTurn` call showed.
#[derive(Debug, Default)]
struct StreamCall {
    /// How the stream ended: `OK`, or the error status's code.
    status: String,
    /// From sending the request to the first draft.
    first_draft: Option<Duration>,
    /// From sending the request to the (first) outcome, and its attempts.
    outcome: Option<(Duration, u32)>,
    drafts: u64,
    resets: u64,
    outcomes: u64,
    /// An event after the outcome, or an event with nothing in it.
    malformed: bool,
}

/// Calls `StreamTurn` and reads the stream to its end, timing its first draft and its outcome.
/// `timeout` bounds the whole stream here: tonic's `grpc-timeout` covers only the response's
/// headers on the client, and a server need not end a stream at the deadline it was sent.
async fn stream_turn(
    client: &mut TurnServiceClient<Channel>,
    request: pb::StreamTurnRequest,
    timeout: Duration,
) -> StreamCall {
    let mut seen = StreamCall::default();
    let mut call = tonic::Request::new(request);
    call.set_timeout(timeout);
    let sent = Instant::now();
    if tokio::time::timeout(timeout, read_stream(client, call, sent, &mut seen))
        .await
        .is_err()
    {
        seen.status = format!("{:?} (the bench's own)", tonic::Code::DeadlineExceeded);
    }
    seen
}

async fn read_stream(
    client: &mut TurnServiceClient<Channel>,
    call: tonic::Request<pb::StreamTurnRequest>,
    sent: Instant,
    seen: &mut StreamCall,
) {
    use pb::stream_turn_response::Event;
    let mut stream = match client.stream_turn(call).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            seen.status = format!("{:?}", status.code());
            return;
        }
    };
    loop {
        match stream.message().await {
            Ok(Some(event)) => {
                if seen.outcomes > 0 {
                    seen.malformed = true;
                }
                match event.event {
                    Some(Event::Draft(_)) => {
                        seen.drafts += 1;
                        seen.first_draft.get_or_insert_with(|| sent.elapsed());
                    }
                    Some(Event::Reset(_)) => seen.resets += 1,
                    Some(Event::Outcome(outcome)) => {
                        seen.outcomes += 1;
                        seen.outcome
                            .get_or_insert_with(|| (sent.elapsed(), outcome.attempts));
                    }
                    None => seen.malformed = true,
                }
            }
            Ok(None) => {
                seen.status = "OK".into();
                return;
            }
            Err(status) => {
                seen.status = format!("{:?}", status.code());
                return;
            }
        }
    }
}

/// This process's tag in its activities' ids: random, the same for all of them.
fn process_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| format!("{:08x}", rand::random::<u32>()))
}

fn base_activity(run: &str, conversation: u64) -> pb::Activity {
    pb::Activity {
        channel_id: Some("bench".into()),
        conversation: Some(pb::ConversationAccount {
            id: Some(format!("{run}-c{conversation}")),
            ..Default::default()
        }),
        from: Some(pb::ChannelAccount {
            id: Some(format!("user-{conversation}")),
            ..Default::default()
        }),
        recipient: Some(pb::ChannelAccount {
            id: Some("bot".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One turn through the gateway: `(attempts, redelivered)` as far as HTTP tells (1, false), or the
/// status and whether retrying is pointless.
async fn post(
    http: &reqwest::Client,
    url: &str,
    request: &pb::ProcessTurnRequest,
    timeout: Duration,
) -> Result<(u32, bool), (String, bool)> {
    let Some(pb::process_turn_request::Input::Activity(activity)) = request.input.clone() else {
        return Err(("no activity".into(), true));
    };
    let mut json = turnstile::activity::Activity::from(*activity).to_json();
    json["deliveryMode"] = json!("expectReplies");
    json["serviceUrl"] = json!("http://127.0.0.1:9/bench");
    let response = http
        .post(url)
        .timeout(timeout)
        .json(&json)
        .send()
        .await
        .map_err(|e| (format!("HTTP error: {e}"), false))?;
    let status = response.status();
    // The replies are part of the cost: read them.
    let body = response
        .bytes()
        .await
        .map_err(|e| (format!("HTTP error: {e}"), false))?;
    if status.is_success() && !body.is_empty() {
        Ok((1, false))
    } else {
        Err((
            format!("HTTP {}", status.as_u16()),
            status.is_client_error() || status.as_u16() == 500,
        ))
    }
}

/// The outcome of comparing every counter with the acknowledged turns.
#[derive(Debug, serde::Serialize)]
struct Verification {
    conversations: usize,
    acknowledged: u64,
    unacknowledged: u64,
    lost: u64,
    doubled: u64,
}

/// Reads every touched conversation's counter. Each acknowledged turn must be counted (else it
/// was lost), and nothing beyond the acknowledged turns plus those whose fate is unknown (else a
/// turn was applied twice).
async fn verify(
    args: &Args,
    channels: &[Channel],
    run: &str,
    tally: &Tally,
) -> anyhow::Result<Verification> {
    let touched: Vec<u64> = tally
        .acked
        .keys()
        .chain(tally.unacked.keys())
        .copied()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let problems = Arc::new(Mutex::new((0u64, 0u64)));
    let queue = Arc::new(Mutex::new(touched.clone()));
    let readers: Vec<_> = (0..args.concurrency.min(64))
        .map(|r| {
            let mut client = TurnServiceClient::new(channels[r % channels.len()].clone());
            let queue = Arc::clone(&queue);
            let problems = Arc::clone(&problems);
            let run = run.to_owned();
            let bot = args.bot.clone();
            let acked = tally.acked.clone();
            let unacked = tally.unacked.clone();
            tokio::spawn(async move {
                loop {
                    let Some(conversation) = queue.lock().await.pop() else {
                        return Ok::<_, anyhow::Error>(());
                    };
                    let mut read = base_activity(&run, conversation);
                    read.r#type = Some("event".into());
                    read.name = Some("read".into());
                    let response = client
                        .process_turn(pb::ProcessTurnRequest::typed(read, bot.clone()))
                        .await
                        .with_context(|| format!("reading conversation {conversation}"))?
                        .into_inner();
                    let text = response
                        .activities
                        .first()
                        .and_then(|a| a.text.clone())
                        .unwrap_or_default();
                    let count: u64 = text
                        .strip_prefix("count: ")
                        .and_then(|n| n.parse().ok())
                        .with_context(|| format!("unexpected reply {text:?}"))?;
                    let acked = acked.get(&conversation).copied().unwrap_or(0);
                    let unknown = unacked.get(&conversation).copied().unwrap_or(0);
                    let mut p = problems.lock().await;
                    p.0 += acked.saturating_sub(count);
                    p.1 += count.saturating_sub(acked + unknown);
                }
            })
        })
        .collect();
    for reader in readers {
        reader.await.context("a reader failed")??;
    }
    let (lost, doubled) = *problems.lock().await;
    Ok(Verification {
        conversations: touched.len(),
        acknowledged: tally.acked.values().sum(),
        unacknowledged: tally.unacked.values().sum(),
        lost,
        doubled,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1000.0
}

/// p50, p90, p99, p99.9 and max of `sorted`, in milliseconds.
fn percentiles(sorted: &[Duration]) -> serde_json::Value {
    json!({
        "p50": percentile(sorted, 50.0),
        "p90": percentile(sorted, 90.0),
        "p99": percentile(sorted, 99.0),
        "p99.9": percentile(sorted, 99.9),
        "max": sorted.last().map_or(0.0, |d| d.as_secs_f64() * 1000.0),
    })
}

fn report(
    args: &Args,
    tally: &Tally,
    elapsed: Duration,
    total_elapsed: Duration,
    cpu: &BTreeMap<String, f64>,
    verification: Option<&Verification>,
) -> anyhow::Result<()> {
    // A closed stdout (the report piped into `head`) ends the run with an error, not a panic.
    let mut stdout = std::io::stdout().lock();
    let mut sorted = tally.latencies.clone();
    sorted.sort_unstable();
    let ok = sorted.len() as f64;
    let throughput = ok / elapsed.as_secs_f64().max(f64::EPSILON);
    let latency = percentiles(&sorted);
    let stream = args.stream.then(|| stream_summary(tally));
    if args.json {
        let mut out = json!({
            "targets": args.targets,
            "concurrency": args.concurrency,
            "conversations": args.conversations,
            "hot_share": args.hot_share,
            "state_bytes": args.state_bytes,
            "seconds": elapsed.as_secs_f64(),
            "turns_per_second": throughput,
            "latency_ms": latency,
            "statuses": tally.statuses,
            "attempts": tally.attempts,
            "retries": tally.retries,
            "redelivered": tally.redelivered,
            "cpu_us_per_turn": cpu,
            "verification": verification,
        });
        if let Some(stream) = &stream {
            out["stream"] = stream.clone();
        }
        writeln!(stdout, "{out}")?;
    } else {
        writeln!(
            stdout,
            "{} turns in {:.2} s ({:.2} s with warm-up): {throughput:.0} turns/s",
            sorted.len(),
            elapsed.as_secs_f64(),
            total_elapsed.as_secs_f64()
        )?;
        write_latencies(&mut stdout, &latency, stream.as_ref())?;
        write_counts(&mut stdout, args, tally, cpu, verification)?;
    }
    check(args, tally, verification)
}

/// The streamed turns' figures: drafts, the time to the first, resets and outcomes.
fn stream_summary(tally: &Tally) -> serde_json::Value {
    let s = &tally.stream;
    let mut first = s.first_drafts.clone();
    first.sort_unstable();
    let streams: u64 = tally.statuses.values().sum();
    json!({
        "first_draft_ms": percentiles(&first),
        "drafts": s.drafts,
        "drafts_per_turn": s.drafts as f64 / streams.max(1) as f64,
        "resets": s.resets,
        "outcomes": s.outcomes,
        "without_draft": s.without_draft,
        "malformed": s.malformed,
    })
}

/// The latency lines of the text report: the turns', and for streams the first draft's too.
fn write_latencies(
    out: &mut impl std::io::Write,
    latency: &serde_json::Value,
    stream: Option<&serde_json::Value>,
) -> anyhow::Result<()> {
    let line = |name: &str, l: &serde_json::Value| {
        format!(
            "{name} ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  p99.9 {:.2}  max {:.2}",
            l["p50"].as_f64().unwrap_or(0.0),
            l["p90"].as_f64().unwrap_or(0.0),
            l["p99"].as_f64().unwrap_or(0.0),
            l["p99.9"].as_f64().unwrap_or(0.0),
            l["max"].as_f64().unwrap_or(0.0),
        )
    };
    match stream {
        None => writeln!(out, "{}", line("latency", latency))?,
        Some(s) => {
            writeln!(out, "{}", line("first draft", &s["first_draft_ms"]))?;
            writeln!(out, "{}", line("whole turn", latency))?;
            writeln!(
                out,
                "streams: {} outcomes, {} drafts ({:.1} per turn), {} resets, {} without a \
                 draft, {} malformed",
                s["outcomes"],
                s["drafts"],
                s["drafts_per_turn"].as_f64().unwrap_or(0.0),
                s["resets"],
                s["without_draft"],
                s["malformed"],
            )?;
        }
    }
    Ok(())
}

/// The counting lines of the text report: statuses, attempts, retries, CPU, verification.
fn write_counts(
    out: &mut impl std::io::Write,
    args: &Args,
    tally: &Tally,
    cpu: &BTreeMap<String, f64>,
    verification: Option<&Verification>,
) -> anyhow::Result<()> {
    writeln!(out, "statuses: {:?}", tally.statuses)?;
    writeln!(out, "attempts: {:?}", tally.attempts)?;
    if !args.stream {
        writeln!(
            out,
            "gateway retries: {}, redelivered answers: {}",
            tally.retries, tally.redelivered
        )?;
    }
    if !cpu.is_empty() {
        let per: Vec<String> = cpu.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
        writeln!(out, "CPU µs per turn: {}", per.join(", "))?;
    }
    if let Some(v) = verification {
        writeln!(
            out,
            "verified {} conversations: {} acknowledged, {} unacknowledged, {} lost, {} doubled",
            v.conversations, v.acknowledged, v.unacknowledged, v.lost, v.doubled
        )?;
    }
    Ok(())
}

/// Fails the run when a stream ended wrong, or a verified turn was lost or applied twice.
fn check(args: &Args, tally: &Tally, verification: Option<&Verification>) -> anyhow::Result<()> {
    if args.stream {
        let s = &tally.stream;
        let failed: u64 = tally
            .statuses
            .iter()
            .filter(|(status, _)| status.as_str() != "OK")
            .map(|(_, n)| n)
            .sum();
        if failed > 0 || s.malformed > 0 {
            bail!(
                "STREAM CHECK FAILED: {failed} streams ended with an error status, {} ended OK \
                 without exactly one outcome as their last event",
                s.malformed
            );
        }
    }
    if let Some(v) = verification {
        if v.lost > 0 || v.doubled > 0 {
            bail!(
                "VERIFICATION FAILED: {} acknowledged turns lost, {} turns applied twice",
                v.lost,
                v.doubled
            );
        }
    }
    Ok(())
}

/// CPU time of processes, read from Linux's /proc, to tell which process a turn's cost lands in
/// when the server, PostgreSQL and this load generator share the machine.
mod cpu {
    use std::collections::{BTreeMap, HashMap};

    /// /proc reports times in USER_HZ, which Linux fixes at 100 for user space.
    const TICKS_PER_SECOND: f64 = 100.0;
    const SELF: &str = "turnstile-bench";

    /// Clock ticks used so far by each named process tree, and by this process.
    pub(super) struct Usage(BTreeMap<String, u64>);

    impl Usage {
        pub(super) fn now(trees: &[(String, u32)]) -> Self {
            let mut usage = BTreeMap::new();
            let Some(table) = processes() else {
                return Self(usage);
            };
            if let Some(own) = table.get(&std::process::id()) {
                usage.insert(SELF.to_owned(), own.ticks);
            }
            for (name, root) in trees {
                usage.insert(name.clone(), tree_ticks(&table, *root));
            }
            Self(usage)
        }

        /// Microseconds of CPU per call between `start` and now; empty without /proc.
        pub(super) fn per_call_since(&self, start: &Usage, calls: u64) -> BTreeMap<String, f64> {
            self.0
                .iter()
                .filter(|_| calls > 0)
                .map(|(name, &end)| {
                    let used = end.saturating_sub(start.0.get(name).copied().unwrap_or(end));
                    (
                        name.clone(),
                        used as f64 / TICKS_PER_SECOND * 1e6 / calls as f64,
                    )
                })
                .collect()
        }
    }

    struct Process {
        parent: u32,
        /// Its own user and system time, plus that of its children it has reaped.
        ticks: u64,
    }

    fn processes() -> Option<HashMap<u32, Process>> {
        let mut table = HashMap::new();
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            if let Some(process) = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|stat| parse_stat(&stat))
            {
                table.insert(pid, process);
            }
        }
        Some(table)
    }

    /// Fields after the command name (which may hold spaces): state, ppid, … utime (14th field of
    /// the line), stime, cutime, cstime.
    fn parse_stat(stat: &str) -> Option<Process> {
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let field = |i: usize| fields.get(i)?.parse::<u64>().ok();
        Some(Process {
            parent: u32::try_from(field(1)?).ok()?,
            ticks: field(11)? + field(12)? + field(13)? + field(14)?,
        })
    }

    fn tree_ticks(table: &HashMap<u32, Process>, root: u32) -> u64 {
        let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
        for (&pid, process) in table {
            children.entry(process.parent).or_default().push(pid);
        }
        let mut total = 0;
        let mut stack = vec![root];
        while let Some(pid) = stack.pop() {
            if let Some(process) = table.get(&pid) {
                total += process.ticks;
            }
            stack.extend(children.get(&pid).into_iter().flatten());
        }
        total
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_stat_line_with_spaces_in_the_name_parses() {
            let line = "42 (tokio rt) S 7 42 42 0 -1 4194560 100 0 0 0 250 30 5 2 20 0 4 0";
            let process = parse_stat(line).expect("parses");
            assert_eq!(process.parent, 7);
            assert_eq!(process.ticks, 250 + 30 + 5 + 2);
        }

        #[test]
        fn this_process_uses_cpu() {
            let start = Usage::now(&[("me".to_owned(), std::process::id())]);
            let mut x = 0u64;
            for i in 0..50_000_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
            std::hint::black_box(x);
            let per =
                Usage::now(&[("me".to_owned(), std::process::id())]).per_call_since(&start, 1);
            assert!(per["me"] > 0.0, "{per:?}");
            assert!(per.contains_key(SELF));
        }
    }
}
