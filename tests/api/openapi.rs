//! The OpenAPI document and Swagger UI.

use std::collections::BTreeSet;

use crate::helpers::{Answer, Settings, TestApp, spawn_app_with};

/// Every route of the API, as (method, path template). Routes are only ever
/// added through `utoipa_axum::routes!` (see the source check below), which
/// documents them as it registers them; Swagger UI at `/docs` is mounted
/// beside the API and is not part of it.
const SERVED: &[(&str, &str)] = &[
    ("get", "/v1/charges"),
    ("post", "/v1/charges"),
    ("get", "/v1/charges/{id}"),
    ("get", "/v1/charges/{id}/refunds"),
    ("get", "/v1/charges/{id}/refunds/{refund}"),
    ("post", "/v1/charges/{id}"),
    ("post", "/v1/charges/{id}/capture"),
    ("post", "/v1/refunds"),
    ("get", "/v1/refunds"),
    ("get", "/v1/refunds/{id}"),
    ("post", "/v1/refunds/{id}"),
    ("get", "/v1/events"),
    ("get", "/v1/events/{id}"),
    ("get", "/v1/balance"),
    ("get", "/v1/events/{id}/deliveries"),
    ("post", "/v1/webhook_endpoints"),
    ("get", "/v1/webhook_endpoints"),
    ("get", "/v1/webhook_endpoints/{id}"),
    ("post", "/v1/webhook_endpoints/{id}"),
    ("delete", "/v1/webhook_endpoints/{id}"),
    ("get", "/v1/idempotency_keys/{key}"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("get", "/lab"),
    ("get", "/demo/effects"),
    ("get", "/demo/settings"),
    ("post", "/demo/naive/charges"),
    ("post", "/demo/naive/refunds"),
    ("post", "/demo/redis/charges"),
    ("post", "/demo/receivers"),
    ("get", "/demo/receivers"),
    ("post", "/demo/receiver/naive"),
    ("post", "/demo/receiver/inbox"),
    ("post", "/demo/processor/payments"),
    ("get", "/demo/processor/payments"),
    ("get", "/demo/trace"),
    ("post", "/demo/broker/deliveries"),
    ("post", "/demo/broker/window"),
];

/// The document `app` serves at `/openapi.json`, answered `200`.
async fn served_document(app: &TestApp) -> serde_json::Value {
    let answer = Answer::of(app.get("/openapi.json").await).await;
    assert_eq!(answer.status, 200);
    answer.json()
}

#[tokio::test]
async fn the_served_document_lists_every_route_the_router_serves() {
    let app = spawn_app_with(Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")).await;
    let doc = served_document(&app).await;
    assert_eq!(doc["openapi"], "3.1.0");
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .map(move |m| (m.clone(), path.clone()))
        })
        .collect();
    let expected: BTreeSet<(String, String)> = SERVED
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(documented, expected);

    // And every documented operation is really served: none falls through
    // to the router's 404 or 405.
    for (method, path) in &documented {
        let url = app.url(
            &path
                .replace("{id}", "x")
                .replace("{key}", "x")
                .replace("{refund}", "x"),
        );
        let request = match method.as_str() {
            "get" => app.client.get(url),
            "post" => app.client.post(url).json(&serde_json::json!({})),
            "delete" => app.client.delete(url),
            other => panic!("undocumented method {other}"),
        };
        let answer = Answer::of(request.bearer_auth(&app.api_key).send().await.unwrap()).await;
        let code = serde_json::from_slice::<serde_json::Value>(&answer.body)
            .ok()
            .and_then(|b| b["code"].as_str().map(str::to_owned));
        assert!(
            !matches!(
                code.as_deref(),
                Some("route_not_found" | "method_not_allowed")
            ),
            "{method} {path} is documented but not served"
        );
    }
}

