//! State keys, in Bot Framework's shape and namespaced by bot:
//!
//! | scope | key |
//! |---|---|
//! | conversation | `{bot}/{channelId}/conversations/{conversationId}` |
//! | user | `{bot}/{channelId}/users/{userId}` |
//! | private conversation | `{bot}/{channelId}/conversations/{conversationId}/users/{userId}` |
//! | a turn's receipt | `{bot}/{channelId}/conversations/{conversationId}/activities/{activityId}` |
//!
//! Every part is escaped before it is joined: `%` becomes `%25` and `/` becomes `%2F`. After
//! escaping no part contains a `/`, so a key splits back into exactly the parts it was built from,
//! and no id can forge another key: a conversation id `c/users/mallory` becomes
//! `c%2Fusers%2Fmallory`, not a path into someone's private conversation state. Bot Framework's own
//! storage keys do not escape, and that forgery works there.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{BuildHasher as _, Hash, Hasher};
use std::sync::{Arc, LazyLock};

use crate::activity::incoming::{ActivityId, ChannelId, ConversationId, TurnAddress, UserId};
use crate::activity::scan;

/// Which of a turn's three state scopes a key belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Shared by everyone in the conversation.
    Conversation,
    /// One user, across all of their conversations on the channel.
    User,
    /// One user within one conversation.
    PrivateConversation,
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scope::Conversation => "conversation",
            Scope::User => "user",
            Scope::PrivateConversation => "private conversation",
        })
    }
}

/// The key of one scope's state row. Built only from parsed ids, always escaped.
///
/// Shared text (`Arc<str>`): a turn hands its keys to the load, the commit, the state cache, the
/// conversation queue and the group commit's batch, and a `String` key was copied into a new
/// allocation at each of those steps (`bench/RESULTS.md`); a clone is now a count.
///
/// Hashed once, when it is made: a turn looks its keys up in a dozen maps (the conversation
/// queue, the state cache, the snapshot, the group commit's batch), and hashing their text at
/// every lookup came to about 17 hashes of 40 to 80 bytes per turn (`bench/RESULTS.md`). The
/// stored hash is keyed with a seed drawn at random once per process ([`KEY_SEED`]), so callers,
/// who choose the ids, cannot aim keys at one bucket; maps hash it again with their own seed
/// ([`crate::store::KeyHasher`]). Equal keys have equal hashes, and the hash is compared first.
#[derive(Clone)]
pub struct StateKey {
    text: Arc<str>,
    hash: u64,
}

/// The seed of every [`StateKey`]'s stored hash: random, one per process.
static KEY_SEED: LazyLock<foldhash::quality::RandomState> = LazyLock::new(Default::default);

impl PartialEq for StateKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.text == other.text
    }
}

impl Eq for StateKey {}

impl Hash for StateKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl PartialOrd for StateKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// By text, as the keys sort in the database.
impl Ord for StateKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.text.cmp(&other.text)
    }
}

impl fmt::Debug for StateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("StateKey").field(&self.text).finish()
    }
}

impl StateKey {
    /// A key of `text`, hashed.
    fn from_text(text: Arc<str>) -> Self {
        let hash = KEY_SEED.hash_one(&*text);
        Self { text, hash }
    }

    /// The conversation scope's key.
    pub fn conversation(bot: &str, channel: &ChannelId, conversation: &ConversationId) -> Self {
        Self::from_text(
            join(&[
                bot,
                channel.as_str(),
                "conversations",
                conversation.as_str(),
            ])
            .into(),
        )
    }

    /// The user scope's key.
    pub fn user(bot: &str, channel: &ChannelId, user: &UserId) -> Self {
        Self::from_text(join(&[bot, channel.as_str(), "users", user.as_str()]).into())
    }

