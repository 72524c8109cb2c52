//! Authorize now, capture later: a charge made with `capture=false` holds
//! its amount until `POST /v1/charges/{id}/capture` takes all or part of it,
//! once, whatever keys and races ask; a refund before releases it whole.

use futures::future::join_all;
use reqwest::Response;
use serde_json::{Value, json};

use crate::helpers::{Answer, TestApp, migrated_before, spawn_app, visa};

/// An authorized, uncaptured `tok_visa` charge of `amount`; returns its id.
pub(crate) async fn authorized_charge(app: &TestApp, amount: i64) -> String {
    let mut body = visa(amount);
    body["capture"] = json!(false);
    let charge = Answer::of(app.post_charge(None, &body).await).await;
    assert_eq!(charge.status, 201, "{:?}", charge.body);
    let charge = charge.json();
    assert_eq!(charge["captured"], false);
    assert_eq!(charge["paid"], true);
    assert_eq!(charge["amount_captured"], 0);
    assert_eq!(charge["balance_transaction"], Value::Null);
    charge["id"].as_str().unwrap().to_owned()
}

/// `POST /v1/charges/{id}/capture` with a JSON body.
pub(crate) async fn post_capture(
    app: &TestApp,
    id: &str,
    key: Option<&str>,
    body: &Value,
) -> Response {
    let mut request = app
        .client
        .post(app.url(&format!("/v1/charges/{id}/capture")))
        .bearer_auth(&app.api_key)
        .json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.expect("send the request")
}

/// What a capture's claim does to the charge, as if an hour ago: `amount`
/// reserved, nothing settled yet.
pub(crate) async fn reserve_capture_an_hour_ago(app: &TestApp, id: &str, amount: i64) {
    sqlx::query(
        "UPDATE charges SET capture_amount = $2, capture_asked_at = now() - interval '1 hour'
          WHERE id = $1",
    )
    .bind(id)
    .bind(amount)
    .execute(&app.pool)
    .await
    .unwrap();
}

/// Captures recorded at the card gateway.
async fn processor_captures(app: &TestApp) -> i64 {
    app.processor_count("SELECT count(*) FROM operations WHERE kind = 'capture'")
        .await
}

#[tokio::test]
async fn a_charge_made_with_capture_false_is_paid_only_once_captured() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    assert_eq!(processor_captures(&app).await, 0);

    let captured = Answer::of(post_capture(&app, &id, Some("cap-1"), &json!({})).await).await;
    assert_eq!(captured.status, 200, "{:?}", captured.body);
    let charge = captured.json();
    assert_eq!(charge["captured"], true);
    assert_eq!(charge["amount_captured"], 2000);
    assert_eq!(charge["amount_refunded"], 0);
    assert!(charge["balance_transaction"].is_string());
    assert_eq!(processor_captures(&app).await, 1);
    assert_eq!(
        app.event_types_of(&id).await,
        ["charge.succeeded", "charge.captured"]
    );
    let stored = Answer::of(app.get(&format!("/v1/charges/{id}")).await).await;
    assert_eq!(stored.json()["captured"], true);

    let again = Answer::of(post_capture(&app, &id, Some("cap-1"), &json!({})).await).await;
    assert!(again.replayed());
    assert_eq!(again.body, captured.body);
    assert_eq!(processor_captures(&app).await, 1);
}

#[tokio::test]
async fn sixteen_captures_racing_with_one_key_capture_the_charge_once() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    let answers = join_all((0..16).map(|_| async {
        Answer::of(post_capture(&app, &id, Some("one"), &json!({})).await).await
    }))
    .await;
    for answer in &answers {
        assert!(
            answer.status == 200 || answer.status == 409,
            "{} {:?}",
            answer.status,
            answer.body
        );
    }
    assert!(answers.iter().any(|a| a.status == 200));
    assert_eq!(processor_captures(&app).await, 1);
    assert_eq!(
        app.count("SELECT count(*) FROM events WHERE type = 'charge.captured'")
            .await,
        1
    );
    let key = Answer::of(app.get("/v1/idempotency_keys/one").await)
        .await
        .json();
    assert_eq!(
        (&key["capture"], &key["charge"], &key["refund"]),
        (&json!(id), &Value::Null, &Value::Null),
        "the key names the capture it guards"
    );
}

