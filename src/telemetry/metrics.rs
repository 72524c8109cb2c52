//! Prometheus metrics, served at `GET /metrics`.
//!
//! | metric | labels |
//! | --- | --- |
//! | `http_requests_total`, `http_request_duration_seconds` | `method` (a standard method or `other`), `route` (a template or `unmatched`), `status` |
//! | `http_connections_open`, `http_connections_shed_total` (`reason`: `evicted`, `refused`) | see `crate::http::server` |
//! | `rate_limited_total` (requests answered `429 rate_limit`), `rate_limit_merchants_tracked` (merchants whose allowance is held) | `kind`: `read`, `write`; see `crate::rate_limit` |
//! | `idempotency_outcomes_total` | `outcome`: `executed`, `replayed`, `in_use`, `reused`, `expired_taken_over`, `stale_recovered` |
//! | `requests_shed_total` (guarded operations answered `503 overloaded` before any work, see `crate::speed::admission`) | `route` (a guarded operation's route template) |
//! | `operation_duration_seconds` (a guarded request from its arrival to its rendered answer, in the handler) | `route` (a guarded operation's route template), `outcome`: `executed`, `replayed`, `in_use`, `reused`, `shed`, `error` |
//! | `operation_phase_duration_seconds` (each phase of it, see `oncepay_core::operation::timing`; none for a replay from the cache) | `route`, `phase`: `extract`, `fingerprint`, `task_handoff`, `pool_wait`, `key_wait`, `claim`, `processor`, `settle_pool_wait`, `settle`, `write`, `render`; `outcome` |
//! | `idempotency_waiters` (requests waiting on a key in flight), `idempotency_wait_polls_total` (reads their shared waits ran) | |
//! | `idempotency_key_reads_per_batch`, `idempotency_key_read_batch_duration_seconds` (the coalesced reads of keys that missed the replay cache, see `crate::speed::reads`) | |
//! | `processor_calls_total`, `processor_call_duration_seconds` | `call` (`authorize`, `void`, `refund`, `lookup`), `outcome` |
//! | `sweeper_runs_total`, `sweeper_settled_total` (`outcome`), `sweeper_keys_deleted_total`, `sweeper_leased_total` | |
//! | `reconcile_runs_total` (`result`), `reconcile_differences` (`kind`), `reconcile_last_run_timestamp_seconds` | see `crate::reconcile::job` |
//! | `db_pool_connections` (`state`: `idle`, `in_use`), `db_pool_max_connections`, `db_pool_timeouts_total` | |
//! | `db_primary_known` (1 while a writable host is known), `db_primary_retargets_total`, with several database hosts only | `pool`: `oncepay`, `oncepay-processor`; see `pg_follow::follow` |
//! | `broker_consumer_messages_total` (each message the ledger consumer handled, in the process that ran it) | `consumer`, `outcome`: `booked`, `ignored`, `duplicate`, `parked`; see `crate::broker::ledger` |
//! | `webhook_attempts_total` (`result`), `webhook_attempt_duration_seconds`, `webhook_deliveries_total` (`outcome`, `reason`), `webhook_oldest_pending_event_age_seconds`, `webhook_endpoints_disabled_total`, `webhook_leases_lost_total` | see `docs/webhooks.md` |
//! | `broker_relay_lag_seconds`, `broker_relay_held_back_seconds`, `broker_relay_published_total`; `broker_consumer_pending_messages`, `broker_consumer_ack_pending_messages` (`consumer`), `broker_parked_messages` (`consumer`, `reason`) | `stream`; set by the relay holding the lock, see `crate::broker::watch` |

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use async_trait::async_trait;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

use crate::processor::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
};

/// The process-wide recorder (one per process, however many apps it runs).
/// The handle that renders the metrics, kept in [`crate::app::AppState`].
pub type Metrics = PrometheusHandle;

pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ];
            // A guarded operation's phases are mostly under a millisecond:
            // finer buckets there.
            let operation_buckets = [
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0,
            ];
            let builder = PrometheusBuilder::new()
                .set_buckets(&buckets)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Prefix("operation_".into()),
                        &operation_buckets,
                    )
                })
                .expect("non-empty buckets");
            match builder.install_recorder() {
                Ok(handle) => {
                    // Present from the start, so a dashboard sees 0, not nothing.
                    metrics::counter!("db_pool_timeouts_total").increment(0);
                    metrics::counter!("idempotency_wait_polls_total").increment(0);
                    for kind in ["read", "write"] {
                        metrics::counter!("rate_limited_total", "kind" => kind).increment(0);
                    }
                    metrics::gauge!("idempotency_waiters").set(0.0);
                    metrics::gauge!("webhook_oldest_pending_event_age_seconds").set(0.0);
                    handle
                }
                // Another recorder is installed (an embedding program): keep
                // a private one so /metrics still answers.
                Err(_) => PrometheusBuilder::new().build_recorder().handle(),
            }
        })
        .clone()
}

/// How often [`upkeep`] drains the recorder.
pub const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Drains the recorder's histogram samples into their buckets every
/// [`UPKEEP_INTERVAL`] until `stop` resolves. The recorder keeps each sample
/// it is given until something drains it; a scrape of `/metrics` does, but
/// with nobody scraping, every request's samples would be kept for good and
/// memory would grow with the number of requests served.
pub async fn upkeep(handle: PrometheusHandle, stop: impl std::future::Future<Output = ()>) {
    let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = tick.tick() => handle.run_upkeep(),
            () = &mut stop => return,
        }
    }
}

/// Renders every metric, after sampling the pool's gauges.
pub fn render(handle: &PrometheusHandle, pool: &PgPool) -> String {
    let size = pool.size() as f64;
    let idle = pool.num_idle() as f64;
    metrics::gauge!("db_pool_connections", "state" => "idle").set(idle);
    metrics::gauge!("db_pool_connections", "state" => "in_use").set(size - idle);
    metrics::gauge!("db_pool_max_connections").set(pool.options().get_max_connections() as f64);
    handle.render()
}

/// A processor that measures every call of the one it wraps.
pub struct MeteredProcessor {
    inner: Arc<dyn Processor>,
}

impl MeteredProcessor {
    pub fn wrap(inner: Arc<dyn Processor>) -> Arc<dyn Processor> {
        Arc::new(MeteredProcessor { inner })
    }
}

fn record<T>(
    call: &'static str,
    started: Instant,
    result: &Result<T, ProcessorError>,
    ok: &'static str,
) {
    let outcome = match result {
        Ok(_) => ok,
        Err(ProcessorError::Unavailable) => "unavailable",
        Err(ProcessorError::OutcomeUnknown(_)) => "unknown",
    };
    metrics::counter!("processor_calls_total", "call" => call, "outcome" => outcome).increment(1);
    metrics::histogram!("processor_call_duration_seconds", "call" => call, "outcome" => outcome)
        .record(started.elapsed().as_secs_f64());
}

fn outcome_label(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Succeeded => "succeeded",
        Outcome::Declined { .. } => "declined",
        Outcome::Voided => "voided",
    }
}

#[async_trait]
impl Processor for MeteredProcessor {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        let started = Instant::now();
        let result = self.inner.authorize(request).await;
        let ok = result.as_ref().map_or("error", outcome_label);
        record("authorize", started, &result, ok);
        result
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        let started = Instant::now();
        let result = self.inner.void_unless_recorded(processor_key).await;
        let ok = result.as_ref().map_or("error", outcome_label);
        record("void", started, &result, ok);
        result
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        let started = Instant::now();
        let result = self.inner.capture(request).await;
        record("capture", started, &result, "captured");
        result
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        let started = Instant::now();
        let result = self.inner.refund(request).await;
        let ok = match &result {
            Ok(RefundOutcome::Refunded) => "refunded",
            Ok(RefundOutcome::Failed { .. }) => "refund_failed",
            Err(_) => "error",
        };
        record("refund", started, &result, ok);
        result
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        let started = Instant::now();
        let result = self.inner.payment(processor_key).await;
        let ok = match &result {
            Ok(Some(payment)) => outcome_label(&payment.outcome),
            Ok(None) => "none",
            Err(_) => "error",
        };
        record("lookup", started, &result, ok);
        result
    }

    async fn ready(&self) -> anyhow::Result<()> {
        self.inner.ready().await
    }
}