    /// The private conversation scope's key.
    pub fn private_conversation(
        bot: &str,
        channel: &ChannelId,
        conversation: &ConversationId,
        user: &UserId,
    ) -> Self {
        Self::from_text(
            join(&[
                bot,
                channel.as_str(),
                "conversations",
                conversation.as_str(),
                "users",
                user.as_str(),
            ])
            .into(),
        )
    }

    /// The key of the receipt of the turn for activity `activity`: what identifies a redelivery.
    pub fn receipt(
        bot: &str,
        channel: &ChannelId,
        conversation: &ConversationId,
        activity: &ActivityId,
    ) -> Self {
        Self::from_text(
            join(&[
                bot,
                channel.as_str(),
                "conversations",
                conversation.as_str(),
                "activities",
                activity.as_str(),
            ])
            .into(),
        )
    }

    /// The key of conversation `conversation`'s hold (`store::postgres::hold`): a row beside its
    /// state, `{conversation}/%hold`, which no other key can be or end with: an id's `%` is
    /// escaped (`%25`), so `/%hold` is never an id's part.
    pub fn hold(conversation: &StateKey) -> Self {
        Self::from_text(format!("{}/%hold", conversation.as_str()).into())
    }

    /// Whether this is a conversation scope's key, `{bot}/{channelId}/conversations/{id}`.
    pub fn is_conversation(&self) -> bool {
        let mut parts = self.as_str().split('/');
        matches!(
            (
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next()
            ),
            (Some(_), Some(_), Some("conversations"), Some(_), None)
        )
    }

    /// The user whose data this key holds, as erasure finds it: `{channelId}/{userId}`, escaped,
    /// for a user scope's or a private conversation scope's key; `None` for any other. The same
    /// as the database's `turnstile_key_user` (`migrations/V4__erasure.sql`).
    pub fn user_subject(&self) -> Option<String> {
        let (channel, user) = self.user_parts()?;
        let mut subject = String::with_capacity(channel.len() + 1 + user.len());
        subject.push_str(channel);
        subject.push('/');
        subject.push_str(user);
        Some(subject)
    }

    /// Whether this key holds a user's data: a user scope's or a private conversation scope's
    /// ([`StateKey::user_subject`] is `Some`), found without building the subject.
    pub fn holds_user_data(&self) -> bool {
        self.user_parts().is_some()
    }

    /// The channel and the user of [`StateKey::user_subject`], read in place.
    fn user_parts(&self) -> Option<(&str, &str)> {
        let (_bot, rest) = self.text.split_once('/')?;
        let (channel, rest) = rest.split_once('/')?;
        let user = match rest.strip_prefix("users/") {
            Some(user) => user,
            None => {
                let (_conversation, rest) = rest.strip_prefix("conversations/")?.split_once('/')?;
                rest.strip_prefix("users/")?
            }
        };
        if user.contains('/') {
            return None;
        }
        Some((channel, user))
    }

    /// The conversation whose data this key holds: `{channelId}/{conversationId}`, escaped, for a
    /// key under a conversation (its scope, private scopes, hold and receipts); `None` for a user
    /// scope. The same as the database's `turnstile_key_conversation`.
    pub fn conversation_subject(&self) -> Option<String> {
        let (channel, conversation) = self.conversation_parts()?;
        Some(format!("{channel}/{conversation}"))
    }

    /// Whether this key is under a conversation ([`StateKey::conversation_subject`] is `Some`),
    /// found without building the subject.
    pub fn is_under_conversation(&self) -> bool {
        self.conversation_parts().is_some()
    }

    /// The channel and the conversation of [`StateKey::conversation_subject`], read in place.
    fn conversation_parts(&self) -> Option<(&str, &str)> {
        let mut parts = self.text.split('/');
        let (_, channel, kind, conversation) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        (kind == "conversations").then_some((channel, conversation))
    }

    /// Whether this is a conversation's hold key ([`StateKey::hold`]).
    pub fn is_hold(&self) -> bool {
        self.text.ends_with("/%hold")
    }

