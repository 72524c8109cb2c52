//! Request ids, metrics, problems from layers, and the per-request timeout.

use crate::helpers::{Answer, Settings, spawn_app, spawn_app_with, visa};

#[tokio::test]
async fn every_response_carries_a_request_id_and_an_incoming_one_is_honoured() {
    let app = spawn_app().await;
    let made = app.client.get(app.url("/healthz")).send().await.unwrap();
    let id = made.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 36, "a UUID: {id}");

    let given = app
        .client
        .get(app.url("/v1/charges/ch_nope"))
        .bearer_auth(&app.api_key)
        .header("X-Request-Id", "trace-42")
        .send()
        .await
        .unwrap();
    assert_eq!(given.headers()["x-request-id"], "trace-42");
    let problem = Answer::of(given).await;
    problem.assert_problem(404, "resource_missing");
    assert_eq!(
        problem.json()["request_id"],
        "trace-42",
        "problems name their request"
    );

    let junk = app
        .client
        .get(app.url("/healthz"))
        .header("X-Request-Id", "x".repeat(500))
        .send()
        .await
        .unwrap();
    assert_eq!(
        junk.headers()["x-request-id"].len(),
        36,
        "an over-long id is replaced"
    );
}

#[tokio::test]
async fn a_replayed_problem_stays_byte_for_byte_while_fresh_ones_get_their_request_id() {
    let app = spawn_app().await;
    let body =
        serde_json::json!({"amount": 100, "currency": "usd", "source": "tok_chargeDeclined"});
    let first = Answer::of(app.post_charge(Some("d"), &body).await).await;
    let retry = Answer::of(app.post_charge(Some("d"), &body).await).await;
    assert_eq!(first.status, 402);
    assert!(retry.replayed());
    assert_eq!(first.body, retry.body);
    assert!(
        first.json().get("request_id").is_none(),
        "saved answers are not rewritten"
    );
}

#[tokio::test]
async fn metrics_count_requests_idempotency_processor_calls_and_the_pool() {
    let app = spawn_app().await;
    assert_eq!(app.post_charge(Some("m"), &visa(100)).await.status(), 201);
    assert_eq!(app.post_charge(Some("m"), &visa(100)).await.status(), 201);
    assert_eq!(app.post_charge(Some("m"), &visa(200)).await.status(), 422);
    app.sweep_once().await;
    let response = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = response.text().await.unwrap();
    for needle in [
        r#"http_requests_total{method="POST",route="/v1/charges",status="201"}"#,
        r#"http_request_duration_seconds_bucket{method="POST",route="/v1/charges",status="201""#,
        r#"idempotency_outcomes_total{outcome="executed"}"#,
        r#"idempotency_outcomes_total{outcome="replayed"}"#,
        r#"idempotency_outcomes_total{outcome="reused"}"#,
        r#"processor_calls_total{call="authorize",outcome="succeeded"}"#,
        "processor_call_duration_seconds_bucket",
        "sweeper_runs_total",
        r#"db_pool_connections{state="idle"}"#,
        "db_pool_max_connections",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    assert!(!text.contains(&app.api_key));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_timeout_gets_a_problem_and_its_work_still_completes() {
    let app = spawn_app_with(
        Settings::new()
            .set("REQUEST_TIMEOUT", "300ms")
            .set("PROCESSOR_LATENCY_MS", 1000),
    )
    .await;
    let slow = Answer::of(app.post_charge(Some("slow"), &visa(100)).await).await;
    slow.assert_problem(503, "request_timeout");
    assert!(slow.header("retry-after").is_some());
    assert!(slow.json()["request_id"].is_string());
    // The work went on in its own task; a retry gets its result once it is
    // done (409 until then: each retry must itself stay under the timeout).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let retry = loop {
        let retry = Answer::of(app.post_charge(Some("slow"), &visa(100)).await).await;
        if retry.status != 409 || std::time::Instant::now() > deadline {
            break retry;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!((app.charges().await, app.payments().await), (1, 1));
}
