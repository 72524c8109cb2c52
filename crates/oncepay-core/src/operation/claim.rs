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
    Claim, ClaimOutcome, Fingerprint, IdempotencyKey, KeyStatus, Resource, StoredKey, store as keys,
};
use crate::operation::timing::{Clock, Phase, count_outcome, count_shed};
use crate::operation::{Answer, Engine, Guard};
use crate::problem::{Problem, ProblemCode};
use crate::retry_after;
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
    /// whose parameters have the `canonical` form (fingerprinted here); with
    /// the guard that marks its client gone when dropped (as the handler's
    /// future is when the client hangs up, see [`crate::operation::run`]).
    pub fn of(
        route: &'static str,
        guard: Guard,
        canonical: impl FnOnce() -> Vec<u8>,
    ) -> (Self, DropGuard) {
        let started = guard.clock.lap(Phase::Extract, guard.arrived);
        let fingerprint = Fingerprint::of(METHOD, route, &canonical());
        guard.clock.lap(Phase::Fingerprint, started);
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

    /// This request's claim of its `key`, for `resource`.
    pub fn claim<'a>(
        &'a self,
        engine: &Engine,
        key: &'a IdempotencyKey,
        resource: Option<&'a Resource>,
    ) -> Claim<'a> {
        Claim {
            merchant_id: self.merchant_id,
            key,
            method: METHOD,
            path: self.route,
            fingerprint: self.fingerprint,
            request_id: self.request_id.as_deref(),
            resource,
            ttl: engine.timeouts.key_ttl,
            arrived: self.arrived,
            deadline: self.deadline(engine).into_std(),
        }
    }

    /// Whether this request may still begin work: its client still waits
    /// for the answer and its deadline has not passed. The rule is the
    /// claim's ([`keys::claim`] says why); this checks it in the process,
    /// on a connection already in hand, just before a claim or write is sent.
    fn still_awaited(&self, engine: &Engine) -> Result<(), Error> {
        if self.client_gone.is_cancelled() || Instant::now() >= self.deadline(engine) {
            return Err(self.answered_before_claim());
        }
        Ok(())
    }

    /// `503 request_timeout`: the request was answered (or its client hung
    /// up) before its claim could take effect, so nothing was claimed.
    pub fn answered_before_claim(&self) -> Error {
        tracing::info!(
            waited_ms = self.arrived.elapsed().as_millis() as u64,
            "the request was answered before its work could begin; nothing claimed"
        );
        count_outcome("answered_before_claim");
        Problem::new(
            ProblemCode::RequestTimeout,
            "The request took too long and was stopped before any work began. Retry (a POST with the same Idempotency-Key).",
        )
        .with_retry_after(retry_after::SOON)
        .into()
    }

    /// A pooled connection to claim on, waited for in the admission queue
    /// (the server's `src/admission.rs`) and never past the request's
    /// deadline: `503 overloaded` when the queue's bound passed first, an
    /// error once the request was answered (`Request::still_awaited`).
    pub async fn connection(&self, engine: &Engine) -> Result<PoolConnection<Postgres>, Error> {
        self.connection_in(engine, Queue::Bounded).await
    }

    /// `503 overloaded`: shed before any work began. (Logged at debug level
    /// only, where it is shed: a line per request would flood the log just
    /// when the process has least to spare; the metric counts.)
    fn shed(&self) -> Error {
        count_shed(self.route);
        overloaded().into()
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
            tracing::debug!(
                waited_ms = waited.as_millis() as u64,
                "no connection within the queue's bound; shed before any work"
            );
            return Err(self.shed());
        }
        // A wait cut at the deadline fails the check below, which says so.
        self.still_awaited(engine)?;
        match acquired {
            Ok(connection) => Ok(connection),
            Err(Refused::Pool(e)) => Err(e.into()),
            Err(Refused::Deadline | Refused::Shed { .. }) => Err(self.answered_before_claim()),
        }
    }

    /// A transaction for a claim, as for [`Request::connection`]. `BEGIN`
    /// is never cut short (sqlx cannot cancel one in flight safely: the
    /// connection would go back to the pool inside a transaction nobody
    /// ends), so the check comes after it.
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

/// `422`, counted: `key`, first used for `first_method` on the route
/// `first_route`, is used by `request` for something else.
fn reused(key: &IdempotencyKey, first_method: &str, first_route: &str, request: &Request) -> Error {
    count_outcome("reused");
    let first = format!("{first_method} {first_route}");
    let now = format!("{METHOD} {}", request.route);
    key_reused(key.as_str(), &first, &now).into()
}

/// The `422` of `key`, first used on the endpoint `first` (`POST
/// /v1/charges`), used again on `now`: with other parameters when the two
/// are the same, else on another endpoint. The messages are Stripe's.
pub fn key_reused(key: &str, first: &str, now: &str) -> Problem {
    let detail = if first == now {
        format!(
            "Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '{key}' if you meant to execute a different request."
        )
    } else {
        format!(
            "Keys for idempotent requests can only be used for the same endpoint they were first used for ('{first}' vs '{now}'). Try using a key other than '{key}' if you meant to execute a different request."
        )
    };
    Problem::new(ProblemCode::IdempotencyKeyReused, detail).with_param("Idempotency-Key")
}

/// The method of every request a key guards: the fingerprint and the claim
/// record it.
const METHOD: &str = "POST";

/// The `409` of the same request still in flight under the key (and not
/// finished within the wait, if the request asked to wait).
pub fn key_in_use(waited: bool) -> Problem {
    let detail = if waited {
        "A request with this Idempotency-Key is still in progress and did not finish within the wait."
    } else {
        "A request with this Idempotency-Key is still in progress. Retry later, or send 'Prefer: wait=5'."
    };
    Problem::new(ProblemCode::IdempotencyKeyInUse, detail).with_retry_after(retry_after::SOON)
}

