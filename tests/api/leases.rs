//! A recovery's hold on the stale keys it leased: renewed just before each
//! record is recovered, given up when lost or out of the pass's budget, so
//! no record is ever driven by two recoveries at once; given back when the
//! recovery fails, so a gateway outage longer than `PROCESSING_TIMEOUT`
//! holds a key no longer than the outage. And a `Prefer: wait` that
//! outlasts `REQUEST_TIMEOUT` still ends in its own `409`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use oncepay::processor::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
};
use oncepay_core::sweeper::Sweeper;
use serde_json::json;

use crate::capture::{authorized_charge, post_capture};
use crate::helpers::{Answer, Settings, TestApp, spawn_app_with, spawn_app_with_processor, visa};

/// The simulated processor, with refunds that take `delay` and are counted
/// per refund processor key.
struct SlowRefunds {
    inner: Arc<dyn Processor>,
    delay: Duration,
    calls: Mutex<HashMap<String, usize>>,
}

#[async_trait]
impl Processor for SlowRefunds {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        self.inner.authorize(request).await
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        self.inner.void_unless_recorded(processor_key).await
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        self.inner.capture(request).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(request.processor_key.to_owned())
            .or_default() += 1;
        tokio::time::sleep(self.delay).await;
        self.inner.refund(request).await
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        self.inner.payment(processor_key).await
    }
}

/// `n` refunds of `charge` left pending by a crash, their keys stale.
async fn stale_refunds(app: &TestApp, charge: &str, n: usize) {
    for i in 0..n {
        let id = format!("re_staleleasedrefund{i:07}");
        let mut tx = app.pool.begin().await.unwrap();
        sqlx::query("UPDATE charges SET amount_refunded = amount_refunded + 100 WHERE id = $1")
            .bind(charge)
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO refunds (id, merchant_id, charge_id, amount, currency, status, created_at)
             VALUES ($1, $2, $3, 100, 'usd', 'pending', now() - interval '1 minute')",
        )
        .bind(&id)
        .bind(app.merchant_id)
        .bind(charge)
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path,
                 fingerprint, refund_id, created_at, locked_at, expires_at)
             VALUES ($1, $2, 'processing', 'POST', '/v1/refunds', sha256('x'), $3,
                     now() - interval '1 minute', now() - interval '1 minute',
                     now() + interval '1 day')",
        )
        .bind(app.merchant_id)
        .bind(format!("stale-refund-{i}"))
        .bind(&id)
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
}

