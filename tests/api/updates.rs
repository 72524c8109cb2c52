//! Updates of charges, refunds and webhook endpoints, and the details a
//! charge carries (receipt email, statement descriptors, shipping, transfer
//! group): each read back from the database.

use serde_json::{Value, json};

use crate::helpers::{Answer, TestApp, spawn_app, visa};

impl TestApp {
    /// `POST path` with a JSON body, as this app's merchant.
    async fn post_json(&self, path: &str, key: Option<&str>, body: &Value) -> Answer {
        let mut request = self
            .client
            .post(self.url(path))
            .bearer_auth(&self.api_key)
            .json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        Answer::of(request.send().await.unwrap()).await
    }

    /// `POST path` with a form body, as this app's merchant.
    async fn post_form(&self, path: &str, key: Option<&str>, body: &str) -> Answer {
        let mut request = self
            .client
            .post(self.url(path))
            .bearer_auth(&self.api_key)
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        Answer::of(request.send().await.unwrap()).await
    }

    /// One column of charge `id`, as JSON.
    async fn charge_column(&self, id: &str, column: &str) -> Value {
        let sql = format!("SELECT to_jsonb({column}) FROM charges WHERE id = $1");
        sqlx::query_scalar::<_, Option<Value>>(&sql)
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
            .unwrap_or(Value::Null)
    }

    /// How many events of `kind` are about `object_id`.
    async fn events_of(&self, object_id: &str, kind: &str) -> usize {
        let types = self.event_types_of(object_id).await;
        types.iter().filter(|t| *t == kind).count()
    }

    /// A paid charge with `metadata`; its id.
    async fn charge_with_metadata(&self, metadata: Value) -> String {
        let mut body = visa(2000);
        body["metadata"] = metadata;
        let created = Answer::of(self.post_charge(None, &body).await).await;
        assert_eq!(created.status, 201, "{:?}", created.body);
        created.json()["id"].as_str().unwrap().to_owned()
    }
}

#[tokio::test]
async fn a_charge_update_merges_metadata_removes_keys_given_empty_and_writes_one_event() {
    let app = spawn_app().await;
    let id = app.charge_with_metadata(json!({"a": "1", "b": "2"})).await;
    let path = format!("/v1/charges/{id}");
    let body = json!({"metadata": {"b": "", "c": "3"}, "description": "gift-wrapped"});
    let updated = app.post_json(&path, Some("upd-1"), &body).await;
    assert_eq!(updated.status, 200, "{:?}", updated.body);
    assert_eq!(updated.json()["metadata"], json!({"a": "1", "c": "3"}));
    assert_eq!(updated.json()["description"], "gift-wrapped");
    assert_eq!(
        app.charge_column(&id, "metadata").await,
        json!({"a": "1", "c": "3"})
    );
    assert_eq!(app.charge_column(&id, "description").await, "gift-wrapped");
    assert_eq!(app.events_of(&id, "charge.updated").await, 1);
    let event: Value = sqlx::query_scalar(
        "SELECT data::jsonb FROM events WHERE object_id = $1 AND type = 'charge.updated'",
    )
    .bind(&id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(event["metadata"], json!({"a": "1", "c": "3"}));
}

#[tokio::test]
async fn metadata_given_as_an_empty_string_removes_every_key() {
    let app = spawn_app().await;
    let id = app.charge_with_metadata(json!({"a": "1", "b": "2"})).await;
    let updated = app
        .post_form(&format!("/v1/charges/{id}"), None, "metadata=")
        .await;
    assert_eq!(updated.status, 200, "{:?}", updated.body);
    assert_eq!(app.charge_column(&id, "metadata").await, json!({}));
}

#[tokio::test]
async fn a_retried_charge_update_replays_and_the_key_with_other_parameters_is_refused() {
    let app = spawn_app().await;
    let id = app.charge_with_metadata(json!({})).await;
    let path = format!("/v1/charges/{id}");
    let first = app
        .post_json(&path, Some("upd"), &json!({"metadata": {"n": "1"}}))
        .await;
    let again = app
        .post_json(&path, Some("upd"), &json!({"metadata": {"n": "1"}}))
        .await;
    assert_eq!((first.status, again.status), (200, 200));
    assert!(again.replayed());
    assert_eq!(first.body, again.body);
    let other = app
        .post_json(&path, Some("upd"), &json!({"metadata": {"n": "2"}}))
        .await;
    other.assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.charge_column(&id, "metadata").await, json!({"n": "1"}));
    assert_eq!(app.events_of(&id, "charge.updated").await, 1);
}

