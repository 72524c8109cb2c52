//! `GET /v1/events/{id}`, `GET /v1/events`: what happened to the merchant's
//! charges and refunds, written by the settles (see [`crate::events`]).

use axum::Json;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Authenticated;
use super::extract::{NoQuery, PathParam};
use super::problem::ApiError;
use crate::app::AppState;
use crate::events::{EventType, store};
use crate::params::{ParamError, shorten};
use crate::problem::{Problem, ProblemCode};
use crate::webhooks::domain::DeliveryStatus;
use crate::webhooks::store as webhooks;

const ROUTE: &str = "/v1/events";
/// The most types one `types[]` filter may name, as Stripe allows.
const MAX_TYPES: usize = 20;

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
    security(("bearer" = []), ("basic" = [])),
    params(("id" = String, Path, description = "An event id, `evt_...`")),
    responses(
        (status = 200, description = "The event", body = super::openapi::Event),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 404, response = super::openapi::NotFound),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
async fn retrieve(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    match store::find(&state.pool, merchant.id, &id).await? {
        Some(event) => Ok(Json(event.to_object()).into_response()),
        None => Err(no_such_event(&id, "id")),
    }
}

/// Where an event's webhooks stand: one delivery per endpoint that enabled
/// its type, each with every attempt recorded (status, duration, error).
#[utoipa::path(
    get,
    path = "/v1/events/{id}/deliveries",
    tag = "webhooks",
    security(("bearer" = []), ("basic" = [])),
    params(("id" = String, Path, description = "An event id, `evt_...`")),
    responses(
        (status = 200, description = "A list object of deliveries", body = super::openapi::WebhookDeliveryList),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 404, response = super::openapi::NotFound),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
async fn deliveries(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    _: NoQuery,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let Some(event) = store::find(&state.pool, merchant.id, &id).await? else {
        return Err(no_such_event(&id, "id"));
    };
    let deliveries = webhooks::deliveries_of(&state.pool, event.seq).await?;
    let attempts = webhooks::attempts_of(&state.pool, event.seq).await?;
    let data: Vec<_> = deliveries
        .iter()
        .map(|d| {
            let tried: Vec<_> = attempts
                .iter()
                .filter(|a| a.endpoint_id == d.endpoint_id)
                .map(|a| {
                    json!({
                        "attempt": a.attempt,
                        "created": a.started_at.timestamp(),
                        "duration_ms": a.duration_ms,
                        "response_status": a.response_status,
                        "error": a.error,
                    })
                })
                .collect();
            json!({
                "object": "webhook_delivery",
                "event": event.id,
                "webhook_endpoint": d.endpoint_id,
                "url": d.url,
                "status": d.status.as_str(),
                "attempt_count": d.attempts,
                "next_attempt": (d.status == DeliveryStatus::Pending)
                    .then(|| d.next_attempt_at.timestamp()),
                "finished": d.finished_at.map(|t| t.timestamp()),
                "failure_reason": d.failure_reason,
                "attempts": tried,
            })
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "url": format!("{ROUTE}/{}/deliveries", event.id),
        "has_more": false,
        "data": data,
    }))
    .into_response())
}

fn no_such_event(id: &str, param: &str) -> ApiError {
    super::problem::no_such("event", id, param)
}

/// The merchant's events, newest first.
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "events",
    security(("bearer" = []), ("basic" = [])),
    params(
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 100, description = "1 to 100, default 10"),
        ("starting_after" = Option<String>, Query, description = "An event id: the page of events older than it"),
        ("ending_before" = Option<String>, Query, description = "An event id: the page of events newer than it (not with `starting_after`)"),
        ("type" = Option<super::openapi::EventType>, Query, description = "Only events of this type"),
        ("types[]" = Option<Vec<super::openapi::EventType>>, Query, explode, description = "Only events of these types, up to 20 (not with `type`); `types[0]=...` works too")
    ),
    responses(
        (status = 200, description = "A list object", body = super::openapi::EventList),
        (status = 400, response = super::openapi::BadRequest),
        (status = 401, response = super::openapi::Unauthorized),
        (status = 500, response = super::openapi::InternalError),
        (status = 503, response = super::openapi::Unavailable)
    )
)]
async fn list(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let query = ListQuery::parse(query.as_deref().unwrap_or(""))?;
    let types: Option<Vec<&str>> = query
        .types
        .as_ref()
        .map(|types| types.iter().map(|t| t.as_str()).collect());
    let types = types.as_deref();
    let limit = query.limit;
    let cursor = |id: &str, param: &'static str| {
        let pool = state.pool.clone();
        let id = id.to_owned();
        async move {
            match store::find(&pool, merchant.id, &id).await? {
                Some(event) => Ok::<_, ApiError>(event.seq),
                None => Err(no_such_event(&id, param)),
            }
        }
    };
    let (events, has_more) = match &query.page {
        Page::EndingBefore(id) => {
            let after = cursor(id, "ending_before").await?;
            let mut events =
                store::list_newer(&state.pool, merchant.id, types, after, limit + 1).await?;
            let has_more = events.len() as i64 > limit;
            // The `limit` next to the cursor, newest first like every page.
            events.truncate(limit as usize);
            events.reverse();
            (events, has_more)
        }
        page => {
            let before = match page {
                Page::StartingAfter(id) => Some(cursor(id, "starting_after").await?),
                _ => None,
            };
            let mut events =
                store::list_older(&state.pool, merchant.id, types, before, limit + 1).await?;
            let has_more = events.len() as i64 > limit;
            events.truncate(limit as usize);
            (events, has_more)
        }
    };
    let data: Vec<_> = events.iter().map(|e| e.to_object()).collect();
    Ok(Json(json!({
        "object": "list",
        "url": ROUTE,
        "has_more": has_more,
        "data": data,
    }))
    .into_response())
}