    /// Wraps a key read back from a store, which only ever holds keys built here.
    pub(crate) fn from_stored(key: String) -> Self {
        Self::from_text(key.into())
    }

    /// The key as stored.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Splits the key back into its unescaped parts: the inverse of building it.
    pub fn parts(&self) -> Vec<String> {
        self.text.split('/').map(unescape).collect()
    }
}

impl fmt::Display for StateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The keys of one turn's scopes: the conversation always, the user and private conversation
/// scopes only when the activity names a user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnKeys {
    /// The conversation scope's key.
    pub conversation: StateKey,
    /// The user scope's key, when the activity has a `from.id`.
    pub user: Option<StateKey>,
    /// The private conversation scope's key, when the activity has a `from.id`.
    pub private_conversation: Option<StateKey>,
    /// Where the user key's escaped channel id starts and its `users/` part: its subject is cut
    /// at these ([`TurnKeys::user_subject`]).
    channel_at: usize,
    users_at: usize,
}

impl TurnKeys {
    /// The keys of bot `bot`'s state for a turn at `address`.
    ///
    /// The same text as [`StateKey`]'s constructors, built with each id escaped once: the
    /// conversation key is the private conversation key's start, and the user key copies its
    /// first two parts and its last (every turn builds these; joining every key from
    /// its parts escaped the bot and channel names three times, `bench/RESULTS.md`).
    pub fn new(bot: &str, address: &TurnAddress) -> Self {
        let TurnAddress {
            channel,
            conversation,
            user,
        } = address;
        let (channel, conversation) = (channel.as_str(), conversation.as_str());
        let user = user.as_ref().map(UserId::as_str);
        with_scratch(|text, user_key| {
            // The conversation and private conversation keys' text:
            // `{bot}/{channelId}/conversations/{conversationId}`, then `/users/{userId}`; the
            // user key's in the second string, `{bot}/{channelId}/` copied, `users/` and the
            // escaped user id copied.
            escape_into(bot, text);
            text.push('/');
            let channel_at = text.len();
            escape_into(channel, text);
            text.push('/');
            let shared = text.len();
            text.push_str("conversations/");
            escape_into(conversation, text);
            let conversation_end = text.len();
            let conversation = StateKey::from_text(text[..conversation_end].into());
            let Some(user) = user else {
                return Self {
                    conversation,
                    user: None,
                    private_conversation: None,
                    channel_at,
                    users_at: shared,
                };
            };
            text.push_str("/users/");
            let escaped_user = text.len();
            escape_into(user, text);
            user_key.push_str(&text[..shared]);
            user_key.push_str("users/");
            user_key.push_str(&text[escaped_user..]);
            Self {
                conversation,
                user: Some(StateKey::from_text(user_key.as_str().into())),
                private_conversation: Some(StateKey::from_text(text.as_str().into())),
                channel_at,
                users_at: shared,
            }
        })
    }

    /// The user scope's subject, `{channelId}/{userId}` escaped, as [`StateKey::user_subject`]
    /// finds it in the user key; `None` without a user. Every turn with a user and an id asks
    /// (its receipt names the user): cut from the key where [`TurnKeys::new`] put the parts,
    /// rather than searched for.
    pub fn user_subject(&self) -> Option<String> {
        let user = self.user.as_ref()?.as_str();
        // `{channelId}/`, then what follows `users/`.
        let (channel, id) = (
            user.get(self.channel_at..self.users_at)?,
            user.get(self.users_at + "users/".len()..)?,
        );
        let mut subject = String::with_capacity(channel.len() + id.len());
        subject.push_str(channel);
        subject.push_str(id);
        Some(subject)
    }

    /// The key of the receipt of the turn for activity `activity` in this conversation: the same
    /// as [`StateKey::receipt`], continuing the conversation key.
    pub fn receipt(&self, activity: &ActivityId) -> StateKey {
        with_scratch(|key, _| {
            key.push_str(self.conversation.as_str());
            key.push_str("/activities/");
            escape_into(activity.as_str(), key);
            StateKey::from_text(key.as_str().into())
        })
    }

