//! A sweeper's hold on the stale keys it leased: renewed just before each
//! record is recovered, given up when lost or out of the pass's budget, so
//! no record is ever driven by two recoveries at once. And a `Prefer: wait`
//! that outlasts `REQUEST_TIMEOUT` still ends in its own `409`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use oncepay::processor::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
};
use oncepay_core::sweeper::Sweeper;

use crate::helpers::{Answer, Settings, TestApp, spawn_app_with, visa};

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
