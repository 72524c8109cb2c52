//! The background task: stale charges settled both ways, late authorizations
//! fenced off, expired keys deleted.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use oncepay::charges::NewCharge;
use oncepay::idempotency::{Fingerprint, store};
use oncepay::params::Params;
use oncepay::processor::{
    Authorization, Outcome, Processor, ProcessorError, Refund, RefundOutcome, TestToken,
    authorization_key,
};
use oncepay::sweeper::{SweepSettings, Sweeper};

use crate::helpers::{Answer, Settings, TestApp, spawn_app_with, visa};

/// A claim and a pending charge for `visa(2000)`, as a request that crashed
/// right after step 2 leaves them, `age` ago.
pub async fn stale_claim(app: &TestApp, key: &str, charge_id: &str, age: &str) {
    let params = Params::from_json(visa(2000).to_string().as_bytes()).unwrap();
    let fingerprint = Fingerprint::of(
        "POST",
        "/v1/charges",
        &NewCharge::from_params(params).unwrap().canonical(),
    );
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, status, created_at)
         VALUES ($1, $2, 2000, 'usd', 'tok_visa', 'pending', now() - $3::interval)",
    )
    .bind(charge_id)
    .bind(app.merchant_id)
    .bind(age)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path,
             fingerprint, charge_id, created_at, locked_at, expires_at)
         VALUES ($1, $2, 'processing', 'POST', '/v1/charges', $5, $3,
                 now() - $4::interval, now() - $4::interval, now() + interval '1 day')",
    )
    .bind(app.merchant_id)
    .bind(key)
    .bind(charge_id)
    .bind(age)
    .bind(&fingerprint.0[..])
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

async fn charge_state(app: &TestApp, id: &str) -> (String, Option<String>) {
    sqlx::query_as("SELECT status, failure_code FROM charges WHERE id = $1")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn key_state(app: &TestApp, key: &str) -> (String, Option<i16>) {
    sqlx::query_as("SELECT status, response_status FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

fn fast_timeout() -> Settings {
    Settings::new().set("PROCESSING_TIMEOUT", "1s")
}

#[tokio::test]
async fn the_sweeper_settles_a_stale_row_as_succeeded_when_the_payment_was_recorded() {
    let app = spawn_app_with(fast_timeout()).await;
    stale_claim(&app, "crashed", "ch_crashedafterprocessor00001", "1 minute").await;
    // The processor took the money before the crash.
    let key = authorization_key("ch_crashedafterprocessor00001");
    let outcome = app
        .processor
        .authorize(Authorization {
            processor_key: &key,
            amount: 2000,
            currency: "usd",
            source: TestToken::Visa,
        })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Succeeded);

    let report = app.sweep_once().await;
    assert_eq!((report.settled_succeeded, report.settled_failed), (1, 0));
    assert_eq!(
        charge_state(&app, "ch_crashedafterprocessor00001").await.0,
        "succeeded"
    );
    assert_eq!(
        key_state(&app, "crashed").await,
        ("completed".into(), Some(201))
    );
    assert_eq!(app.payments().await, 1);

    // The retry replays a definite answer, and a second pass changes nothing.
    let retry = Answer::of(app.post_charge(Some("crashed"), &visa(2000)).await).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], "ch_crashedafterprocessor00001");
    assert_eq!(retry.json()["status"], "succeeded");
    assert_eq!(app.sweep_once().await.settled_succeeded, 0);
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn the_sweeper_fails_a_stale_row_and_voids_it_when_no_payment_was_recorded() {
    let app = spawn_app_with(fast_timeout()).await;
    stale_claim(&app, "crashed", "ch_crashedbeforeprocessor0001", "1 minute").await;

    let report = app.sweep_once().await;
    assert_eq!((report.settled_succeeded, report.settled_failed), (0, 1));
    assert_eq!(
        charge_state(&app, "ch_crashedbeforeprocessor0001").await,
        ("failed".into(), Some("processing_abandoned".into()))
    );
    assert_eq!(
        key_state(&app, "crashed").await,
        ("completed".into(), Some(402))
    );
    assert_eq!(app.payments().await, 0);

    let retry = Answer::of(app.post_charge(Some("crashed"), &visa(2000)).await).await;
    retry.assert_problem(402, "processing_abandoned");
    assert!(retry.replayed());

    // The fence holds: the crashed request's authorization, arriving late, moves no money.
    let key = authorization_key("ch_crashedbeforeprocessor0001");
    let late = app
        .processor
        .authorize(Authorization {
            processor_key: &key,
            amount: 2000,
            currency: "usd",
            source: TestToken::Visa,
        })
        .await
        .unwrap();
    assert_eq!(late, Outcome::Voided);
    assert_eq!(app.payments().await, 0);
}

#[tokio::test]
async fn the_sweeper_leaves_rows_younger_than_the_timeout_alone() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1h")).await;
    stale_claim(&app, "busy", "ch_stillworkingonthisone00001", "1 minute").await;
    assert_eq!(app.sweep_once().await.settled_failed, 0);
    assert_eq!(
        charge_state(&app, "ch_stillworkingonthisone00001").await.0,
        "pending"
    );
    assert_eq!(
        app.count("SELECT count(*) FROM processor_operations").await,
        0
    );
}

