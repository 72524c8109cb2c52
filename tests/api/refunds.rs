//! Refunds: replays, partial and full refunds, races between refunds with
//! different keys, refusals, roll-forward recovery, and the balance.

use oncepay::http::input::FromParams;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use oncepay::processor::{
    self, Authorization, Capture, Outcome, Payment, Processor, ProcessorError, RefundOutcome,
};
use oncepay_core::charges::settle::Settled;
use oncepay_core::idempotency::Fingerprint;
use oncepay_core::params::Params;
use oncepay_core::refunds::{NewRefund, settle};
use serde_json::{Value, json};

use crate::helpers::{
    Answer, Settings, TestApp, spawn_app, spawn_app_with, spawn_app_with_processor, visa,
};

fn refund(charge: &str, amount: Option<i64>) -> Value {
    match amount {
        Some(amount) => json!({"charge": charge, "amount": amount}),
        None => json!({"charge": charge}),
    }
}

async fn refund_state(app: &TestApp, id: &str) -> (String, i64) {
    sqlx::query_as("SELECT status, amount FROM refunds WHERE id = $1")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_retry_replays_one_refund() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    let body = json!({"charge": charge, "amount": 500, "reason": "requested_by_customer",
                      "metadata": {"ticket": "T-1"}});
    let first = Answer::of(app.post_refund(Some("refund-1"), &body).await).await;
    let retry = Answer::of(app.post_refund(Some("refund-1"), &body).await).await;

    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(!first.replayed());
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(first.body, retry.body, "the replay is byte for byte");
    let refund = first.json();
    let id = refund["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("re_") && id.len() == 27, "{id}");
    assert_eq!(
        first.header("location"),
        Some(format!("/v1/refunds/{id}").as_str())
    );
    assert_eq!(retry.header("location"), first.header("location"));
    assert_eq!(refund["object"], "refund");
    assert_eq!(refund["amount"], 500);
    assert_eq!(refund["charge"], charge.as_str());
    assert_eq!(refund["currency"], "usd");
    assert_eq!(refund["status"], "succeeded");
    assert_eq!(refund["reason"], "requested_by_customer");
    assert_eq!(refund["metadata"], json!({"ticket": "T-1"}));
    assert!(refund["created"].is_i64());

    assert_eq!(app.refunds().await, 1);
    assert_eq!(app.processor_refunds().await, 1);
    assert_eq!(app.amount_refunded(&charge).await, 500);
    let read = Answer::of(app.get(&format!("/v1/refunds/{id}")).await).await;
    assert_eq!(read.status, 200);
    assert_eq!(read.json(), refund);

    let key = Answer::of(app.get("/v1/idempotency_keys/refund-1").await)
        .await
        .json();
    assert_eq!(key["status"], "completed");
    assert_eq!(
        key["request"],
        json!({"method": "POST", "path": "/v1/refunds"})
    );
    assert_eq!(key["refund"], id.as_str());
    assert_eq!(key["charge"], Value::Null);
}

#[tokio::test]
async fn a_refund_without_an_amount_refunds_what_is_left_and_marks_the_charge_refunded() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    let part = Answer::of(
        app.post_refund(Some("a"), &refund(&charge, Some(500)))
            .await,
    )
    .await;
    assert_eq!(part.status, 201);
    let before = Answer::of(app.get(&format!("/v1/charges/{charge}")).await)
        .await
        .json();
    assert_eq!(
        (
            before["amount_refunded"].as_i64(),
            before["refunded"].as_bool()
        ),
        (Some(500), Some(false))
    );

    let rest = Answer::of(app.post_refund(Some("b"), &refund(&charge, None)).await).await;
    assert_eq!(rest.status, 201, "{:?}", rest.body);
    assert_eq!(rest.json()["amount"], 1500);
    let after = Answer::of(app.get(&format!("/v1/charges/{charge}")).await)
        .await
        .json();
    assert_eq!(after["amount_refunded"], 2000);
    assert_eq!(after["refunded"], true);

    let again = Answer::of(app.post_refund(Some("c"), &refund(&charge, None)).await).await;
    again.assert_problem(400, "charge_already_refunded");
    assert_eq!(again.json()["param"], "charge");
    assert_eq!(app.refunds().await, 2);
    assert_eq!(app.processor_refunds().await, 2);
    assert_eq!(app.amount_refunded(&charge).await, 2000);
}