    /// Every key with its scope, conversation first.
    pub fn all(&self) -> impl Iterator<Item = (Scope, &StateKey)> {
        std::iter::once((Scope::Conversation, &self.conversation))
            .chain(self.user.iter().map(|k| (Scope::User, k)))
            .chain(
                self.private_conversation
                    .iter()
                    .map(|k| (Scope::PrivateConversation, k)),
            )
    }
}

/// `{channelId}/{id}`, escaped: how erasure names a user or a conversation of a channel
/// ([`StateKey::user_subject`], [`StateKey::conversation_subject`]).
pub fn subject(channel: &str, id: &str) -> String {
    let mut text = String::with_capacity(channel.len() + id.len() + 1);
    escape_into(channel, &mut text);
    text.push('/');
    escape_into(id, &mut text);
    text
}

/// Runs `build` on this thread's two scratch strings, emptied: a turn's keys are written there
/// and each copied once into its own shared text, where a `String` of their own cost each turn
/// three allocations and frees more (`bench/RESULTS.md`). `build` must not build keys itself.
fn with_scratch<R>(build: impl FnOnce(&mut String, &mut String) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<(String, String)> =
            const { std::cell::RefCell::new((String::new(), String::new())) };
    }
    SCRATCH.with_borrow_mut(|(first, second)| {
        first.clear();
        second.clear();
        build(first, second)
    })
}

fn join(parts: &[&str]) -> String {
    // Every turn builds its keys: one allocation, and runs copied whole rather than by character.
    let mut key = String::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            key.push('/');
        }
        escape_into(part, &mut key);
    }
    key
}

