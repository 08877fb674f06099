//! Property-based fuzzing of the request path short of the network: whatever bytes arrive, decoding,
//! the limits, conversion, validation and key building either refuse them with a named field or
//! produce well-formed, escaped state keys — and never panic. Bounded (a few thousand cases) so it
//! runs in CI on every change.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use prost::Message as _;
use turnstile::activity::Activity;
use turnstile::activity::incoming::IncomingActivity;
use turnstile::grpc::limits::Limits;
use turnstile::grpc::pb;
use turnstile::grpc::pb::process_turn_request::Input;
use turnstile::grpc::request::read_activity;
use turnstile::state::TurnKeys;

/// Everything the service does with a request before the bot runs.
fn process(bytes: &[u8]) {
    let Ok(request) = pb::ProcessTurnRequest::decode(bytes) else {
        return;
    };
    let typed = matches!(request.input, Some(Input::Activity(_)));
    let Ok(domain) = read_activity(request.input, &Limits::default()) else {
        return;
    };
    if typed {
        // Converting back and forth is stable.
        assert_eq!(Activity::from(pb::Activity::from(domain.clone())), domain);
    }
    let Ok(incoming) = IncomingActivity::parse(domain) else {
        return;
    };
    let keys = TurnKeys::new(&request.bot, incoming.address());
    for (_, key) in keys.all() {
        let parts = key.parts();
        assert_eq!(
            parts[0], request.bot,
            "the bot namespace comes first: {key}"
        );
        assert!(
            parts.iter().skip(1).all(|p| !p.is_empty()),
            "no empty part: {key}"
        );
    }
    assert_eq!(
        keys.conversation.parts()[3],
        incoming.address().conversation.as_str(),
        "the conversation id survives escaping"
    );
}

/// A plausible request, to be damaged.
fn seed() -> Vec<u8> {
    pb::ProcessTurnRequest::typed(
        pb::Activity {
            r#type: Some("message".into()),
            id: Some("1".into()),
            channel_id: Some("msteams".into()),
            conversation: Some(pb::ConversationAccount {
                id: Some("19:a/b%c@thread.skype".into()),
                ..Default::default()
            }),
            from: Some(pb::ChannelAccount {
                id: Some("29:user/x".into()),
                ..Default::default()
            }),
            text: Some("add ham".into()),
            ..Default::default()
        },
        "pizza",
    )
    .encode_to_vec()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        process(&bytes);
    }

    #[test]
    fn damaged_requests_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = seed();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        let end = cut.index(bytes.len() + 1);
        process(&bytes[..end]);
    }
}

#[test]
fn the_seed_itself_goes_all_the_way() {
    let request = pb::ProcessTurnRequest::decode(seed().as_slice()).unwrap();
    let activity = read_activity(request.input, &Limits::default()).unwrap();
    let incoming = IncomingActivity::parse(activity).unwrap();
    let keys = TurnKeys::new("pizza", incoming.address());
    assert_eq!(
        keys.conversation.as_str(),
        "pizza/msteams/conversations/19:a%2Fb%25c@thread.skype"
    );
}
