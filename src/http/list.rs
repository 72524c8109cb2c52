//! Stripe's list object, and what the lists share: a page found from its
//! cursor, read one row past its `limit` to know whether more remain, and
//! the `created` filter.
//!
//! The lists of objects ordered by creation (charges, refunds) read their
//! pages with [`created_page!`], so that the SQL of a page is written once;
//! the events list has an order of its own (see `events.rs`) and shares the
//! rest.

use std::future::Future;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::openapi::RefOr;
use utoipa::openapi::path::{Parameter, ParameterBuilder, ParameterIn};
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::{IntoParams, ToSchema};

use super::extract::PageParams;
use super::problem::{ApiError, no_such};
use oncepay_core::params::{ParamError, Params, shorten};
use oncepay_core::problem::ProblemCode;

/// A page of objects, in Stripe's list shape.
#[derive(Serialize, ToSchema)]
pub struct List<T> {
    #[schema(example = "list")]
    pub object: &'static str,
    /// The route the page was read from, e.g. `/v1/charges`.
    pub url: String,
    /// Whether objects beyond this page remain.
    pub has_more: bool,
    pub data: Vec<T>,
}

impl<T> List<T> {
    /// The page `data` of the list at `url`.
    pub fn new(url: impl Into<String>, has_more: bool, data: Vec<T>) -> Self {
        List {
            object: "list",
            url: url.into(),
            has_more,
            data,
        }
    }
}

/// Where an object stands in a list ordered by creation: `created_at`,
/// then `id` between objects created in the same microsecond.
#[derive(Clone, Debug)]
pub struct Position {
    pub created_at: DateTime<Utc>,
    pub id: String,
}

/// Which page of a list ordered by creation: the one after a cursor
/// (older), or the newest when there is none; or the one before a cursor
/// (newer).
pub enum Page {
    After(Option<Position>),
    Before(Position),
}

