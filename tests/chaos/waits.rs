//! `Prefer: wait` under load: many requests waiting on one key in flight
//! share one poll of the database, leave the pool to everyone else, and stop
//! waiting when their client hangs up.

use std::process::Command;
use std::time::{Duration, Instant};

use futures::future::join_all;

use crate::database::TestDb as Database;
use crate::harness::{
    Server, assert_events_paired, charge_body, client, eventually, metric, processor_pool, send,
};

/// The settings of both scenarios: a slow processor, well inside
/// `PROCESSING_TIMEOUT`, and the default pool.
const SLOW: [(&str, &str); 2] = [
    ("PROCESSING_TIMEOUT", "30s"),
    ("DATABASE_MAX_CONNECTIONS", "10"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_waiters_on_one_key_share_one_poll_and_leave_the_pool_to_others() {
    let db = Database::create_empty().await;
    let latency = Duration::from_secs(3);
    let mut settings = SLOW.to_vec();
    let latency_ms = latency.as_millis().to_string();
    settings.push(("PROCESSOR_LATENCY_MS", latency_ms.as_str()));
    let server = Server::start(&db.url, &settings).await;
    let url = server.url();
    let other = create_merchant(&db, "other");
    let http = client(Duration::from_secs(20));
    let pool = db.pool().await;

    let key = "one-key";
    let body = charge_body(key, 4200, "tok_visa");
    let polls_before = metric(&http, &url, "idempotency_wait_polls_total").await;
    let transactions_before = transactions(&pool, &db.name).await;
    let owner = tokio::spawn({
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move { send(&http, &url, key, &body, &[]).await }
    });
    in_flight(&pool, key, latency).await;
    let waiting = async {
        let started = Instant::now();
        let answers =
            join_all((0..200).map(|_| send(&http, &url, key, &body, &[("Prefer", "wait=10")])))
                .await;
        (answers, started.elapsed())
    };
    // Meanwhile another merchant charges as usual.
    let others = async {
        join_all((0..20).map(|i| {
            let op = format!("other-{i}");
            let (http, url, other) = (&http, &url, &other);
            async move {
                http.post(format!("{url}/v1/charges"))
                    .bearer_auth(other)
                    .header("Idempotency-Key", &op)
                    .json(&charge_body(&op, 100, "tok_visa"))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            }
        }))
        .await
    };
    let ((answers, waited), others) = tokio::join!(waiting, others);
    let owner = owner.await.unwrap();
    let polls = metric(&http, &url, "idempotency_wait_polls_total").await - polls_before;
    let transactions = transactions(&pool, &db.name).await - transactions_before;

    let (status, headers, first) = owner.unwrap();
    assert_eq!(status, 201, "{first}");
    assert_eq!(headers.get("idempotent-replayed"), None);
    for answer in &answers {
        let (status, headers, body) = answer.as_ref().unwrap();
        assert_eq!(*status, 201, "{body}");
        assert_eq!(body, &first, "the replay of the one charge");
        assert_eq!(
            headers.get("idempotent-replayed").map(String::as_str),
            Some("true")
        );
        assert_eq!(
            headers.get("preference-applied").map(String::as_str),
            Some("wait")
        );
    }
    assert!(
        others.iter().all(|s| matches!(s, Ok(201))),
        "the other merchant was served while 200 requests waited: {others:?}"
    );
    let count = |sql: &'static str| {
        let pool = &pool;
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .bind(key)
                .fetch_one(pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        count("SELECT count(*) FROM charges WHERE metadata->>'op' = $1").await,
        1
    );
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT 'auth:' || id FROM charges WHERE metadata->>'op' = $1")
            .bind(key)
            .fetch_all(&pool)
            .await
            .unwrap();
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM operations WHERE key = ANY($1)")
        .bind(&ids)
        .fetch_one(&processor_pool(&pool).await)
        .await
        .unwrap();
    assert_eq!(payments, 1);

    // One shared poll backs off to one read every 250 ms; a poll per waiter
    // would run at least 200 (one each), and about 200 times this in all.
    let intervals = waited.as_millis() as f64 / 250.0;
    let per_second = polls / waited.as_secs_f64();
    eprintln!(
        "200 waiters for {waited:?}: {polls} polls ({per_second:.1}/s, {:.1} per 250 ms); \
         {transactions} database transactions in all (with the 200 arrivals and the other \
         merchant's 20 charges)",
        polls / intervals
    );
    assert!(
        polls <= 2.0 * intervals + 10.0,
        "the waiters shared one poll: {polls} polls in {waited:?}"
    );
    assert_events_paired(&pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_client_hangs_up_stops_waiting() {
    let db = Database::create_empty().await;
    let latency = Duration::from_secs(6);
    let mut settings = SLOW.to_vec();
    let latency_ms = latency.as_millis().to_string();
    settings.push(("PROCESSOR_LATENCY_MS", latency_ms.as_str()));
    let server = Server::start(&db.url, &settings).await;
    let url = server.url();
    let pool = db.pool().await;
    let http = client(Duration::from_secs(20));
    let key = "hang-up";
    let body = charge_body(key, 4200, "tok_visa");

    let owner = tokio::spawn({
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        async move { send(&http, &url, key, &body, &[]).await }
    });
    in_flight(&pool, key, latency).await;
    // This client gives up after two seconds and closes its connection.
    let patience = Duration::from_secs(2);
    let impatient = client(patience);
    let asked = Instant::now();
    let waiter = tokio::spawn({
        let (url, body) = (url.clone(), body.clone());
        async move { send(&impatient, &url, key, &body, &[("Prefer", "wait=10")]).await }
    });
    eventually(asked + patience, "the request is waiting", || async {
        (metric(&http, &url, "idempotency_waiters").await == 1.0).then_some(())
    })
    .await;
    let gave_up = waiter.await.unwrap();
    assert!(gave_up.unwrap_err().is_timeout());
    let hung_up = Instant::now();

    // The wait ends while the work it waited for is still in flight: it
    // was the hang-up that ended it, not the answer, nor its own 10 s.
    eventually(
        hung_up + latency,
        "the wait stopped after the client hung up",
        || async { (metric(&http, &url, "idempotency_waiters").await == 0.0).then_some(()) },
    )
    .await;
    let stopped_after = hung_up.elapsed();
    let key_status: String =
        sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE key = $1")
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        key_status, "processing",
        "the wait stopped {stopped_after:?} after the hang-up, before the work was done"
    );
    // The shared poll reads at most every 250 ms: a few of its intervals
    // without a read show that nobody polls any more.
    let polls = metric(&http, &url, "idempotency_wait_polls_total").await;
    tokio::time::sleep(Duration::from_millis(4 * 250)).await;
    assert_eq!(
        metric(&http, &url, "idempotency_wait_polls_total").await,
        polls,
        "nobody polls for a waiter that left"
    );
    eprintln!("the wait stopped {stopped_after:?} after the client hung up");

    // The work itself was never the waiter's to cancel.
    let (status, _, charge) = owner.await.unwrap().unwrap();
    assert_eq!(status, 201, "{charge}");
    let charges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM charges WHERE status = 'succeeded'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(charges, 1);
    assert_events_paired(&pool).await;
}

/// Waits until `key` is claimed and its request at the processor, where it
/// stays for `latency`: the deadline.
async fn in_flight(pool: &sqlx::PgPool, key: &str, latency: Duration) {
    eventually(
        Instant::now() + latency,
        "the first request is at the processor",
        || async {
            let status: Option<String> =
                sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE key = $1")
                    .bind(key)
                    .fetch_optional(pool)
                    .await
                    .unwrap();
            (status.as_deref() == Some("processing")).then_some(())
        },
    )
    .await
}

/// Makes a merchant with the CLI, as an operator would; returns its API key.
fn create_merchant(db: &Database, name: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(["merchants", "create", "--name", name])
        .env_clear()
        .env("DATABASE_URL", &db.url)
        .output()
        .expect("run oncepay merchants create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Transactions the database has counted so far (committed and rolled back).
async fn transactions(pool: &sqlx::PgPool, name: &str) -> i64 {
    // The statistics are flushed by each backend within a second or so.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    sqlx::query_scalar(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1",
    )
    .bind(name)
    .fetch_one(pool)
    .await
    .unwrap()
}
