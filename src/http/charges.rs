//! `POST /v1/charges`, `GET /v1/charges/{id}`, `GET /v1/charges`.
//!
//! Creating a charge is the exactly-once flow:
//! 1. authenticate, parse, validate, fingerprint: nothing is written yet;
//! 2. one transaction: claim the key and write the charge as `pending`;
//! 3. call the processor, outside any transaction;
//! 4. one transaction: settle the charge if still pending, save the response
//!    on the key (see [`crate::charges::settle`]).

use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use tokio::time::Instant;
use tracing::Instrument;

use super::AppState;
use super::auth::Authenticated;
use super::extract::{PathParam, RawBody, decode};
use super::problem::{ApiError, Problem};
use crate::charges::domain::new_charge_id;
use crate::charges::settle::{Settled, response_for, settle};
use crate::charges::{NewCharge, store};
use crate::idempotency::{
    Claim, ClaimOutcome, Fingerprint, IdempotencyKey, KeyStatus, SavedResponse, store as keys,
};
use crate::processor::{self, Authorization, ProcessorError};

const ROUTE: &str = "/v1/charges";
/// The longest `Prefer: wait=N` honoured, in seconds.
const MAX_WAIT_SECS: u64 = 10;
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

pub fn router() -> Router<AppState> {
    Router::new()
        .route(ROUTE, get(list).post(create))
        .route("/v1/charges/{id}", get(retrieve))
}

#[tracing::instrument(name = "create_charge", skip_all, fields(merchant = %merchant.id, idempotency_key))]
async fn create(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    // 1. Everything that can refuse the request, before anything is written.
    let key = IdempotencyKey::from_headers(&headers).map_err(|e| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
            e.to_string(),
        )
        .with_param("Idempotency-Key")
    })?;
    if let Some(key) = &key {
        tracing::Span::current().record("idempotency_key", key.as_str());
    }
    if key.is_none() && state.config.idempotency_key_required {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
            "This server requires an Idempotency-Key header on POST requests.",
        )
        .into());
    }
    let new_charge = NewCharge::from_params(decode(&headers, &body)?)?;
    let fingerprint = Fingerprint::of("POST", ROUTE, &new_charge.canonical());
    let wait = prefer_wait(&headers);
    let charge_id = new_charge_id();

    // 2. Claim the key and write the pending charge, in one transaction.
    let deadline = Instant::now() + wait;
    let mut poll = Duration::from_millis(20);
    loop {
        let mut tx = state.pool.begin().await?;
        if let Some(key) = &key {
            let claim = Claim {
                merchant_id: merchant.id,
                key,
                method: "POST",
                path: ROUTE,
                fingerprint,
                charge_id: &charge_id,
                ttl: state.config.idempotency_key_ttl,
            };
            if let ClaimOutcome::Taken(stored) = keys::claim(&mut tx, claim).await? {
                tx.rollback().await?;
                if stored.fingerprint != fingerprint {
                    return Err(reused(key));
                }
                if let (KeyStatus::Completed, Some(saved)) = (stored.status, stored.response) {
                    tracing::info!(charge = ?stored.charge_id, "replaying a completed key");
                    return Ok(replay(saved, !wait.is_zero()));
                }
                if Instant::now() + poll <= deadline {
                    tokio::time::sleep(poll).await;
                    poll = (poll * 2).min(Duration::from_millis(250));
                    continue;
                }
                return Err(in_use(!wait.is_zero()));
            }
        }
        store::insert_pending(&mut tx, &charge_id, merchant.id, &new_charge).await?;
        tx.commit().await?;
        break;
    }

    // 3 and 4 run in their own task: if the client goes away now, the
    // charge is still carried through to a definite outcome.
    let work = tokio::spawn(
        authorize_and_settle(state.clone(), charge_id, new_charge)
            .instrument(tracing::Span::current()),
    );
    let response = work
        .await
        .map_err(|e| ApiError::Internal(anyhow::Error::new(e).context("charge task failed")))??;
    Ok(response)
}

