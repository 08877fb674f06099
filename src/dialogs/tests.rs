//! The dialog stack's behaviour, turn by turn, over a conversation state kept between turns the
//! way the engine keeps it.

use serde_json::json;

use super::*;
use crate::activity::incoming::IncomingActivity;
use crate::activity::{Activity, ChannelAccount, ConversationAccount};
use crate::state::{Scope, ScopeState};

/// A conversation with one bot's dialogs: runs turns and keeps the conversation state.
struct Conversation {
    dialogs: DialogSet,
    state: JsonMap,
}

fn message(text: &str) -> IncomingActivity {
    IncomingActivity::parse(Activity {
        id: Some("a1".into()),
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
    })
    .expect("a valid message")
}

impl Conversation {
    fn new(dialogs: DialogSet) -> Self {
        Self {
            dialogs,
            state: JsonMap::new(),
        }
    }

    /// One turn through [`DialogSet::run`] with root dialog `root`: what the bot said.
    async fn say(&mut self, text: &str) -> (Vec<String>, DialogTurnResult) {
        let incoming = message(text);
        let mut turn = TurnContext::new(
            &incoming,
            1,
            ScopeState::new(Scope::Conversation, self.state.clone()),
            Some(ScopeState::new(Scope::User, JsonMap::new())),
            None,
        );
        let result = self.dialogs.run(&mut turn, "root").await.expect("turn");
        let (scopes, sent) = turn.finish();
        self.state = scopes.conversation.into_properties();
        let texts = sent.into_iter().filter_map(|a| a.text).collect();
        (texts, result)
    }

    async fn replies(&mut self, text: &str) -> Vec<String> {
        self.say(text).await.0
    }

