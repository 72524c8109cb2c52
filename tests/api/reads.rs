//! Reading charges back, health checks, and problems for unknown routes.

use serde_json::Value;

use crate::helpers::{Answer, spawn_app, visa};

#[tokio::test]
async fn a_charge_reads_back_as_it_was_created() {
    let app = spawn_app().await;
    let created = Answer::of(
        app.post_charge(
            None,
            &serde_json::json!({
                "amount": 1234, "currency": "GBP", "source": "tok_amex",
                "description": "Blue mug", "metadata": {"sku": "mug-1"}
            }),
        )
        .await,
    )
    .await
    .json();
    let id = created["id"].as_str().unwrap();
    let read = Answer::of(app.get(&format!("/v1/charges/{id}")).await).await;
    assert_eq!(read.status, 200);
    assert_eq!(read.json(), created);
    assert_eq!(created["currency"], "gbp");
    assert_eq!(created["metadata"]["sku"], "mug-1");
    for field in ["failure_code", "failure_message"] {
        assert_eq!(created[field], Value::Null);
    }
    assert_eq!(created["amount_refunded"], 0);
    assert!(created["created"].as_i64().unwrap() > 1_700_000_000);
    Answer::of(app.get("/v1/charges/ch_doesnotexist").await)
        .await
        .assert_problem(404, "resource_missing");
}

