//! Objects in Stripe's shapes: every field of Stripe's own fixtures
//! (`tests/api/fixtures/stripe_fields.json`, copied from Stripe's OpenAPI
//! repository), each test token's documented outcome and card, and saved
//! answers that keep the bytes they were saved with.

use serde_json::{Value, json};

use std::time::Duration;

use crate::helpers::{Answer, TestApp, spawn_app, until, visa};

const FIELDS: &str = include_str!("fixtures/stripe_fields.json");

/// Stripe's field tree of `resource`, with the paths that may be `null`
/// where the fixture shows an object, and those whose object is one of
/// several kinds (only their presence is compared).
struct Fixture {
    fields: Value,
    nullable: Vec<String>,
    polymorphic: Vec<String>,
}

impl Fixture {
    fn of(resource: &str) -> Self {
        let all: Value = serde_json::from_str(FIELDS).expect("the fixture file is JSON");
        let paths = |name: &str| -> Vec<String> {
            all[name]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_str().unwrap().to_owned())
                .collect()
        };
        let fields = all["resources"][resource].clone();
        assert!(fields.is_object(), "no fixture for {resource}");
        Fixture {
            fields,
            nullable: paths("nullable"),
            polymorphic: paths("polymorphic"),
        }
    }

    /// Every way `object` differs from Stripe's fields: a missing field, a
    /// `null` object that Stripe never leaves `null`, another JSON type.
    fn mismatches(&self, path: &str, expected: &Value, object: &Value) -> Vec<String> {
        let mut found = Vec::new();
        match (expected, object) {
            (Value::Object(fields), Value::Object(ours)) => {
                for (name, field) in fields {
                    let at = format!("{path}.{name}");
                    match ours.get(name) {
                        None => found.push(format!("{at}: missing")),
                        Some(_) if self.polymorphic.contains(&at) => {}
                        Some(value) => found.extend(self.mismatches(&at, field, value)),
                    }
                }
            }
            (Value::Object(_), Value::Null) if self.nullable.iter().any(|p| p == path) => {}
            (Value::Array(element), Value::Array(ours)) => {
                if let Some(element) = element.first() {
                    for (i, value) in ours.iter().enumerate() {
                        found.extend(self.mismatches(&format!("{path}[{i}]"), element, value));
                    }
                }
            }
            // A field Stripe's fixture leaves null may be anything.
            (Value::String(kind), _) if kind == "null" => {}
            (Value::String(_), Value::Null) if self.nullable.iter().any(|p| p == path) => {}
            (Value::String(kind), value) if kind == json_type(value) => {}
            (expected, value) => found.push(format!("{path}: {value} is not like {expected}")),
        }
        found
    }
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Fails, naming every missing or mistyped field, unless `object` carries
/// every field of Stripe's `resource`.
#[track_caller]
fn assert_stripe_shape(resource: &str, object: &Value) {
    let fixture = Fixture::of(resource);
    let found = fixture.mismatches(resource, &fixture.fields, object);
    assert!(
        found.is_empty(),
        "{resource} differs from Stripe's:\n{}\n{object:#}",
        found.join("\n")
    );
}

async fn get_json(app: &TestApp, path: &str) -> Value {
    let answer = Answer::of(app.get(path).await).await;
    assert_eq!(answer.status, 200, "{path}: {:?}", answer.body);
    answer.json()
}

fn charge_of(token: &str) -> Value {
    json!({"amount": 2000, "currency": "usd", "source": token})
}

#[test]
fn the_comparison_fails_on_a_missing_field_a_null_object_and_a_wrong_type() {
    let fixture = Fixture::of("refund");
    let mut refund = fixture.fields.clone();
    refund["amount"] = json!(100);
    refund.as_object_mut().unwrap().remove("payment_intent");
    refund["destination_details"] = Value::Null;
    refund["created"] = json!("yesterday");
    let found = fixture.mismatches("refund", &fixture.fields, &refund);
    assert_eq!(
        found,
        [
            "refund.created: \"yesterday\" is not like \"integer\"",
            "refund.destination_details: null is not like {\"card\":{\"type\":\"string\"},\"type\":\"string\"}",
            "refund.payment_intent: missing",
        ]
    );
}

