//! The workshop's webhook receivers: the naive one ships for every delivery,
//! the inbox ships once per event id; a bad signature writes nothing; and,
//! end to end, an event the worker delivers three times ships three orders
//! naively and one through the inbox.

use std::time::Duration;

use oncepay::webhooks::signature;
use serde_json::{Value, json};

use crate::helpers::{Answer, Settings, TestApp, spawn_app, spawn_app_with, until};

const SECRET: &str = "whsec_receiverTestSecret0000000000";

fn workshop() -> Settings {
    Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")
}

/// An event about a charge of `run`, as the delivery worker would send it.
fn event(id: &str, run: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "id": id,
        "object": "event",
        "type": "charge.succeeded",
        "data": {"object": {"id": "ch_receiverTest", "object": "charge", "metadata": {"demo_run": run}}},
    }))
    .unwrap()
}

fn signed_now(secret: &str, payload: &[u8]) -> String {
    signature::sign(secret, chrono::Utc::now().timestamp(), payload)
}

/// `POST /demo/receivers` as `api_key`.
async fn register_as(app: &TestApp, api_key: &str, body: &Value) -> Answer {
    Answer::of(
        app.client
            .post(app.url("/demo/receivers"))
            .bearer_auth(api_key)
            .json(body)
            .send()
            .await
            .unwrap(),
    )
    .await
}

/// Sets up the receiver of `run` in `mode` with [`SECRET`]; asserts it worked.
async fn register(app: &TestApp, run: &str, mode: &str, fail_first: i64) -> Value {
    let answer = register_as(
        app,
        &app.api_key,
        &json!({"run": run, "mode": mode, "secret": SECRET, "fail_first": fail_first}),
    )
    .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    answer.json()
}

/// Posts `payload` to the receiver at `path` with the signature `signed`.
async fn deliver(app: &TestApp, path: &str, signed: Option<&str>, payload: &[u8]) -> Answer {
    let mut request = app
        .client
        .post(app.url(path))
        .header("Content-Type", "application/json; charset=utf-8")
        .body(payload.to_vec());
    if let Some(signed) = signed {
        request = request.header("Stripe-Signature", signed);
    }
    Answer::of(request.send().await.unwrap()).await
}

/// `GET /demo/receivers?run=RUN`: the counts.
async fn counts(app: &TestApp, run: &str) -> Value {
    let answer = Answer::of(app.get(&format!("/demo/receivers?run={run}")).await).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    answer.json()
}

/// (deliveries, events, shipments) of one receiver, from the counts.
#[track_caller]
fn of(counts: &Value, mode: &str) -> (i64, i64, i64) {
    let r = &counts["receivers"][mode];
    (
        r["deliveries"].as_i64().unwrap(),
        r["events"].as_i64().unwrap(),
        r["shipments"].as_i64().unwrap(),
    )
}

/// Rows in the receivers' tables, whatever the run.
async fn rows_written(app: &TestApp) -> i64 {
    app.count(
        "SELECT (SELECT count(*) FROM demo_receiver_deliveries) + (SELECT count(*) FROM demo_inbox)
              + (SELECT count(*) FROM demo_shipments)",
    )
    .await
}

#[tokio::test]
async fn the_naive_receiver_ships_every_delivery_and_the_inbox_each_event_once() {
    let app = spawn_app_with(workshop()).await;
    let naive = register(&app, "r1", "naive", 0).await;
    assert_eq!(naive["path"], "/demo/receiver/naive?run=r1");
    register(&app, "r1", "inbox", 0).await;

    let payload = event("evt_receiverTest0000000001", "r1");
    let signed = signed_now(SECRET, &payload);
    let mut shipped = Vec::new();
    for _ in 0..3 {
        for path in ["/demo/receiver/naive?run=r1", "/demo/receiver/inbox?run=r1"] {
            let answer = deliver(&app, path, Some(&signed), &payload).await;
            assert_eq!(answer.status, 200, "{:?}", answer.body);
            shipped.push(answer.json()["shipped"].as_bool().unwrap());
        }
    }
    // Naive, inbox, naive, inbox...: the inbox ships the first time only.
    assert_eq!(shipped, [true, true, true, false, true, false]);

    let counts = counts(&app, "r1").await;
    assert_eq!(of(&counts, "naive"), (3, 1, 3));
    assert_eq!(of(&counts, "inbox"), (3, 1, 1));
    assert_eq!(counts["events"], 1);
    // In the database itself.
    assert_eq!(
        app.count("SELECT count(*) FROM demo_shipments WHERE run = 'r1' AND mode = 'naive'")
            .await,
        3
    );
    assert_eq!(
        app.count("SELECT count(*) FROM demo_shipments WHERE run = 'r1' AND mode = 'inbox'")
            .await,
        1
    );
    assert_eq!(app.count("SELECT count(*) FROM demo_inbox").await, 1);

    // A second event ships once more through each.
    let second = event("evt_receiverTest0000000002", "r1");
    let signed = signed_now(SECRET, &second);
    for path in ["/demo/receiver/naive?run=r1", "/demo/receiver/inbox?run=r1"] {
        assert_eq!(
            deliver(&app, path, Some(&signed), &second).await.status,
            200
        );
    }
    let counts = self::counts(&app, "r1").await;
    assert_eq!(of(&counts, "naive"), (4, 2, 4));
    assert_eq!(of(&counts, "inbox"), (4, 2, 2));
    assert_eq!(counts["events"], 2);
}

