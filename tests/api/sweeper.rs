//! The background task: stale charges settled both ways, late authorizations
//! fenced off, expired keys deleted, several sweepers sharing the work.

use oncepay::http::input::FromParams;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sqlx::PgPool;
use uuid::Uuid;

use oncepay::processor::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
    TestToken, authorization_key,
};
use oncepay_core::charges::NewCharge;
use oncepay_core::charges::settle::{self, Settled};
use oncepay_core::idempotency::{Fingerprint, store};
use oncepay_core::params::Params;
use oncepay_core::sweeper::{SweepReport, SweepSettings, Sweeper};

use crate::helpers::{Answer, Settings, TestApp, spawn_app, spawn_app_with, until, visa};

/// A claim and a pending charge for `visa(2000)`, as a request that crashed
/// right after step 2 leaves them, `age` ago.
pub async fn stale_claim(app: &TestApp, key: &str, charge_id: &str, age: &str) {
    stale_claim_in(&app.pool, app.merchant_id, key, charge_id, age).await;
}

/// [`stale_claim`] in any database, for `merchant_id`.
pub async fn stale_claim_in(
    pool: &PgPool,
    merchant_id: Uuid,
    key: &str,
    charge_id: &str,
    age: &str,
) {
    let params = Params::from_json(visa(2000).to_string().as_bytes()).unwrap();
    let fingerprint = Fingerprint::of(
        "POST",
        "/v1/charges",
        &NewCharge::from_params(params).unwrap().canonical(),
    );
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, status, created_at)
         VALUES ($1, $2, 2000, 'usd', 'tok_visa', 'pending', now() - $3::interval)",
    )
    .bind(charge_id)
    .bind(merchant_id)
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
    .bind(merchant_id)
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
            capture: true,
            processor_key: &key,
            amount: 2000,
            currency: "usd",
            source: TestToken::Visa,
            fault: None,
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
            capture: true,
            processor_key: &key,
            amount: 2000,
            currency: "usd",
            source: TestToken::Visa,
            fault: None,
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
    assert_eq!(app.processor_operations().await, 0);
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
    let report = app.sweep_once().await;
    assert_eq!(
        (report.leased, report.unguarded, report.settled_failed),
        (0, 1, 1),
        "{report:?}"
    );
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
    let stalled_for = Duration::from_millis(300);
    let request = async { Answer::of(app.post_charge(Some("slow"), &visa(2000)).await).await };
    let sweep = async {
        // Sweep once the claim is older than the sweeper's timeout, by the
        // database's clock, while the request is still at the processor.
        until(
            app.config.processor.latency,
            "the claim stalled",
            || async {
                sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM idempotency_keys
                                 WHERE key = 'slow' AND status = 'processing'
                                   AND locked_at < now() - $1::float8 * interval '1 millisecond')",
                )
                .bind(stalled_for.as_millis() as f64)
                .fetch_one(&app.pool)
                .await
                .unwrap()
            },
        )
        .await;
        app.sweep_once_with_timeout(stalled_for).await
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

/// What one sweeper did over its passes.
#[derive(Debug, Default)]
struct Tally {
    passes: u64,
    leased: u64,
    unguarded: u64,
    settled: u64,
}

/// Runs `sweeper` pass after pass until `done` says nothing is left,
/// adding up its reports.
async fn sweep_until<F, Fut>(sweeper: &Sweeper, done: F) -> Tally
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut tally = Tally::default();
    // A guard against a sweeper that never finishes, not a timing bet.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(Instant::now() < deadline, "still sweeping: {tally:?}");
        let report: SweepReport = sweeper.sweep_once().await.expect("a sweep pass");
        tally.passes += 1;
        tally.leased += report.leased;
        tally.unguarded += report.unguarded;
        tally.settled += report.settled_succeeded + report.settled_failed;
        if report == SweepReport::default() {
            // The rest is someone else's lease; look again shortly.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    tally
}

