//! Step 2 of every idempotent operation, whatever the resource: claim the
//! key in a transaction the caller then adds its business write to, or say
//! what the key already holds (a saved answer to replay, a request in
//! flight, a key reused with other parameters). Nothing here knows HTTP.

use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Postgres, Transaction};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};
use uuid::Uuid;

use crate::error::{Error, overloaded};
use crate::idempotency::{
    Claim, ClaimOutcome, Fingerprint, IdempotencyKey, KeyStatus, Resource, SavedResponse,
    StoredKey, store as keys,
};
use crate::operation::timing::{Clock, Phase, count_outcome, count_shed};
use crate::operation::{Engine, Guard};
use crate::problem::{Problem, ProblemCode};
use crate::speed::{CachedAnswer, FastPaths, KeyWatch, News, Plain, Refused, Shed};

/// How long before `REQUEST_TIMEOUT` a wait gives up, so that its `409`
/// still goes out.
const WAIT_MARGIN: Duration = Duration::from_millis(250);

/// The idempotency side of a validated request: who asks, with which key
/// (if any), for what (the fingerprint), and how long it will wait.
pub struct Request {
    /// The route whose keys guard the operation (a template, for metrics).
    pub route: &'static str,
    pub merchant_id: Uuid,
    /// The request's `X-Request-Id`, named by the events of a record it
    /// recovers.
    pub request_id: Option<String>,
    pub key: Option<IdempotencyKey>,
    pub fingerprint: Fingerprint,
    /// From `Prefer: wait=N`; zero answers `409` at once.
    pub wait: Duration,
    /// Cancelled when the client hangs up (see [`crate::operation::run`]):
    /// a wait for a key in flight stops then, while claimed work goes on.
    pub client_gone: CancellationToken,
    /// When the request arrived.
    pub arrived: std::time::Instant,
    /// What its phases, the waits among them, are timed on.
    pub clock: Arc<dyn Clock>,
}

impl Request {
    /// The request that `guard` describes, for the operation on `route`
    /// whose parameters have `fingerprint`; with the guard that marks its
    /// client gone when dropped (as the handler's future is when the client
    /// hangs up, see [`crate::operation::run`]).
    pub fn of(route: &'static str, guard: Guard, fingerprint: Fingerprint) -> (Self, DropGuard) {
        let client_gone = CancellationToken::new();
        let hang_up = client_gone.clone().drop_guard();
        let request = Request {
            route,
            merchant_id: guard.merchant_id,
            request_id: guard.request_id,
            key: guard.key,
            fingerprint,
            wait: guard.wait,
            client_gone,
            arrived: guard.arrived,
            clock: guard.clock,
        };
        (request, hang_up)
    }

    /// When `REQUEST_TIMEOUT` answers the request at the latest.
    pub fn deadline(&self, engine: &Engine) -> Instant {
        Instant::from_std(self.arrived) + engine.timeouts.request
    }

    /// Whether this request may still begin work: its client still waits
    /// for the answer and its deadline has not passed. A request answered
    /// `503` was told to retry, and its retry may have done the work by
    /// now, on this instance or another; if it began the work later, with
    /// the key expired or deleted meanwhile, it would do it a second time.
    /// So whatever claims or writes checks this first, on a connection
    /// already in hand, with nothing left to wait for before it is sent.
    fn still_awaited(&self, engine: &Engine) -> Result<(), Error> {
        if self.client_gone.is_cancelled() || Instant::now() >= self.deadline(engine) {
            return Err(self.answered_before_claim());
        }
        Ok(())
    }

    /// The error of a request answered before its claim could take effect:
    /// checked before the claim is sent (`Request::still_awaited`), and by
    /// the database when the claim arrives ([`ClaimOutcome::TooLate`]).
    pub fn answered_before_claim(&self) -> Error {
        tracing::info!(
            waited_ms = self.arrived.elapsed().as_millis() as u64,
            "the request was answered before its work could begin; nothing claimed"
        );
        count_outcome("answered_before_claim");
        too_late()
    }

