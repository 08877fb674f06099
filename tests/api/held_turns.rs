//! The fenced hold of streamed turns (`store::postgres::hold`): a streamed turn holds its
//! conversation across replicas while its bot runs, with no connection or transaction held for
//! that time; a redelivery of its activity on another replica joins its outcome instead of
//! running the bot again; and a holder that stalled past its hold cannot commit, but replays.
//! On real PostgreSQL, with two replicas.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use support::streams::{collect, outcome};
use support::{TestApp, message, texts};
use tokio::sync::Semaphore;
use turnstile::bot::{Bot, BotError, BotRegistry, TurnContext};
use turnstile::grpc::pb;
use turnstile::grpc::pb::stream_turn_response::Event;

/// Appends each message's text to the conversation's list, drafting it first; a message
/// `wait` holds its first attempt on `gate` after drafting. Counts its runs.
struct Lists {
    gate: Arc<Semaphore>,
    runs: Arc<AtomicU32>,
}

#[async_trait]
impl Bot for Lists {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let mut items: Vec<String> = turn.conversation_property("items")?;
        items.push(turn.text().to_owned());
        turn.draft(items.join(", "))?;
        if turn.text() == "wait" && turn.attempt() == 1 {
            self.gate.acquire().await?.forget();
        }
        turn.conversation_state().set("items", &items)?;
        turn.send_text(items.join(", "));
        Ok(())
    }
}

struct Replicas {
    a: TestApp,
    b: TestApp,
    gate: Arc<Semaphore>,
    runs: Arc<AtomicU32>,
    url: String,
}

/// `config` with a pool of `pool_size` connections.
pub(crate) fn with_pool(mut config: turnstile::Config, pool_size: usize) -> turnstile::Config {
    if let turnstile::config::StoreConfig::Postgres { pool_size: p, .. } = &mut config.store {
        *p = pool_size;
    }
    config
}

async fn replicas(pool_size: usize) -> Replicas {
    let gate = Arc::new(Semaphore::new(0));
    let runs = Arc::new(AtomicU32::new(0));
    let bots = || {
        BotRegistry::new(
            "lists",
            Lists {
                gate: Arc::clone(&gate),
                runs: Arc::clone(&runs),
            },
        )
    };
    let a = TestApp::postgres()
        .bots(bots())
        .config(move |c| with_pool(c, pool_size))
        .spawn()
        .await;
    let b = a.replica(bots()).await;
    Replicas {
        url: a.database_url().to_owned(),
        a,
        b,
        gate,
        runs,
    }
}

