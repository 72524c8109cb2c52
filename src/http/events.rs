//! `GET /v1/events/{id}`, `GET /v1/events`: what happened to the merchant's
//! charges and refunds, written by the settles (see [`crate::events`]).

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use sqlx::PgExecutor;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Authenticated;
use super::extract::{ById, PageParams, QueryParams};
use super::input::take_type_filter;
use super::list::{Created, List, finish};
use super::problem::{ApiError, found};
use crate::app::AppState;
use crate::events::{Event, EventType};
use crate::webhooks::domain::DeliveryObject;
use crate::webhooks::store as webhooks;
use oncepay_core::objects::EventObject;

const ROUTE: &str = "/v1/events";

/// A `query_as!` of the merchant's (`$1`) [`Event`]s that also match the
/// SQL in brackets: the columns of an event are written once, for the
/// look-up and the list. A macro because sqlx checks only literal text:
/// each expansion, its filter appended, is checked like any query.
macro_rules! select_events {
    ([$($filter:tt)+], $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            Event,
            r#"SELECT seq, id, type AS "kind: EventType", data AS "data: _",
                      request_id, idempotency_key, created_at,
                      (SELECT count(*) FROM webhook_deliveries d
                        WHERE d.event_seq = events.seq)::int AS "pending_webhooks!"
                 FROM events
                WHERE merchant_id = $1 AND "# + $($filter)+,
            $($arg),+
        )
    };
}

/// The merchant's events that pass a [`Filter`], with `$page` (the
/// position against the cursor, the order) appended.
///
/// It shows an event only once its transaction id is below the xmin of the
/// statement's snapshot: every transaction that began writing before it
/// has ended, so no event can still commit at a position before it, and a
/// client paging forward from any event it was shown misses none. Events
/// written since are held back until then (see docs/decisions.md).
macro_rules! visible_events {
    ($page:literal, $merchant_id:expr, $filter:expr, $from:expr, $limit:expr) => {
        select_events!(
            [
                "txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint
                        + (SELECT event_txid_offset())
                 AND ($2::text[] IS NULL OR type = ANY($2))
                 AND created_at >= $6 AND created_at < $7 AND "
                    + $page
                    + " LIMIT $5"
            ],
            $merchant_id,
            $filter.types as Option<&[&str]>,
            $from.txid,
            $from.seq,
            $limit,
            $filter.created.from,
            $filter.created.until,
        )
    };
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list))
        .routes(routes!(retrieve))
        .routes(routes!(deliveries))
}

/// One of the merchant's events.
#[utoipa::path(
    get,
    path = "/v1/events/{id}",
    tag = "events",
    params(("id" = String, Path, description = "An event id, `evt_...`")),
    responses(
        (status = 200, description = "The event", body = EventObject),
        super::openapi::ReadErrors
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
) -> Result<Response, ApiError> {
    let event = find(&state, merchant.id, &id).await?;
    Ok(Json(event.to_object()).into_response())
}

/// Where an event's webhooks stand.
///
/// Where an event's webhooks stand: one delivery per endpoint that enabled
/// its type, each with every attempt recorded (status, duration, error).
#[utoipa::path(
    get,
    path = "/v1/events/{id}/deliveries",
    tag = "webhooks",
    params(("id" = String, Path, description = "An event id, `evt_...`")),
    responses(
        (status = 200, description = "A list object of deliveries", body = List<DeliveryObject>),
        super::openapi::ReadErrors
    )
)]
async fn deliveries(
    State(state): State<AppState>,
    ById { merchant, id }: ById,
) -> Result<Response, ApiError> {
    let event = find(&state, merchant.id, &id).await?;
    let deliveries = webhooks::deliveries_of(&state.pool, event.seq).await?;
    let attempts = webhooks::attempts_of(&state.pool, event.seq).await?;
    let data: Vec<_> = deliveries
        .iter()
        .map(|d| d.to_object(&event.id, &attempts))
        .collect();
    let url = format!("{ROUTE}/{}/deliveries", event.id);
    Ok(Json(List::new(url, false, data)).into_response())
}

