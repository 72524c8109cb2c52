//! A request answered before its work could claim its key must never claim
//! it later. Instance A's pool is saturated (one connection, held by a
//! refund blocked on a row lock this test holds), so a request sent to A
//! waits for a connection inside its task and is answered `503
//! request_timeout`. Its client retries on instance B, which does the work
//! and saves the answer. Once that answer is older than the keys' lifetime,
//! the lock is let go: A's task, still alive, gets its connection, and must
//! not claim the key (taking over the expired answer, or claiming it anew
//! after the sweeper deleted it) to move money a second time.

use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::PgPool;

use crate::database::TestDb as Database;
use crate::harness::{
    Server, charge_body, client, eventually, post, processor_pool, refund_body, send, setting,
};
use crate::proxy::HoldingProxy;

const TTL: Duration = Duration::from_secs(2);

/// What the log of an instance says when a task finds its request already
/// answered at the moment it would claim.
const GAVE_UP: &str = "nothing claimed";

/// Both instances: keys live [`TTL`], stale work is recovered after a
/// second, a request is answered `503` after 500 ms.
fn settings() -> Vec<(&'static str, String)> {
    vec![
        ("PROCESSING_TIMEOUT", "1s".to_owned()),
        ("SWEEP_INTERVAL", "200ms".to_owned()),
        ("IDEMPOTENCY_KEY_TTL", setting(TTL)),
        ("REQUEST_TIMEOUT", "500ms".to_owned()),
    ]
}

/// Two instances on one database; A has one connection.
struct Pair {
    _db: Database,
    pool: PgPool,
    a: Server,
    b: Server,
    http: reqwest::Client,
}

impl Pair {
    async fn start() -> Self {
        let db = Database::create_empty().await;
        let b = Server::start(&db.url, &settings()).await;
        let mut saturated = settings();
        saturated.push(("DATABASE_MAX_CONNECTIONS", "1".to_owned()));
        // No shedding: the request waits for its connection until its
        // deadline answers it, the path this test is about.
        saturated.push(("DATABASE_QUEUE_TIMEOUT", "1h".to_owned()));
        saturated.push(("DATABASE_QUEUE_OVERLOAD_TIMEOUT", "1h".to_owned()));
        let a = Server::start(&db.url, &saturated).await;
        let pool = db.pool().await;
        let http = client(Duration::from_secs(15));
        // The merchant is cached on A from here on: the requests below need
        // no connection before their task.
        let warm = http
            .get(format!("{}/v1/balance", a.url()))
            .bearer_auth(crate::harness::API_KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(warm.status(), 200);
        Pair {
            _db: db,
            pool,
            a,
            b,
            http,
        }
    }

    /// A succeeded charge made on B.
    async fn paid_charge(&self, op: &str) -> String {
        let (status, _, charge) = send(
            &self.http,
            &self.b.url(),
            op,
            &charge_body(op, 5000, "tok_visa"),
            &[],
        )
        .await
        .unwrap();
        assert_eq!(status, 201, "{charge}");
        charge["id"].as_str().unwrap().to_owned()
    }

    /// Saturates A: locks `charge` in a transaction of this test's, sends A
    /// a refund of it, which takes A's only connection and blocks on the
    /// lock, and waits until it does. Dropping the transaction lets go.
    async fn saturate_a(&self, charge: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut lock = self.pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM charges WHERE id = $1 FOR UPDATE")
            .bind(charge)
            .execute(&mut *lock)
            .await
            .unwrap();
        let (http, url, body) = (
            self.http.clone(),
            self.a.url(),
            refund_body("blocker", charge, 100),
        );
        tokio::spawn(async move {
            let _ = post(&http, &url, "/v1/refunds", "blocker", &body, &[]).await;
        });
        eventually(
            Instant::now() + Duration::from_secs(10),
            "A's connection waits on the row lock",
            || async {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&self.pool)
                .await
                .unwrap();
                (waiting > 0).then_some(())
            },
        )
        .await;
        lock
    }

    /// Waits until the key's saved answer is past its expiry.
    async fn until_expired(&self, key: &str) {
        eventually(
            Instant::now() + TTL * 3,
            "the answer is older than the keys' lifetime",
            || async {
                let live: Option<bool> = sqlx::query_scalar(
                    "SELECT expires_at > now() FROM idempotency_keys WHERE key = $1",
                )
                .bind(key)
                .fetch_optional(&self.pool)
                .await
                .unwrap();
                // Expired, or already deleted by a sweeper.
                (live != Some(true)).then_some(())
            },
        )
        .await;
    }

