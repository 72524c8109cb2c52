//! The background task in every `serve` process (and `oncepay sweep`):
//! settles, by [`crate::recovery`], the charges and refunds a crash or a
//! lost answer left `pending`, releases authorizations left uncaptured past
//! their window ([`expiry`]), and deletes expired keys. Several sweepers may
//! run at once: stale keys are leased ([`keys::lease_stale`]), and every
//! settle is conditional.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{PgExecutor, PgPool};

use crate::charges::{capture, expiry};
use crate::idempotency::Resource;
use crate::idempotency::store::{self as keys, Lease};
use crate::processor::{Outcome, Processor, RefundOutcome};
use crate::recovery::{Recovered, give_back, recover, recover_leased};

/// How long one pass may go on deleting expired keys, batch after batch
/// (each its own short statement): a backlog is cleared as fast as the
/// database allows, so no rate of new keys outgrows the deletes, and a pass
/// still ends soon, so stale records never wait behind it.
pub const DELETE_BUDGET: Duration = Duration::from_secs(1);

/// What a sweeper does, and how much at a time.
#[derive(Clone, Copy, Debug)]
pub struct SweepSettings {
    /// Age after which a `processing` key (or a keyless pending record) is stale.
    pub processing_timeout: Duration,
    /// How long the keys the sweeper completes keep their answer, at least.
    pub key_ttl: Duration,
    /// How many rows one statement leases or deletes (`SWEEP_BATCH_SIZE`).
    pub batch_size: i64,
    /// See [`DELETE_BUDGET`].
    pub delete_budget: Duration,
    /// How long an authorization can be captured (`CAPTURE_WINDOW`); it
    /// is released after.
    pub capture_window: Duration,
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Stale keys this pass leased (at most one batch).
    pub leased: u64,
    /// Leases lost to another sweeper, or not reached within the pass's
    /// budget and given back: whoever sweeps next takes them on.
    pub leases_given_up: u64,
    /// Stale pending records without a key (several sweepers may find one).
    pub unguarded: u64,
    /// Stale charges found paid at the processor, now `succeeded`.
    pub settled_succeeded: u64,
    /// Stale charges that were declined, or voided by this pass, now `failed`.
    pub settled_failed: u64,
    /// Stale refunds rolled forward, now `succeeded`.
    pub refunds_settled: u64,
    /// Stale refunds rolled forward that the processor refused, now `failed`.
    pub refunds_failed: u64,
    /// Stale captures rolled forward, now captured.
    pub captures_settled: u64,
    /// Authorizations past the capture window whose release this pass
    /// reserved (each a refund, settled with the refunds).
    pub authorizations_expired: u64,
    /// Expired keys deleted.
    pub keys_deleted: u64,
}

/// Settles stale records and deletes expired keys, a pass at a time.
#[derive(Clone)]
pub struct Sweeper {
    pool: PgPool,
    processor: Arc<dyn Processor>,
    settings: SweepSettings,
}

impl Sweeper {
    /// A sweeper over `pool` that asks `processor`.
    pub fn new(pool: PgPool, processor: Arc<dyn Processor>, settings: SweepSettings) -> Self {
        Sweeper {
            pool,
            processor,
            settings,
        }
    }

    /// One pass: settle stale charges and refunds, then delete expired keys.
    pub async fn sweep_once(&self) -> anyhow::Result<SweepReport> {
        let mut report = SweepReport::default();
        let SweepSettings {
            processing_timeout: timeout,
            batch_size,
            delete_budget,
            capture_window,
            ..
        } = self.settings;
        let leases = keys::lease_stale(&self.pool, timeout, batch_size).await?;
        report.leased = leases.len() as u64;
        let mut keyless = stale_unguarded(&self.pool, timeout, batch_size).await?;
        let captures = capture::stale_unguarded(&self.pool, timeout, batch_size).await?;
        keyless.extend(captures.into_iter().map(Resource::Capture));
        report.unguarded = keyless.len() as u64;
        // Records are recovered one at a time, with processor calls: the
        // pass takes on no more once half of PROCESSING_TIMEOUT is spent.
        let recovering = Instant::now();
        let in_budget = || recovering.elapsed() < timeout / 2;
        self.work_through(leases, &in_budget, &mut report).await;
        for resource in keyless {
            if !in_budget() {
                break;
            }
            self.recover_one(&resource, None, &mut report).await;
        }
        for (merchant, charge) in expiry::expired(&self.pool, capture_window, batch_size).await? {
            if !in_budget() {
                break;
            }
            match expiry::release(&self.pool, merchant, &charge).await {
                Ok(Some(refund)) => {
                    report.authorizations_expired += 1;
                    self.recover_one(&Resource::Refund(refund), None, &mut report)
                        .await;
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(%charge, error = format!("{e:#}"), "could not release an expired authorization")
                }
            }
        }
        let deleting = Instant::now();
        loop {
            let deleted = keys::delete_expired(&self.pool, batch_size).await?;
            report.keys_deleted += deleted;
            if deleted < batch_size as u64 || deleting.elapsed() >= delete_budget {
                break;
            }
        }
        count(&report);
        if report != SweepReport::default() {
            tracing::info!(?report, "sweep pass");
        }
        Ok(report)
    }

