//! Bot Framework's conformance transcripts, replayed through the gRPC API against the bots the
//! binary hosts, on the memory store and on PostgreSQL: every activity the user sent goes to the
//! transcript's bot, and the replies must be exactly the bot activities that follow it, compared
//! on `type` and trimmed `text`. A missing or an extra reply fails.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::path::{Path, PathBuf};

use support::{TestApp, spawn_app};
use tonic::transport::Channel;
use turnstile::activity::Activity;
use turnstile::grpc::pb;
use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

/// One transcript: its file stem, the bot that answers it, and its activities.
struct Transcript {
    name: String,
    bot: &'static str,
    activities: Vec<Activity>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transcripts")
}

/// Every `*.transcript`, each mapped to its bot; a transcript without a bot is a failure.
fn transcripts() -> Vec<Transcript> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .expect("the transcripts directory")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "transcript"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            let bot = turnstile::bots::CONFORMANCE
                .iter()
                .find(|(_, stem)| *stem == name)
                .map(|(bot, _)| *bot)
                .unwrap_or_else(|| panic!("no bot answers the transcript {name}"));
            let json: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            let activities = json
                .as_array()
                .unwrap_or_else(|| panic!("{name} is not an array of activities"))
                .iter()
                .map(|a| Activity::from_json(a.clone()).unwrap())
                .collect();
            Transcript {
                name,
                bot,
                activities,
            }
        })
        .collect()
}

fn is_from_bot(activity: &Activity) -> bool {
    activity.from.as_ref().and_then(|f| f.role.as_deref()) == Some("bot")
}

/// `type: trimmed text`, the form replies are compared in.
fn shown(activity: &Activity) -> String {
    format!(
        "{}: {}",
        activity.activity_type.as_deref().unwrap_or("?"),
        activity.text.as_deref().unwrap_or_default().trim()
    )
}

fn shown_pb(activity: &pb::Activity) -> String {
    format!(
        "{}: {}",
        activity.r#type.as_deref().unwrap_or("?"),
        activity.text.as_deref().unwrap_or_default().trim()
    )
}

/// Replays `transcript` in a conversation of its own (its ids suffixed with `run`); the first
/// mismatch, described, or `Ok`.
async fn replay(
    client: &mut TurnServiceClient<Channel>,
    transcript: &Transcript,
    run: &str,
) -> Result<(), String> {
    let activities = &transcript.activities;
    let mut i = 0;
    while i < activities.len() {
        let mut sent = activities[i].clone();
        if is_from_bot(&sent) {
            return Err(format!(
                "activity {i} is a bot reply with no user activity before it"
            ));
        }
        if let Some(conversation) = sent.conversation.as_mut() {
            conversation.id = conversation.id.as_ref().map(|id| format!("{id}-{run}"));
        }
        if let Some(from) = sent.from.as_mut() {
            from.id = from.id.as_ref().map(|id| format!("{id}-{run}"));
        }
        let expected: Vec<String> = activities[i + 1..]
            .iter()
            .take_while(|a| is_from_bot(a))
            .map(shown)
            .collect();
        let response = client
            .process_turn(pb::ProcessTurnRequest::typed(
                sent.clone().into(),
                transcript.bot,
            ))
            .await
            .map_err(|s| format!("activity {i} ({}) failed: {s:?}", shown(&sent)))?
            .into_inner();
        let got: Vec<String> = response.activities.iter().map(shown_pb).collect();
        if got != expected {
            return Err(format!(
                "after activity {i} ({}):\n    expected {expected:#?}\n    got      {got:#?}",
                shown(&sent)
            ));
        }
        i += 1 + expected.len();
    }
    Ok(())
}

/// Replays every transcript against `app`, all of them even when one fails, and fails naming
/// each that did.
async fn replay_all(mut app: TestApp, store: &str) {
    let transcripts = transcripts();
    assert_eq!(
        transcripts.len(),
        turnstile::bots::CONFORMANCE.len(),
        "one transcript per conformance bot"
    );
    let mut failures = Vec::new();
    for transcript in &transcripts {
        match replay(&mut app.client, transcript, store).await {
            Ok(()) => eprintln!("{store}: {} ({}) ok", transcript.name, transcript.bot),
            Err(e) => failures.push(format!(
                "{} (bot `{}`) on {store}: {e}",
                transcript.name, transcript.bot
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test]
async fn every_transcript_replays_on_the_memory_store() {
    replay_all(TestApp::memory().spawn().await, "memory").await;
}

#[tokio::test]
async fn every_transcript_replays_on_postgres() {
    replay_all(spawn_app().await, "postgres").await;
}

#[tokio::test]
async fn a_transcript_replayed_twice_in_one_conversation_starts_over() {
    // The dialogs leave no stack behind when they end, so the same conversation can run the
    // whole transcript again, as Bot Framework's bots can.
    let mut app = TestApp::memory().spawn().await;
    for transcript in transcripts()
        .iter()
        .filter(|t| t.name.ends_with("Prompt") && t.name != "WaterfallPrompt")
    {
        for _ in 0..2 {
            replay(&mut app.client, transcript, "twice")
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", transcript.name));
        }
    }
}

#[tokio::test]
async fn the_replayer_notices_an_extra_or_a_missing_reply() {
    let mut app = TestApp::memory().spawn().await;
    let waterfall = transcripts()
        .into_iter()
        .find(|t| t.name == "Waterfall")
        .unwrap();

    let extra = Transcript {
        name: waterfall.name.clone(),
        bot: "waterfall-nested",
        activities: waterfall.activities.clone(),
    };
    let err = replay(&mut app.client, &extra, "extra")
        .await
        .expect_err("waterfall-nested says step1.1 too");
    assert!(err.contains("step1.1"), "{err}");

    let mut missing = waterfall;
    let mut unanswered = missing.activities.last().unwrap().clone();
    unanswered.text = Some("step4".into());
    missing.activities.push(unanswered);
    let err = replay(&mut app.client, &missing, "missing")
        .await
        .expect_err("there is no step4");
    assert!(err.contains("step4"), "{err}");
}