    /// A pooled connection to begin the request's work on (to read or
    /// claim its key), waited for in the bounded queue the fast paths keep
    /// (the server's `src/admission.rs`) and never past the request's
    /// deadline (a cancelled wait for a connection is safe: sqlx closes a connection it
    /// had half handed over). `503 overloaded` when the queue's bound passed
    /// first: nothing was begun. An error once the request was answered
    /// (see `Request::still_awaited`).
    pub async fn connection(&self, engine: &Engine) -> Result<PoolConnection<Postgres>, Error> {
        self.connection_in(engine, Queue::Bounded).await
    }

    /// [`Request::connection`], waited for as `queue` says.
    async fn connection_in(
        &self,
        engine: &Engine,
        queue: Queue,
    ) -> Result<PoolConnection<Postgres>, Error> {
        let asked = std::time::Instant::now();
        let deadline = self.deadline(engine);
        let acquired = match queue {
            Queue::Bounded => engine.fast.connection(&engine.pool, deadline).await,
            Queue::Kept => Plain.connection(&engine.pool, deadline).await,
        };
        self.clock.add(Phase::PoolWait, asked.elapsed());
        if let Err(Refused::Shed { waited }) = &acquired {
            // One line per shed request would flood the log just when the
            // process has least to spare: debug only; the metric counts.
            tracing::debug!(
                waited_ms = waited.as_millis() as u64,
                "no connection within the queue's bound; shed before any work"
            );
            count_shed(self.route);
            return Err(overloaded().into());
        }
        // A wait cut at the deadline fails the check below, which says so.
        self.still_awaited(engine)?;
        match acquired {
            Ok(connection) => Ok(connection),
            Err(Refused::Pool(e)) => Err(e.into()),
            Err(Refused::Deadline | Refused::Shed { .. }) => Err(too_late()),
        }
    }

    /// A transaction for a claim; an error once the request was answered,
    /// as for [`Request::connection`]. Unlike the wait for a connection,
    /// `BEGIN` is never cut short by the deadline: sqlx cannot cancel a
    /// `BEGIN` in flight safely (the connection would go back to the pool
    /// inside a transaction nobody ends, and every statement run on it
    /// afterwards would be lost), so the check comes after it, and a late
    /// request rolls its empty transaction back.
    async fn transaction(
        &self,
        engine: &Engine,
        queue: Queue,
    ) -> Result<Transaction<'static, Postgres>, Error> {
        let connection = self.connection_in(engine, queue).await?;
        // `BEGIN` on a connection already taken, as `Pool::begin` itself
        // does after its own `acquire`.
        let tx = Transaction::begin(connection, None).await?;
        self.still_awaited(engine)?;
        Ok(tx)
    }
}

/// How a request waits for a connection.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Queue {
    /// In the admission queue, shed once its bound passes: for a request
    /// that has done nothing yet, so that being turned away costs nothing.
    Bounded,
    /// Straight from the pool until the deadline, never shed (the plain
    /// way, [`Plain`]): for a request that has already written (it settled
    /// its stale key), which keeps its admission for the rest of its steps.
    Kept,
}

/// The error of a request whose work did not begin before it was answered
/// (the client already has `503 request_timeout`, or hung up).
fn too_late() -> Error {
    Problem::new(
        ProblemCode::RequestTimeout,
        "The request took too long and was stopped before any work began. Retry (a POST with the same Idempotency-Key).",
    )
    .with_retry_after(crate::retry_after::SOON)
    .into()
}

