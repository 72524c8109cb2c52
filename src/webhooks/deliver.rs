//! The delivery worker, in every `serve` process beside the sweeper: claims
//! due deliveries ([`store::claim_due`], `FOR UPDATE SKIP LOCKED`), sends
//! each event, signed, to its endpoint, and records every attempt.
//!
//! Sends flow: the worker keeps up to `WEBHOOK_CONCURRENCY` of them in
//! flight and claims more as soon as one ends, so a slow receiver holds one
//! place, not a batch. The claim passes over the deliveries of an endpoint
//! or a merchant that already has its bound in flight (counted over every
//! instance), so one merchant's hanging endpoints cannot hold every place.
//!
//! Delivery is at least once. The receiver's `2xx` and the worker's record
//! of it are two systems' writes, and no transaction spans both: a worker
//! that dies between them leaves the delivery claimed but unrecorded, and
//! it is sent again once its lease runs out. Receivers therefore
//! deduplicate by the event's `id` (an inbox); what the worker guarantees
//! is that nothing committed is lost, and that no two workers send one
//! attempt.
//!
//! With the address guard on (see [`super::guard`]), every attempt checks
//! where it goes: an address in the URL before sending, a name as the
//! client resolves it, connecting only to the addresses checked. A refused
//! attempt sends nothing and is recorded, and retried, like any failure.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use reqwest::header::{CONTENT_TYPE, HeaderValue, USER_AGENT};
use sqlx::PgPool;
use tokio::task::JoinSet;

use super::domain::{DeliveryEnd, EndpointStatus};
use super::guard::{AddressGuard, GuardedResolver, Refused};
use super::signature;
use super::store::{self, Claimed, Finished, InFlightBounds, Next};
use crate::config::Config;
use oncepay_core::faults::{Fault, crash_if};

/// The most bytes of a receiver's answer read: its status is what counts.
pub const MAX_RESPONSE_BYTES: usize = 4096;
/// The longest the worker reads a receiver's answer after its status, within
/// the attempt's timeout. Reading is a courtesy (it lets the connection be
/// used again); a body that stalls, ends early or is malformed changes
/// nothing.
pub const RESPONSE_BODY_WAIT: Duration = Duration::from_secs(1);
/// How long a claim holds a delivery beyond the attempt's own timeout and
/// the wait for a connection to record it, for the recording statement.
const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// How the worker delivers, from the `WEBHOOK_*` settings.
#[derive(Clone, Copy, Debug)]
pub struct DeliverySettings {
    /// The longest one attempt may take, connecting and answering included.
    pub timeout: Duration,
    /// Attempts per delivery, the first included.
    pub max_attempts: i32,
    /// The wait after the first failed attempt; it doubles after each.
    pub retry_base: Duration,
    /// The longest wait between two attempts.
    pub retry_max: Duration,
    /// An endpoint that fails every delivery for this long is disabled.
    pub disable_after: Duration,
    /// How often an idle worker looks for due deliveries.
    pub poll_interval: Duration,
    /// The longest a record waits for a database connection
    /// (`DATABASE_ACQUIRE_TIMEOUT`): part of the lease.
    pub acquire_timeout: Duration,
    /// Honour `Oncepay-Fault` in a receiver's answer (tests and workshops).
    pub fault_injection: bool,
    /// Attempts this process makes at once (`WEBHOOK_CONCURRENCY`).
    pub concurrency: usize,
    /// Attempts in flight at once to one endpoint and to one merchant's
    /// endpoints, over every instance.
    pub bounds: InFlightBounds,
    /// Whether internal addresses are refused (`WEBHOOK_ALLOW_PRIVATE`).
    pub guard: AddressGuard,
}

