//! Fault injection at the HTTP edge: reading `Oncepay-Fault` (see
//! [`oncepay_core::faults`]) and the `drop-response` middleware. A request asking
//! for a fault while it is off is refused with `400 fault_injection_disabled`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;

use super::problem::ApiError;
use crate::app::AppState;
use crate::workshop::trace::RequestTrace;
use oncepay_core::faults::Fault;
use oncepay_core::problem::{Problem, ProblemCode};

pub const HEADER: &str = "oncepay-fault";

/// The fault a request asks for, if any; a `400` when it asks while fault
/// injection is off, or names no fault.
pub fn from_headers(state: &AppState, headers: &HeaderMap) -> Result<Option<Fault>, ApiError> {
    let Some(value) = requested(state, headers)? else {
        return Ok(None);
    };
    match Fault::parse(value) {
        Some(fault) => Ok(Some(fault)),
        None => Err(Problem::new(
            ProblemCode::InvalidFault,
            "Oncepay-Fault must be drop-response, crash-after-claim, crash-after-processor, crash-before-settle-commit, or processor- and a Processor-Fault of the gateway (processor-fail-before-record, processor-drop-after-record, processor-slow, processor-crash-after-record).",
        )
        .into()),
    }
}

/// The `Oncepay-Fault` a request sends, if any, for the endpoint to read
/// as it honours faults; a `400` when it sends one while fault injection is
/// off.
pub fn requested<'h>(
    state: &AppState,
    headers: &'h HeaderMap,
) -> Result<Option<&'h str>, ApiError> {
    let Some(value) = headers.get(HEADER) else {
        return Ok(None);
    };
    if !state.config.workshop.fault_injection {
        return Err(Problem::new(
            ProblemCode::FaultInjectionDisabled,
            "Oncepay-Fault is only honoured when the server runs with FAULT_INJECTION=true.",
        )
        .into());
    }
    Ok(Some(value.to_str().unwrap_or("")))
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
    let drop = state.config.workshop.fault_injection
        && request.headers().get(HEADER).and_then(|v| v.to_str().ok()) == Some("drop-response");
    let trace = request.extensions().get::<Arc<RequestTrace>>().cloned();
    let response = next.run(request).await;
    if drop {
        tracing::warn!(status = %response.status(), "fault injection: dropping the response");
        if let Some(trace) = trace {
            trace.lost(response.status().as_u16());
        }
        std::panic::resume_unwind(Box::new("fault injection: drop-response"));
    }
    response
}
