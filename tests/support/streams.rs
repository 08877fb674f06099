//! `StreamTurn` calls as the tests read them: every event of a call, and how it ended.

use tonic::Status;
use tonic::codec::Streaming;
use turnstile::grpc::pb;
use turnstile::grpc::pb::stream_turn_response::Event;

use super::TestServer;

/// Every event of a `StreamTurn` call of `activity` to `bot` on `server`, and how it ended.
pub async fn stream(
    server: &TestServer,
    activity: pb::Activity,
    bot: &str,
) -> (Vec<Event>, Result<(), Status>) {
    let mut client = server.client().await;
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