/// Two sweepers on one database with `batch_size` rows a statement, each
/// with its own counting processor; their fences are also counted by key.
fn two_sweepers(
    app: &TestApp,
    batch_size: i64,
) -> ([Sweeper; 2], [Arc<CountingProcessor>; 2], FencesByKey) {
    let by_key = FencesByKey::default();
    let processor = || {
        Arc::new(CountingProcessor {
            inner: app.working_processor.clone(),
            voids: AtomicUsize::new(0),
            by_key: by_key.clone(),
            // Slow enough that one sweeper is still fencing its batch when
            // the other leases the next: their passes interleave.
            delay: Duration::from_millis(10),
        })
    };
    let processors = [processor(), processor()];
    let settings = SweepSettings {
        processing_timeout: Duration::from_secs(1),
        batch_size,
        ..app.config.sweep_settings()
    };
    let sweepers = processors
        .clone()
        .map(|p| Sweeper::new(app.pool.clone(), p, settings));
    (sweepers, processors, by_key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sweepers_at_once_settle_each_stale_row_once() {
    const ROWS: u64 = 40;
    const BATCH: i64 = 5;
    let app = spawn_app_with(fast_timeout()).await;
    for i in 0..ROWS {
        stale_claim(
            &app,
            &format!("k{i}"),
            &format!("ch_stalechargenumber{i:010}"),
            "1 minute",
        )
        .await;
    }
    let ([first, second], [a_processor, b_processor], by_key) = two_sweepers(&app, BATCH);
    // Someone else (a retry leasing its own key, say) holds the oldest row
    // while both sweepers make their first pass: a lease that waited for it
    // instead of skipping it would take it, and the rows leased with it, in
    // both sweepers at once.
    let mut holder = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = 'k0' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let blocked = || async {
        app.count(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
    };
    let release = async {
        until(
            Duration::from_secs(30),
            "two passes, or two sweepers blocked",
            || async {
                let leased = app
                    .count(
                        "SELECT count(*) FROM idempotency_keys
                          WHERE status = 'completed'
                             OR locked_at > now() - interval '30 seconds'",
                    )
                    .await;
                leased >= 2 * BATCH || blocked().await >= 2
            },
        )
        .await;
        let blocked = blocked().await;
        holder.rollback().await.unwrap();
        blocked
    };
    let done = || async {
        app.count("SELECT count(*) FROM idempotency_keys WHERE status = 'processing'")
            .await
            == 0
    };
    let (a, b, blocked) = tokio::join!(
        sweep_until(&first, done),
        sweep_until(&second, done),
        release
    );
    assert_eq!(blocked, 0, "the lease skips a row someone else holds");
    // Each pass leased at most one batch, and each row was leased once.
    assert_eq!(a.leased + b.leased, ROWS, "{a:?} {b:?}");
    assert!(
        a.leased > 0 && b.leased > 0,
        "both sweepers took part: {a:?} {b:?}"
    );
    // Each row was fenced once, by the sweeper that leased it.
    let by_key = by_key.lock().unwrap().clone();
    assert_eq!(by_key.len() as u64, ROWS);
    assert!(by_key.values().all(|&n| n == 1), "{by_key:?}");
    assert_eq!(
        a_processor.voids.load(Ordering::SeqCst) as u64,
        a.leased,
        "a sweeper fences what it leased, no more"
    );
    assert_eq!(b_processor.voids.load(Ordering::SeqCst) as u64, b.leased);
    // And settled once: the reports add up to the rows, each of them failed.
    assert_eq!(a.settled + b.settled, ROWS, "{a:?} {b:?}");
    assert!(a.settled > 0 && b.settled > 0, "{a:?} {b:?}");
    assert_eq!(
        app.count("SELECT count(*) FROM charges WHERE status = 'failed'")
            .await as u64,
        ROWS
    );
    assert_eq!(
        app.count("SELECT count(*) FROM idempotency_keys WHERE status = 'completed'")
            .await as u64,
        ROWS
    );
    assert_eq!(
        app.processor_count("SELECT count(*) FROM operations WHERE outcome = 'voided'")
            .await as u64,
        ROWS
    );
    assert_eq!(app.payments().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sweepers_at_once_settle_each_keyless_stale_charge_once() {
    const ROWS: u64 = 12;
    let app = spawn_app_with(fast_timeout()).await;
    sqlx::query(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, status, created_at)
         SELECT 'ch_keylessstalecharge' || lpad(i::text, 6, '0'), $1, 2000, 'usd', 'tok_visa',
                'pending', now() - interval '1 minute'
           FROM generate_series(1, $2) i",
    )
    .bind(app.merchant_id)
    .bind(ROWS as i64)
    .execute(&app.pool)
    .await
    .unwrap();
    let ([first, second], _, by_key) = two_sweepers(&app, 5);
    let done = || async {
        app.count("SELECT count(*) FROM charges WHERE status = 'pending'")
            .await
            == 0
    };
    let (a, b) = tokio::join!(sweep_until(&first, done), sweep_until(&second, done));

    // Nothing leases a keyless charge: both sweepers may find and fence the
    // same one. The fence is idempotent and the settle conditional, so each
    // charge has one record at the processor and is settled once.
    assert_eq!((a.leased, b.leased), (0, 0));
    assert!(a.unguarded + b.unguarded >= ROWS, "{a:?} {b:?}");
    assert_eq!(a.settled + b.settled, ROWS, "{a:?} {b:?}");
    let by_key = by_key.lock().unwrap().clone();
    assert_eq!(by_key.len() as u64, ROWS, "every charge was fenced");
    let abandoned: Vec<String> = sqlx::query_scalar(
        "SELECT 'auth:' || id FROM charges
          WHERE status = 'failed' AND failure_code = 'processing_abandoned'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let voided: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE key = ANY($1) AND outcome = 'voided'",
    )
    .bind(&abandoned)
    .fetch_one(&app.processor_pool)
    .await
    .unwrap();
    assert_eq!(
        (abandoned.len() as u64, voided as u64),
        (ROWS, ROWS),
        "each charge failed, with one void at the processor"
    );
    assert_eq!(app.processor_operations().await as u64, ROWS);
}

#[tokio::test]
async fn the_sweeper_never_deletes_an_expired_key_that_is_still_processing() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1h")).await;
    // In flight for a minute, well within the timeout, and past its expiry.
    stale_claim(&app, "busy", "ch_stillworkingpastexpiry0001", "1 minute").await;
    // Stale and past its expiry: settled first, then kept for its answer.
    stale_claim(&app, "crashed", "ch_crashedpastitsexpiry00001", "2 hours").await;
    seed_expired_keys(&app, 1).await;
    let expired = sqlx::query(
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'
          WHERE status = 'processing'",
    )
    .execute(&app.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(expired, 2);

    let report = app.sweep_once().await;
    assert_eq!(report.keys_deleted, 1, "only the completed expired key");
    assert_eq!((report.leased, report.settled_failed), (1, 1), "{report:?}");
    assert_eq!(
        key_state(&app, "busy").await,
        ("processing".into(), None),
        "a key in flight is never deleted"
    );
    assert_eq!(
        charge_state(&app, "ch_stillworkingpastexpiry0001").await.0,
        "pending"
    );
    assert_eq!(
        key_state(&app, "crashed").await,
        ("completed".into(), Some(402)),
        "settled, not deleted"
    );
    assert_eq!(
        app.count(
            "SELECT count(*) FROM idempotency_keys
              WHERE key = 'crashed' AND expires_at > now() + interval '23 hours'"
        )
        .await,
        1,
        "its answer is kept a full TTL"
    );
    // A second pass deletes nothing more.
    assert_eq!(app.sweep_once().await.keys_deleted, 0);
    assert_eq!(app.keys().await, 2);
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
    let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {}", store::delete_expired_sql()))
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

/// How many fences each processor key was asked for, over all processors.
type FencesByKey = Arc<Mutex<HashMap<String, u32>>>;

/// A processor that counts the fences (voids) it is asked for, and takes
/// `delay` over each.
struct CountingProcessor {
    inner: Arc<dyn Processor>,
    voids: AtomicUsize,
    by_key: FencesByKey,
    delay: Duration,
}

#[async_trait]
impl Processor for CountingProcessor {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        self.inner.authorize(request).await
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        self.voids.fetch_add(1, Ordering::SeqCst);
        *self
            .by_key
            .lock()
            .unwrap()
            .entry(processor_key.to_owned())
            .or_default() += 1;
        tokio::time::sleep(self.delay).await;
        self.inner.void_unless_recorded(processor_key).await
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        self.inner.capture(request).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        self.inner.refund(request).await
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        self.inner.payment(processor_key).await
    }
}

#[tokio::test]
async fn a_pass_stops_deleting_at_the_first_short_batch_without_spending_its_budget() {
    let app = spawn_app_with(Settings::new()).await;
    seed_expired_keys(&app, 3).await;
    // With a budget of an hour, only the short batch can end the pass in time.
    let report = tokio::time::timeout(
        Duration::from_secs(60),
        app.sweep_once_with_budget(Duration::from_secs(3600)),
    )
    .await
    .expect("the pass ends at the first batch shorter than SWEEP_BATCH_SIZE");
    assert_eq!(report.keys_deleted, 3);
}

#[tokio::test]
async fn settling_a_settled_charge_again_changes_nothing() {
    let app = spawn_app_with(Settings::new()).await;
    let charge = app.paid_charge(2000).await;
    let again = settle::settle(
        &app.pool,
        &charge,
        &Outcome::Voided,
        app.config.keys.ttl,
        None,
    )
    .await
    .unwrap();
    assert!(matches!(again, Settled::Already), "{again:?}");
    assert_eq!(
        charge_state(&app, &charge).await,
        ("succeeded".to_owned(), None)
    );
    assert_eq!(app.event_types_of(&charge).await, ["charge.succeeded"]);
}

/// The plan of `statement` on `conn`, as `EXPLAIN (FORMAT JSON)` gives it.
async fn plan_of(conn: &mut sqlx::PgConnection, statement: &str) -> String {
    let (plan,): (serde_json::Value,) =
        sqlx::query_as(&format!("EXPLAIN (FORMAT JSON) {statement}"))
            .fetch_one(conn)
            .await
            .unwrap();
    plan.to_string()
}

#[tokio::test]
async fn a_key_found_by_its_charge_or_refund_is_read_through_that_index_not_the_sweepers() {
    let app = spawn_app().await;
    // Many completed keys, a few in flight, fresh statistics: the shape in
    // which an index of the keys in flight looks cheapest to the planner
    // (and, with the dead entries of keys completed since the last vacuum,
    // is not).
    for i in 0..300 {
        let key = format!("plan-{i}");
        let response = app.post_charge(Some(&key), &visa(1000 + i)).await;
        assert_eq!(response.status(), 201, "{key}");
    }
    for i in 0..3 {
        stale_claim(
            &app,
            &format!("plan-stale-{i}"),
            &format!("ch_planstale{i}"),
            "1 hour",
        )
        .await;
    }
    let mut conn = app.pool.acquire().await.unwrap();
    sqlx::query("ANALYZE idempotency_keys")
        .execute(&mut *conn)
        .await
        .unwrap();
    // Indexes only: which one the planner takes is the question.
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();

    for (statement, index) in [
        (
            "UPDATE idempotency_keys SET locked_at = NULL \
             WHERE charge_id = 'ch_planstale0' AND status = 'processing'",
            "idempotency_keys_charge_idx",
        ),
        (
            "DELETE FROM idempotency_keys WHERE charge_id = 'ch_x' AND status = 'processing'",
            "idempotency_keys_charge_idx",
        ),
        (
            "SELECT key FROM idempotency_keys WHERE refund_id = 're_x' AND status = 'processing'",
            "idempotency_keys_refund_idx",
        ),
    ] {
        let plan = plan_of(&mut conn, statement).await;
        assert!(plan.contains(index), "{statement}\n{plan}");
        assert!(
            !plan.contains("idempotency_keys_locked_idx"),
            "{statement}\n{plan}"
        );
    }
    // The sweeper's own question is answered from the index of locks.
    let stale = "SELECT merchant_id, key FROM idempotency_keys \
                 WHERE status = 'processing' AND locked_at < now() - interval '1 minute' \
                 ORDER BY locked_at LIMIT 10";
    let plan = plan_of(&mut conn, stale).await;
    assert!(plan.contains("idempotency_keys_locked_idx"), "{plan}");
    sqlx::query("RESET enable_seqscan")
        .execute(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    let leased = store::lease_stale(&app.pool, Duration::from_secs(60), 10)
        .await
        .unwrap();
    assert_eq!(leased.len(), 3, "the three stale keys, found and leased");
}