#[tokio::test]
async fn the_sweeper_settles_a_stale_charge_made_without_a_key() {
    let app = spawn_app_with(fast_timeout()).await;
    sqlx::query(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, status, created_at)
         VALUES ('ch_keylesscrashedcharge00001', $1, 2000, 'usd', 'tok_visa', 'pending', now() - interval '1 minute')",
    )
    .bind(app.merchant_id)
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(app.sweep_once().await.settled_failed, 1);
    assert_eq!(
        charge_state(&app, "ch_keylesscrashedcharge00001").await.0,
        "failed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_authorization_racing_the_sweeper_moves_no_money_and_fails_the_charge() {
    // The processor takes 2 s; a sweeper gives up on a charge after 300 ms.
    // The server itself refuses a latency above its PROCESSING_TIMEOUT, so
    // the short timeout is the sweeper's own: as if this request had
    // stalled (a paused process, a slow network) past the timeout.
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 2000)).await;
    let request = async { Answer::of(app.post_charge(Some("slow"), &visa(2000)).await).await };
    let sweep = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        app.sweep_once_with_timeout(Duration::from_millis(300))
            .await
    };
    let (answer, report) = tokio::join!(request, sweep);

    assert_eq!(
        report.settled_failed, 1,
        "the sweeper voided and failed the charge"
    );
    answer.assert_problem(402, "processing_abandoned");
    let charge_id = answer.json()["charge"].as_str().unwrap().to_owned();
    assert_eq!(
        charge_state(&app, &charge_id).await,
        ("failed".into(), Some("processing_abandoned".into()))
    );
    assert_eq!(
        app.payments().await,
        0,
        "money never moved for a failed charge"
    );
    // A retry replays the same definite answer.
    let retry = Answer::of(app.post_charge(Some("slow"), &visa(2000)).await).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, answer.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sweepers_at_once_settle_each_stale_row_once() {
    let app = spawn_app_with(fast_timeout()).await;
    for i in 0..20 {
        stale_claim(
            &app,
            &format!("k{i}"),
            &format!("ch_stalechargenumber{i:010}"),
            "1 minute",
        )
        .await;
    }
    // Two sweepers sharing one processor that counts the fences it is asked for.
    let counting = Arc::new(CountingProcessor {
        inner: app.processor.clone(),
        voids: AtomicUsize::new(0),
    });
    let sweeper = || {
        Sweeper::new(
            app.pool.clone(),
            counting.clone(),
            SweepSettings {
                processing_timeout: Duration::from_secs(1),
                ..SweepSettings::from_config(&app.config)
            },
        )
    };
    let (first, second) = (sweeper(), sweeper());
    let (a, b) = tokio::join!(first.sweep_once(), second.sweep_once());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.settled_failed + b.settled_failed, 20, "{a:?} {b:?}");
    assert_eq!(
        counting.voids.load(Ordering::SeqCst),
        20,
        "the lease kept the two sweepers off each other's rows"
    );
    assert_eq!(
        app.count("SELECT count(*) FROM charges WHERE status = 'failed'")
            .await,
        20
    );
    assert_eq!(
        app.count("SELECT count(*) FROM idempotency_keys WHERE status = 'completed'")
            .await,
        20
    );
}

