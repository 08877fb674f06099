//! Who is calling Direct Line, and the tokens that say so: every route asks [`DirectLine::caller`]
//! first, so that a credential is checked in one place.
//!
//! Tokens are HS256 JWTs signed with the (first) Direct Line secret, each bound to one
//! conversation and expiring after [`TOKEN_LIFETIME`]; a client holding a token reaches only its
//! conversation, a client holding a secret reaches any. Without a secret and without an app id
//! (development) no credential is needed and tokens are signed with a key made at start.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use rand::Rng as _;
use serde::{Deserialize, Serialize};
use serde_json::json;
use subtle::ConstantTimeEq as _;

use super::transcript::requested_user;
use super::{DirectLine, DirectLineError};
use crate::gateway::config::Secret;

/// How long a token is valid; clients refresh it before (`botframework-directlinejs` every 15
/// minutes), as Direct Line's own tokens last 30 minutes.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(30 * 60);
/// The issuer and audience of this gateway's tokens.
const TOKEN_ISSUER: &str = "turnstile-directline";

/// Who may use Direct Line.
#[derive(Debug)]
pub(super) enum Keys {
    /// Callers present one of these secrets, or a token signed with the first.
    Secrets(Vec<Secret>),
    /// Development: open; tokens are still issued (clients expect them), signed with this key.
    Development(Vec<u8>),
}

impl Keys {
    /// `secrets`, or a development key made now when there are none.
    pub(super) fn new(secrets: Vec<Secret>) -> Self {
        if secrets.is_empty() {
            let mut key = vec![0u8; 32];
            rand::rng().fill(&mut key[..]);
            Self::Development(key)
        } else {
            Self::Secrets(secrets)
        }
    }
}

/// A token's claims: the conversation it opens and the user it speaks for.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Claims {
    iss: String,
    aud: String,
    /// The conversation.
    pub(super) conv: String,
    /// The user's id, which the token's holder posts as.
    pub(super) user: String,
    iat: u64,
    nbf: u64,
    exp: u64,
}

/// Who is calling.
pub(super) enum Caller {
    /// A holder of a Direct Line secret, or anyone in development: any conversation.
    Trusted,
    /// A holder of a token: its conversation only.
    Token(Claims),
}

impl DirectLine {
    fn signing_key(&self) -> &[u8] {
        match &self.keys {
            Keys::Secrets(secrets) => secrets.first().map_or(&[][..], |s| s.expose().as_bytes()),
            Keys::Development(key) => key,
        }
    }

    /// The caller the `Authorization` header names.
    pub(super) fn caller(&self, headers: &HeaderMap) -> Result<Caller, DirectLineError> {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|h| h.to_str().ok())
            .and_then(|h| {
                h.strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let Some(bearer) = bearer else {
            return if self.is_open() {
                Ok(Caller::Trusted)
            } else {
                Err(DirectLineError::MissingCredentials)
            };
        };
        if let Keys::Secrets(secrets) = &self.keys
            && secrets
                .iter()
                .any(|s| bool::from(s.expose().as_bytes().ct_eq(bearer.as_bytes())))
        {
            return Ok(Caller::Trusted);
        }
        match self.verify(bearer) {
            Ok(claims) => Ok(Caller::Token(claims)),
            // In development a stale token (from before a restart) is no reason to refuse.
            Err(_) if self.is_open() => Ok(Caller::Trusted),
            Err(e) => Err(e),
        }
    }

    fn verify(&self, token: &str) -> Result<Claims, DirectLineError> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_issuer(&[TOKEN_ISSUER]);
        validation.set_audience(&[TOKEN_ISSUER]);
        validation.leeway = 30;
        let keys: Vec<&[u8]> = match &self.keys {
            Keys::Secrets(secrets) => secrets.iter().map(|s| s.expose().as_bytes()).collect(),
            Keys::Development(key) => vec![key],
        };
        let mut expired = false;
        for key in keys {
            match jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(key), &validation)
            {
                Ok(data) => return Ok(data.claims),
                Err(e) if *e.kind() == jsonwebtoken::errors::ErrorKind::ExpiredSignature => {
                    expired = true;
                }
                Err(_) => {}
            }
        }
        Err(if expired {
            DirectLineError::TokenExpired
        } else {
            DirectLineError::Forbidden
        })
    }

    /// A token for `user_id` in `conversation_id`, valid for [`TOKEN_LIFETIME`].
    pub(super) fn token(
        &self,
        conversation_id: &str,
        user_id: &str,
    ) -> Result<String, DirectLineError> {
        let now = unix_now();
        let claims = Claims {
            iss: TOKEN_ISSUER.to_owned(),
            aud: TOKEN_ISSUER.to_owned(),
            conv: conversation_id.to_owned(),
            user: user_id.to_owned(),
            iat: now,
            nbf: now,
            exp: now + TOKEN_LIFETIME.as_secs(),
        };
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(self.signing_key()),
        )
        .map_err(DirectLineError::Signing)
    }

    /// `conversation_id`'s user, when the conversation exists and `caller` may use it.
    pub(super) fn authorize(
        &self,
        caller: &Caller,
        conversation_id: &str,
    ) -> Result<String, DirectLineError> {
        if let Caller::Token(claims) = caller
            && claims.conv != conversation_id
        {
            return Err(DirectLineError::Forbidden);
        }
        self.user_of(conversation_id)
    }
}

#[tracing::instrument(skip_all)]
pub(super) async fn generate(
    State(dl): State<Arc<DirectLine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, DirectLineError> {
    let Caller::Trusted = dl.caller(&headers)? else {
        // A token cannot mint tokens: that would extend it forever to other conversations.
        return Err(DirectLineError::Forbidden);
    };
    let (conversation_id, user_id) = dl.start(requested_user(&body));
    let token = dl.token(&conversation_id, &user_id)?;
    Ok(axum::Json(json!({
        "conversationId": conversation_id,
        "token": token,
        "expires_in": TOKEN_LIFETIME.as_secs(),
    }))
    .into_response())
}

#[tracing::instrument(skip_all)]
pub(super) async fn refresh(
    State(dl): State<Arc<DirectLine>>,
    headers: HeaderMap,
) -> Result<Response, DirectLineError> {
    let Caller::Token(claims) = dl.caller(&headers)? else {
        return Err(DirectLineError::Forbidden);
    };
    // A forgotten conversation's token is not renewed: the 404 ends the client's refresh loop.
    dl.user_of(&claims.conv)?;
    let token = dl.token(&claims.conv, &claims.user)?;
    Ok(axum::Json(json!({
        "conversationId": claims.conv,
        "token": token,
        "expires_in": TOKEN_LIFETIME.as_secs(),
    }))
    .into_response())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
