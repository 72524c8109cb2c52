//! What the official Stripe SDKs read: the `error` member of every problem
//! (with Stripe's codes, `decline_code`, `param` and `doc_url`),
//! `Stripe-Should-Retry`, `Request-Id`, and, sent with `Stripe-Version`,
//! Stripe's statuses: `400` for a reused key, `200` for a create.

use serde_json::{Value, json};

use crate::helpers::{Answer, Settings, TestApp, spawn_app, spawn_app_with, visa};

#[track_caller]
fn assert_error(answer: &Answer, expected: Value) {
    assert_eq!(answer.json()["error"], expected, "{:?}", answer.body);
}

/// Sends `body` to `path` as a Stripe SDK does: with `Stripe-Version`.
async fn stripe_post(app: &TestApp, path: &str, key: Option<&str>, body: &Value) -> Answer {
    let mut request = app
        .client
        .post(app.url(path))
        .bearer_auth(&app.api_key)
        .header("Stripe-Version", "2024-06-20");
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    Answer::of(request.json(body).send().await.unwrap()).await
}

#[tokio::test]
async fn a_decline_is_a_card_error_with_its_decline_code_and_charge() {
    let app = spawn_app().await;
    let body =
        json!({"amount": 500, "currency": "usd", "source": "tok_chargeDeclinedInsufficientFunds"});
    let declined = Answer::of(app.post_charge(Some("s1"), &body).await).await;
    declined.assert_problem(402, "card_declined");
    let problem = declined.json();
    let charge = problem["charge"].as_str().unwrap();
    assert_error(
        &declined,
        json!({
            "type": "card_error",
            "code": "card_declined",
            "decline_code": "insufficient_funds",
            "doc_url": "https://stripe.com/docs/error-codes/card-declined",
            "message": "Your card has insufficient funds.",
            "charge": charge,
        }),
    );
    assert_eq!(declined.header("stripe-should-retry"), Some("false"));
    let (status, failure_code): (String, String) =
        sqlx::query_as("SELECT status, failure_code FROM charges WHERE id = $1")
            .bind(charge)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), failure_code.as_str()),
        ("failed", "card_declined")
    );
}

#[tokio::test]
async fn every_decline_has_stripes_code_decline_code_and_param() {
    let app = spawn_app().await;
    for (token, code, decline_code, param, message) in [
        (
            "tok_chargeDeclined",
            "card_declined",
            Some("generic_decline"),
            None,
            "Your card was declined.",
        ),
        (
            "tok_chargeDeclinedInsufficientFunds",
            "card_declined",
            Some("insufficient_funds"),
            None,
            "Your card has insufficient funds.",
        ),
        (
            "tok_chargeDeclinedLostCard",
            "card_declined",
            Some("lost_card"),
            None,
            "Your card was declined.",
        ),
        (
            "tok_chargeDeclinedStolenCard",
            "card_declined",
            Some("stolen_card"),
            None,
            "Your card was declined.",
        ),
        (
            "tok_chargeDeclinedFraudulent",
            "card_declined",
            Some("fraudulent"),
            None,
            "Your card was declined.",
        ),
        (
            "tok_chargeDeclinedExpiredCard",
            "expired_card",
            None,
            Some("exp_month"),
            "Your card has expired.",
        ),
        (
            "tok_chargeDeclinedIncorrectCvc",
            "incorrect_cvc",
            None,
            Some("cvc"),
            "Your card's security code is incorrect.",
        ),
        (
            "tok_chargeDeclinedProcessingError",
            "processing_error",
            None,
            None,
            "An error occurred while processing your card. Try again in a little bit.",
        ),
    ] {
        let body = json!({"amount": 500, "currency": "usd", "source": token});
        let declined = Answer::of(app.post_charge(Some(token), &body).await).await;
        declined.assert_problem(402, code);
        let charge = declined.json()["charge"].as_str().unwrap().to_owned();
        let mut error = json!({
            "type": "card_error",
            "code": code,
            "doc_url": format!("https://stripe.com/docs/error-codes/{}", code.replace('_', "-")),
            "message": message,
            "charge": charge,
        });
        if let Some(decline_code) = decline_code {
            error["decline_code"] = json!(decline_code);
        }
        if let Some(param) = param {
            error["param"] = json!(param);
            assert_eq!(declined.json()["param"], param, "{token}");
        }
        assert_error(&declined, error);
        let object = Answer::of(app.get(&format!("/v1/charges/{charge}")).await)
            .await
            .json();
        assert_eq!(object["failure_code"], code, "{token}");
        assert_eq!(object["failure_message"], message, "{token}");
    }
}