#[tokio::test]
async fn updating_an_unknown_or_another_merchants_charge_is_404_and_leaves_the_key_free() {
    let app = spawn_app().await;
    let other_key = app.other_merchant().await;
    let foreign = Answer::of(app.post_charge_as(&other_key, None, &visa(500)).await).await;
    let foreign = foreign.json()["id"].as_str().unwrap().to_owned();
    for id in ["ch_nope", foreign.as_str()] {
        let path = format!("/v1/charges/{id}");
        let refused = app
            .post_json(&path, Some("k-404"), &json!({"description": "x"}))
            .await;
        refused.assert_problem(404, "resource_missing");
    }
    assert_eq!(app.keys().await, 0);
    assert_eq!(
        app.charge_column(&foreign, "description").await,
        Value::Null
    );
}

#[tokio::test]
async fn bad_charge_updates_are_refused_with_their_code_and_change_nothing() {
    let app = spawn_app().await;
    let fifty: serde_json::Map<String, Value> =
        (0..50).map(|n| (format!("k{n}"), json!("v"))).collect();
    let id = app.charge_with_metadata(Value::Object(fifty)).await;
    let path = format!("/v1/charges/{id}");
    for (body, code) in [
        (json!({"amount": 5}), "parameter_unknown"),
        (json!({"metadata": {"one_more": "v"}}), "metadata_invalid"),
        (
            json!({"fraud_details": {"user_report": "maybe"}}),
            "parameter_invalid_string",
        ),
        (
            json!({"fraud_details": {"stripe_report": "safe"}}),
            "parameter_unknown",
        ),
        (json!({"receipt_email": "not-an-email"}), "email_invalid"),
        (
            json!({"shipping": {"address": {"line1": "1 Main"}}}),
            "parameter_missing",
        ),
        (json!({"customer": "cus_1"}), "parameter_unsupported"),
    ] {
        let refused = app.post_json(&path, None, &body).await;
        refused.assert_problem(400, code);
    }
    assert_eq!(
        app.charge_column(&id, "(SELECT count(*) FROM jsonb_object_keys(metadata))")
            .await,
        50
    );
    assert_eq!(app.charge_column(&id, "fraud_details").await, json!({}));
    assert_eq!(app.events_of(&id, "charge.updated").await, 0);
}

#[tokio::test]
async fn fraud_reports_receipt_emails_and_shipping_are_set_by_update_and_removed_by_empty_strings()
{
    let app = spawn_app().await;
    let id = app.charge_with_metadata(json!({})).await;
    let path = format!("/v1/charges/{id}");
    let form = "fraud_details[user_report]=safe&receipt_email=jenny%40example.com\
                &shipping[name]=Jenny&shipping[address][line1]=1+Main+St&shipping[address][country]=US";
    let updated = app.post_form(&path, None, form).await;
    assert_eq!(updated.status, 200, "{:?}", updated.body);
    assert_eq!(
        updated.json()["fraud_details"],
        json!({"user_report": "safe"})
    );
    assert_eq!(
        app.charge_column(&id, "fraud_details").await,
        json!({"user_report": "safe"})
    );
    assert_eq!(
        app.charge_column(&id, "receipt_email").await,
        "jenny@example.com"
    );
    assert_eq!(
        app.charge_column(&id, "shipping->'address'->>'line1'")
            .await,
        "1 Main St"
    );
    assert_eq!(updated.json()["shipping"]["name"], "Jenny");
    let removed = app.post_form(&path, None, "receipt_email=&shipping=").await;
    assert_eq!(removed.status, 200, "{:?}", removed.body);
    assert_eq!(app.charge_column(&id, "receipt_email").await, Value::Null);
    assert_eq!(app.charge_column(&id, "shipping").await, Value::Null);
}

