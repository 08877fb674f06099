//! `AdminService` over gRPC: what an operator needs to see of the state Turnstile keeps — a
//! conversation's and a user's scopes, the recent receipts, a bot's conversations — without SQL
//! against escaped keys, and to erase a user's or a conversation's data. It reads the store
//! directly, past the replica's cache: an operator sees what is stored, not what this replica
//! last guessed. An erasure is the store's one statement ([`Store::erase`]); here it gets its
//! record, and a log line that names no one.
//!
//! Off unless the server has admin tokens, and then only for a caller presenting one of them
//! ([`AdminGate`]): these are not `TurnService`'s tokens, since a gateway that may run turns may
//! not read every user's state.
//!
//! A listing's page token names the key the next page starts after, signed (HMAC-SHA-256, keyed
//! by the admin tokens, so that every replica of a deployment accepts the others' tokens) together
//! with the listing it belongs to: a token changed by hand, or carried to another listing, is
//! refused instead of silently listing from somewhere else.

use std::sync::Arc;
use std::time::SystemTime;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;
use tonic::service::Interceptor;
use tonic::{Request, Response, Status};

use super::auth::{Authenticate, Token};
use super::error::AdminError;
use super::pb;
use crate::activity::incoming::{ChannelId, ConversationId, InvalidActivity, UserId};
use crate::bot::BotRegistry;
use crate::state::{Scope, StateKey};
use crate::store::{Erasure, InspectedRow, Store};

/// Receipts `GetState` returns unless asked.
const DEFAULT_RECEIPTS: usize = 10;
/// The most receipts one `GetState` returns.
const MAX_RECEIPTS: usize = 100;
/// Conversations per page unless asked.
const DEFAULT_PAGE: usize = 100;
/// The most conversations per page.
const MAX_PAGE: usize = 1000;

/// The `AdminService` implementation.
#[derive(Clone)]
pub struct AdminApi {
    store: Arc<dyn Store>,
    bots: BotRegistry,
    gate: AdminGate,
    pages: Arc<hmac::Key>,
}

impl std::fmt::Debug for AdminApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminApi").finish_non_exhaustive()
    }
}

impl AdminApi {
    /// Reads `store` for the bots of `bots`, for callers presenting one of `tokens`, the admin
    /// tokens (none: the service is off); page tokens are signed with a key derived from them.
    pub fn new(store: Arc<dyn Store>, bots: BotRegistry, tokens: Vec<Token>) -> Self {
        let mut secret = b"turnstile admin page tokens".to_vec();
        let mut sorted: Vec<&[u8]> = tokens.iter().map(Token::as_bytes).collect();
        // The same key on every replica given the same tokens, in whatever order.
        sorted.sort_unstable();
        for token in sorted {
            secret.extend_from_slice(&(token.len() as u64).to_be_bytes());
            secret.extend_from_slice(token);
        }
        Self {
            store,
            bots,
            gate: AdminGate::new(tokens),
            pages: Arc::new(hmac::Key::new(hmac::HMAC_SHA256, &secret)),
        }
    }

    /// Lets a call with `metadata` in when the gate does.
    fn admit(&self, metadata: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let call = Request::from_parts(metadata.clone(), Default::default(), ());
        self.gate.clone().call(call).map(drop)
    }