/// Opens a `StreamTurn` of `activity` on `app` and reads it to its first draft.
async fn until_drafted(
    app: &TestApp,
    activity: &pb::Activity,
) -> (tonic::Streaming<pb::StreamTurnResponse>, Vec<Event>) {
    support::streams::open_until(app, activity, |e| matches!(e, Event::Draft(_))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_on_another_replica_joins_the_running_turn_and_the_bot_runs_once() {
    let r = replicas(8).await;
    let activity = message("join", "ada", "wait");
    let (events, seen) = until_drafted(&r.a, &activity).await;

    // The channel sends the activity again, to the other replica, while the first still runs.
    let b = r.b.client.clone();
    let again = activity.clone();
    let redelivered = tokio::spawn(async move {
        let mut b = b;
        b.stream_turn(pb::StreamTurnRequest::typed(again, ""))
            .await
            .unwrap()
            .into_inner()
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(r.runs.load(Ordering::SeqCst), 1, "the redelivery waits");
    r.gate.add_permits(1);

    let (events, ended) = collect(events, seen).await;
    ended.unwrap();
    let first = outcome(&events);
    assert!(!first.redelivered);
    assert_eq!(texts(first), ["wait"]);
    let (joined, ended) = collect(redelivered.await.unwrap(), Vec::new()).await;
    ended.unwrap();
    assert_eq!(joined.len(), 1, "the outcome alone, no drafts: {joined:?}");
    let joined = outcome(&joined);
    assert!(joined.redelivered, "{joined:?}");
    assert_eq!(texts(joined), texts(first));
    assert_eq!(r.runs.load(Ordering::SeqCst), 1, "the bot ran once in all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_turns_hold_no_connection_while_their_bots_run() {
    const TURNS: usize = 12;
    // Two connections for twelve conversations whose bots all run at once.
    let r = replicas(2).await;
    let mut running = Vec::new();
    for i in 0..TURNS {
        let activity = message(&format!("many-{i}"), "ada", "wait");
        running.push(until_drafted(&r.a, &activity).await);
    }
    assert_eq!(r.runs.load(Ordering::SeqCst) as usize, TURNS, "all running");
    let observer = support::pg::session(&r.url).await;
    let open: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE state LIKE 'idle in transaction%' \
                AND datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(open, 0, "no transaction is held while the bots run");
    r.gate.add_permits(TURNS);
    for (events, seen) in running {
        let (events, ended) = collect(events, seen).await;
        ended.unwrap();
        assert_eq!(texts(outcome(&events)), ["wait"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_stalled_past_its_hold_cannot_commit_and_replays_after_the_new_holder() {
    let r = replicas(8).await;
    let stalled = message("fence", "ada", "wait");
    let (events, seen) = until_drafted(&r.a, &stalled).await;
    // Its hold runs out, as a replica stalled past it would let it: another turn takes over and
    // runs its bot.
    let observer = support::pg::session(&r.url).await;
    let expired = observer
        .execute(
            "UPDATE turnstile_state SET state = jsonb_set(state, '{until}', '0') \
              WHERE key LIKE '%/\\%hold'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(expired, 1);
    let (taker, taken) = until_drafted(&r.b, &message("fence", "bob", "wait")).await;

    // The stalled turn goes on first: its commit finds the hold taken, though the state it read
    // has not moved, and it waits to replay after the new holder.
    r.gate.add_permits(1);
    let mut events = events;
    let mut seen = seen;
    let reset = events.message().await.unwrap().unwrap().event.unwrap();
    assert!(matches!(reset, Event::Reset(_)), "{reset:?}");
    seen.push(reset);
    r.gate.add_permits(1);
    let (taker, ended) = collect(taker, taken).await;
    ended.unwrap();
    let taker = outcome(&taker);
    assert_eq!(taker.attempts, 1, "the holder was not beaten: {taker:?}");
    assert_eq!(texts(taker), ["wait"]);

    let (events, ended) = collect(events, seen).await;
    ended.unwrap();
    let kinds = support::streams::kinds(&events);
    assert_eq!(
        kinds,
        ["draft 1 wait", "reset 1", "draft 2 wait, wait", "outcome 2"]
    );
    assert_eq!(outcome(&events).version, 2, "each committed once");
}

/// A held turn's commit that PostgreSQL cancels to break a deadlock wrote nothing, and the hold
/// still keeps every other held turn out: the commit is sent again, and the bot does not run
/// twice (`store::postgres::deadlock`). Here a session of the test's own makes the deadlock: it
/// holds the conversation's row, the turn's commit checks the hold's row and waits for the
/// conversation's, then the session asks for the hold's row too. With a longer
/// `deadlock_timeout` of its own, the session is never the one cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turns_commit_cancelled_by_a_deadlock_is_sent_again_and_the_bot_runs_once() {
    let r = replicas(8).await;
    let (first, seen) = until_drafted(&r.a, &message("victim", "ada", "one")).await;
    collect(first, seen).await.1.unwrap();
    let (events, seen) = until_drafted(&r.a, &message("victim", "ada", "wait")).await;

    let conversation = "lists/test/conversations/victim";
    let other = support::pg::session(&r.url).await;
    other
        .batch_execute(&format!(
            "SET deadlock_timeout = '60s'; BEGIN; \
             SELECT 1 FROM turnstile_state WHERE key = '{conversation}' FOR UPDATE"
        ))
        .await
        .unwrap();
    r.gate.add_permits(1);
    // The turn's commit has checked the hold and waits for the conversation's row.
    let observer = support::pg::session(&r.url).await;
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                    WHERE datname = current_database() AND wait_event_type = 'Lock' \
                      AND query LIKE '%turnstile_commit%'";
    for tried in 0.. {
        let n: i64 = observer.query_one(waiting, &[]).await.unwrap().get(0);
        if n == 1 {
            break;
        }
        assert!(tried < 200, "the turn's commit never waited for the row");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The deadlock: PostgreSQL cancels the commit, which waited first, and the session gets
    // the hold's row.
    other
        .batch_execute(&format!(
            "SELECT 1 FROM turnstile_state WHERE key = '{conversation}/%hold' FOR UPDATE"
        ))
        .await
        .unwrap();
    other.batch_execute("ROLLBACK").await.unwrap();

    let (events, ended) = collect(events, seen).await;
    ended.unwrap();
    assert_eq!(
        support::streams::kinds(&events),
        ["draft 1 one, wait", "outcome 1"],
        "committed by its first run"
    );
    assert_eq!(texts(outcome(&events)), ["one, wait"]);
    assert_eq!(r.runs.load(Ordering::SeqCst), 2, "the bot ran once a turn");
}

/// A serialized bot's turns hold their conversations by the fenced hold too: far more
/// conversations than the pool has connections run their slow bots at once, none waits for a
/// connection, and no transaction stays open while the bots run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serialized_slow_turns_on_many_conversations_all_run_at_once_on_a_small_pool() {
    const CONVERSATIONS: usize = 48;
    const BOT_DELAY: Duration = Duration::from_millis(1500);
    let bots = BotRegistry::new("slow", turnstile::bots::SlowBot::new(BOT_DELAY))
        .with_policy("slow", turnstile::ConcurrencyPolicy::Serialized)
        .unwrap();
    let app = TestApp::postgres()
        .bots(bots)
        .config(|c| with_pool(c, 4))
        .spawn()
        .await;
    let started = std::time::Instant::now();
    let turns: Vec<_> = (0..CONVERSATIONS)
        .map(|i| {
            let mut client = app.client.clone();
            tokio::spawn(async move {
                let mut call = tonic::Request::new(pb::ProcessTurnRequest::typed(
                    message(&format!("serial-{i}"), "ada", "hi"),
                    "",
                ));
                call.set_timeout(Duration::from_secs(30));
                client.process_turn(call).await
            })
        })
        .collect();
    // Midway through the bots' runs: nobody holds a transaction open.
    tokio::time::sleep(BOT_DELAY / 2).await;
    let observer = support::pg::session(app.database_url()).await;
    let open: i64 = observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
              WHERE xact_start < clock_timestamp() - interval '200 milliseconds' \
                AND datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(open, 0, "a transaction stayed open while the bots ran");
    for turn in turns {
        let reply = turn.await.unwrap().unwrap().into_inner();
        assert_eq!(texts(&reply), ["count: 1"]);
    }
    let elapsed = started.elapsed();
    // One after the other, four at a time, would take twelve bot runs.
    assert!(
        elapsed < BOT_DELAY * 4,
        "{CONVERSATIONS} turns took {elapsed:?}: they did not all run at once"
    );
}

/// Appends each message's text to the conversation's list, drafting it first; a message `wait`
/// holds every attempt on `gate` after drafting.
struct Patient {
    gate: Arc<Semaphore>,
}

#[async_trait]
impl Bot for Patient {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let mut items: Vec<String> = turn.conversation_property("items")?;
        items.push(turn.text().to_owned());
        turn.draft(items.join(", "))?;
        if turn.text() == "wait" {
            self.gate.acquire().await?.forget();
        }
        turn.conversation_state().set("items", &items)?;
        turn.send_text(items.join(", "));
        Ok(())
    }
}

/// A plain turn of another replica holds nothing, so the hold cannot keep it out: a held
/// (streamed) turn it beat replays under the conversation lock, whose row lock makes the next
/// plain commit wait, and so commits on that replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_turn_beaten_by_a_plain_turn_replays_under_the_lock_and_wins() {
    let gate = Arc::new(Semaphore::new(0));
    let bots = || {
        BotRegistry::new(
            "patient",
            Patient {
                gate: Arc::clone(&gate),
            },
        )
    };
    let a = TestApp::postgres().bots(bots()).spawn().await;
    let mut b = a.replica(bots()).await;
    let plain = |text: &str| pb::ProcessTurnRequest::typed(message("beaten", "bob", text), "");

    let (mut events, mut seen) = until_drafted(&a, &message("beaten", "ada", "wait")).await;
    let first = b.client.process_turn(plain("one")).await.unwrap();
    assert_eq!(texts(first.get_ref()), ["one"]);
    gate.add_permits(1);
    // The held turn's commit meets the plain one's: a reset, and the replay drafts again.
    for _ in 0..2 {
        seen.push(events.message().await.unwrap().unwrap().event.unwrap());
    }
    assert!(matches!(seen[1], Event::Reset(_)), "{seen:?}");
    // While the replay runs, another plain turn: its commit must wait for the replay's.
    let mut late = b.client.clone();
    let second = tokio::spawn(async move {
        late.process_turn(pb::ProcessTurnRequest::typed(
            message("beaten", "bob", "two"),
            "",
        ))
        .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    gate.add_permits(1);
    let (events, ended) = collect(events, seen).await;
    ended.unwrap();
    let held = outcome(&events);
    assert_eq!(held.attempts, 2, "the replay won: {events:?}");
    assert_eq!(texts(held), ["one, wait"]);
    let second = second.await.unwrap().unwrap().into_inner();
    assert_eq!(texts(&second), ["one, wait, two"]);
    assert_eq!(
        second.attempts, 2,
        "it waited, then replayed on the held turn's state"
    );
}

/// A hold lasts `HOLD_FOR` unless renewed: a turn whose bot runs longer keeps its conversation
/// by renewing it, so another replica's held turn waits for it rather than taking over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_longer_than_its_hold_keeps_the_conversation_by_renewing_it() {
    let r = replicas(8).await;
    let (events, seen) = until_drafted(&r.a, &message("renewed", "ada", "wait")).await;
    // A streamed turn on the other replica, with time to wait for the hold.
    let mut b = r.b.client.clone();
    let waiting = async {
        let mut call = tonic::Request::new(pb::StreamTurnRequest::typed(
            message("renewed", "bob", "cheese"),
            "",
        ));
        call.set_timeout(Duration::from_secs(30));
        collect(b.stream_turn(call).await.unwrap().into_inner(), Vec::new()).await
    };
    tokio::pin!(waiting);
    let past_the_hold = turnstile::store::postgres::hold::HOLD_FOR + Duration::from_secs(1);
    tokio::select! {
        ended = &mut waiting => panic!("the hold ran out under a running turn: {ended:?}"),
        () = tokio::time::sleep(past_the_hold) => {}
    }
    r.gate.add_permits(1);
    let (events, ended) = collect(events, seen).await;
    ended.unwrap();
    assert_eq!(outcome(&events).attempts, 1, "{events:?}");
    let (after, ended) = waiting.await;
    ended.unwrap();
    assert_eq!(texts(outcome(&after)), ["wait, cheese"]);
}
