//! The card gateway as a process of its own: killed under the service, it
//! makes charges "unavailable" (nothing recorded, keys given back) and the
//! instance not ready, never crashed; restarted, the same keys charge once.
//! Aborted right after recording, it keeps what it recorded.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::database::TestDb as Database;
use crate::harness::{Server, charge_body, client, eventually, processor_pool, send};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_gateway_killed_and_restarted_under_the_service_charges_each_key_once() {
    let db = Database::create_empty().await;
    let mut server = Server::start(&db.url, &[("PROCESSOR_RETRIES", "1")]).await;
    let http = client(Duration::from_secs(15));
    let url = server.url();
    let (status, _, _) = send(
        &http,
        &url,
        "before",
        &charge_body("before", 1000, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 201);

    // Killed: connections are refused, so nothing can be recorded.
    server.processor.as_mut().expect("its own gateway").kill();
    let (status, headers, body) = send(
        &http,
        &url,
        "during",
        &charge_body("during", 1000, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("processor_unavailable")),
        "{body}"
    );
    assert_eq!(headers.get("retry-after").map(String::as_str), Some("1"));
    let ready = http.get(format!("{url}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503, "not ready while its gateway is down");
    assert!(server.alive(), "the service does not crash");

    // Restarted on the same port: ready again, and the same key charges once.
    server.processor.as_mut().unwrap().restart().await;
    let deadline = Instant::now() + Duration::from_secs(15);
    eventually(deadline, "ready again", || async {
        let ready = http.get(format!("{url}/readyz")).send().await.ok()?;
        (ready.status() == 200).then_some(())
    })
    .await;
    let (status, _, _) = send(
        &http,
        &url,
        "during",
        &charge_body("during", 1000, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 201);

    let pool = db.pool().await;
    let charges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM charges WHERE status = 'succeeded'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let payments: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE kind = 'authorization' AND outcome = 'succeeded'",
    )
    .fetch_one(&processor_pool(&pool).await)
    .await
    .unwrap();
    assert_eq!((charges, payments), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_gateway_aborted_right_after_recording_keeps_the_payment() {
    let db = Database::create_empty().await;
    let mut server = Server::start(&db.url, &[("SWEEP_INTERVAL", "1h")]).await;
    let gateway = server.processor.as_mut().expect("its own gateway");
    let http = reqwest::Client::new();
    let lost = http
        .post(format!("{}/v1/authorizations", gateway.url()))
        .bearer_auth(&gateway.api_key)
        .header("Idempotency-Key", "auth:ch_crashed")
        .header("Processor-Fault", "crash-after-record")
        .json(&json!({"amount": 500, "currency": "usd", "source": "tok_visa"}))
        .send()
        .await;
    assert!(lost.is_err(), "no answer: {lost:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while gateway.alive() {
        assert!(Instant::now() < deadline, "the gateway did not abort");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gateway.restart().await;
    let found: serde_json::Value = http
        .get(format!("{}/v1/operations/auth:ch_crashed", gateway.url()))
        .bearer_auth(&gateway.api_key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(found["outcome"], "succeeded", "{found}");
}