#[tokio::test]
async fn partial_refunds_add_up_and_the_last_cent_can_be_refunded() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    for (i, amount) in [300, 700, 999].into_iter().enumerate() {
        let answer = Answer::of(
            app.post_refund(Some(&format!("p{i}")), &refund(&charge, Some(amount)))
                .await,
        )
        .await;
        assert_eq!(answer.status, 201, "{:?}", answer.body);
    }
    assert_eq!(app.amount_refunded(&charge).await, 1999);
    let too_much = Answer::of(app.post_refund(Some("p3"), &refund(&charge, Some(2))).await).await;
    too_much.assert_problem(400, "amount_too_large");
    assert_eq!(too_much.json()["param"], "amount");
    let last = Answer::of(app.post_refund(Some("p4"), &refund(&charge, Some(1))).await).await;
    assert_eq!(last.status, 201);
    assert_eq!(app.amount_refunded(&charge).await, 2000);
    let sum: i64 = app
        .count("SELECT sum(amount)::bigint FROM refunds WHERE status = 'succeeded'")
        .await;
    assert_eq!(sum, 2000);
    assert_eq!(app.processor_refunds().await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_refunds_with_different_keys_never_refund_more_than_was_charged() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 100)).await;
    let charge = app.paid_charge(1000).await;
    // Each asks for 30%: only three fit.
    let requests = (0..20).map(|i| {
        let (app, charge) = (&app, &charge);
        async move {
            Answer::of(
                app.post_refund(Some(&format!("race-{i}")), &refund(charge, Some(300)))
                    .await,
            )
            .await
        }
    });
    let answers = join_all(requests).await;

    let succeeded = answers.iter().filter(|a| a.status == 201).count();
    assert_eq!(succeeded, 3, "exactly three refunds of 300 fit in 1000");
    for answer in answers.iter().filter(|a| a.status != 201) {
        answer.assert_problem(400, "amount_too_large");
    }
    assert!(answers.iter().all(|a| a.status < 500));
    let refunded = app.amount_refunded(&charge).await;
    let sum: i64 = app
        .count("SELECT coalesce(sum(amount), 0)::bigint FROM refunds WHERE status = 'succeeded'")
        .await;
    assert_eq!((refunded, sum), (900, 900));
    assert_eq!(app.refunds().await, 3, "losers wrote no refund");
    assert_eq!(app.processor_refunds().await, 3);
    assert_eq!(
        app.count("SELECT count(*) FROM idempotency_keys WHERE key LIKE 'race-%'")
            .await,
        3,
        "losers' keys stay free"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_wait_on_a_refund_in_flight_replays_its_answer() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 1500)).await;
    let charge = app.paid_charge(2000).await;
    let body = refund(&charge, Some(700));
    let first = async { Answer::of(app.post_refund(Some("patient"), &body).await).await };
    let waiter = async {
        // The first request has reserved the amount and is at the processor.
        app.until_in_flight("patient").await;
        let response = app
            .client
            .post(app.url("/v1/refunds"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "patient")
            .header("Prefer", "wait=5")
            .json(&body)
            .send()
            .await
            .unwrap();
        Answer::of(response).await
    };
    let (first, waiter) = tokio::join!(first, waiter);

    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(!first.replayed());
    assert_eq!(waiter.status, 201, "{:?}", waiter.body);
    assert!(waiter.replayed());
    assert_eq!(waiter.header("preference-applied"), Some("wait"));
    assert_eq!(waiter.body, first.body);
    assert_eq!(app.refunds().await, 1);
    assert_eq!(app.processor_refunds().await, 1);
    assert_eq!(app.amount_refunded(&charge).await, 700);
}

#[tokio::test]
async fn refunding_a_declined_or_pending_charge_is_charge_not_refundable() {
    let app = spawn_app().await;
    let declined = Answer::of(
        app.post_charge(
            None,
            &json!({"amount": 2000, "currency": "usd", "source": "tok_chargeDeclined"}),
        )
        .await,
    )
    .await;
    let declined = declined.json()["charge"].as_str().unwrap().to_owned();
    sqlx::query(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, status)
         VALUES ('ch_stillpendingcharge0000001', $1, 2000, 'usd', 'tok_visa', 'pending')",
    )
    .bind(app.merchant_id)
    .execute(&app.pool)
    .await
    .unwrap();

    for charge in [declined.as_str(), "ch_stillpendingcharge0000001"] {
        for amount in [None, Some(100)] {
            let answer =
                Answer::of(app.post_refund(Some("nope"), &refund(charge, amount)).await).await;
            answer.assert_problem(400, "charge_not_refundable");
            assert_eq!(answer.json()["param"], "charge");
            assert_eq!(app.amount_refunded(charge).await, 0);
        }
    }
    assert_eq!(app.refunds().await, 0);
    assert_eq!(
        app.keys().await,
        0,
        "refused before the work: the key stays free"
    );
    assert_eq!(app.processor_refunds().await, 0);
}

