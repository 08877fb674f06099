//! A bot of your own, served by Turnstile as a library: the same engine, stores, health service
//! and flags as the `turnstile` binary, without forking it.
//!
//! ```text
//! cargo run --example hello_bot -- --listen 127.0.0.1:50051 [--database-url postgres://…]
//! ```
//!
//! The bot asks for the user's name once (a text prompt on the dialog stack) and remembers it in
//! user state, so it greets them by name in every later conversation.

use async_trait::async_trait;
use clap::Parser;
use turnstile::activity::types;
use turnstile::config::ServeArgs;
use turnstile::dialogs::{DialogSet, PromptOptions, TextPrompt, WaterfallDialog};
use turnstile::{Bot, BotError, BotRegistry, TurnContext};

/// Greets the user, by name once it knows it.
struct HelloBot {
    dialogs: DialogSet,
}

impl HelloBot {
    fn new() -> Self {
        let ask_name = WaterfallDialog::new("ask-name")
            .step(|step| {
                Box::pin(async move {
                    step.prompt("name", PromptOptions::new("Hello! What's your name?"))
                })
            })
            .step(|step| {
                Box::pin(async move {
                    let name: String = step.result()?.unwrap_or_default();
                    step.turn().user_state()?.set("name", &name)?;
                    step.send_text(format!("Nice to meet you, {name}."));
                    step.end()
                })
            });
        Self {
            dialogs: DialogSet::new()
                .with(ask_name)
                .with(TextPrompt::new("name")),
        }
    }
}

#[async_trait]
impl Bot for HelloBot {
    async fn on_turn(&self, turn: &mut TurnContext<'_>) -> Result<(), BotError> {
        if !turn.activity().is_type(types::MESSAGE) {
            return Ok(());
        }
        match turn.user_state()?.get::<String>("name")? {
            Some(name) => turn.send_text(format!("Welcome back, {name}.")),
            None => {
                self.dialogs.run(turn, "ask-name").await?;
            }
        }
        Ok(())
    }
}

/// The bots this server hosts: just the one.
fn bots() -> BotRegistry {
    BotRegistry::new("hello", HelloBot::new())
}

/// `turnstile serve`'s flags (and their environment variables), for our own binary.
#[derive(Debug, Parser)]
#[command(name = "hello_bot")]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let listener = tokio::net::TcpListener::bind(cli.serve.listen).await?;
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    turnstile::serve(cli.serve.config(), bots(), listener, shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile::grpc::pb;
    use turnstile::grpc::pb::turn_service_client::TurnServiceClient;

    fn message(user: &str, conversation: &str, text: &str) -> pb::Activity {
        pb::Activity {
            r#type: Some("message".into()),
            id: Some(format!("{conversation}-{text}")),
            channel_id: Some("test".into()),
            conversation: Some(pb::ConversationAccount {
                id: Some(conversation.into()),
                ..Default::default()
            }),
            from: Some(pb::ChannelAccount {
                id: Some(user.into()),
                ..Default::default()
            }),
            text: Some(text.into()),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn asks_for_the_name_once_and_remembers_it_across_conversations() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let addr = listener.local_addr().expect("bound");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(turnstile::serve(
            turnstile::Config::default(),
            bots(),
            listener,
            async {
                let _ = stopped.await;
            },
        ));
        let mut client = loop {
            if let Ok(client) = TurnServiceClient::connect(format!("http://{addr}")).await {
                break client;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        let mut say = async |conversation: &str, text: &str| -> Vec<String> {
            let request = pb::ProcessTurnRequest::typed(message("ada", conversation, text), "");
            let response = client.process_turn(request).await.expect("a turn");
            response
                .into_inner()
                .activities
                .into_iter()
                .filter_map(|a| a.text)
                .collect()
        };

        assert_eq!(say("c1", "hi").await, ["Hello! What's your name?"]);
        assert_eq!(say("c1", "Ada").await, ["Nice to meet you, Ada."]);
        assert_eq!(say("c2", "hi again").await, ["Welcome back, Ada."]);

        stop.send(()).expect("the server is running");
        server.await.expect("joined").expect("a clean shutdown");
    }
}