    /// Lets A's queue drain: a read sent to A after the lock is gone gets
    /// its connection after the late task had its turn (the pool serves
    /// waiters in order); then waits until the task said it gave up, or
    /// until `extra` records show that it did not.
    async fn drain_a(&self, count: &str, op: &str) {
        let read = self
            .http
            .get(format!("{}/v1/balance", self.a.url()))
            .bearer_auth(crate::harness::API_KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(read.status(), 200);
        eventually(
            Instant::now() + Duration::from_secs(10),
            "A's late task gave up or did the work again",
            || async {
                let records: i64 = sqlx::query_scalar(count)
                    .bind(op)
                    .fetch_one(&self.pool)
                    .await
                    .unwrap();
                (records > 1 || self.a.log_text().contains(GAVE_UP)).then_some(())
            },
        )
        .await;
    }
}

/// Sends `body` to `route` on A while A is saturated: the answer is `503
/// request_timeout`, telling the client to retry with the same key.
async fn answered_503_by_a(pair: &Pair, route: &str, key: &str, body: &Value) {
    let (status, _, problem) = post(&pair.http, &pair.a.url(), route, key, body, &[])
        .await
        .unwrap();
    assert_eq!(status, 503, "{problem}");
    assert_eq!(problem["code"], "request_timeout", "{problem}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_answered_503_never_claims_its_key_after_the_retry_s_answer_expired() {
    let pair = Pair::start().await;
    let locked = pair.paid_charge("to-lock").await;
    let lock = pair.saturate_a(&locked).await;

    let key = "late-charge";
    let body = charge_body(key, 2000, "tok_visa");
    answered_503_by_a(&pair, "/v1/charges", key, &body).await;
    let (status, _, first) = send(&pair.http, &pair.b.url(), key, &body, &[])
        .await
        .unwrap();
    assert_eq!(status, 201, "the retry on B charges: {first}");

    pair.until_expired(key).await;
    lock.rollback().await.unwrap();
    let count = "SELECT count(*) FROM charges WHERE metadata->>'op' = $1";
    pair.drain_a(count, key).await;

    let charges: Vec<String> =
        sqlx::query_scalar("SELECT id FROM charges WHERE metadata->>'op' = $1")
            .bind(key)
            .fetch_all(&pair.pool)
            .await
            .unwrap();
    assert_eq!(charges, [first["id"].as_str().unwrap()], "one charge only");
    let ledger = processor_pool(&pair.pool).await;
    let payments: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations
          WHERE kind = 'authorization' AND key = 'auth:' || $1",
    )
    .bind(&charges[0])
    .fetch_one(&ledger)
    .await
    .unwrap();
    assert_eq!(payments, 1, "one payment at the processor");
    let all_payments: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operations WHERE kind = 'authorization'")
            .fetch_one(&ledger)
            .await
            .unwrap();
    assert_eq!(
        all_payments, 2,
        "the locked charge's and this one's, no more"
    );
    let key_charge: Option<String> =
        sqlx::query_scalar("SELECT charge_id FROM idempotency_keys WHERE key = $1")
            .bind(key)
            .fetch_optional(&pair.pool)
            .await
            .unwrap()
            .flatten();
    assert!(
        key_charge.is_none() || key_charge.as_deref() == first["id"].as_str(),
        "the key, if still there, names the acknowledged charge, not {key_charge:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_answered_503_never_claims_its_key_after_the_retry_s_answer_expired() {
    let pair = Pair::start().await;
    let locked = pair.paid_charge("to-lock").await;
    let refunded = pair.paid_charge("to-refund").await;
    let lock = pair.saturate_a(&locked).await;

    let key = "late-refund";
    let body = refund_body(key, &refunded, 1000);
    answered_503_by_a(&pair, "/v1/refunds", key, &body).await;
    let (status, _, first) = post(&pair.http, &pair.b.url(), "/v1/refunds", key, &body, &[])
        .await
        .unwrap();
    assert_eq!(status, 201, "the retry on B refunds: {first}");

    pair.until_expired(key).await;
    lock.rollback().await.unwrap();
    let count = "SELECT count(*) FROM refunds WHERE metadata->>'op' = $1";
    pair.drain_a(count, key).await;

    let refunds: Vec<String> =
        sqlx::query_scalar("SELECT id FROM refunds WHERE metadata->>'op' = $1")
            .bind(key)
            .fetch_all(&pair.pool)
            .await
            .unwrap();
    assert_eq!(refunds, [first["id"].as_str().unwrap()], "one refund only");
    let refunded_amount: i64 =
        sqlx::query_scalar("SELECT amount_refunded FROM charges WHERE id = $1")
            .bind(&refunded)
            .fetch_one(&pair.pool)
            .await
            .unwrap();
    assert_eq!(refunded_amount, 1000, "refunded once");
    let processor_refunds: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations
          WHERE kind = 'refund' AND payment_key = 'auth:' || $1",
    )
    .bind(&refunded)
    .fetch_one(&processor_pool(&pair.pool).await)
    .await
    .unwrap();
    assert_eq!(processor_refunds, 1, "one refund at the processor");
}

/// A charge whose claim statement is held on the wire, after it was sent,
/// until the retry's answer has expired: the statement reaches Postgres
/// long after its request's deadline, and must not take the key over (or
/// claim it anew once a sweeper deleted it) to charge a second time.
/// Instance A reaches Postgres through a proxy of the test's that holds
/// the bytes, as a cut link holds them in TCP retransmission; B directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_held_on_the_wire_past_the_retry_s_expiry_never_charges_twice() {
    let db = Database::create_empty().await;
    let b = Server::start(&db.url, &settings()).await;
    let proxy = HoldingProxy::to_database(&db.url).await;
    let mut a_settings = settings();
    let gateway = b.processor.as_ref().expect("B's card gateway");
    a_settings.push(("PROCESSOR_URL", gateway.url()));
    a_settings.push(("PROCESSOR_API_KEY", gateway.api_key.clone()));
    let a = Server::start(&proxy.url(&db.url), &a_settings).await;
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    // New keys only, until A claims a new charge in one statement, without
    // reading its key first (the read has a connection of its own, and a
    // held read would keep the claim from being sent at all).
    for n in 0..40 {
        let op = format!("warm-{n}");
        let (status, _, charge) = send(
            &http,
            &a.url(),
            &op,
            &charge_body(&op, 100, "tok_visa"),
            &[],
        )
        .await
        .unwrap();
        assert_eq!(status, 201, "{charge}");
    }

