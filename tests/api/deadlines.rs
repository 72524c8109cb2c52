//! A claim takes effect only if its statement reaches Postgres before its
//! request's deadline, by the database's clock: however long the statement
//! was held on the wire, a late one claims nothing, neither a new key nor
//! an expired answer. The statements are driven directly here; the process
//! test `late_claims` holds a real server's traffic in a proxy.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oncepay_core::charges::{Charge, NewCharge};
use oncepay_core::idempotency::{Fingerprint, IdempotencyKey, Resource};
use oncepay_core::operation::claim::{self, Found};
use oncepay_core::operation::engine::{Engine, METHOD, Request};
use oncepay_core::operation::timing::Untimed;
use oncepay_core::settings::Timeouts;
use oncepay_core::speed::Plain;

use crate::helpers::{TestApp, spawn_app};

/// An engine on the app's database, with keys that live a minute.
fn engine(app: &TestApp) -> Engine {
    Engine {
        pool: app.pool.clone(),
        processor: app.processor.clone(),
        timeouts: Timeouts {
            key_ttl: Duration::from_secs(60),
            processing: Duration::from_secs(30),
            request: Duration::from_secs(1),
            sweep_interval: Duration::from_secs(5),
        },
        tasks: Default::default(),
        admission: Arc::new(Plain),
        waits: Arc::new(Plain),
    }
}

/// A request for a charge under `key`, whose deadline is `deadline`.
fn request(app: &TestApp, key: &IdempotencyKey, deadline: Instant) -> Request {
    let route = "/v1/charges";
    Request {
        route,
        merchant_id: app.merchant_id,
        request_id: None,
        key: Some(key.clone()),
        fingerprint: Fingerprint::of(METHOD, route, b"amount=100"),
        wait: Duration::ZERO,
        fault: None,
        arrived: deadline - Duration::from_secs(1),
        deadline,
        client_gone: Default::default(),
        has_written: Default::default(),
        clock: Arc::new(Untimed),
    }
}

/// A deadline that passed a second ago.
fn passed() -> Instant {
    Instant::now() - Duration::from_secs(1)
}

/// Stores `key` as a completed answer that expired a minute ago.
async fn expired_answer(app: &TestApp, key: &str) {
    sqlx::query(
        "INSERT INTO idempotency_keys
             (merchant_id, key, status, request_method, request_path, fingerprint,
              response_status, response_content_type, response_body,
              created_at, locked_at, completed_at, expires_at)
         VALUES ($1, $2, 'completed', 'POST', '/v1/charges', $3, 201,
                 'application/json', '{}', now() - interval '2 hours',
                 now() - interval '2 hours', now() - interval '2 hours',
                 now() - interval '1 minute')",
    )
    .bind(app.merchant_id)
    .bind(key)
    .bind(&[0u8; 32][..])
    .execute(&app.pool)
    .await
    .unwrap();
}

async fn key_rows(app: &TestApp, key: &str) -> Vec<(String, Option<String>)> {
    sqlx::query_as("SELECT status, charge_id FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

async fn charges(app: &TestApp, id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges WHERE id = $1")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// A pending charge `id` of 100 USD.
fn pending(app: &TestApp, id: &str) -> Charge {
    let params = oncepay_core::params::Params::from_json(
        br#"{"amount": 100, "currency": "usd", "source": "tok_visa"}"#,
    )
    .unwrap();
    let charge: NewCharge = oncepay::http::input::FromParams::from_params(params).unwrap();
    charge.pending(id.to_owned(), app.merchant_id)
}

#[tokio::test]
async fn a_claim_that_reaches_postgres_after_its_deadline_claims_no_new_key() {
    let app = spawn_app().await;
    let key = IdempotencyKey::parse(b"late-new").unwrap();
    let resource = Resource::Charge("ch_late_new".into());
    let mut tx = app.pool.begin().await.unwrap();
    let outcome = claim::claim(
        &mut tx,
        &engine(&app),
        &request(&app, &key, passed()),
        Some(&resource),
        None,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(outcome, Found::TooLate), "{outcome:?}");
    assert_eq!(key_rows(&app, "late-new").await, [], "no key written");
}

#[tokio::test]
async fn a_claim_that_reaches_postgres_after_its_deadline_never_takes_over_an_expired_answer() {
    let app = spawn_app().await;
    expired_answer(&app, "late-expired").await;
    let key = IdempotencyKey::parse(b"late-expired").unwrap();
    let resource = Resource::Charge("ch_late_expired".into());
    let mut tx = app.pool.begin().await.unwrap();
    let outcome = claim::claim(
        &mut tx,
        &engine(&app),
        &request(&app, &key, passed()),
        Some(&resource),
        None,
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(outcome, Found::TooLate), "{outcome:?}");
    assert_eq!(
        key_rows(&app, "late-expired").await,
        [("completed".to_owned(), None)],
        "the expired answer is left as it was"
    );

    // In time, the same statement takes it over: the refusal above was
    // the deadline's. (Rolled back: the charge it guards is not written.)
    let mut tx = app.pool.begin().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let outcome = claim::claim(
        &mut tx,
        &engine(&app),
        &request(&app, &key, deadline),
        Some(&resource),
        None,
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert!(
        matches!(outcome, Found::Won { took_over: true }),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_charge_claimed_with_its_record_after_its_deadline_writes_neither_key_nor_charge() {
    let app = spawn_app().await;
    let key = IdempotencyKey::parse(b"late-one-statement").unwrap();
    let resource = Resource::Charge("ch_late_one".into());
    let first = claim::claim(
        &mut app.pool.acquire().await.unwrap(),
        &engine(&app),
        &request(&app, &key, passed()),
        Some(&resource),
        Some(&mut pending(&app, "ch_late_one")),
    )
    .await
    .unwrap();
    assert!(matches!(first, Found::TooLate), "{first:?}");
    assert_eq!(key_rows(&app, "late-one-statement").await, []);
    assert_eq!(charges(&app, "ch_late_one").await, 0, "no charge written");
}

#[tokio::test]
async fn a_charge_claimed_with_its_record_after_its_deadline_never_takes_over_an_expired_answer() {
    let app = spawn_app().await;
    expired_answer(&app, "late-one-expired").await;
    let key = IdempotencyKey::parse(b"late-one-expired").unwrap();
    let resource = Resource::Charge("ch_late_one_expired".into());
    let first = claim::claim(
        &mut app.pool.acquire().await.unwrap(),
        &engine(&app),
        &request(&app, &key, passed()),
        Some(&resource),
        Some(&mut pending(&app, "ch_late_one_expired")),
    )
    .await
    .unwrap();
    assert!(matches!(first, Found::TooLate), "{first:?}");
    assert_eq!(
        key_rows(&app, "late-one-expired").await,
        [("completed".to_owned(), None)]
    );
    assert_eq!(charges(&app, "ch_late_one_expired").await, 0);

    let deadline = Instant::now() + Duration::from_secs(5);
    let first = claim::claim(
        &mut app.pool.acquire().await.unwrap(),
        &engine(&app),
        &request(&app, &key, deadline),
        Some(&resource),
        Some(&mut pending(&app, "ch_late_one_expired")),
    )
    .await
    .unwrap();
    assert!(
        matches!(first, Found::Won { took_over: true }),
        "in time, the same statement takes it over: {first:?}"
    );
    assert_eq!(charges(&app, "ch_late_one_expired").await, 1);
}
