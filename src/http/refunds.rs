//! `POST /v1/refunds`, `GET /v1/refunds/{id}`, `GET /v1/refunds`, and a
//! charge's refunds: `GET /v1/charges/{id}/refunds` and
//! `GET /v1/charges/{id}/refunds/{refund}`.
//!
//! Creating a refund is a guarded operation ([`oncepay_core::operation`]); the
//! handler only extracts, calls and maps. See [`oncepay_core::operation::refund`]
//! for the reservation on the charge.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use sqlx::PgExecutor;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Authenticated;
use super::extract::{ById, ByIds, IdempotentPost, PageParams, PathParam, QueryParams};
use super::idempotent;
use super::input::FromParams;
use super::list::{Created, List, Page, Position, created_page, finish};
use super::problem::{ApiError, found, no_such};
use crate::app::AppState;
use crate::updates::refund::{RefundUpdate, UpdateRefund};
use oncepay_core::charges::store as charges;
use oncepay_core::objects::RefundObject;
use oncepay_core::operation::refund::CreateRefund;
use oncepay_core::operation::workflow::Operation;
use oncepay_core::operation::write::Write;
use oncepay_core::params::string;
use oncepay_core::refunds::{NewRefund, Refund, store};

const ROUTE: &str = CreateRefund::ROUTE;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list, create))
        .routes(routes!(retrieve, update))
        .routes(routes!(list_of_charge))
        .routes(routes!(retrieve_of_charge))
}

/// Changes a refund's metadata.
///
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
    mut post: IdempotentPost,
) -> Result<Response, ApiError> {
    let asker = post.asker();
    let update = RefundUpdate::from_params(post.params())?;
    let refund = UpdateRefund {
        merchant_id: merchant.id,
        id,
        update,
        asker,
    };
    let (request, clock) = post.request(
        &state,
        merchant.id,
        UpdateRefund::ROUTE,
        &refund.canonical(),
    );
    let answer = state.front.write(&state.engine, request, refund).await;
    Ok(idempotent::respond(&clock, answer))
}

/// Refunds a succeeded charge, exactly once per key.
///
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
        (status = 404, response = super::openapi::NotFound),
        super::openapi::PostErrors
    )
)]
async fn create(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    mut post: IdempotentPost,
) -> Result<Response, ApiError> {
    let refund = CreateRefund::new(merchant.id, NewRefund::from_params(post.params())?);
    let route = CreateRefund::ROUTE;
    let (request, clock) = post.request(&state, merchant.id, route, &refund.canonical());
    let answer = state.front.run(&state.engine, request, refund).await;
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

/// A `query_as!` of the merchant's [`Refund`]s that also match `$filter`,
/// with `$page` appended (see [`created_page!`]): the columns of a refund
/// are written once, for each list. A macro because sqlx checks only
/// literal text: each expansion is checked against the schema like any query.
macro_rules! select_refunds {
    ($filter:literal, $page:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            Refund,
            r#"SELECT id, merchant_id, charge_id, amount, currency, status AS "status: _",
                      reason, metadata AS "metadata: _", created_at, failure_reason
                 FROM refunds
                WHERE merchant_id = $1 AND "# + $filter + $page,
            $($arg),+
        )
    };
}

/// The merchant's refunds, for [`created_page!`].
macro_rules! merchant_refunds {
    ($page:literal, $($arg:expr),+ $(,)?) => {
        select_refunds!("", $page, $($arg),+)
    };
}

/// The refunds of one of the merchant's charges (`$7`), for [`created_page!`].
macro_rules! charge_refunds {
    ($page:literal, $($arg:expr),+ $(,)?) => {
        select_refunds!("charge_id = $7 AND ", $page, $($arg),+)
    };
}

