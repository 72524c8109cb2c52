//! What the official Stripe SDKs read besides the body's `error` member
//! (see [`crate::problem::Problem::body`]): `Request-Id` on every response,
//! `Stripe-Should-Retry` on errors where their retry decision matters, and
//! a `400` for a reused key when the client says it speaks Stripe's API.

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;

use crate::problem::{Problem, ProblemCode};

/// The request id as the SDKs read it into `error.request_id`.
pub const STRIPE_REQUEST_ID: HeaderName = HeaderName::from_static("request-id");
/// Whether a retry can change the answer; the SDKs obey it over their own guess.
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");
/// Sent by every Stripe SDK.
pub const STRIPE_VERSION: HeaderName = HeaderName::from_static("stripe-version");

/// Adds `Request-Id` (the same value as `X-Request-Id`, here `id`) to
/// every response, and `Stripe-Should-Retry` to every error
/// ([`should_retry`]). Saved answers get the headers too: only their bytes
/// are untouchable. Called by [`super::observe::finish`].
pub fn add_headers(response: &mut Response, id: Option<HeaderValue>) {
    if let Some(id) = id {
        response.headers_mut().insert(STRIPE_REQUEST_ID, id);
    }
    if let Some(retry) = should_retry(response.status()) {
        response
            .headers_mut()
            .insert(SHOULD_RETRY, HeaderValue::from_static(retry));
    }
}

/// For an error, as Stripe sets it: `true` where the same request may get
/// another answer later (`409`: the key is in flight; `429`: the merchant's
/// rate limit, after `Retry-After`; a `5xx`: the server's side failed, and
/// a retry with the same key is safe), `false` on every
/// other client error, which a retry cannot change (`400`, `401`, `402`,
/// `403`, `404`, `405`, `413`, `415`, `422`). `None` below `400`. The SDKs retry
/// `409`s, `429`s and `5xx`s on their own, so `false` matters most on a `402` or a
/// `400`.
fn should_retry(status: StatusCode) -> Option<&'static str> {
    match status.as_u16() {
        409 | 429 => Some("true"),
        400..=499 => Some("false"),
        500..=599 => Some("true"),
        _ => None,
    }
}

/// A reused key is `422` (the IETF draft's answer), but the Stripe SDKs
/// raise their `IdempotencyError` only for a `400`, Stripe's own status for
/// it. A request with a `Stripe-Version` header (every SDK sends one) gets
/// the `400`.
pub fn for_client(problem: Problem, stripe_client: bool) -> Problem {
    if stripe_client && problem.code == ProblemCode::IdempotencyKeyReused {
        return Problem {
            status: StatusCode::BAD_REQUEST,
            ..problem
        };
    }
    problem
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_advised_only_where_they_can_change_the_answer() {
        for status in [409, 429, 500, 503] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(should_retry(status), Some("true"), "{status}");
        }
        for status in [400, 401, 402, 404, 405, 413, 415, 422] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(should_retry(status), Some("false"), "{status}");
        }
        assert_eq!(should_retry(StatusCode::OK), None);
        assert_eq!(should_retry(StatusCode::CREATED), None);
    }
}
