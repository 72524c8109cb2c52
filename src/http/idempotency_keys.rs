//! `GET /v1/idempotency_keys/{key}`: what the server remembers of one of the
//! merchant's keys, so a client (or a workshop) can watch the flow.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde_json::{Value, json};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Authenticated;
use super::extract::NoQuery;
use super::extract::PathParam;
use super::problem::ApiError;
use crate::app::AppState;
use crate::idempotency::{IdempotencyKey, Resource, store};
use crate::problem::{Problem, ProblemCode};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(retrieve))
}

/// What the server remembers of one of the merchant's keys.
#[utoipa::path(
    get,
    path = "/v1/idempotency_keys/{key}",
    tag = "idempotency",
    params(("key" = String, Path, description = "The key, percent-encoded")),
    responses(
        (status = 200, description = "The key's state", body = super::openapi::IdempotencyKeyState),
        (status = 404, response = super::openapi::NotFound),
        super::openapi::Errors
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    _: NoQuery,
    PathParam(raw): PathParam,
) -> Result<Json<Value>, ApiError> {
    let key = IdempotencyKey::parse(raw.as_bytes()).map_err(|e| {
        Problem::new(ProblemCode::InvalidIdempotencyKey, e.to_string()).with_param("key")
    })?;
    let Some(stored) = store::find(&state.pool, merchant.id, &key).await? else {
        return Err(Problem::with_status(
            StatusCode::NOT_FOUND,
            ProblemCode::ResourceMissing,
            format!(
                "No such idempotency key: '{}' (unknown or expired)",
                key.as_str()
            ),
        )
        .with_param("key")
        .into());
    };
    Ok(Json(json!({
        "object": "idempotency_key",
        "key": stored.key,
        "status": stored.status.as_str(),
        "created_at": stored.created_at.timestamp(),
        "expires_at": stored.expires_at.timestamp(),
        "request": { "method": stored.request_method, "path": stored.request_path },
        "response": stored.response.map(|r| json!({ "status_code": r.status })),
        "charge": match &stored.resource {
            Some(Resource::Charge(id)) => Some(id),
            _ => None,
        },
        "refund": match &stored.resource {
            Some(Resource::Refund(id)) => Some(id),
            _ => None,
        },
    })))
}
