//! Workshop routes: the effect counter (`GET /demo/effects`), the lab page
//! (`GET /lab`), and, only with `DEMO_UNSAFE_ENDPOINTS=true`, the
//! deliberately broken `POST /demo/naive/charges` and the webhook receivers
//! (see [`super::receiver`]).

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{Html, Response};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Authenticated;
use super::extract::{RawBody, decode};
use super::idempotent::{self, REPLAYED};
use super::problem::ApiError;
use crate::app::AppState;
use crate::charges::NewCharge;
use crate::params::ParamError;
use crate::problem::{Problem, ProblemCode};
use crate::workshop;

/// The lab page: one self-contained file, no build step, nothing from the internet.
const LAB_PAGE: &str = include_str!("../../static/lab.html");

pub fn router(unsafe_endpoints: bool) -> OpenApiRouter<AppState> {
    let router = OpenApiRouter::new()
        .routes(routes!(lab))
        .routes(routes!(effects));
    if unsafe_endpoints {
        router
            .routes(routes!(naive_charge))
            .merge(super::receiver::router())
    } else {
        router
    }
}

/// The workshop's lab page (HTML, self-contained).
#[utoipa::path(get, path = "/lab", tag = "workshop",
    responses((status = 200, description = "The lab page", content_type = "text/html")))]
async fn lab() -> Html<&'static str> {
    Html(LAB_PAGE)
}

/// `GET /demo/effects?run=TAG`: what the database holds for the merchant's
/// charges tagged `metadata[demo_run]=TAG`: payments recorded by the
/// processor (money moved) and charges by status. `run` is required: a count
/// over all of a merchant's charges would read its whole history.
/// Payments and charges in the database for a workshop run.
#[utoipa::path(
    get,
    path = "/demo/effects",
    tag = "workshop",
    security(("bearer" = []), ("basic" = [])),
    params(("run" = String, Query, description = "The run tag, `metadata[demo_run]`")),
    responses(
        (status = 200, description = "The counts", body = super::openapi::Effects),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
async fn effects(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Json<serde_json::Value>, ApiError> {
    let mut run = None;
    for (name, value) in form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "run" if !value.contains('\0') => run = Some(value.into_owned()),
            other => return Err(ParamError::unknown(other).into()),
        }
    }
    let run = run.ok_or_else(|| {
        ParamError::new(
            ProblemCode::ParameterMissing,
            "run",
            "Missing required param: run (the metadata[demo_run] tag of the charges to count)",
        )
    })?;
    let counts = workshop::effects(&state.pool, merchant.id, &run).await?;
    Ok(Json(json!({
        "object": "demo_effects",
        "run": run,
        "payments": counts.payments,
        "charges": counts.charges,
        "succeeded": counts.succeeded,
        "failed": counts.failed,
        "pending": counts.pending,
    })))
}

/// THE CLASSIC BUG, ON PURPOSE. Look the key up, do the work, then write the
/// key: two requests that both look before either writes both do the work.
/// The real endpoint claims the key first, atomically; see `charges.rs`.
/// WRONG ON PURPOSE, for teaching (only with `DEMO_UNSAFE_ENDPOINTS=true`):
/// looks the key up, does the work, then writes the key, so two requests at
/// once both charge.
#[utoipa::path(
    post,
    path = "/demo/naive/charges",
    tag = "workshop",
    security(("bearer" = []), ("basic" = [])),
    params(("Idempotency-Key" = String, Header, description = "Required here")),
    request_body(content(
        (super::openapi::CreateCharge = "application/json"),
        (super::openapi::CreateCharge = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Charged, or looked up", body = super::openapi::Charge),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 402, response = super::openapi::PaymentFailed),
        (status = 413, response = super::openapi::TooLarge),
        (status = 415, response = super::openapi::UnsupportedMediaType),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
async fn naive_charge(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let Some(key) = idempotent::key_from_headers(&state, &headers)? else {
        return Err(Problem::new(
            ProblemCode::IdempotencyKeyMissing,
            "The naive endpoint demonstrates keys; send an Idempotency-Key.",
        )
        .into());
    };
    super::faults::from_headers(&state, &headers)?;
    let charge = NewCharge::from_params(decode(&headers, &body)?)?;
    // 1. Look the key up. (Bug: nothing stops a second request from looking too.)
    if let Some(saved) = workshop::naive_lookup(&state.pool, merchant.id, key.as_str()).await? {
        let mut response = idempotent::send(saved);
        response
            .headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
        return Ok(response);
    }
    // 2. Do the work: the same charge and processor code as the real path.
    let request_id = headers
        .get(super::observe::REQUEST_ID)
        .and_then(|v| v.to_str().ok());
    let (charge_id, saved) = workshop::naive_charge(&state, merchant.id, &charge, request_id)
        .await
        .map_err(|e| crate::error::Error::from_recovery(e, &state.config))?;
    // 3. Write the key, after the work. (Bug: too late to stop a duplicate.)
    workshop::naive_remember(&state.pool, merchant.id, key.as_str(), &charge_id, &saved).await?;
    Ok(idempotent::send(saved))
}
