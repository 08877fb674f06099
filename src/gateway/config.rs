//! The gateway's settings, under Bot Framework's own names, so that an existing bot's
//! `MicrosoftAppId`, `MicrosoftAppPassword`, … work unchanged as environment variables.
//!
//! Without `MicrosoftAppId` the gateway runs unauthenticated, as the Bot Framework Emulator and
//! the Agents Playground expect locally; [`GatewayArgs::config`] is where that choice is made,
//! and `serve` warns about it loudly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use secrecy::{ExposeSecret as _, SecretString};
use subtle::ConstantTimeEq as _;

use crate::grpc::client::ClientTls;

/// Bot Framework's public cloud: where channel tokens' signing keys are published.
pub const CHANNEL_OPENID_METADATA_URL: &str =
    "https://login.botframework.com/v1/.well-known/openidconfiguration";
/// Bot Framework's public cloud: the issuer of channel tokens.
pub const CHANNEL_TOKEN_ISSUER: &str = "https://api.botframework.com";
/// Entra ID's public cloud, under which a bot's own tokens are issued.
pub const LOGIN_HOST: &str = "https://login.microsoftonline.com";
/// The tenant multi-tenant bots get their tokens from.
pub const BOT_FRAMEWORK_TENANT: &str = "botframework.com";
/// The audience of a bot's tokens for the channels.
pub const CHANNEL_OAUTH_SCOPE: &str = "https://api.botframework.com";

/// `turnstile gateway`.
#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    /// Address to serve the Bot Framework endpoint (`POST /api/messages`) on.
    #[arg(
        help_heading = "Listen",
        long,
        env = "TURNSTILE_GATEWAY_LISTEN",
        default_value = "127.0.0.1:3978"
    )]
    pub listen: SocketAddr,
    /// Address of a plain-HTTP `GET /metrics` endpoint (Prometheus text), e.g. `0.0.0.0:9091`:
    /// a port of its own, apart from the one channels reach. None when unset.
    #[arg(
        long,
        env = "TURNSTILE_GATEWAY_METRICS_LISTEN",
        help_heading = "Listen"
    )]
    pub metrics_listen: Option<SocketAddr>,
    /// The Turnstile server whose `TurnService` runs the turns.
    #[arg(
        help_heading = "Turnstile server",
        long,
        env = "TURNSTILE_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    pub turnstile_url: String,
    /// The hosted bot that handles the turns; empty selects the server's default bot.
    #[arg(
        help_heading = "Turnstile server",
        long,
        env = "TURNSTILE_BOT",
        default_value = ""
    )]
    pub bot: String,
    /// Bearer token for `TurnService`, when the server requires one.
    #[arg(
        help_heading = "Turnstile server",
        long,
        env = "TURNSTILE_AUTH_TOKEN",
        hide_env_values = true
    )]
    pub turnstile_token: Option<String>,
    /// PEM CA the server's certificate chains to, for an `https://` URL; without it the public
    /// (Mozilla) roots are trusted.
    #[arg(help_heading = "Turnstile server", long, env = "TURNSTILE_CA_CERT")]
    pub turnstile_ca_cert: Option<PathBuf>,
    /// The name the server's certificate carries, when it is not the URL's host.
    #[arg(help_heading = "Turnstile server", long, env = "TURNSTILE_TLS_DOMAIN")]
    pub turnstile_tls_domain: Option<String>,
    /// PEM client certificate for a server that requires mutual TLS (with
    /// `--turnstile-client-key`).
    #[arg(
        help_heading = "Turnstile server",
        long,
        env = "TURNSTILE_CLIENT_CERT",
        requires = "turnstile_client_key"
    )]
    pub turnstile_client_cert: Option<PathBuf>,
    /// The client certificate's PEM key.
    #[arg(
        help_heading = "Turnstile server",
        long,
        env = "TURNSTILE_CLIENT_KEY",
        requires = "turnstile_client_cert"
    )]
    pub turnstile_client_key: Option<PathBuf>,
    /// Milliseconds a turn may take, retries included, when its caller waits for the replies
    /// (`expectReplies`, invokes, Direct Line): channels give up after 15 s, and the replies must
    /// still be delivered within them.
    #[arg(
        help_heading = "Limits",
        long,
        env = "TURNSTILE_GATEWAY_TURN_TIMEOUT_MS",
        default_value_t = 8_000
    )]
    pub turn_timeout_ms: u64,
    /// Milliseconds a turn may take, retries included, when the channel was answered `202` at
    /// once and its replies go through the Connector: the bot's budget, not the channel's.
    #[arg(
        help_heading = "Limits",
        long,
        env = "TURNSTILE_GATEWAY_BOT_TURN_TIMEOUT_MS",
        default_value_t = 120_000
    )]
    pub bot_turn_timeout_ms: u64,
    /// Seconds a graceful shutdown (SIGTERM) waits for the turns running in the background, whose
    /// channels were answered `202` and will not resend them. With the turns of the calls that
    /// wait (`--turn-timeout-ms`) before it, it fits in Kubernetes' default 30 s.
    #[arg(
        help_heading = "Limits",
        long,
        env = "TURNSTILE_GATEWAY_SHUTDOWN_GRACE_SECS",
        default_value_t = 20
    )]
    pub shutdown_grace_secs: u64,
    /// Most turns running in the background at once; past it an activity is answered `503`, which
    /// the channel retries, instead of queueing turns that would retry an overloaded Turnstile.
    #[arg(
        help_heading = "Limits",
        long,
        env = "TURNSTILE_GATEWAY_MAX_BACKGROUND_TURNS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub max_background_turns: u64,
    /// The bot's channel credentials and Direct Line secrets.
    #[command(flatten)]
    pub channel: ChannelArgs,
    /// Serve on an address other than loopback without `MicrosoftAppId`: every call is then
    /// accepted unauthenticated, by anyone who reaches the port (a development cluster only).
    #[arg(long, env = "TURNSTILE_GATEWAY_INSECURE", help_heading = "Security")]
    pub insecure: bool,
}

