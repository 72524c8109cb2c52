//! `POST /v1/charges`, `GET /v1/charges/{id}`, `GET /v1/charges`,
//! `POST /v1/charges/{id}/capture`.
//!
//! Creating a charge and capturing one are guarded operations
//! ([`oncepay_core::operation`]); the handlers only extract, call and map.

use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use sqlx::PgExecutor;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Authenticated;
use super::extract::{ById, IdempotentPost, PageParams, QueryParams};
use super::idempotent;
use super::input::{CaptureParams, FromParams};
use super::list::{Created, List, Page, Position, created_page, finish};
use super::problem::{ApiError, found};
use crate::app::AppState;
use crate::updates::charge::{ChargeUpdate, UpdateCharge};
use oncepay_core::charges::{NewCharge, store};
use oncepay_core::objects::ChargeObject;
use oncepay_core::operation::capture::CaptureCharge;
use oncepay_core::operation::charge::CreateCharge;
use oncepay_core::operation::workflow::Operation;
use oncepay_core::operation::write::Write;
use oncepay_core::refunds::store as refunds;

const ROUTE: &str = CreateCharge::ROUTE;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(retrieve, update))
        .routes(routes!(capture))
}

/// Changes a charge.
///
/// Changes a charge's description, metadata, receipt email, shipping or
/// fraud report, once per idempotency key; writes `charge.updated` when
/// anything changed.
#[utoipa::path(
    post,
    path = "/v1/charges/{id}",
    tag = "charges",
    params(("id" = String, Path, description = "A charge id, `ch_...`"), super::extract::IdempotentPost),
    request_body(content(
        (ChargeUpdate = "application/json"),
        (ChargeUpdate = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 200, description = "The charge as updated (or the saved answer, with `Idempotent-Replayed: true`)", body = ChargeObject,
         headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        super::openapi::UpdateErrors
    )
)]
async fn update(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
    mut post: IdempotentPost,
) -> Result<Response, ApiError> {
    let asker = post.asker();
    let update = ChargeUpdate::from_params(post.params())?;
    let charge = UpdateCharge {
        merchant_id: merchant.id,
        id,
        update,
        asker,
    };
    let (request, clock) = post.request(
        &state,
        merchant.id,
        UpdateCharge::ROUTE,
        &charge.canonical(),
    );
    let answer = state.front.write(&state.engine, request, charge).await;
    Ok(idempotent::respond(&clock, answer))
}

/// Charges a card, exactly once per idempotency key.
#[utoipa::path(
    post,
    path = "/v1/charges",
    tag = "charges",
    params(super::extract::IdempotentPost),
    request_body(content(
        (NewCharge = "application/json"),
        (NewCharge = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Charged (or the saved answer, with `Idempotent-Replayed: true`)", body = ChargeObject,
         headers(("Location" = String, description = "/v1/charges/{id}"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 402, response = super::openapi::PaymentFailed),
        super::openapi::PostErrors
    )
)]
async fn create(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    mut post: IdempotentPost,
) -> Result<Response, ApiError> {
    let charge = CreateCharge::new(merchant.id, NewCharge::from_params(post.params())?);
    let (request, clock) = post.request(&state, merchant.id, ROUTE, &charge.canonical());
    let answer = state.front.run(&state.engine, request, charge).await;
    Ok(idempotent::respond(&clock, answer))
}

/// Captures a charge made with capture=false, whole or in part.
///
/// `amount` captures a part; what is not captured goes back to the card.
#[utoipa::path(
    post,
    path = "/v1/charges/{id}/capture",
    tag = "charges",
    params(("id" = String, Path, description = "A charge made with `capture=false`"), super::extract::IdempotentPost),
    request_body(content(
        (CaptureParams = "application/json"),
        (CaptureParams = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 200, description = "Captured: the charge (or the saved answer, with `Idempotent-Replayed: true`)", body = ChargeObject,
         headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 404, response = super::openapi::NotFound),
        super::openapi::PostErrors
    )
)]
async fn capture(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    Path(id): Path<String>,
    mut post: IdempotentPost,
) -> Result<Response, ApiError> {
    let CaptureParams { amount } = CaptureParams::from_params(post.params())?;
    let window = state.config.processor.capture_window;
    let capture = CaptureCharge::new(merchant.id, id, amount, window);
    let route = CaptureCharge::ROUTE;
    let (request, clock) = post.request(&state, merchant.id, route, &capture.canonical());
    let answer = state.front.run(&state.engine, request, capture).await;
    Ok(idempotent::respond(&clock, answer))
}

/// One of the merchant's charges.
#[utoipa::path(
    get,
    path = "/v1/charges/{id}",
    tag = "charges",
    params(("id" = String, Path, description = "A charge id, `ch_...`")),
    responses(
        (status = 200, description = "The charge", body = ChargeObject),
        super::openapi::ReadErrors
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
) -> Result<Response, ApiError> {
    let charge = found(
        store::find(&state.pool, merchant.id, &id).await?,
        "charge",
        &id,
    )?;
    let refunds = refunds::of_charges(&state.pool, std::slice::from_ref(&charge.id)).await?;
    Ok(Json(charge.to_object(&refunds)).into_response())
}

/// A `query_as!` of the merchant's charges (`oncepay_core::charge_query!`),
/// with `$page` (the position against the cursor, the order; see
/// [`created_page!`]) appended. A macro because sqlx checks only literal
/// text: each expansion, its `$page` appended, is checked against the
/// schema like any query.
macro_rules! merchant_charges {
    ($page:literal, $($arg:expr),+ $(,)?) => {
        oncepay_core::charge_query!(
            "SELECT",
            ["FROM charges WHERE merchant_id = $1 AND ", $page],
            $($arg),+
        )
    };
}

/// The merchant's charges, newest first.
#[utoipa::path(
    get,
    path = "/v1/charges",
    tag = "charges",
    params(
        PageParams,
        Created
    ),
    responses(
        (status = 200, description = "A list object", body = List<ChargeObject>),
        super::openapi::Errors
    )
)]
async fn list(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    QueryParams(mut params): QueryParams,
) -> Result<Response, ApiError> {
    let created = Created::take(&mut params)?;
    let PageParams { limit, cursor } = PageParams::take(params, "charge")?;
    let page = Page::of(cursor, "charge", |id| {
        position(&state.pool, merchant.id, id)
    })
    .await?;
    let db = &state.pool;
    let charges = created_page!(merchant_charges, db, merchant.id, &page, created, limit + 1)?;
    let (has_more, charges) = finish(charges, limit, page.is_newer());
    let ids: Vec<String> = charges.iter().map(|c| c.id.clone()).collect();
    let refunds = refunds::of_charges(&state.pool, &ids).await?;
    let data: Vec<_> = charges
        .iter()
        .map(|c| c.to_object(refunds::of_charge(&refunds, &c.id)))
        .collect();
    Ok(Json(List::new(ROUTE, has_more, data)).into_response())
}

/// Where the merchant's charge `id` stands in the list, if it exists.
async fn position(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: String,
) -> sqlx::Result<Option<Position>> {
    let charge = store::find(db, merchant_id, &id).await?;
    Ok(charge.map(|c| Position {
        created_at: c.created_at,
        id: c.id,
    }))
}
