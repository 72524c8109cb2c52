//! Step 2 of every idempotent `POST`, whatever the resource: claim the key in
//! a transaction the caller then adds its business write to, or answer from
//! what the key already holds (replay, `409`, `422`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sqlx::{Postgres, Transaction};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};
use uuid::Uuid;

use super::problem::ApiError;
use crate::app::AppState;
use crate::cache::CachedAnswer;
use crate::idempotency::wait::News;
use crate::idempotency::{
    Claim, ClaimOutcome, Fingerprint, IdempotencyKey, KeyStatus, Resource, SavedResponse,
    StoredKey, store as keys,
};
use crate::metrics;
use crate::problem::{Problem, ProblemCode};
use crate::retry_after;

pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// How long before `REQUEST_TIMEOUT` a wait gives up, so that its `409`
/// still goes out.
const WAIT_MARGIN: Duration = Duration::from_millis(250);
/// The longest `Prefer: wait=N` honoured, in seconds.
const MAX_WAIT_SECS: u64 = 10;

/// The idempotency side of a validated request: who asks, with which key
/// (if any), for what (the fingerprint), and how long it will wait.
pub struct Request {
    pub merchant_id: Uuid,
    pub key: Option<IdempotencyKey>,
    pub fingerprint: Fingerprint,
    /// From `Prefer: wait=N`; zero answers `409` at once.
    pub wait: Duration,
    /// Cancelled when the client hangs up (see [`hang_up_guard`]): a wait
    /// for a key in flight stops then, while claimed work goes on.
    pub client_gone: CancellationToken,
}

/// Cancels `client_gone` when dropped. A handler keeps it in its own future,
/// which hyper drops when the client disconnects (and the timeout layer
/// when `REQUEST_TIMEOUT` passes), and hands the rest of the work to a task
/// that outlives it.
pub fn hang_up_guard(client_gone: &CancellationToken) -> DropGuard {
    client_gone.clone().drop_guard()
}