/// The bot's identity towards the channels, under Bot Framework's own names: read the same way
/// by `turnstile gateway` and by the gateway `turnstile serve` embeds, so that a bot's
/// `MicrosoftAppId` and `MicrosoftAppPassword` are enforced wherever they are set.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Channel credentials (Bot Framework's names)")]
pub struct ChannelArgs {
    /// The bot's app id; without it the gateway accepts unauthenticated calls (local
    /// development only).
    #[arg(long = "microsoft-app-id", env = "MicrosoftAppId")]
    pub app_id: Option<String>,
    /// The app's client secret, for the tokens replies are sent with.
    #[arg(
        long = "microsoft-app-password",
        env = "MicrosoftAppPassword",
        hide_env_values = true
    )]
    pub app_password: Option<String>,
    /// `MultiTenant` (the default) or `SingleTenant`.
    #[arg(long = "microsoft-app-type", env = "MicrosoftAppType")]
    pub app_type: Option<String>,
    /// The app's tenant, required for `SingleTenant`.
    #[arg(long = "microsoft-app-tenant-id", env = "MicrosoftAppTenantId")]
    pub app_tenant_id: Option<String>,
    /// Where the channels' signing keys are published (OpenID metadata).
    #[arg(long, env = "ToBotFromChannelOpenIdMetadataUrl")]
    pub to_bot_from_channel_open_id_metadata_url: Option<String>,
    /// The issuer of channel tokens.
    #[arg(long, env = "ToBotFromChannelTokenIssuer")]
    pub to_bot_from_channel_token_issuer: Option<String>,
    /// The authority the bot's own tokens come from (`…/oauth2/v2.0/token` is appended).
    #[arg(long, env = "ToChannelFromBotLoginUrl")]
    pub to_channel_from_bot_login_url: Option<String>,
    /// The audience of the bot's own tokens (`/.default` is appended).
    #[arg(long, env = "ToChannelFromBotOAuthScope")]
    pub to_channel_from_bot_oauth_scope: Option<String>,
    /// Direct Line secrets, comma-separated (the first signs tokens; the others are still
    /// accepted, for rotation); Direct Line is open without one in development and off
    /// without one when `MicrosoftAppId` is set.
    #[arg(long, env = "DirectLineSecret", hide_env_values = true)]
    pub direct_line_secret: Option<String>,
    /// What the user is told when a message is refused because the bot is still answering the
    /// one before (a bot whose double-text policy is `reject`). Nothing is committed for it.
    #[arg(long, env = "TURNSTILE_BUSY_TEXT", default_value = BUSY_TEXT)]
    pub busy_text: String,
    /// What ends a Teams stream whose turn a later message interrupted (a bot whose double-text
    /// policy is `interrupt`): the stream's drafts answered the earlier message, and Teams
    /// would show them until it times the stream out.
    #[arg(long, env = "TURNSTILE_SUPERSEDED_TEXT", default_value = SUPERSEDED_TEXT)]
    pub superseded_text: String,
}