#[tokio::test]
async fn an_update_that_changes_nothing_writes_no_event() {
    let app = spawn_app().await;
    let id = app.charge_with_metadata(json!({"a": "1"})).await;
    let same = app
        .post_json(
            &format!("/v1/charges/{id}"),
            None,
            &json!({"metadata": {"a": "1"}}),
        )
        .await;
    assert_eq!(same.status, 200);
    assert_eq!(app.events_of(&id, "charge.updated").await, 0);
}

#[tokio::test]
async fn a_refund_update_merges_metadata_writes_refund_updated_and_replays() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    let body = json!({"charge": charge, "metadata": {"a": "1", "b": "2"}});
    let refund = Answer::of(app.post_refund(None, &body).await).await;
    let refund = refund.json()["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/refunds/{refund}");
    let update = json!({"metadata": {"a": "", "c": "3"}});
    let updated = app.post_json(&path, Some("re-upd"), &update).await;
    assert_eq!(updated.status, 200, "{:?}", updated.body);
    let again = app.post_json(&path, Some("re-upd"), &update).await;
    assert!(again.replayed());
    let stored: Value = sqlx::query_scalar("SELECT metadata FROM refunds WHERE id = $1")
        .bind(&refund)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, json!({"b": "2", "c": "3"}));
    assert_eq!(app.events_of(&refund, "refund.updated").await, 1);
    let refused = app.post_json(&path, None, &json!({"amount": 5})).await;
    refused.assert_problem(400, "parameter_unknown");
    app.post_json("/v1/refunds/re_nope", None, &update)
        .await
        .assert_problem(404, "resource_missing");
}