#[tokio::test]
async fn leases_a_sweep_pass_did_not_reach_are_given_back_stale_at_once() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1s")).await;
    let charge = app.paid_charge(3000).await;
    stale_refunds(&app, &charge, 4).await;
    // Each refund takes 0.7 s and a pass takes on none past half the
    // timeout: it reaches one.
    let processor = Arc::new(SlowRefunds {
        inner: app.working_processor.clone(),
        delay: Duration::from_millis(700),
        calls: Mutex::default(),
    });
    let sweeper = Sweeper::new(app.pool.clone(), processor, app.config.sweep_settings());
    let pass = sweeper.sweep_once().await.unwrap();
    assert_eq!((pass.leased, pass.leases_given_up), (4, 3), "{pass:?}");

    // The three it gave back are stale now, for the next pass or a retry,
    // not a whole timeout after their lease.
    let stale = app
        .count(
            "SELECT count(*) FROM idempotency_keys
              WHERE status = 'processing' AND locked_at <= now() - interval '1 second'",
        )
        .await;
    assert_eq!(stale, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_lease_lapsed_mid_batch_is_recovered_by_one_sweeper_only() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1s")).await;
    let charge = app.paid_charge(3000).await;
    stale_refunds(&app, &charge, 4).await;
    let processor = Arc::new(SlowRefunds {
        inner: app.working_processor.clone(),
        delay: Duration::from_millis(700),
        calls: Mutex::default(),
    });
    let settings = app.config.sweep_settings();
    let first = Sweeper::new(app.pool.clone(), processor.clone(), settings);
    let second = Sweeper::new(app.pool.clone(), processor.clone(), settings);
    // The first takes all four; each refund takes 0.7 s, so the keys it has
    // not reached go stale again while it works, and the second sweeper,
    // starting 1.2 s later, leases them.
    let (a, b) = tokio::join!(first.sweep_once(), async {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        second.sweep_once().await
    });
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.leased, 4, "{a:?}");
    {
        let calls = processor.calls.lock().unwrap();
        assert!(
            calls.values().all(|&n| n == 1),
            "no refund was driven by both sweepers: {calls:?} {a:?} {b:?}"
        );
    }
    assert!(
        a.leases_given_up > 0,
        "the first gave up what it could not reach: {a:?}"
    );

    // Whatever is left is finished by later passes, each refund once.
    let deadline = Instant::now() + Duration::from_secs(20);
    while app
        .count("SELECT count(*) FROM refunds WHERE status = 'pending'")
        .await
        > 0
    {
        assert!(Instant::now() < deadline, "refunds still pending");
        tokio::time::sleep(Duration::from_millis(1100)).await;
        first.sweep_once().await.unwrap();
    }
    let calls = processor.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert!(calls.values().all(|&n| n == 1), "{calls:?}");
    assert_eq!(app.processor_refunds().await, 4);
    assert_eq!(app.amount_refunded(&charge).await, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_longer_than_the_request_timeout_ends_in_409_not_a_timeout() {
    let settings = Settings::new()
        .set("PROCESSING_TIMEOUT", "4s")
        .set("REQUEST_TIMEOUT", "1500ms");
    // A processor slower than REQUEST_TIMEOUT, which oncepay's own
    // PROCESSOR_LATENCY_MS may not be: the gateway's alone.
    let app = spawn_app_with(settings.processor("PROCESSOR_LATENCY_MS", 3000)).await;
    let body = visa(2000);
    let holder = app.post_charge(Some("slow"), &body);
    let waiter = async {
        let deadline = Instant::now() + Duration::from_secs(5);
        while app
            .count("SELECT count(*) FROM idempotency_keys WHERE key = 'slow' AND status = 'processing'")
            .await
            == 0
        {
            assert!(Instant::now() < deadline, "never claimed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let started = Instant::now();
        let response = app
            .client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "slow")
            .header("Prefer", "wait=10")
            .json(&visa(2000))
            .send()
            .await
            .unwrap();
        (Answer::of(response).await, started.elapsed())
    };
    let (holder, (waiter, took)) = tokio::join!(holder, waiter);
    // The holder outlives REQUEST_TIMEOUT too; its work goes on in its task.
    Answer::of(holder)
        .await
        .assert_problem(503, "request_timeout");
    waiter.assert_problem(409, "idempotency_key_in_use");
    assert_eq!(waiter.header("retry-after"), Some("1"));
    assert!(
        took < Duration::from_millis(1500),
        "answered after {took:?}"
    );

    let deadline = Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let retry = Answer::of(app.post_charge(Some("slow"), &body).await).await;
        if retry.status != 409 {
            break retry;
        }
        assert!(Instant::now() < deadline, "the charge never completed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
}

/// The link between oncepay and the gateway, cut and healed by a test.
#[derive(Default)]
struct Link {
    cut: AtomicBool,
    /// Calls that did not get through while it was cut.
    refused: AtomicUsize,
}

impl Link {
    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// `Unavailable`, counted, while the link is cut.
    fn check(&self) -> Result<(), ProcessorError> {
        if self.cut.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(ProcessorError::Unavailable);
        }
        Ok(())
    }
}

/// The gateway behind a [`Link`]. While it is cut, no call gets through (a
/// connection that cannot be made: `Unavailable`), but an authorization
/// already on its way: it is recorded, and its answer is lost.
struct Partitioned {
    inner: Arc<dyn Processor>,
    link: Arc<Link>,
}

#[async_trait]
impl Processor for Partitioned {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        let outcome = self.inner.authorize(request).await?;
        match self.link.check() {
            Ok(()) => Ok(outcome),
            Err(_) => Err(ProcessorError::OutcomeUnknown(anyhow::anyhow!(
                "the answer was lost in the partition"
            ))),
        }
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        self.link.check()?;
        self.inner.void_unless_recorded(processor_key).await
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        self.link.check()?;
        self.inner.capture(request).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        self.link.check()?;
        self.inner.refund(request).await
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        self.link.check()?;
        self.inner.payment(processor_key).await
    }
}

/// An app whose gateway sits behind `link`, with `settings`.
async fn behind(link: &Arc<Link>, settings: Settings) -> TestApp {
    let link = link.clone();
    spawn_app_with_processor(settings, move |_, http| {
        Arc::new(Partitioned { inner: http, link })
    })
    .await
}

/// `PROCESSING_TIMEOUT` a dozen sweeps long, so that a key held for another
/// timeout is told apart from one recovered at the next pass.
const PROCESSING_TIMEOUT: Duration = Duration::from_secs(3);
const SWEEP_INTERVAL: Duration = Duration::from_millis(250);
/// What a loaded machine may add to the pass that settles.
const SLACK: Duration = Duration::from_secs(1);

fn outage_timing() -> Settings {
    Settings::new()
        .set(
            "PROCESSING_TIMEOUT",
            format!("{}ms", PROCESSING_TIMEOUT.as_millis()),
        )
        .set(
            "SWEEP_INTERVAL",
            format!("{}ms", SWEEP_INTERVAL.as_millis()),
        )
}

/// Keeps `link` cut past `PROCESSING_TIMEOUT` since `cut_at`, until a
/// recovery has tried the key and failed at the gateway; then heals it and
/// returns how long `settled` (a count on the app's database) took to
/// reach one.
async fn outage_then_heal(app: &TestApp, link: &Link, cut_at: Instant, settled: &str) -> Duration {
    tokio::time::sleep_until((cut_at + PROCESSING_TIMEOUT).into()).await;
    let refused = link.refused();
    let deadline = Instant::now() + PROCESSING_TIMEOUT * 3;
    while link.refused() == refused {
        assert!(Instant::now() < deadline, "no recovery tried the key");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(app.count(settled).await, 0, "settled during the outage");
    link.heal();
    let healed = Instant::now();
    while app.count(settled).await == 0 {
        assert!(healed.elapsed() < PROCESSING_TIMEOUT * 3, "never settled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = healed.elapsed();
    eprintln!("outage {:?}, heal to settle {took:?}", healed - cut_at);
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_stuck_by_a_gateway_outage_longer_than_the_timeout_settles_within_a_sweep_of_the_heal()
 {
    let link = Arc::new(Link::default());
    let app = behind(&link, outage_timing()).await;
    let id = authorized_charge(&app, 2000).await;

    link.cut();
    let cut_at = Instant::now();
    let first = Answer::of(post_capture(&app, &id, Some("K"), &json!({})).await).await;
    first.assert_problem(503, "processor_unavailable");
    // The sweeper finds the key stale, leases it and fails at the gateway.
    let settled = "SELECT count(*) FROM idempotency_keys k JOIN charges c ON c.id = k.capture_of
                    WHERE k.key = 'K' AND k.status = 'completed' AND c.captured_at IS NOT NULL";
    let took = outage_then_heal(&app, &link, cut_at, settled).await;
    assert!(
        took < SWEEP_INTERVAL + SLACK,
        "settled {took:?} after the heal, not at the next sweep pass"
    );

    let retry = Answer::of(post_capture(&app, &id, Some("K"), &json!({})).await).await;
    assert_eq!(retry.status, 200, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.json()["amount_captured"], 2000);
    let captures = "SELECT count(*) FROM operations WHERE kind = 'capture'";
    assert_eq!(app.processor_count(captures).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_whose_answer_an_outage_longer_than_the_timeout_lost_settles_within_a_sweep_of_the_heal()
 {
    let link = Arc::new(Link::default());
    let app = behind(&link, outage_timing()).await;

    link.cut();
    let cut_at = Instant::now();
    let first = Answer::of(app.post_charge(Some("K"), &visa(2000)).await).await;
    first.assert_problem(503, "processing_outcome_unknown");
    let settled = "SELECT count(*) FROM idempotency_keys k JOIN charges c ON c.id = k.charge_id
                    WHERE k.key = 'K' AND k.status = 'completed' AND c.status = 'succeeded'";
    let took = outage_then_heal(&app, &link, cut_at, settled).await;
    assert!(
        took < SWEEP_INTERVAL + SLACK,
        "settled {took:?} after the heal, not at the next sweep pass"
    );

    let retry = Answer::of(app.post_charge(Some("K"), &visa(2000)).await).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!((app.charges().await, app.payments().await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_recovery_failed_in_an_outage_gives_the_key_back_and_the_next_retry_recovers_it()
 {
    let link = Arc::new(Link::default());
    // No sweeper here (the tests' SWEEP_INTERVAL is an hour): only retries.
    let timeout = format!("{}ms", PROCESSING_TIMEOUT.as_millis());
    let app = behind(&link, Settings::new().set("PROCESSING_TIMEOUT", timeout)).await;
    let id = authorized_charge(&app, 2000).await;
    let capture =
        || async { Answer::of(post_capture(&app, &id, Some("K"), &json!({})).await).await };

    link.cut();
    capture().await.assert_problem(503, "processor_unavailable");
    tokio::time::sleep(PROCESSING_TIMEOUT + Duration::from_millis(200)).await;
    // The retry leases the stale key and fails at the gateway: it gives the
    // lease back, so the key is stale again at once, and says so.
    let refused = link.refused();
    let failed = capture().await;
    failed.assert_problem(503, "processor_unavailable");
    assert!(link.refused() > refused, "the retry tried to recover");
    assert_eq!(failed.header("retry-after"), Some("1"));
    let stale = format!(
        "SELECT count(*) FROM idempotency_keys
          WHERE key = 'K' AND idempotency_key_stale(status, locked_at, {})",
        PROCESSING_TIMEOUT.as_millis()
    );
    assert_eq!(app.count(&stale).await, 1, "the key is stale again");

    link.heal();
    let healed = Instant::now();
    let retry = capture().await;
    eprintln!("heal to the retry's answer {:?}", healed.elapsed());
    assert_eq!(retry.status, 200, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.json()["amount_captured"], 2000);
    let captured =
        format!("SELECT count(*) FROM charges WHERE id = '{id}' AND captured_at IS NOT NULL");
    assert_eq!(app.count(&captured).await, 1);
    let captures = "SELECT count(*) FROM operations WHERE kind = 'capture'";
    assert_eq!(app.processor_count(captures).await, 1);
}