    /// Works through the leased keys while `in_budget`: each lease renewed
    /// just before its record is recovered, so no one leases it meanwhile;
    /// one not reached is given back, for whoever sweeps next.
    async fn work_through(
        &self,
        leases: Vec<keys::Lease>,
        in_budget: &impl Fn() -> bool,
        report: &mut SweepReport,
    ) {
        let timeout = self.settings.processing_timeout;
        for mut lease in leases {
            if !in_budget() {
                report.leases_given_up += 1;
                if let Err(e) = give_back(&self.pool, &lease, timeout).await {
                    tracing::warn!(resource = ?lease.resource, error = format!("{e:#}"), "could not give a lease back");
                }
                continue;
            }
            match keys::renew(&self.pool, &mut lease).await {
                Ok(true) => {
                    self.recover_one(&lease.resource, Some(&lease), report)
                        .await
                }
                Ok(false) => report.leases_given_up += 1,
                Err(e) => {
                    report.leases_given_up += 1;
                    tracing::warn!(resource = ?lease.resource, error = format!("{e:#}"), "could not renew a lease");
                }
            }
        }
    }

    /// Recovers one stale record, through the `lease` on its key if it has
    /// one, and counts what it came to.
    async fn recover_one(
        &self,
        resource: &Resource,
        lease: Option<&Lease>,
        report: &mut SweepReport,
    ) {
        let (pool, processor) = (&self.pool, self.processor.as_ref());
        let (timeout, key_ttl) = (self.settings.processing_timeout, self.settings.key_ttl);
        // No request settles what the sweeper settles: its events name none.
        let recovered = match lease {
            Some(lease) => recover_leased(pool, processor, lease, timeout, key_ttl, None).await,
            None => recover(pool, processor, resource, key_ttl, None).await,
        };
        match recovered {
            Ok(Some(Recovered::Charge(Outcome::Succeeded))) => report.settled_succeeded += 1,
            Ok(Some(Recovered::Charge(_))) => report.settled_failed += 1,
            Ok(Some(Recovered::Refund(RefundOutcome::Refunded))) => report.refunds_settled += 1,
            Ok(Some(Recovered::Refund(RefundOutcome::Failed { .. }))) => report.refunds_failed += 1,
            Ok(Some(Recovered::Capture)) => report.captures_settled += 1,
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(
                    ?resource,
                    error = format!("{e:#}"),
                    "could not settle a stale record"
                )
            }
        }
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

/// Pending charges and refunds older than `timeout` that no `processing` key
/// guards, up to `limit` of each, oldest first.
async fn stale_unguarded(
    db: impl PgExecutor<'_>,
    timeout: Duration,
    limit: i64,
) -> sqlx::Result<Vec<Resource>> {
    let rows = sqlx::query!(
        r#"(SELECT true AS "charge!", c.id AS "id!" FROM charges c
             WHERE c.status = 'pending'
               AND c.created_at < now() - $1::float8 * interval '1 millisecond'
               AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                                WHERE k.charge_id = c.id AND k.status = 'processing')
             ORDER BY c.created_at
             LIMIT $2)
           UNION ALL
           (SELECT false, r.id FROM refunds r
             WHERE r.status = 'pending'
               AND r.created_at < now() - $1::float8 * interval '1 millisecond'
               AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                                WHERE k.refund_id = r.id AND k.status = 'processing')
             ORDER BY r.created_at
             LIMIT $2)"#,
        timeout.as_millis() as f64,
        limit,
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            if row.charge {
                Resource::Charge(row.id)
            } else {
                Resource::Refund(row.id)
            }
        })
        .collect())
}

/// Counts a pass in the sweeper's metrics.
fn count(report: &SweepReport) {
    metrics::counter!("sweeper_runs_total").increment(1);
    for (outcome, n) in [
        ("charge_succeeded", report.settled_succeeded),
        ("charge_failed", report.settled_failed),
        ("refund_succeeded", report.refunds_settled),
        ("refund_failed", report.refunds_failed),
        ("capture_succeeded", report.captures_settled),
    ] {
        metrics::counter!("sweeper_settled_total", "outcome" => outcome).increment(n);
    }
    metrics::counter!("sweeper_authorizations_expired_total")
        .increment(report.authorizations_expired);
    metrics::counter!("sweeper_keys_deleted_total").increment(report.keys_deleted);
    metrics::counter!("sweeper_leased_total").increment(report.leased);
}