#[test]
fn routes_are_only_added_where_they_are_documented() {
    for entry in std::fs::read_dir("src/http").unwrap() {
        let path = entry.unwrap().path();
        let source = std::fs::read_to_string(&path).unwrap();
        for (n, line) in source.lines().enumerate() {
            let code = line.trim_start();
            assert!(
                code.starts_with("//") || !(code.contains(".route(") || code.contains(".nest(")),
                "{}:{}: add routes with utoipa_axum::routes! so they are documented",
                path.display(),
                n + 1
            );
        }
    }
}

#[tokio::test]
async fn the_document_describes_headers_codes_and_auth() {
    let app = spawn_app_with(Settings::new()).await;
    let doc = served_document(&app).await;
    let create = &doc["paths"]["/v1/charges"]["post"];
    let params: Vec<&str> = create["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(params, ["Idempotency-Key", "Prefer"]);
    let bodies: Vec<&String> = create["requestBody"]["content"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(
        bodies,
        ["application/json", "application/x-www-form-urlencoded"]
    );
    assert!(create["responses"]["201"]["headers"]["Idempotent-Replayed"].is_object());
    assert!(create["responses"]["409"].is_object() && create["responses"]["422"].is_object());
    let schemes = doc["components"]["securitySchemes"].as_object().unwrap();
    assert!(schemes.contains_key("bearer") && schemes.contains_key("basic"));
    let codes = doc["components"]["schemas"]["ProblemCode"]["enum"]
        .as_array()
        .unwrap();
    for code in [
        "idempotency_key_in_use",
        "idempotency_key_reused",
        "card_declined",
        "request_timeout",
    ] {
        assert!(codes.iter().any(|c| c == code), "{code}");
    }
    let explained = doc["components"]["schemas"]["ProblemCode"]["description"]
        .as_str()
        .unwrap();
    assert!(
        explained.contains("`idempotency_key_in_use` (409)"),
        "{explained}"
    );
}

#[tokio::test]
async fn swagger_ui_at_docs_reads_the_document_and_fetches_nothing_from_the_internet() {
    let app = spawn_app_with(Settings::new()).await;
    // `/docs` redirects to `/docs/`, whose page loads its files relative to it.
    let page = app.client.get(app.url("/docs")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert_eq!(page.url().path(), "/docs/");
    let html = page.text().await.unwrap();
    assert!(html.contains("swagger-ui"), "{html}");
    let mut files = vec![html];
    for file in [
        "swagger-initializer.js",
        "swagger-ui.css",
        "swagger-ui-bundle.js",
    ] {
        let answer = app
            .client
            .get(app.url(&format!("/docs/{file}")))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{file}");
        files.push(answer.text().await.unwrap());
    }
    let initializer = &files[1];
    assert!(
        initializer.contains(r#""url": "/openapi.json""#),
        "{initializer}"
    );
    assert!(
        initializer.contains(r#""tryItOutEnabled": true"#),
        "{initializer}"
    );
    // The page and its settings name no outside address: the spec validator,
    // which would send the document to swagger.io, is off.
    for text in &files[..2] {
        assert!(
            !text.contains("http://") && !text.contains("https://"),
            "nothing from the internet: {text}"
        );
    }
    assert!(
        initializer.contains(r#""validatorUrl": "none""#),
        "{initializer}"
    );
}

#[tokio::test]
async fn every_operation_has_a_plain_summary_of_its_own() {
    let app = spawn_app_with(Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")).await;
    let doc = served_document(&app).await;
    let mut summaries = std::collections::BTreeMap::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let summary = operation["summary"].as_str().unwrap_or("");
            assert!(!summary.is_empty(), "{method} {path} has no summary");
            assert!(!summary.contains('`'), "{method} {path}: {summary}");
            assert!(
                !summary.contains('\n'),
                "{method} {path}: one line: {summary}"
            );
            summaries.insert((method.clone(), path.clone()), summary.to_owned());
        }
    }
    let capture = &summaries[&("post".to_owned(), "/v1/charges/{id}/capture".to_owned())];
    assert!(capture.starts_with("Captures"), "{capture}");
}
