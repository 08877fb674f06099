//! Caller authentication: a bearer token on every `TurnService` call, when tokens are configured.
//!
//! It is an interceptor on `TurnService` alone, so that health probes and reflection stay open to
//! the platform that has no token. Tokens are compared in constant time (a timing difference
//! would let a caller guess one byte at a time), and never printed: a [`Token`] holds its secret
//! in a [`SecretString`], whose `Debug` shows `[REDACTED]` and which is zeroed when dropped.

use std::path::Path;
use std::sync::Arc;

use secrecy::{ExposeSecret as _, SecretString};
use subtle::ConstantTimeEq as _;
use tonic::service::Interceptor;
use tonic::{Request, Status};

use super::error::Refusal;

/// A secret a caller presents as `authorization: Bearer <token>`. Two tokens are equal when
/// their bytes are, compared in constant time like a presented token.
#[derive(Debug, Clone)]
pub struct Token(SecretString);

impl Token {
    /// Wraps a token.
    pub fn new(token: impl Into<String>) -> Self {
        Self(SecretString::from(token.into()))
    }

    /// The secret's bytes, for comparing and deriving keys; never for printing.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.expose_secret().as_bytes()
    }
}

impl PartialEq for Token {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes().ct_eq(other.as_bytes()).into()
    }
}

impl Eq for Token {}

/// Parses tokens from a list: one per line (a file) or comma-separated (an environment
/// variable); blank entries and surrounding whitespace are ignored.
pub fn parse_tokens(text: &str, separator: char) -> Vec<Token> {
    text.split(separator)
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(Token::new)
        .collect()
}

/// Reads the tokens in `path`, one per line.
///
/// # Errors
/// When the file cannot be read. The error names the file, never its content.
pub fn read_tokens_file(path: &Path) -> std::io::Result<Vec<Token>> {
    Ok(parse_tokens(&std::fs::read_to_string(path)?, '\n'))
}

/// The `TurnService` interceptor: lets a call through when no token is configured or when it
/// carries one of the configured tokens; otherwise answers `UNAUTHENTICATED`.
#[derive(Debug, Clone, Default)]
pub struct Authenticate {
    tokens: Arc<[Token]>,
}

impl Authenticate {
    /// Checks calls against `tokens`; with none, lets every call through.
    pub fn new(tokens: Vec<Token>) -> Self {
        Self {
            tokens: tokens.into(),
        }
    }

    /// Whether any token is required.
    pub fn is_enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Whether `presented` is one of the tokens: every token is compared, whatever matched.
    fn accepts(&self, presented: &[u8]) -> bool {
        // `subtle` compares in time that depends only on the lengths, and its `Choice` keeps the
        // optimizer from short-circuiting the fold.
        let found = self
            .tokens
            .iter()
            .fold(subtle::Choice::from(0), |found, token| {
                found | token.as_bytes().ct_eq(presented)
            });
        bool::from(found)
    }
}

impl Interceptor for Authenticate {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        if !self.is_enabled() {
            return Ok(request);
        }
        let Some(value) = request.metadata().get("authorization") else {
            return Err(Refusal::Unauthenticated(
                "this call needs `authorization: Bearer <token>`",
            )
            .into());
        };
        let value = value.as_bytes();
        let token = match value.split_at_checked(7) {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case(b"bearer ") => token,
            _ => {
                return Err(Refusal::Unauthenticated(
                    "the authorization header must be `Bearer <token>`",
                )
                .into());
            }
        };
        if self.accepts(token) {
            Ok(request)
        } else {
            Err(Refusal::Unauthenticated("the bearer token is not valid").into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_parse_and_never_print() {
        let tokens = parse_tokens(" a1 ,, b2\n", ',');
        assert_eq!(tokens, vec![Token::new("a1"), Token::new("b2")]);
        assert!(!format!("{tokens:?}").contains("a1"));
        assert_eq!(parse_tokens("x\n\ny\n", '\n').len(), 2);
    }

    #[test]
    fn only_configured_tokens_are_accepted() {
        let auth = Authenticate::new(vec![Token::new("secret"), Token::new("other")]);
        assert!(auth.accepts(b"secret"));
        assert!(auth.accepts(b"other"));
        assert!(!auth.accepts(b"secreT"));
        assert!(!auth.accepts(b"secret "));
        assert!(!auth.accepts(b""));
        assert!(!Authenticate::default().is_enabled());
    }
}