impl Page {
    /// The page a list's cursor (its parameter and id, from
    /// [`PageParams`](super::extract::PageParams)) names. `find` reads the
    /// position of the merchant's object with that id; none is
    /// `400 resource_missing` naming the cursor's parameter and `noun`.
    pub async fn of<F, Fut>(
        cursor: Option<(&'static str, String)>,
        noun: &str,
        find: F,
    ) -> Result<Page, ApiError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = sqlx::Result<Option<Position>>>,
    {
        let Some((name, id)) = cursor else {
            return Ok(Page::After(None));
        };
        let position = find(id.clone())
            .await?
            .ok_or_else(|| no_such(noun, &id, name))?;
        Ok(match name {
            "starting_after" => Page::After(Some(position)),
            _ => Page::Before(position),
        })
    }

    /// Whether the page lies on the newer side of its cursor, so its rows
    /// are read oldest first (see [`finish`]).
    pub fn is_newer(&self) -> bool {
        matches!(self, Page::Before(_))
    }
}

/// A page as shown, from the rows read for it: up to `limit + 1` next to
/// the cursor, nearest first. Whether more remain (the extra row), and the
/// `limit` nearest ones newest first, as every page shows them; rows read
/// on the `newer` side of the cursor come oldest first and are turned round.
pub fn finish<T>(mut rows: Vec<T>, limit: i64, newer: bool) -> (bool, Vec<T>) {
    let has_more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    if newer {
        rows.reverse();
    }
    (has_more, rows)
}

/// Reads a [`Page`] of a list ordered by creation, within a [`Created`]
/// range, as `sqlx::Result<Vec<_>>`: `$select` is a macro of the table's
/// `query_as!`, its `WHERE` clause ending in `AND `, that appends the SQL
/// literal it is given. That SQL takes `$1` the merchant, `$2` and `$3` the
/// range, `$4` and `$5` the cursor's position, `$6` the limit; a `$select`
/// that filters further takes its own arguments (`$7` on) after them.
///
/// A macro because sqlx checks only literal text: each expansion is checked
/// against the schema like any query. Both bounds of the range are always
/// given, so each page is one range of an index on
/// `(merchant_id, created_at DESC, id DESC)`.
macro_rules! created_page {
    ($select:ident, $db:expr, $merchant_id:expr, $page:expr, $created:expr, $limit:expr $(, $arg:expr)* $(,)?) => {
        match $page {
            $crate::http::list::Page::After(cursor) => {
                $select!(
                    "created_at >= $2 AND created_at < $3
                     AND ($4::timestamptz IS NULL OR (created_at, id) < ($4, $5))
                     ORDER BY created_at DESC, id DESC LIMIT $6",
                    $merchant_id,
                    $created.from,
                    $created.until,
                    cursor.as_ref().map(|c| c.created_at),
                    cursor.as_ref().map(|c| c.id.as_str()),
                    $limit,
                    $($arg),*
                )
                .fetch_all($db)
                .await
            }
            $crate::http::list::Page::Before(cursor) => {
                $select!(
                    "created_at >= $2 AND created_at < $3
                     AND (created_at, id) > ($4, $5)
                     ORDER BY created_at, id LIMIT $6",
                    $merchant_id,
                    $created.from,
                    $created.until,
                    cursor.created_at,
                    cursor.id.as_str(),
                    $limit,
                    $($arg),*
                )
                .fetch_all($db)
                .await
            }
        }
    };
}
pub(crate) use created_page;

/// The first instant a `created` bound may name: earlier bounds are
/// clamped to it (no object is older), so that every bound is a timestamp
/// Postgres and chrono both hold. Midnight, 1 January of the year 1.
const EARLIEST: i64 = -62_135_596_800;
/// The end of the range a `created` bound may name: midnight, 1 January
/// of the year 10000.
const LATEST: i64 = 253_402_300_800;

/// A list's `created` filter, as Stripe's lists take it: `created=<unix>`
/// (created in that second) or any of `created[gt]`, `created[gte]`,
/// `created[lt]`, `created[lte]`, in Unix seconds. Held as the half-open
/// range of instants `[from, until)` they leave: a second `T` covers every
/// instant from `T` up to `T + 1`, the instants whose `created` is `T`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Created {
    pub from: DateTime<Utc>,
    pub until: DateTime<Utc>,
}

impl Created {
    /// Every instant: no filter.
    pub fn any() -> Self {
        Created {
            from: instant(EARLIEST),
            until: instant(LATEST),
        }
    }

    /// Takes `created` out of `params`; none is every instant. A bound that
    /// is not a whole number is `parameter_invalid_integer` naming it
    /// (`created[gte]`), a bound of another name `parameter_unknown`.
    pub fn take(params: &mut Params) -> Result<Self, ParamError> {
        let (mut from, mut until) = (EARLIEST, LATEST);
        match params.take("created") {
            None => {}
            Some(Value::Object(bounds)) => {
                for (op, value) in bounds {
                    let param = format!("created[{op}]");
                    let second = || unix_seconds(&value, &param);
                    match op.as_str() {
                        "gt" => from = from.max(second()?.saturating_add(1)),
                        "gte" => from = from.max(second()?),
                        "lt" => until = until.min(second()?),
                        "lte" => until = until.min(second()?.saturating_add(1)),
                        _ => return Err(ParamError::unknown(&param)),
                    }
                }
            }
            Some(value) => {
                let second = unix_seconds(&value, "created")?;
                (from, until) = (second, second.saturating_add(1));
            }
        }
        Ok(Created {
            from: instant(from),
            until: instant(until),
        })
    }
}

/// The whole number of seconds `value` holds, or `parameter_invalid_integer`
/// for `param`, with Stripe's message.
fn unix_seconds(value: &Value, param: &str) -> Result<i64, ParamError> {
    let text = match value {
        Value::String(text) => text.as_str(),
        _ => "",
    };
    text.parse().map_err(|_| {
        ParamError::new(
            ProblemCode::ParameterInvalidInteger,
            param,
            format!("Invalid integer: {}", shorten(text)),
        )
    })
}