#[tokio::test]
async fn every_object_carries_every_field_of_stripes_fixtures() {
    let app = spawn_app().await;
    let paid = Answer::of(app.post_charge(Some("shape-paid"), &visa(2000)).await).await;
    assert_eq!(paid.status, 201, "{:?}", paid.body);
    assert_stripe_shape("charge", &paid.json());
    let charge_id = paid.json()["id"].as_str().unwrap().to_owned();

    let declined = Answer::of(
        app.post_charge(Some("shape-declined"), &charge_of("tok_chargeDeclined"))
            .await,
    )
    .await;
    declined.assert_problem(402, "card_declined");
    let declined_id = declined.json()["charge"].as_str().unwrap().to_owned();
    assert_stripe_shape(
        "charge",
        &get_json(&app, &format!("/v1/charges/{declined_id}")).await,
    );

    let refund = Answer::of(
        app.post_refund(
            Some("shape-refund"),
            &json!({"charge": charge_id, "amount": 500}),
        )
        .await,
    )
    .await;
    assert_eq!(refund.status, 201, "{:?}", refund.body);
    assert_stripe_shape("refund", &refund.json());

    let charge = get_json(&app, &format!("/v1/charges/{charge_id}")).await;
    assert_stripe_shape("charge", &charge);
    let refunds = &charge["refunds"]["data"];
    assert_eq!(refunds.as_array().unwrap().len(), 1, "{charge:#}");
    assert_stripe_shape("refund", &refunds[0]);
    for charge in get_json(&app, "/v1/charges").await["data"]
        .as_array()
        .unwrap()
    {
        assert_stripe_shape("charge", charge);
    }

    assert_stripe_shape("balance", &get_json(&app, "/v1/balance").await);
    // charge.succeeded, charge.failed, refund.created, charge.refunded: a
    // list shows an event once no earlier one can still commit.
    until(Duration::from_secs(10), "four events listed", || async {
        get_json(&app, "/v1/events").await["data"]
            .as_array()
            .is_some_and(|events| events.len() == 4)
    })
    .await;
    let events = get_json(&app, "/v1/events").await;
    for event in events["data"].as_array().unwrap() {
        assert_stripe_shape("event", event);
        let object = &event["data"]["object"];
        let kind = object["object"].as_str().unwrap();
        assert_stripe_shape(kind, object);
    }

    let endpoint = Answer::of(
        app.client
            .post(app.url("/v1/webhook_endpoints"))
            .bearer_auth(&app.api_key)
            .json(&json!({"url": "https://example.com/hook", "enabled_events": ["*"]}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(endpoint.status, 201, "{:?}", endpoint.body);
    assert_stripe_shape("webhook_endpoint", &endpoint.json());
    let id = endpoint.json()["id"].as_str().unwrap().to_owned();
    assert_stripe_shape(
        "webhook_endpoint",
        &get_json(&app, &format!("/v1/webhook_endpoints/{id}")).await,
    );
}

#[tokio::test]
async fn a_paid_charge_reports_stripes_outcome_and_its_card() {
    let app = spawn_app().await;
    let paid = Answer::of(app.post_charge(None, &charge_of("tok_visa")).await).await;
    assert_eq!(paid.status, 201, "{:?}", paid.body);
    let charge = paid.json();
    let id = charge["id"].as_str().unwrap();
    let suffix = id.strip_prefix("ch_").unwrap();
    assert_eq!(
        (
            &charge["paid"],
            &charge["captured"],
            &charge["amount_captured"]
        ),
        (&json!(true), &json!(true), &json!(2000))
    );
    assert_eq!(
        charge["outcome"],
        json!({
            "advice_code": null, "network_advice_code": null, "network_decline_code": null,
            "network_status": "approved_by_network", "reason": null, "risk_level": "normal",
            "seller_message": "Payment complete.", "type": "authorized",
        })
    );
    assert_eq!(charge["payment_method"], format!("card_{suffix}"));
    assert_eq!(charge["source"]["id"], format!("card_{suffix}"));
    assert_eq!(charge["source"]["brand"], "Visa");
    assert_eq!(charge["balance_transaction"], format!("txn_{suffix}"));
    let card = &charge["payment_method_details"]["card"];
    assert_eq!(
        (
            &card["brand"],
            &card["last4"],
            &card["funding"],
            &card["country"],
            &card["network"]
        ),
        (
            &json!("visa"),
            &json!("4242"),
            &json!("credit"),
            &json!("US"),
            &json!("visa")
        )
    );
    assert_eq!(card["checks"]["cvc_check"], "pass");
    assert_eq!(
        charge["refunds"],
        json!({"object": "list", "data": [], "has_more": false, "url": format!("/v1/charges/{id}/refunds")})
    );
    // The same charge, read back, renders the same way.
    assert_eq!(get_json(&app, &format!("/v1/charges/{id}")).await, charge);
}

/// (token, brand, last4, funding, country, the card object's brand) of the
/// cards that pay, as Stripe's testing docs give them.
const PAYING: [(&str, &str, &str, &str, &str, &str); 10] = [
    ("tok_visa", "visa", "4242", "credit", "US", "Visa"),
    ("tok_visa_debit", "visa", "5556", "debit", "US", "Visa"),
    (
        "tok_mastercard",
        "mastercard",
        "4444",
        "credit",
        "US",
        "MasterCard",
    ),
    (
        "tok_mastercard_debit",
        "mastercard",
        "8210",
        "debit",
        "US",
        "MasterCard",
    ),
    (
        "tok_mastercard_prepaid",
        "mastercard",
        "5100",
        "prepaid",
        "US",
        "MasterCard",
    ),
    (
        "tok_amex",
        "amex",
        "8431",
        "credit",
        "US",
        "American Express",
    ),
    (
        "tok_discover",
        "discover",
        "1117",
        "credit",
        "US",
        "Discover",
    ),
    ("tok_jcb", "jcb", "0505", "credit", "JP", "JCB"),
    (
        "tok_unionpay",
        "unionpay",
        "0005",
        "credit",
        "CN",
        "UnionPay",
    ),
    (
        "tok_diners",
        "diners",
        "0004",
        "credit",
        "US",
        "Diners Club",
    ),
];

#[tokio::test]
async fn each_paying_token_and_its_payment_method_charges_its_own_card() {
    let app = spawn_app().await;
    let payment_methods = PAYING.map(|(token, brand, last4, funding, country, display)| {
        let name = token.replacen("tok_", "pm_card_", 1);
        (name, brand, last4, funding, country, display)
    });
    let tokens = PAYING.map(|(token, brand, last4, funding, country, display)| {
        (token.to_owned(), brand, last4, funding, country, display)
    });
    for (token, brand, last4, funding, country, display) in tokens.iter().chain(&payment_methods) {
        let (token, brand, last4, funding, country, display) =
            (token.as_str(), *brand, *last4, *funding, *country, *display);
        let paid = Answer::of(app.post_charge(None, &charge_of(token)).await).await;
        assert_eq!(paid.status, 201, "{token}: {:?}", paid.body);
        let charge = paid.json();
        let card = &charge["payment_method_details"]["card"];
        assert_eq!(
            (
                card["brand"].as_str(),
                card["last4"].as_str(),
                card["funding"].as_str(),
                card["country"].as_str()
            ),
            (Some(brand), Some(last4), Some(funding), Some(country)),
            "{token}"
        );
        assert_eq!(charge["outcome"]["type"], "authorized", "{token}");
        assert_eq!(charge["source"]["last4"], last4, "{token}");
        assert_eq!(charge["source"]["brand"], display, "{token}");
        let status: String = sqlx::query_scalar("SELECT status FROM charges WHERE id = $1")
            .bind(charge["id"].as_str().unwrap())
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(status, "succeeded", "{token}");
    }
}

/// (token, error code, decline code, outcome type, network status, outcome
/// reason, risk level, last4).
type Declining = (
    &'static str,
    &'static str,
    Option<&'static str>,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);

const DECLINING: [Declining; 8] = [
    (
        "tok_chargeDeclined",
        "card_declined",
        Some("generic_decline"),
        "issuer_declined",
        "declined_by_network",
        "generic_decline",
        "normal",
        "0002",
    ),
    (
        "tok_chargeDeclinedInsufficientFunds",
        "card_declined",
        Some("insufficient_funds"),
        "issuer_declined",
        "declined_by_network",
        "insufficient_funds",
        "normal",
        "9995",
    ),
    (
        "tok_chargeDeclinedExpiredCard",
        "expired_card",
        None,
        "issuer_declined",
        "declined_by_network",
        "expired_card",
        "normal",
        "0069",
    ),
    (
        "tok_chargeDeclinedIncorrectCvc",
        "incorrect_cvc",
        None,
        "issuer_declined",
        "declined_by_network",
        "incorrect_cvc",
        "normal",
        "0127",
    ),
    (
        "tok_chargeDeclinedProcessingError",
        "processing_error",
        None,
        "issuer_declined",
        "declined_by_network",
        "processing_error",
        "normal",
        "0119",
    ),
    (
        "tok_chargeDeclinedFraudulent",
        "card_declined",
        Some("fraudulent"),
        "blocked",
        "not_sent_to_network",
        "highest_risk_level",
        "highest",
        "0019",
    ),
    (
        "tok_chargeDeclinedLostCard",
        "card_declined",
        Some("lost_card"),
        "issuer_declined",
        "declined_by_network",
        "lost_card",
        "normal",
        "9987",
    ),
    (
        "tok_chargeDeclinedStolenCard",
        "card_declined",
        Some("stolen_card"),
        "issuer_declined",
        "declined_by_network",
        "stolen_card",
        "normal",
        "9979",
    ),
];

#[tokio::test]
async fn an_elevated_risk_card_pays_and_is_placed_in_review() {
    let app = spawn_app().await;
    for token in ["tok_riskLevelElevated", "pm_card_riskLevelElevated"] {
        let paid = Answer::of(app.post_charge(None, &charge_of(token)).await).await;
        assert_eq!(paid.status, 201, "{token}: {:?}", paid.body);
        let charge = paid.json();
        assert_eq!(
            (&charge["status"], &charge["paid"]),
            (&json!("succeeded"), &json!(true))
        );
        assert_eq!(
            charge["outcome"],
            json!({
                "advice_code": null,
                "network_advice_code": null,
                "network_decline_code": null,
                "network_status": "approved_by_network",
                "reason": "elevated_risk_level",
                "risk_level": "elevated",
                "seller_message": "Stripe evaluated this payment as having elevated risk, and placed it in your manual review queue.",
                "type": "manual_review",
            }),
            "{token}"
        );
        assert_eq!(charge["payment_method_details"]["card"]["last4"], "9235");
    }
}

#[tokio::test]
async fn oncepays_own_fault_tokens_have_no_payment_method_name() {
    let app = spawn_app().await;
    let answer = Answer::of(
        app.post_charge(None, &charge_of("pm_card_processorUnavailable"))
            .await,
    )
    .await;
    answer.assert_problem(400, "resource_missing");
    assert_eq!(answer.json()["param"], "source");
}

#[tokio::test]
async fn each_declining_token_gets_stripes_codes_outcome_and_card() {
    let app = spawn_app().await;
    for (token, code, decline_code, kind, network_status, reason, risk_level, last4) in DECLINING {
        let key = format!("decline-{token}");
        let declined = Answer::of(app.post_charge(Some(&key), &charge_of(token)).await).await;
        declined.assert_problem(402, code);
        let problem = declined.json();
        assert_eq!(problem["error"]["type"], "card_error", "{token}");
        assert_eq!(problem["error"]["code"], code, "{token}");
        assert_eq!(
            problem["error"]["decline_code"].as_str(),
            decline_code,
            "{token}"
        );
        let id = problem["charge"].as_str().unwrap();
        let charge = get_json(&app, &format!("/v1/charges/{id}")).await;
        assert_eq!(
            (
                &charge["status"],
                &charge["paid"],
                &charge["amount_captured"]
            ),
            (&json!("failed"), &json!(false), &json!(0)),
            "{token}"
        );
        assert_eq!(charge["failure_code"], code, "{token}");
        assert_eq!(charge["failure_message"], problem["detail"], "{token}");
        let outcome = &charge["outcome"];
        assert_eq!(
            (
                outcome["type"].as_str(),
                outcome["network_status"].as_str(),
                outcome["reason"].as_str(),
                outcome["risk_level"].as_str()
            ),
            (
                Some(kind),
                Some(network_status),
                Some(reason),
                Some(risk_level)
            ),
            "{token}"
        );
        assert!(outcome["seller_message"].is_string(), "{token}");
        assert_eq!(
            charge["payment_method_details"]["card"]["last4"], last4,
            "{token}"
        );
        assert_eq!(charge["balance_transaction"], Value::Null, "{token}");
        let cvc = if token == "tok_chargeDeclinedIncorrectCvc" {
            "fail"
        } else {
            "pass"
        };
        assert_eq!(
            charge["payment_method_details"]["card"]["checks"]["cvc_check"], cvc,
            "{token}"
        );
        // The decline is saved: a retry gets the same bytes.
        let again = Answer::of(app.post_charge(Some(&key), &charge_of(token)).await).await;
        assert!(again.replayed(), "{token}");
        assert_eq!(again.body, declined.body, "{token}");
    }
    let failed: i64 = sqlx::query_scalar("SELECT count(*) FROM charges WHERE status = 'failed'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(failed, DECLINING.len() as i64);
}

#[tokio::test]
async fn an_answer_saved_before_the_objects_grew_is_replayed_with_its_old_bytes() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("old-shape"), &visa(1500)).await).await;
    assert_eq!(first.status, 201);
    let id = first.json()["id"].as_str().unwrap().to_owned();
    // The charge object as oncepay rendered it before it carried Stripe's
    // every field, saved under the key as it was then.
    let old = format!(
        r#"{{"id":"{id}","object":"charge","amount":1500,"currency":"usd","status":"succeeded","paid":true,"captured":true,"source":"tok_visa","description":null,"metadata":{{}},"failure_code":null,"failure_message":null,"amount_refunded":0,"refunded":false,"created":1700000000,"livemode":false}}"#
    );
    let updated = sqlx::query(
        "UPDATE idempotency_keys SET response_body = $1 WHERE key = 'old-shape' AND charge_id = $2",
    )
    .bind(old.as_bytes())
    .bind(&id)
    .execute(&app.pool)
    .await
    .unwrap();
    assert_eq!(updated.rows_affected(), 1);

    let replay = Answer::of(app.post_charge(Some("old-shape"), &visa(1500)).await).await;
    assert!(replay.replayed());
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body.as_ref(), old.as_bytes());
    // The charge itself is read in today's shape; no second charge was made.
    assert_stripe_shape(
        "charge",
        &get_json(&app, &format!("/v1/charges/{id}")).await,
    );
    assert_eq!(app.charges().await, 1);
}
