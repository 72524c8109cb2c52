//! Events: one per final state change, written with the change, holding the
//! object exactly as the API served it then; none for a replay or a second
//! settle, whatever races; listed and read back per merchant.

use std::time::Duration;

use futures::future::join_all;
use serde_json::{Value, json};

use crate::helpers::{
    Answer, Settings, TestApp, migrated_before, spawn_app, spawn_app_with, until, visa,
};
use crate::sweeper::stale_claim;

/// Every event of the app's merchant, newest first, as the API lists them.
async fn all_events(app: &TestApp) -> Vec<Value> {
    app.until_listed().await;
    let list = Answer::of(app.get("/v1/events?limit=100").await).await;
    assert_eq!(list.status, 200, "{:?}", list.body);
    let list = list.json();
    assert_eq!(list["has_more"], false, "fewer than 100 events in a test");
    list["data"].as_array().unwrap().clone()
}

/// The events about `object_id`, oldest first.
async fn events_of(app: &TestApp, object_id: &str) -> Vec<Value> {
    let mut events: Vec<Value> = all_events(app)
        .await
        .into_iter()
        .filter(|e| e["data"]["object"]["id"] == object_id)
        .collect();
    events.reverse();
    events
}

/// The one event about `object_id` of type `kind`.
#[track_caller]
fn the_one<'a>(events: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = events.iter().filter(|e| e["type"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} in {events:?}");
    found[0]
}

/// `GET path` as the app's merchant: the body's bytes and its JSON.
async fn read(app: &TestApp, path: &str) -> (bytes::Bytes, Value) {
    let answer = Answer::of(app.get(path).await).await;
    assert_eq!(answer.status, 200, "{path}: {:?}", answer.body);
    let json = answer.json();
    (answer.body, json)
}

/// Asserts that `event.data.object` is `served`, byte for byte: the object
/// as the API served it at that moment, in the same key order.
#[track_caller]
fn assert_snapshot(event: &Value, served: &[u8]) {
    assert_eq!(
        serde_json::to_string(&event["data"]["object"]).unwrap(),
        String::from_utf8_lossy(served),
        "the snapshot of {}",
        event["type"]
    );
}

/// Sends `POST path` with `body`, an `Idempotency-Key` and an `X-Request-Id`.
async fn post(app: &TestApp, path: &str, key: &str, request_id: &str, body: &Value) -> Answer {
    Answer::of(
        app.client
            .post(app.url(path))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", key)
            .header("X-Request-Id", request_id)
            .json(body)
            .send()
            .await
            .unwrap(),
    )
    .await
}

