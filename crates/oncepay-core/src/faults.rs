//! Fault injection points, for the failure tests and the workshop: with
//! `FAULT_INJECTION=true` (off by default), a request can ask
//! (`Oncepay-Fault`) to fail on purpose at a chosen point ([`Fault`]).

use crate::processor::WireFault;

/// The header that asks for a fault: on a request, and on a receiver's
/// answer to a webhook.
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
    /// Abort the process inside the settle's transaction, after the record's
    /// conditional update and its events were written, before `COMMIT`: the
    /// database rolls all of it back.
    CrashBeforeSettleCommit,
    /// Abort the process after a webhook receiver answered, before the
    /// attempt is recorded. Asked for by the receiver, in its answer
    /// (`Oncepay-Fault: crash-after-delivery`), never by a request.
    CrashAfterDelivery,
    /// Abort the process after the charge committed in Postgres, before its
    /// answer is written to Redis: for the workshop's `POST /demo/redis/charges`
    /// only, which reads it itself; the real endpoints refuse it.
    CrashAfterCommit,
    /// Ask the card gateway for a [`WireFault`] on this request's processor
    /// call (`Oncepay-Fault: processor-<fault>`, sent on as `Processor-Fault`).
    Processor(WireFault),
}

/// The `Oncepay-Fault` value of [`Fault::CrashAfterCommit`].
pub const CRASH_AFTER_COMMIT: &str = "crash-after-commit";

impl Fault {
    /// The fault a header value names, if any.
    pub fn parse(value: &str) -> Option<Fault> {
        match value {
            "drop-response" => Some(Fault::DropResponse),
            "crash-after-claim" => Some(Fault::CrashAfterClaim),
            "crash-after-processor" => Some(Fault::CrashAfterProcessor),
            "crash-before-settle-commit" => Some(Fault::CrashBeforeSettleCommit),
            other => other
                .strip_prefix("processor-")
                .and_then(WireFault::parse)
                .map(Fault::Processor),
        }
    }

    /// The wire fault to ask of the gateway, if this is one.
    pub fn at_processor(fault: Option<Fault>) -> Option<WireFault> {
        match fault {
            Some(Fault::Processor(wire)) => Some(wire),
            _ => None,
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
