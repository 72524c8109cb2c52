//! Retries, replays, reuse with other parameters, expiry.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::helpers::{Answer, Settings, spawn_app, spawn_app_with, visa};

#[tokio::test]
async fn a_charge_without_a_key_is_created_once_per_request() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(None, &visa(2000)).await).await;
    let second = Answer::of(app.post_charge(None, &visa(2000)).await).await;
    assert_eq!((first.status, second.status), (201, 201));
    assert_ne!(first.json()["id"], second.json()["id"]);
    assert_eq!(app.charges().await, 2, "no key, no protection: two charges");
    assert_eq!(app.payments().await, 2);
}

#[tokio::test]
async fn a_retry_replays_the_same_body_and_creates_one_charge() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("order-1"), &visa(2000)).await).await;
    let retry = Answer::of(app.post_charge(Some("order-1"), &visa(2000)).await).await;

    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(first.body, retry.body, "the replay is byte for byte");
    assert_eq!(first.header("content-type"), retry.header("content-type"));
    let id = first.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        first.header("location"),
        Some(format!("/v1/charges/{id}").as_str())
    );
    assert_eq!(retry.header("location"), first.header("location"));

    let charge = first.json();
    assert_eq!(charge["object"], "charge");
    assert_eq!(charge["status"], "succeeded");
    assert_eq!(charge["amount"], 2000);
    assert_eq!(charge["livemode"], false);
    assert!(id.starts_with("ch_") && id.len() >= 27);

    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
    let status: String =
        sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE key = 'order-1'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(status, "completed");
}

#[tokio::test]
async fn a_different_amount_with_the_same_key_is_422_and_changes_nothing() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("order-1"), &visa(2000)).await).await;
    assert_eq!(first.status, 201);
    let (charges, keys) = (app.charges().await, app.keys().await);
    let saved: Vec<u8> = sqlx::query_scalar("SELECT response_body FROM idempotency_keys")
        .fetch_one(&app.pool)
        .await
        .unwrap();

    let reused = Answer::of(app.post_charge(Some("order-1"), &visa(3000)).await).await;
    reused.assert_problem(422, "idempotency_key_reused");
    assert_eq!((app.charges().await, app.keys().await), (charges, keys));
    assert_eq!(app.payments().await, 1);
    let saved_after: Vec<u8> = sqlx::query_scalar("SELECT response_body FROM idempotency_keys")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(saved, saved_after, "the saved response is untouched");

    // And the original still replays.
    let retry = Answer::of(app.post_charge(Some("order-1"), &visa(2000)).await).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
}

#[tokio::test]
async fn json_and_form_bodies_with_equal_parameters_share_a_fingerprint() {
    let app = spawn_app().await;
    let json_body = json!({
        "metadata": {"order": "42", "customer": "ada"},
        "source": "tok_visa", "currency": "USD", "amount": 2000, "description": "Tea"
    });
    let first = Answer::of(app.post_charge(Some("k"), &json_body).await).await;
    assert_eq!(first.status, 201);
    let form = "amount=2000&currency=usd&source=tok_visa&description=Tea&metadata[customer]=ada&metadata%5Border%5D=42";
    let retry = Answer::of(
        app.post_raw(Some("k"), "application/x-www-form-urlencoded", form)
            .await,
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed(), "the form request is the same operation");
    assert_eq!(retry.body, first.body);
    // White space and key order in JSON do not matter either.
    let spaced = r#"{ "amount" : 2000 , "currency":"usd","source":"tok_visa",
        "description":"Tea", "metadata": {"customer":"ada","order":"42"} }"#;
    let again = Answer::of(
        app.post_raw(Some("k"), "application/json; charset=utf-8", spaced)
            .await,
    )
    .await;
    assert!(again.replayed());
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn two_merchants_with_one_key_string_get_two_charges() {
    let app = spawn_app().await;
    let other = app.other_merchant().await;
    let mine = Answer::of(app.post_charge(Some("shared-key"), &visa(2000)).await).await;
    let theirs = Answer::of(
        app.post_charge_as(&other, Some("shared-key"), &visa(2000))
            .await,
    )
    .await;
    assert_eq!((mine.status, theirs.status), (201, 201));
    assert!(!theirs.replayed());
    assert_ne!(mine.json()["id"], theirs.json()["id"]);
    assert_eq!(app.charges().await, 2);
    assert_eq!(app.keys().await, 2);
    assert_eq!(app.payments().await, 2);
}

