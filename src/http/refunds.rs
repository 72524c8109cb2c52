//! `POST /v1/refunds`, `GET /v1/refunds/{id}`.
//!
//! Creating a refund is the exactly-once flow of charges, with one more
//! decision in step 2:
//! 1. authenticate, parse, validate, fingerprint: nothing is written yet;
//! 2. one transaction: claim the key, reserve the amount on the charge with
//!    one conditional update (which decides any race between refunds), and
//!    write the refund as `pending`; if nothing could be reserved, roll back
//!    and say why;
//! 3. call the processor, outside any transaction;
//! 4. one transaction: mark the refund succeeded if still pending, save the
//!    response on the key (see [`crate::refunds::settle`]).

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Authenticated;
use super::extract::{PathParam, RawBody, decode};
use super::idempotent::{self, Begun, Request};
use super::problem::ApiError;
use crate::app::AppState;
use crate::charges::settle::Settled;
use crate::charges::{ChargeStatus, store as charges};
use crate::faults::{self, Fault};
use crate::idempotency::{Fingerprint, Resource};
use crate::params::shorten;
use crate::problem::{Problem, ProblemCode};
use crate::processor::ProcessorError;
use crate::refunds::domain::new_refund_id;
use crate::refunds::settle::{self, Pending};
use crate::refunds::{NewRefund, store};
use crate::retry_after;

const ROUTE: &str = "/v1/refunds";

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create))
        .routes(routes!(retrieve))
}

