//! `StopTurn`: the user stops a streamed reply while it is being written. The bot's run is
//! cancelled, and what was shown — never more than the bot drafted, nor than the user saw — is
//! committed once, on the state as it was, and answers a redelivery; a turn nobody runs here is
//! not stopped, and bad requests name their field. On real PostgreSQL.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use async_trait::async_trait;
use support::streams::{collect, outcome};
use support::{TestApp, message, texts};
use tokio::sync::Semaphore;
use tonic::Code;
use turnstile::bot::{Bot, BotError, BotRegistry, TurnContext};
use turnstile::grpc::pb;
use turnstile::grpc::pb::stream_turn_response::Event;

/// Counts the conversation's turns in its state, drafts "one" and "one two", then waits on
/// `gate` before it would send "one two three"; `finished` and `cancelled` tell how each run
/// ended.
struct Writes {
    gate: Arc<Semaphore>,
    finished: Arc<AtomicU32>,
    cancelled: Arc<AtomicU32>,
}

/// Counts a run dropped before it finished.
struct Unfinished(Arc<AtomicU32>, bool);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl Bot for Writes {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let mut running = Unfinished(Arc::clone(&self.cancelled), false);
        let count: u64 = turn.conversation_property("count")?;
        turn.conversation_state().set("count", &(count + 1))?;
        turn.inform("Thinking…")?;
        turn.draft("one")?;
        turn.draft("one two")?;
        if turn.text() != "quick" {
            self.gate.acquire().await?.forget();
        }
        turn.send_text(format!("one two three (turn {})", count + 1));
        running.1 = true;
        self.finished.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn stop(activity: &pb::Activity, shown: Option<&str>) -> pb::StopTurnRequest {
    pb::StopTurnRequest {
        bot: String::new(),
        channel_id: activity.channel_id.clone().unwrap(),
        conversation_id: activity.conversation.as_ref().unwrap().id.clone().unwrap(),
        activity_id: activity.id.clone().unwrap(),
        shown_text: shown.map(str::to_owned),
    }
}

/// Opens a `StreamTurn` of `activity` and reads it up to the draft "one two".
async fn until_second_draft(
    app: &TestApp,
    activity: &pb::Activity,
) -> (tonic::Streaming<pb::StreamTurnResponse>, Vec<Event>) {
    support::streams::open_until(
        app,
        activity,
        |e| matches!(e, Event::Draft(d) if d.text == "one two"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_turn_commits_what_was_shown_once_on_unchanged_state_and_its_bot_is_cancelled() {
    let gate = Arc::new(Semaphore::new(0));
    let finished = Arc::new(AtomicU32::new(0));
    let cancelled = Arc::new(AtomicU32::new(0));
    let bots = BotRegistry::new(
        "writes",
        Writes {
            gate: Arc::clone(&gate),
            finished: Arc::clone(&finished),
            cancelled: Arc::clone(&cancelled),
        },
    );
    let mut app = TestApp::postgres().bots(bots).spawn().await;

    // The channel showed "one tw" when the user pressed Stop.
    let first = message("stop-1", "ada", "write");
    let (events, seen) = until_second_draft(&app, &first).await;
    let stopped = app
        .client
        .stop_turn(stop(&first, Some("one tw")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stopped.result(), pb::StopTurnResult::Stopped);
    let (events, ended) = collect(events, seen).await;
    ended.unwrap();
    let committed = outcome(&events);
    assert!(committed.stopped && !committed.redelivered, "{committed:?}");
    assert_eq!(texts(committed), ["one tw"], "what the user saw, no more");
    assert_eq!(
        committed.version, 0,
        "the state is as it was: never written"
    );
    assert_eq!(
        cancelled.load(Ordering::SeqCst),
        1,
        "the bot's run was dropped"
    );
    // Releasing the gate now finds no run waiting at it.
    gate.add_permits(1);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(finished.load(Ordering::SeqCst), 0);
    gate.forget_permits(1);

    // A redelivery is answered from the receipt: the same stopped reply, the bot not run.
    let again = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(first.clone(), ""))
        .await
        .unwrap()
        .into_inner();
    assert!(again.redelivered && again.stopped, "{again:?}");
    assert_eq!(texts(&again), ["one tw"]);
    // The turn is over: nothing runs to stop.
    let late = app.client.stop_turn(stop(&first, None)).await.unwrap();
    assert_eq!(late.into_inner().result(), pb::StopTurnResult::NotRunning);

    // Shown text that the bot never drafted is cut to what it did: "one two", not "one twelve";
    // stopping twice keeps the first stop.
    let second = message("stop-1", "ada", "write");
    let (events, seen) = until_second_draft(&app, &second).await;
    let result = app
        .client
        .stop_turn(stop(&second, Some("one twelve")))
        .await;
    assert_eq!(
        result.unwrap().into_inner().result(),
        pb::StopTurnResult::Stopped
    );
    // A second stop finds the turn stopping (or, on a busy machine, over already): either way
    // the first stop's text is what commits.
    let again = app.client.stop_turn(stop(&second, Some("o"))).await;
    assert!(
        matches!(
            again.unwrap().into_inner().result(),
            pb::StopTurnResult::Stopped | pb::StopTurnResult::NotRunning
        ),
        "a second stop"
    );
    let (events, ended) = collect(events, seen).await;
    ended.unwrap();
    assert_eq!(texts(outcome(&events)), ["one tw"], "{events:?}");

    // Without shown text: the latest text draft.
    let third = message("stop-1", "ada", "write");
    let (events, seen) = until_second_draft(&app, &third).await;
    app.client.stop_turn(stop(&third, None)).await.unwrap();
    let (events, _) = collect(events, seen).await;
    assert_eq!(texts(outcome(&events)), ["one two"]);
    assert_eq!(cancelled.load(Ordering::SeqCst), 3);

    // None of the stopped turns counted: the next one is the conversation's first.
    let quick = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("stop-1", "ada", "quick"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&quick), ["one two three (turn 1)"]);
    assert!(!quick.stopped);
    assert_eq!(quick.version, 1);
    assert_eq!(finished.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_names_what_is_wrong_with_it_and_stops_only_streamed_turns_running_here() {
    let gate = Arc::new(Semaphore::new(0));
    let bots = || {
        BotRegistry::new(
            "writes",
            Writes {
                gate: Arc::clone(&gate),
                finished: Arc::default(),
                cancelled: Arc::default(),
            },
        )
    };
    let mut a = TestApp::postgres()
        .bots(bots())
        .config(|mut c| {
            c.limits.max_text_bytes = 16;
            c
        })
        .spawn()
        .await;
    let mut b = a.replica(bots()).await;
    let activity = message("stop-2", "ada", "write");

    let mut missing = stop(&activity, None);
    missing.activity_id.clear();
    let mut too_long = stop(&activity, Some(&"x".repeat(17)));
    let mut unknown = stop(&activity, None);
    unknown.bot = "nobody".into();
    for (request, code, field) in [
        (missing, Code::InvalidArgument, "activity_id"),
        (too_long.clone(), Code::InvalidArgument, "shown_text"),
        (unknown, Code::NotFound, "nobody"),
    ] {
        let status = a.client.stop_turn(request).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(field), "{status:?}");
    }

    // A turn run with ProcessTurn shows nothing and cannot be stopped; nor can one running on
    // another replica, which this one does not know of.
    let mut unary = a.client.clone();
    let plain = activity.clone();
    let running = tokio::spawn(async move {
        unary
            .process_turn(pb::ProcessTurnRequest::typed(plain, ""))
            .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let result = a.client.stop_turn(stop(&activity, None)).await.unwrap();
    assert_eq!(result.into_inner().result(), pb::StopTurnResult::NotRunning);
    gate.add_permits(1);
    let done = running.await.unwrap().unwrap().into_inner();
    assert!(!done.stopped);

    let streamed = message("stop-2", "ada", "write");
    let (events, seen) = until_second_draft(&a, &streamed).await;
    let elsewhere = b.client.stop_turn(stop(&streamed, None)).await.unwrap();
    assert_eq!(
        elsewhere.into_inner().result(),
        pb::StopTurnResult::NotRunning
    );
    too_long.activity_id = streamed.id.clone().unwrap();
    too_long.shown_text = Some("one".into());
    let here = a.client.stop_turn(too_long).await.unwrap();
    assert_eq!(here.into_inner().result(), pb::StopTurnResult::Stopped);
    let (events, _) = collect(events, seen).await;
    assert_eq!(texts(outcome(&events)), ["one"]);
}
