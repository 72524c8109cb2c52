//! Reads of keys that missed the replay cache, coalesced.
//!
//! While retries are common, a keyed request that missed the replay cache
//! reads its key before the core is entered ([`super::front`]): a retry of a
//! finished operation is answered from that read, without the claim's
//! statement, which writes when it wins, locks the key's row when it does
//! not, and costs the database several times a primary-key read either way. The reads of concurrent
//! requests, whatever their keys and merchants, go out together: one task
//! takes every read asked for since its last batch and runs them as one
//! statement on one connection ([`store::find_many`]), one batch at a time.
//! Requests asking while a batch is out wait for the next, so the busier
//! the instance, the larger the batches and the fewer the statements per
//! read.
//!
//! The read is a fast path, never the decision: the claim that follows a
//! read that found nothing is the same atomic `INSERT ... ON CONFLICT` as
//! ever, and a batch that fails (or a request that cannot wait for it)
//! only sends the request to that claim without the read's answer.
//!
//! The queue of reads waiting for a batch is bounded ([`MOST_QUEUED`]): a
//! database that answers more slowly than reads arrive (or not at all, until
//! its connections are cut, see [`pg_follow::liveness`]) would
//! otherwise have requests pile up behind it without end. A read asked of a
//! full queue is refused at once ([`Shed`]), and its request answered
//! `503 overloaded` before it has begun anything.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;
use uuid::Uuid;

use oncepay_core::idempotency::IdempotencyKey;
use oncepay_core::idempotency::store::{self, StoredKey};

use super::admission::Admission;

/// A read of a key refused at once because too many are queued: the
/// request is shed before any work.
#[derive(Debug)]
pub struct Shed;

/// The most reads one statement carries.
const MOST_PER_BATCH: usize = 128;

/// The most reads waiting for a batch: eight full batches.
pub const MOST_QUEUED: usize = 8 * MOST_PER_BATCH;

/// One request's read, waiting for its batch.
struct Ask {
    merchant_id: Uuid,
    key: IdempotencyKey,
    /// When its request stops waiting for the read.
    deadline: tokio::time::Instant,
    /// The key found, if any; `None` too when the read failed.
    answer: oneshot::Sender<Option<StoredKey>>,
}

/// The process's coalesced reads; cloning shares them.
#[derive(Clone)]
pub struct Reads {
    asks: mpsc::Sender<Ask>,
    lately: Arc<Lately>,
}

/// What a batch of reads needs: the pool, the queue its connection waits
/// in, and `PROCESSING_TIMEOUT` (a key in flight is read as stale after it).
struct Batcher {
    pool: PgPool,
    admission: Arc<Admission>,
    processing_timeout: Duration,
}

/// Of the keys that missed the replay cache lately, how many were taken
/// (a retry, or a duplicate in flight) and how many were met at all; both
/// halved whenever [`Lately::MEMORY`] keys have been met, so that old
/// traffic fades.
#[derive(Default)]
struct Lately {
    taken: AtomicU32,
    met: AtomicU32,
}

impl Lately {
    const MEMORY: u32 = 256;
    /// Fewer keys met than this say nothing yet: read.
    const EVIDENCE: u32 = 32;
    /// Read first while at least one key in this many was taken.
    const ONE_IN: u32 = 8;

    fn learn(&self, taken: bool) {
        if taken {
            self.taken.fetch_add(1, Ordering::Relaxed);
        }
        if self.met.fetch_add(1, Ordering::Relaxed) + 1 >= Self::MEMORY {
            // Racing learners may halve twice or miss a count: a rough
            // memory is enough for a choice between two correct paths.
            self.met.store(Self::MEMORY / 2, Ordering::Relaxed);
            let taken = self.taken.load(Ordering::Relaxed);
            self.taken.store(taken / 2, Ordering::Relaxed);
        }
    }

    fn worth_reading(&self) -> bool {
        let met = self.met.load(Ordering::Relaxed);
        met < Self::EVIDENCE || self.taken.load(Ordering::Relaxed) * Self::ONE_IN >= met
    }
}

impl Reads {
    /// Starts the task that batches reads on `pool`, taking its connection
    /// through `admission` as the requests it reads for would; it ends when
    /// the last clone of the returned handle is dropped.
    pub fn start(pool: PgPool, admission: Arc<Admission>, processing_timeout: Duration) -> Self {
        let (asks, queued) = mpsc::channel(MOST_QUEUED);
        let batcher = Batcher {
            pool,
            admission,
            processing_timeout,
        };
        tokio::spawn(
            batch_reads(batcher, queued).instrument(tracing::info_span!("coalesced_key_reads")),
        );
        Reads {
            asks,
            lately: Arc::default(),
        }
    }

    /// Whether a request whose key missed the replay cache should read it
    /// before claiming it. For a new key the read is a round trip more,
    /// for a taken one it saves the claim's statement, which costs the
    /// database about ten times a read: so it is worth it while at least
    /// one such key in [`Lately::ONE_IN`] was taken lately, as in a storm
    /// of retries, or when the instance's retries are another's (a fleet
    /// behind a balancer), and not under ordinary traffic, almost all new
    /// keys. Either way the claim decides; this only picks the cheaper
    /// way to it.
    pub fn worth_reading(&self) -> bool {
        self.lately.worth_reading()
    }

