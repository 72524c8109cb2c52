//! The card gateway's own API, called directly over HTTP as oncepay calls
//! it: idempotent authorizations and refunds, the void fence, refusals that
//! record nothing, the lookup and the ledger's pages, and its faults.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{Answer, TestGateway};

async fn gateway() -> TestGateway {
    TestGateway::start(&[]).await
}

async fn authorize(gateway: &TestGateway, key: &str, body: &Value) -> Answer {
    post(gateway, "/v1/authorizations", Some(key), body, None).await
}

async fn post(
    gateway: &TestGateway,
    path: &str,
    key: Option<&str>,
    body: &Value,
    fault: Option<&str>,
) -> Answer {
    let mut request = client(gateway)
        .post(format!("{}{path}", gateway.url))
        .json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    if let Some(fault) = fault {
        request = request.header("Processor-Fault", fault);
    }
    Answer::of(request.send().await.expect("the gateway answers")).await
}

async fn get(gateway: &TestGateway, path: &str) -> Answer {
    Answer::of(
        client(gateway)
            .get(format!("{}{path}", gateway.url))
            .send()
            .await
            .expect("the gateway answers"),
    )
    .await
}

/// A client that calls as the gateway's test account.
fn client(gateway: &TestGateway) -> reqwest::Client {
    as_account(&gateway.secret)
}

/// A client that sends `secret` as its bearer token on every call.
fn as_account(secret: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {secret}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap()
}

async fn rows(gateway: &TestGateway, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&gateway.pool)
        .await
        .unwrap()
}

fn card(amount: i64, source: &str) -> Value {
    json!({"amount": amount, "currency": "usd", "source": source})
}

#[track_caller]
fn assert_error(answer: &Answer, status: u16, code: &str) {
    assert_eq!(answer.status, status, "{:?}", answer.body);
    assert_eq!(answer.json()["error"]["code"], code, "{:?}", answer.body);
    assert!(answer.json()["error"]["message"].is_string());
}

#[tokio::test]
async fn an_authorization_repeated_under_its_key_returns_the_first_outcome_and_moves_money_once() {
    let gateway = gateway().await;
    let first = authorize(&gateway, "auth:ch_1", &card(2000, "tok_visa")).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.json()["outcome"], "succeeded");
    assert_eq!(first.json()["amount"], 2000);
    let again = authorize(&gateway, "auth:ch_1", &card(2000, "tok_visa")).await;
    assert_eq!(again.status, 200);
    assert!(again.replayed());
    assert_eq!(again.json(), first.json());
    assert_eq!(rows(&gateway, "SELECT count(*) FROM operations").await, 1);

    let declined = authorize(
        &gateway,
        "auth:ch_2",
        &card(2000, "tok_chargeDeclinedExpiredCard"),
    )
    .await;
    assert_eq!(declined.status, 201);
    assert_eq!(declined.json()["outcome"], "declined");
    assert_eq!(declined.json()["decline_code"], "expired_card");
    assert_eq!(declined.json()["decline_message"], "Your card has expired.");
}

#[tokio::test]
async fn a_key_reused_with_other_parameters_is_refused_422_and_moves_nothing() {
    let gateway = gateway().await;
    authorize(&gateway, "auth:ch_1", &card(2000, "tok_visa")).await;
    for other in [card(2001, "tok_visa"), card(2000, "tok_amex")] {
        let reused = authorize(&gateway, "auth:ch_1", &other).await;
        assert_error(&reused, 422, "idempotency_key_reused");
    }
    let as_refund = post(
        &gateway,
        "/v1/refunds",
        Some("auth:ch_1"),
        &json!({"payment": "auth:ch_1", "amount": 100, "currency": "usd"}),
        None,
    )
    .await;
    assert_error(&as_refund, 422, "idempotency_key_reused");
    assert_eq!(rows(&gateway, "SELECT count(*) FROM operations").await, 1);
}