/// Why the settings describe no gateway that could work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The app type is not one this gateway knows.
    #[error(
        "MicrosoftAppType `{0}` is not supported; use MultiTenant or SingleTenant \
         (UserAssignedMSI needs a managed identity endpoint this gateway does not call)"
    )]
    AppType(String),
    /// A setting the others require is missing.
    #[error("{0} is required when MicrosoftAppId is set{1}")]
    Missing(&'static str, &'static str),
    /// The bot named for the gateway is not hosted by the server beside it.
    #[error(
        "the gateway's bot `{name}` is not hosted here (hosted: {hosted}); name one of them, or \
         add a bot worker with --remote-bot {name}=http://host:port"
    )]
    UnknownBot {
        /// The name given.
        name: String,
        /// The names hosted, comma-separated.
        hosted: String,
    },
    /// No credentials, and an address other machines reach.
    #[error(
        "refusing to serve the gateway on {address} without MicrosoftAppId: anyone who reaches \
         that address could run turns and read replies unauthenticated. Set MicrosoftAppId and \
         MicrosoftAppPassword (as for any Bot Framework bot), listen on 127.0.0.1, or pass \
         {flag} for a development network"
    )]
    Exposed {
        /// Where the gateway was to listen.
        address: SocketAddr,
        /// The flag that would allow it anyway.
        flag: &'static str,
    },
}

/// How the gateway authenticates channels and itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppType {
    /// One app registration used from any tenant; tokens from the `botframework.com` tenant.
    MultiTenant,
    /// An app registration of one tenant; tokens from that tenant.
    SingleTenant,
}

/// A client secret, bearer token or Direct Line secret: a [`SecretString`], so that `Debug`
/// shows `[REDACTED]` and the text is zeroed when dropped. Two secrets are equal when their
/// bytes are, compared in constant time.
#[derive(Debug, Clone)]
pub struct Secret(SecretString);

impl Secret {
    /// Wraps a secret.
    pub fn new(secret: impl Into<String>) -> Self {
        Self(SecretString::from(secret.into()))
    }

    /// The secret itself, for the one request that sends it or the comparison that checks it.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.expose()
            .as_bytes()
            .ct_eq(other.expose().as_bytes())
            .into()
    }
}

impl Eq for Secret {}

/// The bot's identity and where channels' and its own tokens come from.
#[derive(Debug, Clone)]
pub struct AppCredentials {
    /// The app id: the audience every channel token must name.
    pub app_id: String,
    /// The client secret replies' tokens are requested with.
    pub password: Secret,
    /// Multi- or single-tenant.
    pub app_type: AppType,
    /// The tenant of a single-tenant app.
    pub tenant_id: Option<String>,
    /// Where the channels' signing keys are published (`ToBotFromChannelOpenIdMetadataUrl`).
    pub openid_metadata_url: String,
    /// The issuer of channel tokens (`ToBotFromChannelTokenIssuer`).
    pub token_issuer: String,
    /// The authority of the bot's own tokens (`ToChannelFromBotLoginUrl`).
    pub login_url: String,
    /// The audience of the bot's own tokens (`ToChannelFromBotOAuthScope`).
    pub oauth_scope: String,
}

/// How stubbornly replies are delivered to the channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryPolicy {
    /// Most POSTs per reply (the first included).
    pub attempts: u32,
    /// The wait before the second POST; doubles each time.
    pub base_delay: Duration,
    /// The longest wait, whatever `Retry-After` asks for.
    pub max_delay: Duration,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        Self {
            attempts: 4,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(2),
        }
    }
}

