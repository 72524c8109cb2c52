//! A guarded operation done whole in the claim's transaction: no processor,
//! no other system, so the claim, the record and the saved answer commit
//! together or not at all. Creating a webhook endpoint is one. Its key is
//! never left `processing`, so nothing here is ever left to recovery: a
//! retry finds the key completed and replays it, or finds it free.

use std::future::Future;
use std::time::Instant;

use sqlx::PgConnection;

use super::claim::{self, Found, Pending};
use super::engine::{Answer, Engine, Request};
use super::timing::Phase;
use super::workflow::in_task;
use crate::error::Error;
use crate::idempotency::{SavedResponse, store as keys};

/// The work of one kind of record, plugged into [`run`].
pub trait Write: Send + Sync + 'static {
    /// The route whose keys guard this operation.
    const ROUTE: &'static str;
    /// The parameters in a canonical form, for the key's fingerprint.
    fn canonical(&self) -> Vec<u8>;
    /// Writes the record in the claim's transaction and renders the
    /// answer to save. An error rolls the claim back with it: the key
    /// stays free, as for any refusal.
    fn write(
        &self,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<SavedResponse, Error>> + Send;
}

/// Runs `write` for `request`: claims the key or answers from it; writes,
/// saves the answer on the key, and commits, all at once.
///
/// The work runs in a task of [`Engine::tasks`], as a guarded operation's
/// does: a request dropped by `REQUEST_TIMEOUT` or a client hanging up must
/// not cancel a transaction half-way (sqlx cannot cancel a `BEGIN` in flight
/// safely); a wait for the key in flight still stops when the client goes.
pub async fn run<W: Write>(engine: &Engine, request: Request, write: W) -> Result<Answer, Error> {
    debug_assert_eq!(request.route, W::ROUTE, "a request for another write");
    let request = super::workflow::bounded(engine, request);
    let _hang_up = request.client_gone.clone().drop_guard();
    let engine_in_task = engine.clone();
    let work = async move {
        let mut writing = Writing { write, saved: None };
        let claiming = Instant::now();
        let claimed = claim::claim_or_answer(&engine_in_task, &request, &mut writing).await;
        request.clock.lap(Phase::Claim, claiming);
        let answer = match (claimed, writing.saved) {
            (Ok(Some(answer)), _) => Ok(answer),
            (Ok(None), Some(saved)) => Ok(Answer::Fresh(saved)),
            (Ok(None), None) => Err(Error::internal("a write claimed without its answer")),
            (Err(e), _) => Err(e),
        };
        (answer, request)
    };
    in_task(engine, "write", work).await
}

/// A write on its way: its answer once written with the claim.
struct Writing<W> {
    write: W,
    saved: Option<SavedResponse>,
}

impl<W: Write> Pending for Writing<W> {
    /// In one transaction: the claim, the record, its answer saved on the
    /// key (`idempotency_key_complete`), committed at once.
    async fn claim_with_record(
        &mut self,
        engine: &Engine,
        request: &Request,
    ) -> Result<Found, Error> {
        let mut tx = claim::transaction(engine, request).await?;
        let found = claim::claim(&mut tx, engine, request, None, None).await?;
        if !matches!(found, Found::Won { .. }) {
            tx.rollback().await?;
            return Ok(found);
        }
        let writing = Instant::now();
        let saved = match self.write.write(&mut tx).await {
            Ok(saved) => saved,
            Err(refused) => {
                tx.rollback().await?;
                return Err(refused);
            }
        };
        if let Some(key) = &request.key {
            let ttl = engine.timeouts.key_ttl;
            if !keys::complete(&mut tx, request.merchant_id, key, &saved, ttl).await? {
                return Err(Error::internal(
                    "the key claimed here is no longer its to complete",
                ));
            }
        }
        tx.commit().await?;
        request.clock.lap(Phase::Write, writing);
        if let Some(key) = &request.key {
            engine.waits.wake(request.merchant_id, key);
        }
        self.saved = Some(saved);
        Ok(found)
    }
}