#[tokio::test]
async fn errors_with_a_code_stripe_has_link_to_its_page_and_others_do_not() {
    let app = spawn_app().await;
    let unknown = Answer::of(
        app.post_charge(
            None,
            &json!({"amount": 500, "currency": "usd", "source": "tok_visa", "tip": 1}),
        )
        .await,
    )
    .await;
    unknown.assert_problem(400, "parameter_unknown");
    assert_eq!(
        unknown.json()["error"]["doc_url"],
        "https://stripe.com/docs/error-codes/parameter-unknown"
    );
    assert_eq!(
        unknown.json().get("doc_url"),
        None,
        "the problem's `type` is its link"
    );
    let missing = Answer::of(app.get("/v1/charges/ch_nothing").await).await;
    assert_eq!(
        missing.json()["error"]["doc_url"],
        "https://stripe.com/docs/error-codes/resource-missing"
    );
    let own = Answer::of(app.post_raw(Some("t"), "text/plain", "amount=1").await).await;
    own.assert_problem(415, "unsupported_media_type");
    assert_eq!(own.json()["error"].get("doc_url"), None);
}

#[tokio::test]
async fn unknown_routes_and_methods_are_stripes_404_unrecognized_request_url() {
    let app = spawn_app().await;
    let send = |method: reqwest::Method, path: &str| {
        app.client
            .request(method, app.url(path))
            .bearer_auth(&app.api_key)
            .header("Stripe-Version", "2024-06-20")
            .send()
    };
    for (method, path) in [
        (reqwest::Method::POST, "/v1/foo"),
        (reqwest::Method::GET, "/v1/payment_intents"),
        (reqwest::Method::DELETE, "/v1/charges/ch_x"),
        (reqwest::Method::DELETE, "/v1/charges"),
        (reqwest::Method::PUT, "/v1/refunds"),
    ] {
        let answer = Answer::of(send(method.clone(), path).await.unwrap()).await;
        answer.assert_problem(404, "route_not_found");
        let message = format!(
            "Unrecognized request URL ({method}: {path}). Please see https://stripe.com/docs or we can help at https://support.stripe.com/."
        );
        assert_error(
            &answer,
            json!({
                "type": "invalid_request_error",
                "code": "route_not_found",
                "message": message,
            }),
        );
        assert_eq!(answer.header("stripe-should-retry"), Some("false"));
    }
    assert_eq!(app.charges().await, 0);
}