    /// The token of the page after `key` in the listing of `prefix`.
    fn page_token(&self, prefix: &str, key: &str) -> String {
        let tag = hmac::sign(&self.pages, &signed(prefix, key));
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(key),
            URL_SAFE_NO_PAD.encode(tag.as_ref())
        )
    }

    /// The key a page token of the listing of `prefix` starts after.
    fn page_after(&self, prefix: &str, token: &str) -> Result<String, AdminError> {
        let refused = || {
            AdminError::Invalid(InvalidActivity::new(
                "page_token",
                "is not a page token this service issued for this listing",
            ))
        };
        let (key, tag) = token.split_once('.').ok_or_else(refused)?;
        let key = URL_SAFE_NO_PAD.decode(key).map_err(|_| refused())?;
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| refused())?;
        let key = String::from_utf8(key).map_err(|_| refused())?;
        hmac::verify(&self.pages, &signed(prefix, &key), &tag).map_err(|_| refused())?;
        Ok(key)
    }

    async fn get_state(
        &self,
        request: pb::GetStateRequest,
    ) -> Result<pb::GetStateResponse, AdminError> {
        let (bot, _) = self.bots.get(Some(request.bot.as_str()))?;
        let channel = ChannelId::parse(&request.channel_id, "channel_id")?;
        let conversation = ConversationId::parse(&request.conversation_id, "conversation_id")?;
        let receipts = match request.receipts as usize {
            0 => DEFAULT_RECEIPTS,
            n if n > MAX_RECEIPTS => {
                return Err(AdminError::Invalid(InvalidActivity::new(
                    "receipts",
                    format!("is {n}, over the most one call returns ({MAX_RECEIPTS})"),
                )));
            }
            n => n,
        };
        let conversation_key = StateKey::conversation(bot, &channel, &conversation);
        let mut keys = vec![(Scope::Conversation, conversation_key.clone())];
        if !request.user_id.is_empty() {
            let user = UserId::parse(&request.user_id, "user_id")?;
            keys.push((Scope::User, StateKey::user(bot, &channel, &user)));
            keys.push((
                Scope::PrivateConversation,
                StateKey::private_conversation(bot, &channel, &conversation, &user),
            ));
        }
        let names: Vec<StateKey> = keys.iter().map(|(_, key)| key.clone()).collect();
        let under = format!("{}/activities/", conversation_key.as_str());
        let found = self.store.inspect(&names, &under, receipts).await?;
        // In the order asked for: conversation, user, private conversation.
        let scopes = keys
            .iter()
            .filter_map(|(scope, key)| {
                let row = found.rows.iter().find(|row| row.key == *key)?;
                Some(pb::StoredScope {
                    scope: scope_name(*scope).to_owned(),
                    key: key.as_str().to_owned(),
                    state_json: serde_json::to_string(&*row.row.state).unwrap_or_default(),
                    version: row.row.version.get(),
                    updated_at: row.updated_at.map(timestamp),
                })
            })
            .collect();
        let receipts = found
            .receipts
            .into_iter()
            .map(|receipt| pb::StoredReceipt {
                activity_id: receipt.key.parts().pop().unwrap_or_default(),
                payload_json: receipt.payload.text().to_owned(),
                created_at: receipt.created_at.map(timestamp),
            })
            .collect();
        Ok(pb::GetStateResponse { scopes, receipts })
    }

    async fn list_conversations(
        &self,
        request: pb::ListConversationsRequest,
    ) -> Result<pb::ListConversationsResponse, AdminError> {
        let (bot, _) = self.bots.get(Some(request.bot.as_str()))?;
        let channel = ChannelId::parse(&request.channel_id, "channel_id")?;
        // The listing's keys start as the key of a conversation whose id is the prefix: ids are
        // escaped a character at a time, so an id's start escapes to its escaped key's start.
        let prefix = if request.conversation_prefix.is_empty() {
            let any = ConversationId::parse("x", "conversation_prefix")?;
            let key = StateKey::conversation(bot, &channel, &any);
            key.as_str()[..key.as_str().len() - 1].to_owned()
        } else {
            let start = ConversationId::parse(&request.conversation_prefix, "conversation_prefix")?;
            StateKey::conversation(bot, &channel, &start)
                .as_str()
                .to_owned()
        };
        let size = match request.page_size as usize {
            0 => DEFAULT_PAGE,
            n if n > MAX_PAGE => {
                return Err(AdminError::Invalid(InvalidActivity::new(
                    "page_size",
                    format!("is {n}, over the largest page ({MAX_PAGE})"),
                )));
            }
            n => n,
        };
        let after = match request.page_token.as_str() {
            "" => None,
            token => Some(self.page_after(&prefix, token)?),
        };
        let mut rows = self
            .store
            .list_conversations(&prefix, after.as_deref(), size + 1)
            .await?;
        let more = rows.len() > size;
        rows.truncate(size);
        let next_page_token = match (more, rows.last()) {
            (true, Some(last)) => self.page_token(&prefix, last.key.as_str()),
            _ => String::new(),
        };
        Ok(pb::ListConversationsResponse {
            conversations: rows.iter().map(summary).collect(),
            next_page_token,
        })
    }
}

impl AdminApi {
    async fn erase(
        &self,
        erasure: Erasure,
        kind: &'static str,
    ) -> Result<pb::ErasureRecord, AdminError> {
        let started = std::time::Instant::now();
        let erased = self.store.erase(&erasure).await;
        metrics::histogram!(crate::telemetry::metrics::STORE_DURATION, "op" => "erase")
            .record(started.elapsed().as_secs_f64());
        let erased = erased?;
        let erasure_id = format!("{:032x}", rand::random::<u128>());
        let scopes: Vec<pb::ErasedScope> = erased
            .rows
            .iter()
            .map(|(key, version)| pb::ErasedScope {
                bot: key.parts().into_iter().next().unwrap_or_default(),
                scope: erased_scope(key).to_owned(),
                key: key.as_str().to_owned(),
                version: version.get(),
            })
            .collect();
        let count = |name: &str| scopes.iter().filter(|s| s.scope == name).count();
        // The record of it, with no id of the user or the conversation: a log keeps what it is
        // told, and this one must not keep what was erased.
        tracing::info!(
            event = "erasure",
            erasure_id,
            kind,
            bots = scopes
                .iter()
                .map(|s| s.bot.as_str())
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            conversation_scopes = count("conversation"),
            user_scopes = count("user"),
            private_conversation_scopes = count("private_conversation"),
            holds = count("hold"),
            receipts = erased.receipts,
            took_ms = started.elapsed().as_millis(),
            "erased"
        );
        Ok(pb::ErasureRecord {
            erasure_id,
            erased_at: erased.at.map(timestamp),
            scopes,
            receipts: erased.receipts,
        })
    }

