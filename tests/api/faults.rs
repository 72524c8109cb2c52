//! Processor faults and the fault-injection switch.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use oncepay::processor::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
};
use serde_json::json;
use sqlx::PgPool;

use crate::helpers::{Answer, Settings, spawn_app, spawn_app_with, spawn_app_with_processor};

/// `PROCESSING_TIMEOUT` and `SWEEP_INTERVAL` off their defaults, so that
/// the documented `Retry-After` (their sum, rounded up) is told apart from
/// any constant: 20 s + 90.5 s, 111 s.
fn recovery_timing() -> Settings {
    Settings::new()
        .set("PROCESSING_TIMEOUT", "20s")
        .set("SWEEP_INTERVAL", "90500ms")
}
const UNTIL_RECOVERED: &str = "111";

fn token(source: &str) -> serde_json::Value {
    json!({"amount": 2000, "currency": "usd", "source": source})
}

#[tokio::test]
async fn an_unavailable_processor_rolls_the_claim_back_and_frees_the_key() {
    let app = spawn_app().await;
    let answer = Answer::of(
        app.post_charge(Some("k"), &token("tok_processorUnavailable"))
            .await,
    )
    .await;
    answer.assert_problem(503, "processor_unavailable");
    assert_eq!(
        answer.header("retry-after"),
        Some("1"),
        "nothing to wait for"
    );
    assert_eq!(
        (app.charges().await, app.keys().await),
        (0, 0),
        "claim and pending charge rolled back"
    );
    assert_eq!(app.processor_operations().await, 0);
    // The key is free: the next request with it runs anew.
    let retry = Answer::of(app.post_charge(Some("k"), &token("tok_visa")).await).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(app.payments().await, 1);
}

#[tokio::test]
async fn a_timeout_after_capture_is_503_then_409_then_the_succeeded_replay() {
    let app = spawn_app_with(recovery_timing()).await;
    let body = token("tok_processorTimeoutAfterCapture");
    let first = Answer::of(app.post_charge(Some("t"), &body).await).await;
    first.assert_problem(503, "processing_outcome_unknown");
    assert_eq!(
        first.header("retry-after"),
        Some(UNTIL_RECOVERED),
        "PROCESSING_TIMEOUT plus one SWEEP_INTERVAL, rounded up"
    );
    let charge_id = first.json()["charge"].as_str().unwrap().to_owned();
    assert_eq!(app.payments().await, 1, "the money moved");
    let (status,): (String,) = sqlx::query_as("SELECT status FROM charges WHERE id = $1")
        .bind(&charge_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(status, "pending");

    // Before PROCESSING_TIMEOUT the key is in flight.
    let in_flight = Answer::of(app.post_charge(Some("t"), &body).await).await;
    in_flight.assert_problem(409, "idempotency_key_in_use");
    assert_eq!(in_flight.header("retry-after"), Some("1"));

    // The sweeper settles it from the processor's record, once the key is
    // stale: here it was claimed two hours ago, for a one-hour timeout.
    sqlx::query("UPDATE idempotency_keys SET locked_at = now() - interval '2 hours'")
        .execute(&app.pool)
        .await
        .unwrap();
    let report = app.sweep_once_with_timeout(Duration::from_secs(3600)).await;
    assert_eq!(report.settled_succeeded, 1);
    let retry = Answer::of(app.post_charge(Some("t"), &body).await).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], charge_id.as_str());
    assert_eq!(app.payments().await, 1);
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn a_retry_after_the_processing_timeout_settles_the_stale_key_itself() {
    // No repeats of the lost answer: the first request must be answered
    // within its 500 ms (half the processing timeout), which a loaded
    // machine needs; 150 ms was not always enough.
    let app = spawn_app_with(
        Settings::new()
            .set("PROCESSING_TIMEOUT", "1s")
            .set("PROCESSOR_RETRIES", 0),
    )
    .await;
    let body = token("tok_processorTimeoutAfterCapture");
    let first = Answer::of(app.post_charge(Some("t"), &body).await).await;
    first.assert_problem(503, "processing_outcome_unknown");
    assert_eq!(
        first.header("retry-after"),
        Some("3601"),
        "1 s plus the tests' SWEEP_INTERVAL (1 h), rounded up"
    );
    // Its key was claimed before the answer: it is stale this much later.
    tokio::time::sleep(app.config.keys.processing_timeout + Duration::from_millis(200)).await;
    // No sweeper runs here: the retry settles the stale row by the same fenced procedure.
    let retry = Answer::of(app.post_charge(Some("t"), &body).await).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.json()["status"], "succeeded");
    assert_eq!((app.payments().await, app.charges().await), (1, 1));
}

