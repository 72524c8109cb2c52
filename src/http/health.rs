//! `GET /healthz` (the process is up) and `GET /readyz` (the database answers).

use std::time::Duration;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use super::AppState;
use super::problem::ApiError;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn readyz(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let ping = sqlx::query("SELECT 1").execute(&state.pool);
    match tokio::time::timeout(Duration::from_secs(2), ping).await {
        Ok(Ok(_)) => Ok(Json(json!({"status": "ok", "database": "ok"}))),
        Ok(Err(e)) => Err(ApiError::Unavailable(e.into())),
        Err(_) => Err(ApiError::Unavailable(anyhow::anyhow!(
            "database ping timed out"
        ))),
    }
}
