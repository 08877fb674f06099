//! Channel JWTs: who may call `/api/messages`.
//!
//! A Bot Framework channel signs every call with a JWT whose signing keys it publishes through
//! OpenID metadata (`jwks_uri`). A call is accepted only when its token is RS256-signed by a
//! published key (endorsed for the activity's channel, when the key says), names this app as its
//! audience and a known issuer, has not expired (five minutes of clock skew allowed, as the Bot
//! Framework SDKs do), and carries a `serviceurl` claim equal to the activity's `serviceUrl` —
//! otherwise anyone holding one valid token could make the bot post to a URL of their choosing
//! with the bot's own credentials.
//!
//! Keys are cached per authority and fetched again when a token names a key not in the cache
//! (channels rotate keys without notice) or the cache is a day old. A flood of unknown key ids
//! causes at most one fetch per [`MIN_REFRESH_INTERVAL`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use tokio::sync::Mutex;

use super::config::{AppCredentials, AppType};

/// Clock skew allowed on `exp` and `nbf`, in seconds (the Bot Framework SDKs allow five minutes).
pub const CLOCK_SKEW_SECS: u64 = 5 * 60;
/// How long fetched keys are used before they are fetched again anyway.
const KEYS_MAX_AGE: Duration = Duration::from_secs(24 * 60 * 60);
/// The least time between two fetches of one authority's keys.
pub const MIN_REFRESH_INTERVAL: Duration = Duration::from_secs(30);

/// Why a call is refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer …` header.
    #[error("no bearer token")]
    MissingToken,
    /// The token's header is unreadable, not RS256, or names no key id.
    #[error("the token is malformed: {0}")]
    Malformed(String),
    /// No authority publishes the token's key.
    #[error("the token's signing key `{0}` is not published")]
    UnknownKey(String),
    /// Signature, audience, issuer or expiry is wrong.
    #[error("the token is not valid: {0}")]
    Invalid(#[from] jsonwebtoken::errors::Error),
    /// The signing key is not endorsed for the activity's channel.
    #[error("the signing key is not endorsed for channel `{0}`")]
    NotEndorsed(String),
    /// The token's `serviceurl` claim is not the activity's `serviceUrl`.
    #[error("the token's serviceurl claim does not match the activity's serviceUrl")]
    ServiceUrlMismatch,
    /// The signing keys could not be fetched: the caller may retry, nothing is wrong with it.
    #[error("fetching signing keys from {url} failed: {reason}")]
    KeysUnavailable {
        /// The metadata or key set URL.
        url: String,
        /// Why.
        reason: String,
    },
}

/// A key a token may be signed with.
struct SigningKey {
    key: DecodingKey,
    /// The channels the key is endorsed for; `None` when the key set does not say.
    endorsements: Option<Vec<String>>,
}

#[derive(Default)]
struct KeySet {
    keys: HashMap<String, std::sync::Arc<SigningKey>>,
    fetched: Option<Instant>,
}

/// Where tokens of some issuers come from, and the keys they are signed with.
struct Authority {
    metadata_url: String,
    issuers: Vec<String>,
    keys: Mutex<KeySet>,
}

/// Validates channel tokens for one app.
pub struct ChannelAuth {
    app_id: String,
    authorities: Vec<Authority>,
    http: reqwest::Client,
}

