//! Step 2: the claim. Before any work, a request claims its idempotency key
//! with one statement ([`claim`]): an `INSERT ... ON CONFLICT` that inserts
//! the key as `processing`, or takes over an expired one, and writes the
//! pending record with it, so the key and the record exist together or not
//! at all. Nothing is read first and written after: two requests with one
//! key race on the table's unique index, and exactly one wins.
//!
//! What the claim found ([`Found`]) decides what the request does next, in
//! one loop ([`claim_or_answer`]) in the shape of brandur's
//! rocket-rides-atomic:
//!
//! | the claim found | the request |
//! |---|---|
//! | `Won` | holds the key, its record written pending: on to the processor |
//! | `Done` | replays the saved answer, or `422` if it was for other parameters |
//! | `Busy`, other parameters | `422` |
//! | `Busy`, stale | leases the key and settles its record as the sweeper does, then claims again (if someone else leased it first: as `Busy`) |
//! | `Busy` | waits (`Prefer: wait=N`) and claims again, or `409` with `Retry-After` |
//! | `Gone` | claims again |
//! | `TooLate` | `503 request_timeout`: nothing was claimed |
//!
//! Each kind of operation writes its own pending record with the claim
//! ([`Pending`]): a charge in the claim's own statement; a refund or a
//! capture, whose record reserves an amount on a charge and may be refused,
//! in one transaction with the claim, rolled back together.
//!
//! Nothing here knows HTTP, and nothing here is a speed mechanism: the
//! connection comes through the engine's admission and a wait through its
//! waits ([`crate::speed`]), whose plain defaults are the pool and a poll.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres, Transaction};

use super::engine::{Answer, Engine, METHOD, Request};
use super::timing::{Phase, count_outcome, count_shed};
use crate::charges::Charge;
use crate::error::{Error, overloaded};
use crate::idempotency::Resource;
use crate::idempotency::store::{self as keys, FirstRequest, KeyStatus, SavedAnswer, millis};
use crate::problem::{Problem, ProblemCode};
use crate::recovery;
use crate::retry_after;
use crate::speed::{Admission, Plain, Refused};

/// What a claim found.
#[derive(Debug)]
pub enum Found {
    /// The key is this request's now, and its pending record is written (a
    /// request without a key has only the record). `took_over`: the key
    /// existed, had expired, and was taken over.
    Won { took_over: bool },
    /// The key holds a saved answer.
    Done(Arc<SavedAnswer>),
    /// Another request holds the key and has not finished: `first` is what
    /// it asked for; `stale` when it has held the key for longer than
    /// `PROCESSING_TIMEOUT`.
    Busy { first: FirstRequest, stale: bool },
    /// The key vanished between the claim and its read (given back, or
    /// expired and deleted).
    Gone,
    /// The statement reached the database after the request's deadline:
    /// nothing was claimed or written.
    TooLate,
}

/// One kind of operation's step 2: its pending record, written with the
/// claim so that both stand or fall together.
pub trait Pending: Send {
    /// Claims the request's key ([`claim`]) and writes the pending record
    /// with it: in the claim's own statement, or in one transaction after
    /// it, rolled back with the claim if the record cannot be written (the
    /// refusal is the error). Anything but [`Found::Won`] writes nothing.
    fn claim_with_record(
        &mut self,
        engine: &Engine,
        request: &Request,
    ) -> impl Future<Output = Result<Found, Error>> + Send;
}

/// How long before `REQUEST_TIMEOUT` a wait gives up, so that its `409`
/// still goes out.
const WAIT_MARGIN: Duration = Duration::from_millis(250);