#[tokio::test]
async fn fault_headers_are_refused_unless_fault_injection_is_on() {
    let app = spawn_app().await;
    let response = app
        .client
        .post(app.url("/v1/charges"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "k")
        .header("Oncepay-Fault", "crash-after-claim")
        .json(&token("tok_visa"))
        .send()
        .await
        .unwrap();
    Answer::of(response)
        .await
        .assert_problem(400, "fault_injection_disabled");
    assert_eq!((app.charges().await, app.keys().await), (0, 0));

    let on = spawn_app_with(Settings::new().set("FAULT_INJECTION", "true")).await;
    let response = on
        .client
        .post(on.url("/v1/charges"))
        .bearer_auth(&on.api_key)
        .header("Oncepay-Fault", "explode")
        .json(&token("tok_visa"))
        .send()
        .await
        .unwrap();
    Answer::of(response)
        .await
        .assert_problem(400, "invalid_fault");
}

#[tokio::test]
async fn a_dropped_response_is_committed_and_replayed() {
    let app = spawn_app_with(Settings::new().set("FAULT_INJECTION", "true")).await;
    let lost = app
        .client
        .post(app.url("/v1/charges"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "d")
        .header("Oncepay-Fault", "drop-response")
        .json(&token("tok_visa"))
        .send()
        .await;
    assert!(
        lost.is_err(),
        "the connection closed without an answer: {lost:?}"
    );
    assert_eq!(
        (app.charges().await, app.payments().await),
        (1, 1),
        "the work was committed"
    );
    let retry = Answer::of(app.post_charge(Some("d"), &token("tok_visa")).await).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(app.charges().await, 1);
    // The server is still serving.
    assert_eq!(
        app.client
            .get(app.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

/// The simulated processor, except that the database goes away (the pool
/// is closed) right after an authorization is recorded.
struct DatabaseGoneAfterAuthorizing {
    inner: Arc<dyn Processor>,
    pool: PgPool,
}

#[async_trait]
impl Processor for DatabaseGoneAfterAuthorizing {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        let outcome = self.inner.authorize(request).await;
        self.pool.close().await;
        outcome
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
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
async fn a_database_outage_after_the_processor_took_the_money_says_when_recovery_answers() {
    let app = spawn_app_with_processor(recovery_timing(), |pool, http| {
        Arc::new(DatabaseGoneAfterAuthorizing { inner: http, pool })
    })
    .await;
    let answer = Answer::of(app.post_charge(Some("gone"), &token("tok_visa")).await).await;
    answer.assert_problem(503, "service_unavailable");
    assert_eq!(answer.header("retry-after"), Some(UNTIL_RECOVERED));
    // The money moved and the charge waits for recovery (read on a
    // connection of its own: the app's pool is closed).
    let mut db = <sqlx::PgConnection as sqlx::Connection>::connect(&app.config.database_url)
        .await
        .unwrap();
    let status: String = sqlx::query_scalar("SELECT status FROM charges")
        .fetch_one(&mut db)
        .await
        .unwrap();
    assert_eq!((status.as_str(), app.payments().await), ("pending", 1));
}

#[tokio::test]
async fn a_database_outage_before_any_work_asks_for_a_retry_in_a_second() {
    let app = spawn_app_with(recovery_timing()).await;
    app.pool.close().await;
    let answer = Answer::of(app.post_charge(Some("early"), &token("tok_visa")).await).await;
    answer.assert_problem(503, "service_unavailable");
    assert_eq!(answer.header("retry-after"), Some("1"));
}

/// The simulated processor, except that it never confirms an authorization
/// and cannot be reached to fence one.
struct Unreachable(Arc<dyn Processor>);

#[async_trait]
impl Processor for Unreachable {
    async fn authorize(&self, _: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        Err(ProcessorError::OutcomeUnknown(anyhow::anyhow!("no answer")))
    }

    async fn void_unless_recorded(&self, _: &str) -> Result<Outcome, ProcessorError> {
        Err(ProcessorError::Unavailable)
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        self.0.capture(request).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        self.0.refund(request).await
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        self.0.payment(processor_key).await
    }
}

#[tokio::test]
async fn a_retry_whose_recovery_fails_at_the_processor_says_when_the_next_recovery_answers() {
    let app = spawn_app_with_processor(
        Settings::new()
            .set("PROCESSING_TIMEOUT", "1s")
            .set("SWEEP_INTERVAL", "2500ms"),
        |_, http| Arc::new(Unreachable(http)),
    )
    .await;
    let body = token("tok_visa");
    let first = Answer::of(app.post_charge(Some("u"), &body).await).await;
    first.assert_problem(503, "processing_outcome_unknown");
    assert_eq!(
        first.header("retry-after"),
        Some("4"),
        "1 s + 2.5 s, rounded up"
    );
    // Its key was claimed before the answer: it is stale this much later.
    tokio::time::sleep(app.config.keys.processing_timeout + Duration::from_millis(200)).await;
    // The key is stale: the retry leases it and tries to fence the charge,
    // and the processor cannot be reached. It gives the lease back, so the
    // next retry tries again at once rather than meeting a `409`.
    for _ in 0..2 {
        let retry = Answer::of(app.post_charge(Some("u"), &body).await).await;
        retry.assert_problem(503, "processor_unavailable");
        assert_eq!(retry.header("retry-after"), Some("1"));
    }
    assert_eq!(
        app.count("SELECT count(*) FROM charges WHERE status = 'pending'")
            .await,
        1
    );
}

/// The simulated processor, except that authorizing `amount` panics.
struct PanicsOn {
    amount: i64,
    inner: Arc<dyn Processor>,
}

const PANIC_MESSAGE: &str = "the processor client hit a bug";

#[async_trait]
impl Processor for PanicsOn {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        assert_ne!(request.amount, self.amount, "{PANIC_MESSAGE}");
        self.inner.authorize(request).await
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
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
async fn a_panic_is_answered_as_an_internal_error_problem_and_the_server_goes_on() {
    let app = spawn_app_with_processor(Settings::new(), |_, http| {
        Arc::new(PanicsOn {
            amount: 1313,
            inner: http,
        })
    })
    .await;
    let body = json!({"amount": 1313, "currency": "usd", "source": "tok_visa"});
    let answer = Answer::of(app.post_charge(Some("bug"), &body).await).await;
    answer.assert_problem(500, "internal_error");
    assert!(answer.json()["request_id"].is_string());
    assert!(
        !String::from_utf8_lossy(&answer.body).contains(PANIC_MESSAGE),
        "details stay in the log"
    );
    // The charge was written before the processor call: it stays pending,
    // its key claimed, for recovery to settle. No money moved.
    assert_eq!(
        app.count("SELECT count(*) FROM charges WHERE status = 'pending'")
            .await,
        1
    );
    assert!(app.in_flight("bug").await);
    assert_eq!(app.payments().await, 0);

    // The process goes on serving.
    let next = Answer::of(app.post_charge(Some("fine"), &token("tok_visa")).await).await;
    assert_eq!(next.status, 201, "{:?}", next.body);
    assert_eq!(app.payments().await, 1);
    let health = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
}