#[tokio::test]
async fn a_decline_is_stored_and_replayed() {
    let app = spawn_app().await;
    let body =
        json!({"amount": 500, "currency": "eur", "source": "tok_chargeDeclinedInsufficientFunds"});
    let first = Answer::of(app.post_charge(Some("d1"), &body).await).await;
    first.assert_problem(402, "card_declined");
    assert_eq!(first.json()["error"]["decline_code"], "insufficient_funds");
    let charge_id = first.json()["charge"].as_str().unwrap().to_owned();
    let retry = Answer::of(app.post_charge(Some("d1"), &body).await).await;
    assert_eq!(retry.status, 402);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);

    let (status, code): (String, String) =
        sqlx::query_as("SELECT status, failure_code FROM charges WHERE id = $1")
            .bind(&charge_id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), code.as_str()),
        ("failed", "card_declined")
    );
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 0, "a decline moves no money");

    let charge = Answer::of(app.get(&format!("/v1/charges/{charge_id}")).await).await;
    assert_eq!(charge.json()["failure_code"], "card_declined");
    assert_eq!(charge.json()["outcome"]["reason"], "insufficient_funds");
}

#[tokio::test]
async fn every_decline_token_fails_with_its_code() {
    let app = spawn_app().await;
    for (token, code) in [
        ("tok_chargeDeclined", "card_declined"),
        ("tok_chargeDeclinedInsufficientFunds", "card_declined"),
        ("tok_chargeDeclinedExpiredCard", "expired_card"),
    ] {
        let body = json!({"amount": 100, "currency": "usd", "source": token});
        Answer::of(app.post_charge(None, &body).await)
            .await
            .assert_problem(402, code);
    }
    for token in ["tok_visa", "tok_mastercard", "tok_amex"] {
        let body = json!({"amount": 100, "currency": "usd", "source": token});
        assert_eq!(app.post_charge(None, &body).await.status(), 201);
    }
    assert_eq!(app.payments().await, 3);
    assert_eq!(
        app.count("SELECT count(*) FROM charges WHERE status = 'failed'")
            .await,
        3
    );
}

#[tokio::test]
async fn a_validation_error_leaves_the_key_free() {
    let app = spawn_app().await;
    let bad = json!({"amount": 0, "currency": "usd", "source": "tok_visa"});
    Answer::of(app.post_charge(Some("fix-me"), &bad).await)
        .await
        .assert_problem(400, "parameter_invalid_integer");
    assert_eq!(app.keys().await, 0, "nothing saved for a refused request");

    let corrected = Answer::of(app.post_charge(Some("fix-me"), &visa(2000)).await).await;
    assert_eq!(corrected.status, 201);
    assert!(!corrected.replayed(), "the corrected request runs normally");
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn an_expired_key_runs_anew() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("old"), &visa(2000)).await).await;
    sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    // Expired counts as never seen, with other parameters too.
    let again = Answer::of(app.post_charge(Some("old"), &visa(3000)).await).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed());
    assert_ne!(again.json()["id"], first.json()["id"]);
    assert_eq!(app.charges().await, 2);
    assert_eq!(app.keys().await, 1, "the expired row was taken over");
    let expires_in: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - now())::float8 FROM idempotency_keys",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(expires_in > 23.0 * 3600.0, "a fresh TTL: {expires_in}");
}

#[tokio::test]
async fn a_cached_answer_lives_as_long_as_the_database_gives_its_key_and_no_longer() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("short"), &visa(2000)).await).await;
    assert_eq!(first.status, 201);
    sqlx::query("UPDATE idempotency_keys SET expires_at = now() + interval '2 seconds'")
        .execute(&app.pool)
        .await
        .unwrap();
    let started = Instant::now();
    // This replay reads the row, with its 2 s left, and caches its answer.
    let replay = Answer::of(app.post_charge(Some("short"), &visa(2000)).await).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    // What the database holds changes; an answer served from memory does not.
    sqlx::query("UPDATE idempotency_keys SET response_body = convert_to('{}', 'UTF8')")
        .execute(&app.pool)
        .await
        .unwrap();
    let cached = Answer::of(app.post_charge(Some("short"), &visa(2000)).await).await;
    assert!(cached.replayed());
    assert_eq!(cached.body, first.body, "served from the cache");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "too slow to tell"
    );

    // Past the database's deadline the cache does not answer: the key has
    // expired, so the request runs anew.
    tokio::time::sleep_until((started + Duration::from_millis(2100)).into()).await;
    let after = Answer::of(app.post_charge(Some("short"), &visa(2000)).await).await;
    assert_eq!(after.status, 201);
    assert!(!after.replayed(), "not replayed after the key expired");
    assert_ne!(after.json()["id"], first.json()["id"]);
    assert_eq!(app.charges().await, 2);
}

#[tokio::test]
async fn with_the_replay_cache_off_every_replay_reads_the_database() {
    let app = spawn_app_with(Settings::new().set("REPLAY_CACHE_BYTES", 0)).await;
    let first = Answer::of(app.post_charge(Some("k"), &visa(2000)).await).await;
    let replay = Answer::of(app.post_charge(Some("k"), &visa(2000)).await).await;
    assert_eq!(replay.body, first.body);
    sqlx::query("UPDATE idempotency_keys SET response_body = convert_to('{}', 'UTF8')")
        .execute(&app.pool)
        .await
        .unwrap();
    let again = Answer::of(app.post_charge(Some("k"), &visa(2000)).await).await;
    assert!(again.replayed());
    assert_eq!(&again.body[..], b"{}", "read from the database");
}

