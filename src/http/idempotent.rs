//! Step 2 of every idempotent `POST`, whatever the resource: claim the key in
//! a transaction the caller then adds its business write to, or answer from
//! what the key already holds (replay, `409`, `422`).

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sqlx::{Postgres, Transaction};
use tokio::time::Instant;
use uuid::Uuid;

use super::AppState;
use super::problem::{ApiError, Problem};
use super::retry_after;
use crate::cache::CachedAnswer;
use crate::idempotency::{
    Claim, ClaimOutcome, Fingerprint, IdempotencyKey, KeyStatus, Resource, SavedResponse,
    StoredKey, store as keys,
};
use crate::metrics;

pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
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
}

/// The result of step 2's opening.
pub enum Begun {
    /// The key is ours (or there is none): write the business record in
    /// this transaction and commit.
    Claimed(Transaction<'static, Postgres>),
    /// The key was taken: this is the answer.
    Answered(Response),
}

/// Opens step 2 for `resource` on `route`: a transaction holding the claim
/// on the request's key, a plain transaction when it has none, or the
/// answer the key already holds.
///
/// When the key is held by a request that has been `processing` for longer
/// than `PROCESSING_TIMEOUT`, this request leases it (one conditional update,
/// as the sweeper does) and settles its record by the sweeper's own
/// procedure ([`crate::sweeper::recover`]); then it answers from the key.
pub async fn begin(
    state: &AppState,
    request: &Request,
    route: &'static str,
    resource: &Resource,
) -> Result<Begun, ApiError> {
    let Some(key) = &request.key else {
        return Ok(Begun::Claimed(state.pool.begin().await?));
    };
    // The fast path for a retry of a finished operation: a completed key
    // cannot change until it expires, so it is answered from memory or from
    // one plain read, with no transaction and no row lock.
    if let Some(answer) = cached_or_completed(state, request.merchant_id, key).await? {
        return answer_from(state, request, key, route, answer, false);
    }
    let deadline = Instant::now() + request.wait;
    let mut poll = Duration::from_millis(20);
    let mut waited = false;
    loop {
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
        let stored = match keys::claim(&mut tx, claim).await? {
            ClaimOutcome::Claimed { took_over } => {
                metrics::idempotency(if took_over {
                    "expired_taken_over"
                } else {
                    "executed"
                });
                return Ok(Begun::Claimed(tx));
            }
            ClaimOutcome::Taken(stored) => stored,
        };
        tx.rollback().await?;
        let stored = *stored;
        if stored.status == KeyStatus::Completed {
            let answer = completed(stored).ok_or_else(|| {
                ApiError::Internal(anyhow::anyhow!("a completed key without its response"))
            })?;
            return answer_from(state, request, key, route, answer, waited);
        }
        if stored.fingerprint != request.fingerprint || stored.request_path != route {
            metrics::idempotency("reused");
            return Err(reused(key));
        }
        let stale = keys::lease_one(
            &state.pool,
            request.merchant_id,
            key,
            state.config.processing_timeout,
        )
        .await?;
        if let Some(stale) = stale {
            tracing::info!(resource = ?stale, "a retry found its key stale; settling it");
            crate::sweeper::recover(&state.pool, state.processor.as_ref(), &stale)
                .await
                .map_err(|e| ApiError::from_recovery(e, &state.config))?;
            metrics::idempotency("stale_recovered");
            continue;
        }
        let now = Instant::now();
        if now < deadline {
            tokio::time::sleep(poll.min(deadline - now)).await;
            poll = (poll * 2).min(Duration::from_millis(250));
            waited = true;
            continue;
        }
        metrics::idempotency("in_use");
        return Err(in_use(waited));
    }
}

/// A completed key's answer: from the cache, else from one read (which then
/// fills the cache). `None` when the key is not completed.
async fn cached_or_completed(
    state: &AppState,
    merchant_id: Uuid,
    key: &IdempotencyKey,
) -> Result<Option<CachedAnswer>, ApiError> {
    if let Some(answer) = state.caches.answer(merchant_id, key.as_str()) {
        return Ok(Some(answer));
    }
    let stored = keys::find_completed(&state.pool, merchant_id, key).await?;
    Ok(stored.and_then(completed))
}

/// The saved answer of a key, if it is completed.
fn completed(stored: StoredKey) -> Option<CachedAnswer> {
    match (stored.status, stored.response) {
        (KeyStatus::Completed, Some(response)) => Some(CachedAnswer {
            route: stored.request_path,
            fingerprint: stored.fingerprint,
            response,
            expires_at: stored.expires_at,
        }),
        _ => None,
    }
}

/// Answers a request from a completed key: `422` if it asks for something
/// else, else the saved answer, replayed (and remembered in the cache).
fn answer_from(
    state: &AppState,
    request: &Request,
    key: &IdempotencyKey,
    route: &str,
    answer: CachedAnswer,
    waited: bool,
) -> Result<Begun, ApiError> {
    if answer.fingerprint != request.fingerprint || answer.route != route {
        metrics::idempotency("reused");
        return Err(reused(key));
    }
    state
        .caches
        .remember_answer(request.merchant_id, key.as_str(), answer.clone());
    metrics::idempotency("replayed");
    Ok(Begun::Answered(replay(answer.response, waited)))
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

/// Sends a saved response exactly as saved.
pub fn send(saved: SavedResponse) -> Response {
    let status = StatusCode::from_u16(saved.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, saved.body).into_response();
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
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
        format!(
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
    Problem::new(StatusCode::CONFLICT, "idempotency_key_in_use", detail)
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
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            e.to_string(),
        )
        .with_param("Idempotency-Key")
    })?;
    if key.is_none() && state.config.idempotency_key_required {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
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