#[tokio::test]
async fn a_succeeded_charge_writes_one_charge_succeeded_event_holding_the_charge_as_served() {
    let app = spawn_app().await;
    let charge = post(&app, "/v1/charges", "order-1", "req-order-1", &visa(2000)).await;
    assert_eq!(charge.status, 201, "{:?}", charge.body);
    let id = charge.json()["id"].as_str().unwrap().to_owned();
    let (served, _) = read(&app, &format!("/v1/charges/{id}")).await;

    let events = events_of(&app, &id).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let event = &events[0];
    assert_snapshot(event, &served);
    assert_snapshot(event, &charge.body);
    let event_id = event["id"].as_str().unwrap();
    assert!(
        event_id.len() == 28
            && event_id.starts_with("evt_")
            && event_id[4..].bytes().all(|b| b.is_ascii_alphanumeric()),
        "{event_id}"
    );
    assert_eq!(
        *event,
        json!({
            "id": event_id,
            "object": "event",
            "api_version": null,
            "created": event["created"],
            "data": {"object": event["data"]["object"]},
            "livemode": false,
            "pending_webhooks": 0,
            "request": {"id": "req-order-1", "idempotency_key": "order-1"},
            "type": "charge.succeeded",
        })
    );
    let created = event["created"].as_i64().unwrap();
    assert!((charge.json()["created"].as_i64().unwrap() - created).abs() <= 1);

    // Read back alone, byte for byte as listed.
    let (one, _) = read(&app, &format!("/v1/events/{event_id}")).await;
    assert_eq!(one, serde_json::to_vec(event).unwrap());
    // In the database: one row, the merchant's, about the charge.
    let (merchant, object): (uuid::Uuid, String) =
        sqlx::query_as("SELECT merchant_id, object_id FROM events WHERE id = $1")
            .bind(event_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((merchant, object.as_str()), (app.merchant_id, id.as_str()));
    assert_eq!(app.events().await, 1);
}

#[tokio::test]
async fn a_declined_charge_writes_charge_failed_with_its_failure_code() {
    let app = spawn_app().await;
    let body =
        json!({"amount": 900, "currency": "usd", "source": "tok_chargeDeclinedInsufficientFunds"});
    let declined = post(&app, "/v1/charges", "declined", "req-declined", &body).await;
    declined.assert_problem(402, "card_declined");
    let id = declined.json()["charge"].as_str().unwrap().to_owned();
    let (served, charge) = read(&app, &format!("/v1/charges/{id}")).await;
    assert_eq!(charge["status"], "failed");

    let events = events_of(&app, &id).await;
    let event = the_one(&events, "charge.failed");
    assert_eq!(events.len(), 1);
    assert_snapshot(event, &served);
    assert_eq!(event["data"]["object"]["failure_code"], "card_declined");
    assert_eq!(
        event["data"]["object"]["outcome"]["reason"],
        "insufficient_funds"
    );
    assert_eq!(
        event["request"],
        json!({"id": "req-declined", "idempotency_key": "declined"})
    );
}

#[tokio::test]
async fn a_charge_made_without_a_key_names_no_key_in_its_event() {
    let app = spawn_app().await;
    let id = app.paid_charge(100).await;
    let events = events_of(&app, &id).await;
    let event = the_one(&events, "charge.succeeded");
    assert_eq!(event["request"]["idempotency_key"], Value::Null);
    assert!(
        event["request"]["id"].is_string(),
        "the server's own request id"
    );
}

#[tokio::test]
async fn each_refund_writes_refund_created_and_charge_refunded_with_the_charge_as_it_stood() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;

    // A partial refund, then the rest: Stripe sends charge.refunded for both.
    let mut served_charges = Vec::new();
    let mut refunds = Vec::new();
    for (key, amount) in [("refund-1", json!(500)), ("refund-2", Value::Null)] {
        let mut body = json!({"charge": charge});
        if !amount.is_null() {
            body["amount"] = amount;
        }
        let refund = post(&app, "/v1/refunds", key, &format!("req-{key}"), &body).await;
        assert_eq!(refund.status, 201, "{:?}", refund.body);
        let id = refund.json()["id"].as_str().unwrap().to_owned();
        let (served_refund, _) = read(&app, &format!("/v1/refunds/{id}")).await;
        served_charges.push(read(&app, &format!("/v1/charges/{charge}")).await);

        let events = events_of(&app, &id).await;
        assert_eq!(events.len(), 1, "{events:?}");
        let event = the_one(&events, "refund.created");
        assert_snapshot(event, &served_refund);
        assert_eq!(
            event["request"],
            json!({"id": format!("req-{key}"), "idempotency_key": key})
        );
        refunds.push(id);
    }

    let events = events_of(&app, &charge).await;
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        ["charge.succeeded", "charge.refunded", "charge.refunded"]
    );
    for (event, (served, json)) in events[1..].iter().zip(&served_charges) {
        assert_snapshot(event, served);
        assert_eq!(
            event["data"]["object"]["amount_refunded"],
            json["amount_refunded"]
        );
    }
    assert_eq!(events[1]["data"]["object"]["refunded"], false);
    assert_eq!(events[2]["data"]["object"]["refunded"], true);
    assert_eq!(
        events[2]["request"],
        json!({"id": "req-refund-2", "idempotency_key": "refund-2"}),
        "charge.refunded names the refund's request"
    );

    // The whole list, newest first: each refund's pair, written together.
    let all: Vec<(String, String)> = all_events(&app)
        .await
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_owned(),
                e["data"]["object"]["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expected = [
        ("charge.refunded", &charge),
        ("refund.created", &refunds[1]),
        ("charge.refunded", &charge),
        ("refund.created", &refunds[0]),
        ("charge.succeeded", &charge),
    ]
    .map(|(t, id)| (t.to_owned(), id.clone()));
    assert_eq!(all, expected);
}

