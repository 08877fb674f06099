//! Delivering replies to the channel: the Bot Framework Connector REST API.
//!
//! Each reply is POSTed, in the order the bot sent it, to
//! `{serviceUrl}/v3/conversations/{conversationId}/activities/{replyToId}` (or `…/activities`
//! when it replies to nothing), with a bearer token the gateway gets for its own app id by the
//! client-credentials grant. A 429 or 5xx is retried with backoff (honouring `Retry-After` up to
//! the policy's cap), since the turn has committed and its replies must not be lost; a reply the
//! channel still refuses fails the delivery. A caller that waits (an invoke) is then answered
//! with an error and its redelivery is answered from the turn's receipt and delivered again; a
//! turn in the background, whose channel already has its `202`, can only log and count it.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde::Deserialize;
use tokio::sync::Mutex;

use super::config::{AppCredentials, DeliveryPolicy, Secret};

/// How long before its expiry a cached token is replaced.
const TOKEN_EARLY_RENEWAL: Duration = Duration::from_secs(5 * 60);

/// Why a reply did not reach the channel.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// The channel kept refusing the reply.
    #[error("the channel answered {status} to a reply (after {attempts} attempts)")]
    Refused {
        /// Its last answer.
        status: StatusCode,
        /// How many POSTs were made.
        attempts: u32,
    },
    /// The channel could not be reached.
    #[error("the channel could not be reached (after {attempts} attempts)")]
    Unreachable {
        /// The last error.
        #[source]
        source: reqwest::Error,
        /// How many POSTs were made.
        attempts: u32,
    },
    /// The bot's own token could not be obtained.
    #[error("getting the bot's token from {url} failed: {reason}")]
    Token {
        /// The token endpoint.
        url: String,
        /// Why.
        reason: String,
    },
}

/// Gets and caches the bot's token for the channels (client-credentials grant).
struct TokenSource {
    url: String,
    client_id: String,
    secret: Secret,
    scope: String,
    cached: Mutex<Option<(String, Instant)>>,
}

#[derive(Deserialize)]
struct TokenResponse {
    access_token: String,
    expires_in: Option<u64>,
}

impl TokenSource {
    fn new(credentials: &AppCredentials) -> Self {
        Self {
            url: format!(
                "{}/oauth2/v2.0/token",
                credentials.login_url.trim_end_matches('/')
            ),
            client_id: credentials.app_id.clone(),
            secret: credentials.password.clone(),
            scope: format!("{}/.default", credentials.oauth_scope.trim_end_matches('/')),
            cached: Mutex::new(None),
        }
    }

    /// A token valid for a while yet: the cached one, or a new one.
    async fn token(&self, http: &reqwest::Client) -> Result<String, DeliveryError> {
        let mut cached = self.cached.lock().await;
        if let Some((token, renew_at)) = cached.as_ref()
            && Instant::now() < *renew_at
        {
            return Ok(token.clone());
        }
        let failed = |reason: String| DeliveryError::Token {
            url: self.url.clone(),
            reason,
        };
        let response = http
            .post(&self.url)
            .form(&[
                ("grant_type", "client_credentials"),
                ("client_id", self.client_id.as_str()),
                ("client_secret", self.secret.expose()),
                ("scope", self.scope.as_str()),
            ])
            .send()
            .await
            .map_err(|e| failed(e.to_string()))?
            .error_for_status()
            .map_err(|e| failed(e.to_string()))?;
        let token: TokenResponse = response.json().await.map_err(|e| failed(e.to_string()))?;
        let lifetime = Duration::from_secs(token.expires_in.unwrap_or(3600));
        let renew_at = Instant::now() + lifetime.saturating_sub(TOKEN_EARLY_RENEWAL);
        *cached = Some((token.access_token.clone(), renew_at));
        Ok(token.access_token)
    }

    /// Forgets the cached token, after the channel refused it.
    async fn forget(&self) {
        *self.cached.lock().await = None;
    }
}

/// Posts replies to channels.
pub struct Connector {
    http: reqwest::Client,
    tokens: Option<TokenSource>,
    policy: DeliveryPolicy,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("authenticated", &self.tokens.is_some())
            .field("policy", &self.policy)
            .finish()
    }
}

/// Where one reply goes.
#[derive(Debug, Clone, Copy)]
pub struct ReplyAddress<'a> {
    /// The channel's base URL, from the inbound activity.
    pub service_url: &'a str,
    /// The conversation.
    pub conversation_id: &'a str,
    /// The activity replied to, if any.
    pub reply_to_id: Option<&'a str>,
}

impl ReplyAddress<'_> {
    /// The Connector URL of this reply.
    pub fn url(&self) -> String {
        let base = self.service_url.trim_end_matches('/');
        let conversation = encode_segment(self.conversation_id);
        match self.reply_to_id {
            Some(id) if !id.is_empty() => format!(
                "{base}/v3/conversations/{conversation}/activities/{}",
                encode_segment(id)
            ),
            _ => format!("{base}/v3/conversations/{conversation}/activities"),
        }
    }
}

