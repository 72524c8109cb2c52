//! `GET /v1/balance`: per currency, what the merchant's succeeded charges
//! came to, what succeeded refunds gave back, and the difference, so "charged
//! once" can be shown in money.

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use sqlx::PgExecutor;
use utoipa::ToSchema;
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
    responses(
        (status = 200, description = "The balance", body = BalanceObject),
        super::openapi::Errors
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    _: NoQuery,
) -> Result<Json<BalanceObject>, ApiError> {
    let totals = totals(&state.pool, merchant.id).await?;
    Ok(Json(BalanceObject::new(totals)))
}

/// The balance object, in Stripe's shape: one entry per currency the
/// merchant has charged in, in `available`, `pending` and `connect_reserved`.
/// oncepay makes a charge's money available at once and has no connected
/// accounts, so `pending` and `connect_reserved` are always zero.
#[derive(Serialize, ToSchema)]
#[schema(as = Balance)]
struct BalanceObject {
    #[schema(example = "balance")]
    object: &'static str,
    available: Vec<Available>,
    /// Per currency, always 0: oncepay has no connected accounts.
    connect_reserved: Vec<Reserved>,
    livemode: bool,
    /// Per currency, always 0: a charge's money is available at once.
    pending: Vec<Funds>,
}

/// What a currency's succeeded charges and refunds came to.
#[derive(Serialize, ToSchema)]
struct Available {
    /// `charged - refunded`.
    #[schema(example = 1500)]
    amount: i64,
    #[schema(example = "usd")]
    currency: String,
    source_types: SourceTypes,
    /// Succeeded charges (oncepay's addition).
    #[schema(example = 2000)]
    charged: i64,
    /// Succeeded refunds (oncepay's addition).
    #[schema(example = 500)]
    refunded: i64,
}

/// Funds in one currency.
#[derive(Serialize, ToSchema)]
struct Funds {
    #[schema(example = 0)]
    amount: i64,
    #[schema(example = "usd")]
    currency: String,
    source_types: SourceTypes,
}

/// Where the funds came from: every payment here is a card's.
#[derive(Serialize, ToSchema)]
struct SourceTypes {
    #[schema(example = 1500)]
    card: i64,
}

#[derive(Serialize, ToSchema)]
struct Reserved {
    #[schema(example = 0)]
    amount: i64,
    #[schema(example = "usd")]
    currency: String,
}

impl BalanceObject {
    fn new(totals: Vec<(String, i64, i64)>) -> Self {
        let zero = |currency: &String| Funds {
            amount: 0,
            currency: currency.clone(),
            source_types: SourceTypes { card: 0 },
        };
        BalanceObject {
            object: "balance",
            pending: totals
                .iter()
                .map(|(currency, _, _)| zero(currency))
                .collect(),
            connect_reserved: totals
                .iter()
                .map(|(currency, _, _)| Reserved {
                    amount: 0,
                    currency: currency.clone(),
                })
                .collect(),
            livemode: false,
            available: totals
                .into_iter()
                .map(|(currency, charged, refunded)| Available {
                    amount: charged - refunded,
                    currency,
                    source_types: SourceTypes {
                        card: charged - refunded,
                    },
                    charged,
                    refunded,
                })
                .collect(),
        }
    }
}

/// (currency, succeeded charges, succeeded refunds) per currency, summed
/// from `balance_movements` (the money that moved: its migration writes the
/// rule) in one statement, so both sums come from one snapshot. The ledger
/// consumer's `--check` compares with the same view.
async fn totals(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
) -> sqlx::Result<Vec<(String, i64, i64)>> {
    let rows = sqlx::query!(
        r#"SELECT currency AS "currency!",
                  coalesce(sum(amount) FILTER (WHERE kind = 'charge'), 0)::bigint AS "charged!",
                  coalesce(-sum(amount) FILTER (WHERE kind = 'refund'), 0)::bigint AS "refunded!"
             FROM balance_movements WHERE merchant_id = $1
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