#[tokio::test]
async fn a_void_recorded_first_fences_the_key_against_any_later_authorization() {
    let gateway = gateway().await;
    let void = post(
        &gateway,
        "/v1/authorizations/auth:ch_lost/void",
        None,
        &json!({}),
        None,
    )
    .await;
    assert_eq!(void.status, 201, "{:?}", void.body);
    assert_eq!(void.json()["outcome"], "voided");
    let late = authorize(&gateway, "auth:ch_lost", &card(2000, "tok_visa")).await;
    assert_eq!(late.status, 200);
    assert_eq!(
        late.json()["outcome"],
        "voided",
        "no money moves after the void"
    );
    assert_eq!(
        rows(
            &gateway,
            "SELECT count(*) FROM operations WHERE outcome = 'succeeded'"
        )
        .await,
        0
    );

    // A void after a payment finds the payment, and records nothing.
    authorize(&gateway, "auth:ch_paid", &card(500, "tok_visa")).await;
    let void = post(
        &gateway,
        "/v1/authorizations/auth:ch_paid/void",
        None,
        &json!({}),
        None,
    )
    .await;
    assert_eq!(void.status, 200);
    assert_eq!(void.json()["outcome"], "succeeded");
    assert_eq!(rows(&gateway, "SELECT count(*) FROM operations").await, 2);
}

#[tokio::test]
async fn a_refund_is_idempotent_on_its_key_and_never_larger_than_the_payment() {
    let gateway = gateway().await;
    authorize(&gateway, "auth:ch_1", &card(1000, "tok_visa")).await;
    let refund = |amount: i64| json!({"payment": "auth:ch_1", "amount": amount, "currency": "usd"});
    let first = post(
        &gateway,
        "/v1/refunds",
        Some("refund:re_1"),
        &refund(600),
        None,
    )
    .await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.json()["outcome"], "refunded");
    let again = post(
        &gateway,
        "/v1/refunds",
        Some("refund:re_1"),
        &refund(600),
        None,
    )
    .await;
    assert_eq!((again.status, again.replayed()), (200, true));

    let too_much = post(
        &gateway,
        "/v1/refunds",
        Some("refund:re_2"),
        &refund(1001),
        None,
    )
    .await;
    assert_error(&too_much, 400, "amount_too_large");
    assert_eq!(too_much.json()["error"]["param"], "amount");
    let rest = post(
        &gateway,
        "/v1/refunds",
        Some("refund:re_3"),
        &refund(400),
        None,
    )
    .await;
    assert_eq!(rest.status, 201);

    let payment = get(&gateway, "/v1/operations/auth:ch_1").await.json();
    assert_eq!(
        (
            payment["refunds"].clone(),
            payment["amount_refunded"].clone()
        ),
        (json!(2), json!(1000))
    );
    assert_eq!(
        rows(
            &gateway,
            "SELECT count(*) FROM operations WHERE kind = 'refund'"
        )
        .await,
        2
    );
}

#[tokio::test]
async fn refunds_of_unknown_declined_or_other_currency_payments_are_refused() {
    let gateway = gateway().await;
    authorize(
        &gateway,
        "auth:ch_declined",
        &card(1000, "tok_chargeDeclined"),
    )
    .await;
    authorize(&gateway, "auth:ch_paid", &card(1000, "tok_visa")).await;
    let refund = |payment: &str, currency: &str| json!({"payment": payment, "amount": 100, "currency": currency});
    let unknown = post(
        &gateway,
        "/v1/refunds",
        Some("refund:a"),
        &refund("auth:ch_none", "usd"),
        None,
    )
    .await;
    assert_error(&unknown, 404, "payment_not_found");
    let declined = post(
        &gateway,
        "/v1/refunds",
        Some("refund:b"),
        &refund("auth:ch_declined", "usd"),
        None,
    )
    .await;
    assert_error(&declined, 409, "payment_not_refundable");
    let currency = post(
        &gateway,
        "/v1/refunds",
        Some("refund:c"),
        &refund("auth:ch_paid", "eur"),
        None,
    )
    .await;
    assert_error(&currency, 400, "currency_mismatch");
    assert_eq!(
        rows(
            &gateway,
            "SELECT count(*) FROM operations WHERE kind = 'refund'"
        )
        .await,
        0
    );
}