impl Connector {
    /// A connector sending with `credentials`' token, or with none (local development).
    pub fn new(
        credentials: Option<&AppCredentials>,
        http: reqwest::Client,
        policy: DeliveryPolicy,
    ) -> Self {
        Self {
            http,
            tokens: credentials.map(TokenSource::new),
            policy,
        }
    }

    /// POSTs one reply (`body`, Bot Framework JSON text) to `to`, retrying 429 and 5xx.
    ///
    /// # Errors
    /// [`DeliveryError`] when the channel still refuses it after the policy's attempts.
    pub async fn send(&self, to: ReplyAddress<'_>, body: &str) -> Result<(), DeliveryError> {
        let url = to.url();
        let mut delay = self.policy.base_delay;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut request = self
                .http
                .post(&url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_owned());
            if let Some(tokens) = &self.tokens {
                request = request.bearer_auth(tokens.token(&self.http).await?);
            }
            let last = attempt >= self.policy.attempts;
            match request.send().await {
                Ok(response) if response.status().is_success() => return Ok(()),
                Ok(response) => {
                    let status = response.status();
                    let retryable = status == StatusCode::TOO_MANY_REQUESTS
                        || status.is_server_error()
                        || status == StatusCode::UNAUTHORIZED;
                    if !retryable || last {
                        return Err(DeliveryError::Refused {
                            status,
                            attempts: attempt,
                        });
                    }
                    if status == StatusCode::UNAUTHORIZED
                        && let Some(tokens) = &self.tokens
                    {
                        tokens.forget().await;
                    }
                    let wait = retry_after(&response).unwrap_or(delay);
                    tracing::warn!(%status, attempt, "the channel refused a reply; retrying");
                    super::metrics::delivery_retried("refused");
                    tokio::time::sleep(wait.min(self.policy.max_delay)).await;
                }
                Err(source) => {
                    if last {
                        return Err(DeliveryError::Unreachable {
                            source,
                            attempts: attempt,
                        });
                    }
                    tracing::warn!(error = %source, attempt, "the channel is unreachable; retrying");
                    super::metrics::delivery_retried("unreachable");
                    tokio::time::sleep(delay).await;
                }
            }
            delay = (delay * 2).min(self.policy.max_delay);
        }
    }
}

impl Connector {
    /// POSTs one provisional activity (`body`) to `to`, once: a draft that does not pass is
    /// dropped, since the next one carries the whole text anyway. Answers the id the channel gave
    /// the activity, when it gave one.
    ///
    /// # Errors
    /// [`DeliveryError`] when the channel refused it or could not be reached.
    pub async fn send_draft(
        &self,
        to: ReplyAddress<'_>,
        body: &str,
    ) -> Result<Option<String>, DeliveryError> {
        #[derive(Deserialize)]
        struct Sent {
            id: Option<String>,
        }
        let mut request = self
            .http
            .post(to.url())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_owned());
        if let Some(tokens) = &self.tokens {
            request = request.bearer_auth(tokens.token(&self.http).await?);
        }
        let response = request
            .send()
            .await
            .map_err(|source| DeliveryError::Unreachable {
                source,
                attempts: 1,
            })?;
        let status = response.status();
        if !status.is_success() {
            return Err(DeliveryError::Refused {
                status,
                attempts: 1,
            });
        }
        // An answer without a body (202 {} or nothing) names no id.
        let text = response.text().await.unwrap_or_default();
        Ok(serde_json::from_str::<Sent>(&text)
            .ok()
            .and_then(|sent| sent.id)
            .filter(|id| !id.is_empty()))
    }
}

/// `Retry-After` in seconds, when the channel sent one.
fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let seconds: u64 = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds))
}

/// Percent-encodes one URL path segment as JavaScript's `encodeURIComponent` does, the encoding
/// the Bot Framework SDKs use for conversation and activity ids (Teams' hold `:`, `@`, `;`).
fn encode_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.!~*'()".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_urls_encode_ids_like_the_sdks() {
        let to = ReplyAddress {
            service_url: "https://smba.example/emea/",
            conversation_id: "19:abc@thread.skype;messageid=17",
            reply_to_id: Some("1:x/y"),
        };
        assert_eq!(
            to.url(),
            "https://smba.example/emea/v3/conversations/19%3Aabc%40thread.skype%3Bmessageid%3D17\
             /activities/1%3Ax%2Fy"
        );
        let fresh = ReplyAddress {
            reply_to_id: None,
            ..to
        };
        assert!(fresh.url().ends_with("messageid%3D17/activities"));
        assert_eq!(encode_segment("é"), "%C3%A9");
    }
}
