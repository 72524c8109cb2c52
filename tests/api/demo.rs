//! The workshop routes: the effect counter, the lab page, and the naive
//! endpoint that double-charges on purpose.

use serde_json::json;

use crate::helpers::{Answer, Settings, TestApp, spawn_app, spawn_app_with};

fn tagged(run: &str) -> serde_json::Value {
    json!({"amount": 500, "currency": "usd", "source": "tok_visa", "metadata": {"demo_run": run}})
}

async fn naive(app: &TestApp, key: &str, run: &str) -> Answer {
    let response = app
        .client
        .post(app.url("/demo/naive/charges"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", key)
        .json(&tagged(run))
        .send()
        .await
        .unwrap();
    Answer::of(response).await
}

#[tokio::test]
async fn the_naive_endpoint_does_not_exist_unless_enabled() {
    let app = spawn_app().await;
    naive(&app, "k", "r")
        .await
        .assert_problem(404, "route_not_found");
    assert_eq!(app.charges().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_naive_endpoint_charges_twice_when_two_requests_race_on_one_key() {
    let app = spawn_app_with(
        Settings::new()
            .set("DEMO_UNSAFE_ENDPOINTS", "true")
            .set("PROCESSOR_LATENCY_MS", 500),
    )
    .await;
    let (a, b) = tokio::join!(naive(&app, "race", "naive"), naive(&app, "race", "naive"));
    assert_eq!((a.status, b.status), (201, 201));
    assert_ne!(
        a.json()["id"],
        b.json()["id"],
        "the bug: two charges for one key"
    );
    assert_eq!(app.payments().await, 2);
    // Sequential retries do replay: the bug needs the race.
    let retry = naive(&app, "race", "naive").await;
    assert!(retry.replayed());
    assert_eq!(app.payments().await, 2);

    // The real endpoint, same race, same latency: one effect.
    let body = tagged("real");
    let (a, b) = tokio::join!(
        app.post_charge(Some("race-real"), &body),
        app.post_charge(Some("race-real"), &body)
    );
    let statuses = [a.status().as_u16(), b.status().as_u16()];
    assert!(
        statuses.contains(&201) && statuses.contains(&409),
        "{statuses:?}"
    );
    assert_eq!(app.payments().await, 3);
}

#[tokio::test]
async fn the_effect_counter_reads_the_database_per_run() {
    let app = spawn_app().await;
    for _ in 0..2 {
        assert_eq!(app.post_charge(None, &tagged("one")).await.status(), 201);
    }
    let declined = json!({"amount": 500, "currency": "usd", "source": "tok_chargeDeclined", "metadata": {"demo_run": "one"}});
    assert_eq!(app.post_charge(None, &declined).await.status(), 402);
    assert_eq!(app.post_charge(None, &tagged("two")).await.status(), 201);

    let one = Answer::of(app.get("/demo/effects?run=one").await)
        .await
        .json();
    assert_eq!(
        (one["payments"].as_i64(), one["charges"].as_i64()),
        (Some(2), Some(3))
    );
    assert_eq!(
        (one["succeeded"].as_i64(), one["failed"].as_i64()),
        (Some(2), Some(1))
    );
    let two = Answer::of(app.get("/demo/effects?run=two").await)
        .await
        .json();
    assert_eq!(
        (two["payments"].as_i64(), two["charges"].as_i64()),
        (Some(1), Some(1))
    );
    let other = app.other_merchant().await;
    let theirs = app
        .client
        .get(app.url("/demo/effects?run=one"))
        .bearer_auth(other)
        .send()
        .await
        .unwrap();
    assert_eq!(Answer::of(theirs).await.json()["payments"], 0);
    Answer::of(app.get("/demo/effects?run=one&nope=1").await)
        .await
        .assert_problem(400, "parameter_unknown");
}

#[tokio::test]
async fn the_effect_counter_needs_a_run_and_reads_only_that_runs_charges() {
    let app = spawn_app().await;
    let missing = Answer::of(app.get("/demo/effects").await).await;
    missing.assert_problem(400, "parameter_missing");
    assert_eq!(missing.json()["param"], "run");

    // A long history of real charges, and one small tagged run.
    sqlx::query(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, metadata, status)
         SELECT 'ch_history' || lpad(i::text, 14, '0'), $1, 100, 'usd', 'tok_visa',
                CASE WHEN i <= 3 THEN '{\"demo_run\": \"small\"}'::jsonb ELSE '{}'::jsonb END,
                'succeeded'
           FROM generate_series(1, 20000) i",
    )
    .bind(app.merchant_id)
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE charges")
        .execute(&app.pool)
        .await
        .unwrap();
    // The tagged charges through their index, each payment by its key: no
    // table is read whole.
    let plan: Vec<String> =
        sqlx::query_scalar(&format!("EXPLAIN {}", oncepay::workshop::effects_sql()))
            .bind(app.merchant_id)
            .bind("small")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    let plan = plan.join("\n");
    assert!(
        plan.contains("charges_demo_run_idx") && !plan.contains("Seq Scan"),
        "{plan}"
    );
    let small = Answer::of(app.get("/demo/effects?run=small").await)
        .await
        .json();
    assert_eq!(small["charges"], 3);
}

#[tokio::test]
async fn the_lab_page_is_served_without_authentication() {
    let app = spawn_app().await;
    let page = app.client.get(app.url("/lab")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(
        page.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let html = page.text().await.unwrap();
    assert!(html.contains("oncepay"));
    // The SVG namespace is a name the drawings are made in, not an address
    // the page loads; nothing else may point off the machine.
    let loads = html.replace("\"http://www.w3.org/2000/svg\"", "");
    assert!(
        !loads.contains("http://") && !loads.contains("https://"),
        "nothing from the internet"
    );
}

async fn processor_payment(app: &TestApp, run: &str, keys: &str) -> Answer {
    let response = app
        .client
        .post(app.url("/demo/processor/payments"))
        .bearer_auth(&app.api_key)
        .json(&json!({"run": run, "keys": keys, "amount": 700}))
        .send()
        .await
        .unwrap();
    Answer::of(response).await
}

#[tokio::test]
async fn a_new_processor_key_per_attempt_pays_twice_when_the_answer_is_lost_and_the_same_key_once()
{
    let app = spawn_app_with(
        Settings::new()
            .set("DEMO_UNSAFE_ENDPOINTS", "true")
            .set("FAULT_INJECTION", "true"),
    )
    .await;

    let same = processor_payment(&app, "same", "same").await;
    assert_eq!(same.status, 200, "{:?}", same.json());
    let attempts = same.json()["attempts"].clone();
    assert_eq!(
        attempts,
        json!([
            {"processor_key": "demo:same", "answer_dropped": true, "answer": "no answer"},
            {"processor_key": "demo:same", "answer_dropped": false, "answer": "succeeded"},
        ])
    );
    assert_eq!(app.payments().await, 1, "the repeat found the payment");

    let new = processor_payment(&app, "new", "new_per_attempt").await;
    assert_eq!(new.status, 200, "{:?}", new.json());
    assert_eq!(
        new.json()["attempts"],
        json!([
            {"processor_key": "demo:new:attempt-1", "answer_dropped": true, "answer": "no answer"},
            {"processor_key": "demo:new:attempt-2", "answer_dropped": false, "answer": "succeeded"},
        ])
    );
    assert_eq!(app.payments().await, 3, "the bug: a second payment");

    // The counts, from the gateway's ledger, per run.
    let counted = Answer::of(app.get("/demo/processor/payments?run=same").await).await;
    assert_eq!(
        (
            counted.json()["payments"].clone(),
            counted.json()["charged"].clone()
        ),
        (json!(1), json!(700))
    );
    let counted = Answer::of(app.get("/demo/processor/payments?run=new").await).await;
    assert_eq!(
        counted.json()["keys"],
        json!(["demo:new:attempt-1", "demo:new:attempt-2"])
    );
    assert_eq!(counted.json()["payments"], 2);
}

#[tokio::test]
async fn the_processor_key_scenario_needs_fault_injection_and_a_plain_run() {
    let app = spawn_app_with(Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")).await;
    processor_payment(&app, "r", "same")
        .await
        .assert_problem(400, "fault_injection_disabled");
    processor_payment(&app, "a:b", "same")
        .await
        .assert_problem(400, "parameter_invalid_string");
    processor_payment(&app, "r", "sometimes")
        .await
        .assert_problem(400, "parameter_invalid_string");
    assert_eq!(app.processor_operations().await, 0);
    let off = spawn_app().await;
    processor_payment(&off, "r", "same")
        .await
        .assert_problem(404, "route_not_found");
}