#[tokio::test]
async fn a_bad_signature_is_refused_and_writes_nothing() {
    let app = spawn_app_with(workshop()).await;
    register(&app, "r", "naive", 0).await;
    register(&app, "r", "inbox", 0).await;
    let payload = event("evt_receiverTest0000000001", "r");
    let now = chrono::Utc::now().timestamp();
    let tampered = event("evt_receiverTest0000000002", "r");
    let good_for_other = signed_now(SECRET, &tampered);
    let cases: Vec<(&str, Option<String>)> = vec![
        ("no header", None),
        ("another secret", Some(signed_now("whsec_other", &payload))),
        ("another payload", Some(good_for_other)),
        (
            "ten minutes old",
            Some(signature::sign(SECRET, now - 600, &payload)),
        ),
        ("no v1", Some(format!("t={now}"))),
        ("not a signature", Some("nonsense".to_owned())),
    ];
    for mode in ["naive", "inbox"] {
        for (what, signed) in &cases {
            let path = format!("/demo/receiver/{mode}?run=r");
            let answer = deliver(&app, &path, signed.as_deref(), &payload).await;
            answer.assert_problem(400, "webhook_signature_invalid");
            assert!(
                answer.json()["detail"]
                    .as_str()
                    .unwrap()
                    .contains("Nothing was written"),
                "{mode}, {what}"
            );
        }
    }
    assert_eq!(rows_written(&app).await, 0);
    let counts = counts(&app, "r").await;
    assert_eq!(of(&counts, "naive"), (0, 0, 0));
    assert_eq!(of(&counts, "inbox"), (0, 0, 0));
}

#[tokio::test]
async fn fail_first_answers_500_after_the_work_committed_then_200() {
    let app = spawn_app_with(workshop()).await;
    register(&app, "r", "naive", 2).await;
    register(&app, "r", "inbox", 2).await;
    let payload = event("evt_receiverTest0000000001", "r");
    let signed = signed_now(SECRET, &payload);
    for (mode, shipped) in [
        ("naive", [true, true, true]),
        ("inbox", [true, false, false]),
    ] {
        let path = format!("/demo/receiver/{mode}?run=r");
        let mut statuses = Vec::new();
        for (n, shipped) in shipped.into_iter().enumerate() {
            let answer = deliver(&app, &path, Some(&signed), &payload).await;
            statuses.push(answer.status);
            let body = answer.json();
            assert_eq!(body["delivery"], n + 1, "{body}");
            assert_eq!(
                body["shipped"],
                shipped,
                "{mode} delivery {}: {body}",
                n + 1
            );
            if answer.status == 500 {
                answer.assert_problem(500, "receiver_failed_on_purpose");
                assert_eq!(body["event"], "evt_receiverTest0000000001");
            }
        }
        assert_eq!(statuses, [500, 500, 200], "{mode}");
    }
    let counts = counts(&app, "r").await;
    assert_eq!(of(&counts, "naive"), (3, 1, 3));
    assert_eq!(of(&counts, "inbox"), (3, 1, 1));
}

