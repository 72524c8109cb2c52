//! Problems and errors as HTTP responses: `application/problem+json`
//! (RFC 9457), each with a stable `code` (see [`crate::problem`]).

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use crate::error::{Error, service_unavailable};
use crate::problem::{CONTENT_TYPE, Problem, ProblemCode};
use crate::retry_after;

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = self.body();
        let mut response = (
            self.status,
            [(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE))],
            body,
        )
            .into_response();
        for (name, value) in &self.headers {
            response.headers_mut().append(name.clone(), value.clone());
        }
        // For `observe::finish`, which adds the request id.
        response.extensions_mut().insert(self);
        response
    }
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
        format!("No such {noun}: '{}'", crate::params::shorten(id)),
    )
    .with_param(param)
    .into()
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
            Error::Problem(problem) => problem.into_response(),
            Error::Unavailable(error) => {
                tracing::warn!(error = format!("{error:#}"), "database unavailable");
                service_unavailable(retry_after::SOON).into_response()
            }
            Error::Internal(error) => {
                tracing::error!(error = format!("{error:#}"), "internal error");
                Problem::new(
                    ProblemCode::InternalError,
                    "Something went wrong on our side. Retry shortly (a POST with the same Idempotency-Key).",
                )
                .into_response()
            }
        }
    }
}