    proxy.hold();
    let key = "held-claim";
    let body = charge_body(key, 2000, "tok_visa");
    let (status, _, problem) = send(&http, &a.url(), key, &body, &[]).await.unwrap();
    assert_eq!(status, 503, "A cannot reach Postgres: {problem}");
    assert_eq!(problem["code"], "request_timeout", "{problem}");
    let (status, _, first) = send(&http, &b.url(), key, &body, &[]).await.unwrap();
    assert_eq!(status, 201, "the retry on B charges: {first}");
    eventually(
        Instant::now() + TTL * 3,
        "the retry's answer is older than the keys' lifetime",
        || async {
            let live: Option<bool> = sqlx::query_scalar(
                "SELECT expires_at > now() FROM idempotency_keys WHERE key = $1",
            )
            .bind(key)
            .fetch_optional(&pool)
            .await
            .unwrap();
            (live != Some(true)).then_some(())
        },
    )
    .await;
    proxy.release();
    // A may have cut its connection meanwhile (its database host went
    // silent): the held claim still reaches Postgres, and A never hears
    // what came of it. So the wait ends on A's word, or a second charge, or
    // once the proxy has passed everything on and a moment went by.
    let count = "SELECT count(*) FROM charges WHERE metadata->>'op' = $1";
    eventually(
        Instant::now() + Duration::from_secs(20),
        "A's held claim was passed on to Postgres",
        || async { proxy.drained().then_some(()) },
    )
    .await;
    let settled = Instant::now() + Duration::from_secs(2);
    while Instant::now() < settled && !a.log_text().contains(GAVE_UP) {
        let records: i64 = sqlx::query_scalar(count)
            .bind(key)
            .fetch_one(&pool)
            .await
            .unwrap();
        if records > 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let charges: Vec<String> =
        sqlx::query_scalar("SELECT id FROM charges WHERE metadata->>'op' = $1")
            .bind(key)
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(charges, [first["id"].as_str().unwrap()], "one charge only");
    let payments: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operations WHERE kind = 'authorization'")
            .fetch_one(&processor_pool(&pool).await)
            .await
            .unwrap();
    assert_eq!(payments, 41, "the warm-up's 40 and this one's, no more");
}