/// Refunds a succeeded charge, in part or in full, exactly once per key and
/// never more than was charged.
#[utoipa::path(
    post,
    path = "/v1/refunds",
    tag = "refunds",
    security(("bearer" = []), ("basic" = [])),
    params(super::openapi::IdempotencyHeaders),
    request_body(content(
        (super::openapi::CreateRefund = "application/json"),
        (super::openapi::CreateRefund = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Refunded (or the saved answer, with `Idempotent-Replayed: true`)", body = super::openapi::Refund,
         headers(("Location" = String, description = "/v1/refunds/{id}"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
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
    let new_refund = NewRefund::from_params(decode(&headers, &body)?)?;
    let fingerprint = Fingerprint::of("POST", ROUTE, &new_refund.canonical());
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
            claim_and_refund(state, request, new_refund, fault)
                .instrument(tracing::Span::current()),
        )
        .await
        .map_err(|e| ApiError::internal(anyhow::Error::new(e).context("refund task failed")))?
}

async fn claim_and_refund(
    state: AppState,
    request: Request,
    new_refund: NewRefund,
    fault: Option<Fault>,
) -> Result<Response, ApiError> {
    let refund_id = new_refund_id();
    let resource = Resource::Refund(refund_id.clone());
    let merchant_id = request.merchant_id;

    // 2. Claim the key, reserve the amount and write the pending refund, in
    // one transaction.
    let mut tx = match idempotent::begin(&state, &request, ROUTE, &resource).await? {
        Begun::Claimed(tx) => tx,
        Begun::Answered(response) => return Ok(response),
    };
    let amount = new_refund.amount.map(|a| a.minor_units());
    let Some(reserved) = store::reserve(&mut tx, merchant_id, &new_refund.charge, amount).await?
    else {
        // Refused before the work: the claim goes with the rollback.
        tx.rollback().await?;
        return Err(refused(&state, merchant_id, &new_refund).await);
    };
    store::insert_pending(&mut tx, &refund_id, merchant_id, &new_refund, &reserved).await?;
    tx.commit().await?;
    faults::crash_if(fault, Fault::CrashAfterClaim);

    // 3 and 4.
    let refund = Pending {
        id: refund_id,
        charge_id: new_refund.charge,
        amount: reserved.amount,
        currency: reserved.currency,
    };
    let config = state.config.clone();
    let answer = refund_and_settle(state.clone(), refund, fault)
        .await
        .map_err(|e| ApiError(e.0.awaiting_recovery(&config)));
    idempotent::finished(&state, &request);
    answer
}

async fn refund_and_settle(
    state: AppState,
    refund: Pending,
    fault: Option<Fault>,
) -> Result<Response, ApiError> {
    let refund_id = refund.id.clone();
    let outcome = settle::refund_at_processor(state.processor.as_ref(), &refund).await;
    faults::crash_if(fault, Fault::CrashAfterProcessor);
    match outcome {
        // Refunded, or refused for good by the card's issuer: either way the
        // outcome is recorded and final, and settling saves it on the key.
        Ok(outcome) => match settle::settle(
            &state.pool,
            &refund_id,
            &outcome,
            state.config.idempotency_key_ttl,
        )
        .await?
        {
            Settled::Now(response) => Ok(idempotent::send(response)),
            // Recovery settled it while the processor was answering; both
            // wrote the same recorded outcome.
            Settled::Already => settled_elsewhere(&state, &refund_id).await,
        },
        Err(ProcessorError::Unavailable) => {
            // Unlike a charge, a reserved refund is never given back: the
            // money was promised, and a recovery may already be re-driving
            // the idempotent refund call, so giving the amount back here could
            // leave money refunded at the processor with no record. The claim
            // stays; the sweeper (or a retry after PROCESSING_TIMEOUT) rolls
            // the refund forward once the processor answers.
            tracing::warn!(refund = %refund_id, "processor unavailable; the refund stays reserved");
            Err(Problem::new(ProblemCode::ProcessorUnavailable, "The card processor is unavailable. The refund is reserved and will be completed; retry with the same Idempotency-Key to get it.",
            )
            .with_extra("refund", refund_id.clone())
            .with_retry_after(retry_after::until_recovered(&state.config))
            .into())
        }
        Err(e @ ProcessorError::OutcomeUnknown(_)) => {
            // The refund may be recorded: keep the claim and the reservation;
            // recovery repeats the idempotent refund and settles it.
            tracing::warn!(refund = %refund_id, error = format!("{:#}", anyhow::Error::new(e)), "processor outcome unknown");
            Err(Problem::new(ProblemCode::ProcessingOutcomeUnknown, "The card processor did not confirm the refund. Retry with the same Idempotency-Key to get it.",
            )
            .with_extra("refund", refund_id.clone())
            .with_retry_after(retry_after::until_recovered(&state.config))
            .into())
        }
    }
}

/// Why nothing could be reserved, read after the update decided. The charge
/// may have changed since; the answer describes what the update saw as well
/// as a later read can.
async fn refused(state: &AppState, merchant_id: Uuid, refund: &NewRefund) -> ApiError {
    let charge = match charges::find(&state.pool, merchant_id, &refund.charge).await {
        Ok(Some(charge)) => charge,
        Ok(None) => {
            return Problem::new(
                ProblemCode::ResourceMissing,
                format!("No such charge: '{}'", shorten(&refund.charge)),
            )
            .with_param("charge")
            .into();
        }
        Err(e) => return e.into(),
    };
    let problem = if charge.status != ChargeStatus::Succeeded.as_str() {
        Problem::new(
            ProblemCode::ChargeNotRefundable,
            format!(
                "Charge {} is {}: only a succeeded charge can be refunded.",
                charge.id, charge.status
            ),
        )
        .with_param("charge")
    } else if charge.amount_refunded >= charge.amount {
        Problem::new(
            ProblemCode::ChargeAlreadyRefunded,
            format!("Charge {} has already been refunded in full.", charge.id),
        )
        .with_param("charge")
    } else {
        Problem::new(
            ProblemCode::AmountTooLarge,
            format!(
                "Refund amount is greater than what is left to refund on charge {} ({}).",
                charge.id,
                charge.amount - charge.amount_refunded
            ),
        )
        .with_param("amount")
    };
    problem.into()
}

/// The answer for a refund someone else settled: its key's saved response,
/// or, for a refund made without a key, the refund rendered afresh.
async fn settled_elsewhere(state: &AppState, refund_id: &str) -> Result<Response, ApiError> {
    let resource = Resource::Refund(refund_id.to_owned());
    if let Some(response) = idempotent::saved_answer(state, &resource).await? {
        return Ok(response);
    }
    let refund = store::find_any(&state.pool, refund_id)
        .await?
        .ok_or_else(|| {
            ApiError::internal(anyhow::anyhow!("settled refund {refund_id} vanished"))
        })?;
    Ok(idempotent::send(settle::response_for(&refund)))
}

/// One of the merchant's refunds.
#[utoipa::path(
    get,
    path = "/v1/refunds/{id}",
    tag = "refunds",
    security(("bearer" = []), ("basic" = [])),
    params(("id" = String, Path, description = "A refund id, `re_...`")),
    responses(
        (status = 200, description = "The refund", body = super::openapi::Refund),
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
        Some(refund) => Ok(Json(refund.to_object()).into_response()),
        None => Err(Problem::with_status(
            StatusCode::NOT_FOUND,
            ProblemCode::ResourceMissing,
            format!("No such refund: '{}'", shorten(&id)),
        )
        .with_param("id")
        .into()),
    }
}
