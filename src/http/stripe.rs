//! What the official Stripe SDKs read besides the body's `error` member
//! (see [`oncepay_core::problem::Problem::body`]): `Request-Id` on every response,
//! `Idempotency-Key` echoed to a request that sent one, `Stripe-Should-Retry`
//! on errors where their retry decision matters, and, when the client says it
//! speaks Stripe's API, Stripe's statuses: `200` for a create, `400` for a
//! reused key, `404` for a method a route does not take.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;

use oncepay_core::idempotency::IdempotencyKey;
use oncepay_core::idempotency::key::HEADER as IDEMPOTENCY_KEY;
use oncepay_core::problem::{Problem, ProblemCode};

/// The request id as the SDKs read it into `error.request_id`.
pub const STRIPE_REQUEST_ID: HeaderName = HeaderName::from_static("request-id");
/// Whether a retry can change the answer; the SDKs obey it over their own guess.
pub const SHOULD_RETRY: HeaderName = HeaderName::from_static("stripe-should-retry");
/// Sent by every Stripe SDK.
pub const STRIPE_VERSION: HeaderName = HeaderName::from_static("stripe-version");

/// What the way out needs to know of a request's client.
#[derive(Clone, Debug, Default)]
pub struct Client {
    /// The request sent `Stripe-Version`, as every Stripe SDK does.
    pub speaks_stripe: bool,
    /// The request's `Idempotency-Key`, when it sent one well-formed key.
    pub idempotency_key: Option<HeaderValue>,
}

impl Client {
    /// Reads the client from its request's headers.
    pub fn of(headers: &HeaderMap) -> Self {
        let idempotency_key = match IdempotencyKey::from_headers(headers) {
            Ok(Some(_)) => headers.get(IDEMPOTENCY_KEY).cloned(),
            _ => None,
        };
        Client {
            speaks_stripe: headers.contains_key(STRIPE_VERSION),
            idempotency_key,
        }
    }
}

/// Adds `Request-Id` (the same value as `X-Request-Id`, here `id`) to
/// every response, `Idempotency-Key` to the answer of a request that sent
/// one, as Stripe does, and `Stripe-Should-Retry` to every error
/// ([`should_retry`]); answers a Stripe client's create with Stripe's status
/// ([`status_for`]). Saved answers get the headers and the status too: only
/// their bytes are untouchable, so a replay to a client of the same kind gets
/// the same status as the first answer. Called by [`super::observe::finish`].
pub fn finish(response: &mut Response, id: Option<HeaderValue>, client: Client) {
    *response.status_mut() = status_for(response.status(), client.speaks_stripe);
    if let Some(id) = id {
        response.headers_mut().insert(STRIPE_REQUEST_ID, id);
    }
    if let Some(key) = client.idempotency_key {
        response.headers_mut().insert(IDEMPOTENCY_KEY, key);
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

/// The status a client gets for an answer of `status`: a create's `201`
/// (with its `Location`) as HTTP has it, but `200` for a Stripe client,
/// which is what Stripe answers every create with. Written here once, for
/// every create: a charge, a refund, a webhook endpoint, and any to come.
/// The saved answer keeps `201`.
pub fn status_for(status: StatusCode, stripe_client: bool) -> StatusCode {
    if stripe_client && status == StatusCode::CREATED {
        StatusCode::OK
    } else {
        status
    }
}

/// The problem as a Stripe client expects it. A reused key is `422` (the
/// IETF draft's answer), but the Stripe SDKs raise their `IdempotencyError`
/// only for a `400`, Stripe's own status for it. A method a route does not
/// take is HTTP's `405`, but Stripe answers it as any URL it does not know,
/// `404`, which the SDKs raise as an `InvalidRequestError` (a `405` is a
/// bare `APIError`). A request with a `Stripe-Version` header (every SDK
/// sends one) gets Stripe's answer.
pub fn for_client(problem: Problem, stripe_client: bool) -> Problem {
    match problem.code {
        ProblemCode::IdempotencyKeyReused if stripe_client => Problem {
            status: StatusCode::BAD_REQUEST,
            ..problem
        },
        ProblemCode::MethodNotAllowed if stripe_client => Problem {
            status: StatusCode::NOT_FOUND,
            code: ProblemCode::RouteNotFound,
            ..problem
        },
        _ => problem,
    }
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

    #[test]
    fn a_create_is_200_for_a_stripe_client_and_201_for_any_other() {
        assert_eq!(status_for(StatusCode::CREATED, true), StatusCode::OK);
        assert_eq!(status_for(StatusCode::CREATED, false), StatusCode::CREATED);
        for status in [StatusCode::OK, StatusCode::PAYMENT_REQUIRED] {
            assert_eq!(status_for(status, true), status);
        }
    }
}