impl DeliverySettings {
    pub fn from_config(config: &Config) -> Self {
        DeliverySettings {
            timeout: config.webhooks.timeout,
            max_attempts: config.webhooks.max_attempts,
            retry_base: config.webhooks.retry_base,
            retry_max: config.webhooks.retry_max,
            disable_after: config.webhooks.disable_after,
            poll_interval: config.webhooks.poll_interval,
            acquire_timeout: config.database.acquire_timeout,
            fault_injection: config.workshop.fault_injection,
            concurrency: usize::try_from(config.webhooks.concurrency)
                .unwrap_or(1)
                .max(1),
            bounds: InFlightBounds {
                per_endpoint: config.webhooks.endpoint_concurrency,
                per_merchant: config.webhooks.merchant_concurrency,
            },
            guard: AddressGuard::new(config.webhooks.allow_private),
        }
    }

    /// How long a claim holds a delivery: past the attempt's timeout and
    /// the wait for a connection to record it, so a live worker is not
    /// overtaken (one that is records nothing but its attempt), and short,
    /// so a dead one's delivery is soon due again.
    pub fn lease(&self) -> Duration {
        self.timeout + self.acquire_timeout + LEASE_MARGIN
    }

    /// The longest a failing endpoint can go between two failures while
    /// still failing every delivery: the longest wait between attempts,
    /// plus a lease. A failure after a longer quiet begins a new run.
    pub fn failure_run_gap(&self) -> Duration {
        self.retry_max + self.lease()
    }
}

/// The wait before the attempt after failed attempt `attempt` (1 for the
/// first): `retry_base` doubled for each attempt before it, at most
/// `retry_max`, then jittered to between half and all of that (`jitter` in
/// `[0, 1)`), so receivers that failed together are not retried together.
pub fn retry_delay(settings: &DeliverySettings, attempt: i32, jitter: f64) -> Duration {
    let doublings = u32::try_from(attempt.saturating_sub(1))
        .unwrap_or(0)
        .min(30);
    let full = settings
        .retry_base
        .saturating_mul(1 << doublings)
        .min(settings.retry_max);
    full.mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
}

/// What one attempt came to.
#[derive(Debug)]
struct Sent {
    status: Option<u16>,
    error: Option<String>,
    /// The fault the receiver's answer asked for (`Oncepay-Fault:
    /// crash-after-delivery`), honoured only with fault injection on.
    fault: Option<Fault>,
    /// The address guard refused the attempt: nothing was sent.
    refused: Option<Refused>,
}

impl Sent {
    fn refused(refused: Refused) -> Self {
        Sent {
            status: None,
            error: Some(refused.to_string()),
            fault: None,
            refused: Some(refused),
        }
    }
}

/// The worker of one process.
pub struct Worker {
    pool: PgPool,
    client: reqwest::Client,
    settings: DeliverySettings,
}