    fn stack_ids(&self) -> Vec<String> {
        self.state
            .get(DIALOG_STATE)
            .and_then(|state| state.get(DIALOG_STACK))
            .and_then(Value::as_array)
            .map(|stack| {
                stack
                    .iter()
                    .filter_map(|i| i["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn say(text: &'static str) -> WaterfallDialog {
    WaterfallDialog::new(text).step(move |step| {
        Box::pin(async move {
            step.send_text(text);
            step.wait()
        })
    })
}

#[tokio::test]
async fn a_child_runs_on_top_and_its_parent_resumes_with_its_result() {
    let child = WaterfallDialog::new("child")
        .step(|step| {
            Box::pin(async move {
                step.send_text("child asks");
                step.wait()
            })
        })
        .step(|step| {
            Box::pin(async move {
                let answer: String = step.result()?.unwrap_or_default();
                step.end_with(&format!("child got {answer}"))
            })
        });
    let root = WaterfallDialog::new("root")
        .step(|step| Box::pin(async move { step.begin("child") }))
        .step(|step| {
            Box::pin(async move {
                let result: String = step.result()?.unwrap_or_default();
                step.send_text(format!("root resumed: {result}"));
                step.end_with(&42)
            })
        });
    let mut conversation = Conversation::new(DialogSet::new().with(root).with(child));

    let (sent, result) = conversation.say("hi").await;
    assert_eq!(sent, ["child asks"]);
    assert_eq!(result.status, DialogTurnStatus::Waiting);
    assert_eq!(conversation.stack_ids(), ["child", "root"], "active first");

    let (sent, result) = conversation.say("blue").await;
    assert_eq!(sent, ["root resumed: child got blue"]);
    assert_eq!(result.status, DialogTurnStatus::Complete);
    assert_eq!(result.result_as::<i32>().expect("a number"), Some(42));
    assert!(
        !conversation.state.contains_key(DIALOG_STATE),
        "a finished conversation leaves no dialog state"
    );

    let (sent, _) = conversation.say("again").await;
    assert_eq!(sent, ["child asks"], "the next message starts over");
}

#[tokio::test]
async fn the_stack_is_stored_in_bot_framework_shape() {
    let root = WaterfallDialog::new("root")
        .step(|step| {
            Box::pin(async move {
                step.set_value("name", "Ada")?;
                step.prompt("ask", PromptOptions::new("Age?"))
            })
        })
        .step(|step| Box::pin(async move { step.end() }));
    let mut conversation = Conversation::new(
        DialogSet::new()
            .with(root)
            .with(NumberPrompt::<i64>::new("ask")),
    );
    conversation.say("hi").await;
    assert_eq!(
        Value::Object(conversation.state.clone()),
        json!({"DialogState": {"dialogStack": [
            {"id": "ask", "state": {"options": {"prompt": "Age?"}, "state": {"attemptCount": 0}}},
            {"id": "root", "state": {"values": {"name": "Ada"}, "stepIndex": 0}},
        ]}})
    );
}

#[tokio::test]
async fn next_runs_the_following_step_in_the_same_turn() {
    let root = WaterfallDialog::new("root")
        .step(|step| Box::pin(async move { step.next_with("carried") }))
        .step(|step| {
            Box::pin(async move {
                let carried: String = step.result()?.unwrap_or_default();
                step.send_text(format!("{carried} at step {}", step.index()));
                assert_eq!(step.reason(), DialogReason::NextCalled);
                step.wait()
            })
        });
    let mut conversation = Conversation::new(DialogSet::new().with(root));
    assert_eq!(conversation.replies("hi").await, ["carried at step 1"]);
    let (sent, result) = conversation.say("hi").await;
    assert!(sent.is_empty());
    assert_eq!(
        result.status,
        DialogTurnStatus::Complete,
        "after the last step"
    );
}

#[tokio::test]
async fn cancel_all_empties_a_nested_stack_and_ends_every_dialog() {
    let child = WaterfallDialog::new("child")
        .step(|step| {
            Box::pin(async move {
                step.send_text("in child");
                step.wait()
            })
        })
        .step(|step| {
            Box::pin(async move {
                if step.result::<String>()?.as_deref() == Some("cancel") {
                    return step.cancel_all();
                }
                step.end()
            })
        });
    let root = WaterfallDialog::new("root")
        .step(|step| Box::pin(async move { step.begin("child") }))
        .step(|step| {
            Box::pin(async move {
                step.send_text("root must not resume");
                step.end()
            })
        });
    let mut conversation = Conversation::new(DialogSet::new().with(root).with(child));
    conversation.say("hi").await;
    assert_eq!(conversation.stack_ids(), ["child", "root"]);
    let (sent, result) = conversation.say("cancel").await;
    assert!(sent.is_empty(), "{sent:?}");
    assert_eq!(result.status, DialogTurnStatus::Cancelled);
    assert!(conversation.stack_ids().is_empty());
}

#[tokio::test]
async fn replace_swaps_the_active_dialog_without_resuming_the_parent() {
    let first = WaterfallDialog::new("first").step(|step| {
        Box::pin(async move {
            step.send_text("first");
            step.replace("second")
        })
    });
    let root = WaterfallDialog::new("root")
        .step(|step| Box::pin(async move { step.begin("first") }))
        .step(|step| {
            Box::pin(async move {
                step.send_text("root resumed");
                step.wait()
            })
        });
    let mut conversation =
        Conversation::new(DialogSet::new().with(root).with(first).with(say("second")));
    assert_eq!(conversation.replies("hi").await, ["first", "second"]);
    assert_eq!(conversation.stack_ids(), ["second", "root"]);
    assert_eq!(
        conversation.replies("hi").await,
        ["root resumed"],
        "the replacement's end resumes the parent"
    );
}

#[tokio::test]
async fn a_context_replaces_and_cancels_directly() {
    let dialogs = DialogSet::new().with(say("a")).with(say("b"));
    let incoming = message("hi");
    let mut turn = TurnContext::new(
        &incoming,
        1,
        ScopeState::new(Scope::Conversation, JsonMap::new()),
        None,
        None,
    );
    let mut dc = dialogs.context(&mut turn).expect("context");
    assert_eq!(
        dc.continue_dialog().await.expect("continue").status,
        DialogTurnStatus::Empty
    );
    dc.begin_dialog("a", None).await.expect("begin a");
    dc.replace_dialog("b", None).await.expect("replace");
    assert_eq!(dc.stack().len(), 1);
    assert_eq!(dc.active_dialog().map(|d| d.id.as_str()), Some("b"));
    dc.begin_dialog("a", None).await.expect("begin a on b");
    assert_eq!(dc.stack().len(), 2);
    let cancelled = dc.cancel_all_dialogs().await.expect("cancel");
    assert_eq!(cancelled.status, DialogTurnStatus::Cancelled);
    assert!(dc.stack().is_empty());
    assert!(matches!(
        dc.begin_dialog("nope", None).await,
        Err(DialogError::UnknownDialog(id)) if id == "nope"
    ));
    drop(dc);
    let (_, sent) = turn.finish();
    let texts: Vec<_> = sent.iter().filter_map(|a| a.text.as_deref()).collect();
    assert_eq!(texts, ["a", "b", "a"]);
}

#[tokio::test]
async fn a_component_keeps_its_own_stack_and_ends_with_its_result() {
    let inner = WaterfallDialog::new("inner")
        .step(|step| Box::pin(async move { step.prompt("name", PromptOptions::new("Your name?")) }))
        .step(|step| {
            Box::pin(async move {
                let name: String = step.result()?.unwrap_or_default();
                step.end_with(&name)
            })
        });
    let component = ComponentDialog::new("profile", inner).with(TextPrompt::new("name"));
    let root = WaterfallDialog::new("root")
        .step(|step| Box::pin(async move { step.begin("profile") }))
        .step(|step| {
            Box::pin(async move {
                let name: String = step.result()?.unwrap_or_default();
                step.send_text(format!("Hello {name}"));
                step.end()
            })
        });
    let mut conversation = Conversation::new(DialogSet::new().with(root).with(component));
    assert_eq!(conversation.replies("hi").await, ["Your name?"]);
    assert_eq!(conversation.stack_ids(), ["profile", "root"]);
    let inner_ids: Vec<&str> =
        conversation.state[DIALOG_STATE][DIALOG_STACK][0]["state"]["dialogs"]["dialogStack"]
            .as_array()
            .expect("the inner stack")
            .iter()
            .filter_map(|i| i["id"].as_str())
            .collect();
    assert_eq!(inner_ids, ["name", "inner"]);
    assert_eq!(conversation.replies("Ada").await, ["Hello Ada"]);
    assert!(conversation.stack_ids().is_empty());
}

#[tokio::test]
async fn prompts_retry_count_attempts_and_let_validators_speak() {
    let root = WaterfallDialog::new("root")
        .step(|step| {
            Box::pin(async move {
                step.prompt(
                    "even",
                    PromptOptions::new("An even number?").retry_prompt("Even, please."),
                )
            })
        })
        .step(|step| {
            Box::pin(async move {
                let n: i64 = step.result()?.unwrap_or_default();
                step.send_text(format!("got {n}"));
                step.end()
            })
        });
    let prompt = NumberPrompt::<i64>::new("even").validator(|ctx| {
        if ctx.attempt_count() == 3 {
            ctx.turn().send_text("Last try!");
        }
        ctx.recognized().is_some_and(|n| n % 2 == 0)
    });
    let mut conversation = Conversation::new(DialogSet::new().with(root).with(prompt));
    assert_eq!(conversation.replies("hi").await, ["An even number?"]);
    assert_eq!(conversation.replies("three").await, ["Even, please."]);
    assert_eq!(conversation.replies("what?").await, ["Even, please."]);
    assert_eq!(
        conversation.replies("5").await,
        ["Last try!"],
        "a validator that replies replaces the retry prompt"
    );
    assert_eq!(
        conversation.state[DIALOG_STATE][DIALOG_STACK][0]["state"]["state"]["attemptCount"],
        json!(3)
    );
    assert_eq!(conversation.replies("twenty-two").await, ["got 22"]);
}

#[tokio::test]
async fn non_message_activities_leave_a_prompt_waiting() {
    let dialogs = DialogSet::new().with(TextPrompt::new("root"));
    let mut conversation = Conversation::new(dialogs);
    // `run` begins the root on an empty stack; the prompt has no text to send.
    let (_, result) = conversation.say("hi").await;
    assert_eq!(result.status, DialogTurnStatus::Waiting);
    let update = IncomingActivity::parse(Activity {
        activity_type: Some("conversationUpdate".into()),
        channel_id: Some("test".into()),
        conversation: Some(ConversationAccount {
            id: Some("c1".into()),
            ..Default::default()
        }),
        ..Activity::default()
    })
    .expect("valid");
    let mut turn = TurnContext::new(
        &update,
        1,
        ScopeState::new(Scope::Conversation, conversation.state.clone()),
        None,
        None,
    );
    let result = conversation
        .dialogs
        .run(&mut turn, "root")
        .await
        .expect("turn");
    assert_eq!(result.status, DialogTurnStatus::Waiting);
    assert_eq!(
        conversation.replies("  some text ").await,
        Vec::<String>::new()
    );
}

#[tokio::test]
async fn a_stack_naming_an_unknown_dialog_fails_the_turn() {
    let mut conversation = Conversation::new(DialogSet::new().with(say("root")));
    conversation.state.insert(
        DIALOG_STACK.into(),
        json!([{"id": "removed-in-the-last-deploy", "state": {}}]),
    );
    let incoming = message("hi");
    let mut turn = TurnContext::new(
        &incoming,
        1,
        ScopeState::new(Scope::Conversation, conversation.state.clone()),
        None,
        None,
    );
    let err = conversation
        .dialogs
        .run(&mut turn, "root")
        .await
        .expect_err("unknown dialog");
    assert!(
        err.to_string().contains("removed-in-the-last-deploy"),
        "{err}"
    );
}

#[tokio::test]
async fn two_sets_bound_to_two_properties_keep_two_stacks() {
    let asks = |id: &'static str| {
        WaterfallDialog::new("root")
            .step(move |step| Box::pin(async move { step.prompt(id, PromptOptions::new(id)) }))
            .step(|step| Box::pin(async move { step.end() }))
    };
    let profile = DialogSet::bound_to("profile")
        .with(asks("name"))
        .with(TextPrompt::new("name"));
    let order = DialogSet::new()
        .with(asks("size"))
        .with(TextPrompt::new("size"));
    let incoming = message("hi");
    let mut turn = TurnContext::new(
        &incoming,
        1,
        ScopeState::new(Scope::Conversation, JsonMap::new()),
        None,
        None,
    );
    profile.run(&mut turn, "root").await.expect("profile turn");
    order.run(&mut turn, "root").await.expect("order turn");
    let (scopes, _) = turn.finish();
    let state = scopes.conversation.into_properties();
    assert_eq!(state["profile"][DIALOG_STACK][0]["id"], "name");
    assert_eq!(state[DIALOG_STATE][DIALOG_STACK][0]["id"], "size");
}

#[tokio::test]
async fn a_stack_in_the_old_top_level_place_is_taken_and_moved() {
    let mut conversation = Conversation::new(
        DialogSet::new()
            .with(say("root"))
            .with(TextPrompt::new("unused")),
    );
    conversation.state.insert(
        DIALOG_STACK.into(),
        json!([{"id": "root", "state": {"values": {}, "stepIndex": 0}}]),
    );
    // The waterfall resumes past its only step and ends: the stack came from the old place.
    let (sent, result) = conversation.say("hi").await;
    assert!(sent.is_empty(), "{sent:?}");
    assert_eq!(result.status, DialogTurnStatus::Complete);
    assert!(!conversation.state.contains_key(DIALOG_STACK), "moved out");
    assert_eq!(conversation.replies("again").await, ["root"]);
    assert_eq!(conversation.stack_ids(), ["root"], "now in DialogState");
    assert!(!conversation.state.contains_key(DIALOG_STACK));
}
