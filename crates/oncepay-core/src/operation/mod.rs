//! One guarded operation, whatever it makes: the exactly-once workflow that
//! charges and refunds share, and that knows nothing of HTTP.
//!
//! 1. the caller has validated the request: nothing is written yet;
//! 2. one transaction: claim the key ([`claim`]) and
//!    write the record as pending ([`Operation::write_pending`]), or answer
//!    from what the key holds;
//! 3. call the processor, outside any transaction;
//! 4. one transaction: settle the record if still pending, and save the
//!    answer on the key ([`Operation::settle`]).
//!
//! Steps 2 to 4 run in their own task, so that a client hanging up cannot
//! cancel the work half-way once the claim may have committed. A record
//! left pending by a failure is settled later by [`crate::recovery`].
//!
//! An operation with no processor call (creating a webhook endpoint) is a
//! [`write::Write`] instead: claim, record and answer in one transaction.
//!
//! Each run is timed phase by phase on the request's clock ([`timing`]).

pub mod capture;
pub mod charge;
pub mod claim;
pub mod refund;
pub mod timing;
pub mod write;

#[cfg(test)]
mod plain;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgConnection;
use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use uuid::Uuid;

use self::claim::Begun;
use self::timing::{Clock, Phase};
use crate::charges::settle::Settled;
use crate::error::Error;
use crate::faults::{Fault, crash_if};
use crate::idempotency::{
    Claim, ClaimOutcome, IdempotencyKey, Resource, SavedResponse, store as keys,
};
use crate::problem::{Problem, ProblemCode};
use crate::processor::{Processor, ProcessorError, WireFault};
use crate::retry_after;
use crate::settings::Timeouts;
use crate::speed::FastPaths;

/// What guarded operations run on: the database, the processor, the
/// timeouts, the tasks the work runs in, and the fast paths plugged in
/// ([`crate::speed`]). Cloning it shares them.
#[derive(Clone)]
pub struct Engine {
    pub pool: PgPool,
    pub processor: Arc<dyn Processor>,
    pub timeouts: Timeouts,
    /// The work a request hands to its own task (steps 2 to 4); a shutdown
    /// waits for it.
    pub tasks: TaskTracker,
    pub fast: Arc<dyn FastPaths>,
}

/// Who asks, with which key, and how: everything about a request that is
/// not the operation's own parameters.
pub struct Guard {
    pub merchant_id: Uuid,
    /// The request's `X-Request-Id`, which the events of the record it
    /// settles name.
    pub request_id: Option<String>,
    /// The `Idempotency-Key`, if the request has one.
    pub key: Option<IdempotencyKey>,
    /// How long to wait for the same request in flight (`Prefer: wait=N`);
    /// zero answers `409` at once.
    pub wait: Duration,
    /// Where to fail on purpose (`FAULT_INJECTION=true` only).
    pub fault: Option<Fault>,
    /// When the request arrived: its work may begin only while its client
    /// still waits for the answer, and before `REQUEST_TIMEOUT` from here.
    pub arrived: std::time::Instant,
    /// What its phases are timed on.
    pub clock: Arc<dyn Clock>,
}

/// The answer to a guarded operation.
#[derive(Debug)]
pub enum Answer {
    /// This request's own answer: the work it did, or the answer of whoever
    /// settled the record while it worked.
    Fresh(SavedResponse),
    /// The answer the key had saved, and the request that claimed the key
    /// (its `X-Request-Id`, if recorded); `waited` when the request waited
    /// for it.
    Replayed {
        saved: SavedResponse,
        original_request: Option<String>,
        waited: bool,
    },
}

