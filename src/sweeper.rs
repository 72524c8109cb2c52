//! The background task in every `serve` process (and `oncepay sweep`):
//! settles charges left `pending` by a crash or a lost processor answer, and
//! deletes expired keys in bounded batches.
//!
//! Several sweepers may run at once. Stale keys are leased (`FOR UPDATE SKIP
//! LOCKED`, then a fresh `locked_at`), and every write is conditional, so
//! no row is settled twice and a late request changes nothing.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::charges::settle::recover;
use crate::charges::store as charges;
use crate::idempotency::store as keys;
use crate::processor::{Outcome, Processor};

/// How many rows one statement handles.
const BATCH: i64 = 500;
/// How many delete batches one pass runs at most, so a pass stays short.
const MAX_DELETE_BATCHES: usize = 20;

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Stale charges found paid at the processor, now `succeeded`.
    pub settled_succeeded: u64,
    /// Stale charges that were declined, or voided by this pass, now `failed`.
    pub settled_failed: u64,
    /// Expired keys deleted.
    pub keys_deleted: u64,
}

/// The sweeper.
#[derive(Clone)]
pub struct Sweeper {
    pool: PgPool,
    processor: Arc<dyn Processor>,
    processing_timeout: Duration,
}

impl Sweeper {
    pub fn new(pool: PgPool, processor: Arc<dyn Processor>, processing_timeout: Duration) -> Self {
        Sweeper {
            pool,
            processor,
            processing_timeout,
        }
    }

    /// One pass: settle stale charges, then delete expired keys.
    pub async fn sweep_once(&self) -> anyhow::Result<SweepReport> {
        let mut report = SweepReport::default();
        let mut stale = keys::lease_stale(&self.pool, self.processing_timeout, BATCH).await?;
        stale.extend(charges::stale_unguarded(&self.pool, self.processing_timeout, BATCH).await?);
        for charge_id in stale {
            match recover(&self.pool, self.processor.as_ref(), &charge_id).await {
                Ok(Some(Outcome::Succeeded)) => report.settled_succeeded += 1,
                Ok(Some(_)) => report.settled_failed += 1,
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(charge = %charge_id, error = format!("{e:#}"), "could not settle a stale charge")
                }
            }
        }
        for _ in 0..MAX_DELETE_BATCHES {
            let deleted = keys::delete_expired(&self.pool, BATCH).await?;
            report.keys_deleted += deleted;
            if deleted < BATCH as u64 {
                break;
            }
        }
        if report != SweepReport::default() {
            tracing::info!(?report, "sweep pass");
        }
        Ok(report)
    }

    /// Sweeps every `interval` until `shutdown` resolves; a failed pass is
    /// logged and the next one tried.
    pub async fn run(self, interval: Duration, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        // The first pass comes one interval after start, like every other.
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = ticker.tick() => {
                    if let Err(e) = self.sweep_once().await {
                        tracing::warn!(error = format!("{e:#}"), "sweep pass failed");
                    }
                }
            }
        }
    }
}
