//! The HTTP side of every idempotent `POST`: the `Idempotency-Key` and
//! `Prefer` headers in, saved answers out (replayed ones marked
//! `Idempotent-Replayed: true` and naming the `Original-Request`). The claim itself is
//! `oncepay_core::operation::claim`'s.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::problem::ApiError;
use crate::app::AppState;
use crate::speed::timing::Stopwatch;
use oncepay_core::error::Error;
use oncepay_core::idempotency::{IdempotencyKey, SavedResponse};
use oncepay_core::operation::engine::Answer;
use oncepay_core::problem::{Problem, ProblemCode};

pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// On a replay, as Stripe sends it: the `X-Request-Id` of the request that
/// claimed the key, whose answer this is.
pub const ORIGINAL_REQUEST: HeaderName = HeaderName::from_static("original-request");
/// The longest `Prefer: wait=N` honoured, in seconds.
const MAX_WAIT_SECS: u64 = 10;

/// The response for how an operation ended: its answer, or its error as a
/// problem. Rendering it records the operation's timing on `clock`.
pub fn respond(clock: &Stopwatch, answer: Result<Answer, Error>) -> Response {
    clock.render(answer, |answer| match answer {
        Ok(Answer::Fresh(saved)) => send(saved),
        Ok(Answer::Replayed { saved, waited }) => {
            let response = saved.response.clone();
            replay(response, saved.original_request.as_deref(), waited)
        }
        Err(e) => ApiError(e).into_response(),
    })
}

/// Sends a saved response exactly as saved. The body is sent from the saved
/// `Bytes` as they are, without a copy.
pub fn send(saved: SavedResponse) -> Response {
    let status = StatusCode::from_u16(saved.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, Body::from(saved.body)).into_response();
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(&saved.content_type) {
        headers.insert(header::CONTENT_TYPE, value);
    }
    if let Some(value) = saved.location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        headers.insert(header::LOCATION, value);
    }
    // Saved bytes go out as saved: nothing may add to them (see `observe`).
    response
        .extensions_mut()
        .insert(super::observe::SavedAnswer);
    response
}

/// Sends a saved answer as a replay: `Idempotent-Replayed: true`,
/// `Original-Request` when the key recorded the request that claimed it
/// (keys claimed before it was recorded did not), and
/// `Preference-Applied: wait` when the request waited for it.
pub fn replay(saved: SavedResponse, original_request: Option<&str>, waited: bool) -> Response {
    let mut response = send(saved);
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    if let Some(value) = original_request.and_then(|id| HeaderValue::from_str(id).ok()) {
        response.headers_mut().insert(ORIGINAL_REQUEST, value);
    }
    if waited {
        response
            .headers_mut()
            .insert("preference-applied", HeaderValue::from_static("wait"));
    }
    response
}

/// Reads the key header: `None` without one, a `400` when malformed, or
/// missing while `IDEMPOTENCY_KEY_REQUIRED` is on.
pub fn key_from_headers(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Option<IdempotencyKey>, ApiError> {
    let key = IdempotencyKey::from_headers(headers).map_err(|e| {
        Problem::new(ProblemCode::InvalidIdempotencyKey, e.to_string())
            .with_param("Idempotency-Key")
    })?;
    if key.is_none() && state.config.keys.required {
        return Err(Problem::new(
            ProblemCode::IdempotencyKeyMissing,
            "This server requires an Idempotency-Key header on POST requests.",
        )
        .into());
    }
    if let Some(key) = &key {
        tracing::Span::current().record("idempotency_key", key.as_str());
    }
    Ok(key)
}

/// `Prefer: wait=N` (RFC 7240): how long to wait for a request in flight
/// with the same key, at most ten seconds. Zero when absent or malformed.
pub fn prefer_wait(headers: &HeaderMap) -> Duration {
    headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split([',', ';']))
        .filter_map(|pref| {
            let (name, value) = pref.trim().split_once('=')?;
            name.trim()
                .eq_ignore_ascii_case("wait")
                .then(|| value.trim().trim_matches('"').parse::<u64>().ok())?
        })
        .next()
        .map_or(Duration::ZERO, |secs| {
            Duration::from_secs(secs.min(MAX_WAIT_SECS))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_of(values: &[&str]) -> Duration {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append("prefer", HeaderValue::from_str(value).unwrap());
        }
        prefer_wait(&headers)
    }

    #[test]
    fn prefer_wait_is_whole_seconds_at_most_ten_and_zero_when_absent_or_malformed() {
        let secs = Duration::from_secs;
        assert_eq!(wait_of(&[]), Duration::ZERO);
        assert_eq!(wait_of(&["wait=0"]), Duration::ZERO);
        assert_eq!(wait_of(&["wait=5"]), secs(5));
        assert_eq!(wait_of(&["wait=10"]), secs(10));
        assert_eq!(wait_of(&["wait=11"]), secs(MAX_WAIT_SECS));
        assert_eq!(wait_of(&["wait=86400"]), secs(10));
        assert_eq!(wait_of(&["wait=18446744073709551615"]), secs(10));
        // Among other preferences, in any case, quoted, in any header line.
        assert_eq!(wait_of(&["respond-async, wait=7"]), secs(7));
        assert_eq!(wait_of(&["handling=lenient; WAIT = \"3\""]), secs(3));
        assert_eq!(wait_of(&["return=minimal", "wait=2"]), secs(2));
        for malformed in [
            "wait=soon",
            "wait=-1",
            "wait=1.5",
            "wait",
            "wait=",
            "waiting=4",
        ] {
            assert_eq!(wait_of(&[malformed]), Duration::ZERO, "{malformed}");
        }
    }
}