/// What a request's key says, once claimed or read.
pub enum Begun {
    /// The key is ours (or there is none): write the business record in
    /// this transaction and commit.
    Claimed(Transaction<'static, Postgres>),
    /// The key holds a saved answer to this very request: replay it.
    /// `waited` when the request waited for it (`Prefer: wait=N`).
    Replay { saved: SavedResponse, waited: bool },
    /// The same request is still in flight under the key (and did not
    /// finish within the wait, if the request asked to wait).
    InUse { waited: bool },
    /// The key was used with other parameters (or on another route).
    Reused,
    /// The key is ours, and the record was written and committed with the
    /// claim, in one statement ([`crate::operation::Operation::claim_with_record`]).
    Written,
}

/// Where a request's key stands in [`after_read`], and what it does next.
enum Step {
    /// Try to claim the key (one locking statement).
    Claim,
    /// See whether the key is stale, and settle it if so.
    Lease,
    /// Wait for news of the key in flight, without touching the database.
    Wait,
    /// Done: what the key says.
    Begun(Begun),
}

/// Opens step 2 for `resource` on `route`: a transaction holding the claim
/// on the request's key, a plain transaction when it has none, or what the
/// key already holds.
///
/// A request that finds its key in flight and asked to wait joins the
/// process's shared wait on that key ([`crate::speed::KeyWatch`]: the
/// server's `src/idempotency/wait.rs`, or a poll of its own): it holds no
/// connection and takes no lock while it waits, answers from the
/// completed row the poll read, claims again if the key was given back, and
/// stops when its client hangs up.
///
/// When the key is held by a request that has been `processing` for longer
/// than `PROCESSING_TIMEOUT`, this request leases it (one conditional update,
/// as the sweeper does) and settles its record by the sweeper's own
/// procedure ([`crate::recovery::recover`]); then it answers from the key.
/// Every other request that tried the lease in vain goes back to waiting.
pub async fn begin(
    engine: &Engine,
    request: &Request,
    route: &'static str,
    resource: Option<&Resource>,
) -> Result<Begun, Error> {
    let Some(key) = &request.key else {
        return Ok(Begun::Claimed(
            request.transaction(engine, Queue::Bounded).await?,
        ));
    };
    if let Some(begun) = from_cache(engine, request, route)? {
        return Ok(begun);
    }
    // The fast path for a retry of a finished operation: a completed key
    // cannot change until it expires, so it is answered from one plain
    // read, with no transaction and no row lock. The same read sends a
    // request willing to wait on a key in flight straight to the wait,
    // without a lock either.
    let found = read(engine, request, key).await?;
    after_read(engine, request, route, resource, found).await
}

/// The request's `key` as [`keys::find`] reads it, read with the other
/// requests' keys of the moment (the server's coalesced reads,
/// `src/idempotency/reads.rs`); `None` when there is none, or when that
/// read could not be made before the request's deadline (the claim that
/// follows finds a taken key itself). `503 overloaded` when the reads'
/// queue is full: nothing was begun.
pub async fn read(
    engine: &Engine,
    request: &Request,
    key: &IdempotencyKey,
) -> Result<Option<StoredKey>, Error> {
    let deadline = request.deadline(engine);
    match engine
        .fast
        .read(&engine.pool, request.merchant_id, key, deadline)
        .await
    {
        Ok(found) => Ok(found),
        Err(Shed) => {
            tracing::debug!("the queue of key reads is full; shed before any work");
            count_shed(request.route);
            Err(overloaded().into())
        }
    }
}

/// The answer a request's key has in this process's cache, if any: a
/// completed key cannot change until it expires, so it is answered from
/// memory. `None` for a request without a key.
pub fn from_cache(
    engine: &Engine,
    request: &Request,
    route: &'static str,
) -> Result<Option<Begun>, Error> {
    let Some(key) = &request.key else {
        return Ok(None);
    };
    match engine.fast.cached(request.merchant_id, key) {
        Some(answer) => answer_from(request, route, &answer, false).map(Some),
        None => Ok(None),
    }
}

/// [`begin`] after the read of the request's key (`found`, just read
/// without a lock, by [`keys::find`] or by the statement that tried to
/// claim it with its record): a loop over the steps of a key's life, each
/// step a method of `Pursuit` that says which comes next.
pub async fn after_read(
    engine: &Engine,
    request: &Request,
    route: &'static str,
    resource: Option<&Resource>,
    found: Option<StoredKey>,
) -> Result<Begun, Error> {
    let Some(key) = &request.key else {
        return Ok(Begun::Claimed(
            request.transaction(engine, Queue::Bounded).await?,
        ));
    };
    // A wait ends in time to answer `409` before `REQUEST_TIMEOUT` would
    // answer `503` in its place.
    let deadline = (Instant::now() + request.wait)
        .min(request.deadline(engine) - WAIT_MARGIN.min(engine.timeouts.request));
    let mut pursuit = Pursuit {
        engine,
        request,
        route,
        resource,
        key,
        deadline,
        known_at: Instant::now(),
        waiter: None,
        waited: false,
        queue: Queue::Bounded,
    };
    let mut step = pursuit.first(found)?;
    loop {
        step = match step {
            Step::Claim => pursuit.claim().await?,
            Step::Lease => pursuit.lease().await?,
            Step::Wait => pursuit.wait().await?,
            Step::Begun(begun) => return Ok(begun),
        };
    }
}

/// One request's pursuit of its key in [`after_read`]: what it asks, and
/// what it has learnt of the key so far.
struct Pursuit<'a> {
    engine: &'a Engine,
    request: &'a Request,
    route: &'static str,
    resource: Option<&'a Resource>,
    key: &'a IdempotencyKey,
    /// When a wait for the key in flight gives up.
    deadline: Instant,
    /// When this request last had a read of the key of its own finished:
    /// only shared polls begun after it can tell it anything new.
    known_at: Instant,
    /// The shared wait this request joined, if any.
    waiter: Option<Box<dyn KeyWatch>>,
    /// Whether it waited (`Prefer: wait=N`) at all.
    waited: bool,
    /// Bounded until this request writes: once it has settled a stale key,
    /// its next steps are never shed.
    queue: Queue,
}

