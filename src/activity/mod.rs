//! The Bot Framework Activity as a plain Rust value, independent of the wire.
//!
//! Bots, dialogs and the turn engine work on these types and never on the generated protobuf
//! code or raw JSON, so that neither tonic nor `serde_json` shapes leak into the bot-facing API.
//! The types mirror `proto/turnstile/v1/turn.proto` field by field (same snake_case names, except
//! that `type` is `activity_type` on [`Activity`] and `kind` on [`MessageReaction`] and
//! [`CardAction`]), which keeps the gRPC conversion (`crate::grpc::convert`) a mechanical
//! one-to-one mapping.
//!
//! Channels send more than any schema names, and a bot that echoes or forwards an activity must
//! not silently drop what it did not understand. Every type therefore carries a `properties` map
//! holding, verbatim and under their JSON names, all members the typed fields cannot represent
//! exactly; see [`json`] for the rule that decides which is which.
//!
//! Nothing here validates: an inbound activity without `type` or `conversation.id` is still an
//! `Activity`. Checking what a turn requires happens once, at the gRPC boundary, through
//! [`incoming::IncomingActivity::parse`].

pub mod incoming;
pub(crate) mod json;
pub(crate) mod scan;

pub use json::ActivityJsonError;

/// A JSON object: the shape of `properties`, entities and `SemanticAction.entities`.
pub type JsonMap = serde_json::Map<String, serde_json::Value>;

/// The well-known values of [`Activity::activity_type`], as the Bot Framework spells them.
pub mod types {
    /// A message from the user or a reply from the bot.
    pub const MESSAGE: &str = "message";
    /// The bot was added to or removed from a user's contact list.
    pub const CONTACT_RELATION_UPDATE: &str = "contactRelationUpdate";
    /// Members joined or left the conversation, or its metadata changed.
    pub const CONVERSATION_UPDATE: &str = "conversationUpdate";
    /// The sender is typing.
    pub const TYPING: &str = "typing";
    /// The conversation ended.
    pub const END_OF_CONVERSATION: &str = "endOfConversation";
    /// A named event with an optional value, not shown to the user.
    pub const EVENT: &str = "event";
    /// A request that expects a response (`invokeResponse`).
    pub const INVOKE: &str = "invoke";
    /// The response to an `invoke`.
    pub const INVOKE_RESPONSE: &str = "invokeResponse";
    /// The user asked for their data to be deleted.
    pub const DELETE_USER_DATA: &str = "deleteUserData";
    /// A previously sent message was edited.
    pub const MESSAGE_UPDATE: &str = "messageUpdate";
    /// A previously sent message was deleted.
    pub const MESSAGE_DELETE: &str = "messageDelete";
    /// The bot was installed or uninstalled.
    pub const INSTALLATION_UPDATE: &str = "installationUpdate";
    /// Reactions were added to or removed from a message.
    pub const MESSAGE_REACTION: &str = "messageReaction";
    /// A private suggestion to the recipient about another activity.
    pub const SUGGESTION: &str = "suggestion";
    /// Diagnostics, shown only by the emulator.
    pub const TRACE: &str = "trace";
    /// The conversation is handed to another agent.
    pub const HANDOFF: &str = "handoff";
    /// A command addressed to the bot.
    pub const COMMAND: &str = "command";
    /// The result of a `command`.
    pub const COMMAND_RESULT: &str = "commandResult";
}

