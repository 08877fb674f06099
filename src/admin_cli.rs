//! `turnstile state`: the admin service from a shell — what an operator types to see a
//! conversation's or a user's state, or a bot's conversations, or to erase a user's or a
//! conversation's data, instead of SQL against escaped keys. It is a client of a running server's `AdminService` (so it sees what every replica
//! sees, with the server's own checks and tokens), and prints JSON: one object for `get`, one
//! line per conversation for `ls`, ready for `jq`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use tonic::metadata::MetadataValue;

use crate::grpc::client::{ClientTls, endpoint};
use crate::grpc::pb;
use crate::grpc::pb::admin_service_client::AdminServiceClient;

/// `turnstile state`.
#[derive(Debug, Args)]
pub struct StateArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: StateCommand,
    /// The server: `http://host:port` for plaintext, `https://host:port` for TLS.
    #[arg(long, global = true, default_value = "http://127.0.0.1:50051")]
    pub address: String,
    /// An admin token of the server (its `--admin-tokens`).
    #[arg(
        long,
        global = true,
        env = "TURNSTILE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// PEM CA certificate(s) the server's certificate must chain to (for `https`).
    #[arg(long, global = true)]
    pub ca_cert: Option<PathBuf>,
    /// Seconds each call may take.
    #[arg(long, global = true, default_value_t = 30)]
    pub timeout_secs: u64,
}