impl std::fmt::Debug for ChannelAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelAuth")
            .field("app_id", &self.app_id)
            .field(
                "authorities",
                &self
                    .authorities
                    .iter()
                    .map(|a| &a.metadata_url)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[derive(Deserialize)]
struct Metadata {
    jwks_uri: String,
}

#[derive(Deserialize)]
struct Jwks {
    keys: Vec<Jwk>,
}

#[derive(Deserialize)]
struct Jwk {
    kid: Option<String>,
    kty: Option<String>,
    n: Option<String>,
    e: Option<String>,
    endorsements: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct Claims {
    serviceurl: Option<String>,
}

impl ChannelAuth {
    /// Validates tokens for `credentials`: the channel's issuer with keys from its OpenID
    /// metadata, and for a single-tenant app also Entra ID's issuers of its tenant.
    pub fn new(credentials: &AppCredentials, http: reqwest::Client) -> Self {
        let mut authorities = vec![Authority::new(
            credentials.openid_metadata_url.clone(),
            vec![credentials.token_issuer.clone()],
        )];
        if let (AppType::SingleTenant, Some(tenant)) =
            (credentials.app_type, &credentials.tenant_id)
        {
            let login = credentials.login_url.trim_end_matches('/');
            authorities.push(Authority::new(
                format!("{login}/v2.0/.well-known/openid-configuration"),
                vec![
                    format!("https://sts.windows.net/{tenant}/"),
                    format!("{login}/v2.0"),
                ],
            ));
        }
        Self {
            app_id: credentials.app_id.clone(),
            authorities,
            http,
        }
    }

    /// Checks the `Authorization` header of a call carrying an activity of `channel_id` from
    /// `service_url`.
    ///
    /// # Errors
    /// [`AuthError`] saying why the call is refused.
    pub async fn check(
        &self,
        authorization: Option<&str>,
        channel_id: &str,
        service_url: &str,
    ) -> Result<(), AuthError> {
        let token = authorization
            .and_then(|h| {
                h.strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(AuthError::MissingToken)?;
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| AuthError::Malformed(e.to_string()))?;
        if header.alg != Algorithm::RS256 {
            return Err(AuthError::Malformed(format!(
                "signed with {:?}, not RS256",
                header.alg
            )));
        }
        let kid = header
            .kid
            .ok_or_else(|| AuthError::Malformed("no key id".into()))?;
        let (authority, key) = self.find_key(&kid).await?;
        let mut validation = Validation::new(Algorithm::RS256);
        validation.leeway = CLOCK_SKEW_SECS;
        validation.set_audience(&[&self.app_id]);
        validation.set_issuer(&authority.issuers);
        validation.set_required_spec_claims(&["exp", "aud", "iss"]);
        let claims = jsonwebtoken::decode::<Claims>(token, &key.key, &validation)?.claims;
        if let Some(endorsed) = &key.endorsements
            && !endorsed.iter().any(|c| c == channel_id)
        {
            return Err(AuthError::NotEndorsed(channel_id.to_owned()));
        }
        if claims.serviceurl.as_deref() != Some(service_url) {
            return Err(AuthError::ServiceUrlMismatch);
        }
        Ok(())
    }

    /// The key `kid` and the authority that published it, fetching keys that are missing.
    async fn find_key(
        &self,
        kid: &str,
    ) -> Result<(&Authority, std::sync::Arc<SigningKey>), AuthError> {
        for authority in &self.authorities {
            if let Some(key) = authority.key(kid, &self.http).await? {
                return Ok((authority, key));
            }
        }
        Err(AuthError::UnknownKey(kid.to_owned()))
    }
}

impl Authority {
    fn new(metadata_url: String, issuers: Vec<String>) -> Self {
        Self {
            metadata_url,
            issuers,
            keys: Mutex::new(KeySet::default()),
        }
    }

    /// The key `kid`, from the cache or, when it is missing or old, from a fresh fetch.
    async fn key(
        &self,
        kid: &str,
        http: &reqwest::Client,
    ) -> Result<Option<std::sync::Arc<SigningKey>>, AuthError> {
        // One lock for lookup and refresh: concurrent calls with a new key wait for one fetch.
        let mut set = self.keys.lock().await;
        let age = set.fetched.map(|at| at.elapsed());
        let fresh = age.is_some_and(|a| a < KEYS_MAX_AGE);
        if fresh && let Some(key) = set.keys.get(kid) {
            return Ok(Some(std::sync::Arc::clone(key)));
        }
        let may_fetch = age.is_none_or(|a| a >= MIN_REFRESH_INTERVAL);
        if may_fetch {
            match self.fetch(http).await {
                Ok(keys) => {
                    *set = KeySet {
                        keys,
                        fetched: Some(Instant::now()),
                    };
                }
                // Stale keys are better than none while the metadata is unreachable.
                Err(e) if !set.keys.is_empty() => {
                    tracing::warn!(error = %e, "refreshing channel signing keys failed");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(set.keys.get(kid).cloned())
    }

    async fn fetch(
        &self,
        http: &reqwest::Client,
    ) -> Result<HashMap<String, std::sync::Arc<SigningKey>>, AuthError> {
        let metadata: Metadata = get_json(http, &self.metadata_url).await?;
        let jwks: Jwks = get_json(http, &metadata.jwks_uri).await?;
        let mut keys = HashMap::new();
        for jwk in jwks.keys {
            let (Some(kid), Some(n), Some(e)) = (jwk.kid, jwk.n, jwk.e) else {
                continue;
            };
            if jwk.kty.as_deref().is_some_and(|k| k != "RSA") {
                continue;
            }
            match DecodingKey::from_rsa_components(&n, &e) {
                Ok(key) => {
                    keys.insert(
                        kid,
                        std::sync::Arc::new(SigningKey {
                            key,
                            endorsements: jwk.endorsements,
                        }),
                    );
                }
                Err(e) => tracing::warn!(%kid, error = %e, "skipping an unreadable signing key"),
            }
        }
        tracing::info!(url = %self.metadata_url, keys = keys.len(), "fetched channel signing keys");
        Ok(keys)
    }
}

async fn get_json<T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    url: &str,
) -> Result<T, AuthError> {
    let unavailable = |reason: String| AuthError::KeysUnavailable {
        url: url.to_owned(),
        reason,
    };
    let response = http
        .get(url)
        .send()
        .await
        .map_err(|e| unavailable(e.to_string()))?
        .error_for_status()
        .map_err(|e| unavailable(e.to_string()))?;
    response
        .json()
        .await
        .map_err(|e| unavailable(e.to_string()))
}