/// The result of step 2's opening.
pub enum Begun {
    /// The key is ours (or there is none): write the business record in
    /// this transaction and commit.
    Claimed(Transaction<'static, Postgres>),
    /// The key was taken: this is the answer.
    Answered(Response),
}

/// What [`begin`] does next.
enum Step {
    /// Try to claim the key (one locking statement).
    Claim,
    /// See whether the key is stale, and settle it if so.
    Lease,
    /// Wait for news of the key in flight, without touching the database.
    Wait,
}

/// Opens step 2 for `resource` on `route`: a transaction holding the claim
/// on the request's key, a plain transaction when it has none, or the
/// answer the key already holds.
///
/// A request that finds its key in flight and asked to wait joins the
/// process's shared wait on that key ([`crate::idempotency::wait`]): it holds
/// no connection and takes no lock while it waits, answers from the
/// completed row the poll read, claims again if the key was given back, and
/// stops when its client hangs up.
///
/// When the key is held by a request that has been `processing` for longer
/// than `PROCESSING_TIMEOUT`, this request leases it (one conditional update,
/// as the sweeper does) and settles its record by the sweeper's own
/// procedure ([`crate::sweeper::recover`]); then it answers from the key.
/// Every other request that tried the lease in vain goes back to waiting.
pub async fn begin(
    state: &AppState,
    request: &Request,
    route: &'static str,
    resource: &Resource,
) -> Result<Begun, ApiError> {
    let Some(key) = &request.key else {
        return Ok(Begun::Claimed(state.pool.begin().await?));
    };
    // A wait ends in time to answer `409` before `REQUEST_TIMEOUT` would
    // answer `503` in its place.
    let wait = request
        .wait
        .min(state.config.request_timeout.saturating_sub(WAIT_MARGIN));
    let deadline = Instant::now() + wait;
    // The fast path for a retry of a finished operation: a completed key
    // cannot change until it expires, so it is answered from memory or from
    // one plain read, with no transaction and no row lock. The same read
    // sends a request willing to wait on a key in flight straight to the
    // wait, without a lock either.
    let mut step = Step::Claim;
    if let Some(answer) = state.caches.answer(request.merchant_id, key.as_str()) {
        return answer_from(request, key, route, &answer, false);
    }
    let found = keys::find(&state.pool, request.merchant_id, key).await?;
    // When this request last had a read of the key of its own finished: only
    // shared polls begun after it can tell it anything new.
    let mut known_at = Instant::now();
    if let Some(stored) = found {
        match stored.status {
            KeyStatus::Completed => {
                if let Some(answer) = remember(state, request.merchant_id, key, stored) {
                    return answer_from(request, key, route, &answer, false);
                }
            }
            KeyStatus::Processing if !wait.is_zero() && same(&stored, request, route) => {
                step = Step::Wait;
            }
            KeyStatus::Processing => {}
        }
    }
    let mut waiter = None;
    let mut waited = false;
    loop {
        step = match step {
            Step::Claim => {
                let mut tx = state.pool.begin().await?;
                let claim = Claim {
                    merchant_id: request.merchant_id,
                    key,
                    method: "POST",
                    path: route,
                    fingerprint: request.fingerprint,
                    resource,
                    ttl: state.config.idempotency_key_ttl,
                };
                let claimed = keys::claim(&mut tx, claim).await?;
                known_at = Instant::now();
                let stored = match claimed {
                    ClaimOutcome::Claimed { took_over } => {
                        metrics::idempotency(if took_over {
                            "expired_taken_over"
                        } else {
                            "executed"
                        });
                        return Ok(Begun::Claimed(tx));
                    }
                    ClaimOutcome::Taken(stored) => *stored,
                };
                tx.rollback().await?;
                if stored.status == KeyStatus::Completed {
                    let answer =
                        remember(state, request.merchant_id, key, stored).ok_or_else(|| {
                            ApiError::internal(anyhow::anyhow!(
                                "a completed key without its response"
                            ))
                        })?;
                    return answer_from(request, key, route, &answer, waited);
                }
                if !same(&stored, request, route) {
                    metrics::idempotency("reused");
                    return Err(reused(key));
                }
                Step::Lease
            }
            Step::Lease => {
                let stale = keys::lease_one(
                    &state.pool,
                    request.merchant_id,
                    key,
                    state.config.processing_timeout,
                )
                .await?;
                known_at = Instant::now();
                if let Some(stale) = stale {
                    tracing::info!(resource = ?stale, "a retry found its key stale; settling it");
                    crate::sweeper::recover(
                        &state.pool,
                        state.processor.as_ref(),
                        &stale,
                        state.config.idempotency_key_ttl,
                    )
                    .await
                    .map_err(|e| crate::error::Error::from_recovery(e, &state.config))?;
                    metrics::idempotency("stale_recovered");
                    Step::Claim
                } else if Instant::now() < deadline {
                    Step::Wait
                } else {
                    metrics::idempotency("in_use");
                    return Err(in_use(waited));
                }
            }
            Step::Wait => {
                waited = true;
                let shared =
                    waiter.get_or_insert_with(|| state.waits.join(request.merchant_id, key));
                let news = tokio::select! {
                    news = tokio::time::timeout_at(deadline, shared.news_since(known_at)) => news,
                    () = request.client_gone.cancelled() => {
                        tracing::info!("the client hung up; stopped waiting for the key in flight");
                        metrics::idempotency("wait_abandoned");
                        return Err(in_use(waited));
                    }
                };
                match news {
                    Err(_) => {
                        metrics::idempotency("in_use");
                        return Err(in_use(waited));
                    }
                    Ok(Some(News::Completed(stored))) => {
                        match remember(state, request.merchant_id, key, StoredKey::clone(&stored)) {
                            Some(answer) => {
                                return answer_from(request, key, route, &answer, waited);
                            }
                            None => Step::Claim,
                        }
                    }
                    Ok(Some(News::Stale)) => Step::Lease,
                    Ok(Some(News::Gone)) => Step::Claim,
                    Ok(Some(News::InFlight)) => Step::Wait,
                    Ok(None) => {
                        // The shared wait ended under us: look again, and
                        // join a new one if still in flight.
                        waiter = None;
                        Step::Claim
                    }
                }
            }
        };
    }
}

/// Notes that the request holding `request`'s key has finished its work here
/// (completed, or given the key back): requests waiting on the key in this
/// process hear of it at once instead of at the next poll.
pub fn finished(state: &AppState, request: &Request) {
    if let Some(key) = &request.key {
        state.waits.wake(request.merchant_id, key);
    }
}

/// Whether a stored key was claimed for this very request.
fn same(stored: &StoredKey, request: &Request, route: &str) -> bool {
    stored.fingerprint == request.fingerprint && stored.request_path == route
}

/// The saved answer of a key just read from the database, if it is
/// completed; it is remembered in the cache until the row's deadline.
fn remember(
    state: &AppState,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    stored: StoredKey,
) -> Option<Arc<CachedAnswer>> {
    let answer = match (stored.status, stored.response) {
        (KeyStatus::Completed, Some(response)) => Arc::new(CachedAnswer {
            route: stored.request_path,
            fingerprint: stored.fingerprint,
            response,
            deadline: stored.deadline,
        }),
        _ => return None,
    };
    state
        .caches
        .remember_answer(merchant_id, key.as_str(), answer.clone());
    Some(answer)
}

/// Answers a request from a completed key: `422` if it asks for something
/// else, else the saved answer, replayed.
fn answer_from(
    request: &Request,
    key: &IdempotencyKey,
    route: &str,
    answer: &CachedAnswer,
    waited: bool,
) -> Result<Begun, ApiError> {
    if answer.fingerprint != request.fingerprint || answer.route != route {
        metrics::idempotency("reused");
        return Err(reused(key));
    }
    metrics::idempotency("replayed");
    // The clone shares the body with the cache.
    Ok(Begun::Answered(replay(answer.response.clone(), waited)))
}

/// The answer for a resource someone else (the sweeper, a retry) settled
/// while this request was working: what its key saved, if it has a key.
pub async fn saved_answer(
    state: &AppState,
    resource: &Resource,
) -> Result<Option<Response>, ApiError> {
    Ok(keys::saved_for_resource(&state.pool, resource)
        .await?
        .map(send))
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

fn replay(saved: SavedResponse, waited: bool) -> Response {
    let mut response = send(saved);
    response
        .headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    if waited {
        response
            .headers_mut()
            .insert("preference-applied", HeaderValue::from_static("wait"));
    }
    response
}

fn reused(key: &IdempotencyKey) -> ApiError {
    Problem::new(ProblemCode::IdempotencyKeyReused, format!(
            "Keys are for one operation only: '{}' was used with different parameters. Use a new key for a new operation.",
            key.as_str()
        ),
    )
    .with_param("Idempotency-Key")
    .into()
}

fn in_use(waited: bool) -> ApiError {
    let detail = if waited {
        "A request with this Idempotency-Key is still in progress and did not finish within the wait."
    } else {
        "A request with this Idempotency-Key is still in progress. Retry later, or send 'Prefer: wait=5'."
    };
    Problem::new(ProblemCode::IdempotencyKeyInUse, detail)
        .with_retry_after(retry_after::SOON)
        .into()
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
    if key.is_none() && state.config.idempotency_key_required {
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