#[tokio::test]
async fn the_first_refund_of_a_refund_fail_card_is_refused_for_good_and_later_ones_go_through() {
    let gateway = gateway().await;
    authorize(&gateway, "auth:ch_1", &card(1000, "tok_refundFail")).await;
    let refund = json!({"payment": "auth:ch_1", "amount": 1000, "currency": "usd"});
    let first = post(&gateway, "/v1/refunds", Some("refund:re_1"), &refund, None).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.json()["outcome"], "refund_failed");
    assert_eq!(first.json()["failure_reason"], "declined");
    let again = post(&gateway, "/v1/refunds", Some("refund:re_1"), &refund, None).await;
    assert_eq!(
        again.json()["outcome"],
        "refund_failed",
        "the refusal replays"
    );
    let second = post(&gateway, "/v1/refunds", Some("refund:re_2"), &refund, None).await;
    assert_eq!(second.json()["outcome"], "refunded");
}

#[tokio::test]
async fn a_lookup_of_an_unknown_key_is_404_and_of_a_known_one_its_record() {
    let gateway = gateway().await;
    assert_error(
        &get(&gateway, "/v1/operations/auth:ch_none").await,
        404,
        "operation_not_found",
    );
    authorize(&gateway, "auth:ch_1", &card(700, "tok_mastercard")).await;
    let found = get(&gateway, "/v1/operations/auth:ch_1").await;
    assert_eq!(found.status, 200);
    let found = found.json();
    assert_eq!(
        (
            found["kind"].clone(),
            found["outcome"].clone(),
            found["source"].clone()
        ),
        (
            json!("authorization"),
            json!("succeeded"),
            json!("tok_mastercard")
        )
    );
    assert!(found["created"].is_i64());
}

#[tokio::test]
async fn the_ledger_is_listed_oldest_first_a_page_at_a_time_within_a_time_range() {
    let gateway = gateway().await;
    for i in 0..5 {
        authorize(
            &gateway,
            &format!("auth:ch_{i}"),
            &card(100 + i, "tok_visa"),
        )
        .await;
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(key) => format!("/v1/operations?limit=2&starting_after={key}"),
            None => "/v1/operations?limit=2".to_owned(),
        };
        let page = get(&gateway, &path).await;
        assert_eq!(page.status, 200, "{:?}", page.body);
        let page = page.json();
        let data = page["data"].as_array().unwrap();
        assert!(data.len() <= 2);
        seen.extend(data.iter().map(|o| o["key"].as_str().unwrap().to_owned()));
        if !page["has_more"].as_bool().unwrap() {
            assert!(page["next_starting_after"].is_null());
            break;
        }
        after = page["next_starting_after"].as_str().map(str::to_owned);
    }
    let expected: Vec<String> = (0..5).map(|i| format!("auth:ch_{i}")).collect();
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "every operation once: {seen:?}");

    let now = chrono::Utc::now().timestamp();
    let future = get(
        &gateway,
        &format!("/v1/operations?created[gte]={}", now + 60),
    )
    .await;
    assert_eq!(future.json()["data"], json!([]));
    let past = get(
        &gateway,
        &format!(
            "/v1/operations?created[gte]={}&created[lt]={}",
            now - 60,
            now + 60
        ),
    )
    .await;
    assert_eq!(past.json()["data"].as_array().unwrap().len(), 5);

    for bad in [
        "limit=0",
        "limit=1001",
        "limit=x",
        "created[gte]=soon",
        "starting_after=auth:ch_none",
        "sort=desc",
    ] {
        let answer = get(&gateway, &format!("/v1/operations?{bad}")).await;
        assert_eq!(answer.status, 400, "{bad}: {:?}", answer.body);
    }
}