#[tokio::test]
async fn the_sweeper_deletes_expired_keys_and_keeps_live_ones() {
    let app = spawn_app_with(Settings::new()).await;
    for i in 0..3 {
        assert_eq!(
            app.post_charge(Some(&format!("k{i}")), &visa(100))
                .await
                .status(),
            201
        );
    }
    // Make a backlog larger than one batch directly.
    sqlx::query(
        "INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path, fingerprint,
             response_status, response_content_type, response_body, created_at, completed_at, expires_at)
         SELECT $1, 'old-' || i, 'completed', 'POST', '/v1/charges', sha256('x'), 201, 'application/json',
                '{}', now() - interval '2 days', now() - interval '2 days', now() - interval '1 day'
           FROM generate_series(1, 1200) i",
    )
    .bind(app.merchant_id)
    .execute(&app.pool)
    .await
    .unwrap();
    let report = app.sweep_once().await;
    assert_eq!(report.keys_deleted, 1200);
    assert_eq!(app.keys().await, 3, "live keys stay");
    assert_eq!(app.charges().await, 3, "charges are never deleted");
}

/// `n` completed keys of the app's merchant that expired a day ago, guarding
/// no record, inserted in one statement.
async fn seed_expired_keys(app: &TestApp, n: i64) {
    sqlx::query(
        "INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path, fingerprint,
             response_status, response_content_type, response_body, created_at, completed_at, expires_at)
         SELECT $1, 'expired-' || i, 'completed', 'POST', '/v1/charges', sha256('x'), 201,
                'application/json', '{}', now() - interval '2 days', now() - interval '2 days',
                now() - interval '1 day' - i * interval '1 millisecond'
           FROM generate_series(1, $2) i",
    )
    .bind(app.merchant_id)
    .bind(n)
    .execute(&app.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn one_pass_deletes_a_backlog_of_expired_keys_far_beyond_twenty_batches() {
    let app = spawn_app_with(Settings::new()).await;
    assert_eq!(
        app.post_charge(Some("live"), &visa(100)).await.status(),
        201
    );
    seed_expired_keys(&app, 30_000).await;
    sqlx::query("ANALYZE idempotency_keys")
        .execute(&app.pool)
        .await
        .unwrap();

    // The delete finds its rows through the partial index on completed keys.
    let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {}", store::DELETE_EXPIRED))
        .bind(500_i64)
        .fetch_all(&app.pool)
        .await
        .unwrap();
    let plan = plan.join("\n");
    assert!(
        plan.contains("Index Scan using idempotency_keys_completed_expires_idx")
            && plan.contains("Tid Scan")
            && !plan.contains("Seq Scan"),
        "{plan}"
    );

    let report = app.sweep_once_with_budget(Duration::from_secs(60)).await;
    assert_eq!(report.keys_deleted, 30_000, "more than 20 batches of 500");
    assert_eq!(app.keys().await, 1, "the live key stays");
}

#[tokio::test]
async fn a_pass_stops_deleting_once_its_time_budget_is_spent() {
    let app = spawn_app_with(Settings::new()).await;
    seed_expired_keys(&app, 1_200).await;
    // A spent budget still allows one batch, so every pass makes progress.
    let report = app.sweep_once_with_budget(Duration::ZERO).await;
    assert_eq!(report.keys_deleted, 500);
    assert_eq!(app.keys().await, 700);
    let report = app.sweep_once().await;
    assert_eq!(report.keys_deleted, 700);
}

/// A processor that counts the fences (voids) it is asked for.
struct CountingProcessor {
    inner: Arc<dyn Processor>,
    voids: AtomicUsize,
}

#[async_trait]
impl Processor for CountingProcessor {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        self.inner.authorize(request).await
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        self.voids.fetch_add(1, Ordering::SeqCst);
        self.inner.void_unless_recorded(processor_key).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        self.inner.refund(request).await
    }
}