#[tokio::test]
async fn a_refund_of_another_merchants_charge_or_an_unknown_one_is_404_naming_id_as_at_stripe() {
    let app = spawn_app().await;
    let other = app.other_merchant().await;
    let theirs = Answer::of(app.post_charge_as(&other, None, &visa(2000)).await).await;
    let theirs = theirs.json()["id"].as_str().unwrap().to_owned();
    for charge in [theirs.as_str(), "ch_doesnotexist000000000000", ""] {
        let answer = Answer::of(app.post_refund(Some("k"), &refund(charge, None)).await).await;
        answer.assert_problem(404, "resource_missing");
        let error = &answer.json()["error"];
        assert_eq!(
            (&answer.json()["param"], &error["param"]),
            (&json!("id"), &json!("id"))
        );
        assert_eq!(error["message"], format!("No such charge: '{charge}'"));
    }
    assert_eq!(app.amount_refunded(&theirs).await, 0);
    assert_eq!((app.refunds().await, app.keys().await), (0, 0));
    // Their refunds are not ours to read either.
    let refund = Answer::of(
        app.post_refund_as(&other, None, &json!({"charge": theirs}))
            .await,
    )
    .await;
    assert_eq!(refund.status, 201);
    let id = refund.json()["id"].as_str().unwrap().to_owned();
    Answer::of(app.get(&format!("/v1/refunds/{id}")).await)
        .await
        .assert_problem(404, "resource_missing");
}

#[tokio::test]
async fn a_key_used_for_a_charge_is_refused_for_a_refund() {
    let app = spawn_app().await;
    let charge = Answer::of(app.post_charge(Some("one-key"), &visa(2000)).await).await;
    let charge_id = charge.json()["id"].as_str().unwrap().to_owned();
    let answer = Answer::of(
        app.post_refund(Some("one-key"), &refund(&charge_id, None))
            .await,
    )
    .await;
    answer.assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.refunds().await, 0);
    assert_eq!(app.amount_refunded(&charge_id).await, 0);
    // The charge's answer is untouched.
    let retry = Answer::of(app.post_charge(Some("one-key"), &visa(2000)).await).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, charge.body);
}

#[tokio::test]
async fn a_different_refund_with_the_same_key_is_422() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    let first = Answer::of(
        app.post_refund(Some("r"), &refund(&charge, Some(100)))
            .await,
    )
    .await;
    assert_eq!(first.status, 201);
    Answer::of(
        app.post_refund(Some("r"), &refund(&charge, Some(200)))
            .await,
    )
    .await
    .assert_problem(422, "idempotency_key_reused");
    // No amount means "what is left", a different request from 100.
    Answer::of(app.post_refund(Some("r"), &refund(&charge, None)).await)
        .await
        .assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.amount_refunded(&charge).await, 100);
    assert_eq!(app.refunds().await, 1);
}

#[tokio::test]
async fn a_refused_refund_leaves_its_key_free_for_the_corrected_request() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    Answer::of(
        app.post_refund(Some("fix"), &refund(&charge, Some(2001)))
            .await,
    )
    .await
    .assert_problem(400, "amount_too_large");
    assert_eq!((app.keys().await, app.refunds().await), (0, 0));
    let corrected = Answer::of(
        app.post_refund(Some("fix"), &refund(&charge, Some(2000)))
            .await,
    )
    .await;
    assert_eq!(corrected.status, 201);
    assert!(!corrected.replayed());
    assert_eq!(app.amount_refunded(&charge).await, 2000);
}