impl Worker {
    pub fn new(pool: PgPool, settings: DeliverySettings) -> anyhow::Result<Self> {
        let mut client = reqwest::Client::builder()
            // A redirect is an answer that is not 2xx, as Stripe treats it.
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(settings.timeout)
            .timeout(settings.timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(4);
        if settings.guard.is_on() {
            // Names resolve through the guard, and the connection goes to
            // the addresses it passed. No proxy: a proxy would resolve the
            // name itself, out of the guard's sight.
            client = client.dns_resolver(Arc::new(GuardedResolver)).no_proxy();
        }
        let client = client
            .build()
            .map_err(|e| anyhow::anyhow!(e).context("building the webhook HTTP client"))?;
        Ok(Worker {
            pool,
            client,
            settings,
        })
    }

    /// Delivers until `stop` resolves, then lets the sends in flight end.
    ///
    /// Up to `concurrency` sends run at once. Whenever a place is free the
    /// worker claims due deliveries for the free places; a claim that took
    /// some is followed at once by another (more may be due), one that took
    /// none by rest until `poll_interval` passes or a send ends (which may
    /// bring an endpoint or a merchant back under its bound).
    pub async fn run(self, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let mut sends = JoinSet::new();
        let mut gauged: Option<Instant> = None;
        loop {
            if gauged.is_none_or(|at| at.elapsed() >= self.settings.poll_interval) {
                self.gauge_oldest_pending().await;
                gauged = Some(Instant::now());
            }
            let free = self.settings.concurrency.saturating_sub(sends.len());
            let mut took = 0;
            if free > 0 {
                match self.claim(free).await {
                    Ok(claimed) => {
                        took = claimed.len();
                        self.spawn_all(&mut sends, claimed);
                    }
                    Err(e) => {
                        tracing::warn!(
                            error = format!("{e:#}"),
                            "claiming webhook deliveries failed"
                        );
                    }
                }
            }
            let full = sends.len() >= self.settings.concurrency;
            if took > 0 && !full {
                // More may be due at once; but a stop comes first.
                tokio::select! {
                    biased;
                    () = &mut stop => break,
                    () = std::future::ready(()) => continue,
                }
            }
            tokio::select! {
                () = &mut stop => break,
                Some(done) = sends.join_next(), if !sends.is_empty() => report(done),
                () = tokio::time::sleep(self.settings.poll_interval), if !full => {}
            }
        }
        // An attempt cut short would be sent again after its lease; let the
        // ones in flight end (startup bounds this by SHUTDOWN_GRACE).
        while let Some(done) = sends.join_next().await {
            report(done);
        }
    }

    /// One pass: claims what is due, up to `concurrency`, sends it all,
    /// records each attempt, and returns how many deliveries it claimed.
    pub async fn pass(&self) -> anyhow::Result<usize> {
        self.gauge_oldest_pending().await;
        let claimed = self.claim(self.settings.concurrency).await?;
        let count = claimed.len();
        let mut sends = JoinSet::new();
        self.spawn_all(&mut sends, claimed);
        while let Some(done) = sends.join_next().await {
            report(done);
        }
        Ok(count)
    }

    async fn claim(&self, places: usize) -> anyhow::Result<Vec<Claimed>> {
        let limit = i64::try_from(places).unwrap_or(i64::MAX);
        Ok(store::claim_due(
            &self.pool,
            limit,
            self.settings.lease(),
            self.settings.bounds,
        )
        .await?)
    }

    fn spawn_all(&self, sends: &mut JoinSet<anyhow::Result<()>>, claimed: Vec<Claimed>) {
        for delivery in claimed {
            let pool = self.pool.clone();
            let client = self.client.clone();
            let settings = self.settings;
            sends.spawn(async move { deliver(&pool, &client, &settings, delivery).await });
        }
    }

    async fn gauge_oldest_pending(&self) {
        match store::oldest_pending_age(&self.pool).await {
            Ok(age) => {
                metrics::gauge!("webhook_oldest_pending_event_age_seconds").set(age.unwrap_or(0.0));
            }
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "reading the oldest pending webhook failed"
            ),
        }
    }
}

/// Logs what went wrong with one send, if anything.
fn report(done: Result<anyhow::Result<()>, tokio::task::JoinError>) {
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(
            error = format!("{e:#}"),
            "recording a webhook attempt failed; the delivery is due again after its lease"
        ),
        Err(e) => tracing::error!(error = %e, "a webhook delivery task failed"),
    }
}