/// The merchant's event `id`, or `404 resource_missing`.
async fn find(state: &AppState, merchant_id: Uuid, id: &str) -> Result<Event, ApiError> {
    let event = select_events!(["id = $2"], merchant_id, id)
        .fetch_optional(&state.pool)
        .await?;
    found(event, "event", id)
}

fn no_such_event(id: &str, param: &str) -> ApiError {
    super::problem::no_such("event", id, param)
}

/// The merchant's events, newest first.
///
/// In the order their transactions began writing, each shown once every
/// transaction that began writing before it has ended, so that paging
/// forward with `ending_before` from an event the list showed misses none
/// written later.
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "events",
    params(
        PageParams,
        ("type" = Option<String>, Query, example = "charge.*", description = "Only events of this type, or of the types a pattern with `*` (any characters) matches, e.g. `charge.*`"),
        ("types[]" = Option<Vec<EventType>>, Query, explode, description = "Only events of these types, up to 20 (not with `type`); `types[0]=...` works too"),
        Created
    ),
    responses(
        (status = 200, description = "A list object", body = List<EventObject>),
        super::openapi::Errors
    )
)]
async fn list(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    QueryParams(mut params): QueryParams,
) -> Result<Response, ApiError> {
    let types = take_type_filter(&mut params)?;
    let created = Created::take(&mut params)?;
    let PageParams { limit, cursor } = PageParams::take(params, "event")?;
    let types: Option<Vec<&str>> = types.map(|types| types.iter().map(|t| t.as_str()).collect());
    let filter = Filter {
        types: types.as_deref(),
        created,
    };
    let (from, newer) = match cursor {
        Some((name, id)) => {
            let from = cursor_position(&state, merchant.id, name, &id).await?;
            (from, name == "ending_before")
        }
        None => (Position::END, false),
    };
    let events = list_page(&state.pool, merchant.id, &filter, from, newer, limit + 1).await?;
    let (has_more, events) = finish(events, limit, newer);
    let data: Vec<_> = events.iter().map(|e| e.to_object()).collect();
    Ok(Json(List::new(ROUTE, has_more, data)).into_response())
}

/// Where an event stands in the list, `txid` then `seq`: a page is a range
/// of positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Position {
    txid: i64,
    seq: i64,
}

impl Position {
    /// After every event: the first page's upper bound.
    const END: Position = Position {
        txid: i64::MAX,
        seq: i64::MAX,
    };
}

/// Where the cursor event `id`, given as parameter `name`, stands in the list.
async fn cursor_position(
    state: &AppState,
    merchant_id: Uuid,
    name: &str,
    id: &str,
) -> Result<Position, ApiError> {
    sqlx::query_as!(
        Position,
        "SELECT txid, seq FROM events WHERE merchant_id = $1 AND id = $2",
        merchant_id,
        id,
    )
    .fetch_optional(&state.pool)
    .await?
    .ok_or_else(|| no_such_event(id, name))
}

/// Which of the merchant's events a list shows.
struct Filter<'a> {
    /// Only these types, when given.
    types: Option<&'a [&'a str]>,
    created: Created,
}

/// Up to `limit` events next to `from` in the list's order that pass
/// `filter`: before it, newest first ([`Position::END`] for the newest);
/// or, when `newer`, after it, the oldest first: the page before a cursor.
async fn list_page(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    filter: &Filter<'_>,
    from: Position,
    newer: bool,
    limit: i64,
) -> sqlx::Result<Vec<Event>> {
    if newer {
        visible_events!(
            "(txid, seq) > ($3, $4) ORDER BY txid, seq",
            merchant_id,
            filter,
            from,
            limit
        )
        .fetch_all(db)
        .await
    } else {
        visible_events!(
            "(txid, seq) < ($3, $4) ORDER BY txid DESC, seq DESC",
            merchant_id,
            filter,
            from,
            limit
        )
        .fetch_all(db)
        .await
    }
}