#[tokio::test]
async fn sixteen_captures_racing_with_sixteen_keys_capture_once_and_never_more_than_authorized() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    let answers = join_all((0..16).map(|i| {
        let (app, id) = (&app, &id);
        async move {
            let body = json!({"amount": 1000 + i * 100});
            Answer::of(post_capture(app, id, Some(&format!("key-{i}")), &body).await).await
        }
    }))
    .await;
    let won: Vec<_> = answers.iter().filter(|a| a.status == 200).collect();
    assert_eq!(won.len(), 1, "exactly one capture wins");
    for lost in answers.iter().filter(|a| a.status != 200) {
        lost.assert_problem(400, "charge_already_captured");
    }
    let captured = won[0].json()["amount_captured"].as_i64().unwrap();
    assert!(captured <= 2000);
    assert_eq!(processor_captures(&app).await, 1);
    let at_processor = app
        .processor_count("SELECT amount FROM operations WHERE kind = 'capture'")
        .await;
    assert_eq!(at_processor, captured);
    // The keys that lost kept nothing: a refused capture leaves its key free.
    assert_eq!(
        app.count("SELECT count(*) FROM idempotency_keys WHERE capture_of IS NOT NULL")
            .await,
        1
    );
}

#[tokio::test]
async fn a_partial_capture_makes_no_refund_and_only_what_it_took_can_be_refunded() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 7200).await;
    let body = json!({"amount": 3200});
    let captured = Answer::of(post_capture(&app, &id, None, &body).await).await;
    assert_eq!(captured.status, 200, "{:?}", captured.body);
    // As Stripe does since 2025-03-31.basil: the 4000 not taken is released,
    // with no refund object, and `amount_refunded` stays 0.
    let charge = captured.json();
    assert_eq!(charge["amount_captured"], 3200);
    assert_eq!(charge["amount_refunded"], 0);
    assert_eq!(charge["refunded"], false);
    assert_eq!(charge["refunds"]["data"], json!([]));
    assert_eq!(app.amount_refunded(&id).await, 0);
    assert_eq!(app.refunds().await, 0);
    let listed = Answer::of(app.get(&format!("/v1/refunds?charge={id}")).await).await;
    assert_eq!(listed.json()["data"], json!([]));
    assert_eq!(
        app.event_types_of(&id).await,
        ["charge.succeeded", "charge.captured"]
    );

    let body = json!({"charge": id, "amount": 3201});
    let too_much = Answer::of(app.post_refund(None, &body).await).await;
    too_much.assert_problem(400, "amount_too_large");
    let rest = Answer::of(app.post_refund(None, &json!({"charge": id})).await).await;
    assert_eq!(rest.status, 201, "{:?}", rest.body);
    assert_eq!(rest.json()["amount"], 3200);
    let charge = Answer::of(app.get(&format!("/v1/charges/{id}")).await)
        .await
        .json();
    assert_eq!(
        (&charge["amount_refunded"], &charge["refunded"]),
        (&json!(3200), &json!(true))
    );
    let body = json!({"charge": id, "amount": 1});
    let more = Answer::of(app.post_refund(None, &body).await).await;
    more.assert_problem(400, "charge_already_refunded");
    assert_eq!(app.processor_refunds().await, 1);
}

#[tokio::test]
async fn a_refund_of_an_uncaptured_charge_releases_it_and_it_cannot_be_captured_after() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    let partial = Answer::of(
        app.post_refund(None, &json!({"charge": id, "amount": 500}))
            .await,
    )
    .await;
    partial.assert_problem(400, "charge_not_refundable");

    let released = Answer::of(app.post_refund(None, &json!({"charge": id})).await).await;
    assert_eq!(released.status, 201, "{:?}", released.body);
    let charge = Answer::of(app.get(&format!("/v1/charges/{id}")).await)
        .await
        .json();
    assert_eq!(charge["refunded"], true);
    assert_eq!(charge["captured"], false);
    assert_eq!(charge["amount_refunded"], 2000);

    let capture = Answer::of(post_capture(&app, &id, Some("late"), &json!({})).await).await;
    capture.assert_problem(400, "charge_already_refunded");
    assert_eq!(processor_captures(&app).await, 0);
    assert_eq!(app.count("SELECT count(*) FROM idempotency_keys").await, 0);
}

