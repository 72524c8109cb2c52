//! `GET /v1/idempotency_keys/{key}`: what the server remembers of one of the
//! merchant's keys, so a client (or a workshop) can watch the flow.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::ById;
use super::problem::ApiError;
use crate::app::AppState;
use oncepay_core::idempotency::{IdempotencyKey, Resource, store};
use oncepay_core::problem::{Problem, ProblemCode};

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
        (status = 200, description = "The key's state", body = KeyState),
        super::openapi::ReadErrors
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    ById { merchant, id: raw }: ById,
) -> Result<Json<KeyState>, ApiError> {
    let key = IdempotencyKey::parse(raw.as_bytes()).map_err(|e| {
        Problem::new(ProblemCode::InvalidIdempotencyKey, e.to_string()).with_param("key")
    })?;
    let Some(stored) = store::find(
        &state.pool,
        merchant.id,
        &key,
        state.config.keys.processing_timeout,
    )
    .await?
    else {
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
    Ok(Json(KeyState {
        object: "idempotency_key",
        status: stored.status.as_str(),
        created_at: stored.created_at.timestamp(),
        expires_at: stored.expires_at.timestamp(),
        response: stored.response.map(|r| KeyResponse {
            status_code: r.status,
        }),
        charge: match &stored.resource {
            Some(Resource::Charge(id)) => Some(id.clone()),
            _ => None,
        },
        refund: match &stored.resource {
            Some(Resource::Refund(id)) => Some(id.clone()),
            _ => None,
        },
        capture: match &stored.resource {
            Some(Resource::Capture(id)) => Some(id.clone()),
            _ => None,
        },
        request: KeyRequest {
            method: stored.first.method,
            path: stored.first.route,
        },
        key: stored.key,
    }))
}

/// What the server remembers of one key.
#[derive(Serialize, ToSchema)]
#[schema(as = IdempotencyKeyState)]
struct KeyState {
    #[schema(example = "idempotency_key")]
    object: &'static str,
    #[schema(example = "order-6735-charge")]
    key: String,
    /// `processing` (claimed, work under way) or `completed` (answer saved).
    #[schema(example = "completed")]
    status: &'static str,
    /// Unix seconds.
    #[schema(example = 1764892800)]
    created_at: i64,
    /// Unix seconds; after this the key counts as never seen.
    #[schema(example = 1764979200)]
    expires_at: i64,
    request: KeyRequest,
    /// The saved answer's status code, once completed.
    response: Option<KeyResponse>,
    /// The charge the key guards, if it guards a charge.
    #[schema(example = "ch_FSqF13LohwPRt53icfinsfKa")]
    charge: Option<String>,
    /// The refund the key guards, if it guards a refund.
    #[schema(example = json!(null))]
    refund: Option<String>,
    /// The charge whose capture the key guards, if it guards a capture.
    #[schema(example = json!(null))]
    capture: Option<String>,
}

/// The request that claimed the key.
#[derive(Serialize, ToSchema)]
struct KeyRequest {
    #[schema(example = "POST")]
    method: String,
    #[schema(example = "/v1/charges")]
    path: String,
}

/// The saved answer.
#[derive(Serialize, ToSchema)]
struct KeyResponse {
    #[schema(example = 201)]
    status_code: u16,
}
