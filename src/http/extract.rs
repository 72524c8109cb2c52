//! Extractors whose every failure is a problem: request bodies (JSON or
//! `application/x-www-form-urlencoded`, within `MAX_BODY_BYTES`) and path
//! parameters.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use utoipa::IntoParams;
use uuid::Uuid;

use super::auth::Authenticated;
use super::problem::ApiError;
use super::{faults, idempotent, observe};
use crate::app::AppState;
use crate::merchants::Merchant;
use crate::speed::timing::Stopwatch;
use crate::workshop::trace::{RequestTrace, Traced};
use oncepay_core::faults::Fault;
use oncepay_core::idempotency::Fingerprint;
use oncepay_core::idempotency::IdempotencyKey;
use oncepay_core::operation::engine::{self, METHOD};
use oncepay_core::operation::timing::{Clock, Phase};
use oncepay_core::params::Params;
use oncepay_core::problem::{Problem, ProblemCode};

/// The raw body, read within the configured limit.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Bytes::from_request(req, state).await {
            Ok(bytes) => Ok(RawBody(bytes)),
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(Problem::new(
                    ProblemCode::PayloadTooLarge,
                    "The request body is larger than this server accepts.",
                )
                .into())
            }
            Err(rejection) => Err(Problem::new(
                ProblemCode::InvalidBody,
                format!(
                    "The request body could not be read: {}",
                    rejection.body_text()
                ),
            )
            .into()),
        }
    }
}

/// An idempotent `POST`: its idempotency headers and its decoded
/// parameters, refused in the order a client fixes them: the body's size,
/// the `Idempotency-Key`, `Oncepay-Fault`, the body's encoding.
///
/// Its headers are the operations' documented parameters (`IntoParams`).
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
pub struct IdempotentPost {
    /// The request's `X-Request-Id` (set before any handler runs).
    #[param(ignore)]
    pub request_id: Option<String>,
    /// 1 to 255 visible ASCII characters, one per logical operation; the
    /// quoted RFC 8941 form names the same key.
    #[param(rename = "Idempotency-Key", value_type = String, required = false)]
    pub key: Option<IdempotencyKey>,
    #[param(ignore)]
    pub fault: Option<Fault>,
    /// `wait=N` (N up to 10): if the same request is in flight, wait for it
    /// and replay its answer instead of 409.
    #[param(rename = "Prefer", value_type = String, required = false, example = "wait=5")]
    pub wait: Duration,
    /// When the request arrived (see [`observe::Arrived`]).
    #[param(ignore)]
    pub arrived: Instant,
    #[param(ignore)]
    pub params: Params,
    /// The workshop's recording of this request, if it asked for one.
    #[param(ignore)]
    pub trace: Option<Arc<RequestTrace>>,
}

impl IdempotentPost {
    /// Who asks, as an update's event names them: the request id and key.
    pub fn asker(&self) -> crate::updates::Asker {
        crate::updates::Asker {
            request_id: self.request_id.clone(),
            key: self.key.as_ref().map(|k| k.as_str().to_owned()),
        }
    }

    /// Takes the decoded parameters out, for the operation to be made from.
    pub fn params(&mut self) -> Params {
        std::mem::take(&mut self.params)
    }

    /// The core's request for the operation on `route` whose parameters have
    /// the `canonical` form (fingerprinted here), and the clock its phases
    /// are timed on.
    pub fn request(
        self,
        state: &AppState,
        merchant_id: Uuid,
        route: &'static str,
        canonical: &[u8],
    ) -> (engine::Request, Arc<Stopwatch>) {
        let stopwatch = Stopwatch::start(route, self.arrived);
        let clock: Arc<dyn Clock> = match self.trace {
            Some(trace) => Arc::new(Traced {
                inner: stopwatch.clone(),
                trace,
            }),
            None => stopwatch.clone(),
        };
        let fingerprinting = clock.lap(Phase::Extract, self.arrived);
        let fingerprint = Fingerprint::of(METHOD, route, canonical);
        clock.lap(Phase::Fingerprint, fingerprinting);
        let request = engine::Request {
            route,
            merchant_id,
            request_id: self.request_id,
            key: self.key,
            fingerprint,
            wait: self.wait,
            fault: self.fault,
            arrived: self.arrived,
            deadline: self.arrived + state.config.request_timeout,
            client_gone: Default::default(),
            has_written: Default::default(),
            clock,
        };
        (request, stopwatch)
    }
}

