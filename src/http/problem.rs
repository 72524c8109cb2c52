//! Errors as `application/problem+json` (RFC 9457), each with a stable `code`.

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::retry_after;
use crate::config::Config;
use crate::params::{DecodeError, ParamError};
use crate::processor::ProcessorError;

pub const CONTENT_TYPE: &str = "application/problem+json";

/// A problem to show the client: status, stable code, human detail.
#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
    pub param: Option<String>,
    /// Extra members of the body, such as the failed charge's id.
    pub extra: Map<String, Value>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl Problem {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Problem {
            status,
            code,
            detail: detail.into(),
            param: None,
            extra: Map::new(),
            headers: Vec::new(),
        }
    }

    /// Names the parameter at fault, cut to
    /// [`MAX_PARAM_CHARS`](crate::params::MAX_PARAM_CHARS) should a caller
    /// have passed a client's long name unshortened.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        let param = param.into();
        let param = crate::params::shorten_to(&param, crate::params::MAX_PARAM_CHARS);
        self.param = Some(param.into_owned());
        self
    }

    pub fn with_extra(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(name.to_owned(), value.into());
        self
    }

    pub fn with_header(mut self, name: HeaderName, value: &'static str) -> Self {
        self.headers.push((name, HeaderValue::from_static(value)));
        self
    }

    /// `Retry-After: seconds`, a value from [`retry_after`].
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.headers
            .push((header::RETRY_AFTER, HeaderValue::from(seconds)));
        self
    }

    /// The body, as saved for replay and as sent.
    pub fn body(&self) -> Vec<u8> {
        let mut body = json!({
            "type": format!("/problems/{}", self.code),
            "title": self.status.canonical_reason().unwrap_or("Error"),
            "status": self.status.as_u16(),
            "detail": self.detail,
            "code": self.code,
        });
        let object = body.as_object_mut().expect("a JSON object");
        if let Some(param) = &self.param {
            object.insert("param".into(), param.clone().into());
        }
        object.extend(self.extra.clone());
        serde_json::to_vec(&body).expect("serialising a JSON value cannot fail")
    }
}

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
        // For `observe::finish_problems`, which adds the request id.
        response.extensions_mut().insert(self);
        response
    }
}

/// Everything a handler can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A problem the client can act on.
    #[error("{} {}: {}", .0.status, .0.code, .0.detail)]
    Problem(Box<Problem>),
    /// The database cannot be reached: 503, try again.
    #[error("database unavailable")]
    Unavailable(#[source] anyhow::Error),
    /// A bug or an unexpected failure: logged in full, shown as a plain 500.
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

impl From<Problem> for ApiError {
    fn from(problem: Problem) -> Self {
        ApiError::Problem(Box::new(problem))
    }
}

impl From<ParamError> for ApiError {
    fn from(e: ParamError) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, e.code, e.message)
            .with_param(e.param)
            .into()
    }
}

impl From<DecodeError> for ApiError {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Param(e) => e.into(),
            e @ (DecodeError::Json(_) | DecodeError::NotAnObject) => {
                Problem::new(StatusCode::BAD_REQUEST, "invalid_json", e.to_string()).into()
            }
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        if matches!(e, sqlx::Error::PoolTimedOut) {
            metrics::counter!("db_pool_timeouts_total").increment(1);
        }
        if is_unavailable(&e) {
            ApiError::Unavailable(e.into())
        } else {
            ApiError::Internal(e.into())
        }
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        match e.downcast_ref::<sqlx::Error>() {
            Some(sqlx_error) if is_unavailable(sqlx_error) => ApiError::Unavailable(e),
            _ => ApiError::Internal(e),
        }
    }
}

impl ApiError {
    /// An error from work that leaves its record pending for recovery when
    /// it fails: recovering a stale key, or the naive demo path. A processor
    /// failure is a `503` to retry once recovery can have settled the
    /// record, not a bug.
    pub fn from_recovery(e: anyhow::Error, config: &Config) -> Self {
        let Some(processor) = e.downcast_ref::<ProcessorError>() else {
            return ApiError::from(e).awaiting_recovery(config);
        };
        tracing::warn!(error = format!("{e:#}"), "processor call failed");
        let (code, detail) = match processor {
            ProcessorError::Unavailable => (
                "processor_unavailable",
                "The card processor is unavailable. Retry with the same Idempotency-Key.",
            ),
            ProcessorError::OutcomeUnknown(_) => (
                "processing_outcome_unknown",
                "The card processor did not confirm the outcome. Retry with the same Idempotency-Key to get it.",
            ),
        };
        Problem::new(StatusCode::SERVICE_UNAVAILABLE, code, detail)
            .with_retry_after(retry_after::until_recovered(config))
            .into()
    }

    /// For an error after the processor was called: the record stays
    /// pending until recovery settles it, so a database outage's `503`
    /// tells the client to come back once that can have happened, not in a
    /// second (when it would only get `409`).
    pub fn awaiting_recovery(self, config: &Config) -> Self {
        match self {
            ApiError::Unavailable(error) => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "database unavailable after the processor call; the record stays pending"
                );
                service_unavailable(retry_after::until_recovered(config)).into()
            }
            other => other,
        }
    }
}

/// `503 service_unavailable`: the database cannot be reached.
pub fn service_unavailable(retry_after: u64) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "The service cannot reach its database right now. Retry shortly (a POST with the same Idempotency-Key).",
    )
    .with_retry_after(retry_after)
}

/// Errors that mean "the database is not there right now", not "a bug".
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        // 57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now,
        // and class 08, connection exceptions.
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
        _ => false,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Problem(problem) => problem.into_response(),
            ApiError::Unavailable(error) => {
                tracing::warn!(error = format!("{error:#}"), "database unavailable");
                service_unavailable(retry_after::SOON).into_response()
            }
            ApiError::Internal(error) => {
                tracing::error!(error = format!("{error:#}"), "internal error");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    "Something went wrong on our side. Retry shortly (a POST with the same Idempotency-Key).",
                )
                .into_response()
            }
        }
    }
}
