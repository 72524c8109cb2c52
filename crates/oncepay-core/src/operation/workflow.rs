//! One guarded operation, whatever it makes: steps 2 to 4 of the
//! exactly-once workflow ([`run`]), and what each kind of operation plugs
//! into it ([`Operation`]).

use std::future::Future;
use std::time::Instant;

use sqlx::PgConnection;
use tracing::Instrument;

use super::claim::{self, Pending};
use super::engine::{Answer, Engine, Request};
use super::timing::Phase;
use crate::charges::settle::Settled;
use crate::error::Error;
use crate::faults::{Fault, crash_if};
use crate::idempotency::{Resource, SavedResponse, store as keys};
use crate::problem::{Problem, ProblemCode};
use crate::processor::{Processor, ProcessorError, WireFault};
use crate::retry_after;

/// The work of one kind of record, plugged into [`run`]: its step 2 (its
/// pending record, [`Pending`]), its processor call and its settle.
pub trait Operation: Pending + Sync + 'static {
    /// What the processor answers, which settles the record.
    type Outcome: Send + Sync;
    /// The route whose keys guard this operation.
    const ROUTE: &'static str;
    /// What the record is called in logs and in problems (`charge`).
    const NOUN: &'static str;
    /// The detail of the `503 processing_outcome_unknown` problem.
    const OUTCOME_UNKNOWN: &'static str;

    /// The record's id.
    fn id(&self) -> &str;
    /// The record, as the key names it.
    fn resource(&self) -> Resource;
    /// The parameters in a canonical form, for the key's fingerprint.
    fn canonical(&self) -> Vec<u8>;
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

/// Runs `operation` for `request`: claims the key or answers from it
/// (step 2), calls the processor (3), settles (4). The steps run in a task
/// of [`Engine::tasks`]; if this future is dropped (the client hung up, or
/// `REQUEST_TIMEOUT` passed), a wait for a key in flight stops, while claimed
/// work goes on to the end. Work not yet claimed by then never is: the
/// client was told to retry, and its retry may already have done it.
pub async fn run<O: Operation>(
    engine: &Engine,
    request: Request,
    operation: O,
) -> Result<Answer, Error> {
    debug_assert_eq!(request.route, O::ROUTE, "a request for another operation");
    let request = bounded(engine, request);
    let _hang_up = request.client_gone.clone().drop_guard();
    let work = claim_and_work(engine.clone(), request, operation);
    in_task(engine, O::NOUN, work).await
}

/// `request`, its deadline no later than `REQUEST_TIMEOUT` after its arrival,
/// whatever its caller said: the rules of [`crate::settings::Timeouts::new`]
/// hold for that deadline.
pub(crate) fn bounded(engine: &Engine, mut request: Request) -> Request {
    let latest = request.arrived + engine.timeouts.request;
    request.deadline = request.deadline.min(latest);
    request
}

/// Runs `work` in a task of [`Engine::tasks`] and returns its answer, timing
/// its hand-offs to and from the scheduler as [`Phase::TaskHandoff`].
/// `noun` names the task in the error of one that failed.
pub(crate) async fn in_task<W>(engine: &Engine, noun: &str, work: W) -> Result<Answer, Error>
where
    W: Future<Output = (Result<Answer, Error>, Request)> + Send + 'static,
{
    let spawned = Instant::now();
    let task = engine.tasks.clone().spawn(
        async move {
            let started = Instant::now();
            let (answer, request) = work.await;
            (answer, request, started, Instant::now())
        }
        .instrument(tracing::Span::current()),
    );
    match task.await {
        Ok((answer, request, started, ended)) => {
            let handoff = started.saturating_duration_since(spawned) + ended.elapsed();
            request.clock.add(Phase::TaskHandoff, handoff);
            answer
        }
        Err(e) => Err(Error::Internal(
            anyhow::Error::new(e).context(format!("{noun} task failed")),
        )),
    }
}