/// Sends one claimed delivery and records the attempt.
async fn deliver(
    pool: &PgPool,
    client: &reqwest::Client,
    settings: &DeliverySettings,
    claimed: Claimed,
) -> anyhow::Result<()> {
    // Nothing is sent to an endpoint deleted or disabled after the delivery
    // was written, nor past the last attempt (attempts cut short by crashes
    // count, so a receiver that crashes every sender cannot loop forever).
    let unsent = match claimed.endpoint_status {
        EndpointStatus::Deleted => Some(DeliveryEnd::EndpointDeleted),
        EndpointStatus::Disabled => Some(DeliveryEnd::EndpointDisabled),
        EndpointStatus::Enabled if claimed.attempt > settings.max_attempts => {
            Some(DeliveryEnd::AttemptsExhausted)
        }
        EndpointStatus::Enabled => None,
    };
    if let Some(end) = unsent {
        let reason = end.reason();
        if store::end_unsent(pool, claimed.delivery_id, claimed.attempt, reason).await? {
            end.count(1);
            tracing::info!(
                event = %claimed.event.id,
                endpoint = %claimed.endpoint_id,
                reason,
                "webhook delivery ended unsent"
            );
        }
        return Ok(());
    }
    let started_at = Utc::now();
    let started = Instant::now();
    let sent = send(client, settings, &claimed).await;
    let duration = started.elapsed();
    if settings.fault_injection {
        crash_if(sent.fault, Fault::CrashAfterDelivery);
    }
    let delivered = sent.status.is_some_and(|s| (200..300).contains(&s));
    let next = if delivered {
        Next::Delivered
    } else if claimed.attempt >= settings.max_attempts {
        Next::GiveUp
    } else {
        Next::RetryAfter(retry_delay(settings, claimed.attempt, rand::random()))
    };
    let result = match (&sent.status, &sent.error) {
        _ if sent.refused.is_some() => "refused",
        (Some(s), _) if (200..300).contains(s) => "delivered",
        (Some(_), _) => "http_error",
        (None, Some(e)) if e == "timeout" => "timeout",
        (None, Some(e)) if e.starts_with("connect") => "connect_error",
        (None, _) => "error",
    };
    metrics::counter!("webhook_attempts_total", "result" => result).increment(1);
    metrics::histogram!("webhook_attempt_duration_seconds").record(duration.as_secs_f64());
    let finished = Finished {
        delivery_id: claimed.delivery_id,
        attempt: claimed.attempt,
        started_at,
        duration,
        response_status: sent.status,
        error: sent.error.as_deref(),
        next,
    };
    let recorded = store::record(
        pool,
        &finished,
        settings.disable_after,
        settings.failure_run_gap(),
    )
    .await?;
    let span = tracing::info_span!(
        "webhook",
        event = %claimed.event.id,
        endpoint = %claimed.endpoint_id,
        attempt = claimed.attempt,
    );
    let _entered = span.enter();
    if let Some(refused) = sent.refused {
        tracing::warn!(
            network = ?refused.network(),
            "webhook attempt refused by the address guard; nothing was sent"
        );
    }
    if !recorded.held {
        metrics::counter!("webhook_leases_lost_total").increment(1);
        tracing::warn!(
            "the delivery was taken on again or ended while this attempt ran; only the attempt is recorded"
        );
        return Ok(());
    }
    match next {
        Next::Delivered => {
            DeliveryEnd::Delivered.count(1);
            tracing::info!(status = sent.status, ?duration, "webhook delivered");
        }
        Next::RetryAfter(after) => tracing::info!(
            status = sent.status,
            error = sent.error,
            retry_in = ?after,
            "webhook attempt failed; will retry"
        ),
        Next::GiveUp => {
            DeliveryEnd::AttemptsExhausted.count(1);
            tracing::warn!(
                status = sent.status,
                error = sent.error,
                "webhook delivery failed for good: attempts exhausted"
            );
        }
    }
    if let Some(endpoint) = recorded.disabled_endpoint {
        let ended = store::end_deliveries_of_disabled(pool, &endpoint).await?;
        metrics::counter!("webhook_endpoints_disabled_total").increment(1);
        DeliveryEnd::EndpointDisabled.count(ended);
        tracing::warn!(
            ended,
            "webhook endpoint disabled: it failed every delivery for WEBHOOK_DISABLE_AFTER"
        );
    }
    Ok(())
}