/// Counts a claim that took effect.
pub(crate) fn count_claimed(took_over: bool) {
    count_outcome(if took_over {
        "expired_taken_over"
    } else {
        "executed"
    });
}

/// What a request's key says, once claimed or read. (A key in flight is
/// `409`, and a key reused `422`: errors.)
pub enum Begun {
    /// The key is ours (or there is none): write the business record in
    /// this transaction and commit.
    Claimed(Transaction<'static, Postgres>),
    /// The key is ours, and the record was written and committed with the
    /// claim, in one statement ([`crate::operation::Operation::claim_with_record`]).
    Written,
    /// The key's saved answer to this very request, to replay.
    Answered(Answer),
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

/// Opens step 2 for `resource`: a transaction holding the claim on the
/// request's key (a plain one when it has none), or what the key holds.
/// The key is read first, without a lock: a retry of a finished operation
/// is answered from that read, and a request that will wait on a key in
/// flight goes straight to the wait.
pub async fn begin(
    engine: &Engine,
    request: &Request,
    resource: Option<&Resource>,
) -> Result<Begun, Error> {
    let found = match &request.key {
        Some(key) => read(engine, request, key).await?,
        None => None,
    };
    after_read(engine, request, resource, found).await
}

/// The request's `key` as [`keys::find`] reads it (through the fast paths:
/// the server coalesces reads); `None` too when the read missed the
/// request's deadline (the claim that follows reads a taken key itself).
/// `503 overloaded` when reads are shed.
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
            Err(request.shed())
        }
    }
}

/// The answer a request's key has in this process's cache, if any (a
/// completed key cannot change until it expires): its saved answer, or
/// `422` if the request asks for something else.
pub fn from_cache(engine: &Engine, request: &Request) -> Result<Option<Answer>, Error> {
    let Some(key) = &request.key else {
        return Ok(None);
    };
    let Some(answer) = engine.fast.cached(request.merchant_id, key) else {
        return Ok(None);
    };
    request.clock.cached();
    answer_from(request, key, &answer, false).map(Some)
}

/// [`begin`] after the read of the request's key (`found`, read without a
/// lock, by [`keys::find`] or by the statement that tried to claim it with
/// its record): a loop over the steps of a key's life, each step a method
/// of `Pursuit` that says which comes next.
///
/// A wait holds no connection and no lock, and stops when the client hangs
/// up. A key `processing` for longer than `PROCESSING_TIMEOUT` is leased
/// (one conditional update, as the sweeper does) and its record settled by
/// the sweeper's own procedure ([`crate::recovery::recover`]); the requests
/// that tried the lease in vain go back to waiting.
pub async fn after_read(
    engine: &Engine,
    request: &Request,
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
            KeyStatus::Processing if will_wait && same(&stored, self.request) => Ok(Step::Wait),
            KeyStatus::Processing => Ok(Step::Claim),
        }
    }

    /// Claims the key in a transaction: ours, its saved answer, reused, or
    /// in flight (then a lease, in case it is stale).
    async fn claim(&mut self) -> Result<Step, Error> {
        let (engine, request) = (self.engine, self.request);
        let mut tx = request.transaction(engine, self.queue).await?;
        let claim = request.claim(engine, self.key, self.resource);
        let stored = match keys::claim(&mut tx, claim).await? {
            ClaimOutcome::Claimed { took_over, .. } => {
                count_claimed(took_over);
                return Ok(Step::Begun(Begun::Claimed(tx)));
            }
            ClaimOutcome::Taken(stored) => stored,
            ClaimOutcome::TooLate => return Err(request.answered_before_claim()),
        };
        self.known_at = Instant::now();
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
        if !same(&stored, request) {
            return Err(reused(
                self.key,
                &stored.request_method,
                &stored.request_path,
                request,
            ));
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
            if Instant::now() < self.deadline {
                return Ok(Step::Wait);
            }
            return Err(self.in_use("in_use"));
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
                return Err(self.in_use("wait_abandoned"));
            }
        };
        request.clock.add(Phase::KeyWait, waiting.elapsed());
        Ok(match news {
            Err(_) => return Err(self.in_use("in_use")),
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
            Some(answer) => answer_from(request, self.key, &answer, self.waited)
                .map(|answer| Some(Step::Begun(Begun::Answered(answer)))),
            None => Ok(None),
        }
    }

    /// `409`, counted as `outcome`: the key is still in flight.
    fn in_use(&self, outcome: &'static str) -> Error {
        count_outcome(outcome);
        key_in_use(self.waited).into()
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
fn same(stored: &StoredKey, request: &Request) -> bool {
    stored.fingerprint == request.fingerprint && stored.request_path == request.route
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
            method: stored.request_method,
            route: stored.request_path,
            fingerprint: stored.fingerprint,
            response,
            original_request: stored.request_id,
            deadline: stored.deadline,
        }),
        _ => return None,
    };
    engine.fast.remember(merchant_id, key, answer.clone());
    Some(answer)
}

/// What a completed key means for a request: `422` if it asks for
/// something else, else its saved answer, to replay.
fn answer_from(
    request: &Request,
    key: &IdempotencyKey,
    answer: &CachedAnswer,
    waited: bool,
) -> Result<Answer, Error> {
    if answer.fingerprint != request.fingerprint || answer.route != request.route {
        return Err(reused(key, &answer.method, &answer.route, request));
    }
    count_outcome("replayed");
    // The clone shares the body with the cache.
    Ok(Answer::Replayed {
        saved: answer.response.clone(),
        original_request: answer.original_request.clone(),
        waited,
    })
}
