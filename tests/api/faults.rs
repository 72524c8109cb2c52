//! Processor faults and the fault-injection switch.

use std::time::Duration;

use serde_json::json;

use crate::helpers::{Answer, Settings, spawn_app, spawn_app_with};

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
    assert!(answer.header("retry-after").is_some());
    assert_eq!(
        (app.charges().await, app.keys().await),
        (0, 0),
        "claim and pending charge rolled back"
    );
    assert_eq!(
        app.count("SELECT count(*) FROM processor_operations").await,
        0
    );
    // The key is free: the next request with it runs anew.
    let retry = Answer::of(app.post_charge(Some("k"), &token("tok_visa")).await).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(app.payments().await, 1);
}

#[tokio::test]
async fn a_timeout_after_capture_is_503_then_409_then_the_succeeded_replay() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1h")).await;
    let body = token("tok_processorTimeoutAfterCapture");
    let first = Answer::of(app.post_charge(Some("t"), &body).await).await;
    first.assert_problem(503, "processing_outcome_unknown");
    assert!(first.header("retry-after").is_some());
    let charge_id = first.json()["charge"].as_str().unwrap().to_owned();
    assert_eq!(app.payments().await, 1, "the money moved");
    let (status,): (String,) = sqlx::query_as("SELECT status FROM charges WHERE id = $1")
        .bind(&charge_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(status, "pending");

    // Before PROCESSING_TIMEOUT the key is in flight.
    Answer::of(app.post_charge(Some("t"), &body).await)
        .await
        .assert_problem(409, "idempotency_key_in_use");

    // The sweeper (here with a zero timeout) settles it from the processor's record.
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
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "300ms")).await;
    let body = token("tok_processorTimeoutAfterCapture");
    let first = Answer::of(app.post_charge(Some("t"), &body).await).await;
    assert_eq!(first.status, 503);
    tokio::time::sleep(Duration::from_millis(500)).await;
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
