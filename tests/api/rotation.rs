//! Rolling a merchant's key: the old key works beside the new one until it
//! expires, then gets `401`; both keys are one merchant, down to its
//! idempotency keys.

use std::time::Duration;

use futures::future::join_all;
use oncepay::merchants::{self, ApiKey};
use oncepay::speed::cache::MERCHANT_TTL;
use oncepay::startup::Application;

use crate::helpers::{Answer, TestApp, migrated_before, spawn_app, until, visa};

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

/// A second instance of the service on the test app's database and
/// gateway, started as a fleet's instance starts: with `DEMO_API_KEY` set.
struct Instance {
    address: String,
    shutdown: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<()>,
}

/// An instance built and through its start (migrations, the demo
/// merchant), not yet serving; with a pool of its own, which it closes as
/// it stops.
async fn prepared(app: &TestApp, demo_api_key: &str) -> Application {
    let mut config = app.config.clone();
    config.workshop.demo_api_key = Some(demo_api_key.to_owned());
    config.database.max_connections = 4;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(config.database.max_connections)
        .connect(&config.database_url)
        .await
        .expect("connect the instance");
    let built = Application::build(config, pool)
        .await
        .expect("build the instance");
    built.prepare_database().await.expect("the instance starts");
    built
}

impl Instance {
    async fn start(app: &TestApp, demo_api_key: &str) -> Instance {
        let built = prepared(app, demo_api_key).await;
        let address = format!("http://127.0.0.1:{}", built.port());
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            built
                .run_until_stopped(async {
                    let _ = stopped.await;
                })
                .await
                .expect("the instance runs");
        });
        Instance {
            address,
            shutdown,
            server,
        }
    }

    async fn charge_as(&self, app: &TestApp, api_key: &str, key: &str) -> Answer {
        let sent = app
            .client
            .post(format!("{}/v1/charges", self.address))
            .bearer_auth(api_key)
            .header("Idempotency-Key", key)
            .json(&visa(2000))
            .send()
            .await
            .unwrap();
        Answer::of(sent).await
    }

    async fn stop(self) {
        let _ = self.shutdown.send(());
        self.server.await.unwrap();
    }
}

#[tokio::test]
async fn a_start_with_a_demo_key_rolled_an_hour_ago_makes_no_second_merchant_and_the_retry_replays()
{
    let app = spawn_app().await;
    let old = app.api_key.clone();
    let first = charge_as(&app, &old, "order-1").await;
    assert_eq!(first.status, 201);
    roll(&app, Duration::from_secs(3600)).await;
    assert!(charge_as(&app, &old, "order-1").await.replayed());

    let restarted = Instance::start(&app, &old).await;
    let retried = restarted.charge_as(&app, &old, "order-1").await;
    assert_eq!(retried.status, 201);
    assert!(retried.replayed(), "the retry after the restart replays");
    assert_eq!(retried.body, first.body);
    let owner = merchants::find_by_key(&app.pool, &ApiKey::parse(&old).unwrap())
        .await
        .unwrap()
        .expect("the old key lives out its hour");
    assert_eq!(owner.id, app.merchant_id, "the old key names its merchant");
    assert_eq!(app.count("SELECT count(*) FROM merchants").await, 1);
    assert_eq!((app.charges().await, app.keys().await), (1, 1));
    assert_eq!(app.payments().await, 1);
    restarted.stop().await;
}

#[tokio::test]
async fn a_start_with_a_demo_key_revoked_at_once_neither_creates_a_merchant_nor_revives_the_key() {
    let app = spawn_app().await;
    let old = app.api_key.clone();
    roll(&app, Duration::ZERO).await;
    charge_as(&app, &old, "revoked")
        .await
        .assert_problem(401, "invalid_api_key");

    // Once as the previous key, expired; once more rolled on, held by no
    // column of the merchant any more.
    for _ in 0..2 {
        let restarted = Instance::start(&app, &old).await;
        restarted
            .charge_as(&app, &old, "revoked")
            .await
            .assert_problem(401, "invalid_api_key");
        assert_eq!(app.count("SELECT count(*) FROM merchants").await, 1);
        restarted.stop().await;
        roll(&app, Duration::ZERO).await;
    }
    assert_eq!((app.charges().await, app.keys().await), (0, 0));
}

