//! The lab's timelines (`Oncepay-Trace`, `GET /demo/trace`): what the server
//! records of a run's requests, checked against what really happened, in
//! the database and at the card gateway.

use serde_json::{Value, json};

use crate::helpers::{Answer, Settings, TestApp, spawn_app, spawn_app_with};
use crate::sweeper::stale_claim;

fn tagged(run: &str) -> Value {
    json!({"amount": 500, "currency": "usd", "source": "tok_visa", "metadata": {"demo_run": run}})
}

/// A workshop server whose gateway answers slowly enough for two requests to overlap.
async fn workshop() -> TestApp {
    spawn_app_with(
        Settings::new()
            .set("DEMO_UNSAFE_ENDPOINTS", "true")
            .set("FAULT_INJECTION", "true")
            .set("PROCESSOR_LATENCY_MS", 300),
    )
    .await
}

/// A charge on `path` recorded as request `label` of `run`.
async fn traced(app: &TestApp, path: &str, run: &str, label: &str, key: &str) -> Answer {
    let response = app
        .client
        .post(app.url(path))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", key)
        .header("Oncepay-Trace", format!("{run}/{label}"))
        .json(&tagged(run))
        .send()
        .await
        .unwrap();
    Answer::of(response).await
}

/// The run's events, checked to be in time order.
async fn trace(app: &TestApp, run: &str) -> Vec<Value> {
    let answer = Answer::of(app.get(&format!("/demo/trace?run={run}")).await).await;
    assert_eq!(answer.status, 200, "{}", answer.json());
    let events = answer.json()["events"].as_array().unwrap().clone();
    let times: Vec<_> = events
        .iter()
        .map(|e| e["at_us"].as_i64().unwrap())
        .collect();
    assert!(times.is_sorted(), "in time order: {times:?}");
    events
}

/// The events on `lane` marked `mark` (`None`: spans and plain moments).
fn marked<'e>(events: &'e [Value], lane: &str, mark: Option<&str>) -> Vec<&'e Value> {
    events
        .iter()
        .filter(|e| e["lane"] == lane && e["mark"].as_str() == mark)
        .collect()
}

