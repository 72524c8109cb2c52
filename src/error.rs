//! The error every operation (and every handler) can fail with: a problem
//! the client can act on, the database out of reach, or a bug. The HTTP
//! layer renders it (`http::problem::ApiError`); nothing here knows HTTP.

use http::StatusCode;

use crate::config::Config;
use crate::params::{DecodeError, ParamError};
use crate::problem::{Problem, ProblemCode};
use crate::processor::ProcessorError;
use crate::retry_after;

/// What a request could not do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
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

impl From<Problem> for Error {
    fn from(problem: Problem) -> Self {
        Error::Problem(Box::new(problem))
    }
}

impl From<ParamError> for Error {
    fn from(e: ParamError) -> Self {
        Problem::with_status(StatusCode::BAD_REQUEST, e.code, e.message)
            .with_param(e.param)
            .into()
    }
}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Param(e) => e.into(),
            e @ (DecodeError::Json(_) | DecodeError::NotAnObject) => {
                Problem::new(ProblemCode::InvalidJson, e.to_string()).into()
            }
        }
    }
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        if matches!(e, sqlx::Error::PoolTimedOut) {
            metrics::counter!("db_pool_timeouts_total").increment(1);
        }
        if is_unavailable(&e) {
            Error::Unavailable(e.into())
        } else {
            Error::Internal(e.into())
        }
    }
}

impl From<anyhow::Error> for Error {
    fn from(e: anyhow::Error) -> Self {
        match e.downcast_ref::<sqlx::Error>() {
            Some(sqlx_error) if is_unavailable(sqlx_error) => Error::Unavailable(e),
            _ => Error::Internal(e),
        }
    }
}

impl Error {
    /// A bug or an unexpected state, with `message` as its context.
    pub fn internal(message: impl std::fmt::Display) -> Self {
        Error::Internal(anyhow::anyhow!("{message}"))
    }

    /// An error from work that leaves its record pending for recovery when
    /// it fails: recovering a stale key, or the naive demo path. A processor
    /// failure is a `503` to retry once recovery can have settled the
    /// record, not a bug.
    pub fn from_recovery(e: anyhow::Error, config: &Config) -> Self {
        let Some(processor) = e.downcast_ref::<ProcessorError>() else {
            return Error::from(e).awaiting_recovery(config);
        };
        tracing::warn!(error = format!("{e:#}"), "processor call failed");
        let (code, detail) = match processor {
            ProcessorError::Unavailable => (
                ProblemCode::ProcessorUnavailable,
                "The card processor is unavailable. Retry with the same Idempotency-Key.",
            ),
            ProcessorError::OutcomeUnknown(_) => (
                ProblemCode::ProcessingOutcomeUnknown,
                "The card processor did not confirm the outcome. Retry with the same Idempotency-Key to get it.",
            ),
        };
        Problem::new(code, detail)
            .with_retry_after(retry_after::until_recovered(config))
            .into()
    }

    /// For an error after the processor was called: the record stays
    /// pending until recovery settles it, so a database outage's `503`
    /// tells the client to come back once that can have happened, not in a
    /// second (when it would only get `409`).
    pub fn awaiting_recovery(self, config: &Config) -> Self {
        match self {
            Error::Unavailable(error) => {
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
        ProblemCode::ServiceUnavailable,
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