    /// Records whether a key that missed the replay cache was `taken`,
    /// found by its read or by its claim.
    pub fn learn(&self, taken: bool) {
        self.lately.learn(taken);
    }

    /// The merchant's key as [`store::find`] reads it (a live key, or one
    /// still `processing`), read with whatever other reads are asked for
    /// meanwhile; `None` if there is none, and also if the read could not
    /// be made before `deadline` or its batch failed: either way the caller
    /// claims the key, and the claim finds a taken key itself. [`Shed`] at
    /// once when the queue is full.
    pub async fn find(
        &self,
        merchant_id: Uuid,
        key: &IdempotencyKey,
        deadline: tokio::time::Instant,
    ) -> Result<Option<StoredKey>, Shed> {
        let (answer, found) = oneshot::channel();
        let ask = Ask {
            merchant_id,
            key: key.clone(),
            deadline,
            answer,
        };
        match self.asks.try_send(ask) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => return Err(Shed),
            Err(mpsc::error::TrySendError::Closed(_)) => return Ok(None),
        }
        Ok(tokio::time::timeout_at(deadline, found)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten())
    }
}

async fn batch_reads(batcher: Batcher, mut queued: mpsc::Receiver<Ask>) {
    let mut batch = Vec::new();
    while let Some(first) = queued.recv().await {
        // Its connection waits in the admission queue, as the requests' own
        // would: when the pool is overloaded the batch is shed, and its
        // requests go to their claims, which are shed in turn.
        let deadline = first.deadline;
        batch.push(first);
        let mut db = match batcher.admission.acquire(&batcher.pool, deadline).await {
            Ok(db) => db,
            Err(refused) => {
                // Every read asked meanwhile would wait in vain as well.
                while let Ok(ask) = queued.try_recv() {
                    batch.push(ask);
                }
                fail(std::mem::take(&mut batch), &refused);
                continue;
            }
        };
        // One batch after another on the same connection while asks keep
        // coming: a connection going back to the pool costs a round trip
        // (sqlx checks it), so it goes back only once the queue is empty.
        // Reads are the fast path only (see the module's note), so a
        // connection kept across a change of primary can do no harm.
        loop {
            while batch.len() < MOST_PER_BATCH {
                match queued.try_recv() {
                    Ok(ask) => batch.push(ask),
                    Err(_) => break,
                }
            }
            let timeout = batcher.processing_timeout;
            if batch.is_empty() || !read_batch(&mut db, std::mem::take(&mut batch), timeout).await {
                break;
            }
        }
    }
}

/// Reads `batch` in one statement on `db` and answers each ask; `false`
/// if the statement failed.
async fn read_batch(db: &mut PgConnection, batch: Vec<Ask>, timeout: Duration) -> bool {
    // An ask whose request has gone needs no read.
    let batch: Vec<Ask> = batch
        .into_iter()
        .filter(|a| !a.answer.is_closed())
        .collect();
    if batch.is_empty() {
        return true;
    }
    let started = Instant::now();
    let merchants: Vec<Uuid> = batch.iter().map(|a| a.merchant_id).collect();
    let keys: Vec<&str> = batch.iter().map(|a| a.key.as_str()).collect();
    let read = store::find_many(db, &merchants, &keys, timeout).await;
    metrics::histogram!("idempotency_key_reads_per_batch").record(batch.len() as f64);
    metrics::histogram!("idempotency_key_read_batch_duration_seconds")
        .record(started.elapsed().as_secs_f64());
    let rows = match read {
        Ok(rows) => rows,
        Err(e) => {
            fail(batch, &e);
            return false;
        }
    };
    let mut found: Vec<Option<StoredKey>> = (0..batch.len()).map(|_| None).collect();
    for (at, stored) in rows {
        if let Some(slot) = found.get_mut(at) {
            *slot = Some(stored);
        }
    }
    for (ask, stored) in batch.into_iter().zip(found) {
        let _ = ask.answer.send(stored);
    }
    true
}

/// Tells every ask of `batch` that its read failed.
fn fail(batch: Vec<Ask>, e: &dyn std::fmt::Debug) {
    tracing::debug!(
        error = ?e,
        reads = batch.len(),
        "a batch of key reads failed; its requests claim without it"
    );
    for ask in batch {
        let _ = ask.answer.send(None);
    }
}

#[cfg(test)]
mod tests {
    use super::Lately;

    #[test]
    fn keys_are_read_first_while_one_in_eight_was_taken_and_not_after() {
        let lately = Lately::default();
        assert!(lately.worth_reading(), "no evidence yet: read");
        for _ in 0..100 {
            lately.learn(false);
        }
        assert!(!lately.worth_reading(), "all new: claim at once");
        for _ in 0..20 {
            lately.learn(true);
        }
        assert!(lately.worth_reading(), "20 taken of 120: read");
        for _ in 0..1000 {
            lately.learn(false);
        }
        assert!(!lately.worth_reading(), "the storm has faded");
        assert!(lately.met.load(std::sync::atomic::Ordering::Relaxed) <= Lately::MEMORY);
    }
}