#[tokio::test]
async fn a_refused_refund_writes_refund_failed_and_no_charge_refunded() {
    let app = spawn_app().await;
    let charge = Answer::of(
        app.post_charge(
            None,
            &json!({"amount": 1000, "currency": "usd", "source": "tok_refundFail"}),
        )
        .await,
    )
    .await;
    assert_eq!(charge.status, 201);
    let charge = charge.json()["id"].as_str().unwrap().to_owned();

    let refused = post(
        &app,
        "/v1/refunds",
        "refused",
        "req-refused",
        &json!({"charge": charge}),
    )
    .await;
    assert_eq!(refused.status, 201, "{:?}", refused.body);
    assert_eq!(refused.json()["status"], "failed");
    let id = refused.json()["id"].as_str().unwrap().to_owned();
    let (served, _) = read(&app, &format!("/v1/refunds/{id}")).await;

    let events = events_of(&app, &id).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let event = the_one(&events, "refund.failed");
    assert_snapshot(event, &served);
    assert_eq!(event["data"]["object"]["failure_reason"], "declined");
    let charge_events = events_of(&app, &charge).await;
    let types: Vec<&str> = charge_events
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["charge.succeeded"], "nothing was refunded");

    // The amount was given back: refunding it again succeeds, with its pair.
    let again = post(
        &app,
        "/v1/refunds",
        "again",
        "req-again",
        &json!({"charge": charge}),
    )
    .await;
    assert_eq!(again.json()["status"], "succeeded");
    assert_eq!(
        app.event_types_of(&charge).await,
        ["charge.succeeded", "charge.refunded"]
    );
}

#[tokio::test]
async fn an_attempt_the_sweeper_abandons_writes_charge_failed_naming_no_request() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1s")).await;
    stale_claim(&app, "crashed", "ch_eventsabandonedcharge0001", "1 minute").await;
    assert_eq!(app.events().await, 0, "a pending charge has no event");

    let report = app.sweep_once().await;
    assert_eq!(report.settled_failed, 1);
    let (served, _) = read(&app, "/v1/charges/ch_eventsabandonedcharge0001").await;
    let events = events_of(&app, "ch_eventsabandonedcharge0001").await;
    assert_eq!(events.len(), 1, "{events:?}");
    let event = the_one(&events, "charge.failed");
    assert_snapshot(event, &served);
    assert_eq!(
        event["data"]["object"]["failure_code"],
        "processing_abandoned"
    );
    assert_eq!(
        event["request"],
        json!({"id": null, "idempotency_key": "crashed"}),
        "the sweeper settled it; the key names the operation"
    );

    // Later passes and the retry's replay write nothing more.
    assert_eq!(app.sweep_once().await.settled_failed, 0);
    let retry = Answer::of(app.post_charge(Some("crashed"), &visa(2000)).await).await;
    retry.assert_problem(402, "processing_abandoned");
    assert!(retry.replayed());
    assert_eq!(app.events().await, 1);
}

#[tokio::test]
async fn a_retry_that_settles_its_stale_key_writes_the_event_naming_itself() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1s")).await;
    stale_claim(&app, "stuck", "ch_eventsstuckcharge000000001", "1 minute").await;

    let retry = post(&app, "/v1/charges", "stuck", "req-retry", &visa(2000)).await;
    retry.assert_problem(402, "processing_abandoned");
    assert!(retry.replayed());
    let events = events_of(&app, "ch_eventsstuckcharge000000001").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        the_one(&events, "charge.failed")["request"],
        json!({"id": "req-retry", "idempotency_key": "stuck"})
    );
    assert_eq!(app.sweep_once().await.settled_failed, 0);
    assert_eq!(app.events().await, 1);
}

