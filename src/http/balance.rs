//! `GET /v1/balance`: per currency, what the merchant's succeeded charges
//! came to, what succeeded refunds gave back, and the difference, so "charged
//! once" can be shown in money.

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};
use sqlx::PgExecutor;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Authenticated;
use super::extract::NoQuery;
use super::problem::ApiError;
use crate::app::AppState;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(retrieve))
}

/// Per currency: succeeded charges, succeeded refunds, and the difference.
#[utoipa::path(
    get,
    path = "/v1/balance",
    tag = "refunds",
    security(("bearer" = []), ("basic" = [])),
    responses(
        (status = 200, description = "The balance", body = super::openapi::Balance),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 429, response = super::openapi::TooManyRequests),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    _: NoQuery,
) -> Result<Json<Value>, ApiError> {
    let available: Vec<_> = totals(&state.pool, merchant.id)
        .await?
        .into_iter()
        .map(|(currency, charged, refunded)| {
            json!({
                "currency": currency,
                "amount": charged - refunded,
                "charged": charged,
                "refunded": refunded,
            })
        })
        .collect();
    Ok(Json(json!({
        "object": "balance",
        "livemode": false,
        "available": available,
    })))
}

/// (currency, succeeded charges, succeeded refunds) per currency, in one
/// statement so both sums come from one snapshot. Pending refunds, whose
/// amount is only reserved on the charge, do not count yet.
async fn totals(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
) -> sqlx::Result<Vec<(String, i64, i64)>> {
    let rows = sqlx::query!(
        r#"SELECT currency AS "currency!", sum(charged)::bigint AS "charged!",
                  sum(refunded)::bigint AS "refunded!"
           FROM (SELECT currency, amount AS charged, 0::bigint AS refunded
                   FROM charges WHERE merchant_id = $1 AND status = 'succeeded'
                 UNION ALL
                 SELECT currency, 0::bigint, amount
                   FROM refunds WHERE merchant_id = $1 AND status = 'succeeded') movements
          GROUP BY currency
          ORDER BY currency"#,
        merchant_id,
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|row| (row.currency, row.charged, row.refunded))
        .collect())
}
