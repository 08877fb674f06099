//! The conversation as call metadata, for meshes that route by header.
//!
//! Turns of one conversation that reach one replica queue there and never conflict; turns spread
//! over replicas meet in the database. A caller that sends [`CONVERSATION_METADATA`] lets a mesh
//! or L7 proxy hash each conversation onto one replica (Istio's `consistentHash.httpHeaderName`,
//! Envoy's ring hash on a header), so that conflicts become rare; the conversation lock makes
//! the ones left cheap. The server reads nothing from it: the activity says which conversation a
//! turn belongs to, and a caller that sends a wrong value or none loses only the affinity.

use tonic::metadata::{Ascii, MetadataValue};

/// The metadata key (an HTTP/2 header) carrying the conversation, for routing only.
pub const CONVERSATION_METADATA: &str = "x-turnstile-conversation";

/// The value of [`CONVERSATION_METADATA`] for a conversation of a channel: `channel/conversation`,
/// each byte outside visible ASCII (and `%`) percent-encoded, so that any id makes a valid
/// header. Only its equality matters to a mesh. `None` only if the encoding failed to make
/// header text, which it cannot.
pub fn conversation_value(channel: &str, conversation: &str) -> Option<MetadataValue<Ascii>> {
    let mut text = String::with_capacity(channel.len() + conversation.len() + 1);
    encode_into(channel, &mut text);
    text.push('/');
    encode_into(conversation, &mut text);
    text.parse().ok()
}

fn encode_into(part: &str, out: &mut String) {
    for byte in part.bytes() {
        if byte.is_ascii_graphic() && byte != b'%' && byte != b'/' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn any_conversation_id_makes_a_header_and_distinct_ones_stay_distinct() {
        let teams = conversation_value("msteams", "19:abc@thread.tacv2;messageid=1").unwrap();
        assert_eq!(
            teams.to_str().unwrap(),
            "msteams/19:abc@thread.tacv2;messageid=1"
        );
        let odd = conversation_value("test", "caf\u{e9} 1/2%").unwrap();
        assert_eq!(odd.to_str().unwrap(), "test/caf%C3%A9%201%2F2%25");
        assert_ne!(
            conversation_value("a/b", "c"),
            conversation_value("a", "b/c"),
            "the separator cannot be forged"
        );
    }
}