#[tokio::test]
async fn replays_write_no_event() {
    let app = spawn_app().await;
    for _ in 0..3 {
        let answer = Answer::of(app.post_charge(Some("once"), &visa(700)).await).await;
        assert_eq!(answer.status, 201);
    }
    let declined = json!({"amount": 700, "currency": "usd", "source": "tok_chargeDeclined"});
    for _ in 0..3 {
        let answer = Answer::of(app.post_charge(Some("declined"), &declined).await).await;
        answer.assert_problem(402, "card_declined");
    }
    let charge = app.paid_charge(700).await;
    let refund = json!({"charge": charge, "amount": 100});
    for _ in 0..3 {
        let answer = Answer::of(app.post_refund(Some("refund"), &refund).await).await;
        assert_eq!(answer.status, 201);
    }
    assert_eq!(app.charges().await, 3);
    assert_eq!(app.refunds().await, 1);
    // A charge each, and the refund's pair.
    assert_eq!(app.events().await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_requests_with_one_key_write_one_event() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 300)).await;
    let answers =
        join_all((0..50).map(|_| async {
            Answer::of(app.post_charge(Some("storm"), &visa(2000)).await).await
        }))
        .await;
    assert!(
        answers.iter().any(|a| a.status == 409),
        "the race overlapped"
    );
    let charge = answers.iter().find(|a| a.status == 201).unwrap().json();
    let charge = charge["id"].as_str().unwrap();

    let charge_ids: Vec<String> = sqlx::query_scalar("SELECT id FROM charges")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(charge_ids, [charge]);
    assert_eq!(app.event_types_of(charge).await, ["charge.succeeded"]);
    assert_eq!(app.events().await, 1);
    let events = events_of(&app, charge).await;
    assert_eq!(events[0]["request"]["idempotency_key"], "storm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_and_the_sweeper_settling_one_charge_at_once_write_one_event() {
    // As in the sweeper's tests: the request stalls at the processor past
    // the sweeper's timeout, the sweeper voids and settles the charge, and
    // the request's own settle then finds it settled.
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 2000)).await;
    let stalled_for = Duration::from_millis(300);
    let request = async { Answer::of(app.post_charge(Some("slow"), &visa(2000)).await).await };
    let sweep = async {
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
    assert_eq!(report.settled_failed, 1);
    answer.assert_problem(402, "processing_abandoned");
    let charge = answer.json()["charge"].as_str().unwrap().to_owned();

    let events = events_of(&app, &charge).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let event = the_one(&events, "charge.failed");
    assert_eq!(event["request"]["id"], Value::Null, "the sweeper's");
    assert_eq!(app.events().await, 1);
}

#[tokio::test]
async fn a_settle_whose_event_cannot_be_written_changes_nothing_until_recovery_writes_both() {
    let app = spawn_app().await;
    // Every event insert fails while this trigger is there.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_events() RETURNS trigger LANGUAGE plpgsql
             AS $$ BEGIN RAISE EXCEPTION 'events refused'; END $$;
         CREATE TRIGGER refuse_events BEFORE INSERT ON events
             FOR EACH ROW EXECUTE FUNCTION refuse_events();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let failed = Answer::of(app.post_charge(Some("atomic"), &visa(2000)).await).await;
    failed.assert_problem(500, "internal_error");

    // The settle rolled back whole: the charge is pending, its key processing.
    let (status, key): (String, String) = sqlx::query_as(
        "SELECT c.status, k.status FROM charges c JOIN idempotency_keys k ON k.charge_id = c.id",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), key.as_str()), ("pending", "processing"));
    assert_eq!(app.events().await, 0);
    assert_eq!(app.payments().await, 1, "the processor did take the money");

    // Once events can be written, recovery settles the charge with its event.
    sqlx::raw_sql("DROP TRIGGER refuse_events ON events")
        .execute(&app.pool)
        .await
        .unwrap();
    let report = app.sweep_once_with_timeout(Duration::from_millis(1)).await;
    assert_eq!(report.settled_succeeded, 1, "{report:?}");
    let retry = Answer::of(app.post_charge(Some("atomic"), &visa(2000)).await).await;
    assert_eq!(retry.status, 201);
    let id = retry.json()["id"].as_str().unwrap().to_owned();
    let events = events_of(&app, &id).await;
    assert_eq!(
        the_one(&events, "charge.succeeded")["request"],
        json!({"id": null, "idempotency_key": "atomic"})
    );
}

