//! Workshop routes: the effect counter (`GET /demo/effects`), the lab page
//! (`GET /lab`), and, only with `DEMO_UNSAFE_ENDPOINTS=true`, the
//! deliberately broken `POST /demo/naive/charges`.

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use super::AppState;
use super::auth::Authenticated;
use super::extract::{RawBody, decode};
use super::idempotent::{self, REPLAYED};
use super::problem::{ApiError, Problem};
use crate::charges::NewCharge;
use crate::demo;

/// The lab page: one self-contained file, no build step, nothing from the internet.
const LAB_PAGE: &str = include_str!("../../static/lab.html");

pub fn router(unsafe_endpoints: bool) -> Router<AppState> {
    let router = Router::new()
        .route("/lab", get(lab))
        .route("/demo/effects", get(effects));
    if unsafe_endpoints {
        router.route("/demo/naive/charges", post(naive_charge))
    } else {
        router
    }
}

async fn lab() -> Html<&'static str> {
    Html(LAB_PAGE)
}

/// `GET /demo/effects?run=TAG`: what the database holds for the merchant's
/// charges tagged `metadata[demo_run]=TAG` (all its charges without `run`):
/// payments recorded by the processor (money moved) and charges by status.
async fn effects(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Json<serde_json::Value>, ApiError> {
    let mut run = None;
    for (name, value) in form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "run" if !value.contains('\0') => run = Some(value.into_owned()),
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
    let counts = demo::effects(&state.pool, merchant.id, run.as_deref()).await?;
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
async fn naive_charge(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let Some(key) = idempotent::key_from_headers(&state, &headers)? else {
        return Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
            "The naive endpoint demonstrates keys; send an Idempotency-Key.",
        )
        .into());
    };
    let charge = NewCharge::from_params(decode(&headers, &body)?)?;
    // 1. Look the key up. (Bug: nothing stops a second request from looking too.)
    if let Some(saved) = demo::naive_lookup(&state.pool, merchant.id, key.as_str()).await? {
        let mut response = idempotent::send(saved);
        response
            .headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
        return Ok(response);
    }
    // 2. Do the work: the same charge and processor code as the real path.
    let saved = demo::naive_charge(&state, merchant.id, &charge).await?;
    // 3. Write the key, after the work. (Bug: too late to stop a duplicate.)
    demo::naive_remember(&state.pool, merchant.id, key.as_str(), &saved).await?;
    Ok(idempotent::send(saved))
}