/// The work of one kind of record, plugged into [`run`].
pub trait Operation: Send + Sync + 'static {
    /// What the processor answers, which settles the record.
    type Outcome: Send + Sync;
    /// The route whose keys guard this operation.
    const ROUTE: &'static str;
    /// What the record is called in logs and in problems (`charge`).
    const NOUN: &'static str;
    /// The detail of the `503 processing_outcome_unknown` problem.
    const OUTCOME_UNKNOWN: &'static str;

    /// The new record's id.
    fn id(&self) -> &str;
    /// The record, as the key names it.
    fn resource(&self) -> Resource;
    /// The parameters in a canonical form, for the key's fingerprint.
    fn canonical(&self) -> Vec<u8>;
    /// Step 2 in one statement, for a kind whose pending record the claim's
    /// own statement can write (on a connection from
    /// [`claim::Request::connection`]). `None`, the default: the claim runs
    /// in a transaction with [`Operation::write_pending`].
    fn claim_with_record(
        &mut self,
        engine: &Engine,
        request: &claim::Request,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Option<ClaimOutcome>, Error>> + Send {
        let _ = (engine, request, claim);
        async { Ok(None) }
    }
    /// Step 2: writes the pending record in the claim's transaction. An
    /// error (the operation cannot be done) rolls the claim back with it.
    fn write_pending(
        &mut self,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Step 3: the processor call, idempotent on the record's processor
    /// key, asking the gateway for `fault` if any ([`Fault::Processor`]).
    fn call_processor(
        &self,
        processor: &dyn Processor,
        fault: Option<WireFault>,
    ) -> impl Future<Output = Result<Self::Outcome, ProcessorError>> + Send;
    /// Step 4: settles the record with `outcome` if still pending, saves
    /// its answer on its key and writes its events (naming `request_id`),
    /// in one transaction on `db` (aborting just before its commit with
    /// [`Fault::CrashBeforeSettleCommit`]).
    fn settle(
        &self,
        engine: &Engine,
        db: &mut PgConnection,
        outcome: &Self::Outcome,
        request_id: Option<&str>,
        fault: Option<Fault>,
    ) -> impl Future<Output = sqlx::Result<Settled>> + Send;
    /// The answer of the settled record, rendered afresh for the request
    /// `request_id` (for a record made without a key that someone else
    /// settled).
    fn render(
        &self,
        engine: &Engine,
        request_id: Option<&str>,
    ) -> impl Future<Output = Result<SavedResponse, Error>> + Send;
    /// The processor was unavailable and recorded nothing: the problem to
    /// answer, having given the record back or kept it as the kind
    /// requires; `None` when someone else settled the record meanwhile.
    fn processor_unavailable(
        &self,
        engine: &Engine,
    ) -> impl Future<Output = Result<Option<Problem>, Error>> + Send;
}

/// Runs `operation` for a request guarded by `guard`: claims the key or
/// answers from it, does the work, settles. Steps 2 to 4 run in a task of
/// [`Engine::tasks`]; if this future is dropped (the client hung up, or
/// `REQUEST_TIMEOUT` passed), a wait for a key in flight stops, while claimed
/// work goes on to the end. Work not yet claimed by then never is: the
/// client was told to retry, and its retry may already have done it.
pub async fn run<O: Operation>(
    engine: &Engine,
    guard: Guard,
    operation: O,
) -> Result<Answer, Error> {
    let fault = guard.fault;
    let (request, _hang_up) = claim::Request::of(O::ROUTE, guard, || operation.canonical());
    in_task(engine, request, O::NOUN, |request| {
        claim_and_work(engine.clone(), request, operation, fault)
    })
    .await
}

/// Answers `request` from the replay cache, or runs `work` (steps 2 to 4)
/// for it in a task of [`Engine::tasks`] and returns its answer, marking
/// the time its start and the handler's waking waited for the scheduler as
/// [`Phase::TaskHandoff`]. `noun` names the task in the error of one that
/// failed.
pub(crate) async fn in_task<W>(
    engine: &Engine,
    request: claim::Request,
    noun: &str,
    work: impl FnOnce(claim::Request) -> W,
) -> Result<Answer, Error>
where
    W: Future<Output = Result<Answer, Error>> + Send + 'static,
{
    // A retry of a finished operation is answered from memory, with no
    // task: there is no work that a hang-up could cut short.
    if let Some(answer) = claim::from_cache(engine, &request)? {
        return Ok(answer);
    }
    let clock = request.clock.clone();
    let work = work(request);
    let spawned = Instant::now();
    let task_clock = clock.clone();
    let task = engine.tasks.clone().spawn(
        async move {
            task_clock.lap(Phase::TaskHandoff, spawned);
            (work.await, Instant::now())
        }
        .instrument(tracing::Span::current()),
    );
    match task.await {
        Ok((answer, ended)) => {
            clock.lap(Phase::TaskHandoff, ended);
            answer
        }
        Err(e) => Err(Error::Internal(
            anyhow::Error::new(e).context(format!("{noun} task failed")),
        )),
    }
}

async fn claim_and_work<O: Operation>(
    engine: Engine,
    request: claim::Request,
    mut operation: O,
    fault: Option<Fault>,
) -> Result<Answer, Error> {
    let claiming = Instant::now();
    let claimed = claim_or_answer(&engine, &request, &mut operation).await;
    request.clock.lap(Phase::Claim, claiming);
    if let Some(answer) = claimed? {
        return Ok(answer);
    }
    crash_if(fault, Fault::CrashAfterClaim);

    // 3 and 4. From here on the record is pending: a failure leaves it to
    // recovery.
    let answer = work_and_settle(
        &engine,
        &operation,
        request.request_id.as_deref(),
        fault,
        request.clock.as_ref(),
    )
    .await
    .map_err(|e| e.awaiting_recovery(&engine.timeouts));
    claim::finished(&engine, &request);
    answer
}

/// Step 2: claims the key and writes the pending record, in one statement
/// when the kind has one, else in one transaction; `None` once the record
/// is pending, or the answer the key already had.
async fn claim_or_answer<O: Operation>(
    engine: &Engine,
    request: &claim::Request,
    operation: &mut O,
) -> Result<Option<Answer>, Error> {
    let resource = operation.resource();
    // While retries are common, a retry of a finished operation (or of one
    // in flight) is answered from a plain read of its key, and only a key
    // found free is claimed; else the claim's statement reads the key
    // itself (see the server's `src/idempotency/reads.rs`).
    let found = match &request.key {
        Some(key) if engine.fast.worth_reading() => claim::read(engine, request, key).await?,
        _ => None,
    };
    let begun = match found {
        Some(found) => {
            engine.fast.learn(true);
            claim::after_read(engine, request, Some(&resource), Some(found)).await?
        }
        None => claim_new(engine, request, operation, &resource).await?,
    };
    match begun {
        Begun::Written => Ok(None),
        Begun::Claimed(mut tx) => {
            if let Err(refused) = operation.write_pending(&mut tx).await {
                tx.rollback().await?;
                return Err(refused);
            }
            tx.commit().await?;
            Ok(None)
        }
        Begun::Answered(answer) => Ok(Some(answer)),
    }
}

/// Claims the request's key, which a read just found free (or did not
/// read), with the record in one statement when the kind has one.
async fn claim_new<O: Operation>(
    engine: &Engine,
    request: &claim::Request,
    operation: &mut O,
    resource: &Resource,
) -> Result<Begun, Error> {
    let claimed = match &request.key {
        Some(key) => {
            let first = request.claim(engine, key, Some(resource));
            operation.claim_with_record(engine, request, &first).await?
        }
        None => None,
    };
    if let Some(first) = &claimed {
        engine.fast.learn(matches!(first, ClaimOutcome::Taken(_)));
    }
    let found = match claimed {
        None => None,
        Some(ClaimOutcome::Claimed { took_over, .. }) => {
            claim::count_claimed(took_over);
            return Ok(Begun::Written);
        }
        Some(ClaimOutcome::TooLate) => return Err(request.answered_before_claim()),
        Some(ClaimOutcome::Taken(found)) => found.map(|stored| *stored),
    };
    claim::after_read(engine, request, Some(resource), found).await
}

async fn work_and_settle<O: Operation>(
    engine: &Engine,
    operation: &O,
    request_id: Option<&str>,
    fault: Option<Fault>,
    clock: &dyn Clock,
) -> Result<Answer, Error> {
    let calling = Instant::now();
    let outcome = operation
        .call_processor(engine.processor.as_ref(), Fault::at_processor(fault))
        .await;
    let called = clock.lap(Phase::Processor, calling);
    crash_if(fault, Fault::CrashAfterProcessor);
    match outcome {
        // Recorded and final, whatever it was: settling saves it on the key.
        Ok(outcome) => {
            let settled = {
                // Taken from the pool directly, not through the admission
                // queue: claimed work is never turned away.
                let mut db = engine.pool.acquire().await?;
                let settling = clock.lap(Phase::SettlePoolWait, called);
                let settled = operation
                    .settle(engine, &mut db, &outcome, request_id, fault)
                    .await;
                clock.lap(Phase::Settle, settling);
                settled?
            };
            match settled {
                Settled::Now(saved) => Ok(Answer::Fresh(saved)),
                // Recovery settled it while the processor was answering: what
                // it saved is the answer, since both came from the one
                // processor record.
                Settled::Already => {
                    let reading = Instant::now();
                    let answer = settled_elsewhere(engine, operation, request_id).await;
                    clock.lap(Phase::Settle, reading);
                    answer
                }
            }
        }
        Err(ProcessorError::Unavailable) => {
            let answer = match operation.processor_unavailable(engine).await {
                Ok(Some(problem)) => Err(problem.into()),
                Ok(None) => settled_elsewhere(engine, operation, request_id).await,
                Err(e) => Err(e),
            };
            clock.lap(Phase::Settle, called);
            answer
        }
        Err(e @ ProcessorError::OutcomeUnknown(_)) => {
            // Money may have moved: keep the claim; recovery (the sweeper, or
            // a retry after PROCESSING_TIMEOUT) settles the record from the
            // processor's record, and later retries replay that.
            tracing::warn!(
                resource = ?operation.resource(),
                error = format!("{:#}", anyhow::Error::new(e)),
                "processor outcome unknown"
            );
            Err(
                Problem::new(ProblemCode::ProcessingOutcomeUnknown, O::OUTCOME_UNKNOWN)
                    .with_extra(O::NOUN, operation.id().to_owned())
                    .with_retry_after(retry_after::until_recovered(&engine.timeouts))
                    .into(),
            )
        }
    }
}

/// The answer for a record someone else settled: its key's saved response,
/// or, for a record made without a key, the record rendered afresh.
async fn settled_elsewhere<O: Operation>(
    engine: &Engine,
    operation: &O,
    request_id: Option<&str>,
) -> Result<Answer, Error> {
    if let Some(saved) = keys::saved_for_resource(&engine.pool, &operation.resource()).await? {
        return Ok(Answer::Fresh(saved));
    }
    Ok(Answer::Fresh(operation.render(engine, request_id).await?))
}
