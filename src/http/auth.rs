//! Authentication: the merchant's secret key, as a Bearer token or as the
//! user name of HTTP Basic with an empty password (so `curl -u sk_test_...:`
//! works, as with Stripe). The key never reaches a log.
//!
//! Once the merchant is known, its rate limit is taken
//! ([`crate::rate_limit`]): every authenticated handler extracts
//! [`Authenticated`] before its body, so a request over the limit is
//! answered `429` before anything is read, claimed or written, and a replay
//! of a saved answer counts like any request.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{Method, header};
use base64::Engine;

use super::problem::ApiError;
use crate::app::AppState;
use crate::merchants::{self, ApiKey, Merchant};
use crate::rate_limit::{self, Kind};
use oncepay_core::problem::{Problem, ProblemCode};

/// The merchant a request authenticated as.
#[derive(Clone, Debug)]
pub struct Authenticated(pub Merchant);

impl FromRequestParts<AppState> for Authenticated {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Some(value) = parts.headers.get(header::AUTHORIZATION) else {
            return Err(unauthorized(
                ProblemCode::AuthenticationRequired,
                "No API key provided. Use 'Authorization: Bearer sk_test_...' or 'curl -u sk_test_...:'.",
            ));
        };
        let key = value
            .to_str()
            .ok()
            .and_then(key_from_authorization)
            .and_then(|k| ApiKey::parse(&k));
        let Some(key) = key else {
            return Err(unauthorized(
                ProblemCode::InvalidApiKey,
                "The API key provided is not valid.",
            ));
        };
        let found = state
            .caches
            .merchant_or_load(key.hash(), merchants::authenticate(&state.pool, &key))
            .await?;
        match found {
            Some(merchant) => {
                tracing::Span::current().record("merchant", tracing::field::display(merchant.id));
                refuse_connected_account(parts)?;
                let kind = kind_of(&parts.method);
                if let Err(wait) = state.rate_limits.check(merchant.id, kind) {
                    return Err(rate_limited(kind, wait));
                }
                Ok(Authenticated(merchant))
            }
            None => Err(unauthorized(
                ProblemCode::InvalidApiKey,
                "The API key provided is not valid.",
            )),
        }
    }
}

/// Refuses a request with a `Stripe-Account` header: it asks to act as a
/// connected account, and oncepay has none, so the key has access to no
/// other account (`403 account_invalid`, as Stripe answers for an account
/// out of reach). Ignoring it would act on the caller's own account.
fn refuse_connected_account(parts: &Parts) -> Result<(), ApiError> {
    let Some(account) = parts.headers.get(STRIPE_ACCOUNT) else {
        return Ok(());
    };
    let account = String::from_utf8_lossy(account.as_bytes());
    Err(Problem::new(
        ProblemCode::AccountInvalid,
        format!(
            "The provided key does not have access to account '{}' (or that account does not exist): oncepay has no connected accounts.",
            oncepay_core::params::shorten(&account)
        ),
    )
    .with_param("Stripe-Account")
    .into())
}

/// The header with which a Connect platform acts as one of its accounts.
const STRIPE_ACCOUNT: &str = "stripe-account";

/// Reads draw on the read allowance; everything else is a write.
fn kind_of(method: &Method) -> Kind {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        Kind::Read
    } else {
        Kind::Write
    }
}

/// `429 rate_limit`, with `Retry-After`: whole seconds until the
/// merchant's allowance has room for one more request.
fn rate_limited(kind: Kind, wait: std::time::Duration) -> ApiError {
    metrics::counter!("rate_limited_total", "kind" => kind.as_str()).increment(1);
    let detail = match kind {
        Kind::Read => "Too many reads from this merchant: slow down, and retry after Retry-After.",
        Kind::Write => {
            "Too many writes from this merchant: slow down, and retry (with the same \
             Idempotency-Key) after Retry-After."
        }
    };
    Problem::new(ProblemCode::RateLimit, detail)
        .with_retry_after(rate_limit::retry_after_seconds(wait))
        .into()
}

fn key_from_authorization(value: &str) -> Option<String> {
    let (scheme, credentials) = value.trim().split_once(' ')?;
    let credentials = credentials.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(credentials.to_owned());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(credentials)
            .ok()?;
        let decoded = String::from_utf8(decoded).ok()?;
        // The key is the user name; the password must be empty.
        let (user, password) = decoded.split_once(':').unwrap_or((&decoded, ""));
        return password.is_empty().then(|| user.to_owned());
    }
    None
}

fn unauthorized(code: ProblemCode, detail: &str) -> ApiError {
    Problem::new(code, detail)
        .with_header(header::WWW_AUTHENTICATE, "Bearer realm=\"oncepay\"")
        .with_header(header::WWW_AUTHENTICATE, "Basic realm=\"oncepay\"")
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_and_basic_with_empty_password_carry_the_key() {
        assert_eq!(
            key_from_authorization("Bearer sk_test_abc").as_deref(),
            Some("sk_test_abc")
        );
        let basic = base64::engine::general_purpose::STANDARD.encode("sk_test_abc:");
        assert_eq!(
            key_from_authorization(&format!("Basic {basic}")).as_deref(),
            Some("sk_test_abc")
        );
        let with_password = base64::engine::general_purpose::STANDARD.encode("sk_test_abc:pw");
        assert_eq!(
            key_from_authorization(&format!("Basic {with_password}")),
            None
        );
        assert_eq!(key_from_authorization("Token sk_test_abc"), None);
    }
}