fn escape_into(part: &str, out: &mut String) {
    // Almost no id holds a special: checked a word at a time first, such a part is copied whole
    // (the byte-by-byte search below showed in every turn's profile, `bench/RESULTS.md`).
    if !has_special(part.as_bytes()) {
        out.push_str(part);
        return;
    }
    let mut rest = part;
    // Both specials are ASCII, so the byte index found is a character boundary.
    while let Some(at) = rest.bytes().position(|b| b == b'%' || b == b'/') {
        out.push_str(&rest[..at]);
        out.push_str(if rest.as_bytes()[at] == b'%' {
            "%25"
        } else {
            "%2F"
        });
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
}

/// Whether `bytes` holds a `%` or a `/`, checked a word at a time.
fn has_special(bytes: &[u8]) -> bool {
    scan::any_word(bytes, b'a', |w| {
        scan::byte_is(w, b'%') | scan::byte_is(w, b'/')
    })
}

fn unescape(part: &str) -> String {
    part.replace("%2F", "/").replace("%25", "%")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(channel: &str, conversation: &str, user: &str) -> (ChannelId, ConversationId, UserId) {
        (
            ChannelId::parse(channel, "channel_id").expect("valid channel"),
            ConversationId::parse(conversation, "conversation.id").expect("valid conversation"),
            UserId::parse(user, "from.id").expect("valid user"),
        )
    }

    #[test]
    fn keys_have_bot_framework_shape() {
        let (ch, conv, user) = ids("msteams", "19:abc@thread.skype", "29:u");
        assert_eq!(
            StateKey::conversation("pizza", &ch, &conv).as_str(),
            "pizza/msteams/conversations/19:abc@thread.skype"
        );
        assert_eq!(
            StateKey::user("pizza", &ch, &user).as_str(),
            "pizza/msteams/users/29:u"
        );
        assert_eq!(
            StateKey::private_conversation("pizza", &ch, &conv, &user).as_str(),
            "pizza/msteams/conversations/19:abc@thread.skype/users/29:u"
        );
    }

    #[test]
    fn a_conversation_id_cannot_reach_private_state() {
        let (ch, victim_conv, victim) = ids("slack", "c", "mallory");
        let (_, forged_conv, _) = ids("slack", "c/users/mallory", "x");
        let private = StateKey::private_conversation("bot", &ch, &victim_conv, &victim);
        let forged = StateKey::conversation("bot", &ch, &forged_conv);
        assert_ne!(private, forged);
        assert_eq!(
            forged.as_str(),
            "bot/slack/conversations/c%2Fusers%2Fmallory"
        );
    }

    fn id() -> impl Strategy<Value = String> {
        // Ids rich in the characters that matter: separators, escapes and their look-alikes.
        proptest::collection::vec(
            prop_oneof![
                Just("/".to_owned()),
                Just("%".to_owned()),
                Just("%2F".to_owned()),
                Just("%25".to_owned()),
                Just("users".to_owned()),
                Just("conversations".to_owned()),
                "[a-z0-9:@.|+=-]{1,3}",
                "\\PC",
            ],
            1..6,
        )
        .prop_map(|parts| parts.concat())
    }

    #[derive(Debug, Clone, PartialEq)]
    enum Built {
        Conversation(String, String, String),
        User(String, String, String),
        Private(String, String, String, String),
        Receipt(String, String, String, String),
    }

    fn build(b: &Built) -> StateKey {
        let p = |ch: &str, conv: &str, user: &str| ids(ch, conv, user);
        match b {
            Built::Conversation(bot, ch, conv) => {
                let (ch, conv, _) = p(ch, conv, "u");
                StateKey::conversation(bot, &ch, &conv)
            }
            Built::User(bot, ch, user) => {
                let (ch, _, user) = p(ch, "c", user);
                StateKey::user(bot, &ch, &user)
            }
            Built::Private(bot, ch, conv, user) => {
                let (ch, conv, user) = p(ch, conv, user);
                StateKey::private_conversation(bot, &ch, &conv, &user)
            }
            Built::Receipt(bot, ch, conv, activity) => {
                let (ch, conv, _) = p(ch, conv, "u");
                let activity = ActivityId::parse(activity, "id").expect("valid activity id");
                StateKey::receipt(bot, &ch, &conv, &activity)
            }
        }
    }

    fn built() -> impl Strategy<Value = Built> {
        prop_oneof![
            (id(), id(), id()).prop_map(|(b, c, v)| Built::Conversation(b, c, v)),
            (id(), id(), id()).prop_map(|(b, c, u)| Built::User(b, c, u)),
            (id(), id(), id(), id()).prop_map(|(b, c, v, u)| Built::Private(b, c, v, u)),
            (id(), id(), id(), id()).prop_map(|(b, c, v, a)| Built::Receipt(b, c, v, a)),
        ]
    }

    #[test]
    fn a_special_is_found_at_every_position() {
        for special in [b'%', b'/'] {
            for len in 1..70 {
                for at in 0..len {
                    let mut bytes = vec![b'x'; len];
                    bytes[at] = special;
                    assert!(has_special(&bytes), "{special:#x} at {at} of {len}");
                }
            }
        }
        for clean in [0u8, b'$', b'.', b'0', b'2', b'5', b'F', 0x7f, 0x80, 0xff] {
            assert!(!has_special(&[clean; 65]), "{clean:#x}");
        }
    }

    proptest! {
        #[test]
        fn a_turns_keys_are_the_keys_built_part_by_part(
            bot in id(), ch in id(), conv in id(), user in id(), activity in id(), anonymous in any::<bool>()
        ) {
            let (ch, conv, user) = ids(&ch, &conv, &user);
            let activity = ActivityId::parse(&activity, "id").expect("valid activity id");
            let address = TurnAddress {
                channel: ch.clone(),
                conversation: conv.clone(),
                user: (!anonymous).then(|| user.clone()),
            };
            let keys = TurnKeys::new(&bot, &address);
            prop_assert_eq!(&keys.conversation, &StateKey::conversation(&bot, &ch, &conv));
            prop_assert_eq!(
                keys.user.clone(),
                (!anonymous).then(|| StateKey::user(&bot, &ch, &user))
            );
            prop_assert_eq!(
                keys.private_conversation.clone(),
                (!anonymous).then(|| StateKey::private_conversation(&bot, &ch, &conv, &user))
            );
            prop_assert_eq!(
                keys.receipt(&activity),
                StateKey::receipt(&bot, &ch, &conv, &activity)
            );
            let subject = keys.user.as_ref().and_then(StateKey::user_subject);
            prop_assert_eq!(keys.user_subject(), subject.clone());
            prop_assert_eq!(
                subject,
                (!anonymous).then(|| super::subject(ch.as_str(), user.as_str()))
            );
        }

        #[test]
        fn keys_split_back_into_their_parts(b in built()) {
            let parts = build(&b).parts();
            let expected: Vec<String> = match &b {
                Built::Conversation(bot, ch, conv) =>
                    vec![bot.clone(), ch.clone(), "conversations".into(), conv.clone()],
                Built::User(bot, ch, user) =>
                    vec![bot.clone(), ch.clone(), "users".into(), user.clone()],
                Built::Private(bot, ch, conv, user) => vec![
                    bot.clone(), ch.clone(), "conversations".into(), conv.clone(),
                    "users".into(), user.clone(),
                ],
                Built::Receipt(bot, ch, conv, activity) => vec![
                    bot.clone(), ch.clone(), "conversations".into(), conv.clone(),
                    "activities".into(), activity.clone(),
                ],
            };
            prop_assert_eq!(parts, expected);
        }

        /// The checks that build nothing say what the subjects say, for every kind of key, and
        /// the subjects name the scopes they should.
        #[test]
        fn a_keys_checks_agree_with_its_subjects(b in built()) {
            let key = build(&b);
            prop_assert_eq!(key.holds_user_data(), key.user_subject().is_some());
            prop_assert_eq!(key.is_under_conversation(), key.conversation_subject().is_some());
            let (user, under_conversation) = match &b {
                Built::Conversation(..) | Built::Receipt(..) => (false, true),
                Built::User(..) => (true, false),
                Built::Private(..) => (true, true),
            };
            prop_assert_eq!(key.holds_user_data(), user);
            prop_assert_eq!(key.is_under_conversation(), under_conversation);
        }

        #[test]
        fn different_scopes_or_ids_never_share_a_key(a in built(), b in built()) {
            if a != b {
                prop_assert_ne!(build(&a), build(&b));
            }
        }

        /// The stored hash agrees with equality, a key built twice is found in a map, and keys
        /// sort by their text.
        #[test]
        fn keys_hash_compare_and_sort_by_their_text(a in built(), b in built()) {
            let (a1, a2, b1) = (build(&a), build(&a), build(&b));
            prop_assert_eq!(&a1, &a2);
            prop_assert_eq!(a1.hash, a2.hash);
            let map: crate::store::KeyMap<u8> = [(a1.clone(), 1)].into_iter().collect();
            prop_assert_eq!(map.get(&a2), Some(&1));
            prop_assert_eq!(a1.cmp(&b1), a1.as_str().cmp(b1.as_str()));
            prop_assert_eq!(a1 == b1, a1.as_str() == b1.as_str());
        }
    }

    #[test]
    fn a_hold_key_is_told_from_every_other_key() {
        let channel = ChannelId::parse("test", "channelId").expect("an id");
        for conversation in ["c", "hold", "%hold", "x/%hold"] {
            let conversation =
                ConversationId::parse(conversation, "conversation.id").expect("an id");
            let key = StateKey::conversation("bot", &channel, &conversation);
            assert!(!key.is_hold(), "{key:?}");
            assert!(StateKey::hold(&key).is_hold());
            let user = UserId::parse("%hold", "from.id").expect("an id");
            let private = StateKey::private_conversation("bot", &channel, &conversation, &user);
            assert!(!private.is_hold(), "{private:?}");
        }
    }
}
