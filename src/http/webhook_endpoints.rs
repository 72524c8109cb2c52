//! `POST /v1/webhook_endpoints`, `GET /v1/webhook_endpoints/{id}`,
//! `GET /v1/webhook_endpoints`, `DELETE /v1/webhook_endpoints/{id}`.
//!
//! Creating an endpoint is a guarded write ([`oncepay_core::operation::write`]);
//! the handlers only extract, call and map.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Authenticated;
use super::extract::{ById, IdempotentPost, PageParams, QueryParams};
use super::idempotent;
use super::list::List;
use super::problem::{ApiError, found};
use crate::app::AppState;
use crate::webhooks::create_endpoint::CreateEndpoint;
use crate::webhooks::domain::{
    DeliveryEnd, EndpointObject, EndpointUpdate, NewEndpoint, check_address,
};
use crate::webhooks::guard::AddressGuard;
use crate::webhooks::store;
use crate::webhooks::update_endpoint::UpdateEndpoint;
use oncepay_core::operation::write::Write;

const ROUTE: &str = CreateEndpoint::ROUTE;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(retrieve, update, delete))
}

/// Changes a webhook endpoint.
///
/// Changes an endpoint's URL (checked as on create), event types,
/// description, metadata, or whether it is disabled, once per idempotency key.
#[utoipa::path(
    post,
    path = "/v1/webhook_endpoints/{id}",
    tag = "webhooks",
    params(("id" = String, Path, description = "A webhook endpoint id, `we_...`"), super::extract::IdempotentPost),
    request_body(content(
        (EndpointUpdate = "application/json"),
        (EndpointUpdate = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 200, description = "The endpoint as updated, without its secret (or the saved answer, with `Idempotent-Replayed: true`)", body = EndpointObject,
         headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        super::openapi::UpdateErrors
    )
)]
async fn update(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
    mut post: IdempotentPost,
) -> Result<Response, ApiError> {
    let update = EndpointUpdate::from_params(post.params())?;
    if let Some(url) = &update.url {
        let guard = AddressGuard::new(state.config.webhooks.allow_private);
        check_address(url, guard).await?;
    }
    let endpoint = UpdateEndpoint {
        merchant_id: merchant.id,
        id,
        update,
    };
    let route = UpdateEndpoint::ROUTE;
    let (request, clock) = post.request(&state, merchant.id, route, &endpoint.canonical());
    let answer = state.front.write(&state.engine, request, endpoint).await;
    Ok(idempotent::respond(&clock, answer))
}

/// Registers a webhook endpoint.
///
/// Registers a URL to receive the merchant's events, signed with a new
/// secret that this answer alone shows.
#[utoipa::path(
    post,
    path = "/v1/webhook_endpoints",
    tag = "webhooks",
    params(super::extract::IdempotentPost),
    request_body(content(
        (NewEndpoint = "application/json"),
        (NewEndpoint = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Created, with its `secret` (or the saved answer, with `Idempotent-Replayed: true`)", body = EndpointObject,
         headers(("Location" = String, description = "/v1/webhook_endpoints/{id}"), ("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        super::openapi::PostErrors
    )
)]
async fn create(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    mut post: IdempotentPost,
) -> Result<Response, ApiError> {
    let endpoint = NewEndpoint::from_params(post.params())?;
    endpoint
        .check_address(AddressGuard::new(state.config.webhooks.allow_private))
        .await?;
    let endpoint = CreateEndpoint::new(merchant.id, endpoint);
    let (request, clock) = post.request(&state, merchant.id, ROUTE, &endpoint.canonical());
    let answer = state.front.write(&state.engine, request, endpoint).await;
    Ok(idempotent::respond(&clock, answer))
}

/// One of the merchant's webhook endpoints (without its secret).
#[utoipa::path(
    get,
    path = "/v1/webhook_endpoints/{id}",
    tag = "webhooks",
    params(("id" = String, Path, description = "A webhook endpoint id, `we_...`")),
    responses(
        (status = 200, description = "The endpoint", body = EndpointObject),
        super::openapi::ReadErrors
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
) -> Result<Response, ApiError> {
    let endpoint = found(
        store::find(&state.pool, merchant.id, &id).await?,
        "webhook endpoint",
        &id,
    )?;
    Ok(Json(endpoint.to_object()).into_response())
}

/// Deletes an endpoint.
///
/// Nothing more is sent to it, and its deliveries still pending end `failed`.
#[utoipa::path(
    delete,
    path = "/v1/webhook_endpoints/{id}",
    tag = "webhooks",
    params(("id" = String, Path, description = "A webhook endpoint id, `we_...`")),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        super::openapi::ReadErrors
    )
)]
async fn delete(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
) -> Result<Response, ApiError> {
    let mut tx = state.pool.begin().await?;
    let Some(ended) = store::delete(&mut tx, merchant.id, &id).await? else {
        tx.rollback().await?;
        return Err(no_such_endpoint(&id, "id"));
    };
    tx.commit().await?;
    DeliveryEnd::EndpointDeleted.count(ended);
    let deleted = Deleted {
        id: &id,
        object: "webhook_endpoint",
        deleted: true,
    };
    Ok(Json(deleted).into_response())
}

/// A deleted webhook endpoint, as its delete answers.
#[derive(Serialize, ToSchema)]
#[schema(as = DeletedWebhookEndpoint)]
struct Deleted<'a> {
    #[schema(example = "we_1NbB3eCTYkz2mVgqA8rW0hXp")]
    id: &'a str,
    #[schema(example = "webhook_endpoint")]
    object: &'static str,
    /// Always true.
    deleted: bool,
}

fn no_such_endpoint(id: &str, param: &str) -> ApiError {
    super::problem::no_such("webhook endpoint", id, param)
}

/// The merchant's webhook endpoints, newest first.
#[utoipa::path(
    get,
    path = "/v1/webhook_endpoints",
    tag = "webhooks",
    params(
        PageParams
    ),
    responses(
        (status = 200, description = "A list object", body = List<EndpointObject>),
        super::openapi::Errors
    )
)]
async fn list(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    QueryParams(params): QueryParams,
) -> Result<Response, ApiError> {
    let PageParams { limit, cursor } = PageParams::take(params, "webhook endpoint")?;
    let limit = limit as usize;
    // A merchant has at most MAX_ENDPOINTS: the whole list is one read, and
    // a page is a slice of it.
    let all = store::list(&state.pool, merchant.id).await?;
    let position = |name: &'static str, id: &str| {
        all.iter()
            .position(|e| e.id == id)
            .ok_or_else(|| no_such_endpoint(id, name))
    };
    let (page, has_more) = match cursor {
        None => (&all[..all.len().min(limit)], all.len() > limit),
        Some((name @ "starting_after", id)) => {
            let older = &all[position(name, &id)? + 1..];
            (&older[..older.len().min(limit)], older.len() > limit)
        }
        Some((name, id)) => {
            let newer = &all[..position(name, &id)?];
            let from = newer.len().saturating_sub(limit);
            (&newer[from..], from > 0)
        }
    };
    let data: Vec<_> = page.iter().map(|e| e.to_object()).collect();
    Ok(Json(List::new(ROUTE, has_more, data)).into_response())
}
