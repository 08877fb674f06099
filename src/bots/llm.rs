//! The `llm` sample bot: a stand-in for a language-model agent, so that streaming and double
//! texting can be tried on any machine — no network, no model. It answers with canned text, one
//! word every `token_delay` (50 ms unless told, `--llm-token-delay-ms`), showing a status line
//! first and then its answer as it "writes" it ([`TurnContext::draft`]); only the whole answer,
//! sent at the end, is delivered, once its turn has committed.
//!
//! Like a real agent it keeps the conversation's transcript in conversation state (`transcript`,
//! a list of [`Message`]s), and each run appends to it, in order:
//!
//! 1. the user's messages it answers: the ones its turn supersedes first
//!    ([`TurnContext::superseded`], under the `interrupt` policy: they were never answered), then
//!    the batch ([`TurnContext::batch`], under `coalesce`), or else the turn's own message;
//! 2. a `tool_use` (the model asks for the [`TOOL`] tool, with an id derived from the
//!    transcript's length), then the tool's `tool_result` once the call is back — the call takes
//!    [`TOOL_CALL_WORDS`] words' time;
//! 3. its answer, written word by word.
//!
//! The transcript is written to state at every step, as an agent saving its progress would: a
//! turn whose run is cut short (interrupted, stopped, failed) must leave none of it, and in
//! particular never a `tool_use` without its `tool_result`, which a model's next call would
//! refuse. That is the engine's guarantee (nothing is committed before the run ends), and what
//! `bench/double_text_storm.sh` checks in the committed state. It is also what a conflict would
//! otherwise corrupt, and what a replay recomputes from the fresh state: everything here is a
//! function of the state and the activities, as the replay rule asks.

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::activity::{Activity, types};
use crate::bot::{Bot, BotError, Scopes, TurnContext};

const TRANSCRIPT: &str = "transcript";

/// How long the fake model takes per word unless told.
pub const DEFAULT_TOKEN_DELAY: Duration = Duration::from_millis(50);

/// How many words' time (`token_delay` each) the fake tool call takes.
pub const TOOL_CALL_WORDS: u32 = 6;

/// The tool the fake model calls on every run.
pub const TOOL: &str = "search";

/// A [`Message`]'s role: what the user said.
pub const USER: &str = "user";
/// A [`Message`]'s role: the model's request for a tool call.
pub const TOOL_USE: &str = "tool_use";
/// A [`Message`]'s role: the answer of a tool call.
pub const TOOL_RESULT: &str = "tool_result";
/// A [`Message`]'s role: what the bot answered.
pub const ASSISTANT: &str = "assistant";

/// Streams a canned answer word by word, after a tool call.
#[derive(Debug, Clone, Copy)]
pub struct LlmBot {
    token_delay: Duration,
}

impl LlmBot {
    /// A bot that "writes" one word every `token_delay`, and whose tool call takes
    /// [`TOOL_CALL_WORDS`] of them.
    pub fn new(token_delay: Duration) -> Self {
        Self { token_delay }
    }
}

impl Default for LlmBot {
    fn default() -> Self {
        Self::new(DEFAULT_TOKEN_DELAY)
    }
}

/// One entry of the transcript kept in conversation state. Transcripts written before the tool
/// call (`role` and `text` alone) read as they are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// [`USER`], [`TOOL_USE`], [`TOOL_RESULT`] or [`ASSISTANT`].
    pub role: String,
    /// What was said; for a tool call, the tool's input or its result.
    pub text: String,
    /// For a user's message: the id of its activity, when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activity_id: Option<String>,
    /// For a tool call: the id pairing its `tool_use` with its `tool_result`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_use_id: Option<String>,
    /// For a `tool_use`: the tool called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
}

impl Message {
    fn new(role: &str, text: impl Into<String>) -> Self {
        Self {
            role: role.to_owned(),
            text: text.into(),
            activity_id: None,
            tool_use_id: None,
            tool: None,
        }
    }

    /// `activity`, a user's message.
    fn user(activity: &Activity) -> Self {
        Self {
            activity_id: activity.id.clone(),
            ..Self::new(USER, activity.text_trimmed().unwrap_or_default())
        }
    }
}

/// The fake model's answer to `text`, the `turn`th of the conversation: a function of the
/// state and the activity alone, as the replay rule asks.
pub fn answer(text: &str, turn: usize) -> String {
    answer_all(&[text], turn)
}

/// The fake model's answer to several messages answered by one run (a batch, or messages an
/// interrupt superseded), oldest first; [`answer`] for one.
pub fn answer_all(texts: &[&str], turn: usize) -> String {
    let quoted: Vec<String> = texts.iter().map(|text| format!("\"{text}\"")).collect();
    let said = match quoted.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => quoted.concat(),
    };
    format!(
        "You said {said}. This is answer number {turn} of this conversation, written one word at \
         a time the way a language model writes, so that you can watch it arrive before it is \
         committed."
    )
}

/// The id of the tool call made when the transcript holds `len` entries: deterministic, so a
/// replay makes the same call.
pub fn tool_use_id(len: usize) -> String {
    format!("toolu_{len:04}")
}

