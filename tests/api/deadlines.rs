//! A claim takes effect only if its statement reaches Postgres before its
//! request's deadline, by the database's clock: however long the statement
//! was held on the wire, a late one claims nothing, neither a new key nor
//! an expired answer. The statements are driven directly here; the process
//! test `late_claims` holds a real server's traffic in a proxy.

use std::time::{Duration, Instant};

use oncepay::idempotency::store::{self as keys, PendingCharge};
use oncepay::idempotency::{Claim, ClaimOutcome, Fingerprint, IdempotencyKey, Resource};

use crate::helpers::{TestApp, spawn_app};

/// A claim of `key` for `resource`, by a request whose deadline is
/// `deadline`.
fn claim<'a>(
    app: &TestApp,
    key: &'a IdempotencyKey,
    resource: &'a Resource,
    deadline: Instant,
) -> Claim<'a> {
    Claim {
        merchant_id: app.merchant_id,
        key,
        method: "POST",
        path: "/v1/charges",
        fingerprint: Fingerprint::of("POST", "/v1/charges", b"amount=100"),
        request_id: None,
        resource: Some(resource),
        ttl: Duration::from_secs(60),
        arrived: deadline - Duration::from_secs(1),
        deadline,
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

fn pending<'a>(id: &'a str) -> PendingCharge<'a> {
    PendingCharge {
        capture_later: false,
        id,
        amount: 100,
        currency: "usd",
        source: "tok_visa",
        description: None,
        metadata: "{}",
        details: None,
    }
}

#[tokio::test]
async fn a_claim_that_reaches_postgres_after_its_deadline_claims_no_new_key() {
    let app = spawn_app().await;
    let key = IdempotencyKey::parse(b"late-new").unwrap();
    let resource = Resource::Charge("ch_late_new".into());
    let mut tx = app.pool.begin().await.unwrap();
    let outcome = keys::claim(&mut tx, claim(&app, &key, &resource, passed()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(outcome, ClaimOutcome::TooLate), "{outcome:?}");
    assert_eq!(key_rows(&app, "late-new").await, [], "no key written");
}

#[tokio::test]
async fn a_claim_that_reaches_postgres_after_its_deadline_never_takes_over_an_expired_answer() {
    let app = spawn_app().await;
    expired_answer(&app, "late-expired").await;
    let key = IdempotencyKey::parse(b"late-expired").unwrap();
    let resource = Resource::Charge("ch_late_expired".into());
    let mut tx = app.pool.begin().await.unwrap();
    let outcome = keys::claim(&mut tx, claim(&app, &key, &resource, passed()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(outcome, ClaimOutcome::TooLate), "{outcome:?}");
    assert_eq!(
        key_rows(&app, "late-expired").await,
        [("completed".to_owned(), None)],
        "the expired answer is left as it was"
    );

    // In time, the same statement takes it over: the refusal above was
    // the deadline's. (Rolled back: the charge it guards is not written.)
    let mut tx = app.pool.begin().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let outcome = keys::claim(&mut tx, claim(&app, &key, &resource, deadline))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(
        matches!(
            outcome,
            ClaimOutcome::Claimed {
                took_over: true,
                ..
            }
        ),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_charge_claimed_with_its_record_after_its_deadline_writes_neither_key_nor_charge() {
    let app = spawn_app().await;
    let key = IdempotencyKey::parse(b"late-one-statement").unwrap();
    let resource = Resource::Charge("ch_late_one".into());
    let first = keys::claim_with_charge(
        &app.pool,
        &claim(&app, &key, &resource, passed()),
        &pending("ch_late_one"),
    )
    .await
    .unwrap();
    assert!(matches!(first, ClaimOutcome::TooLate), "{first:?}");
    assert_eq!(key_rows(&app, "late-one-statement").await, []);
    assert_eq!(charges(&app, "ch_late_one").await, 0, "no charge written");
}

#[tokio::test]
async fn a_charge_claimed_with_its_record_after_its_deadline_never_takes_over_an_expired_answer() {
    let app = spawn_app().await;
    expired_answer(&app, "late-one-expired").await;
    let key = IdempotencyKey::parse(b"late-one-expired").unwrap();
    let resource = Resource::Charge("ch_late_one_expired".into());
    let first = keys::claim_with_charge(
        &app.pool,
        &claim(&app, &key, &resource, passed()),
        &pending("ch_late_one_expired"),
    )
    .await
    .unwrap();
    assert!(matches!(first, ClaimOutcome::TooLate), "{first:?}");
    assert_eq!(
        key_rows(&app, "late-one-expired").await,
        [("completed".to_owned(), None)]
    );
    assert_eq!(charges(&app, "ch_late_one_expired").await, 0);

    let deadline = Instant::now() + Duration::from_secs(5);
    let first = keys::claim_with_charge(
        &app.pool,
        &claim(&app, &key, &resource, deadline),
        &pending("ch_late_one_expired"),
    )
    .await
    .unwrap();
    assert!(
        matches!(
            first,
            ClaimOutcome::Claimed {
                took_over: true,
                ..
            }
        ),
        "in time, the same statement takes it over: {first:?}"
    );
    assert_eq!(charges(&app, "ch_late_one_expired").await, 1);
}
