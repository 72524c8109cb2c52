//! Fault injection, for the failure tests and the workshop: with
//! `FAULT_INJECTION=true`, a request carrying `Oncepay-Fault` fails on purpose
//! at a chosen point. Off by default; a request asking for a fault while it
//! is off is refused with `400 fault_injection_disabled`.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::problem::{ApiError, Problem};

pub const HEADER: &str = "oncepay-fault";

/// Where to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Commit everything, then close the connection without an answer.
    DropResponse,
    /// Abort the process right after the claim committed.
    CrashAfterClaim,
    /// Abort the process right after the processor answered, before settling.
    CrashAfterProcessor,
}

impl Fault {
    /// The fault a request asks for, if any.
    pub fn from_headers(state: &AppState, headers: &HeaderMap) -> Result<Option<Fault>, ApiError> {
        let Some(value) = headers.get(HEADER) else {
            return Ok(None);
        };
        if !state.config.fault_injection {
            return Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "fault_injection_disabled",
                "Oncepay-Fault is only honoured when the server runs with FAULT_INJECTION=true.",
            )
            .into());
        }
        match value.to_str().unwrap_or("") {
            "drop-response" => Ok(Some(Fault::DropResponse)),
            "crash-after-claim" => Ok(Some(Fault::CrashAfterClaim)),
            "crash-after-processor" => Ok(Some(Fault::CrashAfterProcessor)),
            _ => Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "invalid_fault",
                "Oncepay-Fault must be drop-response, crash-after-claim or crash-after-processor.",
            )
            .into()),
        }
    }
}

/// Aborts the whole process here, as `kill -9` would: no destructor, no
/// flush, no answer. Only reachable with `FAULT_INJECTION=true`.
pub fn crash_if(fault: Option<Fault>, point: Fault) {
    if fault == Some(point) {
        tracing::error!(?point, "fault injection: aborting the process");
        std::process::abort();
    }
}

/// Middleware for `drop-response`: lets the request run to completion (and
/// commit), then unwinds the connection's task instead of answering, so the
/// connection closes with no response at all. It sits outside the panic
/// catcher on purpose; `resume_unwind` skips the panic hook, so nothing is
/// printed, and only this connection's task ends.
pub async fn drop_response(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let drop = state.config.fault_injection
        && request.headers().get(HEADER).and_then(|v| v.to_str().ok()) == Some("drop-response");
    let response = next.run(request).await;
    if drop {
        tracing::warn!(status = %response.status(), "fault injection: dropping the response");
        std::panic::resume_unwind(Box::new("fault injection: drop-response"));
    }
    response
}