#[tokio::test]
async fn malformed_requests_are_refused_with_json_errors_and_record_nothing() {
    let gateway = gateway().await;
    let no_key = post(
        &gateway,
        "/v1/authorizations",
        None,
        &card(100, "tok_visa"),
        None,
    )
    .await;
    assert_error(&no_key, 400, "idempotency_key_missing");
    let unknown_card = authorize(&gateway, "auth:x", &card(100, "tok_nope")).await;
    assert_error(&unknown_card, 400, "invalid_source");
    let zero = authorize(&gateway, "auth:x", &card(0, "tok_visa")).await;
    assert_error(&zero, 400, "amount_invalid");
    let currency = authorize(
        &gateway,
        "auth:x",
        &json!({"amount": 1, "currency": "USDX", "source": "tok_visa"}),
    )
    .await;
    assert_error(&currency, 400, "currency_invalid");
    let extra = authorize(
        &gateway,
        "auth:x",
        &json!({"amount": 1, "currency": "usd", "source": "tok_visa", "tip": 5}),
    )
    .await;
    assert_error(&extra, 400, "invalid_body");
    let text = Answer::of(
        client(&gateway)
            .post(format!("{}/v1/authorizations", gateway.url))
            .header("Idempotency-Key", "auth:x")
            .header("Content-Type", "text/plain")
            .body("amount=1")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_error(&text, 415, "unsupported_media_type");
    let broken = Answer::of(
        client(&gateway)
            .post(format!("{}/v1/authorizations", gateway.url))
            .header("Idempotency-Key", "auth:x")
            .header("Content-Type", "application/json")
            .body("{\"amount\": 1,")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_error(&broken, 400, "invalid_body");
    assert_error(&get(&gateway, "/v1/nothing").await, 404, "route_not_found");
    assert_eq!(rows(&gateway, "SELECT count(*) FROM operations").await, 0);
}

#[tokio::test]
async fn an_unavailable_card_network_is_503_with_nothing_recorded() {
    let gateway = gateway().await;
    let unavailable = authorize(&gateway, "auth:u", &card(100, "tok_processorUnavailable")).await;
    assert_error(&unavailable, 503, "processor_unavailable");
    let fault = post(
        &gateway,
        "/v1/authorizations",
        Some("auth:f"),
        &card(100, "tok_visa"),
        Some("fail-before-record"),
    )
    .await;
    assert_error(&fault, 503, "processor_unavailable");
    assert_eq!(rows(&gateway, "SELECT count(*) FROM operations").await, 0);
}

#[tokio::test]
async fn an_answer_dropped_after_recording_is_lost_once_and_the_repeat_gets_the_outcome() {
    let gateway = gateway().await;
    let client = client(&gateway);
    let send = || {
        client
            .post(format!("{}/v1/authorizations", gateway.url))
            .header("Idempotency-Key", "auth:ch_dropped")
            .header("Processor-Fault", "drop-after-record")
            .json(&card(900, "tok_visa"))
            .send()
    };
    let lost = send().await;
    assert!(lost.is_err(), "no answer: {lost:?}");
    assert_eq!(
        rows(
            &gateway,
            "SELECT count(*) FROM operations WHERE outcome = 'succeeded'"
        )
        .await,
        1
    );
    // The fault fires only on the request that records: the repeat replays.
    let repeat = Answer::of(send().await.expect("an answer")).await;
    assert_eq!((repeat.status, repeat.replayed()), (200, true));
    assert_eq!(repeat.json()["outcome"], "succeeded");

    // The timeout-after-capture card loses every answer, repeats included.
    for _ in 0..2 {
        let lost = client
            .post(format!("{}/v1/authorizations", gateway.url))
            .header("Idempotency-Key", "auth:ch_timeout")
            .json(&card(900, "tok_processorTimeoutAfterCapture"))
            .send()
            .await;
        assert!(lost.is_err(), "{lost:?}");
    }
    assert_eq!(
        rows(
            &gateway,
            "SELECT count(*) FROM operations WHERE outcome = 'succeeded'"
        )
        .await,
        2
    );
}

#[tokio::test]
async fn the_fault_header_is_refused_unless_fault_injection_is_on() {
    let gateway = TestGateway::start(&[("PROCESSOR_FAULT_INJECTION", "false".to_owned())]).await;
    let refused = post(
        &gateway,
        "/v1/authorizations",
        Some("auth:x"),
        &card(100, "tok_visa"),
        Some("crash-after-record"),
    )
    .await;
    assert_error(&refused, 400, "fault_injection_disabled");
    let on = self::gateway().await;
    let unknown = post(
        &on,
        "/v1/authorizations",
        Some("auth:x"),
        &card(100, "tok_visa"),
        Some("explode"),
    )
    .await;
    assert_error(&unknown, 400, "invalid_fault");
    assert_eq!(rows(&gateway, "SELECT count(*) FROM operations").await, 0);
}

#[tokio::test]
async fn the_gateway_reports_health_readiness_and_metrics() {
    let gateway = gateway().await;
    assert_eq!(get(&gateway, "/healthz").await.status, 200);
    assert_eq!(get(&gateway, "/readyz").await.json()["database"], "ok");
    authorize(&gateway, "auth:ch_1", &card(100, "tok_visa")).await;
    let metrics = get(&gateway, "/metrics").await;
    assert_eq!(metrics.status, StatusCode::OK.as_u16());
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("gateway_operations_total"), "{text}");
    assert!(text.contains("gateway_requests_total"), "{text}");
}

#[tokio::test]
async fn calls_without_a_known_secret_are_refused_401_and_read_or_record_nothing() {
    let gateway = gateway().await;
    authorize(&gateway, "auth:ch_paid", &card(5000, "tok_visa")).await;
    let anonymous = reqwest::Client::new();
    let impostor = as_account("gwsk_0000000000000000_00000000000000000000000000000000");
    let (_, other) = crate::helpers::new_account(&gateway.pool, "someone else").await;
    let mut wrong = other.clone();
    wrong.replace_range(wrong.len() - 4.., "zzzz");
    let wrong = as_account(&wrong);
    for (client, code) in [
        (&anonymous, "api_key_missing"),
        (&impostor, "api_key_invalid"),
        (&wrong, "api_key_invalid"),
    ] {
        let listed = Answer::of(
            client
                .get(format!("{}/v1/operations", gateway.url))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_error(&listed, 401, code);
        assert!(!String::from_utf8_lossy(&listed.body).contains("auth:ch_paid"));
        let looked_up = Answer::of(
            client
                .get(format!("{}/v1/operations/auth:ch_paid", gateway.url))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_error(&looked_up, 401, code);
        let refunded = Answer::of(
            client
                .post(format!("{}/v1/refunds", gateway.url))
                .header("Idempotency-Key", "refund:stolen")
                .json(&json!({"payment": "auth:ch_paid", "amount": 5000, "currency": "usd"}))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_error(&refunded, 401, code);
        let paid = Answer::of(
            client
                .post(format!("{}/v1/authorizations", gateway.url))
                .header("Idempotency-Key", "auth:ch_free")
                .json(&card(100, "tok_visa"))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_error(&paid, 401, code);
    }
    assert_eq!(rows(&gateway, "SELECT count(*) FROM operations").await, 1);
    let secrets: i64 =
        sqlx::query_scalar("SELECT count(*) FROM api_keys WHERE hash = sha256($1::bytea)")
            .bind(other.as_bytes())
            .fetch_one(&gateway.pool)
            .await
            .unwrap();
    assert_eq!(secrets, 1, "the key is stored as the SHA-256 of its secret");
}

#[tokio::test]
async fn another_accounts_payment_is_invisible_unrefundable_and_its_key_stays_free() {
    let gateway = gateway().await;
    authorize(&gateway, "auth:ch_1", &card(5000, "tok_visa")).await;
    let (_, secret) = crate::helpers::new_account(&gateway.pool, "another oncepay").await;
    let other = as_account(&secret);
    let call = |request: reqwest::RequestBuilder| async move {
        Answer::of(request.send().await.unwrap()).await
    };
    let looked_up = call(other.get(format!("{}/v1/operations/auth:ch_1", gateway.url))).await;
    assert_error(&looked_up, 404, "operation_not_found");
    let listed = call(other.get(format!("{}/v1/operations", gateway.url))).await;
    assert_eq!(listed.status, 200, "{:?}", listed.body);
    assert_eq!(listed.json()["data"], json!([]));
    let refund = json!({"payment": "auth:ch_1", "amount": 5000, "currency": "usd"});
    let refunded = call(
        other
            .post(format!("{}/v1/refunds", gateway.url))
            .header("Idempotency-Key", "reconcile-refund:auth:ch_1")
            .json(&refund),
    )
    .await;
    assert_error(&refunded, 404, "payment_not_found");
    let voided =
        call(other.post(format!("{}/v1/authorizations/auth:ch_1/void", gateway.url))).await;
    assert_eq!(voided.json()["outcome"], "voided", "a void of its own key");
    // The owner's payment is untouched, and its own listing shows it alone.
    let own = get(&gateway, "/v1/operations/auth:ch_1").await;
    assert_eq!(own.json()["outcome"], "succeeded");
    assert_eq!(own.json()["amount_refunded"], 0);
    let mine = get(&gateway, "/v1/operations").await;
    let mine = mine.json();
    let keys: Vec<&str> = mine["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["auth:ch_1"]);
    assert_eq!(
        rows(
            &gateway,
            "SELECT count(*) FROM operations WHERE kind = 'refund'"
        )
        .await,
        0
    );
}
