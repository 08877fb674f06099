//! `StreamTurn`: a bot's drafts reach the caller while it runs, and the committed outcome comes
//! last, exactly once — through a conflict between replicas (the drafts are reset and the replay
//! drafts anew), a redelivery (the outcome alone, the bot not run), a bot that fails after
//! drafting, and a draft over the size cap (nothing committed). On real PostgreSQL.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use support::bots::Gated;
use support::streams::{collect, drafts, outcome, stream};
use support::{TestApp, message, texts};
use tokio::sync::Semaphore;
use tonic::Code;
use tonic_types::StatusExt as _;
use turnstile::bot::{Bot, BotError, BotRegistry, TurnContext};
use turnstile::bots::LlmBot;
use turnstile::grpc::pb;
use turnstile::grpc::pb::stream_turn_response::Event;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_come_before_the_committed_outcome_and_a_redelivery_gets_the_outcome_alone() {
    let bots = BotRegistry::new("llm", LlmBot::new(Duration::from_millis(1)));
    let mut app = TestApp::postgres().bots(bots).spawn().await;
    let activity = message("stream-1", "ada", "hello");

    let (events, ended) = stream(&app, activity.clone(), "").await;
    ended.unwrap();
    let shown = drafts(&events);
    assert!(shown.len() > 10, "a draft per word: {events:?}");
    assert_eq!(shown[0].kind(), pb::DraftKind::Informative);
    assert_eq!(shown[0].text, "Thinking…");
    for (i, draft) in shown.iter().enumerate() {
        assert_eq!(draft.sequence, u32::try_from(i + 1).unwrap(), "{shown:?}");
        assert_eq!(draft.attempt, 1);
        assert_eq!(draft.stream_id, shown[0].stream_id);
    }
    let text: Vec<&str> = shown[1..].iter().map(|d| d.text.as_str()).collect();
    for pair in text.windows(2) {
        assert!(
            pair[1].starts_with(pair[0]),
            "the text so far grows: {pair:?}"
        );
    }
    let committed = outcome(&events);
    assert_eq!(committed.attempts, 1);
    assert!(!committed.redelivered);
    assert_eq!(committed.version, 1, "committed once");
    assert_eq!(
        texts(committed),
        [*text.last().unwrap()],
        "the last draft is the committed reply"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, Event::Outcome(_)))
            .count(),
        1
    );

    // The same activity again: its receipt answers, the bot does not run, nothing is drafted.
    let (again, ended) = stream(&app, activity, "").await;
    ended.unwrap();
    assert_eq!(again.len(), 1, "the outcome alone: {again:?}");
    let redelivered = outcome(&again);
    assert!(redelivered.redelivered);
    assert_eq!(texts(redelivered), texts(committed));
    assert_eq!(redelivered.version, 1);

    // ProcessTurn of the same bot is unchanged: the drafts go nowhere.
    let reply = app
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("stream-1", "ada", "more"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.version, 2);
    assert!(texts(&reply)[0].contains("answer number 2"), "{reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_mid_stream_resets_the_drafts_and_the_replay_commits_once() {
    let gate = Arc::new(Semaphore::new(0));
    let bots = || {
        BotRegistry::new(
            "gated",
            Gated {
                gate: Arc::clone(&gate),
            },
        )
    };
    let mut a = TestApp::postgres().bots(bots()).spawn().await;
    let (mut b, mut c) = (a.replica(bots()).await, a.replica(bots()).await);
    // The conversation exists: both replicas' turns will update the same row.
    c.client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("race", "ada", "first"),
            "",
        ))
        .await
        .unwrap();

    let mut events = a
        .client
        .stream_turn(pb::StreamTurnRequest::typed(
            message("race", "ada", "wait"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    // The first draft means the first attempt has read the state and is running.
    let first = events.message().await.unwrap().unwrap().event.unwrap();
    assert!(
        matches!(&first, Event::Draft(d) if d.attempt == 1 && d.text == "writing first, wait"),
        "{first:?}"
    );
    // Meanwhile another replica commits a turn of the same conversation.
    let other = b
        .client
        .process_turn(pb::ProcessTurnRequest::typed(
            message("race", "bob", "other"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&other), ["first, other"]);
    gate.add_permits(1);

    let mut rest = vec![first];
    while let Some(response) = events.message().await.unwrap() {
        rest.push(response.event.unwrap());
    }
    let kinds = support::streams::kinds(&rest);
    assert_eq!(
        kinds,
        [
            "draft 1 writing first, wait",
            "reset 1",
            "draft 2 writing first, other, wait",
            "outcome 2",
        ],
        "the void draft, its reset, the replay's draft on fresh state, then the outcome"
    );
    let committed = outcome(&rest);
    assert_eq!(texts(committed), ["first, other, wait"]);
    assert_eq!(committed.version, 3, "three turns, each committed once");
    match &rest[1] {
        Event::Reset(reset) => assert_eq!(reset.stream_id, drafts(&rest)[0].stream_id),
        other => panic!("{other:?}"),
    }
}

/// Drafts, then fails: its drafts are void, and nothing of the turn commits.
struct DraftsThenFails;

#[async_trait]
impl Bot for DraftsThenFails {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        let count: u64 = turn.conversation_property("count")?;
        turn.conversation_state().set("count", &(count + 1))?;
        turn.draft("half an answer")?;
        if turn.text() == "fail" {
            return Err(BotError::msg("the model went away"));
        }
        turn.send_text(format!("count: {}", count + 1));
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bot_that_drafts_then_fails_or_drafts_too_much_ends_the_stream_with_a_status_and_commits_nothing()
 {
    let bots = BotRegistry::new("fails", DraftsThenFails)
        .with("llm", LlmBot::new(Duration::from_millis(1)));
    let app = TestApp::postgres()
        .bots(bots)
        .config(|mut c| {
            c.limits.max_text_bytes = 64;
            c
        })
        .spawn()
        .await;

    let (events, ended) = stream(&app, message("f", "ada", "fail"), "").await;
    let status = ended.expect_err("the bot failed");
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "BOT_FAILED"
    );
    assert!(
        !status.message().contains("half an answer"),
        "no draft text in the status: {status:?}"
    );
    assert_eq!(drafts(&events).len(), 1, "{events:?}");
    assert!(!events.iter().any(|e| matches!(e, Event::Outcome(_))));

    // The llm bot's answer outgrows 64 bytes: its draft is refused, failing the turn.
    let (events, ended) = stream(&app, message("f", "ada", "hello"), "llm").await;
    assert_eq!(ended.expect_err("too large").code(), Code::Internal);
    assert!(!events.iter().any(|e| matches!(e, Event::Outcome(_))));

    // Nothing was committed by either: the next turn counts from zero.
    let (events, ended) = stream(&app, message("f", "ada", "ok"), "").await;
    ended.unwrap();
    let committed = outcome(&events);
    assert_eq!(texts(committed), ["count: 1"]);
    assert_eq!(committed.version, 1);
}

/// A stream's deadline ends the call, as a unary call's would (a client library bounds a stream
/// only until its headers); the turn goes on and commits, and a redelivery gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_deadline_ends_the_call_and_the_turn_still_commits_once() {
    // About 35 words at 20 ms: some 700 ms, well past the call's 200 ms.
    let bots = BotRegistry::new("llm", LlmBot::new(Duration::from_millis(20)));
    let mut app = TestApp::postgres().bots(bots).spawn().await;
    let activity = message("deadline", "ada", "hello");
    // The server is up first (on a fresh database its start migrates it, which can take longer
    // than the deadline below): a stream's first event means it serves.
    let mut warm = app
        .client
        .stream_turn(pb::StreamTurnRequest::typed(
            message("warm", "ada", "hi"),
            "",
        ))
        .await
        .unwrap()
        .into_inner();
    warm.message().await.unwrap().expect("a first event");
    let mut request = tonic::Request::new(pb::StreamTurnRequest::typed(activity.clone(), ""));
    request.set_timeout(Duration::from_millis(200));
    let events = app.client.stream_turn(request).await.unwrap().into_inner();
    let (shown, ended) = collect(events, Vec::new()).await;
    let status = ended.expect_err("the deadline ends the stream");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "DEADLINE_EXCEEDED"
    );
    assert!(!drafts(&shown).is_empty(), "drafts before the deadline");
    assert!(!shown.iter().any(|e| matches!(e, Event::Outcome(_))));

    // The same activity again: it queues behind the running turn, then its receipt answers.
    let (again, ended) = stream(&app, activity, "").await;
    ended.unwrap();
    assert_eq!(again.len(), 1, "the outcome alone: {again:?}");
    let committed = outcome(&again);
    assert!(committed.redelivered);
    assert_eq!(committed.version, 1, "committed once");
    assert!(
        texts(committed)[0].contains("answer number 1"),
        "{committed:?}"
    );
}
