//! `POST /v1/refunds`, `GET /v1/refunds/{id}`.
//!
//! Creating a refund is a guarded operation ([`crate::operation`]); the
//! handler only extracts, calls and maps. See [`crate::operation::refund`]
//! for the reservation on the charge.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Authenticated;
use super::extract::{ById, IdempotentPost};
use super::idempotent;
use super::input::FromParams;
use super::problem::{ApiError, found};
use crate::app::AppState;
use crate::objects::RefundObject;
use crate::operation::refund::CreateRefund;
use crate::operation::write::{self, Write};
use crate::operation::{self, Operation};
use crate::refunds::{NewRefund, store};
use crate::updates::refund::{RefundUpdate, UpdateRefund};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create))
        .routes(routes!(retrieve, update))
}

/// Changes a refund's metadata, once per idempotency key; writes
/// `refund.updated` when it changed.
#[utoipa::path(
    post,
    path = "/v1/refunds/{id}",
    tag = "refunds",
    params(("id" = String, Path, description = "A refund id, `re_...`"), super::extract::IdempotentPost),
    request_body(content(
        (RefundUpdate = "application/json"),
        (RefundUpdate = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 200, description = "The refund as updated (or the saved answer, with `Idempotent-Replayed: true`)", body = RefundObject,
         headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        super::openapi::UpdateErrors
    )
)]
async fn update(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
    post: IdempotentPost,
) -> Result<Response, ApiError> {
    let asker = post.asker();
    let (guard, params, clock) = post.split(merchant.id, UpdateRefund::ROUTE);
    let update = RefundUpdate::from_params(params)?;
    let refund = UpdateRefund {
        merchant_id: merchant.id,
        id,
        update,
        asker,
    };
    let answer = write::run(&state.engine, guard, refund).await;
    Ok(idempotent::respond(&clock, answer))
}

/// Refunds a succeeded charge, in part or in full, exactly once per key and
/// never more than was charged.
#[utoipa::path(
    post,
    path = "/v1/refunds",
    tag = "refunds",
    params(super::extract::IdempotentPost),
    request_body(content(
        (NewRefund = "application/json"),
        (NewRefund = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Refunded (or the saved answer, with `Idempotent-Replayed: true`)", body = RefundObject,
         headers(("Location" = String, description = "/v1/refunds/{id}"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        super::openapi::PostErrors
    )
)]
async fn create(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    post: IdempotentPost,
) -> Result<Response, ApiError> {
    let (guard, params, clock) = post.split(merchant.id, CreateRefund::ROUTE);
    let refund = NewRefund::from_params(params)?;
    let answer = operation::run(&state.engine, guard, CreateRefund::new(merchant.id, refund)).await;
    Ok(idempotent::respond(&clock, answer))
}

/// One of the merchant's refunds.
#[utoipa::path(
    get,
    path = "/v1/refunds/{id}",
    tag = "refunds",
    params(("id" = String, Path, description = "A refund id, `re_...`")),
    responses(
        (status = 200, description = "The refund", body = RefundObject),
        super::openapi::ReadErrors
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
) -> Result<Response, ApiError> {
    let refund = found(
        store::find(&state.pool, merchant.id, &id).await?,
        "refund",
        &id,
    )?;
    Ok(Json(refund.to_object()).into_response())
}
