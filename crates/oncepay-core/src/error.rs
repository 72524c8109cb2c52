//! The error every operation (and every handler) can fail with: a problem
//! the client can act on, the database out of reach, or a bug. The HTTP
//! layer renders it (`http::problem::ApiError`); nothing here knows HTTP.

use http::StatusCode;

use crate::params::{DecodeError, ParamError};
use crate::problem::{Problem, ProblemCode};
use crate::processor::ProcessorError;
use crate::retry_after;
use crate::settings::Timeouts;

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
        // Anywhere in the chain: a store's own error may wrap sqlx's.
        let unavailable = e
            .chain()
            .filter_map(|cause| cause.downcast_ref::<sqlx::Error>())
            .any(is_unavailable);
        if unavailable {
            Error::Unavailable(e)
        } else {
            Error::Internal(e)
        }
    }
}

impl Error {
    /// A bug or an unexpected state, with `message` as its context.
    pub fn internal(message: impl std::fmt::Display) -> Self {
        Error::Internal(anyhow::anyhow!("{message}"))
    }

    /// An error from work that leaves its record pending for recovery (the
    /// naive demo path): a processor failure is a `503` to retry once
    /// recovery can have settled it ([`retry_after::until_recovered`]), and
    /// so is a database outage ([`Error::awaiting_recovery`]); not a bug.
    pub fn from_recovery(e: anyhow::Error, timeouts: &Timeouts) -> Self {
        Error::from_processor(e, retry_after::until_recovered(timeouts)).awaiting_recovery(timeouts)
    }

    /// A processor failure as its `503`, to retry after `retry_after`
    /// seconds; any other error as [`Error::from`] makes it.
    pub fn from_processor(e: anyhow::Error, retry_after: u64) -> Self {
        let Some(processor) = e.downcast_ref::<ProcessorError>() else {
            return Error::from(e);
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
            .with_retry_after(retry_after)
            .into()
    }

    /// For an error after the processor was called: a database outage's
    /// `503` waits for recovery ([`retry_after::until_recovered`]).
    pub fn awaiting_recovery(self, timeouts: &Timeouts) -> Self {
        match self {
            Error::Unavailable(error) => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "database unavailable after the processor call; the record stays pending"
                );
                service_unavailable(retry_after::until_recovered(timeouts)).into()
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

/// `503 overloaded`: this request waited for a database connection past its
/// bound (the server's `src/speed/admission.rs`) and began no work.
pub fn overloaded() -> Problem {
    Problem::new(
        ProblemCode::Overloaded,
        "The service has more requests than it can serve right now, and this one was turned away before any work began. Retry shortly (a POST with the same Idempotency-Key).",
    )
    .with_retry_after(retry_after::SOON)
}

/// Errors that mean "the database cannot serve now" (unreachable, refusing
/// connections, or ending the session), not "a bug": a `503`, never a `500`.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            // FATAL and PANIC end the session: every refusal at connect time
            // (a database not accepting connections, too many connections,
            // failed authentication, a database that is gone) and every
            // session the server cut.
            let session_ended = db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some_and(|pg| {
                    matches!(
                        pg.severity(),
                        sqlx::postgres::PgSeverity::Fatal | sqlx::postgres::PgSeverity::Panic
                    )
                });
            session_ended || db.code().is_some_and(|code| unavailable_code(&code))
        }
        _ => false,
    }
}

/// SQLSTATEs of a database that cannot serve now: class 08 (connection
/// exceptions), class 53 (insufficient resources: 53300
/// too_many_connections, disk full, out of memory), 57P (57P01
/// admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now, 57P04
/// database_dropped), and 25006 read_only_sql_transaction (a standby, as
/// after a failover).
fn unavailable_code(code: &str) -> bool {
    code.starts_with("08") || code.starts_with("53") || code.starts_with("57P") || code == "25006"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_codes_of_a_database_that_cannot_serve_now_are_unavailable_and_others_are_not() {
        for code in [
            "08006", "08001", "53300", "53100", "57P01", "57P03", "57P04", "25006",
        ] {
            assert!(unavailable_code(code), "{code}");
        }
        for code in ["23505", "40001", "42P01", "22P02", "55000"] {
            assert!(!unavailable_code(code), "{code}");
        }
        assert!(is_unavailable(&sqlx::Error::PoolTimedOut));
        assert!(!is_unavailable(&sqlx::Error::RowNotFound));
    }

    #[test]
    fn a_sqlx_error_deep_in_an_anyhow_chain_still_counts() {
        #[derive(Debug, thiserror::Error)]
        #[error("the store failed")]
        struct Store(#[source] sqlx::Error);
        let wrapped = anyhow::Error::new(Store(sqlx::Error::PoolTimedOut)).context("settling");
        assert!(matches!(Error::from(wrapped), Error::Unavailable(_)));
        let bug = anyhow::Error::new(Store(sqlx::Error::RowNotFound));
        assert!(matches!(Error::from(bug), Error::Internal(_)));
    }
}