#[tokio::test]
async fn bad_refund_input_gets_4xx_problems_and_writes_nothing() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    let (keys, processor_rows) = (app.keys().await, app.processor_operations().await);
    let cases = [
        (json!({}), "parameter_missing", "charge"),
        (json!({"charge": 42}), "parameter_invalid_type", "charge"),
        (
            json!({"charge": charge, "amount": 0}),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            json!({"charge": charge, "amount": -5}),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            json!({"charge": charge, "amount": 10.5}),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            json!({"charge": charge, "amount": "100"}),
            "parameter_invalid_integer",
            "amount",
        ),
        (
            json!({"charge": charge, "amount": 100_000_000}),
            "amount_too_large",
            "amount",
        ),
        (
            json!({"charge": charge, "reason": "changed_my_mind"}),
            "invalid_reason",
            "reason",
        ),
        (
            json!({"charge": charge, "reason": 1}),
            "parameter_invalid_type",
            "reason",
        ),
        (
            json!({"charge": charge, "metadata": {"k": 1}}),
            "metadata_invalid",
            "metadata[k]",
        ),
        (
            json!({"charge": charge, "metadata": {"k": "v".repeat(501)}}),
            "metadata_invalid",
            "metadata[k]",
        ),
        (
            json!({"charge": charge, "currency": "usd"}),
            "parameter_unknown",
            "currency",
        ),
    ];
    for (i, (body, code, param)) in cases.into_iter().enumerate() {
        let answer = Answer::of(app.post_refund(Some(&format!("bad-{i}")), &body).await).await;
        answer.assert_problem(400, code);
        assert_eq!(answer.json()["param"], param, "{body}");
    }
    let form = app
        .client
        .post(app.url("/v1/refunds"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "bad-form")
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(format!("charge={charge}&amount=1.5"))
        .send()
        .await
        .unwrap();
    Answer::of(form)
        .await
        .assert_problem(400, "parameter_invalid_integer");
    let xml = app
        .client
        .post(app.url("/v1/refunds"))
        .bearer_auth(&app.api_key)
        .header("Content-Type", "text/xml")
        .body("<refund/>")
        .send()
        .await
        .unwrap();
    Answer::of(xml)
        .await
        .assert_problem(415, "unsupported_media_type");
    let anonymous = app
        .client
        .post(app.url("/v1/refunds"))
        .json(&refund(&charge, None))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);

    assert_eq!(app.refunds().await, 0);
    assert_eq!(app.keys().await, keys);
    assert_eq!(app.processor_operations().await, processor_rows);
    assert_eq!(app.amount_refunded(&charge).await, 0);
    Answer::of(app.get("/v1/refunds/re_doesnotexist000000000001").await)
        .await
        .assert_problem(404, "resource_missing");
}

