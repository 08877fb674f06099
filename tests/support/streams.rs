//! `StreamTurn` calls as the tests read them: every event of a call, and how it ended.

use tonic::Status;
use tonic::codec::Streaming;
use turnstile::grpc::pb;
use turnstile::grpc::pb::stream_turn_response::Event;

use super::TestApp;

/// Every event of a `StreamTurn` call of `activity` to `bot` on `app`, and how it ended.
pub async fn stream(
    app: &TestApp,
    activity: pb::Activity,
    bot: &str,
) -> (Vec<Event>, Result<(), Status>) {
    let mut client = app.client.clone();
    match client
        .stream_turn(pb::StreamTurnRequest::typed(activity, bot))
        .await
    {
        Ok(response) => collect(response.into_inner(), Vec::new()).await,
        Err(status) => (Vec::new(), Err(status)),
    }
}

/// The rest of an open call's events after `seen`, and how it ended.
pub async fn collect(
    mut stream: Streaming<pb::StreamTurnResponse>,
    mut seen: Vec<Event>,
) -> (Vec<Event>, Result<(), Status>) {
    loop {
        match stream.message().await {
            Ok(Some(response)) => seen.push(response.event.expect("an event")),
            Ok(None) => return (seen, Ok(())),
            Err(status) => return (seen, Err(status)),
        }
    }
}

/// The drafts among `events`, in order.
pub fn drafts(events: &[Event]) -> Vec<&pb::Draft> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Draft(d) => Some(d),
            _ => None,
        })
        .collect()
}

/// The outcome that ends `events`; panics when they do not end with one.
pub fn outcome(events: &[Event]) -> &pb::ProcessTurnResponse {
    match events.last() {
        Some(Event::Outcome(outcome)) => outcome,
        other => panic!("the last event is not the outcome: {other:?}"),
    }
}

/// Each event of a call in a word or three, for comparing a whole call at once: `draft 1 text`,
/// `reset 1`, `outcome 2` (its attempts).
pub fn kinds(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e {
            Event::Draft(d) => format!("draft {} {}", d.attempt, d.text),
            Event::Reset(r) => format!("reset {}", r.attempt),
            Event::Outcome(o) => format!("outcome {}", o.attempts),
        })
        .collect()
}

/// Opens a `StreamTurn` of `activity` to the default bot of `app` and reads it up to and with
/// the first event `until` accepts: the open call and the events read.
pub async fn open_until(
    app: &TestApp,
    activity: &pb::Activity,
    until: impl Fn(&Event) -> bool,
) -> (Streaming<pb::StreamTurnResponse>, Vec<Event>) {
    let mut client = app.client.clone();
    let mut events = client
        .stream_turn(pb::StreamTurnRequest::typed(activity.clone(), ""))
        .await
        .expect("the call opens")
        .into_inner();
    let mut seen = Vec::new();
    loop {
        let event = events
            .message()
            .await
            .expect("no error")
            .expect("more events")
            .event
            .expect("an event");
        let last = until(&event);
        seen.push(event);
        if last {
            return (events, seen);
        }
    }
}
