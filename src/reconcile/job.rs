//! The periodic reconciliation inside `serve`: every `RECONCILE_INTERVAL`
//! each instance tries the job's advisory lock ([`store::try_lock`]); the
//! one that takes it runs unless a run began within the interval (so the
//! fleet reconciles about once per interval, whichever instance it falls
//! to), records the run in `reconcile_runs`, and lets the lock go. The job
//! reports; it never refunds (that is `oncepay reconcile --fix`, run by a
//! person).
//!
//! The lock is held on a connection of its own, taken out of the pool and
//! closed afterwards: if the process dies mid-run, Postgres lets the lock go
//! with the session. No transaction stays open across the processor calls.

use std::time::Duration;

use chrono::Utc;
use sqlx::{Connection, PgConnection, PgPool};

use super::{Kind, Reconciler, Reconciliation, Window, store};

/// What one tick of the job came to.
#[derive(Debug)]
pub enum JobRun {
    /// This instance reconciled.
    Ran(Reconciliation),
    /// Another instance holds the lock: it is reconciling now.
    Busy,
    /// A run began within the interval.
    NotDue,
}

/// The periodic job.
#[derive(Clone)]
pub struct ReconcileJob {
    pool: PgPool,
    reconciler: Reconciler,
    interval: Duration,
    window: Duration,
}

impl ReconcileJob {
    /// Reconciles the last `window` about once per `interval`.
    pub fn new(pool: PgPool, reconciler: Reconciler, interval: Duration, window: Duration) -> Self {
        ReconcileJob {
            pool,
            reconciler,
            interval,
            window,
        }
    }

    /// Runs once if this instance takes the lock and a run is due.
    pub async fn run_if_due(&self) -> anyhow::Result<JobRun> {
        let mut conn = self.pool.acquire().await?.detach();
        let outcome = self.locked(&mut conn).await;
        // Closing the session lets the lock go whatever happened above.
        let _ = conn.close().await;
        outcome
    }

    async fn locked(&self, conn: &mut PgConnection) -> anyhow::Result<JobRun> {
        if !store::try_lock(conn).await? {
            return Ok(JobRun::Busy);
        }
        let outcome = self.run_locked(conn).await;
        let _ = store::unlock(conn).await;
        outcome
    }

    async fn run_locked(&self, conn: &mut PgConnection) -> anyhow::Result<JobRun> {
        // A tick comes a little early or late: a run begun within nine
        // tenths of the interval counts as this interval's.
        if !store::due(&mut *conn, self.interval.mul_f64(0.9)).await? {
            return Ok(JobRun::NotDue);
        }
        let started_at = Utc::now();
        let window = Window::last(self.window, started_at)?;
        let reconciliation = self.reconciler.run(window, false).await?;
        let by_kind: serde_json::Map<String, serde_json::Value> = reconciliation
            .by_kind()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| (k.as_str().to_owned(), n.into()))
            .collect();
        store::record_run(
            &mut *conn,
            &store::Run {
                started_at,
                window_from: window.since,
                window_until: window.until,
                differences: reconciliation.differences.len() as i32,
                by_kind: &serde_json::Value::Object(by_kind),
            },
        )
        .await?;
        Ok(JobRun::Ran(reconciliation))
    }

    /// Ticks every interval until `shutdown` resolves; the first tick comes
    /// one interval after start. A failed run is logged and counted.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + self.interval, self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = ticker.tick() => self.tick().await,
            }
        }
    }

    /// One tick, with its metrics and log.
    pub async fn tick(&self) {
        match self.run_if_due().await {
            Ok(JobRun::Ran(reconciliation)) => {
                let result = if reconciliation.differences.is_empty() {
                    "clean"
                } else {
                    "differences"
                };
                metrics::counter!("reconcile_runs_total", "result" => result).increment(1);
                for (kind, n) in reconciliation.by_kind() {
                    metrics::gauge!("reconcile_differences", "kind" => kind.as_str()).set(n as f64);
                }
                metrics::gauge!("reconcile_last_run_timestamp_seconds")
                    .set(Utc::now().timestamp() as f64);
                if reconciliation.differences.is_empty() {
                    tracing::info!(
                        since = %reconciliation.since,
                        until = %reconciliation.until,
                        charges = reconciliation.checked.charges,
                        refunds = reconciliation.checked.refunds,
                        in_flight = reconciliation.in_flight,
                        "reconciliation: no differences"
                    );
                }
                for d in &reconciliation.differences {
                    tracing::error!(kind = d.kind.as_str(), key = %d.key, detail = %d.detail, "reconciliation difference");
                }
            }
            Ok(JobRun::Busy | JobRun::NotDue) => {}
            Err(e) => {
                metrics::counter!("reconcile_runs_total", "result" => "failed").increment(1);
                tracing::warn!(error = format!("{e:#}"), "reconciliation run failed");
            }
        }
    }
}

/// Registers the job's metrics at 0, so a dashboard sees them before a run.
pub fn describe_metrics() {
    metrics::counter!("reconcile_runs_total", "result" => "clean").increment(0);
    for kind in Kind::ALL {
        metrics::gauge!("reconcile_differences", "kind" => kind.as_str()).set(0.0);
    }
}