impl FromRequest<AppState> for IdempotentPost {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        // The headers are taken, not copied: reading the body needs none.
        let (mut parts, body) = req.into_parts();
        let headers = std::mem::take(&mut parts.headers);
        let req = Request::from_parts(parts, body);
        let arrived = req
            .extensions()
            .get::<observe::Arrived>()
            .map_or_else(Instant::now, |arrived| arrived.0);
        let trace = req.extensions().get::<Arc<RequestTrace>>().cloned();
        let RawBody(body) = RawBody::from_request(req, state).await?;
        let key = idempotent::key_from_headers(state, &headers)?;
        let fault = faults::from_headers(state, &headers)?;
        let params = decode(&headers, &body)?;
        Ok(IdempotentPost {
            request_id: headers
                .get(observe::REQUEST_ID)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            key,
            fault,
            wait: idempotent::prefer_wait(&headers),
            arrived,
            params,
            trace,
        })
    }
}

/// Decodes the body by its `Content-Type`. A request with neither body nor
/// `Content-Type` has no parameters, as at Stripe, whose docs capture with
/// `curl -X POST .../capture -u sk_...:`.
pub fn decode(headers: &HeaderMap, body: &[u8]) -> Result<Params, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match mime.as_str() {
        "application/json" => Ok(Params::from_json(body)?),
        "application/x-www-form-urlencoded" => Ok(Params::from_form(body)?),
        "" if body.is_empty() => Ok(Params::from_form(body)?),
        _ => Err(Problem::new(
            ProblemCode::UnsupportedMediaType,
            "Send the parameters as application/json or application/x-www-form-urlencoded.",
        )
        .into()),
    }
}

/// The one `{id}`-style parameter of a route.
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let PathParams(values) = PathParams::from_request_parts(parts, state).await?;
        Ok(PathParam(values.into_iter().next().unwrap_or_default()))
    }
}

/// The `{id}`-style parameters of a route, in the order of the path.
pub struct PathParams(pub Vec<String>);

impl<S: Send + Sync> FromRequestParts<S> for PathParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<Vec<String>>::from_request_parts(parts, state).await {
            // No id contains NUL, and Postgres text cannot hold it.
            Ok(Path(values)) if values.iter().any(|v| v.contains('\0')) => {
                Err(Problem::with_status(
                    StatusCode::NOT_FOUND,
                    ProblemCode::ResourceMissing,
                    "No such resource.",
                )
                .into())
            }
            Ok(Path(values)) => Ok(PathParams(values)),
            Err(rejection) => Err(Problem::new(
                ProblemCode::InvalidPath,
                format!("The path could not be read: {}", rejection.body_text()),
            )
            .into()),
        }
    }
}

/// A `GET`'s query string, decoded like a form body, with `expand` already
/// answered ([`Params::refuse_expand`]). A handler takes the parameters it
/// knows and refuses the rest (`Params::reject_unknown`), as Stripe does;
/// one that takes none is [`NoQuery`].
pub struct QueryParams(pub Params);

impl<S: Send + Sync> FromRequestParts<S> for QueryParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or("");
        // A bare `=` names no parameter: it is how async-stripe's paginator
        // (serde_qs) writes a list request without parameters, `?=`, and
        // Stripe answers it as none. `=x` or `x=` still name one.
        let mut params = if query.split('&').any(|pair| pair == "=") {
            let kept: Vec<&str> = query.split('&').filter(|pair| *pair != "=").collect();
            Params::from_form(kept.join("&").as_bytes())?
        } else {
            Params::from_form(query.as_bytes())?
        };
        params.refuse_expand()?;
        Ok(QueryParams(params))
    }
}