#[tokio::test]
async fn a_capture_after_the_authorization_window_is_refused_charge_expired_for_capture() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    sqlx::query("UPDATE charges SET created_at = now() - interval '7 days 1 minute' WHERE id = $1")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();
    let capture = Answer::of(post_capture(&app, &id, Some("late"), &json!({})).await).await;
    capture.assert_problem(400, "charge_expired_for_capture");
    assert_eq!(processor_captures(&app).await, 0);
}

#[tokio::test]
async fn captures_that_cannot_be_made_are_refused_with_stripes_codes() {
    let app = spawn_app().await;
    let paid = app.paid_charge(2000).await;
    let at_once = Answer::of(post_capture(&app, &paid, None, &json!({})).await).await;
    at_once.assert_problem(400, "charge_already_captured");

    let id = authorized_charge(&app, 2000).await;
    let too_much = Answer::of(post_capture(&app, &id, None, &json!({"amount": 2001})).await).await;
    too_much.assert_problem(400, "amount_too_large");
    assert_eq!(too_much.json()["param"], "amount");
    let zero = Answer::of(post_capture(&app, &id, None, &json!({"amount": 0})).await).await;
    assert_eq!(zero.status, 400);
    let unknown = Answer::of(post_capture(&app, "ch_nope", None, &json!({})).await).await;
    unknown.assert_problem(404, "resource_missing");
    let other = Answer::of(post_capture(&app, &id, None, &json!({"receipt": "x"})).await).await;
    other.assert_problem(400, "parameter_unknown");
    assert_eq!(processor_captures(&app).await, 0);
}

#[tokio::test]
async fn a_capture_left_in_flight_is_rolled_forward_by_the_sweeper() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    // A capture reserved an hour ago by a request that died before the
    // processor was called.
    reserve_capture_an_hour_ago(&app, &id, 1200).await;
    let refund = Answer::of(app.post_refund(None, &json!({"charge": id})).await).await;
    refund.assert_problem(400, "charge_not_refundable");

    let report = app.sweep_once().await;
    assert_eq!(report.captures_settled, 1);
    assert_eq!(processor_captures(&app).await, 1);
    let charge = Answer::of(app.get(&format!("/v1/charges/{id}")).await)
        .await
        .json();
    assert_eq!(charge["amount_captured"], 1200);
    assert_eq!(charge["amount_refunded"], 0);
    assert_eq!(app.sweep_once().await.captures_settled, 0);
}

#[tokio::test]
async fn an_authorization_left_past_its_window_is_released_once_by_racing_sweepers_as_charge_expired()
 {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    let fresh = authorized_charge(&app, 900).await;
    sqlx::query("UPDATE charges SET created_at = now() - interval '7 days 1 minute' WHERE id = $1")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();

    let sweeps = (0..4).map(|_| app.sweep_once());
    let reports = join_all(sweeps).await;
    let expired: u64 = reports.iter().map(|r| r.authorizations_expired).sum();
    assert_eq!(expired, 1, "one sweeper reserves the release: {reports:?}");

    let charge = Answer::of(app.get(&format!("/v1/charges/{id}")).await)
        .await
        .json();
    assert_eq!(
        (
            &charge["captured"],
            &charge["refunded"],
            &charge["amount_refunded"]
        ),
        (&json!(false), &json!(true), &json!(2000))
    );
    let refunds = &charge["refunds"]["data"];
    assert_eq!(refunds.as_array().unwrap().len(), 1);
    assert_eq!(refunds[0]["reason"], "expired_uncaptured_charge");
    assert_eq!(refunds[0]["status"], "succeeded");
    let events = |kind: &str| {
        format!("SELECT count(*) FROM events WHERE object_id = '{id}' AND type = '{kind}'")
    };
    assert_eq!(app.count(&events("charge.expired")).await, 1);
    assert_eq!(app.count(&events("charge.refunded")).await, 0);
    let released = format!(
        "SELECT count(*) FROM operations WHERE kind = 'refund' AND payment_key = 'auth:{id}'"
    );
    assert_eq!(
        app.processor_count(&released).await,
        1,
        "one release at the gateway"
    );

    let late = Answer::of(post_capture(&app, &id, None, &json!({})).await).await;
    late.assert_problem(400, "charge_expired_for_capture");
    // An authorization inside its window is left to be captured.
    assert_eq!(app.amount_refunded(&fresh).await, 0);
    let captured = Answer::of(post_capture(&app, &fresh, None, &json!({})).await).await;
    assert_eq!(captured.status, 200, "{:?}", captured.body);
}