/// Everything [`super::serve`] needs besides the listener; tests build it directly.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The Turnstile server's URL (`http://host:port`, or `https://` for TLS).
    pub turnstile_url: String,
    /// The hosted bot that handles the turns; empty: the server's default.
    pub bot: String,
    /// Bearer token for `TurnService`, when the server requires one.
    pub turnstile_token: Option<Secret>,
    /// TLS towards the server, for an `https://` URL.
    pub turnstile_tls: ClientTls,
    /// How long a turn may take, retries included, when its caller waits for the replies.
    pub turn_timeout: Duration,
    /// How long a turn may take, retries included, when it runs after the channel was answered
    /// (see [`super::background`]).
    pub bot_turn_timeout: Duration,
    /// How long a graceful shutdown waits for the turns running in the background.
    pub shutdown_grace: Duration,
    /// Most turns running in the background at once.
    pub max_background_turns: usize,
    /// The bot's credentials; `None` runs unauthenticated (local development).
    pub credentials: Option<AppCredentials>,
    /// How replies are delivered.
    pub delivery: DeliveryPolicy,
    /// Direct Line secrets; with none, Direct Line and the chat page are served only in
    /// development (no credentials), and then without authentication.
    pub direct_line_secrets: Vec<Secret>,
    /// The reply to a message refused because the bot is still answering the one before.
    pub busy_text: String,
    /// The final message of a Teams stream whose turn a later message interrupted.
    pub superseded_text: String,
}

/// The default of `--superseded-text`.
pub const SUPERSEDED_TEXT: &str = "(Answering your newer message.)";

/// The default of `--busy-text`.
pub const BUSY_TEXT: &str =
    "I'm still answering your previous message. Please send this one again once I'm done.";

impl GatewayConfig {
    /// An unauthenticated gateway in front of the Turnstile server at `turnstile_url`.
    pub fn development(turnstile_url: impl Into<String>) -> Self {
        Self {
            turnstile_url: turnstile_url.into(),
            bot: String::new(),
            turnstile_token: None,
            turnstile_tls: ClientTls::default(),
            turn_timeout: Duration::from_secs(8),
            bot_turn_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(20),
            max_background_turns: 1000,
            credentials: None,
            delivery: DeliveryPolicy::default(),
            direct_line_secrets: Vec::new(),
            busy_text: BUSY_TEXT.to_owned(),
            superseded_text: SUPERSEDED_TEXT.to_owned(),
        }
    }

    /// The gateway `turnstile serve` runs beside its `TurnService` listening on `grpc`: a gRPC
    /// client over loopback like any gateway, in development mode, for the server's default bot.
    pub fn embedded(grpc: SocketAddr) -> Self {
        Self::development(format!("http://{}", loopback(grpc)))
    }

    /// Checks that this gateway may listen on `address`: with credentials anywhere, without
    /// them on loopback only, unless `insecure` (the `flag` named in the refusal) says
    /// otherwise, which is then logged loudly.
    ///
    /// # Errors
    /// [`ConfigError::Exposed`] for an address beyond loopback without credentials.
    pub fn check_exposure(
        &self,
        address: SocketAddr,
        insecure: bool,
        flag: &'static str,
    ) -> Result<(), ConfigError> {
        if self.credentials.is_some() || address.ip().is_loopback() {
            return Ok(());
        }
        if !insecure {
            return Err(ConfigError::Exposed { address, flag });
        }
        tracing::warn!(
            %address,
            "{flag}: the gateway serves WITHOUT AUTHENTICATION beyond loopback; anyone who \
             reaches this address can run turns and read replies"
        );
        Ok(())
    }

    /// Whether Direct Line (and the chat page) are served: with a Direct Line secret, or in
    /// development.
    pub fn direct_line_enabled(&self) -> bool {
        !self.direct_line_secrets.is_empty() || self.credentials.is_none()
    }
}

