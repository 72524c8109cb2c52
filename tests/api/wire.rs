//! How oncepay classifies what happens on the wire to the card gateway,
//! end to end through `POST /v1/charges`: a refused connection records
//! nothing and gives the key back; a lost or late answer is repeated under
//! the same processor key, or left unknown for recovery to settle from the
//! gateway's record; a `503` that says nothing was recorded is
//! "unavailable". Every count is read from both databases.

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use oncepay::processor::{
    Authorization, HttpProcessor, HttpSettings, Processor, ProcessorError, TestToken,
};

use crate::helpers::{Answer, Settings, spawn_app, spawn_app_with, visa};

/// A port nothing listens on.
async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    port
}

/// How many requests the server's gateway answered (or dropped) with `status`.
async fn gateway_requests(url: &str, status: &str) -> u64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("gateway_requests_total")
                && l.contains("route=\"/v1/authorizations\"")
                && l.contains(&format!("status=\"{status}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test]
async fn a_processor_refusing_connections_records_nothing_and_gives_the_key_back() {
    let port = closed_port().await;
    let app =
        spawn_app_with(Settings::new().set("PROCESSOR_URL", format!("http://127.0.0.1:{port}")))
            .await;
    let answer = Answer::of(app.post_charge(Some("refused"), &visa(2000)).await).await;
    answer.assert_problem(503, "processor_unavailable");
    assert_eq!(answer.header("retry-after"), Some("1"));
    assert_eq!(
        (
            app.charges().await,
            app.keys().await,
            app.processor_operations().await
        ),
        (0, 0, 0),
        "nothing written on either side; the key is free"
    );
    // The key was given back: a retry runs anew (and is refused the same way).
    let retry = Answer::of(app.post_charge(Some("refused"), &visa(2000)).await).await;
    retry.assert_problem(503, "processor_unavailable");
    // Not ready, but up.
    let ready = Answer::of(app.client.get(app.url("/readyz")).send().await.unwrap()).await;
    ready.assert_problem(503, "processor_unavailable");
    let health = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
}

#[tokio::test]
async fn an_instance_whose_processor_answers_is_ready() {
    let app = spawn_app().await;
    let ready = Answer::of(app.client.get(app.url("/readyz")).send().await.unwrap()).await;
    assert_eq!(ready.status, 200, "{:?}", ready.body);
    assert_eq!(ready.json()["processor"], "ok");
}

#[tokio::test]
async fn an_answer_dropped_after_recording_is_repeated_under_the_same_key_and_charges_once() {
    let app =
        spawn_app_with(Settings::new().processor_header("Processor-Fault", "drop-after-record"))
            .await;
    let answer = Answer::of(app.post_charge(Some("dropped"), &visa(2000)).await).await;
    assert_eq!(answer.status, 201, "{:?}", answer.body);
    assert!(!answer.replayed());
    assert_eq!(
        gateway_requests(&app.processor_url, "dropped").await,
        1,
        "the first answer was lost"
    );
    assert_eq!(
        gateway_requests(&app.processor_url, "200").await,
        1,
        "the repeat replayed it"
    );
    assert_eq!((app.charges().await, app.payments().await), (1, 1));
}

#[tokio::test]
async fn an_answer_lost_on_every_attempt_is_unknown_until_recovery_finds_the_one_payment() {
    let app = spawn_app_with(
        Settings::new()
            .set("PROCESSOR_RETRIES", 0)
            .processor_header("Processor-Fault", "drop-after-record"),
    )
    .await;
    let answer = Answer::of(app.post_charge(Some("lost"), &visa(2000)).await).await;
    answer.assert_problem(503, "processing_outcome_unknown");
    assert_eq!(app.payments().await, 1, "the money moved");
    assert_eq!(
        app.count("SELECT count(*) FROM charges WHERE status = 'pending'")
            .await,
        1
    );
    // Recovery asks the gateway what stands under the key: the payment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = app
        .sweep_once_with_timeout(Duration::from_millis(250))
        .await;
    assert_eq!(report.settled_succeeded, 1, "{report:?}");
    let retry = Answer::of(app.post_charge(Some("lost"), &visa(2000)).await).await;
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(
        (
            app.charges().await,
            app.payments().await,
            app.processor_operations().await
        ),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn a_gateway_slower_than_the_timeout_is_repeated_under_the_same_key_and_charges_once() {
    let app = spawn_app_with(
        Settings::new()
            .set("PROCESSOR_TIMEOUT", "300ms")
            .processor("PROCESSOR_FAULT_DELAY", "5s")
            .processor_header("Processor-Fault", "slow"),
    )
    .await;
    let sent = Instant::now();
    let answer = Answer::of(app.post_charge(Some("slow"), &visa(2000)).await).await;
    assert_eq!(answer.status, 201, "{:?}", answer.body);
    assert!(
        sent.elapsed() < Duration::from_secs(4),
        "the repeat did not wait for the slow answer: {:?}",
        sent.elapsed()
    );
    assert_eq!(
        (
            app.charges().await,
            app.payments().await,
            app.processor_operations().await
        ),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn a_gateway_failing_before_it_records_is_unavailable_and_the_key_is_given_back() {
    let app =
        spawn_app_with(Settings::new().processor_header("Processor-Fault", "fail-before-record"))
            .await;
    let answer = Answer::of(app.post_charge(Some("failing"), &visa(2000)).await).await;
    answer.assert_problem(503, "processor_unavailable");
    assert_eq!(
        gateway_requests(&app.processor_url, "503").await,
        u64::from(app.config.processor.retries) + 1,
        "repeated, under the same key, as many times as allowed"
    );
    assert_eq!(
        (
            app.charges().await,
            app.keys().await,
            app.processor_operations().await
        ),
        (0, 0, 0)
    );
}

/// A stand-in gateway that answers every request with `status` and `body`.
async fn answering(status: StatusCode, body: &'static str) -> String {
    let router = axum::Router::new()
        .fallback(move || async move { (status, [("content-type", "application/json")], body) });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

fn client(url: String) -> HttpProcessor {
    HttpProcessor::new(HttpSettings {
        url,
        api_key: "gwsk_test".to_owned(),
        connect_timeout: Duration::from_secs(1),
        timeout: Duration::from_secs(2),
        retries: 1,
        budget: Duration::from_secs(5),
        retry_window: Duration::from_secs(5),
    })
    .unwrap()
}

async fn authorize(
    processor: &HttpProcessor,
) -> Result<oncepay::processor::Outcome, ProcessorError> {
    processor
        .authorize(Authorization {
            capture: true,
            processor_key: "auth:ch_classified",
            amount: 100,
            currency: "usd",
            source: TestToken::Visa,
            fault: None,
        })
        .await
}

#[tokio::test]
async fn server_errors_are_unknown_unless_they_say_nothing_was_recorded() {
    let unavailable = answering(
        StatusCode::SERVICE_UNAVAILABLE,
        r#"{"error":{"code":"processor_unavailable","message":"down"}}"#,
    )
    .await;
    assert!(matches!(
        authorize(&client(unavailable)).await,
        Err(ProcessorError::Unavailable)
    ));
    for (status, body) in [
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"{"error":{"code":"outcome_unknown","message":"x"}}"#,
        ),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "<html>a proxy's page</html>",
        ),
        (StatusCode::BAD_GATEWAY, ""),
        (StatusCode::OK, "not json"),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            r#"{"error":{"code":"idempotency_key_reused","message":"x"}}"#,
        ),
    ] {
        let url = answering(status, body).await;
        assert!(
            matches!(
                authorize(&client(url)).await,
                Err(ProcessorError::OutcomeUnknown(_))
            ),
            "{status} {body}"
        );
    }
    let refused = client(format!("http://127.0.0.1:{}", closed_port().await));
    assert!(matches!(
        authorize(&refused).await,
        Err(ProcessorError::Unavailable)
    ));
}