#[tokio::test]
async fn a_refund_body_that_repeats_a_key_is_refused_and_refunds_nothing() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    let keys = app.keys().await;
    for (i, (body, param)) in [
        (
            format!(r#"{{"charge":"{charge}","amount":100,"amount":2000}}"#),
            "amount",
        ),
        (
            format!(r#"{{"charge":"{charge}","charge":"ch_other"}}"#),
            "charge",
        ),
        (
            format!(r#"{{"charge":"{charge}","metadata":{{"k":"1","k":"2"}}}}"#),
            "metadata[k]",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let answer = app
            .client
            .post(app.url("/v1/refunds"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", format!("dup-{i}"))
            .header("Content-Type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let answer = Answer::of(answer).await;
        answer.assert_problem(400, "parameter_duplicate");
        assert_eq!(answer.json()["param"], param, "{body}");
    }
    assert_eq!(app.refunds().await, 0);
    assert_eq!(app.keys().await, keys);
    assert_eq!(app.processor_refunds().await, 0);
    assert_eq!(app.amount_refunded(&charge).await, 0);
}

#[tokio::test]
async fn a_form_refund_and_a_json_refund_with_equal_parameters_are_one_operation() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    let first = Answer::of(
        app.post_refund(
            Some("same"),
            &json!({"charge": charge, "amount": 250, "reason": "duplicate", "metadata": {"a": "1"}}),
        )
        .await,
    )
    .await;
    assert_eq!(first.status, 201);
    let form = app
        .client
        .post(app.url("/v1/refunds"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "same")
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(format!(
            "metadata[a]=1&reason=duplicate&amount=250&charge={charge}"
        ))
        .send()
        .await
        .unwrap();
    let retry = Answer::of(form).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.refunds().await, 1);
}

/// A pending refund of `amount` on `charge_id`, its amount reserved and (with
/// `key`) its claim, as a request that crashed right after step 2 leaves
/// them, a minute ago.
async fn stale_refund(
    app: &TestApp,
    key: Option<&str>,
    refund_id: &str,
    charge_id: &str,
    amount: i64,
) {
    let body = refund(charge_id, Some(amount));
    let params = Params::from_json(body.to_string().as_bytes()).unwrap();
    let fingerprint = Fingerprint::of(
        "POST",
        "/v1/refunds",
        &NewRefund::from_params(params).unwrap().canonical(),
    );
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query("UPDATE charges SET amount_refunded = amount_refunded + $2 WHERE id = $1")
        .bind(charge_id)
        .bind(amount)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO refunds (id, merchant_id, charge_id, amount, currency, status, created_at)
         VALUES ($1, $2, $3, $4, 'usd', 'pending', now() - interval '1 minute')",
    )
    .bind(refund_id)
    .bind(app.merchant_id)
    .bind(charge_id)
    .bind(amount)
    .execute(&mut *tx)
    .await
    .unwrap();
    if let Some(key) = key {
        sqlx::query(
            "INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path,
                 fingerprint, refund_id, created_at, locked_at, expires_at)
             VALUES ($1, $2, 'processing', 'POST', '/v1/refunds', $3, $4,
                     now() - interval '1 minute', now() - interval '1 minute', now() + interval '1 day')",
        )
        .bind(app.merchant_id)
        .bind(key)
        .bind(&fingerprint.0[..])
        .bind(refund_id)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn the_sweeper_rolls_a_stale_pending_refund_forward() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1s")).await;
    let charge = app.paid_charge(2000).await;
    stale_refund(
        &app,
        Some("crashed"),
        "re_crashedrefund00000000001",
        &charge,
        500,
    )
    .await;
    stale_refund(&app, None, "re_keylesscrashedrefund0001", &charge, 300).await;

    let report = app.sweep_once().await;
    assert_eq!(report.refunds_settled, 2, "{report:?}");
    assert_eq!((report.settled_succeeded, report.settled_failed), (0, 0));
    assert_eq!(
        refund_state(&app, "re_crashedrefund00000000001").await,
        ("succeeded".into(), 500)
    );
    assert_eq!(
        refund_state(&app, "re_keylesscrashedrefund0001").await.0,
        "succeeded"
    );
    assert_eq!(app.processor_refunds().await, 2);
    assert_eq!(app.amount_refunded(&charge).await, 800);
    let (status, code): (String, Option<i16>) = sqlx::query_as(
        "SELECT status, response_status FROM idempotency_keys WHERE key = 'crashed'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), code), ("completed", Some(201)));

    // The retry replays the settled refund; a second pass changes nothing.
    let retry = Answer::of(
        app.post_refund(Some("crashed"), &refund(&charge, Some(500)))
            .await,
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], "re_crashedrefund00000000001");
    assert_eq!(retry.json()["status"], "succeeded");
    assert_eq!(app.sweep_once().await.refunds_settled, 0);
    assert_eq!(app.processor_refunds().await, 2);
}

#[tokio::test]
async fn a_retry_finding_its_refund_key_stale_rolls_the_refund_forward_once() {
    let app = spawn_app_with(Settings::new().set("PROCESSING_TIMEOUT", "1s")).await;
    let charge = app.paid_charge(2000).await;
    stale_refund(
        &app,
        Some("stuck"),
        "re_stuckrefund0000000000001",
        &charge,
        700,
    )
    .await;
    // The crashed request had reached the processor already: the roll-forward
    // repeats that refund under the same processor key, adding none.
    sqlx::query(
        "INSERT INTO operations (account, key, kind, outcome, amount, currency, payment_key)
         VALUES ($2, 'refund:re_stuckrefund0000000000001', 'refund', 'refunded', 700, 'usd', 'auth:' || $1)",
    )
    .bind(&charge)
    .bind(&app.processor_account)
    .execute(&app.processor_pool)
    .await
    .unwrap();

    let retry = Answer::of(
        app.post_refund(Some("stuck"), &refund(&charge, Some(700)))
            .await,
    )
    .await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.json()["id"], "re_stuckrefund0000000000001");
    assert_eq!(
        refund_state(&app, "re_stuckrefund0000000000001").await.0,
        "succeeded"
    );
    assert_eq!(app.processor_refunds().await, 1);
    assert_eq!(app.amount_refunded(&charge).await, 700);
    assert_eq!(app.refunds().await, 1);
}

#[tokio::test]
async fn the_balance_shows_charged_minus_refunded_per_currency() {
    let app = spawn_app().await;
    let usd = app.paid_charge(2000).await;
    app.paid_charge(1000).await;
    let eur = Answer::of(
        app.post_charge(
            None,
            &json!({"amount": 500, "currency": "eur", "source": "tok_visa"}),
        )
        .await,
    )
    .await;
    let eur = eur.json()["id"].as_str().unwrap().to_owned();
    // A decline moves no money and does not count.
    app.post_charge(
        None,
        &json!({"amount": 700, "currency": "usd", "source": "tok_chargeDeclined"}),
    )
    .await;
    for (charge, amount) in [(&usd, 300), (&usd, 200), (&eur, 500)] {
        let answer = app.post_refund(None, &refund(charge, Some(amount))).await;
        assert_eq!(answer.status(), 201);
    }
    // A pending refund has only reserved its amount: it does not count yet.
    stale_refund(&app, None, "re_pendingrefund00000000001", &usd, 100).await;

    let balance = Answer::of(app.get("/v1/balance").await).await;
    assert_eq!(balance.status, 200);
    assert_eq!(
        balance.json(),
        json!({
            "object": "balance",
            "available": [
                {"amount": 0, "currency": "eur", "source_types": {"card": 0}, "charged": 500, "refunded": 500},
                {"amount": 2500, "currency": "usd", "source_types": {"card": 2500}, "charged": 3000, "refunded": 500},
            ],
            "connect_reserved": [
                {"amount": 0, "currency": "eur"},
                {"amount": 0, "currency": "usd"},
            ],
            "livemode": false,
            "pending": [
                {"amount": 0, "currency": "eur", "source_types": {"card": 0}},
                {"amount": 0, "currency": "usd", "source_types": {"card": 0}},
            ],
        })
    );
    let other = app.other_merchant().await;
    let theirs = app
        .client
        .get(app.url("/v1/balance"))
        .bearer_auth(other)
        .send()
        .await
        .unwrap();
    assert_eq!(
        Answer::of(theirs).await.json()["available"],
        json!([]),
        "a merchant sees only its own money"
    );
}

/// The simulated processor, except that every refund call finds the
/// processor unavailable (nothing recorded).
struct RefundsUnavailable(Arc<dyn Processor>);

#[async_trait]
impl Processor for RefundsUnavailable {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        self.0.authorize(request).await
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        self.0.void_unless_recorded(processor_key).await
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        self.0.capture(request).await
    }

    async fn refund(&self, _: processor::Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        Err(ProcessorError::Unavailable)
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        self.0.payment(processor_key).await
    }
}

#[tokio::test]
async fn an_unavailable_processor_keeps_the_refund_reserved_and_the_sweeper_rolls_it_forward() {
    let timing = Settings::new()
        .set("PROCESSING_TIMEOUT", "20s")
        .set("SWEEP_INTERVAL", "90500ms");
    let app = spawn_app_with_processor(timing, |_, http| Arc::new(RefundsUnavailable(http))).await;
    let charge = app.paid_charge(2000).await;
    let answer = Answer::of(
        app.post_refund(Some("later"), &refund(&charge, Some(500)))
            .await,
    )
    .await;
    answer.assert_problem(503, "processor_unavailable");
    assert_eq!(
        answer.header("retry-after"),
        Some("111"),
        "recovery rolls it forward: PROCESSING_TIMEOUT plus one SWEEP_INTERVAL, rounded up"
    );
    assert_eq!(app.amount_refunded(&charge).await, 500, "still reserved");
    assert_eq!(app.processor_refunds().await, 0);
    // The key is held: a retry waits for the roll-forward instead of refunding again.
    let retry = Answer::of(
        app.post_refund(Some("later"), &refund(&charge, Some(500)))
            .await,
    )
    .await;
    retry.assert_problem(409, "idempotency_key_in_use");
    assert_eq!(retry.header("retry-after"), Some("1"));

    // The processor is back: a sweeper rolls the refund forward.
    sqlx::query("UPDATE idempotency_keys SET locked_at = now() - interval '1 hour'")
        .execute(&app.pool)
        .await
        .unwrap();
    let working: Arc<dyn oncepay::processor::Processor> = app.working_processor.clone();
    let settings = oncepay_core::sweeper::SweepSettings {
        processing_timeout: Duration::from_secs(60),
        ..app.config.sweep_settings()
    };
    let report = oncepay_core::sweeper::Sweeper::new(app.pool.clone(), working, settings)
        .sweep_once()
        .await
        .unwrap();
    assert_eq!(report.refunds_settled, 1);
    assert_eq!(app.processor_refunds().await, 1);
    let settled = Answer::of(
        app.post_refund(Some("later"), &refund(&charge, Some(500)))
            .await,
    )
    .await;
    assert_eq!(settled.status, 201);
    assert!(settled.replayed());
    assert_eq!(settled.json()["status"], "succeeded");
    assert_eq!(app.amount_refunded(&charge).await, 500);
}

/// A succeeded charge made with `tok_refundFail`, whose first refund the
/// card's issuer refuses.
async fn charge_whose_first_refund_fails(app: &TestApp, amount: i64) -> String {
    let body = json!({"amount": amount, "currency": "usd", "source": "tok_refundFail"});
    let answer = Answer::of(app.post_charge(None, &body).await).await;
    assert_eq!(answer.status, 201, "{}", answer.json());
    answer.json()["id"].as_str().unwrap().to_owned()
}

async fn key_state(app: &TestApp, key: &str) -> String {
    sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_refused_refund_ends_failed_gives_its_reservation_back_and_its_retry_replays() {
    let app = spawn_app().await;
    let charge = charge_whose_first_refund_fails(&app, 1000).await;
    let body = refund(&charge, Some(600));
    let refused = Answer::of(app.post_refund(Some("refused"), &body).await).await;
    assert_eq!(refused.status, 201, "{}", refused.json());
    assert_eq!(refused.json()["status"], "failed");
    assert_eq!(refused.json()["failure_reason"], "declined");
    let id = refused.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(refund_state(&app, &id).await, ("failed".to_owned(), 600));
    assert_eq!(
        app.amount_refunded(&charge).await,
        0,
        "the reservation is given back"
    );
    assert_eq!(app.processor_refunds().await, 0, "no money moved");
    assert_eq!(key_state(&app, "refused").await, "completed");

    let retry = Answer::of(app.post_refund(Some("refused"), &body).await).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, refused.body, "the failure is the saved answer");
    assert_eq!(app.refunds().await, 1);

    // The whole amount is refundable again, and this time it goes through.
    let later = Answer::of(app.post_refund(Some("later"), &refund(&charge, None)).await).await;
    assert_eq!(later.status, 201, "{}", later.json());
    assert_eq!(later.json()["status"], "succeeded");
    assert_eq!(later.json()["amount"], 1000);
    assert_eq!(later.json()["failure_reason"], Value::Null);
    assert_eq!(app.amount_refunded(&charge).await, 1000);
    assert_eq!(app.processor_refunds().await, 1);
}

#[tokio::test]
async fn a_refund_refused_while_its_request_was_lost_is_failed_by_recovery() {
    let app = spawn_app_with_processor(Settings::new(), |_, http| {
        Arc::new(RefundsUnavailable(http))
    })
    .await;
    let charge = charge_whose_first_refund_fails(&app, 2000).await;
    let body = refund(&charge, Some(2000));
    let answer = Answer::of(app.post_refund(Some("stuck"), &body).await).await;
    answer.assert_problem(503, "processor_unavailable");
    assert_eq!(
        answer.header("retry-after"),
        Some("3630"),
        "PROCESSING_TIMEOUT (30 s) plus the tests' SWEEP_INTERVAL (1 h)"
    );
    assert_eq!(app.amount_refunded(&charge).await, 2000, "still reserved");

    // Recovery repeats the refund at the processor, which refuses it.
    sqlx::query("UPDATE idempotency_keys SET locked_at = now() - interval '1 hour'")
        .execute(&app.pool)
        .await
        .unwrap();
    let working: Arc<dyn oncepay::processor::Processor> = app.working_processor.clone();
    let settings = oncepay_core::sweeper::SweepSettings {
        processing_timeout: Duration::from_secs(60),
        ..app.config.sweep_settings()
    };
    let report = oncepay_core::sweeper::Sweeper::new(app.pool.clone(), working, settings)
        .sweep_once()
        .await
        .unwrap();
    assert_eq!((report.refunds_settled, report.refunds_failed), (0, 1));
    assert_eq!(app.amount_refunded(&charge).await, 0);
    assert_eq!(app.processor_refunds().await, 0);
    let retry = Answer::of(app.post_refund(Some("stuck"), &body).await).await;
    assert!(retry.replayed());
    assert_eq!(retry.json()["status"], "failed");
    assert_eq!(key_state(&app, "stuck").await, "completed");
}

#[tokio::test]
async fn a_settled_refund_is_never_settled_again() {
    let app = spawn_app().await;
    let ttl = app.config.keys.ttl;
    let charge = app.paid_charge(2000).await;
    let refused = RefundOutcome::Failed {
        reason: "account_closed".into(),
    };

    let done = Answer::of(
        app.post_refund(Some("done"), &refund(&charge, Some(500)))
            .await,
    )
    .await;
    assert_eq!(done.status, 201, "{:?}", done.body);
    let done = done.json()["id"].as_str().unwrap().to_owned();
    let again = settle::settle(&app.pool, &done, &refused, ttl, None)
        .await
        .unwrap();
    assert!(matches!(again, Settled::Already), "{again:?}");
    assert_eq!(refund_state(&app, &done).await.0, "succeeded");
    assert_eq!(app.event_types_of(&done).await, ["refund.created"]);
    assert_eq!(
        app.amount_refunded(&charge).await,
        500,
        "its reservation stays"
    );

    let failed = "re_settledfailedrefund00001";
    stale_refund(&app, None, failed, &charge, 300).await;
    let first = settle::settle(&app.pool, failed, &refused, ttl, None)
        .await
        .unwrap();
    assert!(matches!(first, Settled::Now(_)), "{first:?}");
    let again = settle::settle(&app.pool, failed, &RefundOutcome::Refunded, ttl, None)
        .await
        .unwrap();
    assert!(matches!(again, Settled::Already), "{again:?}");
    assert_eq!(refund_state(&app, failed).await.0, "failed");
    assert_eq!(app.event_types_of(failed).await, ["refund.failed"]);
    assert_eq!(
        app.amount_refunded(&charge).await,
        500,
        "the failed refund's 300 given back, once"
    );
}

#[tokio::test]
async fn a_full_refund_that_waits_for_another_reservation_refunds_exactly_the_rest() {
    let app = spawn_app().await;
    let charge = app.paid_charge(2000).await;
    // Another refund's reservation of 500, not committed yet, holds the charge.
    let mut other = app.pool.begin().await.unwrap();
    sqlx::query("UPDATE charges SET amount_refunded = amount_refunded + 500 WHERE id = $1")
        .bind(&charge)
        .execute(&mut *other)
        .await
        .unwrap();
    let rest = refund(&charge, None);
    let full = app.post_refund(Some("rest"), &rest);
    let commit = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while app
            .count(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .await
            == 0
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the full refund never queued behind the reservation"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        other.commit().await.unwrap();
    };
    let (full, ()) = tokio::join!(full, commit);
    let full = Answer::of(full).await;
    assert_eq!(full.status, 201, "{:?}", full.body);
    assert_eq!(
        full.json()["amount"],
        1500,
        "what was left once the other committed"
    );
    assert_eq!(app.amount_refunded(&charge).await, 2000);
}

/// The order that answered a same-key duplicate of a refund `400
/// charge_already_refunded`: the duplicate reads its key while the first
/// request is still at work, so it goes on to claim; before its claim
/// statement runs, the first request completes the key (the whole charge
/// refunded) and the answer expires. Taking the expired answer over would
/// run the refund again, find nothing left to refund, and answer the
/// duplicate with a refusal of a refund that in fact succeeded. The answer
/// was saved after the duplicate arrived, so it is replayed instead.
#[tokio::test]
async fn a_same_key_duplicate_that_claims_after_its_answer_expired_replays_it() {
    // No cache: the duplicate reads the key from the database.
    let app = spawn_app_with(Settings::new().set("REPLAY_CACHE_BYTES", 0)).await;
    let charge = app.paid_charge(2000).await;
    let first = Answer::of(app.post_refund(Some("dup"), &refund(&charge, None)).await).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let saved: (i16, Vec<u8>) = sqlx::query_as(
        "SELECT response_status, response_body FROM idempotency_keys WHERE key = 'dup'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();

    // The first request, as the duplicate will read it: still at work.
    sqlx::query(
        "UPDATE idempotency_keys
            SET status = 'processing', response_status = NULL, response_content_type = NULL,
                response_location = NULL, response_body = NULL, completed_at = NULL,
                locked_at = now()
          WHERE key = 'dup'",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    // The first request's settle, held open on the key's row.
    let mut settle = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = 'dup' FOR UPDATE")
        .execute(&mut *settle)
        .await
        .unwrap();

    let duplicate = {
        let app_url = app.url("/v1/refunds");
        let (client, api_key, body) = (
            app.client.clone(),
            app.api_key.clone(),
            refund(&charge, None),
        );
        tokio::spawn(async move {
            client
                .post(app_url)
                .bearer_auth(api_key)
                .header("Idempotency-Key", "dup")
                .json(&body)
                .send()
                .await
                .unwrap()
        })
    };
    // The duplicate read the key in flight and its claim now waits on the row.
    crate::helpers::until(
        Duration::from_secs(10),
        "the duplicate's claim waits",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&app.pool)
            .await
            .unwrap()
                > 0
        },
    )
    .await;
    // The first request completes the key, and its answer expires.
    sqlx::query(
        "UPDATE idempotency_keys
            SET status = 'completed', response_status = $1, response_content_type = 'application/json',
                response_body = $2, completed_at = clock_timestamp(), locked_at = NULL,
                expires_at = clock_timestamp() - interval '1 second'
          WHERE key = 'dup'",
    )
    .bind(saved.0)
    .bind(&saved.1)
    .execute(&mut *settle)
    .await
    .unwrap();
    settle.commit().await.unwrap();

    let duplicate = Answer::of(duplicate.await.unwrap()).await;
    assert_eq!(duplicate.status, 201, "{:?}", duplicate.body);
    assert!(duplicate.replayed());
    assert_eq!(
        &duplicate.body[..],
        &saved.1[..],
        "the first answer, byte for byte"
    );
    assert_eq!(app.refunds().await, 1);
    assert_eq!(app.processor_refunds().await, 1);
}