/// Step 2 in a loop over what the claim finds: `None` once the request holds
/// its key with its record written pending, else the answer the key gives
/// it (a replay, or a problem: `409`, `422`, `503`).
pub async fn claim_or_answer<P: Pending>(
    engine: &Engine,
    request: &Request,
    operation: &mut P,
) -> Result<Option<Answer>, Error> {
    let margin = WAIT_MARGIN.min(engine.timeouts.request);
    let wait_until = (Instant::now() + request.wait).min(request.deadline - margin);
    let mut waited = false;
    loop {
        let asked_at = tokio::time::Instant::now();
        match operation.claim_with_record(engine, request).await? {
            // Ours, the record written pending: on to the processor.
            Found::Won { took_over } => {
                let outcome = if took_over {
                    "expired_taken_over"
                } else {
                    "executed"
                };
                if request.key.is_some() {
                    count_outcome(outcome);
                }
                return Ok(None);
            }
            // Finished: its answer, if it was for this very request.
            Found::Done(saved) => return replay(saved, request, waited).map(Some),
            Found::Busy { first, stale } => {
                if !first.is(&request.fingerprint) {
                    return Err(reused(request, &first));
                }
                // Its request went quiet: settle it as the sweeper would, claim again.
                if stale && recover_stale(engine, request).await? {
                    continue;
                }
                // In flight: wait for it to change and claim again, or `409`.
                if Instant::now() >= wait_until {
                    count_outcome("in_use");
                    return Err(key_in_use(waited).into());
                }
                waited = true;
                wait(engine, request, asked_at, wait_until).await?;
            }
            Found::Gone => {}
            Found::TooLate => return Err(too_late(request)),
        }
    }
}

/// The claim, one statement: inserts the request's key as `processing`, or
/// takes an existing one over where `idempotency_key_takeover` allows (an
/// expired key whose answer was saved before this request arrived), but only
/// if the statement reaches the database before the request's deadline: a
/// request answered `503` may have been retried, and the retry's answer is
/// never taken over by its late original. With `charge`, the same statement
/// writes the pending charge, exactly when it claims the key (or at once,
/// for a request without one), and sets its `created_at`. `resource` names
/// the record the key guards, for recovery; a record written and answered
/// in the claim's own transaction (a webhook endpoint) needs none.
///
/// A key it finds taken is then read ([`keys::find_taken`]) and returned as
/// [`Found::Done`] or [`Found::Busy`]; in a transaction, the conflict has
/// locked its row, so the read sees it as the transaction will.
pub async fn claim(
    db: &mut PgConnection,
    engine: &Engine,
    request: &Request,
    resource: Option<&Resource>,
    charge: Option<&mut Charge>,
) -> Result<Found, Error> {
    let (charge_id, refund_id, capture_of) = Resource::columns(resource);
    let pending = charge.as_deref().map(serde_json::to_value).transpose();
    let pending = pending.map_err(|e| Error::Internal(e.into()))?;
    let row = sqlx::query!(
        r#"WITH claimed AS (
               INSERT INTO idempotency_keys AS k
                      (merchant_id, key, status, request_method, request_path, fingerprint,
                       charge_id, refund_id, capture_of, request_id,
                       created_at, locked_at, expires_at)
               SELECT $1, $2, 'processing', $3, $4, $5, $6, $7, $8, $9,
                      now(), now(), now() + $10::float8 * interval '1 millisecond'
                WHERE $2::text IS NOT NULL AND statement_timestamp() < $11
               ON CONFLICT (merchant_id, key) DO UPDATE
                  SET (status, request_method, request_path, fingerprint,
                       charge_id, refund_id, capture_of, request_id,
                       created_at, locked_at, expires_at, completed_at, response_status,
                       response_content_type, response_location, response_body)
                    = (EXCLUDED.status, EXCLUDED.request_method, EXCLUDED.request_path,
                       EXCLUDED.fingerprint, EXCLUDED.charge_id, EXCLUDED.refund_id,
                       EXCLUDED.capture_of, EXCLUDED.request_id, EXCLUDED.created_at,
                       EXCLUDED.locked_at, EXCLUDED.expires_at, NULL, NULL, NULL, NULL, NULL)
                WHERE idempotency_key_takeover(k.status, k.expires_at, k.completed_at, $12::float8)
               RETURNING k.xmax <> 0 AS took_over),
           pending_charge AS (
               INSERT INTO charges (id, merchant_id, amount, currency, source, description,
                                    metadata, status, receipt_email, statement_descriptor,
                                    statement_descriptor_suffix, shipping, transfer_group,
                                    capture_later)
               SELECT c.id, c.merchant_id, c.amount, c.currency, c.source, c.description,
                      c.metadata, 'pending', c.receipt_email, c.statement_descriptor,
                      c.statement_descriptor_suffix, c.shipping, c.transfer_group,
                      c.capture_later
                 FROM jsonb_populate_record(NULL::charges, $13::jsonb) AS c
                WHERE $13::jsonb IS NOT NULL AND statement_timestamp() < $11
                  AND ($2::text IS NULL OR EXISTS (SELECT FROM claimed))
               RETURNING created_at)
           SELECT statement_timestamp() < $11 AS "in_time!",
                  (SELECT took_over FROM claimed) AS took_over,
                  (SELECT created_at FROM pending_charge) AS charge_created_at"#,
        request.merchant_id,
        request.key.as_ref().map(|key| key.as_str()),
        METHOD,
        request.route,
        &request.fingerprint.0[..],
        charge_id,
        refund_id,
        capture_of,
        request.request_id.as_deref(),
        millis(engine.timeouts.key_ttl),
        wall_clock(request.deadline),
        millis(request.arrived.elapsed()),
        pending,
    )
    .fetch_one(&mut *db)
    .await?;
    if let (Some(charge), Some(created_at)) = (charge, row.charge_created_at) {
        charge.created_at = created_at;
    }
    let Some(key) = &request.key else {
        return Ok(if row.in_time {
            Found::Won { took_over: false }
        } else {
            Found::TooLate
        });
    };
    match (row.in_time, row.took_over) {
        (false, _) => return Ok(Found::TooLate),
        (true, Some(took_over)) => return Ok(Found::Won { took_over }),
        (true, None) => {}
    }
    // Taken: what does the key hold?
    let processing = engine.timeouts.processing;
    let Some(stored) = keys::find_taken(db, request.merchant_id, key, processing).await? else {
        return Ok(Found::Gone);
    };
    if stored.status == KeyStatus::Processing {
        let (first, stale) = (stored.first, stored.stale);
        return Ok(Found::Busy { first, stale });
    }
    let saved = stored.into_answer();
    let saved = saved.ok_or_else(|| Error::internal("a completed key without its answer"))?;
    Ok(Found::Done(Arc::new(saved)))
}