/// `address`, with an unspecified IP (`0.0.0.0`, `::`) replaced by the loopback address: where
/// this machine reaches a listener bound there.
pub fn loopback(address: SocketAddr) -> SocketAddr {
    let mut address = address;
    if address.ip().is_unspecified() {
        address.set_ip(match address {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    address
}

impl GatewayArgs {
    /// The configuration these settings describe.
    ///
    /// # Errors
    /// [`ConfigError`] when an app id is set but the settings it needs are missing or unknown.
    pub fn config(&self) -> Result<GatewayConfig, ConfigError> {
        let credentials = self.channel.credentials()?;
        Ok(GatewayConfig {
            turnstile_url: self.turnstile_url.clone(),
            bot: self.bot.clone(),
            turnstile_token: self.turnstile_token.clone().map(Secret::new),
            turnstile_tls: ClientTls {
                ca_cert: self.turnstile_ca_cert.clone(),
                domain: self.turnstile_tls_domain.clone(),
                identity: self
                    .turnstile_client_cert
                    .clone()
                    .zip(self.turnstile_client_key.clone()),
            },
            turn_timeout: Duration::from_millis(self.turn_timeout_ms),
            bot_turn_timeout: Duration::from_millis(self.bot_turn_timeout_ms),
            shutdown_grace: Duration::from_secs(self.shutdown_grace_secs),
            max_background_turns: usize::try_from(self.max_background_turns).unwrap_or(usize::MAX),
            credentials,
            delivery: DeliveryPolicy::default(),
            direct_line_secrets: self.channel.direct_line_secrets(),
            busy_text: self.channel.busy_text.clone(),
            superseded_text: self.channel.superseded_text.clone(),
        })
    }
}

impl ChannelArgs {
    /// The app's credentials, or `None` without `MicrosoftAppId` (development).
    ///
    /// # Errors
    /// [`ConfigError`] when an app id is set but the settings it needs are missing or unknown.
    pub fn credentials(&self) -> Result<Option<AppCredentials>, ConfigError> {
        match self.app_id.as_deref().filter(|id| !id.is_empty()) {
            Some(app_id) => self.credentials_of(app_id).map(Some),
            None => Ok(None),
        }
    }

    /// The Direct Line secrets, first the one that signs tokens.
    pub fn direct_line_secrets(&self) -> Vec<Secret> {
        self.direct_line_secret
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Secret::new)
            .collect()
    }

    fn credentials_of(&self, app_id: &str) -> Result<AppCredentials, ConfigError> {
        let app_type = match self.app_type.as_deref().unwrap_or("") {
            "" => AppType::MultiTenant,
            t if t.eq_ignore_ascii_case("MultiTenant") => AppType::MultiTenant,
            t if t.eq_ignore_ascii_case("SingleTenant") => AppType::SingleTenant,
            other => return Err(ConfigError::AppType(other.to_owned())),
        };
        let password = self
            .app_password
            .clone()
            .filter(|p| !p.is_empty())
            .ok_or(ConfigError::Missing("MicrosoftAppPassword", ""))?;
        let tenant_id = self.app_tenant_id.clone().filter(|t| !t.is_empty());
        let tenant = match (app_type, &tenant_id) {
            (AppType::SingleTenant, None) => {
                return Err(ConfigError::Missing(
                    "MicrosoftAppTenantId",
                    " and MicrosoftAppType is SingleTenant",
                ));
            }
            (AppType::SingleTenant, Some(tenant)) => tenant.clone(),
            (AppType::MultiTenant, _) => BOT_FRAMEWORK_TENANT.to_owned(),
        };
        let or = |value: &Option<String>, default: String| {
            value.clone().filter(|v| !v.is_empty()).unwrap_or(default)
        };
        Ok(AppCredentials {
            app_id: app_id.to_owned(),
            password: Secret::new(password),
            app_type,
            tenant_id,
            openid_metadata_url: or(
                &self.to_bot_from_channel_open_id_metadata_url,
                CHANNEL_OPENID_METADATA_URL.to_owned(),
            ),
            token_issuer: or(
                &self.to_bot_from_channel_token_issuer,
                CHANNEL_TOKEN_ISSUER.to_owned(),
            ),
            login_url: or(
                &self.to_channel_from_bot_login_url,
                format!("{LOGIN_HOST}/{tenant}"),
            ),
            oauth_scope: or(
                &self.to_channel_from_bot_oauth_scope,
                CHANNEL_OAUTH_SCOPE.to_owned(),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        gateway: GatewayArgs,
    }

    fn parse(args: &[&str]) -> Result<GatewayConfig, ConfigError> {
        let mut argv = vec!["gateway"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).expect("parses").gateway.config()
    }

    #[test]
    fn no_app_id_is_development_and_an_app_id_needs_its_secret() {
        assert!(parse(&[]).expect("dev").credentials.is_none());
        assert!(
            parse(&["--microsoft-app-id", ""])
                .expect("dev")
                .credentials
                .is_none()
        );
        assert_eq!(
            parse(&["--microsoft-app-id", "a"]).expect_err("no secret"),
            ConfigError::Missing("MicrosoftAppPassword", "")
        );
        let multi = parse(&["--microsoft-app-id", "a", "--microsoft-app-password", "p"])
            .expect("multi-tenant")
            .credentials
            .expect("authenticated");
        assert_eq!(
            multi.login_url,
            "https://login.microsoftonline.com/botframework.com"
        );
        assert_eq!(multi.token_issuer, CHANNEL_TOKEN_ISSUER);
        assert!(
            !format!("{multi:?}").contains("\"p\""),
            "the secret is redacted"
        );
    }

    #[test]
    fn waiting_calls_have_the_channels_budget_and_background_turns_the_bots() {
        let defaults = parse(&[]).expect("dev");
        assert_eq!(defaults.turn_timeout, Duration::from_secs(8));
        assert_eq!(defaults.bot_turn_timeout, Duration::from_secs(120));
        assert_eq!(defaults.shutdown_grace, Duration::from_secs(20));
        assert_eq!(defaults.max_background_turns, 1000);
        let set = parse(&[
            "--bot-turn-timeout-ms",
            "600000",
            "--shutdown-grace-secs",
            "5",
        ])
        .expect("dev");
        assert_eq!(set.bot_turn_timeout, Duration::from_secs(600));
        assert_eq!(set.shutdown_grace, Duration::from_secs(5));
    }

    #[test]
    fn single_tenant_needs_its_tenant_and_gets_its_tokens_there() {
        let base = ["--microsoft-app-id", "a", "--microsoft-app-password", "p"];
        let mut single = base.to_vec();
        single.extend(["--microsoft-app-type", "SingleTenant"]);
        assert!(matches!(
            parse(&single),
            Err(ConfigError::Missing("MicrosoftAppTenantId", _))
        ));
        single.extend(["--microsoft-app-tenant-id", "t1"]);
        let credentials = parse(&single).expect("ok").credentials.expect("auth");
        assert_eq!(
            credentials.login_url,
            "https://login.microsoftonline.com/t1"
        );
        let mut with_secrets = base.to_vec();
        with_secrets.extend(["--direct-line-secret", " one , two,"]);
        let config = parse(&with_secrets).expect("ok");
        assert_eq!(
            config.direct_line_secrets,
            vec![Secret::new("one"), Secret::new("two")]
        );
        assert!(config.direct_line_enabled());
        assert!(!parse(&base).expect("ok").direct_line_enabled());
        assert!(parse(&[]).expect("dev").direct_line_enabled());
        let mut msi = base.to_vec();
        msi.extend(["--microsoft-app-type", "UserAssignedMSI"]);
        assert!(matches!(parse(&msi), Err(ConfigError::AppType(_))));
    }

    #[test]
    fn without_credentials_only_loopback_is_served_unless_insecure() {
        let any: SocketAddr = "0.0.0.0:3978".parse().expect("address");
        let lan: SocketAddr = "192.0.2.7:3978".parse().expect("address");
        let loopback: SocketAddr = "127.0.0.1:3978".parse().expect("address");
        let v6: SocketAddr = "[::1]:3978".parse().expect("address");
        let dev = parse(&[]).expect("dev");
        for address in [loopback, v6] {
            assert_eq!(dev.check_exposure(address, false, "--insecure"), Ok(()));
        }
        for address in [any, lan] {
            let refused = dev
                .check_exposure(address, false, "--insecure")
                .expect_err("beyond loopback");
            assert_eq!(
                refused,
                ConfigError::Exposed {
                    address,
                    flag: "--insecure"
                }
            );
            let message = refused.to_string();
            assert!(message.contains("MicrosoftAppId"), "{message}");
            assert!(message.contains("--insecure"), "{message}");
            assert_eq!(dev.check_exposure(address, true, "--insecure"), Ok(()));
        }
        let authenticated = parse(&["--microsoft-app-id", "a", "--microsoft-app-password", "p"])
            .expect("credentials");
        assert_eq!(
            authenticated.check_exposure(any, false, "--insecure"),
            Ok(())
        );
    }
}
