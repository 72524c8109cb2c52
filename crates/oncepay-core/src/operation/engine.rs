//! What a guarded operation runs on ([`Engine`]), what it is asked
//! ([`Request`]) and what it answers ([`Answer`]).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::timing::Clock;
use crate::faults::Fault;
use crate::idempotency::store::SavedAnswer;
use crate::idempotency::{Fingerprint, IdempotencyKey, SavedResponse};
use crate::processor::Processor;
use crate::settings::Timeouts;
use crate::speed::{Admission, Waits};

/// What guarded operations run on: the database, the processor, the
/// timeouts, the tasks the work runs in, and the two seams a server may
/// plug speed into ([`crate::speed`]). Cloning it shares them.
#[derive(Clone)]
pub struct Engine {
    pub pool: PgPool,
    pub processor: Arc<dyn Processor>,
    pub timeouts: Timeouts,
    /// The work a request hands to its own task (steps 2 to 4); a shutdown
    /// waits for it.
    pub tasks: TaskTracker,
    /// Where a request takes the connection its claim is made on.
    pub admission: Arc<dyn Admission>,
    /// How a request waits for the same request in flight.
    pub waits: Arc<dyn Waits>,
}

/// A guarded request, as the server's edge parsed it: who asks, with which
/// key, for what (the fingerprint of the operation's parameters, made with
/// [`METHOD`] and the route), and how long it may take. The one type of a
/// request's idempotency side.
pub struct Request {
    /// The route whose keys guard the operation (a template, for metrics).
    pub route: &'static str,
    pub merchant_id: Uuid,
    /// The request's `X-Request-Id`, which the key records and the events
    /// of a record it settles name.
    pub request_id: Option<String>,
    /// The `Idempotency-Key`, if the request has one.
    pub key: Option<IdempotencyKey>,
    pub fingerprint: Fingerprint,
    /// How long to wait for the same request in flight (`Prefer: wait=N`);
    /// zero answers `409` at once.
    pub wait: Duration,
    /// Where to fail on purpose (`FAULT_INJECTION=true` only).
    pub fault: Option<Fault>,
    /// When the request arrived.
    pub arrived: Instant,
    /// When `REQUEST_TIMEOUT` answers it: its work may begin only before
    /// then, and only while its client still waits ([`Request::client_gone`]).
    pub deadline: Instant,
    /// Cancelled when the client hangs up (see [`super::workflow::run`]):
    /// a wait for a key in flight stops then, while claimed work goes on.
    pub client_gone: CancellationToken,
    /// Set once the request has written (it settled its stale key): from
    /// then on it takes its connections from the pool directly, never shed
    /// by the admission, since turning it away would no longer cost nothing.
    pub has_written: AtomicBool,
    /// What its phases are timed on.
    pub clock: Arc<dyn Clock>,
}

/// The method of every request a key guards: the fingerprint and the key
/// record it.
pub const METHOD: &str = "POST";

impl Request {
    /// Whether this request may still begin work: its client still waits
    /// for the answer and its deadline has not passed. The claim's statement
    /// checks the deadline again where it counts, on arrival at the database.
    pub fn still_awaited(&self) -> bool {
        !self.client_gone.is_cancelled() && Instant::now() < self.deadline
    }
}

/// The answer to a guarded operation.
#[derive(Debug)]
pub enum Answer {
    /// This request's own answer: the work it did, or the answer of whoever
    /// settled the record while it worked.
    Fresh(SavedResponse),
    /// The answer the key had saved; `waited` when the request waited for it.
    Replayed {
        saved: Arc<SavedAnswer>,
        waited: bool,
    },
}