#[tokio::test]
async fn the_crash_fault_answers_200_with_the_header_for_the_first_n() {
    let app = spawn_app_with(workshop().set("FAULT_INJECTION", "true")).await;
    let set_up = register_as(
        &app,
        &app.api_key,
        &json!({"run": "r", "mode": "inbox", "secret": SECRET, "fail_first": 1, "fault": "crash-after-delivery"}),
    )
    .await;
    assert_eq!(set_up.status, 200, "{:?}", set_up.body);
    assert_eq!(set_up.json()["fault"], "crash-after-delivery");
    let payload = event("evt_receiverTest0000000001", "r");
    let signed = signed_now(SECRET, &payload);
    let first = deliver(&app, "/demo/receiver/inbox?run=r", Some(&signed), &payload).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("oncepay-fault"), Some("crash-after-delivery"));
    assert_eq!(first.json()["shipped"], true);
    let second = deliver(&app, "/demo/receiver/inbox?run=r", Some(&signed), &payload).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.header("oncepay-fault"), None);
    assert_eq!(second.json()["shipped"], false);
    assert_eq!(
        counts(&app, "r").await["receivers"]["inbox"]["fault"],
        "crash-after-delivery"
    );

    // Without fault injection the fault is refused.
    let plain = spawn_app_with(workshop()).await;
    register_as(
        &plain,
        &plain.api_key,
        &json!({"run": "r", "mode": "inbox", "secret": SECRET, "fault": "crash-after-delivery"}),
    )
    .await
    .assert_problem(400, "fault_injection_disabled");
}

#[tokio::test]
async fn an_event_about_another_run_is_acknowledged_and_ignored() {
    let app = spawn_app_with(workshop()).await;
    register(&app, "mine", "naive", 2).await;
    for payload in [
        event("evt_receiverTest0000000001", "theirs"),
        br#"{"id":"evt_receiverTest0000000002","data":{"object":{"metadata":{}}}}"#.to_vec(),
    ] {
        let signed = signed_now(SECRET, &payload);
        let answer = deliver(
            &app,
            "/demo/receiver/naive?run=mine",
            Some(&signed),
            &payload,
        )
        .await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.json()["ignored"], true);
    }
    assert_eq!(rows_written(&app).await, 0);
}