impl Pursuit<'_> {
    /// The first step, from the key as read: its answer when completed, a
    /// wait when in flight and the request will wait; else the claim.
    fn first(&self, found: Option<StoredKey>) -> Result<Step, Error> {
        let Some(stored) = found else {
            return Ok(Step::Claim);
        };
        let will_wait = self.deadline > Instant::now();
        match stored.status {
            KeyStatus::Completed => Ok(self.answer(stored)?.unwrap_or(Step::Claim)),
            KeyStatus::Processing if will_wait && same(&stored, self.request, self.route) => {
                Ok(Step::Wait)
            }
            KeyStatus::Processing => Ok(Step::Claim),
        }
    }

    /// Claims the key in a transaction: ours, its saved answer, reused, or
    /// in flight (then a lease, in case it is stale).
    async fn claim(&mut self) -> Result<Step, Error> {
        let (engine, request) = (self.engine, self.request);
        let mut tx = request.transaction(engine, self.queue).await?;
        let claim = Claim {
            merchant_id: request.merchant_id,
            key: self.key,
            method: "POST",
            path: self.route,
            fingerprint: request.fingerprint,
            resource: self.resource,
            ttl: engine.timeouts.key_ttl,
            arrived: request.arrived,
            deadline: request.deadline(engine).into_std(),
        };
        let claimed = keys::claim(&mut tx, claim).await?;
        self.known_at = Instant::now();
        let stored = match claimed {
            ClaimOutcome::Claimed { took_over, .. } => {
                count_outcome(if took_over {
                    "expired_taken_over"
                } else {
                    "executed"
                });
                return Ok(Step::Begun(Begun::Claimed(tx)));
            }
            ClaimOutcome::Taken(stored) => stored,
            ClaimOutcome::TooLate => return Err(request.answered_before_claim()),
        };
        tx.rollback().await?;
        // No row was read (see `ClaimOutcome::Taken`): look again.
        let Some(stored) = stored.map(|stored| *stored) else {
            return Ok(Step::Claim);
        };
        if stored.status == KeyStatus::Completed {
            return self
                .answer(stored)?
                .ok_or_else(|| Error::internal("a completed key without its response"));
        }
        if !same(&stored, request, self.route) {
            count_outcome("reused");
            return Ok(Step::Begun(Begun::Reused));
        }
        Ok(Step::Lease)
    }

    /// Leases the key if it is stale and settles its record by the
    /// sweeper's own procedure, then claims again; else waits, or answers
    /// `409` once the wait is over.
    async fn lease(&mut self) -> Result<Step, Error> {
        let (engine, request) = (self.engine, self.request);
        request.still_awaited(engine)?;
        let processing = engine.timeouts.processing;
        let stale =
            keys::lease_one(&engine.pool, request.merchant_id, self.key, processing).await?;
        self.known_at = Instant::now();
        let Some(stale) = stale else {
            return Ok(if Instant::now() < self.deadline {
                Step::Wait
            } else {
                self.in_use("in_use")
            });
        };
        tracing::info!(resource = ?stale, "a retry found its key stale; settling it");
        crate::recovery::recover(
            &engine.pool,
            engine.processor.as_ref(),
            &stale,
            engine.timeouts.key_ttl,
            request.request_id.as_deref(),
        )
        .await
        .map_err(|e| Error::from_recovery(e, &engine.timeouts))?;
        count_outcome("stale_recovered");
        self.queue = Queue::Kept;
        Ok(Step::Claim)
    }

    /// Waits for news of the key in flight (the process's shared wait),
    /// holding no connection and no lock, until the wait is over or the
    /// client hangs up.
    async fn wait(&mut self) -> Result<Step, Error> {
        let (engine, request, key) = (self.engine, self.request, self.key);
        self.waited = true;
        let shared = self.waiter.get_or_insert_with(|| {
            let processing = engine.timeouts.processing;
            engine
                .fast
                .watch(&engine.pool, processing, request.merchant_id, key)
        });
        let waiting = std::time::Instant::now();
        let news = tokio::select! {
            news = tokio::time::timeout_at(self.deadline, shared.news_since(self.known_at)) => news,
            () = request.client_gone.cancelled() => {
                tracing::info!("the client hung up; stopped waiting for the key in flight");
                return Ok(self.in_use("wait_abandoned"));
            }
        };
        request.clock.add(Phase::KeyWait, waiting.elapsed());
        Ok(match news {
            Err(_) => self.in_use("in_use"),
            Ok(Some(News::Completed(stored))) => self
                .answer(StoredKey::clone(&stored))?
                .unwrap_or(Step::Claim),
            Ok(Some(News::Stale)) => Step::Lease,
            Ok(Some(News::Gone)) => Step::Claim,
            Ok(Some(News::InFlight)) => Step::Wait,
            Ok(None) => {
                // The shared wait ended under us: look again, and join a
                // new one if still in flight.
                self.waiter = None;
                Step::Claim
            }
        })
    }

    /// The answer of a completed key just read (remembered in the cache),
    /// as the last step; `None` when the row holds no answer.
    fn answer(&self, stored: StoredKey) -> Result<Option<Step>, Error> {
        let (engine, request) = (self.engine, self.request);
        match remember(engine, request.merchant_id, self.key, stored) {
            Some(answer) => answer_from(request, self.route, &answer, self.waited)
                .map(|begun| Some(Step::Begun(begun))),
            None => Ok(None),
        }
    }

    /// `409`, counted as `outcome`: the key is still in flight.
    fn in_use(&self, outcome: &'static str) -> Step {
        count_outcome(outcome);
        Step::Begun(Begun::InUse {
            waited: self.waited,
        })
    }
}