fn request(event: &Value) -> &str {
    event["request"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requests_racing_on_one_key_draw_one_claim_one_call_one_effect_and_one_conflict() {
    let app = workshop().await;
    let (a, b) = tokio::join!(
        traced(&app, "/v1/charges", "race", "A", "race-key"),
        traced(&app, "/v1/charges", "race", "B", "race-key"),
    );
    let winner = if a.status == 201 { "A" } else { "B" };
    let mut statuses = [a.status, b.status];
    statuses.sort_unstable();
    assert_eq!(statuses, [201, 409]);
    let events = trace(&app, "race").await;

    let answers = marked(&events, "request", Some("answer"));
    let conflicts = marked(&events, "request", Some("conflict"));
    assert_eq!(answers.len(), 1);
    assert_eq!(
        (request(answers[0]), answers[0]["what"].as_str()),
        (winner, Some("201"))
    );
    assert_eq!(conflicts.len(), 1, "the loser's 409, on its lane");
    assert_eq!(marked(&events, "oncepay", Some("conflict")).len(), 1);
    let spans: Vec<_> = marked(&events, "request", None);
    assert_eq!(spans.len(), 2, "each request from arrival to answer");

    let claims = marked(&events, "database", None)
        .into_iter()
        .filter(|e| e["what"].as_str().unwrap().starts_with("claim"))
        .count();
    assert_eq!(claims, 2, "both claimed; the statement decided");
    let calls = marked(&events, "gateway", None);
    assert_eq!(calls.len(), 1, "only the claim's winner called the gateway");
    assert_eq!(request(calls[0]), winner);
    let effects = marked(&events, "gateway", Some("effect"));
    assert_eq!(effects.len(), 1);
    assert_eq!(request(effects[0]), winner);
    assert_eq!(
        effects[0]["at_us"], calls[0]["until_us"],
        "where the call ended"
    );
    assert_eq!(
        app.payments().await,
        1,
        "the drawing agrees with the gateway"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_naive_race_draws_an_effect_for_each_request() {
    let app = workshop().await;
    let (a, b) = tokio::join!(
        traced(&app, "/demo/naive/charges", "naive", "A", "naive-key"),
        traced(&app, "/demo/naive/charges", "naive", "B", "naive-key"),
    );
    assert_eq!((a.status, b.status), (201, 201));
    let events = trace(&app, "naive").await;
    let mut by: Vec<_> = marked(&events, "gateway", Some("effect"))
        .into_iter()
        .map(request)
        .collect();
    by.sort_unstable();
    assert_eq!(by, ["A", "B"], "two payments, one per request");
    assert_eq!(app.payments().await, 2);
    let writes = marked(&events, "database", None)
        .into_iter()
        .filter(|e| e["what"] == "write the key, after the work")
        .count();
    assert_eq!(writes, 2);
}

#[tokio::test]
async fn an_answer_dropped_on_purpose_is_drawn_lost_after_its_settle() {
    let app = workshop().await;
    let response = app
        .client
        .post(app.url("/v1/charges"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "dropped")
        .header("Oncepay-Trace", "lost/first try")
        .header("Oncepay-Fault", "drop-response")
        .json(&tagged("lost"))
        .send()
        .await;
    assert!(response.is_err(), "no answer came");
    let retry = traced(&app, "/v1/charges", "lost", "retry", "dropped").await;
    assert!(retry.replayed());

    let events = trace(&app, "lost").await;
    let lost = marked(&events, "request", Some("lost"));
    assert_eq!(lost.len(), 1);
    assert_eq!(request(lost[0]), "first try");
    assert_eq!(marked(&events, "oncepay", Some("lost")).len(), 1);
    let settle = marked(&events, "database", None)
        .into_iter()
        .find(|e| e["what"].as_str().unwrap().starts_with("settle"))
        .expect("a settle");
    assert!(
        settle["until_us"].as_i64() <= lost[0]["at_us"].as_i64(),
        "committed, then lost"
    );
    let replays = marked(&events, "request", Some("replay"));
    assert_eq!(replays.len(), 1);
    assert_eq!(request(replays[0]), "retry");
    assert_eq!(marked(&events, "gateway", Some("effect")).len(), 1);
    assert_eq!(app.payments().await, 1);
}

#[tokio::test]
async fn a_key_the_sweeper_settled_is_drawn_as_the_sweepers() {
    let app = workshop().await;
    stale_claim(&app, "swept", "ch_swept00000000000000000000", "1 hour").await;
    sqlx::query("UPDATE charges SET metadata = '{\"demo_run\": \"swept\"}' WHERE id = $1")
        .bind("ch_swept00000000000000000000")
        .execute(&app.pool)
        .await
        .unwrap();
    app.sweep_once().await;
    let events = trace(&app, "swept").await;
    assert_eq!(
        marked(&events, "database", Some("sweeper")).len(),
        1,
        "{events:?}"
    );
    assert!(
        events.iter().all(|e| e["mark"] != "effect"),
        "the crashed request never reached the gateway: no money moved"
    );
}

#[tokio::test]
async fn only_a_workshop_server_records_and_only_what_asks_for_it() {
    let plain = spawn_app().await;
    let answer = Answer::of(plain.get("/demo/trace?run=r").await).await;
    answer.assert_problem(404, "route_not_found");

    let app = workshop().await;
    assert_eq!(
        app.post_charge(Some("untraced"), &tagged("quiet"))
            .await
            .status(),
        201
    );
    traced(&app, "/v1/charges", "bad run", "A", "bad").await;
    let events = trace(&app, "quiet").await;
    assert!(
        events.iter().all(|e| e["lane"] != "request"),
        "no request asked to be recorded: {events:?}"
    );
    assert_eq!(events.len(), 1, "only the database's record of the charge");
    Answer::of(app.get("/demo/trace").await)
        .await
        .assert_problem(400, "parameter_missing");
}