#[tokio::test]
async fn bad_input_is_a_problem_with_a_stable_code_never_a_500() {
    let app = spawn_app_with(workshop()).await;
    let ok = json!({"run": "r", "mode": "naive", "secret": SECRET});
    let with = |name: &str, value: Value| {
        let mut body = ok.clone();
        body[name] = value;
        body
    };
    for (body, code, param) in [
        (with("mode", json!("eager")), "receiver_invalid", "mode"),
        (
            with("secret", json!("sk_test_nope")),
            "receiver_invalid",
            "secret",
        ),
        (
            with("fail_first", json!(11)),
            "receiver_invalid",
            "fail_first",
        ),
        (
            with("fail_first", json!("x")),
            "parameter_invalid_integer",
            "fail_first",
        ),
        (
            with("fault", json!("drop-response")),
            "receiver_invalid",
            "fault",
        ),
        (with("run", json!("")), "receiver_invalid", "run"),
        (
            with("run", json!("r".repeat(201))),
            "parameter_too_long",
            "run",
        ),
        (with("run", json!(7)), "parameter_invalid_type", "run"),
        (with("colour", json!("red")), "parameter_unknown", "colour"),
        (
            json!({"mode": "naive", "secret": SECRET}),
            "parameter_missing",
            "run",
        ),
    ] {
        let answer = register_as(&app, &app.api_key, &body).await;
        answer.assert_problem(400, code);
        assert_eq!(answer.json()["param"], param, "{body}");
        assert!(!String::from_utf8_lossy(&answer.body).contains("sk_test_nope"));
    }
    let not_json = Answer::of(
        app.client
            .post(app.url("/demo/receivers"))
            .bearer_auth(&app.api_key)
            .header("Content-Type", "application/json")
            .body("{")
            .send()
            .await
            .unwrap(),
    )
    .await;
    not_json.assert_problem(400, "invalid_json");
    let anonymous = Answer::of(
        app.client
            .post(app.url("/demo/receivers"))
            .json(&ok)
            .send()
            .await
            .unwrap(),
    )
    .await;
    anonymous.assert_problem(401, "authentication_required");
    Answer::of(app.get("/demo/receivers").await)
        .await
        .assert_problem(400, "parameter_missing");
    Answer::of(app.get("/demo/receivers?run=r&x=1").await)
        .await
        .assert_problem(400, "parameter_unknown");

    // The receiving side.
    register(&app, "r", "inbox", 0).await;
    let payload = event("evt_receiverTest0000000001", "r");
    let signed = signed_now(SECRET, &payload);
    let missing = deliver(&app, "/demo/receiver/inbox", Some(&signed), &payload).await;
    missing.assert_problem(400, "parameter_missing");
    let unknown = deliver(
        &app,
        "/demo/receiver/inbox?run=r&x=1",
        Some(&signed),
        &payload,
    )
    .await;
    unknown.assert_problem(400, "parameter_unknown");
    let nobody = deliver(&app, "/demo/receiver/naive?run=r", Some(&signed), &payload).await;
    nobody.assert_problem(400, "resource_missing");
    assert_eq!(nobody.json()["param"], "run");
    let nul = deliver(
        &app,
        "/demo/receiver/inbox?run=r%00",
        Some(&signed),
        &payload,
    )
    .await;
    nul.assert_problem(400, "parameter_invalid_string");
    for (body, code) in [
        (&b"not json"[..], "invalid_json"),
        (b"[1]", "invalid_json"),
        (br#"{"id": 7}"#, "invalid_json"),
        (br#"{"id": "evt\u0000"}"#, "parameter_invalid_string"),
    ] {
        let signed = signed_now(SECRET, body);
        deliver(&app, "/demo/receiver/inbox?run=r", Some(&signed), body)
            .await
            .assert_problem(400, code);
    }
    let invalid_utf8 = Answer::of(
        app.client
            .post(app.url("/demo/receiver/inbox?run=r"))
            .header("Stripe-Signature", &b"t=1,v1=\xff"[..])
            .body(payload.clone())
            .send()
            .await
            .unwrap(),
    )
    .await;
    invalid_utf8.assert_problem(400, "webhook_signature_invalid");
    assert_eq!(rows_written(&app).await, 0);
}

#[tokio::test]
async fn a_runs_receivers_belong_to_the_merchant_that_set_them_up() {
    let app = spawn_app_with(workshop()).await;
    register(&app, "r", "inbox", 0).await;
    let other = app.other_merchant().await;
    let taken = register_as(
        &app,
        &other,
        &json!({"run": "r", "mode": "inbox", "secret": "whsec_theirs"}),
    )
    .await;
    taken.assert_problem(400, "receiver_invalid");
    assert_eq!(taken.json()["param"], "run");
    // Setting up again, by the same merchant, replaces the behaviour.
    assert_eq!(register(&app, "r", "inbox", 3).await["fail_first"], 3);
    let payload = event("evt_receiverTest0000000001", "r");
    let signed = signed_now(SECRET, &payload);
    let answer = deliver(&app, "/demo/receiver/inbox?run=r", Some(&signed), &payload).await;
    answer.assert_problem(500, "receiver_failed_on_purpose");
    // The other merchant sees nothing of the run.
    let theirs = Answer::of(
        app.client
            .get(app.url("/demo/receivers?run=r"))
            .bearer_auth(&other)
            .send()
            .await
            .unwrap(),
    )
    .await
    .json();
    assert_eq!(theirs["receivers"]["inbox"]["registered"], false);
    assert_eq!(of(&theirs, "inbox"), (0, 0, 0));
    assert_eq!(of(&counts(&app, "r").await, "inbox"), (1, 1, 1));
}

#[tokio::test]
async fn a_run_belongs_to_one_merchant_so_another_cannot_take_its_other_mode() {
    let app = spawn_app_with(workshop()).await;
    register(&app, "r", "naive", 0).await;
    let other = app.other_merchant().await;
    let theirs = json!({"run": "r", "mode": "inbox", "secret": "whsec_theirs"});
    let taken = register_as(&app, &other, &theirs).await;
    taken.assert_problem(400, "receiver_invalid");
    assert_eq!(taken.json()["param"], "run");
    // The run's merchant sets up its other mode, and a delivery signed with
    // the other merchant's secret is refused there.
    register(&app, "r", "inbox", 0).await;
    let payload = event("evt_receiverTest0000000001", "r");
    let forged = signed_now("whsec_theirs", &payload);
    deliver(&app, "/demo/receiver/inbox?run=r", Some(&forged), &payload)
        .await
        .assert_problem(400, "webhook_signature_invalid");
    let mine: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM demo_receivers WHERE run = 'r' AND merchant_id = $1",
    )
    .bind(app.merchant_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(mine, 2, "both modes of r are its merchant's");
    assert_eq!(rows_written(&app).await, 0);

    // Two merchants setting up the two modes of a new run at once: one of
    // them has it.
    for i in 0..10 {
        let run = format!("race-{i}");
        let mine = json!({"run": run, "mode": "naive", "secret": SECRET});
        let theirs = json!({"run": run, "mode": "inbox", "secret": "whsec_theirs"});
        let (a, b) = tokio::join!(
            register_as(&app, &app.api_key, &mine),
            register_as(&app, &other, &theirs),
        );
        let mut statuses = [a.status, b.status];
        statuses.sort();
        assert_eq!(statuses, [200, 400], "{run}: {:?} {:?}", a.body, b.body);
        let owners: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT merchant_id) FROM demo_receivers WHERE run = $1",
        )
        .bind(&run)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        assert_eq!(owners, 1, "{run}");
    }
}