async fn authorize_and_settle(
    state: AppState,
    charge_id: String,
    charge: NewCharge,
) -> Result<Response, ApiError> {
    let processor_key = processor::authorization_key(&charge_id);
    let authorization = Authorization {
        processor_key: &processor_key,
        amount: charge.amount.minor_units(),
        currency: charge.currency.as_str(),
        source: charge.source,
    };
    match state.processor.authorize(authorization).await {
        Ok(outcome) => match settle(&state.pool, &charge_id, &outcome).await? {
            Settled::Now(response) => Ok(send(response)),
            // The sweeper settled it while the processor was answering: what
            // it saved is the answer (both came from the one processor record).
            Settled::Already => stored_response(&state, &charge_id).await,
        },
        Err(ProcessorError::Unavailable) => {
            // Nothing was recorded: give the key back so a retry runs anew.
            let mut tx = state.pool.begin().await?;
            keys::release(&mut tx, &charge_id).await?;
            store::delete_pending(&mut tx, &charge_id).await?;
            tx.commit().await?;
            Err(Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "processor_unavailable",
                "The card processor is unavailable and nothing was charged. Retry with the same Idempotency-Key.",
            )
            .with_header(header::RETRY_AFTER, "1")
            .into())
        }
        Err(e @ ProcessorError::OutcomeUnknown(_)) => {
            // Money may have moved: keep the claim; the sweeper will settle
            // the charge from the processor's record, and a retry will replay.
            tracing::warn!(charge = %charge_id, error = format!("{:#}", anyhow::Error::new(e)), "processor outcome unknown");
            Err(Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "processing_outcome_unknown",
                "The card processor did not confirm the outcome. Retry with the same Idempotency-Key to get it.",
            )
            .with_extra("charge", charge_id.clone())
            .with_header(header::RETRY_AFTER, "5")
            .into())
        }
    }
}

/// The response of a charge someone else settled: its key's saved response,
/// or, for a charge made without a key, the charge rendered afresh.
async fn stored_response(state: &AppState, charge_id: &str) -> Result<Response, ApiError> {
    let saved: Option<(i16, String, Option<String>, Vec<u8>)> = sqlx::query_as(
        "SELECT response_status, response_content_type, response_location, response_body
           FROM idempotency_keys WHERE charge_id = $1 AND status = 'completed'",
    )
    .bind(charge_id)
    .fetch_optional(&state.pool)
    .await?;
    if let Some((status, content_type, location, body)) = saved {
        let status = u16::try_from(status).map_err(|e| ApiError::Internal(e.into()))?;
        return Ok(send(SavedResponse {
            status,
            content_type,
            location,
            body,
        }));
    }
    let charge = store::find_any(&state.pool, charge_id)
        .await?
        .ok_or_else(|| {
            ApiError::Internal(anyhow::anyhow!("settled charge {charge_id} vanished"))
        })?;
    Ok(send(response_for(&charge)))
}

/// Sends a saved response exactly as saved.
fn send(saved: SavedResponse) -> Response {
    let status = StatusCode::from_u16(saved.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, saved.body).into_response();
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(&saved.content_type) {
        headers.insert(header::CONTENT_TYPE, value);
    }
    if let Some(value) = saved.location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        headers.insert(header::LOCATION, value);
    }
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
        .with_header(header::RETRY_AFTER, "1")
        .into()
}

/// `Prefer: wait=N` (RFC 7240): how long to wait for a request in flight
/// with the same key, at most ten seconds. Zero when absent or malformed.
fn prefer_wait(headers: &HeaderMap) -> Duration {
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

async fn retrieve(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    match store::find(&state.pool, merchant.id, &id).await? {
        Some(charge) => Ok(Json(charge.to_object()).into_response()),
        None => Err(no_such_charge(&id, "id")),
    }
}

fn no_such_charge(id: &str, param: &str) -> ApiError {
    let status = if param == "id" {
        StatusCode::NOT_FOUND
    } else {
        StatusCode::BAD_REQUEST
    };
    Problem::new(
        status,
        "resource_missing",
        format!("No such charge: '{id}'"),
    )
    .with_param(param)
    .into()
}

async fn list(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let mut limit = 10_i64;
    let mut starting_after = None;
    for (name, value) in form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|l| (1..=100).contains(l))
                    .ok_or_else(|| {
                        Problem::new(
                            StatusCode::BAD_REQUEST,
                            "parameter_invalid_integer",
                            "limit must be a whole number from 1 to 100",
                        )
                        .with_param("limit")
                    })?;
            }
            "starting_after" => starting_after = Some(value.into_owned()),
            other => {
                return Err(Problem::new(
                    StatusCode::BAD_REQUEST,
                    "parameter_unknown",
                    format!("Received unknown parameter: {other}"),
                )
                .with_param(other)
                .into());
            }
        }
    }
    let cursor = match &starting_after {
        Some(id) => Some(
            store::find(&state.pool, merchant.id, id)
                .await?
                .ok_or_else(|| no_such_charge(id, "starting_after"))?,
        ),
        None => None,
    };
    let mut charges = store::list(&state.pool, merchant.id, cursor.as_ref(), limit + 1).await?;
    let has_more = charges.len() as i64 > limit;
    charges.truncate(limit as usize);
    let data: Vec<_> = charges.iter().map(|c| c.to_object()).collect();
    Ok(Json(json!({
        "object": "list",
        "url": ROUTE,
        "has_more": has_more,
        "data": data,
    }))
    .into_response())
}