/// Steps 2 to 4, each timed once, at its boundary.
async fn claim_and_work<O: Operation>(
    engine: Engine,
    request: Request,
    mut operation: O,
) -> (Result<Answer, Error>, Request) {
    let claiming = Instant::now();
    let claimed = claim::claim_or_answer(&engine, &request, &mut operation).await;
    request.clock.lap(Phase::Claim, claiming);
    let answer = match claimed {
        Ok(None) => work_and_settle(&engine, &operation, &request).await,
        Ok(Some(answer)) => Ok(answer),
        Err(e) => Err(e),
    };
    (answer, request)
}

/// Steps 3 and 4, once the key is claimed with the record pending: from
/// here on a failure leaves the record to recovery.
async fn work_and_settle<O: Operation>(
    engine: &Engine,
    operation: &O,
    request: &Request,
) -> Result<Answer, Error> {
    let fault = request.fault;
    crash_if(fault, Fault::CrashAfterClaim);
    let calling = Instant::now();
    let outcome = operation
        .call_processor(engine.processor.as_ref(), Fault::at_processor(fault))
        .await;
    let called = request.clock.lap(Phase::Processor, calling);
    crash_if(fault, Fault::CrashAfterProcessor);
    let answer = match outcome {
        Ok(outcome) => settle(engine, operation, request, &outcome, called).await,
        Err(ProcessorError::Unavailable) => {
            let answer = match operation.processor_unavailable(engine).await {
                Ok(Some(problem)) => Err(problem.into()),
                Ok(None) => settled_elsewhere(engine, operation, request).await,
                Err(e) => Err(e),
            };
            request.clock.lap(Phase::Settle, called);
            answer
        }
        Err(e @ ProcessorError::OutcomeUnknown(_)) => Err(outcome_unknown(engine, operation, e)),
    };
    // Requests waiting on the key here hear of it at once.
    if let Some(key) = &request.key {
        engine.waits.wake(request.merchant_id, key);
    }
    answer.map_err(|e| e.awaiting_recovery(&engine.timeouts))
}

/// Step 4: settles the record with the processor's `outcome`, recorded and
/// final whatever it was, on a connection taken from the pool directly (not
/// through the admission: claimed work is never turned away).
async fn settle<O: Operation>(
    engine: &Engine,
    operation: &O,
    request: &Request,
    outcome: &O::Outcome,
    called: Instant,
) -> Result<Answer, Error> {
    let mut db = engine.pool.acquire().await?;
    let settling = request.clock.lap(Phase::SettlePoolWait, called);
    let (request_id, fault) = (request.request_id.as_deref(), request.fault);
    let settled = operation
        .settle(engine, &mut db, outcome, request_id, fault)
        .await;
    request.clock.lap(Phase::Settle, settling);
    match settled? {
        Settled::Now(saved) => Ok(Answer::Fresh(saved)),
        // Recovery settled it while the processor was answering: what it
        // saved is the answer, since both came from the one processor record.
        Settled::Already => settled_elsewhere(engine, operation, request).await,
    }
}

/// `503 processing_outcome_unknown`: money may have moved, so the claim
/// stays; recovery (the sweeper, or a retry after `PROCESSING_TIMEOUT`)
/// settles the record from the processor's record, and later retries replay
/// that.
fn outcome_unknown<O: Operation>(engine: &Engine, operation: &O, e: ProcessorError) -> Error {
    let error = format!("{:#}", anyhow::Error::new(e));
    tracing::warn!(resource = ?operation.resource(), error, "processor outcome unknown");
    Problem::new(ProblemCode::ProcessingOutcomeUnknown, O::OUTCOME_UNKNOWN)
        .with_extra(O::NOUN, operation.id().to_owned())
        .with_retry_after(retry_after::until_recovered(&engine.timeouts))
        .into()
}

/// The answer for a record someone else settled: its key's saved response,
/// or, for a record made without a key, the record rendered afresh.
async fn settled_elsewhere<O: Operation>(
    engine: &Engine,
    operation: &O,
    request: &Request,
) -> Result<Answer, Error> {
    if let Some(saved) = keys::saved_for_resource(&engine.pool, &operation.resource()).await? {
        return Ok(Answer::Fresh(saved));
    }
    let request_id = request.request_id.as_deref();
    Ok(Answer::Fresh(operation.render(engine, request_id).await?))
}