#[tokio::test]
async fn a_create_is_200_for_a_stripe_client_and_201_for_any_other_replays_included() {
    let app = spawn_app().await;
    let charge = stripe_post(&app, "/v1/charges", Some("c-200"), &visa(2000)).await;
    assert_eq!(charge.status, 200, "{:?}", charge.body);
    assert!(charge.header("location").is_some());
    let id = charge.json()["id"].as_str().unwrap().to_owned();
    let replay = stripe_post(&app, "/v1/charges", Some("c-200"), &visa(2000)).await;
    assert!(replay.replayed());
    assert_eq!((replay.status, &replay.body), (200, &charge.body));
    // The saved answer keeps HTTP's status, and a plain client gets it.
    let plain = Answer::of(app.post_charge(Some("c-200"), &visa(2000)).await).await;
    assert!(plain.replayed());
    assert_eq!((plain.status, &plain.body), (201, &charge.body));
    let saved: i16 =
        sqlx::query_scalar("SELECT response_status FROM idempotency_keys WHERE key = 'c-200'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(saved, 201);

    let refund = stripe_post(&app, "/v1/refunds", Some("r-200"), &json!({"charge": id})).await;
    assert_eq!(refund.status, 200, "{:?}", refund.body);
    let endpoint = stripe_post(
        &app,
        "/v1/webhook_endpoints",
        Some("w-200"),
        &json!({"url": "https://example.com/hook", "enabled_events": ["*"]}),
    )
    .await;
    assert_eq!(endpoint.status, 200, "{:?}", endpoint.body);
    // An error keeps its status.
    let declined = json!({"amount": 500, "currency": "usd", "source": "tok_chargeDeclined"});
    stripe_post(&app, "/v1/charges", None, &declined)
        .await
        .assert_problem(402, "card_declined");
}

#[tokio::test]
async fn a_replayed_decline_carries_the_error_member_byte_for_byte() {
    let app = spawn_app().await;
    let body = json!({"amount": 500, "currency": "usd", "source": "tok_chargeDeclined"});
    let first = Answer::of(app.post_charge(Some("s2"), &body).await).await;
    first.assert_problem(402, "card_declined");
    assert_eq!(first.json()["error"]["decline_code"], "generic_decline");
    let replay = Answer::of(app.post_charge(Some("s2"), &body).await).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.json()["error"]["type"], "card_error");
    assert_eq!(replay.header("stripe-should-retry"), Some("false"));
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn a_missing_parameter_is_an_invalid_request_error_naming_it() {
    let app = spawn_app().await;
    let missing = Answer::of(
        app.post_charge(None, &json!({"currency": "usd", "source": "tok_visa"}))
            .await,
    )
    .await;
    missing.assert_problem(400, "parameter_missing");
    let problem = missing.json();
    assert_error(
        &missing,
        json!({
            "type": "invalid_request_error",
            "code": "parameter_missing",
            "doc_url": "https://stripe.com/docs/error-codes/parameter-missing",
            "message": problem["detail"],
            "param": "amount",
        }),
    );
    assert_eq!(missing.header("stripe-should-retry"), Some("false"));
    assert_eq!(app.charges().await, 0);
}

#[tokio::test]
async fn a_wrong_api_key_is_an_invalid_request_error_with_401() {
    let app = spawn_app().await;
    let refused = Answer::of(app.post_charge_as("sk_test_wrong", None, &visa(500)).await).await;
    refused.assert_problem(401, "invalid_api_key");
    assert_eq!(refused.json()["error"]["type"], "invalid_request_error");
    assert_eq!(refused.json()["error"]["code"], "invalid_api_key");
    assert_eq!(refused.header("stripe-should-retry"), Some("false"));
    assert_eq!(app.charges().await, 0);
}

#[tokio::test]
async fn an_unknown_charge_is_404_with_should_retry_false() {
    let app = spawn_app().await;
    let missing = Answer::of(app.get("/v1/charges/ch_nothing").await).await;
    missing.assert_problem(404, "resource_missing");
    assert_eq!(missing.json()["error"]["type"], "invalid_request_error");
    assert_eq!(missing.json()["error"]["param"], "id");
    assert_eq!(missing.header("stripe-should-retry"), Some("false"));
}

#[tokio::test]
async fn a_reused_key_is_422_without_stripe_version_and_400_with_it() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("s3"), &visa(500)).await).await;
    assert_eq!(first.status, 201);

    let plain = Answer::of(app.post_charge(Some("s3"), &visa(600)).await).await;
    plain.assert_problem(422, "idempotency_key_reused");
    assert_eq!(plain.json()["error"]["type"], "idempotency_error");
    assert_eq!(plain.header("stripe-should-retry"), Some("false"));

    let stripe = Answer::of(
        app.client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "s3")
            .header("Stripe-Version", "2024-06-20")
            .json(&visa(600))
            .send()
            .await
            .unwrap(),
    )
    .await;
    stripe.assert_problem(400, "idempotency_key_reused");
    assert_error(
        &stripe,
        json!({
            "type": "idempotency_error",
            "code": "idempotency_key_reused",
            "message": "Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than 's3' if you meant to execute a different request.",
            "param": "Idempotency-Key",
        }),
    );
    assert_eq!(stripe.header("stripe-should-retry"), Some("false"));
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn a_stripe_version_header_changes_no_other_answer() {
    let app = spawn_app().await;
    let charge = Answer::of(
        app.client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "s4")
            .header("Stripe-Version", "2024-06-20")
            .json(&visa(500))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(charge.status, 200, "a create, as Stripe answers it");
    assert_eq!(charge.header("stripe-should-retry"), None);
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn an_unavailable_processor_is_an_api_error_worth_retrying() {
    let app = spawn_app().await;
    let body = json!({"amount": 500, "currency": "usd", "source": "tok_processorUnavailable"});
    let unavailable = Answer::of(app.post_charge(Some("s5"), &body).await).await;
    unavailable.assert_problem(503, "processor_unavailable");
    assert_eq!(unavailable.json()["error"]["type"], "api_error");
    assert_eq!(unavailable.header("stripe-should-retry"), Some("true"));
}

#[tokio::test]
async fn every_error_carries_stripe_should_retry_false_for_the_client_and_true_for_the_server() {
    let app = spawn_app_with(Settings::new().set("MAX_BODY_BYTES", 1024)).await;
    let not_allowed = Answer::of(
        app.client
            .delete(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .send()
            .await
            .unwrap(),
    )
    .await;
    not_allowed.assert_problem(405, "method_not_allowed");
    let mut big = visa(500);
    big["description"] = json!("d".repeat(2000));
    let too_large = Answer::of(
        app.post_raw(Some("big"), "application/json", big.to_string())
            .await,
    )
    .await;
    too_large.assert_problem(413, "payload_too_large");
    let unsupported = Answer::of(app.post_raw(Some("text"), "text/plain", "amount=1").await).await;
    unsupported.assert_problem(415, "unsupported_media_type");
    for refused in [&not_allowed, &too_large, &unsupported] {
        assert_eq!(
            refused.header("stripe-should-retry"),
            Some("false"),
            "{}",
            refused.status
        );
    }

    // A 500: every event insert fails while this trigger is there, so the
    // charge cannot settle.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_events() RETURNS trigger LANGUAGE plpgsql
             AS $$ BEGIN RAISE EXCEPTION 'events refused'; END $$;
         CREATE TRIGGER refuse_events BEFORE INSERT ON events
             FOR EACH ROW EXECUTE FUNCTION refuse_events();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let failed = Answer::of(app.post_charge(Some("bug"), &visa(500)).await).await;
    failed.assert_problem(500, "internal_error");
    assert_eq!(failed.json()["error"]["type"], "api_error");
    assert_eq!(failed.header("stripe-should-retry"), Some("true"));
}

#[tokio::test]
async fn every_response_carries_request_id_equal_to_x_request_id() {
    let app = spawn_app().await;
    let answers = [
        Answer::of(app.post_charge(None, &visa(500)).await).await,
        Answer::of(app.get("/v1/charges/ch_nothing").await).await,
        Answer::of(app.client.get(app.url("/healthz")).send().await.unwrap()).await,
    ];
    for answer in &answers {
        let id = answer.header("x-request-id").expect("an X-Request-Id");
        assert!(!id.is_empty());
        assert_eq!(answer.header("request-id"), Some(id), "{}", answer.status);
    }
    let given = Answer::of(
        app.client
            .get(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("X-Request-Id", "req_mine")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(given.header("request-id"), Some("req_mine"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_flight_is_an_invalid_request_error_worth_retrying() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 1000)).await;
    let body = visa(2000);
    let first = app.post_charge(Some("s6"), &body);
    let second = async {
        app.until_in_flight("s6").await;
        Answer::of(app.post_charge(Some("s6"), &visa(2000)).await).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status(), 201);
    second.assert_problem(409, "idempotency_key_in_use");
    assert_eq!(second.json()["error"]["type"], "invalid_request_error");
    assert_eq!(second.header("stripe-should-retry"), Some("true"));
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn expand_is_accepted_and_every_property_is_refused_as_not_expandable() {
    let app = spawn_app().await;
    let charge = app.paid_charge(700).await;
    // An empty list asks for nothing; the SDKs send `expand[0]=...`.
    let mut body = visa(100);
    body["expand"] = json!([]);
    assert_eq!(
        Answer::of(app.post_charge(None, &body).await).await.status,
        201
    );
    for path in [
        format!("/v1/charges/{charge}?expand[]=balance_transaction"),
        format!("/v1/charges/{charge}?expand[0]=customer"),
        "/v1/charges?expand[]=data.customer".to_owned(),
        "/v1/balance?expand[0]=x".to_owned(),
    ] {
        let answer = Answer::of(app.get(&path).await).await;
        answer.assert_problem(400, "property_not_expandable");
        assert_eq!(answer.json()["param"], "expand", "{path}");
        assert!(
            answer.json()["detail"]
                .as_str()
                .unwrap()
                .starts_with("This property cannot be expanded ("),
            "{path}: {:?}",
            answer.body
        );
    }
    let form = "amount=1&currency=usd&source=tok_visa&expand[0]=balance_transaction";
    Answer::of(
        app.post_raw(
            Some("expand-form"),
            "application/x-www-form-urlencoded",
            form,
        )
        .await,
    )
    .await
    .assert_problem(400, "property_not_expandable");
    let mut body = json!({"charge": charge});
    body["expand"] = json!(["charge"]);
    Answer::of(app.post_refund(Some("expand-refund"), &body).await)
        .await
        .assert_problem(400, "property_not_expandable");
    Answer::of(app.get(&format!("/v1/charges/{charge}?expand[x]=y")).await)
        .await
        .assert_problem(400, "parameter_unknown");
    Answer::of(app.get(&format!("/v1/charges/{charge}?color=red")).await)
        .await
        .assert_problem(400, "parameter_unknown");
    assert_eq!(app.charges().await, 2, "nothing refused was written");
    assert_eq!(app.refunds().await, 0);
}

#[tokio::test]
async fn the_stripe_client_user_agent_header_is_accepted() {
    let app = spawn_app().await;
    let answer = Answer::of(
        app.client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("Stripe-Version", "2024-06-20")
            .header(
                "X-Stripe-Client-User-Agent",
                r#"{"bindings_version":"16.1.0","lang":"python","publisher":"stripe"}"#,
            )
            .header("Idempotency-Key", "6a1f3c6e-6e0b-4f7e-9a77-2d2b8b0d6b41")
            .json(&visa(300))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(app.charges().await, 1);
}