/// The instant `second` Unix seconds name, clamped to what a bound may name.
fn instant(second: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(second.clamp(EARLIEST, LATEST), 0)
        .expect("the clamped range is within chrono's")
}

/// The `created` filter's parameters, for a list's OpenAPI description.
impl IntoParams for Created {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        [
            ("created", "Created in this second (Unix seconds)"),
            ("created[gt]", "Created after this second"),
            ("created[gte]", "Created in or after this second"),
            ("created[lt]", "Created before this second"),
            ("created[lte]", "Created in or before this second"),
        ]
        .into_iter()
        .map(|(name, description)| query_param(name, description, Type::Integer))
        .collect()
    }
}

/// A page's parameters, for a list's OpenAPI description.
impl IntoParams for PageParams {
    fn into_params(_: impl Fn() -> Option<ParameterIn>) -> Vec<Parameter> {
        let mut limit = query_param("limit", "1 to 100, default 10", Type::Integer);
        if let Some(RefOr::T(Schema::Object(schema))) = &mut limit.schema {
            schema.minimum = Some(1.into());
            schema.maximum = Some(100.into());
        }
        let cursors = [
            ("starting_after", "An id of the listed kind: the page of older objects after it"),
            (
                "ending_before",
                "An id of the listed kind: the page of newer objects before it (not with `starting_after`)",
            ),
        ]
        .map(|(name, description)| query_param(name, description, Type::String));
        [limit].into_iter().chain(cursors).collect()
    }
}

/// An optional query parameter of type `kind`.
fn query_param(name: &str, description: &str, kind: Type) -> Parameter {
    ParameterBuilder::new()
        .name(name)
        .parameter_in(ParameterIn::Query)
        .description(Some(description))
        .schema(Some(ObjectBuilder::new().schema_type(kind)))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The range `query` leaves, in Unix seconds, or the code and
    /// parameter it is refused with.
    fn range(query: &str) -> Result<(i64, i64), (ProblemCode, String)> {
        let mut params = Params::from_form(query.as_bytes()).unwrap();
        Created::take(&mut params)
            .map(|c| (c.from.timestamp(), c.until.timestamp()))
            .map_err(|e| (e.code, e.param))
    }

    #[test]
    fn each_bound_leaves_the_seconds_it_names() {
        assert_eq!(range(""), Ok((EARLIEST, LATEST)));
        assert_eq!(range("created=100"), Ok((100, 101)));
        assert_eq!(range("created[gt]=100"), Ok((101, LATEST)));
        assert_eq!(range("created[gte]=100"), Ok((100, LATEST)));
        assert_eq!(range("created[lt]=100"), Ok((EARLIEST, 100)));
        assert_eq!(range("created[lte]=100"), Ok((EARLIEST, 101)));
        assert_eq!(
            range("created[gte]=100&created[gt]=100&created[lt]=200&created[lte]=150"),
            Ok((101, 151))
        );
    }

    #[test]
    fn bounds_beyond_any_instant_are_clamped_not_refused() {
        assert_eq!(
            range("created[gt]=9223372036854775807"),
            Ok((LATEST, LATEST))
        );
        assert_eq!(
            range("created[lte]=-9223372036854775808"),
            Ok((EARLIEST, EARLIEST))
        );
    }

    #[test]
    fn a_bound_that_is_not_a_whole_number_is_refused_by_its_name() {
        let invalid = |param: &str| Err((ProblemCode::ParameterInvalidInteger, param.to_owned()));
        assert_eq!(range("created=yesterday"), invalid("created"));
        assert_eq!(range("created[gte]=1.5"), invalid("created[gte]"));
        assert_eq!(range("created[lt]="), invalid("created[lt]"));
        assert_eq!(
            range("created[lt]=99999999999999999999"),
            invalid("created[lt]")
        );
        assert_eq!(range("created[]=1"), invalid("created"));
        assert_eq!(
            range("created[after]=1"),
            Err((ProblemCode::ParameterUnknown, "created[after]".to_owned()))
        );
    }
}
