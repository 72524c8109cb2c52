//! `POST /v1/charges`, `GET /v1/charges/{id}`, `GET /v1/charges`.
//!
//! Creating a charge is the exactly-once flow:
//! 1. authenticate, parse, validate, fingerprint: nothing is written yet;
//! 2. one transaction: claim the key and write the charge as `pending`;
//! 3. call the processor, outside any transaction;
//! 4. one transaction: settle the charge if still pending, save the response
//!    on the key (see [`crate::charges::settle`]).

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Authenticated;
use super::extract::{PathParam, RawBody, decode};
use super::idempotent::{self, Begun, Request};
use super::problem::ApiError;
use crate::app::AppState;
use crate::charges::domain::new_charge_id;
use crate::charges::settle::{self, Settled};
use crate::charges::{NewCharge, store};
use crate::faults::{self, Fault};
use crate::idempotency::{Fingerprint, Resource, store as keys};
use crate::params::{ParamError, shorten};
use crate::problem::{Problem, ProblemCode};
use crate::processor::{self, Authorization, ProcessorError};
use crate::retry_after;

const ROUTE: &str = "/v1/charges";

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(retrieve))
}

/// Charges a card, exactly once per `Idempotency-Key`.
#[utoipa::path(
    post,
    path = "/v1/charges",
    tag = "charges",
    security(("bearer" = []), ("basic" = [])),
    params(super::openapi::IdempotencyHeaders),
    request_body(content(
        (super::openapi::CreateCharge = "application/json"),
        (super::openapi::CreateCharge = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Charged (or the saved answer, with `Idempotent-Replayed: true`)", body = super::openapi::Charge,
         headers(("Location" = String, description = "/v1/charges/{id}"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 402, response = super::openapi::PaymentFailed),
        (status = 409, response = super::openapi::InFlight),
        (status = 413, response = super::openapi::TooLarge),
        (status = 415, response = super::openapi::UnsupportedMediaType),
        (status = 422, response = super::openapi::KeyReused),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
async fn create(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    // 1. Everything that can refuse the request, before anything is written.
    let key = idempotent::key_from_headers(&state, &headers)?;
    let fault = super::faults::from_headers(&state, &headers)?;
    let new_charge = NewCharge::from_params(decode(&headers, &body)?)?;
    let fingerprint = Fingerprint::of("POST", ROUTE, &new_charge.canonical());
    let wait = idempotent::prefer_wait(&headers);

    // Steps 2 to 4 run in their own task: once the claim may have committed,
    // a client that hangs up must not cancel the work half-way. Only a wait
    // for a key in flight stops then.
    let client_gone = CancellationToken::new();
    let _hang_up = idempotent::hang_up_guard(&client_gone);
    let request = Request {
        merchant_id: merchant.id,
        key,
        fingerprint,
        wait,
        client_gone,
    };
    state
        .tasks
        .clone()
        .spawn(
            claim_and_charge(state, request, new_charge, fault)
                .instrument(tracing::Span::current()),
        )
        .await
        .map_err(|e| ApiError::internal(anyhow::Error::new(e).context("charge task failed")))?
}

async fn claim_and_charge(
    state: AppState,
    request: Request,
    charge: NewCharge,
    fault: Option<Fault>,
) -> Result<Response, ApiError> {
    let charge_id = new_charge_id();
    let resource = Resource::Charge(charge_id.clone());

    // 2. Claim the key and write the pending charge, in one transaction.
    let mut tx = match idempotent::begin(&state, &request, ROUTE, &resource).await? {
        Begun::Claimed(tx) => tx,
        Begun::Answered(response) => return Ok(response),
    };
    store::insert_pending(&mut tx, &charge_id, request.merchant_id, &charge).await?;
    tx.commit().await?;
    faults::crash_if(fault, Fault::CrashAfterClaim);

    // 3 and 4. From here on the charge is pending: a failure leaves it to
    // recovery.
    let config = state.config.clone();
    let answer = authorize_and_settle(state.clone(), charge_id, charge, fault)
        .await
        .map_err(|e| ApiError(e.0.awaiting_recovery(&config)));
    idempotent::finished(&state, &request);
    answer
}

async fn authorize_and_settle(
    state: AppState,
    charge_id: String,
    charge: NewCharge,
    fault: Option<Fault>,
) -> Result<Response, ApiError> {
    let processor_key = processor::authorization_key(&charge_id);
    let authorization = Authorization {
        processor_key: &processor_key,
        amount: charge.amount.minor_units(),
        currency: charge.currency.as_str(),
        source: charge.source,
    };
    let outcome = state.processor.authorize(authorization).await;
    faults::crash_if(fault, Fault::CrashAfterProcessor);
    match outcome {
        Ok(outcome) => match settle::settle(
            &state.pool,
            &charge_id,
            &outcome,
            state.config.idempotency_key_ttl,
        )
        .await?
        {
            Settled::Now(response) => Ok(idempotent::send(response)),
            // The sweeper (or a retry) settled it while the processor was
            // answering: what it saved is the answer, since both came from
            // the one processor record.
            Settled::Already => settled_elsewhere(&state, &charge_id).await,
        },
        Err(ProcessorError::Unavailable) => {
            // Nothing was recorded: give the key back so a retry runs anew.
            // The charge goes first, in the same lock order as settling; if
            // it is no longer pending, the sweeper settled it meanwhile and
            // that answer stands.
            let mut tx = state.pool.begin().await?;
            if store::delete_pending(&mut tx, &charge_id).await? == 0 {
                tx.rollback().await?;
                return settled_elsewhere(&state, &charge_id).await;
            }
            keys::release(&mut tx, &Resource::Charge(charge_id.clone())).await?;
            tx.commit().await?;
            Err(Problem::new(ProblemCode::ProcessorUnavailable, "The card processor is unavailable and nothing was charged. Retry with the same Idempotency-Key.",
            )
            .with_retry_after(retry_after::SOON)
            .into())
        }
        Err(e @ ProcessorError::OutcomeUnknown(_)) => {
            // Money may have moved: keep the claim; the sweeper (or a retry
            // after PROCESSING_TIMEOUT) settles the charge from the
            // processor's record, and later retries replay that.
            tracing::warn!(charge = %charge_id, error = format!("{:#}", anyhow::Error::new(e)), "processor outcome unknown");
            Err(Problem::new(ProblemCode::ProcessingOutcomeUnknown, "The card processor did not confirm the outcome. Retry with the same Idempotency-Key to get it.",
            )
            .with_extra("charge", charge_id.clone())
            .with_retry_after(retry_after::until_recovered(&state.config))
            .into())
        }
    }
}

/// The answer for a charge someone else settled: its key's saved response,
/// or, for a charge made without a key, the charge rendered afresh.
async fn settled_elsewhere(state: &AppState, charge_id: &str) -> Result<Response, ApiError> {
    let resource = Resource::Charge(charge_id.to_owned());
    if let Some(response) = idempotent::saved_answer(state, &resource).await? {
        return Ok(response);
    }
    let charge = store::find_any(&state.pool, charge_id)
        .await?
        .ok_or_else(|| {
            ApiError::internal(anyhow::anyhow!("settled charge {charge_id} vanished"))
        })?;
    Ok(idempotent::send(settle::response_for(&charge)))
}

/// One of the merchant's charges.
#[utoipa::path(
    get,
    path = "/v1/charges/{id}",
    tag = "charges",
    security(("bearer" = []), ("basic" = [])),
    params(("id" = String, Path, description = "A charge id, `ch_...`")),
    responses(
        (status = 200, description = "The charge", body = super::openapi::Charge),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 404, response = super::openapi::NotFound),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
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
    Problem::with_status(
        status,
        ProblemCode::ResourceMissing,
        format!("No such charge: '{}'", shorten(id)),
    )
    .with_param(param)
    .into()
}

/// The merchant's charges, newest first.
#[utoipa::path(
    get,
    path = "/v1/charges",
    tag = "charges",
    security(("bearer" = []), ("basic" = [])),
    params(
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 100, description = "1 to 100, default 10"),
        ("starting_after" = Option<String>, Query, description = "A charge id from the previous page")
    ),
    responses(
        (status = 200, description = "A list object", body = super::openapi::ChargeList),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
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
                            ProblemCode::ParameterInvalidInteger,
                            "limit must be a whole number from 1 to 100",
                        )
                        .with_param("limit")
                    })?;
            }
            // No id contains NUL (and Postgres text cannot hold it).
            "starting_after" if value.contains('\0') => {
                return Err(no_such_charge("\\u0000", "starting_after"));
            }
            "starting_after" => starting_after = Some(value.into_owned()),
            other => return Err(ParamError::unknown(other).into()),
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