/// The merchant's refunds, newest first.
///
/// Of one charge with `charge`.
#[utoipa::path(
    get,
    path = "/v1/refunds",
    tag = "refunds",
    params(
        ("charge" = Option<String>, Query, description = "A charge id: only its refunds"),
        PageParams,
        Created
    ),
    responses(
        (status = 200, description = "A list object", body = List<RefundObject>),
        super::openapi::Errors
    )
)]
async fn list(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    QueryParams(mut params): QueryParams,
) -> Result<Response, ApiError> {
    let charge = params
        .take("charge")
        .map(|v| string(v, "charge"))
        .transpose()?;
    let created = Created::take(&mut params)?;
    let page = PageParams::take(params, "refund")?;
    if let Some(charge) = &charge {
        if charges::find(&state.pool, merchant.id, charge)
            .await?
            .is_none()
        {
            return Err(no_such("charge", charge, "charge"));
        }
    }
    let listed = Listed {
        charge: charge.as_deref(),
        created,
        url: ROUTE.to_owned(),
    };
    read_list(&state, merchant.id, listed, page).await
}

/// A charge's refunds, newest first.
///
/// The list its `refunds.url` names.
#[utoipa::path(
    get,
    path = "/v1/charges/{id}/refunds",
    tag = "refunds",
    params(
        ("id" = String, Path, description = "A charge id, `ch_...`"),
        PageParams
    ),
    responses(
        (status = 200, description = "A list object", body = List<RefundObject>),
        super::openapi::ReadErrors
    )
)]
async fn list_of_charge(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    QueryParams(params): QueryParams,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let page = PageParams::take(params, "refund")?;
    let charge = found(
        charges::find(&state.pool, merchant.id, &id).await?,
        "charge",
        &id,
    )?;
    let listed = Listed {
        charge: Some(&charge.id),
        created: Created::any(),
        url: format!("/v1/charges/{}/refunds", charge.id),
    };
    read_list(&state, merchant.id, listed, page).await
}

/// One refund of one of the merchant's charges.
///
/// One refund of one of the merchant's charges; a refund of another
/// charge is not found.
#[utoipa::path(
    get,
    path = "/v1/charges/{id}/refunds/{refund}",
    tag = "refunds",
    params(
        ("id" = String, Path, description = "A charge id, `ch_...`"),
        ("refund" = String, Path, description = "A refund id of that charge, `re_...`")
    ),
    responses(
        (status = 200, description = "The refund", body = RefundObject),
        super::openapi::ReadErrors
    )
)]
async fn retrieve_of_charge(
    State(state): State<AppState>,
    ByIds {
        merchant,
        outer: charge,
        inner: id,
    }: ByIds,
) -> Result<Response, ApiError> {
    let refund = store::find(&state.pool, merchant.id, &id)
        .await?
        .filter(|refund| refund.charge_id == charge);
    let refund = found(refund, "refund", &id)?;
    Ok(Json(refund.to_object()).into_response())
}

/// Which of the merchant's refunds a list shows, and where it is read.
struct Listed<'a> {
    /// Only this charge's, when given (the caller checked it is the merchant's).
    charge: Option<&'a str>,
    created: Created,
    url: String,
}

/// One page of the refunds `listed` names, as a list object.
async fn read_list(
    state: &AppState,
    merchant_id: Uuid,
    listed: Listed<'_>,
    PageParams { limit, cursor }: PageParams,
) -> Result<Response, ApiError> {
    let page = Page::of(cursor, "refund", |id| {
        position(&state.pool, merchant_id, id)
    })
    .await?;
    let (db, created) = (&state.pool, listed.created);
    let refunds = match listed.charge {
        None => created_page!(merchant_refunds, db, merchant_id, &page, created, limit + 1)?,
        Some(charge) => created_page!(
            charge_refunds,
            db,
            merchant_id,
            &page,
            created,
            limit + 1,
            charge
        )?,
    };
    let (has_more, refunds) = finish(refunds, limit, page.is_newer());
    let data: Vec<_> = refunds.iter().map(Refund::to_object).collect();
    Ok(Json(List::new(listed.url, has_more, data)).into_response())
}

/// Where the merchant's refund `id` stands in the lists, if it exists.
async fn position(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: String,
) -> sqlx::Result<Option<Position>> {
    let refund = store::find(db, merchant_id, &id).await?;
    Ok(refund.map(|r| Position {
        created_at: r.created_at,
        id: r.id,
    }))
}