#[tokio::test]
async fn the_list_is_newest_first_and_pages_both_ways() {
    let app = spawn_app().await;
    let mut charges = Vec::new();
    for amount in 51..=55 {
        charges.push(app.paid_charge(amount).await);
    }
    // Newest first: the events of charges 5, 4, 3, 2, 1.
    let ids: Vec<String> = all_events(&app)
        .await
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    let page = |query: String| {
        let app = &app;
        async move {
            let answer = Answer::of(app.get(&format!("/v1/events?{query}")).await).await;
            assert_eq!(answer.status, 200, "{query}: {:?}", answer.body);
            let body = answer.json();
            assert_eq!(
                (&body["object"], &body["url"]),
                (&json!("list"), &json!("/v1/events"))
            );
            let data: Vec<String> = body["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["id"].as_str().unwrap().to_owned())
                .collect();
            (data, body["has_more"].as_bool().unwrap())
        }
    };
    let amounts: Vec<i64> = all_events(&app)
        .await
        .iter()
        .map(|e| e["data"]["object"]["amount"].as_i64().unwrap())
        .collect();
    assert_eq!(amounts, [55, 54, 53, 52, 51]);

    assert_eq!(page("limit=2".into()).await, (ids[0..2].to_vec(), true));
    assert_eq!(
        page(format!("limit=2&starting_after={}", ids[1])).await,
        (ids[2..4].to_vec(), true)
    );
    assert_eq!(
        page(format!("limit=2&starting_after={}", ids[3])).await,
        (ids[4..].to_vec(), false)
    );
    // Backwards from the oldest: the page just newer than it, newest first.
    assert_eq!(
        page(format!("limit=2&ending_before={}", ids[4])).await,
        (ids[2..4].to_vec(), true)
    );
    assert_eq!(
        page(format!("limit=2&ending_before={}", ids[2])).await,
        (ids[0..2].to_vec(), false)
    );
    assert_eq!(page(String::new()).await, (ids.clone(), false));
    assert_eq!(page("limit=5".into()).await, (ids.clone(), false));
}

#[tokio::test]
async fn the_list_filters_by_type() {
    let app = spawn_app().await;
    let paid = app.paid_charge(1000).await;
    let declined = json!({"amount": 500, "currency": "usd", "source": "tok_chargeDeclined"});
    Answer::of(app.post_charge(None, &declined).await)
        .await
        .assert_problem(402, "card_declined");
    let refund = Answer::of(
        app.post_refund(None, &json!({"charge": paid, "amount": 100}))
            .await,
    )
    .await;
    assert_eq!(refund.status, 201);
    app.until_listed().await;

    let types = |query: &'static str| {
        let app = &app;
        async move {
            let answer = Answer::of(app.get(&format!("/v1/events?{query}")).await).await;
            assert_eq!(answer.status, 200, "{query}: {:?}", answer.body);
            answer.json()["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["type"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(types("type=charge.failed").await, ["charge.failed"]);
    assert_eq!(types("type=refund.failed").await, Vec::<String>::new());
    assert_eq!(
        types("types[]=charge.succeeded&types[]=charge.refunded").await,
        ["charge.refunded", "charge.succeeded"]
    );
    assert_eq!(
        types("types[0]=refund.created&types[1]=charge.failed").await,
        ["refund.created", "charge.failed"]
    );
    assert_eq!(types("").await.len(), 4);

    // Paging within a filter skips the other types.
    let first = Answer::of(app.get("/v1/events?type=charge.succeeded").await)
        .await
        .json();
    let cursor = first["data"][0]["id"].as_str().unwrap();
    let after = Answer::of(
        app.get(&format!(
            "/v1/events?type=charge.succeeded&ending_before={cursor}"
        ))
        .await,
    )
    .await
    .json();
    assert_eq!(
        (&after["data"], &after["has_more"]),
        (&json!([]), &json!(false))
    );
}

#[tokio::test]
async fn the_list_filters_by_stripes_refund_types_and_refuses_refund_succeeded() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    let body = json!({"charge": charge, "amount": 500});
    let refund = Answer::of(app.post_refund(None, &body).await).await;
    assert_eq!(refund.status, 201, "{:?}", refund.body);
    app.until_listed().await;
    for (query, listed) in [
        ("type=refund.created", vec!["refund.created"]),
        ("type=refund.*", vec!["refund.created"]),
        ("type=refund.updated", vec![]),
        ("type=refund.failed", vec![]),
        ("type=charge.refund.updated", vec![]),
        (
            "types[]=refund.created&types[]=charge.refund.updated",
            vec!["refund.created"],
        ),
    ] {
        let answer = Answer::of(app.get(&format!("/v1/events?{query}")).await).await;
        assert_eq!(answer.status, 200, "{query}: {:?}", answer.body);
        let types: Vec<Value> = answer.json()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["type"].clone())
            .collect();
        assert_eq!(types, listed, "{query}");
    }
    // Stripe has no `refund.succeeded`, and no code `invalid_event_type`:
    // the code is oncepay's own, with no page of Stripe's to point to.
    let old = Answer::of(app.get("/v1/events?type=refund.succeeded").await).await;
    old.assert_problem(400, "invalid_event_type");
    assert_eq!(old.json()["error"]["doc_url"], Value::Null);
}

#[tokio::test]
async fn another_merchants_events_are_not_found_and_not_listed() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    let event = events_of(&app, &charge).await[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let other = app.other_merchant().await;
    let get_as = |path: String| {
        let app = &app;
        let other = other.clone();
        async move {
            Answer::of(
                app.client
                    .get(app.url(&path))
                    .bearer_auth(&other)
                    .send()
                    .await
                    .unwrap(),
            )
            .await
        }
    };
    let one = get_as(format!("/v1/events/{event}")).await;
    one.assert_problem(404, "resource_missing");
    assert_eq!(one.json()["param"], "id");
    let list = get_as("/v1/events".into()).await;
    assert_eq!(list.status, 200);
    assert_eq!(list.json()["data"], json!([]));
    for cursor in ["starting_after", "ending_before"] {
        let page = get_as(format!("/v1/events?{cursor}={event}")).await;
        page.assert_problem(400, "resource_missing");
        assert_eq!(page.json()["param"], cursor);
    }
}

#[tokio::test]
async fn unknown_events_and_bad_list_parameters_are_problems() {
    let app = spawn_app().await;
    let unknown = Answer::of(app.get("/v1/events/evt_000000000000000000000000").await).await;
    unknown.assert_problem(404, "resource_missing");
    for (query, code) in [
        ("limit=0", "parameter_invalid_integer"),
        ("limit=abc", "parameter_invalid_integer"),
        ("type=charge.created", "invalid_event_type"),
        ("types[]=nope", "invalid_event_type"),
        (
            "type=charge.failed&types[]=charge.failed",
            "parameters_exclusive",
        ),
        (
            "starting_after=evt_a&ending_before=evt_b",
            "parameters_exclusive",
        ),
        (
            "starting_after=evt_000000000000000000000000",
            "resource_missing",
        ),
        ("starting_after=%00", "parameter_invalid_string"),
        ("created[after]=1", "parameter_unknown"),
    ] {
        Answer::of(app.get(&format!("/v1/events?{query}")).await)
            .await
            .assert_problem(400, code);
    }
    let without_a_key =
        Answer::of(app.client.get(app.url("/v1/events")).send().await.unwrap()).await;
    without_a_key.assert_problem(401, "authentication_required");
}

#[tokio::test]
async fn the_events_routes_refuse_unknown_repeated_and_expand_parameters_like_every_route() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    let event = events_of(&app, &charge).await[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let many_types = vec!["types[]=charge.failed"; 21].join("&");
    let cases = [
        (
            format!("/v1/events/{event}?foo=1"),
            "parameter_unknown",
            "foo",
        ),
        (
            format!("/v1/events/{event}?limit=1"),
            "parameter_unknown",
            "limit",
        ),
        (
            format!("/v1/events/{event}?expand[]=data.object"),
            "property_not_expandable",
            "expand",
        ),
        (
            format!("/v1/events/{event}/deliveries?foo=1"),
            "parameter_unknown",
            "foo",
        ),
        (
            "/v1/events?limit=1&limit=2".into(),
            "parameter_duplicate",
            "limit",
        ),
        (
            "/v1/events?type=charge.failed&type=charge.succeeded".into(),
            "parameter_duplicate",
            "type",
        ),
        (
            format!("/v1/events?ending_before={event}&ending_before={event}"),
            "parameter_duplicate",
            "ending_before",
        ),
        (
            "/v1/events?types[0]=charge.failed&types[0]=refund.failed".into(),
            "parameter_duplicate",
            "types[0]",
        ),
        (
            "/v1/events?types[]=charge.failed&types[0]=refund.failed".into(),
            "parameter_duplicate",
            "types",
        ),
        (
            "/v1/events?expand[]=data.object".into(),
            "property_not_expandable",
            "expand",
        ),
        (
            "/v1/events?expand[0]=data&limit=3".into(),
            "property_not_expandable",
            "expand",
        ),
        (
            "/v1/events?expand[x]=y".into(),
            "parameter_unknown",
            "expand[x]",
        ),
        (
            "/v1/events?types[x]=charge.failed".into(),
            "parameter_unknown",
            "types[x]",
        ),
        (
            "/v1/events?types=charge.failed".into(),
            "parameter_invalid_type",
            "types",
        ),
        (
            "/v1/events?type[]=charge.failed".into(),
            "parameter_invalid_type",
            "type",
        ),
        (
            format!("/v1/events?{many_types}"),
            "parameter_too_long",
            "types",
        ),
    ];
    for (path, code, param) in cases {
        let answer = Answer::of(app.get(&path).await).await;
        answer.assert_problem(400, code);
        assert_eq!(answer.json()["param"], param, "{path}");
    }
}

#[tokio::test]
async fn migrating_renames_refund_succeeded_to_refund_created_wherever_it_is_stored() {
    let (_db, pool) = migrated_before("20261216000200").await;
    let (merchant, _) = oncepay::merchants::create(&pool, "m").await.unwrap();
    let (evt, re) = (
        format!("evt_{}", "a".repeat(24)),
        format!("re_{}", "a".repeat(24)),
    );
    sqlx::raw_sql(&format!(
        "INSERT INTO events (id, merchant_id, type, object_id, data)
         VALUES ('{evt}', '{m}', 'refund.succeeded', '{re}', '{{}}');
         INSERT INTO webhook_endpoints (id, merchant_id, url, enabled_events, secret)
         VALUES ('we_{a}', '{m}', 'https://example.com/a',
                 '{{charge.succeeded,refund.succeeded,refund.updated}}', 'whsec_{s}'),
                ('we_{b}', '{m}', 'https://example.com/b', '{{*}}', 'whsec_{s}');
         INSERT INTO ledger_entries (consumer, event_id, merchant_id, object_id, type, amount,
                                     currency)
         VALUES ('ledger', '{evt}', '{m}', '{re}', 'refund.succeeded', -500, 'usd');",
        m = merchant.id,
        a = "a".repeat(24),
        b = "b".repeat(24),
        s = "s".repeat(32),
    ))
    .execute(&pool)
    .await
    .unwrap();

    oncepay::db::migrate(&pool).await.unwrap();
    let one = |sql: &'static str| {
        let pool = &pool;
        async move {
            sqlx::query_scalar::<_, String>(sql)
                .fetch_one(pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(one("SELECT type FROM events").await, "refund.created");
    assert_eq!(
        one("SELECT type FROM ledger_entries").await,
        "refund.created"
    );
    let enabled: Vec<Vec<String>> =
        sqlx::query_scalar("SELECT enabled_events FROM webhook_endpoints ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        enabled,
        [
            vec!["charge.succeeded", "refund.created", "refund.updated"],
            vec!["*"]
        ]
    );
    // A refund reaches its final state once: a second refund.created of it
    // is refused, as a second refund.succeeded was.
    let again = sqlx::query(
        "INSERT INTO events (id, merchant_id, type, object_id, data)
         VALUES ($1, $2, 'refund.created', $3, '{}')",
    )
    .bind(format!("evt_{}", "b".repeat(24)))
    .bind(merchant.id)
    .bind(&re)
    .execute(&pool)
    .await;
    assert!(again.is_err(), "{again:?}");
    pool.close().await;
}
