//! Rolling a merchant's key: the old key works beside the new one until it
//! expires, then gets `401`; both keys are one merchant, down to its
//! idempotency keys.

use std::time::Duration;

use oncepay::cache::MERCHANT_TTL;
use oncepay::merchants::{self, ApiKey};

use crate::helpers::{Answer, TestApp, spawn_app, until, visa};

async fn roll(app: &TestApp, expire_old_in: Duration) -> String {
    let rolled = merchants::roll_key(&app.pool, app.merchant_id, expire_old_in)
        .await
        .unwrap()
        .expect("the merchant exists");
    rolled.key.expose().to_owned()
}

async fn charge_as(app: &TestApp, api_key: &str, key: &str) -> Answer {
    Answer::of(app.post_charge_as(api_key, Some(key), &visa(2000)).await).await
}

#[tokio::test]
async fn both_keys_work_for_the_same_merchant_until_the_old_one_expires_then_it_is_401() {
    let app = spawn_app().await;
    let old = app.api_key.clone();
    let new = roll(&app, Duration::from_secs(2)).await;
    assert_ne!(new, old);
    // The old key is in the server's merchant cache from here on, with the
    // two seconds it has left.
    assert_eq!(charge_as(&app, &old, "old").await.status, 201);
    assert_eq!(charge_as(&app, &old, "old-again").await.status, 201);
    assert_eq!(charge_as(&app, &new, "new").await.status, 201);
    let owners = app
        .count(&format!(
            "SELECT count(DISTINCT merchant_id) FROM charges WHERE merchant_id = '{}'",
            app.merchant_id
        ))
        .await;
    assert_eq!((app.charges().await, owners), (3, 1));

    tokio::time::sleep(Duration::from_millis(2100)).await;
    let refused = charge_as(&app, &old, "after").await;
    refused.assert_problem(401, "invalid_api_key");
    assert_eq!(charge_as(&app, &new, "after").await.status, 201);
    assert_eq!(app.charges().await, 4);
    let listed = app
        .client
        .get(app.url("/v1/charges"))
        .bearer_auth(&new)
        .send()
        .await
        .unwrap();
    assert_eq!(
        Answer::of(listed).await.json()["data"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
}

#[tokio::test]
async fn a_retry_with_the_new_key_replays_the_answer_made_with_the_old_one() {
    let app = spawn_app().await;
    let first = charge_as(&app, &app.api_key, "order-1").await;
    assert_eq!(first.status, 201);
    let new = roll(&app, Duration::from_secs(3600)).await;
    let retried = charge_as(&app, &new, "order-1").await;
    assert_eq!(retried.status, 201);
    assert!(retried.replayed());
    assert_eq!(retried.body, first.body);
    // And the other way round: a key first used with the new API key.
    let second = charge_as(&app, &new, "order-2").await;
    let back = charge_as(&app, &app.api_key, "order-2").await;
    assert!(back.replayed());
    assert_eq!(back.body, second.body);
    assert_eq!((app.charges().await, app.payments().await), (2, 2));
    assert_eq!(app.keys().await, 2);
}

#[tokio::test]
async fn a_key_rolled_at_once_is_refused_within_the_merchant_cache_lifetime() {
    let app = spawn_app().await;
    let old = app.api_key.clone();
    assert_eq!(charge_as(&app, &old, "cached").await.status, 201);
    let new = roll(&app, Duration::ZERO).await;
    // Never cached: refused at once.
    let other = app.other_merchant().await;
    let other_id = merchants::find_by_key(&app.pool, &ApiKey::parse(&other).unwrap())
        .await
        .unwrap()
        .unwrap()
        .id;
    merchants::roll_key(&app.pool, other_id, Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    charge_as(&app, &other, "other")
        .await
        .assert_problem(401, "invalid_api_key");
    // Cached before the roll: refused once its entry ends.
    until(
        MERCHANT_TTL + Duration::from_secs(2),
        "the old key refused",
        || async { charge_as(&app, &old, "later").await.status == 401 },
    )
    .await;
    assert_eq!(charge_as(&app, &new, "new").await.status, 201);
}

#[tokio::test]
async fn a_third_roll_while_two_keys_are_live_stops_the_oldest_at_once() {
    let app = spawn_app().await;
    let first = ApiKey::parse(&app.api_key).unwrap();
    let hour = Duration::from_secs(3600);
    let second = merchants::roll_key(&app.pool, app.merchant_id, hour)
        .await
        .unwrap()
        .unwrap();
    assert!(!second.expired_older);
    let third = merchants::roll_key(&app.pool, app.merchant_id, hour)
        .await
        .unwrap()
        .unwrap();
    assert!(third.expired_older, "two keys were live");
    let found = |key: ApiKey| {
        let pool = app.pool.clone();
        async move { merchants::authenticate(&pool, &key).await.unwrap() }
    };
    assert!(found(first).await.is_none(), "the oldest stopped at once");
    let previous = found(second.key.clone())
        .await
        .expect("the previous key lives");
    assert_eq!(previous.merchant.id, app.merchant_id);
    let left = previous.expires_in.expect("a previous key expires");
    assert!(
        left > hour - Duration::from_secs(60) && left <= hour,
        "{left:?}"
    );
    let current = found(third.key.clone()).await.expect("the key in use");
    assert_eq!(
        (current.merchant.id, current.expires_in),
        (app.merchant_id, None)
    );
    let hashes = app
        .count(&format!(
            "SELECT count(*) FROM merchants WHERE id = '{}' AND previous_key_hash IS NOT NULL",
            app.merchant_id
        ))
        .await;
    assert_eq!(hashes, 1, "one previous key, stored as its hash");
}

#[tokio::test]
async fn rolling_the_key_of_no_merchant_finds_nothing() {
    let app = spawn_app().await;
    let rolled = merchants::roll_key(&app.pool, uuid::Uuid::now_v7(), Duration::ZERO)
        .await
        .unwrap();
    assert!(rolled.is_none());
}