#[tokio::test]
async fn a_release_the_issuer_refuses_is_asked_again_and_expires_the_charge_once() {
    let app = spawn_app().await;
    let body =
        json!({"amount": 2000, "currency": "usd", "source": "tok_refundFail", "capture": false});
    let charge = Answer::of(app.post_charge(None, &body).await).await;
    assert_eq!(charge.status, 201, "{:?}", charge.body);
    let id = charge.json()["id"].as_str().unwrap().to_owned();
    sqlx::query("UPDATE charges SET created_at = now() - interval '8 days' WHERE id = $1")
        .bind(&id)
        .execute(&app.pool)
        .await
        .unwrap();

    let first = app.sweep_once().await;
    assert_eq!((first.authorizations_expired, first.refunds_failed), (1, 1));
    assert_eq!(
        app.amount_refunded(&id).await,
        0,
        "the refused release gave it back"
    );
    let second = app.sweep_once().await;
    assert_eq!(
        (second.authorizations_expired, second.refunds_settled),
        (1, 1)
    );
    assert_eq!(app.amount_refunded(&id).await, 2000);
    assert_eq!(
        app.sweep_once().await.authorizations_expired,
        0,
        "released: not asked again"
    );

    let statuses = |status: &str| {
        format!("SELECT count(*) FROM refunds WHERE charge_id = '{id}' AND status = '{status}'")
    };
    assert_eq!(app.count(&statuses("failed")).await, 1);
    assert_eq!(app.count(&statuses("succeeded")).await, 1);
    let expired =
        format!("SELECT count(*) FROM events WHERE object_id = '{id}' AND type = 'charge.expired'");
    assert_eq!(app.count(&expired).await, 1);
}

#[tokio::test]
async fn the_balance_counts_what_was_captured_and_not_what_was_only_authorized_or_released() {
    let app = spawn_app().await;
    authorized_charge(&app, 900).await;
    let part = authorized_charge(&app, 2000).await;
    let captured =
        Answer::of(post_capture(&app, &part, None, &json!({"amount": 1500})).await).await;
    assert_eq!(captured.status, 200, "{:?}", captured.body);
    let refund = app
        .post_refund(None, &json!({"charge": part, "amount": 400}))
        .await;
    assert_eq!(refund.status(), 201);
    let released = authorized_charge(&app, 2500).await;
    let release = app.post_refund(None, &json!({"charge": released})).await;
    assert_eq!(release.status(), 201);

    let balance = Answer::of(app.get("/v1/balance").await).await.json();
    let usd = &balance["available"][0];
    assert_eq!(
        (&usd["charged"], &usd["refunded"], &usd["amount"]),
        (&json!(1500), &json!(400), &json!(1100)),
        "{balance}"
    );
}

#[tokio::test]
async fn a_capture_with_no_body_and_no_content_type_captures_the_whole_amount_as_at_stripe() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 7200).await;
    // `curl -X POST .../v1/charges/{id}/capture -u sk_...:`, as Stripe's
    // docs show it: basic auth, no body, no Content-Type.
    let bare = app
        .client
        .post(app.url(&format!("/v1/charges/{id}/capture")))
        .basic_auth(&app.api_key, Some(""))
        .send()
        .await
        .unwrap();
    let captured = Answer::of(bare).await;
    assert_eq!(captured.status, 200, "{:?}", captured.body);
    assert_eq!(captured.json()["captured"], true);
    assert_eq!(captured.json()["amount_captured"], 7200);
    let stored: bool =
        sqlx::query_scalar("SELECT captured_at IS NOT NULL FROM charges WHERE id = $1")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(stored);
}