/// What the fake [`TOOL`] answers for `query`.
fn tool_result(query: &str) -> String {
    format!("3 results for \"{query}\"")
}

/// The user's messages a run answers, oldest first: the superseded ones, then the batch or the
/// turn's own message.
fn asked<'t>(turn: &'t TurnContext<'_>) -> impl Iterator<Item = &'t Activity> {
    let answered = if turn.batch().is_empty() {
        std::slice::from_ref(turn.activity())
    } else {
        turn.batch()
    };
    turn.superseded().iter().chain(answered)
}

#[async_trait]
impl Bot for LlmBot {
    /// Its transcript is the conversation's: no user state is loaded for it.
    fn scopes(&self) -> Scopes {
        Scopes::CONVERSATION
    }

    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !turn.activity().is_type(types::MESSAGE) {
            return Ok(());
        }
        turn.inform("Thinking…")?;
        let mut transcript: Vec<Message> = turn.conversation_property(TRANSCRIPT)?;
        let number = transcript.iter().filter(|m| m.role == ASSISTANT).count() + 1;
        let said: Vec<Message> = asked(turn).map(Message::user).collect();
        let texts: Vec<&str> = said.iter().map(|m| m.text.as_str()).collect();
        let reply = answer_all(&texts, number);
        let query = texts.last().copied().unwrap_or_default().to_owned();
        transcript.extend(said);

        let call = tool_use_id(transcript.len());
        transcript.push(Message {
            tool_use_id: Some(call.clone()),
            tool: Some(TOOL.to_owned()),
            ..Message::new(TOOL_USE, query.as_str())
        });
        turn.conversation_state().set(TRANSCRIPT, &transcript)?;
        tokio::time::sleep(self.token_delay * TOOL_CALL_WORDS).await;
        transcript.push(Message {
            tool_use_id: Some(call),
            ..Message::new(TOOL_RESULT, tool_result(&query))
        });
        turn.conversation_state().set(TRANSCRIPT, &transcript)?;

        let mut written = String::with_capacity(reply.len());
        for word in reply.split_inclusive(' ') {
            tokio::time::sleep(self.token_delay).await;
            written.push_str(word);
            turn.draft(written.as_str())?;
        }
        transcript.push(Message::new(ASSISTANT, written.as_str()));
        turn.conversation_state().set(TRANSCRIPT, &transcript)?;
        turn.send_text(written);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::activity::incoming::IncomingActivity;
    use crate::activity::{ChannelAccount, ConversationAccount, JsonMap};
    use crate::drafts::{DraftEvent, DraftKind, Drafts};
    use crate::state::{Scope, ScopeState};

    /// A message `id` saying `text` in conversation `c1`, from `u1`.
    fn message(id: &str, text: &str) -> Activity {
        Activity {
            id: Some(id.into()),
            channel_id: Some("test".into()),
            conversation: Some(ConversationAccount {
                id: Some("c1".into()),
                ..Default::default()
            }),
            from: Some(ChannelAccount {
                id: Some("u1".into()),
                ..Default::default()
            }),
            ..Activity::message(text)
        }
    }

    /// One run of the bot on conversation state `state` for `activity`, superseding `superseded`
    /// and answering `batch`: the state it leaves and the texts it sends.
    async fn run(
        state: &JsonMap,
        activity: Activity,
        superseded: &[Activity],
        batch: &[Activity],
    ) -> (JsonMap, Vec<String>) {
        let incoming = IncomingActivity::parse(activity).expect("valid");
        let mut turn = TurnContext::new(
            &incoming,
            1,
            ScopeState::new(Scope::Conversation, state.clone()),
            None,
            None,
        )
        .with_superseded(superseded)
        .with_batch(batch);
        LlmBot::new(Duration::ZERO)
            .on_turn(&mut turn)
            .await
            .expect("the turn");
        let (scopes, sent) = turn.finish();
        let texts = sent.into_iter().filter_map(|a| a.text).collect();
        (scopes.conversation.into_properties(), texts)
    }

    fn transcript(state: &JsonMap) -> Vec<Message> {
        serde_json::from_value(state[TRANSCRIPT].clone()).expect("a transcript")
    }

    /// `(role, text)` of each entry.
    fn entries(state: &JsonMap) -> Vec<(String, String)> {
        transcript(state)
            .into_iter()
            .map(|m| (m.role, m.text))
            .collect()
    }

    fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
        expected
            .iter()
            .map(|(role, text)| ((*role).to_owned(), (*text).to_owned()))
            .collect()
    }

    #[tokio::test]
    async fn a_run_records_the_message_a_tool_call_and_the_answer() {
        let (state, sent) = run(&JsonMap::new(), message("m1", "hello"), &[], &[]).await;
        let first = answer("hello", 1);
        assert_eq!(sent, std::slice::from_ref(&first));
        assert_eq!(
            entries(&state),
            pairs(&[
                (USER, "hello"),
                (TOOL_USE, "hello"),
                (TOOL_RESULT, "3 results for \"hello\""),
                (ASSISTANT, &first),
            ])
        );
        let entries = transcript(&state);
        assert_eq!(entries[0].activity_id.as_deref(), Some("m1"));
        assert_eq!(entries[1].tool.as_deref(), Some(TOOL));
        assert_eq!(entries[1].tool_use_id, Some(tool_use_id(1)));
        assert_eq!(entries[2].tool_use_id, entries[1].tool_use_id, "a pair");

        // The next run counts answers, not entries, and its call has an id of its own.
        let (state, sent) = run(&state, message("m2", "more"), &[], &[]).await;
        assert_eq!(sent, [answer("more", 2)]);
        let entries = transcript(&state);
        assert_eq!(entries.len(), 8);
        assert_eq!(entries[5].tool_use_id, Some(tool_use_id(5)));
        assert_eq!(entries[6].tool_use_id, Some(tool_use_id(5)));
    }

    #[tokio::test]
    async fn superseded_messages_come_first_and_a_batch_comes_in_order() {
        let superseded = [message("m1", "one"), message("m2", "two")];
        let (state, sent) = run(&JsonMap::new(), message("m3", "three"), &superseded, &[]).await;
        assert_eq!(sent, [answer_all(&["one", "two", "three"], 1)]);
        assert!(sent[0].starts_with("You said \"one\", \"two\" and \"three\"."));
        let users: Vec<Message> = transcript(&state)
            .into_iter()
            .filter(|m| m.role == USER)
            .collect();
        let ids: Vec<Option<&str>> = users.iter().map(|m| m.activity_id.as_deref()).collect();
        assert_eq!(ids, [Some("m1"), Some("m2"), Some("m3")]);
        assert_eq!(
            transcript(&state)[3].text,
            "three",
            "the tool is asked about the latest"
        );

        // The batch holds the turn's own message: it is not added twice.
        let batch = [message("m4", "four"), message("m5", "five")];
        let (state, sent) = run(&state, message("m4", "four"), &[], &batch).await;
        assert_eq!(sent, [answer_all(&["four", "five"], 2)]);
        let roles: Vec<String> = transcript(&state).into_iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                USER,
                USER,
                USER,
                TOOL_USE,
                TOOL_RESULT,
                ASSISTANT,
                USER,
                USER,
                TOOL_USE,
                TOOL_RESULT,
                ASSISTANT
            ]
        );
        assert_eq!(transcript(&state)[7].activity_id.as_deref(), Some("m5"));
    }

    #[tokio::test]
    async fn a_transcript_from_before_the_tool_call_reads_and_counts() {
        let mut old = JsonMap::new();
        old.insert(
            TRANSCRIPT.into(),
            json!([
                {"role": "user", "text": "hello"},
                {"role": "assistant", "text": answer("hello", 1)},
            ]),
        );
        let (state, sent) = run(&old, message("m2", "again"), &[], &[]).await;
        assert_eq!(sent, [answer("again", 2)]);
        let entries = transcript(&state);
        assert_eq!(entries.len(), 6);
        assert_eq!(entries[0].activity_id, None);
        // Entries keep their shape: no empty fields are written for what they do not have.
        assert_eq!(
            state[TRANSCRIPT][0],
            json!({"role": "user", "text": "hello"})
        );
    }

    #[tokio::test]
    async fn the_drafts_are_a_status_line_then_the_growing_answer() {
        let incoming = IncomingActivity::parse(message("m1", "hello")).expect("valid");
        let (drafts, mut events) = Drafts::channel(256, 4096);
        let mut turn = TurnContext::new(
            &incoming,
            1,
            ScopeState::new(Scope::Conversation, JsonMap::new()),
            None,
            None,
        )
        .with_drafts(Some(&drafts));
        LlmBot::new(Duration::ZERO)
            .on_turn(&mut turn)
            .await
            .expect("the turn");
        let (_, sent) = turn.finish();
        let mut shown = Vec::new();
        while let Ok(DraftEvent::Draft { kind, text, .. }) = events.try_recv() {
            shown.push((kind, text));
        }
        assert_eq!(shown[0], (DraftKind::Informative, "Thinking…".to_owned()));
        let answer = answer("hello", 1);
        assert_eq!(shown.len(), 1 + answer.split_inclusive(' ').count());
        assert!(
            shown[1..]
                .iter()
                .all(|(kind, text)| *kind == DraftKind::Text && answer.starts_with(text.as_str()))
        );
        assert_eq!(shown.last().map(|(_, text)| text), Some(&answer));
        assert_eq!(sent[0].text.as_deref(), Some(answer.as_str()));
    }

    #[tokio::test]
    async fn other_activities_leave_the_transcript_alone() {
        let typing = Activity {
            activity_type: Some(types::TYPING.to_owned()),
            text: None,
            ..message("t1", "")
        };
        let (state, sent) = run(&JsonMap::new(), typing, &[], &[]).await;
        assert!(sent.is_empty());
        assert!(!state.contains_key(TRANSCRIPT));
    }
}