/// A request for one of the merchant's resources by the id in its path,
/// with no query: [`Authenticated`], then [`NoQuery`], then [`PathParam`],
/// each refusing as it would alone.
pub struct ById {
    pub merchant: Merchant,
    pub id: String,
}

impl FromRequestParts<AppState> for ById {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let (merchant, ids) = merchant_and_ids(parts, state).await?;
        let id = ids.into_iter().next().unwrap_or_default();
        Ok(ById { merchant, id })
    }
}

/// A request for one of the merchant's resources inside another, by the
/// two ids in its path (`/v1/charges/{id}/refunds/{refund}`): the outer id,
/// then the inner one, refused as [`ById`] refuses.
pub struct ByIds {
    pub merchant: Merchant,
    pub outer: String,
    pub inner: String,
}

impl FromRequestParts<AppState> for ByIds {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let (merchant, ids) = merchant_and_ids(parts, state).await?;
        let [outer, inner]: [String; 2] = ids.try_into().unwrap_or_default();
        Ok(ByIds {
            merchant,
            outer,
            inner,
        })
    }
}

/// The merchant and the path's ids of a request for resources by id, each
/// refused as it would be alone: [`Authenticated`], then [`NoQuery`], then
/// [`PathParams`].
async fn merchant_and_ids(
    parts: &mut Parts,
    state: &AppState,
) -> Result<(Merchant, Vec<String>), ApiError> {
    let Authenticated(merchant) = Authenticated::from_request_parts(parts, state).await?;
    NoQuery::from_request_parts(parts, state).await?;
    let PathParams(ids) = PathParams::from_request_parts(parts, state).await?;
    Ok((merchant, ids))
}

/// A `GET` that takes no parameter: `expand` is answered, anything else is
/// `parameter_unknown`.
pub struct NoQuery;

impl<S: Send + Sync> FromRequestParts<S> for NoQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let QueryParams(params) = QueryParams::from_request_parts(parts, state).await?;
        params.reject_unknown()?;
        Ok(NoQuery)
    }
}

/// A list's page, as Stripe's lists take it: `limit` (1 to 100, default
/// 10) and at most one of `starting_after` and `ending_before`, each an id
/// of the listed kind.
pub struct PageParams {
    pub limit: i64,
    /// The cursor's parameter (`starting_after` or `ending_before`) and id.
    pub cursor: Option<(&'static str, String)>,
}

impl PageParams {
    /// Takes the page's parameters out of `params` and refuses any other;
    /// a cursor that is not a string names no `noun`.
    pub fn take(mut params: Params, noun: &str) -> Result<Self, ApiError> {
        let limit = match params.take("limit") {
            None => 10,
            Some(value) => value
                .as_str()
                .and_then(|v| v.parse().ok())
                .filter(|l| (1..=100).contains(l))
                .ok_or_else(|| {
                    Problem::new(
                        ProblemCode::ParameterInvalidInteger,
                        "limit must be a whole number from 1 to 100",
                    )
                    .with_param("limit")
                })?,
        };
        let mut cursor = |name: &'static str| match params.take(name) {
            None => Ok(None),
            Some(serde_json::Value::String(id)) => Ok(Some((name, id))),
            Some(_) => Err(super::problem::no_such(noun, "", name)),
        };
        let starting_after = cursor("starting_after")?;
        let ending_before = cursor("ending_before")?;
        params.reject_unknown()?;
        if starting_after.is_some() && ending_before.is_some() {
            return Err(Problem::new(
                ProblemCode::ParametersExclusive,
                "You may only specify one of these parameters: ending_before, starting_after.",
            )
            .with_param("ending_before")
            .into());
        }
        Ok(PageParams {
            limit,
            cursor: starting_after.or(ending_before),
        })
    }
}