/// One Bot Framework activity: a message, an event, a conversation update, and so on.
///
/// Field names follow the proto; the JSON names are their camelCase.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Activity {
    /// The activity type (JSON `type`); see [`types`].
    pub activity_type: Option<String>,
    /// The channel's id of this activity; the key of its receipt.
    pub id: Option<String>,
    /// RFC 3339 text as sent, so that precision survives.
    pub timestamp: Option<String>,
    /// RFC 3339 text as sent, so that the sender's offset survives.
    pub local_timestamp: Option<String>,
    /// The sender's IANA time zone name.
    pub local_timezone: Option<String>,
    /// Where replies to this activity are sent (the channel's Connector endpoint).
    pub service_url: Option<String>,
    /// The channel (msteams, slack, webchat, directline, ...).
    pub channel_id: Option<String>,
    /// The sender.
    pub from: Option<ChannelAccount>,
    /// The conversation the activity belongs to.
    pub conversation: Option<ConversationAccount>,
    /// The addressee (the bot, for inbound activities).
    pub recipient: Option<ChannelAccount>,
    /// How `text` is formatted: plain, markdown or xml.
    pub text_format: Option<String>,
    /// How several attachments are laid out: list or carousel.
    pub attachment_layout: Option<String>,
    /// Members who joined (conversationUpdate).
    pub members_added: Vec<ChannelAccount>,
    /// Members who left (conversationUpdate).
    pub members_removed: Vec<ChannelAccount>,
    /// Reactions added to a message (messageReaction).
    pub reactions_added: Vec<MessageReaction>,
    /// Reactions removed from a message (messageReaction).
    pub reactions_removed: Vec<MessageReaction>,
    /// The conversation's new topic (conversationUpdate).
    pub topic_name: Option<String>,
    /// Whether earlier history is disclosed to members who joined.
    pub history_disclosed: Option<bool>,
    /// The sender's locale, e.g. en-US.
    pub locale: Option<String>,
    /// The message text.
    pub text: Option<String>,
    /// Text to speak, plain or SSML.
    pub speak: Option<String>,
    /// Whether the bot expects input after this message: acceptingInput, expectingInput, ignoringInput.
    pub input_hint: Option<String>,
    /// Text to show when the channel cannot render the activity.
    pub summary: Option<String>,
    /// Buttons offered for the user's next reply.
    pub suggested_actions: Option<SuggestedActions>,
    /// Files, cards and media.
    pub attachments: Vec<Attachment>,
    /// Free-form objects with a `type` member (mention, place, clientInfo, ...).
    pub entities: Vec<JsonMap>,
    /// Channel-specific content, passed through as the channel sent it.
    pub channel_data: Option<serde_json::Value>,
    /// added or removed (contactRelationUpdate, installationUpdate).
    pub action: Option<String>,
    /// The id of the activity this one answers.
    pub reply_to_id: Option<String>,
    /// A descriptive label (trace activities).
    pub label: Option<String>,
    /// The type of `value` (trace activities).
    pub value_type: Option<String>,
    /// The payload of an event, invoke or trace activity, or of a card's submit.
    pub value: Option<serde_json::Value>,
    /// The name of an event, invoke or command.
    pub name: Option<String>,
    /// The conversation and activity this one refers to.
    pub relates_to: Option<ConversationReference>,
    /// Why a conversation ended (endOfConversation).
    pub code: Option<String>,
    /// When the activity expires, RFC 3339 text as sent.
    pub expiration: Option<String>,
    /// low, normal or high.
    pub importance: Option<String>,
    /// normal, notification, expectReplies or ephemeral.
    pub delivery_mode: Option<String>,
    /// Phrases a speech channel should listen for.
    pub listen_for: Vec<String>,
    /// Fragments of the replied-to text to highlight.
    pub text_highlights: Vec<TextHighlight>,
    /// A programmatic action accompanying the request.
    pub semantic_action: Option<SemanticAction>,
    /// Who sent the activity as a verified caller (urn:botframework:...), set by the hosting service.
    pub caller_id: Option<String>,
    /// JSON members the typed fields cannot carry exactly, verbatim under their JSON names.
    pub properties: JsonMap,
}