/// Which page of the list.
#[derive(Debug, PartialEq, Eq)]
enum Page {
    First,
    StartingAfter(String),
    EndingBefore(String),
}

/// The list's query, validated.
#[derive(Debug)]
struct ListQuery {
    limit: i64,
    page: Page,
    /// `None`: every type.
    types: Option<Vec<EventType>>,
}

impl ListQuery {
    fn parse(query: &str) -> Result<Self, ApiError> {
        let mut limit = 10_i64;
        let mut page = Page::First;
        let mut one_type = None;
        let mut types: Option<Vec<EventType>> = None;
        for pair in crate::params::form_pairs(query.as_bytes()) {
            let (name, value) = pair?;
            match name.as_ref() {
                "limit" => {
                    limit = value
                        .parse()
                        .ok()
                        .filter(|l| (1..=100).contains(l))
                        .ok_or_else(|| {
                            Problem::new(
                                ProblemCode::ParameterInvalidInteger,
                                "limit must be a whole number from 1 to 100",
                            )
                            .with_param("limit")
                        })?;
                }
                cursor @ ("starting_after" | "ending_before") => {
                    // No id contains NUL (and Postgres text cannot hold it).
                    if value.contains('\0') {
                        return Err(no_such_event("\\u0000", cursor));
                    }
                    let id = value.into_owned();
                    page = match (&page, cursor) {
                        (Page::EndingBefore(_), "starting_after")
                        | (Page::StartingAfter(_), "ending_before") => {
                            return Err(exclusive("starting_after", "ending_before"));
                        }
                        (_, "starting_after") => Page::StartingAfter(id),
                        _ => Page::EndingBefore(id),
                    };
                }
                "type" => one_type = Some(event_type(&value, "type")?),
                name if is_types_entry(name) => {
                    let types = types.get_or_insert_with(Vec::new);
                    if types.len() == MAX_TYPES {
                        return Err(Problem::new(
                            ProblemCode::ParameterTooLong,
                            format!("types can name at most {MAX_TYPES} event types"),
                        )
                        .with_param("types")
                        .into());
                    }
                    types.push(event_type(&value, "types")?);
                }
                other => return Err(ParamError::unknown(other).into()),
            }
        }
        let types = match (one_type, types) {
            (Some(_), Some(_)) => return Err(exclusive("type", "types")),
            (Some(one), None) => Some(vec![one]),
            (None, types) => types,
        };
        Ok(ListQuery { limit, page, types })
    }
}

/// `types[]` or `types[N]`, as the Stripe SDKs send an array.
fn is_types_entry(name: &str) -> bool {
    name.strip_prefix("types[")
        .and_then(|rest| rest.strip_suffix(']'))
        .is_some_and(|index| index.bytes().all(|b| b.is_ascii_digit()))
}

fn event_type(value: &str, param: &str) -> Result<EventType, ApiError> {
    EventType::parse(value).ok_or_else(|| {
        let known: Vec<&str> = EventType::ALL.iter().map(|t| t.as_str()).collect();
        Problem::new(
            ProblemCode::InvalidEventType,
            format!(
                "Invalid event type: {}. Use one of {}",
                shorten(value),
                known.join(", ")
            ),
        )
        .with_param(param)
        .into()
    })
}

fn exclusive(one: &str, other: &str) -> ApiError {
    Problem::new(
        ProblemCode::ParametersExclusive,
        format!("Send {one} or {other}, not both."),
    )
    .with_param(other)
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(query: &str) -> String {
        match ListQuery::parse(query) {
            Ok(q) => panic!("{query} parsed: {q:?}"),
            Err(ApiError(crate::error::Error::Problem(p))) => p.code.as_str().to_owned(),
            Err(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn a_list_query_reads_every_parameter() {
        let q = ListQuery::parse("limit=3&starting_after=evt_1&type=charge.failed").unwrap();
        assert_eq!(q.limit, 3);
        assert_eq!(q.page, Page::StartingAfter("evt_1".into()));
        assert_eq!(q.types, Some(vec![EventType::ChargeFailed]));
        let q =
            ListQuery::parse("ending_before=evt_2&types[]=refund.failed&types[1]=charge.refunded")
                .unwrap();
        assert_eq!((q.limit, q.page), (10, Page::EndingBefore("evt_2".into())));
        assert_eq!(
            q.types,
            Some(vec![EventType::RefundFailed, EventType::ChargeRefunded])
        );
        assert!(ListQuery::parse("").unwrap().types.is_none());
    }

    #[test]
    fn bad_list_queries_are_refused_with_their_code() {
        assert_eq!(code("limit=0"), "parameter_invalid_integer");
        assert_eq!(code("limit=101"), "parameter_invalid_integer");
        assert_eq!(code("type=charge.*"), "invalid_event_type");
        assert_eq!(code("types[]=charge"), "invalid_event_type");
        assert_eq!(
            code("starting_after=evt_1&ending_before=evt_2"),
            "parameters_exclusive"
        );
        assert_eq!(
            code("type=charge.failed&types[]=charge.failed"),
            "parameters_exclusive"
        );
        assert_eq!(code("types[x]=charge.failed"), "parameter_unknown");
        assert_eq!(code("created=5"), "parameter_unknown");
        let many = vec!["types[]=charge.failed"; 21].join("&");
        assert_eq!(code(&many), "parameter_too_long");
    }
}
