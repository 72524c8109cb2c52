//! `GET /healthz` (the process is up) and `GET /readyz` (the database and
//! the card processor answer; with several database hosts, one of them is
//! known to be the writable primary).
//! Neither takes a query parameter; any is refused, as on every route.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::extract::NoQuery;
use super::problem::ApiError;
use crate::app::AppState;
use oncepay_core::problem::{Problem, ProblemCode};
use oncepay_core::retry_after;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Up", body = Health),
        (status = 400, response = super::openapi::BadRequest)
    ))]
async fn healthz(_: NoQuery) -> Json<Health> {
    Json(Health {
        status: "ok",
        database: None,
        processor: None,
    })
}

/// Liveness or readiness: `database` and `processor` only in the answer
/// to `GET /readyz`.
#[derive(Serialize, ToSchema)]
struct Health {
    #[schema(example = "ok")]
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "ok")]
    database: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "ok")]
    processor: Option<&'static str>,
}

/// The database and the card processor answer.
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Ready", body = Health),
        (status = 400, response = super::openapi::BadRequest),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    ))]
async fn readyz(State(state): State<AppState>, _: NoQuery) -> Result<Json<Health>, ApiError> {
    // With several hosts, not ready while none is known to be writable: a
    // charge would only wait for a connection and get 503.
    if let Some(primary) = &state.primary {
        if !primary.known() {
            return Err(ApiError::unavailable(anyhow::anyhow!(
                "no host of DATABASE_URL is known to be the writable primary"
            )));
        }
    }
    // The statement libpq's read-write check sends: one round trip, like
    // the ping it replaces, and a server that cannot take writes (a
    // standby) makes the instance not ready.
    let ping = sqlx::query_scalar::<_, String>("SHOW transaction_read_only").fetch_one(&state.pool);
    match tokio::time::timeout(Duration::from_secs(2), ping).await {
        Ok(Ok(read_only)) if read_only == "off" => {}
        Ok(Ok(_)) => {
            return Err(ApiError::unavailable(anyhow::anyhow!(
                "the database is read-only (a standby?)"
            )));
        }
        Ok(Err(e)) => return Err(ApiError::unavailable(e.into())),
        Err(_) => {
            return Err(ApiError::unavailable(anyhow::anyhow!(
                "database ping timed out"
            )));
        }
    }
    // An unreachable processor makes the instance not ready, never a crash:
    // charges would only get 503 processor_unavailable.
    let error = match tokio::time::timeout(Duration::from_secs(3), state.processor.ready()).await {
        Ok(Ok(())) => {
            return Ok(Json(Health {
                status: "ok",
                database: Some("ok"),
                processor: Some("ok"),
            }));
        }
        Ok(Err(e)) => e,
        Err(_) => anyhow::anyhow!("the processor's readiness check timed out"),
    };
    tracing::warn!(error = format!("{error:#}"), "not ready: the processor");
    Err(Problem::new(
        ProblemCode::ProcessorUnavailable,
        "The card processor does not answer: this instance is not ready.",
    )
    .with_retry_after(retry_after::SOON)
    .into())
}

/// The metrics, in Prometheus text format.
///
/// `GET /metrics`, for Prometheus to scrape.
#[utoipa::path(get, path = "/metrics", tag = "operations", security(()),
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain"),
        (status = 400, response = super::openapi::BadRequest)
    ))]
pub async fn metrics_endpoint(
    State(state): State<AppState>,
    _: super::extract::NoQuery,
) -> Response {
    let body = crate::telemetry::metrics::render(&state.metrics, &state.pool);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}