/// The endpoint's stored url, status, disabled reason, description, metadata.
async fn endpoint_row(app: &TestApp, id: &str) -> Value {
    sqlx::query_scalar(
        "SELECT jsonb_build_array(url, status, disabled_reason, description, metadata, enabled_events)
           FROM webhook_endpoints WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_webhook_endpoint_update_changes_what_it_is_given_and_disables_and_enables_it() {
    let app = spawn_app().await;
    let created = app
        .post_json(
            "/v1/webhook_endpoints",
            None,
            &json!({"url": "https://93.184.216.34/a", "enabled_events": ["*"], "metadata": {"t": "1"}}),
        )
        .await;
    assert_eq!(created.status, 201, "{:?}", created.body);
    let id = created.json()["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/webhook_endpoints/{id}");
    let form = "url=https://93.184.216.34/b&enabled_events[]=charge.updated&disabled=true\
                &description=orders&metadata[t]=&metadata[u]=2";
    let updated = app.post_form(&path, Some("we-upd"), form).await;
    assert_eq!(updated.status, 200, "{:?}", updated.body);
    assert!(updated.json().get("secret").is_none());
    assert_eq!(
        endpoint_row(&app, &id).await,
        json!(["https://93.184.216.34/b", "disabled", "disabled by the merchant", "orders",
               {"u": "2"}, ["charge.updated"]])
    );
    let enabled = app
        .post_json(&path, None, &json!({"disabled": false, "description": ""}))
        .await;
    assert_eq!(enabled.json()["status"], "enabled");
    let row = endpoint_row(&app, &id).await;
    assert_eq!(
        (&row[1], &row[2], &row[3]),
        (&json!("enabled"), &Value::Null, &Value::Null)
    );
}

#[tokio::test]
async fn a_webhook_endpoint_update_checks_its_url_as_the_create_does() {
    let app = spawn_app().await;
    let created = app
        .post_json(
            "/v1/webhook_endpoints",
            None,
            &json!({"url": "https://93.184.216.34/a", "enabled_events": ["*"]}),
        )
        .await;
    let id = created.json()["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/webhook_endpoints/{id}");
    for url in ["ftp://example.com/x", "http://127.0.0.1:9/inside"] {
        app.post_json(&path, Some(url), &json!({"url": url}))
            .await
            .assert_problem(400, "url_invalid");
    }
    app.post_json(&path, None, &json!({"disabled": "yes"}))
        .await
        .assert_problem(400, "parameter_invalid_type");
    app.post_json(
        "/v1/webhook_endpoints/we_nope",
        None,
        &json!({"description": "x"}),
    )
    .await
    .assert_problem(404, "resource_missing");
    assert_eq!(endpoint_row(&app, &id).await[0], "https://93.184.216.34/a");
    assert_eq!(app.keys().await, 0);
}

#[tokio::test]
async fn a_charge_created_with_details_stores_and_shows_them_from_json_and_from_a_form() {
    let app = spawn_app().await;
    let mut body = visa(2000);
    body["receipt_email"] = json!("jenny@example.com");
    body["statement_descriptor_suffix"] = json!("ORDER 42");
    body["transfer_group"] = json!("order-42");
    body["shipping"] = json!({"name": "Jenny", "phone": "+15555550123",
                              "address": {"line1": "1 Main St", "city": "SF"}});
    let created = Answer::of(app.post_charge(None, &body).await).await;
    assert_eq!(created.status, 201, "{:?}", created.body);
    let charge = created.json();
    let id = charge["id"].as_str().unwrap();
    assert_eq!(charge["receipt_email"], "jenny@example.com");
    assert_eq!(
        charge["calculated_statement_descriptor"],
        "ONCEPAY* ORDER 42"
    );
    assert_eq!(charge["shipping"]["address"]["line2"], Value::Null);
    assert_eq!(app.charge_column(id, "transfer_group").await, "order-42");
    assert_eq!(
        app.charge_column(id, "statement_descriptor_suffix").await,
        "ORDER 42"
    );
    assert_eq!(
        app.charge_column(id, "shipping->>'phone'").await,
        "+15555550123"
    );
    let form = "amount=100&currency=usd&source=tok_visa&statement_descriptor=Shop+Order\
                &shipping[name]=Jo&shipping[address][line1]=2+High+St";
    let created = app.post_form("/v1/charges", None, form).await;
    assert_eq!(created.status, 201, "{:?}", created.body);
    let id = created.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        app.charge_column(&id, "statement_descriptor").await,
        "Shop Order"
    );
    assert_eq!(
        app.charge_column(&id, "shipping->'address'->>'line1'")
            .await,
        "2 High St"
    );
    let read = Answer::of(app.get(&format!("/v1/charges/{id}")).await).await;
    assert_eq!(read.json()["statement_descriptor"], "Shop Order");
}

#[tokio::test]
async fn a_card_charges_statement_descriptor_is_its_suffix_unless_it_has_one_as_at_stripe() {
    let app = spawn_app().await;
    let shown = |body: Value| {
        let app = &app;
        async move {
            let created = Answer::of(app.post_charge(None, &body).await).await;
            assert_eq!(created.status, 201, "{:?}", created.body);
            let charge = created.json();
            let id = charge["id"].as_str().unwrap();
            let read = Answer::of(app.get(&format!("/v1/charges/{id}")).await).await;
            assert_eq!(read.json(), charge);
            charge
        }
    };
    let mut body = visa(2000);
    body["statement_descriptor"] = json!("Shop Order");
    let alone = shown(body.clone()).await;
    assert_eq!(
        alone["calculated_statement_descriptor"],
        "ONCEPAY* Shop Order"
    );
    assert_eq!(alone["statement_descriptor"], "Shop Order");
    assert_eq!(alone["statement_descriptor_suffix"], Value::Null);

    body["statement_descriptor_suffix"] = json!("ORDER 42");
    let both = shown(body).await;
    assert_eq!(both["calculated_statement_descriptor"], "ONCEPAY* ORDER 42");
    assert_eq!(both["statement_descriptor"], "Shop Order");

    let mut long = visa(2000);
    long["statement_descriptor"] = json!("A VERY LONG ORDER 4242");
    let cut = shown(long).await;
    assert_eq!(
        cut["calculated_statement_descriptor"],
        "ONCEPAY* A VERY LONG O"
    );
}

#[tokio::test]
async fn a_retry_with_another_receipt_email_is_a_reused_key() {
    let app = spawn_app().await;
    let mut body = visa(2000);
    body["receipt_email"] = json!("a@example.com");
    let first = Answer::of(app.post_charge(Some("re-email"), &body).await).await;
    assert_eq!(first.status, 201);
    body["receipt_email"] = json!("b@example.com");
    Answer::of(app.post_charge(Some("re-email"), &body).await)
        .await
        .assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn charge_details_are_checked_as_stripe_checks_them_and_a_refusal_writes_no_charge() {
    let app = spawn_app().await;
    for (field, value, code) in [
        (
            "statement_descriptor",
            json!("x".repeat(23)),
            "parameter_too_long",
        ),
        (
            "statement_descriptor",
            json!("12345"),
            "parameter_invalid_string",
        ),
        (
            "statement_descriptor",
            json!("Shop <3"),
            "parameter_invalid_string",
        ),
        (
            "statement_descriptor_suffix",
            json!("A*B"),
            "parameter_invalid_string",
        ),
        ("receipt_email", json!("jenny@"), "email_invalid"),
        (
            "receipt_email",
            json!("jenny example@x.com"),
            "email_invalid",
        ),
        ("shipping", json!({"address": {}}), "parameter_missing"),
        ("shipping", json!({"name": "Jo"}), "parameter_missing"),
        (
            "shipping",
            json!({"name": "Jo", "address": {"street": "x"}}),
            "parameter_unknown",
        ),
        ("transfer_group", json!(7), "parameter_invalid_type"),
    ] {
        let mut body = visa(2000);
        body[field] = value;
        let refused = Answer::of(app.post_charge(None, &body).await).await;
        refused.assert_problem(400, code);
    }
    assert_eq!(app.charges().await, 0);
}

#[tokio::test]
async fn stripes_connect_and_customer_parameters_are_refused_by_name() {
    let app = spawn_app().await;
    for (field, value) in [
        ("customer", json!("cus_1")),
        ("on_behalf_of", json!("acct_1")),
        ("transfer_data", json!({"destination": "acct_1"})),
        ("application_fee_amount", json!(100)),
    ] {
        let mut body = visa(2000);
        body[field] = value;
        let refused = Answer::of(app.post_charge(None, &body).await).await;
        refused.assert_problem(400, "parameter_unsupported");
        assert_eq!(refused.json()["param"], field);
    }
    assert_eq!(app.charges().await, 0);
}

#[tokio::test]
async fn a_stripe_account_header_is_refused_and_no_charge_is_written() {
    let app = spawn_app().await;
    let refused = app
        .client
        .post(app.url("/v1/charges"))
        .bearer_auth(&app.api_key)
        .header("Stripe-Account", "acct_1032D82eZvKYlo2C")
        .header("Idempotency-Key", "connect-1")
        .json(&visa(2000))
        .send()
        .await
        .unwrap();
    let refused = Answer::of(refused).await;
    refused.assert_problem(403, "account_invalid");
    assert!(
        refused.json()["detail"]
            .as_str()
            .unwrap()
            .contains("acct_1032D82eZvKYlo2C")
    );
    assert_eq!((app.charges().await, app.keys().await), (0, 0));
}