#[tokio::test]
async fn the_quoted_form_of_a_key_names_the_same_key() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("order-7"), &visa(2000)).await).await;
    let quoted = Answer::of(app.post_charge(Some("\"order-7\""), &visa(2000)).await).await;
    assert!(quoted.replayed());
    assert_eq!(quoted.body, first.body);
    assert_eq!(app.charges().await, 1);
}

#[tokio::test]
async fn a_missing_key_is_refused_when_keys_are_required() {
    let app = spawn_app_with(Settings::new().set("IDEMPOTENCY_KEY_REQUIRED", "true")).await;
    Answer::of(app.post_charge(None, &visa(2000)).await)
        .await
        .assert_problem(400, "idempotency_key_missing");
    assert_eq!(app.charges().await, 0);
    assert_eq!(app.post_charge(Some("k"), &visa(2000)).await.status(), 201);
}

#[tokio::test]
async fn the_key_endpoint_shows_the_state_of_a_key() {
    let app = spawn_app().await;
    let created = Answer::of(app.post_charge(Some("watch/me"), &visa(2000)).await).await;
    let key = Answer::of(app.get("/v1/idempotency_keys/watch%2Fme").await).await;
    assert_eq!(key.status, 200);
    let key = key.json();
    assert_eq!(key["key"], "watch/me");
    assert_eq!(key["status"], "completed");
    assert_eq!(
        key["request"],
        json!({"method": "POST", "path": "/v1/charges"})
    );
    assert_eq!(key["response"]["status_code"], 201);
    assert_eq!(key["charge"], created.json()["id"]);
    // The answer is kept a full TTL from when it was saved, a moment after
    // the claim (so the seconds between claim and expiry may be 86 401).
    let (created_at, completed_at): (i64, i64) = sqlx::query_as(
        "SELECT floor(extract(epoch FROM created_at))::bigint,
                floor(extract(epoch FROM completed_at))::bigint
           FROM idempotency_keys WHERE key = 'watch/me'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(key["created_at"], created_at);
    assert_eq!(key["expires_at"], completed_at + 86_400);

    Answer::of(app.get("/v1/idempotency_keys/unknown").await)
        .await
        .assert_problem(404, "resource_missing");
    let other = app.other_merchant().await;
    let theirs = app
        .client
        .get(app.url("/v1/idempotency_keys/watch%2Fme"))
        .bearer_auth(other)
        .send()
        .await
        .unwrap();
    Answer::of(theirs)
        .await
        .assert_problem(404, "resource_missing");
    sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    Answer::of(app.get("/v1/idempotency_keys/watch%2Fme").await)
        .await
        .assert_problem(404, "resource_missing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_still_in_flight_is_never_taken_over_even_past_its_expiry() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 1500)).await;
    let body = visa(2000);
    let first = app.post_charge(Some("slow"), &body);
    let second = async {
        // The key expires while its first request is still at the processor.
        app.until_in_flight("slow").await;
        let backdated = sqlx::query(
            "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'
              WHERE key = 'slow' AND status = 'processing'",
        )
        .execute(&app.pool)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(backdated, 1, "the key was in flight when it expired");
        Answer::of(app.post_charge(Some("slow"), &body).await).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status(), 201);
    second.assert_problem(409, "idempotency_key_in_use");
    assert_eq!(second.header("retry-after"), Some("1"));
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
}

#[tokio::test]
async fn a_processing_key_past_its_original_expiry_is_reported_and_its_answer_kept_a_full_ttl() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 1500)).await;
    let body = visa(2000);
    let first = app.post_charge(Some("slow"), &body);
    let watch = async {
        // Wait until the claim is committed, then let its expiry pass.
        app.until_in_flight("slow").await;
        let backdated = sqlx::query(
            "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'
              WHERE key = 'slow' AND status = 'processing'",
        )
        .execute(&app.pool)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(backdated, 1, "the key was still in flight");
        Answer::of(app.get("/v1/idempotency_keys/slow").await).await
    };
    let (first, state) = tokio::join!(first, watch);
    assert_eq!(first.status(), 201);
    assert_eq!(state.status, 200, "{}", state.json());
    assert_eq!(state.json()["status"], "processing");

    // Completed past its original expiry, the key keeps its answer for a
    // full TTL from the moment the answer exists.
    let kept_for: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - completed_at)::float8
           FROM idempotency_keys WHERE key = 'slow' AND status = 'completed'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(
        kept_for >= app.config.keys.ttl.as_secs_f64() - 1.0,
        "kept {kept_for} s after completion"
    );
    let retry = Answer::of(app.post_charge(Some("slow"), &body).await).await;
    assert_eq!(retry.status, 201);
    assert!(
        retry.replayed(),
        "the retry replays instead of charging again"
    );
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
}