/// A user or bot on a channel.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChannelAccount {
    /// The account's id on the channel.
    pub id: Option<String>,
    /// The display name.
    pub name: Option<String>,
    /// The account's Microsoft Entra ID object id, when the channel knows it.
    pub aad_object_id: Option<String>,
    /// user or bot.
    pub role: Option<String>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// The conversation an activity belongs to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConversationAccount {
    /// The conversation's id on the channel.
    pub id: Option<String>,
    /// The display name.
    pub name: Option<String>,
    /// Whether the conversation has more than two members.
    pub is_group: Option<bool>,
    /// The channel's kind of conversation (personal, groupChat, channel, ...).
    pub conversation_type: Option<String>,
    /// The tenant the conversation lives in (Teams).
    pub tenant_id: Option<String>,
    /// user or bot.
    pub role: Option<String>,
    /// The Microsoft Entra ID object id, when the channel knows it.
    pub aad_object_id: Option<String>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// A reaction (like, plusOne, ...) to a message.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MessageReaction {
    /// The reaction type (JSON `type`).
    pub kind: Option<String>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// A file, card or other media attached to an activity.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attachment {
    /// The MIME type, or a card type such as application/vnd.microsoft.card.adaptive.
    pub content_type: Option<String>,
    /// Where the content can be fetched, when it is not inline.
    pub content_url: Option<String>,
    /// Usually an object (a card); some channels send a string.
    pub content: Option<serde_json::Value>,
    /// The file name.
    pub name: Option<String>,
    /// A thumbnail image.
    pub thumbnail_url: Option<String>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// Buttons offered to the user for their next reply.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SuggestedActions {
    /// The ids of the recipients the actions are shown to; empty: everyone.
    pub to: Vec<String>,
    /// The actions.
    pub actions: Vec<CardAction>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// One clickable action on a card or among suggested actions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CardAction {
    /// The action type (JSON `type`): imBack, postBack, openUrl, ...
    pub kind: Option<String>,
    /// The button's text.
    pub title: Option<String>,
    /// An image URL shown on the button.
    pub image: Option<String>,
    /// Text sent to the bot when the action is taken (some action types).
    pub text: Option<String>,
    /// Text shown in the chat when the action is taken.
    pub display_text: Option<String>,
    /// The action's payload (a URL, a postBack value, ...).
    pub value: Option<serde_json::Value>,
    /// Channel-specific content.
    pub channel_data: Option<serde_json::Value>,
    /// Alternative text of `image`.
    pub image_alt_text: Option<String>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// A pointer to a conversation, or to an activity within it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConversationReference {
    /// The activity referred to.
    pub activity_id: Option<String>,
    /// The user in that conversation.
    pub user: Option<ChannelAccount>,
    /// The bot in that conversation.
    pub bot: Option<ChannelAccount>,
    /// The conversation.
    pub conversation: Option<ConversationAccount>,
    /// The channel.
    pub channel_id: Option<String>,
    /// The channel's Connector endpoint.
    pub service_url: Option<String>,
    /// The conversation's locale.
    pub locale: Option<String>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// A fragment of the replied-to text to highlight.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TextHighlight {
    /// The fragment.
    pub text: Option<String>,
    /// Which occurrence of `text` is meant, if it occurs more than once.
    pub occurrence: Option<f64>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

/// A programmatic action accompanying a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SemanticAction {
    /// The action's id.
    pub id: Option<String>,
    /// start, continue or done.
    pub state: Option<String>,
    /// Entities by name, each a free-form object.
    pub entities: Option<JsonMap>,
    /// JSON members the typed fields cannot carry exactly.
    pub properties: JsonMap,
}

impl Activity {
    /// A `message` activity with the given text and nothing else; the engine fills in the
    /// addressing of replies.
    pub fn message(text: impl Into<String>) -> Activity {
        Activity {
            activity_type: Some(types::MESSAGE.to_owned()),
            text: Some(text.into()),
            ..Activity::default()
        }
    }

    /// The text without leading and trailing whitespace, the form that prompts and transcript
    /// comparisons look at.
    pub fn text_trimmed(&self) -> Option<&str> {
        self.text.as_deref().map(str::trim)
    }

    /// `conversation.id`, the key of conversation-scoped state.
    pub fn conversation_id(&self) -> Option<&str> {
        self.conversation.as_ref()?.id.as_deref()
    }

    /// `from.id`, the key of user-scoped state.
    pub fn from_id(&self) -> Option<&str> {
        self.from.as_ref()?.id.as_deref()
    }

    /// Whether [`Activity::activity_type`] is `activity_type`.
    pub fn is_type(&self, activity_type: &str) -> bool {
        self.activity_type.as_deref() == Some(activity_type)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_sets_type_and_text_only() {
        let activity = Activity::message("hi");
        assert_eq!(activity.activity_type.as_deref(), Some(types::MESSAGE));
        assert_eq!(activity.text.as_deref(), Some("hi"));
        assert!(activity.is_type(types::MESSAGE));
        assert_eq!(
            Activity {
                activity_type: None,
                text: None,
                ..activity
            },
            Activity::default()
        );
    }

    #[test]
    fn accessors_look_through_missing_parts() {
        let mut activity = Activity::message("  red \n");
        assert_eq!(activity.text_trimmed(), Some("red"));
        assert_eq!(activity.conversation_id(), None);
        assert_eq!(activity.from_id(), None);

        activity.conversation = Some(ConversationAccount::default());
        activity.from = Some(ChannelAccount::default());
        assert_eq!(activity.conversation_id(), None);
        assert_eq!(activity.from_id(), None);

        activity.conversation = Some(ConversationAccount {
            id: Some("c1".into()),
            ..ConversationAccount::default()
        });
        activity.from = Some(ChannelAccount {
            id: Some("u1".into()),
            ..ChannelAccount::default()
        });
        assert_eq!(activity.conversation_id(), Some("c1"));
        assert_eq!(activity.from_id(), Some("u1"));

        assert_eq!(Activity::default().text_trimmed(), None);
    }
}
