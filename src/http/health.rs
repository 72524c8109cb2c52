//! `GET /healthz` (the process is up) and `GET /readyz` (the database answers).
//! Neither takes a query parameter; any is refused, as on every route.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::NoQuery;
use super::problem::ApiError;
use crate::app::AppState;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses(
        (status = 200, description = "Up", body = super::openapi::Health),
        (status = 400, response = super::openapi::BadRequest)
    ))]
async fn healthz(_: NoQuery) -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// The database answers.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Ready", body = super::openapi::Health),
        (status = 400, response = super::openapi::BadRequest),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    ))]
async fn readyz(State(state): State<AppState>, _: NoQuery) -> Result<Json<Value>, ApiError> {
    let ping = sqlx::query_scalar!("SELECT 1").fetch_one(&state.pool);
    match tokio::time::timeout(Duration::from_secs(2), ping).await {
        Ok(Ok(_)) => Ok(Json(json!({"status": "ok", "database": "ok"}))),
        Ok(Err(e)) => Err(ApiError::unavailable(e.into())),
        Err(_) => Err(ApiError::unavailable(anyhow::anyhow!(
            "database ping timed out"
        ))),
    }
}