/// Notes that the request holding `request`'s key has finished its work here
/// (completed, or given the key back): requests waiting on the key in this
/// process hear of it at once instead of at the next poll.
pub fn finished(engine: &Engine, request: &Request) {
    if let Some(key) = &request.key {
        engine.fast.wake(request.merchant_id, key);
    }
}

/// Whether a stored key was claimed for this very request.
fn same(stored: &StoredKey, request: &Request, route: &str) -> bool {
    stored.fingerprint == request.fingerprint && stored.request_path == route
}

/// The saved answer of a key just read from the database, if it is
/// completed; it is remembered in the cache until the row's deadline.
fn remember(
    engine: &Engine,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    stored: StoredKey,
) -> Option<Arc<CachedAnswer>> {
    let answer = match (stored.status, stored.response) {
        (KeyStatus::Completed, Some(response)) => Arc::new(CachedAnswer {
            route: stored.request_path,
            fingerprint: stored.fingerprint,
            response,
            deadline: stored.deadline,
        }),
        _ => return None,
    };
    engine.fast.remember(merchant_id, key, answer.clone());
    Some(answer)
}

/// What a completed key means for a request: reused if it asks for
/// something else, else its saved answer, to replay.
fn answer_from(
    request: &Request,
    route: &str,
    answer: &CachedAnswer,
    waited: bool,
) -> Result<Begun, Error> {
    if answer.fingerprint != request.fingerprint || answer.route != route {
        count_outcome("reused");
        return Ok(Begun::Reused);
    }
    count_outcome("replayed");
    // The clone shares the body with the cache.
    Ok(Begun::Replay {
        saved: answer.response.clone(),
        waited,
    })
}

/// What the key of a resource someone else (the sweeper, a retry) settled
/// while this request was working saved, if it has a key.
pub async fn saved_answer(
    engine: &Engine,
    resource: &Resource,
) -> Result<Option<SavedResponse>, Error> {
    Ok(keys::saved_for_resource(&engine.pool, resource).await?)
}