    async fn erase_user(
        &self,
        request: pb::EraseUserRequest,
    ) -> Result<pb::ErasureRecord, AdminError> {
        let channel = ChannelId::parse(&request.channel_id, "channel_id")?;
        let user = UserId::parse(&request.user_id, "user_id")?;
        let subject = crate::state::subject(channel.as_str(), user.as_str());
        self.erase(Erasure::User(subject), "user").await
    }

    async fn delete_conversation(
        &self,
        request: pb::DeleteConversationRequest,
    ) -> Result<pb::ErasureRecord, AdminError> {
        let channel = ChannelId::parse(&request.channel_id, "channel_id")?;
        let conversation = ConversationId::parse(&request.conversation_id, "conversation_id")?;
        let subject = crate::state::subject(channel.as_str(), conversation.as_str());
        self.erase(Erasure::Conversation(subject), "conversation")
            .await
    }
}

/// The scope of a key an erasure removed, as the record names it.
fn erased_scope(key: &StateKey) -> &'static str {
    if key.is_hold() {
        "hold"
    } else if key.is_conversation() {
        "conversation"
    } else if key.is_under_conversation() {
        "private_conversation"
    } else {
        "user"
    }
}

/// What a page token signs: the listing's prefix and the key, unambiguously joined.
fn signed(prefix: &str, key: &str) -> Vec<u8> {
    let mut message = (prefix.len() as u64).to_be_bytes().to_vec();
    message.extend_from_slice(prefix.as_bytes());
    message.extend_from_slice(key.as_bytes());
    message
}

fn scope_name(scope: Scope) -> &'static str {
    match scope {
        Scope::Conversation => "conversation",
        Scope::User => "user",
        Scope::PrivateConversation => "private_conversation",
    }
}

/// A listed conversation in brief.
fn summary(row: &InspectedRow) -> pb::ConversationSummary {
    pb::ConversationSummary {
        conversation_id: row.key.parts().pop().unwrap_or_default(),
        version: row.row.version.get(),
        updated_at: row.updated_at.map(timestamp),
        state_bytes: crate::state::json_len(&row.row.state) as u64,
    }
}

fn timestamp(at: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(at)
}

#[tonic::async_trait]
impl pb::admin_service_server::AdminService for AdminApi {
    async fn get_state(
        &self,
        request: Request<pb::GetStateRequest>,
    ) -> Result<Response<pb::GetStateResponse>, Status> {
        self.admit(request.metadata())?;
        let answer = self.get_state(request.into_inner()).await;
        tracing::info!(ok = answer.is_ok(), "admin: state read");
        Ok(Response::new(answer?))
    }

    async fn list_conversations(
        &self,
        request: Request<pb::ListConversationsRequest>,
    ) -> Result<Response<pb::ListConversationsResponse>, Status> {
        self.admit(request.metadata())?;
        let answer = self.list_conversations(request.into_inner()).await;
        tracing::info!(ok = answer.is_ok(), "admin: conversations listed");
        Ok(Response::new(answer?))
    }

    async fn erase_user(
        &self,
        request: Request<pb::EraseUserRequest>,
    ) -> Result<Response<pb::EraseUserResponse>, Status> {
        self.admit(request.metadata())?;
        let record = self.erase_user(request.into_inner()).await?;
        Ok(Response::new(pb::EraseUserResponse {
            record: Some(record),
        }))
    }

    async fn delete_conversation(
        &self,
        request: Request<pb::DeleteConversationRequest>,
    ) -> Result<Response<pb::DeleteConversationResponse>, Status> {
        self.admit(request.metadata())?;
        let record = self.delete_conversation(request.into_inner()).await?;
        Ok(Response::new(pb::DeleteConversationResponse {
            record: Some(record),
        }))
    }
}

/// The admin service's gate: with admin tokens, a call needs one of them; without, the service
/// is off and every call is refused, saying how to turn it on.
#[derive(Debug, Clone)]
struct AdminGate(Option<Authenticate>);

impl AdminGate {
    /// The gate for `tokens`; none turns the service off.
    fn new(tokens: Vec<Token>) -> Self {
        Self((!tokens.is_empty()).then(|| Authenticate::new(tokens)))
    }
}

impl Interceptor for AdminGate {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        match &mut self.0 {
            Some(authenticate) => authenticate.call(request),
            None => Err(Status::unimplemented(
                "the admin service is off on this server: start it with admin tokens \
                 (--admin-tokens-file or TURNSTILE_ADMIN_TOKENS)",
            )),
        }
    }
}