/// `turnstile state <command>`.
#[derive(Debug, Subcommand)]
pub enum StateCommand {
    /// A conversation's state — and, with `--user`, that user's user and private conversation
    /// state — as stored, with its newest receipts.
    Get {
        /// The channel (`msteams`, `directline`, …).
        #[arg(long)]
        channel: String,
        /// The conversation.
        #[arg(long)]
        conversation: String,
        /// A user of it.
        #[arg(long)]
        user: Option<String>,
        /// The bot; the server's default when left out.
        #[arg(long, default_value = "")]
        bot: String,
        /// How many receipts (at most 100).
        #[arg(long, default_value_t = 10)]
        receipts: u32,
    },
    /// A bot's conversations on a channel, one JSON line each, every page.
    Ls {
        /// The channel.
        #[arg(long)]
        channel: String,
        /// Only conversations whose id starts with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// The bot; the server's default when left out.
        #[arg(long, default_value = "")]
        bot: String,
        /// Stop after this many.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Erases a user of a channel, for every bot: their user scope, their private conversation
    /// scopes and the receipts of their activities. Prints the erasure record.
    EraseUser {
        /// The channel.
        #[arg(long)]
        channel: String,
        /// The user (`from.id`).
        #[arg(long)]
        user: String,
    },
    /// Deletes a conversation of a channel, for every bot: its scope, its private scopes, its
    /// hold and its receipts. Prints the erasure record.
    DeleteConversation {
        /// The channel.
        #[arg(long)]
        channel: String,
        /// The conversation.
        #[arg(long)]
        conversation: String,
    },
}

/// What adds the admin token to a call.
type WithToken =
    Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;

/// The admin client, with the admin token on every call.
type Client = AdminServiceClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, WithToken>,
>;

/// Runs `args` against its server, printing the answer to stdout.
///
/// # Errors
/// When the server cannot be reached or refuses the call (its status is in the error).
pub async fn run(args: &StateArgs) -> anyhow::Result<()> {
    let mut client = connect(args).await?;
    match &args.command {
        StateCommand::Get {
            channel,
            conversation,
            user,
            bot,
            receipts,
        } => {
            let state = client
                .get_state(pb::GetStateRequest {
                    bot: bot.clone(),
                    channel_id: channel.clone(),
                    conversation_id: conversation.clone(),
                    user_id: user.clone().unwrap_or_default(),
                    receipts: *receipts,
                })
                .await
                .map_err(status)?
                .into_inner();
            println!("{}", serde_json::to_string_pretty(&state_json(&state))?);
        }
        StateCommand::Ls {
            channel,
            prefix,
            bot,
            limit,
        } => list(&mut client, channel, prefix, bot, *limit).await?,
        StateCommand::EraseUser { channel, user } => {
            let erased = client.erase_user(pb::EraseUserRequest {
                channel_id: channel.clone(),
                user_id: user.clone(),
            });
            print_record(erased.await.map_err(status)?.into_inner().record)?;
        }
        StateCommand::DeleteConversation {
            channel,
            conversation,
        } => {
            let deleted = client.delete_conversation(pb::DeleteConversationRequest {
                channel_id: channel.clone(),
                conversation_id: conversation.clone(),
            });
            print_record(deleted.await.map_err(status)?.into_inner().record)?;
        }
    }
    Ok(())
}

/// The admin client for `args`' server, TLS and token.
async fn connect(args: &StateArgs) -> anyhow::Result<Client> {
    let tls = ClientTls {
        ca_cert: args.ca_cert.clone(),
        ..ClientTls::default()
    };
    let channel = endpoint(&args.address, &tls)?
        .timeout(Duration::from_secs(args.timeout_secs))
        .connect()
        .await
        .with_context(|| format!("connecting to {}", args.address))?;
    let bearer: Option<MetadataValue<_>> = args
        .token
        .as_deref()
        .map(|token| format!("Bearer {token}").parse())
        .transpose()
        .context("the admin token is not a valid header value")?;
    let with_token: WithToken = Box::new(move |mut request: tonic::Request<()>| {
        if let Some(bearer) = &bearer {
            request
                .metadata_mut()
                .insert("authorization", bearer.clone());
        }
        Ok(request)
    });
    Ok(AdminServiceClient::with_interceptor(channel, with_token))
}

/// Prints a bot's conversations on `channel`, one JSON line each, page after page, at most
/// `limit`.
async fn list(
    client: &mut Client,
    channel: &str,
    prefix: &str,
    bot: &str,
    limit: Option<usize>,
) -> anyhow::Result<()> {
    let mut token = String::new();
    let mut printed = 0;
    loop {
        let page = client
            .list_conversations(pb::ListConversationsRequest {
                bot: bot.to_owned(),
                channel_id: channel.to_owned(),
                conversation_prefix: prefix.to_owned(),
                page_size: 0,
                page_token: token,
            })
            .await
            .map_err(status)?
            .into_inner();
        for conversation in &page.conversations {
            if limit.is_some_and(|limit| printed >= limit) {
                return Ok(());
            }
            println!(
                "{}",
                json!({
                    "conversationId": conversation.conversation_id,
                    "version": conversation.version,
                    "updatedAt": conversation.updated_at.as_ref().map(ToString::to_string),
                    "stateBytes": conversation.state_bytes,
                })
            );
            printed += 1;
        }
        if page.next_page_token.is_empty() {
            return Ok(());
        }
        token = page.next_page_token;
    }
}

/// A refused call as an error naming its code and the server's message.
fn status(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", status.code(), status.message())
}

/// Prints an erasure record as JSON.
fn print_record(record: Option<pb::ErasureRecord>) -> anyhow::Result<()> {
    println!(
        "{}",
        serde_json::to_string_pretty(&record_json(record.as_ref()))?
    );
    Ok(())
}

/// An erasure record as JSON.
fn record_json(record: Option<&pb::ErasureRecord>) -> Value {
    let Some(record) = record else {
        return Value::Null;
    };
    json!({
        "erasureId": record.erasure_id,
        "erasedAt": record.erased_at.as_ref().map(ToString::to_string),
        "scopes": record.scopes.iter().map(|scope| json!({
            "bot": scope.bot,
            "scope": scope.scope,
            "key": scope.key,
            "version": scope.version,
        })).collect::<Vec<_>>(),
        "receipts": record.receipts,
    })
}

/// `GetState`'s answer as JSON, each stored JSON text parsed back into its object.
fn state_json(state: &pb::GetStateResponse) -> Value {
    let parsed =
        |text: &str| serde_json::from_str::<Value>(text).unwrap_or(Value::String(text.to_owned()));
    json!({
        "scopes": state.scopes.iter().map(|scope| json!({
            "scope": scope.scope,
            "key": scope.key,
            "version": scope.version,
            "updatedAt": scope.updated_at.as_ref().map(ToString::to_string),
            "state": parsed(&scope.state_json),
        })).collect::<Vec<_>>(),
        "receipts": state.receipts.iter().map(|receipt| json!({
            "activityId": receipt.activity_id,
            "createdAt": receipt.created_at.as_ref().map(ToString::to_string),
            "answer": parsed(&receipt.payload_json),
        })).collect::<Vec<_>>(),
    })
}
