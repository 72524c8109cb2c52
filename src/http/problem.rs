//! Problems and errors as HTTP responses: `application/problem+json`
//! (RFC 9457), each with a stable `code` (see [`oncepay_core::problem`]).

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use oncepay_core::error::{Error, service_unavailable};
use oncepay_core::problem::{CONTENT_TYPE, Problem, ProblemCode};
use oncepay_core::retry_after;

/// A problem as its response: `application/problem+json`, with the
/// problem's status and headers. (The core's [`Problem`] knows no HTTP
/// server; this is where it becomes a response.)
pub fn respond(problem: Problem) -> Response {
    let body = problem.body();
    let mut response = (
        problem.status,
        [(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE))],
        body,
    )
        .into_response();
    for (name, value) in &problem.headers {
        response.headers_mut().append(name.clone(), value.clone());
    }
    // For `observe::finish`, which adds the request id.
    response.extensions_mut().insert(problem);
    response
}

/// `resource_missing` for a `noun` (`charge`, `event`, ...) with `id`, named
/// by `param`: `404` when the id is the path's, `400` when a parameter
/// (a cursor, a charge to refund) names nothing.
pub fn no_such(noun: &str, id: &str, param: &str) -> ApiError {
    let status = if param == "id" {
        axum::http::StatusCode::NOT_FOUND
    } else {
        axum::http::StatusCode::BAD_REQUEST
    };
    Problem::with_status(
        status,
        ProblemCode::ResourceMissing,
        format!("No such {noun}: '{}'", oncepay_core::params::shorten(id)),
    )
    .with_param(param)
    .into()
}

/// What a lookup by the path's id found, or, when it found nothing,
/// `404 resource_missing` for a `noun` (see [`no_such`]).
pub fn found<T>(found: Option<T>, noun: &str, id: &str) -> Result<T, ApiError> {
    found.ok_or_else(|| no_such(noun, id, "id"))
}

/// Everything a handler can fail with: an [`Error`] of the layers below,
/// rendered as a problem.
#[derive(Debug)]
pub struct ApiError(pub Error);

impl<E: Into<Error>> From<E> for ApiError {
    fn from(e: E) -> Self {
        ApiError(e.into())
    }
}

impl ApiError {
    /// A bug or an unexpected failure: a plain `500`.
    pub fn internal(e: anyhow::Error) -> Self {
        ApiError(Error::Internal(e))
    }

    /// The database cannot be reached: `503`, try again.
    pub fn unavailable(e: anyhow::Error) -> Self {
        ApiError(Error::Unavailable(e))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self.0 {
            Error::Problem(problem) => respond(*problem),
            Error::Unavailable(error) => {
                tracing::warn!(error = format!("{error:#}"), "database unavailable");
                respond(service_unavailable(retry_after::SOON))
            }
            Error::Internal(error) => {
                tracing::error!(error = format!("{error:#}"), "internal error");
                respond(Problem::new(
                    ProblemCode::InternalError,
                    "Something went wrong on our side. Retry shortly (a POST with the same Idempotency-Key).",
                ))
            }
        }
    }
}