/// `deadline` on this instance's wall clock, read just before a statement
/// is sent that compares it with `statement_timestamp()`. Clocks agree
/// within [`crate::settings::MAX_CLOCK_SKEW`], and keys outlive the deadline
/// plus that ([`crate::settings::Timeouts::new`]).
fn wall_clock(deadline: Instant) -> DateTime<Utc> {
    let left = deadline.saturating_duration_since(Instant::now());
    Utc::now() + chrono::TimeDelta::from_std(left).unwrap_or(chrono::TimeDelta::MAX)
}

/// The answer `saved` gives `request`: its replay, or `422` if the key was
/// first used for another request. The server's replay cache answers
/// through it too.
pub fn replay(saved: Arc<SavedAnswer>, request: &Request, waited: bool) -> Result<Answer, Error> {
    if !saved.first.is(&request.fingerprint) {
        return Err(reused(request, &saved.first));
    }
    count_outcome("replayed");
    Ok(Answer::Replayed { saved, waited })
}

/// Leases the request's stale key (one conditional update, as the sweeper
/// does) and settles its record by the sweeper's own procedure
/// ([`recovery::recover_leased`], which gives the lease back if it fails);
/// `false` when someone else leased it first, or settled it.
async fn recover_stale(engine: &Engine, request: &Request) -> Result<bool, Error> {
    let key = request
        .key
        .as_ref()
        .ok_or_else(|| Error::internal("a keyless lease"))?;
    if !request.still_awaited() {
        return Err(too_late(request));
    }
    let processing = engine.timeouts.processing;
    let leased = keys::lease_one(&engine.pool, request.merchant_id, key, processing).await?;
    let Some(lease) = leased else {
        return Ok(false);
    };
    tracing::info!(resource = ?lease.resource, "a retry found its key stale; settling it");
    let processor = engine.processor.as_ref();
    let (ttl, request_id) = (engine.timeouts.key_ttl, request.request_id.as_deref());
    recovery::recover_leased(&engine.pool, processor, &lease, processing, ttl, request_id)
        .await
        // At the processor, the lease was given back: a retry may recover
        // the key at once. A database outage may have kept it leased.
        .map_err(|e| {
            Error::from_processor(e, retry_after::SOON).awaiting_recovery(&engine.timeouts)
        })?;
    count_outcome("stale_recovered");
    request.has_written.store(true, Ordering::Relaxed);
    Ok(true)
}