#[tokio::test]
async fn the_receivers_are_not_served_unless_enabled() {
    let app = spawn_app().await;
    let payload = event("evt_receiverTest0000000001", "r");
    let signed = signed_now(SECRET, &payload);
    for path in ["/demo/receiver/naive?run=r", "/demo/receiver/inbox?run=r"] {
        deliver(&app, path, Some(&signed), &payload)
            .await
            .assert_problem(404, "route_not_found");
    }
    register_as(
        &app,
        &app.api_key,
        &json!({"run": "r", "mode": "inbox", "secret": SECRET}),
    )
    .await
    .assert_problem(404, "route_not_found");
    Answer::of(app.get("/demo/receivers?run=r").await)
        .await
        .assert_problem(404, "route_not_found");
}

/// Creates a webhook endpoint for `charge.succeeded` at `url`; returns its
/// id and signing secret.
async fn endpoint(app: &TestApp, url: &str) -> (String, String) {
    let created = Answer::of(
        app.client
            .post(app.url("/v1/webhook_endpoints"))
            .bearer_auth(&app.api_key)
            .json(&json!({"url": url, "enabled_events": ["charge.succeeded"]}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(created.status, 201, "{:?}", created.body);
    let created = created.json();
    (
        created["id"].as_str().unwrap().to_owned(),
        created["secret"].as_str().unwrap().to_owned(),
    )
}

#[tokio::test]
async fn an_event_delivered_three_times_ships_three_orders_naively_and_one_through_the_inbox() {
    // The receivers are the server's own, on loopback.
    let app = spawn_app_with(
        workshop()
            .set("WEBHOOK_ALLOW_PRIVATE", "true")
            .set("WEBHOOK_RETRY_BASE", "100ms")
            .set("WEBHOOK_POLL_INTERVAL", "100ms"),
    )
    .await;
    let run = "e2e";
    for mode in ["naive", "inbox"] {
        let (_, secret) =
            endpoint(&app, &app.url(&format!("/demo/receiver/{mode}?run={run}"))).await;
        let set_up = register_as(
            &app,
            &app.api_key,
            &json!({"run": run, "mode": mode, "secret": secret, "fail_first": 2}),
        )
        .await;
        assert_eq!(set_up.status, 200, "{:?}", set_up.body);
    }
    let charge = json!({"amount": 500, "currency": "usd", "source": "tok_visa", "metadata": {"demo_run": run}});
    let charge = Answer::of(app.post_charge(None, &charge).await).await;
    assert_eq!(charge.status, 201, "{:?}", charge.body);
    let event_id: String = sqlx::query_scalar("SELECT id FROM events WHERE object_id = $1")
        .bind(charge.json()["id"].as_str().unwrap())
        .fetch_one(&app.pool)
        .await
        .unwrap();

    let path = format!("/v1/events/{event_id}/deliveries");
    until(Duration::from_secs(30), "both deliveries ended", || async {
        let list = Answer::of(app.get(&path).await).await.json();
        let data = list["data"].as_array().unwrap();
        data.len() == 2 && data.iter().all(|d| d["status"] != "pending")
    })
    .await;
    let list = Answer::of(app.get(&path).await).await.json();
    for delivery in list["data"].as_array().unwrap() {
        assert_eq!(delivery["status"], "succeeded", "{delivery}");
        let statuses: Vec<i64> = delivery["attempts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["response_status"].as_i64().unwrap())
            .collect();
        assert_eq!(statuses, [500, 500, 200], "{delivery}");
    }
    let counts = counts(&app, run).await;
    assert_eq!(of(&counts, "naive"), (3, 1, 3), "{counts}");
    assert_eq!(of(&counts, "inbox"), (3, 1, 1), "{counts}");
    assert_eq!(counts["events"], 1);
    let shipped: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT event_id FROM demo_shipments WHERE run = $1")
            .bind(run)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(shipped, [event_id]);
}