#[tokio::test]
async fn a_key_reused_on_another_endpoint_says_so_and_with_other_parameters_says_that() {
    let app = spawn_app().await;
    let charge = Answer::of(app.post_charge(Some("k-1"), &visa(2000)).await).await;
    let charge_id = charge.json()["id"].as_str().unwrap().to_owned();

    let refund = Answer::of(
        app.post_refund(Some("k-1"), &json!({"charge": charge_id}))
            .await,
    )
    .await;
    refund.assert_problem(422, "idempotency_key_reused");
    assert_eq!(
        refund.json()["detail"],
        "Keys for idempotent requests can only be used for the same endpoint they were first \
         used for ('POST /v1/charges' vs 'POST /v1/refunds'). Try using a key other than 'k-1' \
         if you meant to execute a different request."
    );
    assert_eq!(refund.json()["error"]["type"], "idempotency_error");
    assert_eq!(app.refunds().await, 0);

    let other = Answer::of(app.post_charge(Some("k-1"), &visa(3000)).await).await;
    other.assert_problem(422, "idempotency_key_reused");
    assert_eq!(
        other.json()["detail"],
        "Keys for idempotent requests can only be used with the same parameters they were first \
         used with. Try using a key other than 'k-1' if you meant to execute a different request."
    );
}

#[tokio::test]
async fn a_key_held_in_flight_and_reused_on_another_endpoint_says_so() {
    let app = spawn_app().await;
    let charge_id = app.paid_charge(2000).await;
    // A charge's key still `processing`, as a request at work leaves it.
    sqlx::query(
        "INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path,
                                       fingerprint, locked_at, expires_at)
         VALUES ($1, 'busy', 'processing', 'POST', '/v1/charges', $2, now(),
                 now() + interval '1 hour')",
    )
    .bind(app.merchant_id)
    .bind(vec![7u8; 32])
    .execute(&app.pool)
    .await
    .unwrap();
    let refund = Answer::of(
        app.post_refund(Some("busy"), &json!({"charge": charge_id}))
            .await,
    )
    .await;
    refund.assert_problem(422, "idempotency_key_reused");
    let detail = refund.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("('POST /v1/charges' vs 'POST /v1/refunds')"),
        "{detail}"
    );
}

#[tokio::test]
async fn a_replay_names_its_original_request_and_every_answer_echoes_the_key() {
    let app = spawn_app().await;
    let first = Answer::of(app.post_charge(Some("orig-1"), &visa(2000)).await).await;
    assert_eq!(first.header("idempotency-key"), Some("orig-1"));
    assert_eq!(first.header("original-request"), None, "not a replay");
    let original = first.header("request-id").unwrap().to_owned();

    let replay = Answer::of(app.post_charge(Some("orig-1"), &visa(2000)).await).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("original-request"), Some(original.as_str()));
    assert_ne!(replay.header("request-id"), Some(original.as_str()));
    assert_eq!(replay.header("idempotency-key"), Some("orig-1"));
    assert_eq!(replay.body, first.body);

    // A decline's replay too, and an error's answer echoes the key as well.
    let declined = json!({"amount": 500, "currency": "usd", "source": "tok_chargeDeclined"});
    let decline = Answer::of(app.post_charge(Some("orig-2"), &declined).await).await;
    let again = Answer::of(app.post_charge(Some("orig-2"), &declined).await).await;
    assert_eq!(
        again.header("original-request"),
        decline.header("request-id")
    );
    let reused = Answer::of(app.post_charge(Some("orig-2"), &visa(2000)).await).await;
    assert_eq!(reused.header("idempotency-key"), Some("orig-2"));
    assert_eq!(reused.header("original-request"), None);

    // No key, no echo.
    let keyless = Answer::of(app.post_charge(None, &visa(2000)).await).await;
    assert_eq!(keyless.header("idempotency-key"), None);
}

#[tokio::test]
async fn a_key_saved_before_original_requests_were_recorded_replays_without_one() {
    let app = spawn_app_with(Settings::new().set("REPLAY_CACHE_BYTES", 0)).await;
    let first = Answer::of(app.post_charge(Some("old"), &visa(2000)).await).await;
    sqlx::query("UPDATE idempotency_keys SET request_id = NULL WHERE key = 'old'")
        .execute(&app.pool)
        .await
        .unwrap();
    let replay = Answer::of(app.post_charge(Some("old"), &visa(2000)).await).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("original-request"), None);
    assert_eq!(replay.header("idempotency-key"), Some("old"));
}