/// One attempt: the event as the API renders it, signed now, posted within
/// the timeout. The status decides: once it has come, at most
/// [`MAX_RESPONSE_BYTES`] of the body are read, for at most
/// [`RESPONSE_BODY_WAIT`] and never past the timeout, and whatever the
/// body does (stall, end early, break its framing) the status stands.
async fn send(client: &reqwest::Client, settings: &DeliverySettings, claimed: &Claimed) -> Sent {
    // An address in the URL is never looked up, so the resolver never sees
    // it: it is checked here.
    if let Err(refused) = settings.guard.check_literal(&claimed.url) {
        return Sent::refused(refused);
    }
    let payload = serde_json::to_vec(&claimed.event.to_object()).expect("an event serialises");
    let signed = signature::sign(&claimed.secret, Utc::now().timestamp(), &payload);
    let request = client
        .post(&claimed.url)
        .header(CONTENT_TYPE, "application/json; charset=utf-8")
        .header(USER_AGENT, concat!("oncepay/", env!("CARGO_PKG_VERSION")))
        .header(signature::HEADER, signed)
        .body(payload);
    let deadline = tokio::time::Instant::now() + settings.timeout;
    let mut response = match tokio::time::timeout_at(deadline, request.send()).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            if let Some(refused) = Refused::in_chain(&e) {
                return Sent::refused(refused);
            }
            return Sent {
                status: None,
                error: Some(describe(&e)),
                fault: None,
                refused: None,
            };
        }
        Err(_) => {
            return Sent {
                status: None,
                error: Some("timeout".to_owned()),
                fault: None,
                refused: None,
            };
        }
    };
    let status = response.status().as_u16();
    let fault = response
        .headers()
        .get(oncepay_core::faults::HEADER)
        .is_some_and(|v| v == HeaderValue::from_static("crash-after-delivery"))
        .then_some(Fault::CrashAfterDelivery);
    let read = async {
        let mut read = 0;
        while read < MAX_RESPONSE_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => read += chunk.len(),
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = describe(&e), "the answer's body broke off");
                    break;
                }
            }
        }
    };
    let body_deadline = deadline.min(tokio::time::Instant::now() + RESPONSE_BODY_WAIT);
    if tokio::time::timeout_at(body_deadline, read).await.is_err() {
        tracing::debug!("the answer's body stalled; its status stands");
    }
    Sent {
        status: Some(status),
        error: (!(200..300).contains(&status)).then(|| format!("HTTP {status}")),
        fault,
        refused: None,
    }
}

/// A few words on a failed attempt, without its URL (which may carry a
/// merchant's token in its query).
fn describe(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        return "timeout".to_owned();
    }
    let kind = if error.is_connect() {
        "connect"
    } else if error.is_body() || error.is_decode() {
        "reading the answer"
    } else {
        "request"
    };
    let mut source = std::error::Error::source(error);
    let mut detail = String::new();
    while let Some(inner) = source {
        detail = inner.to_string();
        source = inner.source();
    }
    if detail.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind}: {detail}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> DeliverySettings {
        DeliverySettings {
            timeout: Duration::from_secs(10),
            max_attempts: 16,
            retry_base: Duration::from_secs(60),
            retry_max: Duration::from_secs(8 * 3600),
            disable_after: Duration::from_secs(72 * 3600),
            poll_interval: Duration::from_secs(1),
            acquire_timeout: Duration::from_secs(5),
            fault_injection: false,
            concurrency: 32,
            bounds: InFlightBounds {
                per_endpoint: 4,
                per_merchant: 8,
            },
            guard: AddressGuard::new(false),
        }
    }

    #[test]
    fn retries_double_from_the_base_up_to_the_cap_and_jitter_keeps_at_least_half() {
        let s = settings();
        let secs = |attempt, jitter| retry_delay(&s, attempt, jitter).as_secs_f64();
        assert_eq!(secs(1, 0.999_999).round(), 60.0);
        assert_eq!(secs(1, 0.0), 30.0);
        assert_eq!(secs(2, 0.999_999).round(), 120.0);
        assert_eq!(secs(5, 0.999_999).round(), 960.0);
        // 60 s * 2^9 = 8.5 h: capped at 8 h from the tenth attempt on.
        assert_eq!(secs(10, 0.999_999).round(), 8.0 * 3600.0);
        assert_eq!(secs(15, 0.999_999).round(), 8.0 * 3600.0);
        assert_eq!(secs(i32::MAX, 0.5), 0.75 * 8.0 * 3600.0);
        for attempt in 1..=16 {
            let low = secs(attempt, 0.0);
            let high = secs(attempt, 0.999_999);
            assert!(low > 0.0 && (high / low - 2.0).abs() < 0.001, "{attempt}");
        }
    }

    #[test]
    fn the_lease_outlasts_an_attempt() {
        let s = settings();
        assert!(s.lease() > s.timeout);
    }
}