#[tokio::test]
async fn a_capture_below_the_currencys_minimum_is_amount_too_small_and_leaves_the_charge_capturable()
 {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 7200).await;
    let small =
        Answer::of(post_capture(&app, &id, Some("small"), &json!({"amount": 12})).await).await;
    small.assert_problem(400, "amount_too_small");
    assert_eq!(small.json()["error"]["param"], "amount");
    let reserved: Option<i64> =
        sqlx::query_scalar("SELECT capture_amount FROM charges WHERE id = $1")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(reserved, None, "nothing reserved");

    // The key was left free, as for any refused parameter.
    let captured =
        Answer::of(post_capture(&app, &id, Some("small"), &json!({"amount": 3200})).await).await;
    assert_eq!(captured.status, 200, "{:?}", captured.body);
    assert_eq!(captured.json()["amount_captured"], 3200);
}

#[tokio::test]
async fn a_second_capture_is_charge_already_captured_with_stripes_doc_url() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    let first = Answer::of(post_capture(&app, &id, Some("first"), &json!({})).await).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let second = Answer::of(post_capture(&app, &id, Some("second"), &json!({})).await).await;
    second.assert_problem(400, "charge_already_captured");
    assert_eq!(
        second.json()["error"]["doc_url"],
        "https://stripe.com/docs/error-codes/charge-already-captured"
    );
}

#[tokio::test]
async fn migrating_leaves_in_amount_refunded_only_the_refunds_of_a_charge_captured_in_part() {
    let (_db, pool) = migrated_before("20261216000100").await;
    let (merchant, _) = oncepay::merchants::create(&pool, "m").await.unwrap();
    // As a partial capture left it then: 4000 of 7200 not taken counted as
    // refunded, with 1000 refunded since, 500 pending and 300 failed.
    sqlx::raw_sql(&format!(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, status, amount_refunded,
                              capture_later, capture_amount, capture_asked_at, captured_at)
         VALUES ('ch_part', '{m}', 7200, 'usd', 'tok_visa', 'succeeded', 5500,
                 true, 3200, now(), now()),
                ('ch_whole', '{m}', 2000, 'usd', 'tok_visa', 'succeeded', 700,
                 true, 2000, now(), now()),
                ('ch_released', '{m}', 2500, 'usd', 'tok_visa', 'succeeded', 2500,
                 true, NULL, NULL, NULL);
         INSERT INTO refunds (id, merchant_id, charge_id, amount, currency, status, failure_reason)
         VALUES ('re_{a}', '{m}', 'ch_part', 1000, 'usd', 'succeeded', NULL),
                ('re_{b}', '{m}', 'ch_part', 500, 'usd', 'pending', NULL),
                ('re_{c}', '{m}', 'ch_part', 300, 'usd', 'failed', 'declined'),
                ('re_{d}', '{m}', 'ch_whole', 700, 'usd', 'succeeded', NULL),
                ('re_{e}', '{m}', 'ch_released', 2500, 'usd', 'succeeded', NULL);",
        m = merchant.id,
        a = "a".repeat(24),
        b = "b".repeat(24),
        c = "c".repeat(24),
        d = "d".repeat(24),
        e = "e".repeat(24),
    ))
    .execute(&pool)
    .await
    .unwrap();
    let refunded = || async {
        sqlx::query_as::<_, (String, i64)>("SELECT id, amount_refunded FROM charges ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    let expected = [("ch_part", 1500), ("ch_released", 2500), ("ch_whole", 700)]
        .map(|(id, amount)| (id.to_owned(), amount));

    oncepay::db::migrate(&pool).await.unwrap();
    assert_eq!(refunded().await, expected);
    // Run again (as after a rolling upgrade, for a capture an instance of
    // the version before settled meanwhile), it changes nothing more.
    let migration = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("migrations/20261216000100_captures_refund_nothing.sql");
    let migration = std::fs::read_to_string(migration).unwrap();
    sqlx::raw_sql(&migration).execute(&pool).await.unwrap();
    assert_eq!(refunded().await, expected);
    pool.close().await;
}