#[tokio::test]
async fn one_key_hash_can_never_name_two_merchants_in_use_previous_or_retired() {
    let app = spawn_app().await;
    let old = ApiKey::parse(&app.api_key).unwrap();
    let current = ApiKey::parse(&roll(&app, Duration::from_secs(3600)).await).unwrap();
    let other = ApiKey::parse(&app.other_merchant().await).unwrap();
    let other_id = merchants::find_by_key(&app.pool, &other)
        .await
        .unwrap()
        .unwrap()
        .id;
    // The code names the constraint that refuses: the one hash's one
    // owner (23505), or a previous key the merchant never held (23503).
    let refused = |sql: &'static str, hash: Vec<u8>, code: &'static str| {
        let pool = app.pool.clone();
        async move {
            let err = sqlx::query(sql)
                .bind(hash)
                .bind(other_id)
                .execute(&pool)
                .await
                .expect_err(sql);
            let db = err.as_database_error().expect("a database error");
            assert_eq!(db.code().as_deref(), Some(code), "{sql}: {db}");
        }
    };
    // A previous key, live: neither a new merchant's key nor another's.
    refused(
        "INSERT INTO merchants (id, name, api_key_hash) VALUES (gen_random_uuid(), 'demo', $1)
         RETURNING $2::uuid",
        old.hash(),
        "23505",
    )
    .await;
    refused(
        "UPDATE merchants SET api_key_hash = $1 WHERE id = $2",
        old.hash(),
        "23505",
    )
    .await;
    // Another merchant's key in use, as a previous key.
    refused(
        "UPDATE merchants SET previous_key_hash = $1,
                previous_key_expires_at = now() + interval '1 hour'
          WHERE id = $2",
        current.hash(),
        "23503",
    )
    .await;
    // Rolled twice more, the old key is in no column; still it is refused.
    roll(&app, Duration::ZERO).await;
    roll(&app, Duration::ZERO).await;
    refused(
        "INSERT INTO merchants (id, name, api_key_hash) VALUES (gen_random_uuid(), 'demo', $1)
         RETURNING $2::uuid",
        old.hash(),
        "23505",
    )
    .await;
    assert_eq!(app.count("SELECT count(*) FROM merchants").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_instances_starting_at_once_with_a_rolled_demo_key_make_no_merchant() {
    let app = spawn_app().await;
    let old = app.api_key.clone();
    roll(&app, Duration::from_secs(3600)).await;
    let instances = join_all((0..6).map(|_| Instance::start(&app, &old))).await;
    assert_eq!(app.count("SELECT count(*) FROM merchants").await, 1);
    for instance in instances {
        let answer = instance.charge_as(&app, &old, "order-1").await;
        assert_eq!(answer.status, 201);
        instance.stop().await;
    }
    assert_eq!((app.charges().await, app.payments().await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_while_the_demo_key_is_rolled_never_make_a_second_merchant() {
    let app = spawn_app().await;
    let mut key = app.api_key.clone();
    for _ in 0..5 {
        let starts = join_all((0..4).map(|_| prepared(&app, &key)));
        let (rolled, _) = tokio::join!(roll(&app, Duration::from_secs(3600)), starts);
        key = rolled;
        assert_eq!(app.count("SELECT count(*) FROM merchants").await, 1);
    }
}

#[tokio::test]
async fn migrating_ends_a_previous_key_that_a_second_merchant_holds_in_use_and_keeps_every_request_as_it_was()
 {
    // The schema before `merchant_keys`, from the migrations before it.
    let (_db, pool) = migrated_before("20261210000700").await;

    // What a start with a rolled key did then: a second merchant `demo`
    // holding, in use, the key the first still holds as its previous one.
    let (rolled, old) = merchants::create(&pool, "demo").await.unwrap();
    let new = merchants::roll_key(&pool, rolled.id, Duration::from_secs(3600))
        .await
        .unwrap()
        .unwrap()
        .key;
    let second: uuid::Uuid = sqlx::query_scalar(
        "INSERT INTO merchants (id, name, api_key_hash) VALUES (gen_random_uuid(), 'demo', $1)
         RETURNING id",
    )
    .bind(old.hash())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_ne!(second, rolled.id);
    let owner = |key: ApiKey| {
        let pool = pool.clone();
        async move {
            merchants::authenticate(&pool, &key)
                .await
                .unwrap()
                .map(|found| found.merchant.id)
        }
    };
    let was = (owner(old.clone()).await, owner(new.clone()).await);
    assert_eq!(was, (Some(second), Some(rolled.id)));

    oncepay::db::migrate(&pool).await.unwrap();
    assert_eq!((owner(old.clone()).await, owner(new).await), was);
    let previous: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT previous_key_hash FROM merchants WHERE id = $1")
            .bind(rolled.id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(previous, None, "the previous key that was another's ended");
    let held: Vec<(Vec<u8>, uuid::Uuid)> =
        sqlx::query_as("SELECT hash, merchant_id FROM merchant_keys WHERE hash = $1")
            .bind(old.hash())
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(held, vec![(old.hash(), second)]);
    pool.close().await;
}
