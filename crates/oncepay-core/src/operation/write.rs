//! A guarded operation done whole in the claim's transaction: no processor,
//! no other system, so the claim, the record and the saved answer commit
//! together or not at all. Creating a webhook endpoint is one. Its key is
//! never left `processing`, so nothing here is ever left to recovery: a
//! retry finds the key completed and replays it, or finds it free.

use std::future::Future;
use std::time::Instant;

use sqlx::{PgConnection, Postgres, Transaction};

use super::claim::{self, Begun};
use super::timing::Phase;
use super::{Answer, Guard};
use crate::error::Error;
use crate::idempotency::{SavedResponse, store as keys};
use crate::operation::Engine;

/// The work of one kind of record, plugged into [`run`].
pub trait Write: Send + Sync {
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

/// Runs `write` for a request guarded by `guard`: claims the key or answers
/// from it; writes, saves the answer on the key, and commits, all at once.
///
/// The work runs in a task of [`Engine::tasks`], as a guarded operation's
/// does: a request dropped by `REQUEST_TIMEOUT` or a client hanging up must
/// not cancel a transaction half-way (sqlx cannot cancel a `BEGIN` in flight
/// safely); a wait for the key in flight still stops when the client goes.
pub async fn run<W: Write + 'static>(
    engine: &Engine,
    guard: Guard,
    write: W,
) -> Result<Answer, Error> {
    let (request, _hang_up) = claim::Request::of(W::ROUTE, guard, || write.canonical());
    let work = |request| claim_and_write(engine.clone(), request, write);
    super::in_task(engine, request, "write", work).await
}

async fn claim_and_write<W: Write>(
    engine: Engine,
    request: claim::Request,
    write: W,
) -> Result<Answer, Error> {
    let engine = &engine;
    let claiming = Instant::now();
    let begun = claim::begin(engine, &request, None).await;
    request.clock.lap(Phase::Claim, claiming);
    let tx = match begun? {
        Begun::Claimed(tx) => tx,
        Begun::Answered(answer) => return Ok(answer),
        Begun::Written => {
            return Err(Error::internal("a write's claim has no record of its own"));
        }
    };
    let writing = Instant::now();
    let written = write_and_commit(engine, &request, &write, tx).await;
    request.clock.lap(Phase::Write, writing);
    let saved = written?;
    claim::finished(engine, &request);
    Ok(Answer::Fresh(saved))
}

/// Writes the record, saves its answer on the request's key and commits,
/// in the claim's transaction `tx`.
async fn write_and_commit<W: Write>(
    engine: &Engine,
    request: &claim::Request,
    write: &W,
    mut tx: Transaction<'static, Postgres>,
) -> Result<SavedResponse, Error> {
    let saved = match write.write(&mut tx).await {
        Ok(saved) => saved,
        Err(e) => {
            tx.rollback().await?;
            return Err(e);
        }
    };
    if let Some(key) = &request.key {
        let ttl = engine.timeouts.key_ttl;
        if !keys::complete(&mut tx, request.merchant_id, key, &saved, ttl).await? {
            return Err(Error::internal(
                "the key claimed in this transaction is no longer its to complete",
            ));
        }
    }
    tx.commit().await?;
    Ok(saved)
}
