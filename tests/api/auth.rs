//! Authentication and tenant isolation.

use crate::helpers::{Answer, spawn_app, visa};

#[tokio::test]
async fn a_request_without_a_key_is_401_with_www_authenticate() {
    let app = spawn_app().await;
    let response = app
        .client
        .post(app.url("/v1/charges"))
        .json(&visa(2000))
        .send()
        .await
        .unwrap();
    let answer = Answer::of(response).await;
    answer.assert_problem(401, "authentication_required");
    let challenges: Vec<_> = answer.headers.get_all("www-authenticate").iter().collect();
    assert!(
        challenges
            .iter()
            .any(|c| c.to_str().unwrap().starts_with("Bearer"))
    );
    assert!(
        challenges
            .iter()
            .any(|c| c.to_str().unwrap().starts_with("Basic"))
    );
    assert_eq!(app.charges().await, 0);
}

#[tokio::test]
async fn a_wrong_key_is_401_and_writes_nothing() {
    let app = spawn_app().await;
    let wrong = format!("sk_test_{}", "x".repeat(32));
    for key in [wrong.as_str(), "sk_test_short", "not-a-key"] {
        let answer = Answer::of(app.post_charge_as(key, Some("k"), &visa(2000)).await).await;
        answer.assert_problem(401, "invalid_api_key");
        assert!(answer.header("www-authenticate").is_some());
        assert!(
            !String::from_utf8_lossy(&answer.body).contains(key),
            "the key is not echoed"
        );
    }
    assert_eq!((app.charges().await, app.keys().await), (0, 0));
}

#[tokio::test]
async fn basic_auth_with_the_key_as_user_name_works_like_curl_u() {
    let app = spawn_app().await;
    let response = app
        .client
        .post(app.url("/v1/charges"))
        .basic_auth(&app.api_key, Some(""))
        .form(&[
            ("amount", "2000"),
            ("currency", "usd"),
            ("source", "tok_visa"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let with_password = app
        .client
        .get(app.url("/v1/charges"))
        .basic_auth(&app.api_key, Some("secret"))
        .send()
        .await
        .unwrap();
    assert_eq!(with_password.status(), 401);
}

#[tokio::test]
async fn another_merchants_charge_is_not_found() {
    let app = spawn_app().await;
    let created = Answer::of(app.post_charge(None, &visa(2000)).await)
        .await
        .json();
    let other = app.other_merchant().await;
    let id = created["id"].as_str().unwrap();
    let response = app
        .client
        .get(app.url(&format!("/v1/charges/{id}")))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    Answer::of(response)
        .await
        .assert_problem(404, "resource_missing");
    let list = app
        .client
        .get(app.url("/v1/charges"))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(Answer::of(list).await.json()["data"], serde_json::json!([]));
}

#[tokio::test]
async fn only_the_sha256_of_the_key_is_stored() {
    let app = spawn_app().await;
    let stored: Vec<u8> = sqlx::query_scalar("SELECT api_key_hash FROM merchants WHERE id = $1")
        .bind(app.merchant_id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let expected: Vec<u8> = sqlx::query_scalar("SELECT sha256($1::bytea)")
        .bind(app.api_key.as_bytes())
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, expected);
}