/// Waits until the key in flight may have changed since `since` (the
/// engine's waits, [`crate::speed::Waits`]), holding no connection and no
/// lock: `409` once `until` passes or the client hangs up.
async fn wait(
    engine: &Engine,
    request: &Request,
    since: tokio::time::Instant,
    until: Instant,
) -> Result<(), Error> {
    let key = request
        .key
        .as_ref()
        .ok_or_else(|| Error::internal("a keyless wait"))?;
    let processing = engine.timeouts.processing;
    let changed = engine
        .waits
        .changed(&engine.pool, processing, request.merchant_id, key, since);
    let waiting = Instant::now();
    let outcome = tokio::select! {
        changed = tokio::time::timeout_at(until.into(), changed) => changed.map_or("in_use", |()| ""),
        () = request.client_gone.cancelled() => {
            tracing::info!("the client hung up; stopped waiting for the key in flight");
            "wait_abandoned"
        }
    };
    request.clock.add(Phase::KeyWait, waiting.elapsed());
    if outcome.is_empty() {
        return Ok(());
    }
    count_outcome(outcome);
    Err(key_in_use(true).into())
}

/// A pooled connection to claim on, through the engine's admission (or
/// straight from the pool once the request has written) and never past the
/// request's deadline: `503 overloaded` when the admission sheds the
/// request, `503 request_timeout` once it was answered.
pub async fn connection(
    engine: &Engine,
    request: &Request,
) -> Result<PoolConnection<Postgres>, Error> {
    let asked = Instant::now();
    let (pool, deadline) = (&engine.pool, request.deadline.into());
    let acquired = if request.has_written.load(Ordering::Relaxed) {
        Plain.acquire(pool, deadline).await
    } else {
        engine.admission.acquire(pool, deadline).await
    };
    request.clock.add(Phase::PoolWait, asked.elapsed());
    if let Err(Refused::Shed { waited }) = &acquired {
        // Logged at debug level only: a line per request would flood the
        // log just when the process has least to spare; the metric counts.
        let waited_ms = waited.as_millis() as u64;
        tracing::debug!(waited_ms, "no connection within the queue's bound; shed");
        count_shed(request.route);
        return Err(overloaded().into());
    }
    if !request.still_awaited() {
        return Err(too_late(request));
    }
    match acquired {
        Ok(connection) => Ok(connection),
        Err(Refused::Pool(e)) => Err(e.into()),
        Err(Refused::Deadline | Refused::Shed { .. }) => Err(too_late(request)),
    }
}

/// A transaction to claim in, as for [`connection`]. `BEGIN` is never cut
/// short (sqlx cannot cancel one in flight safely), so the check follows it.
pub async fn transaction(
    engine: &Engine,
    request: &Request,
) -> Result<Transaction<'static, Postgres>, Error> {
    let connection = connection(engine, request).await?;
    let tx = Transaction::begin(connection, None).await?;
    if !request.still_awaited() {
        return Err(too_late(request));
    }
    Ok(tx)
}

/// `503 request_timeout`: the request was answered (or its client hung up)
/// before its claim could take effect, so nothing was claimed.
fn too_late(request: &Request) -> Error {
    let waited_ms = request.arrived.elapsed().as_millis() as u64;
    tracing::info!(
        waited_ms,
        "answered before its work could begin; nothing claimed"
    );
    count_outcome("answered_before_claim");
    Problem::new(
        ProblemCode::RequestTimeout,
        "The request took too long and was stopped before any work began. Retry (a POST with the same Idempotency-Key).",
    )
    .with_retry_after(retry_after::SOON)
    .into()
}

/// `422`, counted: the request's key was first used for `first`.
fn reused(request: &Request, first: &FirstRequest) -> Error {
    count_outcome("reused");
    let key = request.key.as_ref().map_or("", |key| key.as_str());
    let now = format!("{METHOD} {}", request.route);
    key_reused(key, &format!("{} {}", first.method, first.route), &now).into()
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
