//! More requests than the database pool serves: the excess is answered
//! `503 overloaded` once its bounded wait for a connection is spent, having
//! done nothing, and its retry with the same key charges exactly once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::Connection;

use crate::helpers::{Answer, Settings, spawn_app_with, until, visa};
use crate::sweeper::stale_claim;

/// Concurrent charges in the burst.
const BURST: usize = 250;
/// The wait in the queue while it keeps emptying (`DATABASE_QUEUE_TIMEOUT`).
const QUEUE_TIMEOUT: Duration = Duration::from_millis(200);
/// What a loaded machine may add to the wait before the answer is read.
const SLACK: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_what_the_pool_serves_are_shed_quickly_having_done_nothing_and_their_retries_charge_once()
 {
    let app = spawn_app_with(
        Settings::new()
            .set("DATABASE_MAX_CONNECTIONS", 2)
            .set("DATABASE_QUEUE_TIMEOUT", "200ms")
            .set("DATABASE_QUEUE_OVERLOAD_TIMEOUT", "5ms")
            .set("REQUEST_TIMEOUT", "10s")
            // The admitted charges are slow at the processor too.
            .set("PROCESSOR_LATENCY_MS", 100),
    )
    .await;
    // One charge first, and its replay: the merchant is cached
    // (authentication then needs no connection), and so is the answer.
    for _ in 0..2 {
        let warm = Answer::of(app.post_charge(Some("warm"), &visa(100)).await).await;
        assert_eq!(warm.status, 201, "{:?}", warm.body);
    }

    // Every claim blocks on a lock held outside the server's pool, so the
    // two connections stay busy with the first claims to get them, and
    // every other request queues for one: a database slower than the load.
    let mut lock = sqlx::PgConnection::connect(&app.config.database_url)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
    sqlx::query("LOCK TABLE idempotency_keys IN SHARE MODE")
        .execute(&mut lock)
        .await
        .unwrap();

    let answered = Arc::new(AtomicUsize::new(0));
    let mut burst = tokio::task::JoinSet::new();
    for i in 0..BURST {
        let (client, url, api_key) = (
            app.client.clone(),
            app.url("/v1/charges"),
            app.api_key.clone(),
        );
        let answered = answered.clone();
        burst.spawn(async move {
            let key = format!("burst-{i}");
            let sent = Instant::now();
            let response = client
                .post(url)
                .bearer_auth(api_key)
                .header("Idempotency-Key", &key)
                .json(&visa(2000))
                .send()
                .await
                .expect("an answer");
            let answer = Answer::of(response).await;
            answered.fetch_add(1, Ordering::SeqCst);
            (key, sent.elapsed(), answer)
        });
    }
    // Everyone but the two holding a connection is answered while the
    // lock is held; a replay from the cache needs no connection and is not
    // shed.
    until(
        QUEUE_TIMEOUT + SLACK * 5,
        "every request without a connection is answered",
        || async { answered.load(Ordering::SeqCst) >= BURST - 2 },
    )
    .await;
    let replay = Answer::of(app.post_charge(Some("warm"), &visa(100)).await).await;
    assert_eq!(replay.status, 201, "{:?}", replay.body);
    assert!(replay.replayed());
    // On the lock's own connection: the server's two are taken.
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&mut lock)
        .await
        .unwrap();
    assert_eq!(keys, 1, "nothing claimed while the lock is held");
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();

    let mut shed = Vec::new();
    let mut admitted = 0;
    while let Some(joined) = burst.join_next().await {
        let (key, took, answer) = joined.unwrap();
        if answer.status == 201 {
            admitted += 1;
            continue;
        }
        answer.assert_problem(503, "overloaded");
        assert_eq!(answer.header("retry-after"), Some("1"), "nothing was begun");
        assert_eq!(answer.header("stripe-should-retry"), Some("true"));
        assert!(
            took < QUEUE_TIMEOUT + SLACK,
            "shed after {took:?}: the bounded wait, not REQUEST_TIMEOUT"
        );
        shed.push(key);
    }
    assert!(
        admitted >= 1,
        "the requests holding a connection go through"
    );
    assert_eq!(admitted + shed.len(), BURST);
    assert!(shed.len() >= BURST - 2, "{} shed", shed.len());

    // Nothing of the shed requests is in the database: no key, no charge,
    // no payment at the processor.
    let shed_keys: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = ANY($1)")
            .bind(&shed)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(shed_keys, 0);
    assert_eq!(app.charges().await, 1 + admitted as i64);
    assert_eq!(app.payments().await, 1 + admitted as i64);

    // Each one's retry with the same key charges, once: ten clients at a
    // time, each retrying again if shed again, as a client honouring
    // `Retry-After` would (sooner here).
    let shed = Arc::new(std::sync::Mutex::new(shed));
    let mut retries = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let (client, url, api_key, shed) = (
            app.client.clone(),
            app.url("/v1/charges"),
            app.api_key.clone(),
            shed.clone(),
        );
        retries.spawn(async move {
            loop {
                let Some(key) = shed.lock().unwrap().pop() else {
                    return;
                };
                for attempt in 0.. {
                    let response = client
                        .post(&url)
                        .bearer_auth(&api_key)
                        .header("Idempotency-Key", &key)
                        .json(&visa(2000))
                        .send()
                        .await
                        .expect("an answer");
                    let retry = Answer::of(response).await;
                    if retry.status == 503 && attempt < 20 {
                        retry.assert_problem(503, "overloaded");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    assert_eq!(retry.status, 201, "{key}: {:?}", retry.body);
                    assert!(!retry.replayed(), "{key}: the first to do the work");
                    break;
                }
            }
        });
    }
    while let Some(joined) = retries.join_next().await {
        joined.unwrap();
    }
    assert_eq!(app.charges().await, 1 + BURST as i64);
    assert_eq!(app.payments().await, 1 + BURST as i64);
    assert_eq!(
        app.count("SELECT count(*) FROM idempotency_keys WHERE status = 'completed'")
            .await,
        1 + BURST as i64
    );
    assert_eq!(
        app.count("SELECT count(DISTINCT charge_id) FROM idempotency_keys")
            .await,
        1 + BURST as i64,
        "one charge per key"
    );
}