#[tokio::test]
async fn the_list_is_newest_first_and_pages_with_starting_after() {
    let app = spawn_app().await;
    let mut ids = Vec::new();
    for amount in 51..=55 {
        let charge = Answer::of(app.post_charge(None, &visa(amount)).await)
            .await
            .json();
        ids.push(charge["id"].as_str().unwrap().to_owned());
    }
    ids.reverse();
    let page = Answer::of(app.get("/v1/charges?limit=2").await)
        .await
        .json();
    assert_eq!(page["object"], "list");
    assert_eq!(page["has_more"], true);
    let got: Vec<_> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(got, ids[..2]);
    let next = Answer::of(
        app.get(&format!("/v1/charges?limit=2&starting_after={}", ids[1]))
            .await,
    )
    .await
    .json();
    let got: Vec<_> = next["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(got, ids[2..4]);
    let last = Answer::of(
        app.get(&format!("/v1/charges?starting_after={}", ids[3]))
            .await,
    )
    .await
    .json();
    assert_eq!(last["has_more"], false);
    assert_eq!(last["data"].as_array().unwrap().len(), 1);
    let all = Answer::of(app.get("/v1/charges").await).await.json();
    assert_eq!(all["data"].as_array().unwrap().len(), 5);
}

fn ids_of(page: &Value) -> Vec<String> {
    page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn ending_before_pages_back_to_newer_charges_newest_first() {
    let app = spawn_app().await;
    let mut ids = Vec::new();
    for amount in 51..=55 {
        ids.push(app.paid_charge(amount).await);
    }
    ids.reverse(); // newest first, as listed
    let page = |query: String| {
        let app = &app;
        async move {
            Answer::of(app.get(&format!("/v1/charges?{query}")).await)
                .await
                .json()
        }
    };
    // The two charges just newer than the oldest, still newest first.
    let before = page(format!("limit=2&ending_before={}", ids[4])).await;
    assert_eq!(ids_of(&before), ids[2..4]);
    assert_eq!(before["has_more"], true, "two newer charges remain");
    let newest = page(format!("limit=2&ending_before={}", ids[2])).await;
    assert_eq!(ids_of(&newest), ids[..2]);
    assert_eq!(newest["has_more"], false);
    let none = page(format!("ending_before={}", ids[0])).await;
    assert_eq!(ids_of(&none), Vec::<String>::new());
    assert_eq!(none["has_more"], false);
    Answer::of(
        app.get(&format!(
            "/v1/charges?starting_after={}&ending_before={}",
            ids[3], ids[1]
        ))
        .await,
    )
    .await
    .assert_problem(400, "parameters_exclusive");
}

#[tokio::test]
async fn bad_list_parameters_are_400_problems() {
    let app = spawn_app().await;
    for (query, code) in [
        ("limit=0", "parameter_invalid_integer"),
        ("limit=101", "parameter_invalid_integer"),
        ("limit=ten", "parameter_invalid_integer"),
        ("starting_after=ch_nope", "resource_missing"),
        ("ending_before=ch_nope", "resource_missing"),
        ("limit=2&limit=3", "parameter_duplicate"),
        ("created[after]=1", "parameter_unknown"),
    ] {
        Answer::of(app.get(&format!("/v1/charges?{query}")).await)
            .await
            .assert_problem(400, code);
    }
}

#[tokio::test]
async fn a_bare_equals_sign_in_the_query_is_no_parameter_and_a_nameless_value_still_is() {
    // `?=` is what async-stripe's paginator sends for a list without
    // parameters; `=x` names a parameter, the empty one, that nothing knows.
    let app = spawn_app().await;
    for path in [
        "/v1/charges?=",
        "/v1/charges?=&limit=2",
        "/v1/events?=",
        "/v1/webhook_endpoints?=",
    ] {
        let answer = Answer::of(app.get(path).await).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.json());
        assert_eq!(answer.json()["object"], "list", "{path}");
    }
    for path in ["/v1/charges?=x", "/v1/balance?=x"] {
        Answer::of(app.get(path).await)
            .await
            .assert_problem(400, "parameter_unknown");
    }
}

#[tokio::test]
async fn health_and_readiness_answer() {
    let app = spawn_app().await;
    assert_eq!(
        app.client
            .get(app.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let ready = app.client.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
}

#[tokio::test]
async fn an_unknown_path_is_404_and_a_method_its_route_lacks_is_405_with_allow() {
    let app = spawn_app().await;
    Answer::of(app.get("/v1/nothing").await)
        .await
        .assert_problem(404, "route_not_found");
    let delete = app
        .client
        .delete(app.url("/v1/charges"))
        .send()
        .await
        .unwrap();
    let delete = Answer::of(delete).await;
    delete.assert_problem(405, "method_not_allowed");
    assert_eq!(delete.header("allow"), Some("GET,HEAD,POST"));
    assert_eq!(
        delete.json()["detail"],
        "Unrecognized request URL (DELETE: /v1/charges). Please see https://stripe.com/docs or we can help at https://support.stripe.com/."
    );
}

#[tokio::test]
async fn without_a_database_readiness_and_requests_are_503_problems() {
    let config = oncepay::config::Config::from_lookup(|name| {
        let value = match name {
            "DATABASE_URL" => "postgres://postgres@127.0.0.1:1/nowhere",
            "PORT" => "0",
            "DATABASE_ACQUIRE_TIMEOUT" => "300ms",
            "SWEEP_INTERVAL" => "1h",
            "PROCESSOR_URL" => "http://127.0.0.1:1",
            "PROCESSOR_API_KEY" => "gwsk_unused",
            _ => return None,
        };
        Some(value.to_owned())
    })
    .unwrap();
    let pool = oncepay::db::pool(&config).unwrap();
    let app = oncepay::startup::Application::build(config, pool)
        .await
        .unwrap();
    let url = format!("http://127.0.0.1:{}", app.port());
    let server = tokio::spawn(app.run_until_stopped(std::future::pending()));
    let client = reqwest::Client::new();

    let health = client.get(format!("{url}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200, "the process is up");
    let ready = Answer::of(client.get(format!("{url}/readyz")).send().await.unwrap()).await;
    ready.assert_problem(503, "service_unavailable");
    assert_eq!(ready.header("retry-after"), Some("1"));
    let charge = client
        .post(format!("{url}/v1/charges"))
        .bearer_auth(format!("sk_test_{}", "a".repeat(32)))
        .json(&visa(100))
        .send()
        .await
        .unwrap();
    let charge = Answer::of(charge).await;
    charge.assert_problem(503, "service_unavailable");
    assert_eq!(
        charge.header("retry-after"),
        Some("1"),
        "nothing was claimed"
    );
    server.abort();
}