#[tokio::test]
async fn a_read_of_a_key_asked_of_a_full_queue_of_reads_is_shed_at_once() {
    use futures::FutureExt;
    use oncepay::speed::reads::{MOST_QUEUED, Reads};
    use oncepay_core::idempotency::IdempotencyKey;

    let db = crate::database::TestDb::create().await;
    // One connection, held here: the reads' first batch waits for it, and
    // every read asked meanwhile waits in the queue.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let held = pool.acquire().await.unwrap();
    let admission = Arc::new(oncepay::speed::admission::Admission::new(
        Duration::from_secs(3600),
        Duration::from_secs(3600),
    ));
    let reads = Reads::start(pool.clone(), admission, Duration::from_secs(30));
    let key = IdempotencyKey::parse(b"queued").unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let merchant = uuid::Uuid::new_v4();
    // Each read is asked (one poll), and left in the queue.
    let mut shed = Vec::new();
    for i in 0..MOST_QUEUED + 2 {
        if let Some(answer) = reads.find(merchant, &key, deadline).now_or_never() {
            assert!(answer.is_err(), "read {i} answered while its batch waits");
            shed.push(i);
        }
    }
    // The batch task may have taken the first read out of the queue.
    assert!(
        shed.first().is_some_and(|&i| i >= MOST_QUEUED) && shed.contains(&(MOST_QUEUED + 1)),
        "shed: {shed:?}"
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_settled_its_stale_key_is_never_shed_at_its_next_step_and_gets_the_settled_answer()
 {
    let queue_timeout = Duration::from_millis(300);
    let app = spawn_app_with(
        Settings::new()
            .set("DATABASE_MAX_CONNECTIONS", 2)
            .set("DATABASE_QUEUE_TIMEOUT", "300ms")
            .set("DATABASE_QUEUE_OVERLOAD_TIMEOUT", "300ms")
            .set("REQUEST_TIMEOUT", "20s")
            .set("PROCESSING_TIMEOUT", "30s"),
    )
    .await;
    // The merchant cached: authentication needs no connection.
    let warm = Answer::of(app.post_charge(Some("warm"), &visa(100)).await).await;
    assert_eq!(warm.status, 201, "{:?}", warm.body);
    let charge = "ch_shedafterrecovery000000001";
    stale_claim(&app, "crashed", charge, "1 minute").await;

    // The retry's settle of the stale charge waits on this row lock while
    // it holds one of the server's two connections; the test holds the
    // other.
    let mut lock = sqlx::PgConnection::connect(&app.config.database_url)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut lock).await.unwrap();
    sqlx::query("SELECT 1 FROM charges WHERE id = $1 FOR UPDATE")
        .bind(charge)
        .execute(&mut lock)
        .await
        .unwrap();
    let first = app.pool.acquire().await.unwrap();
    let retry = {
        let (client, url, api_key) = (
            app.client.clone(),
            app.url("/v1/charges"),
            app.api_key.clone(),
        );
        tokio::spawn(async move {
            let response = client
                .post(url)
                .bearer_auth(api_key)
                .header("Idempotency-Key", "crashed")
                .json(&visa(2000))
                .send()
                .await
                .expect("an answer");
            Answer::of(response).await
        })
    };
    let observer = sqlx::PgPool::connect(&app.config.database_url)
        .await
        .unwrap();
    until(
        SLACK * 5,
        "the retry's settle waits on the row lock",
        || {
            let observer = observer.clone();
            async move {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&observer)
                .await
                .unwrap();
                waiting == 1
            }
        },
    )
    .await;
    // Queued for the pool before the settle gives its connection back, so
    // it gets that one: the retry's next step then finds the pool full.
    let second = tokio::spawn({
        let pool = app.pool.clone();
        async move { pool.acquire().await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    let second = second.await.unwrap();
    let (status,): (String,) = sqlx::query_as("SELECT status::text FROM charges WHERE id = $1")
        .bind(charge)
        .fetch_one(&mut lock)
        .await
        .unwrap();
    assert_eq!(status, "failed", "the retry settled the stale charge");
    // Longer than any bound of the queue: a retry still in it would be shed.
    tokio::time::sleep(queue_timeout + SLACK).await;
    drop((first, second));

    let answer = retry.await.unwrap();
    answer.assert_problem(402, "processing_abandoned");
    assert_eq!(answer.json()["charge"], charge);
    assert_eq!(
        app.count(
            "SELECT count(*) FROM idempotency_keys WHERE key = 'crashed' AND status = 'completed'"
        )
        .await,
        1
    );
    assert_eq!(app.payments().await, 1, "the warm charge's only");
}
