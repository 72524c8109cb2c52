//! The workshop's remaining pitfalls, against the naive endpoints that show
//! them and the real ones that do not: refunds that race with different keys
//! (idempotency is not concurrency control), keys kept in Redis outside the
//! business transaction (with a real process crash between the commits), and
//! a key that expires before the client's last retry.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::{Value, json};
use tokio::sync::Barrier;

use crate::helpers::{Answer, Settings, TestApp, TestDb, spawn_app, spawn_app_with, until};

fn tagged(run: &str, amount: i64) -> Value {
    json!({"amount": amount, "currency": "usd", "source": "tok_visa", "metadata": {"demo_run": run}})
}

async fn post(app: &TestApp, path: &str, key: &str, body: &Value) -> Answer {
    let response = app
        .client
        .post(app.url(path))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .unwrap();
    Answer::of(response).await
}

/// Money the processor gave back from the charge's payment.
async fn refunded_at_the_processor(app: &TestApp, charge: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(amount), 0)::bigint FROM operations
          WHERE payment_key = 'auth:' || $1 AND outcome = 'refunded'",
    )
    .bind(charge)
    .fetch_one(&app.processor_pool)
    .await
    .unwrap()
}

/// `n` refunds of `amount` from `charge` on `path`, a key each, released
/// together from as many tasks.
async fn refunds_at_once(
    app: &Arc<TestApp>,
    path: &'static str,
    charge: &str,
    amount: i64,
    n: usize,
) -> Vec<Answer> {
    let barrier = Arc::new(Barrier::new(n));
    let tasks = (0..n).map(|i| {
        let (app, barrier) = (app.clone(), barrier.clone());
        let body = json!({"charge": charge, "amount": amount});
        tokio::spawn(async move {
            barrier.wait().await;
            post(&app, path, &format!("refund-{i}"), &body).await
        })
    });
    join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

// ---- idempotency is not concurrency control -------------------------------

#[tokio::test]
async fn the_naive_refund_and_redis_endpoints_do_not_exist_unless_enabled() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    post(&app, "/demo/naive/refunds", "k", &json!({"charge": charge}))
        .await
        .assert_problem(404, "route_not_found");
    post(&app, "/demo/redis/charges", "k", &tagged("r", 500))
        .await
        .assert_problem(404, "route_not_found");
    assert_eq!(app.processor_refunds().await, 0);
    assert_eq!(app.payments().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_with_different_keys_at_once_refund_more_than_was_charged_on_the_naive_endpoint() {
    let app = Arc::new(
        spawn_app_with(
            Settings::new()
                .set("DEMO_UNSAFE_ENDPOINTS", "true")
                .set("PROCESSOR_LATENCY_MS", 300),
        )
        .await,
    );
    let charge = app.paid_charge(1000).await;
    let answers = refunds_at_once(&app, "/demo/naive/refunds", &charge, 600, 8).await;
    let refunded = answers.iter().filter(|a| a.status == 201).count();
    assert!(
        refunded >= 2,
        "the race let several pass the check: {refunded}"
    );
    for answer in answers.iter().filter(|a| a.status == 201) {
        assert_eq!(answer.json()["status"], "succeeded");
        assert!(!answer.replayed(), "each key is its own operation");
    }
    let given_back = refunded_at_the_processor(&app, &charge).await;
    assert_eq!(given_back, 600 * refunded as i64);
    assert!(
        given_back > 1000,
        "the bug: {given_back} refunded of 1000 charged"
    );
    // The charge's books lost writes: each wrote what it read plus 600.
    assert_eq!(app.amount_refunded(&charge).await, 600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_with_different_keys_at_once_never_refund_more_than_was_charged_on_the_real_endpoint()
 {
    let app = Arc::new(spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 300)).await);
    let charge = app.paid_charge(1000).await;
    let answers = refunds_at_once(&app, "/v1/refunds", &charge, 600, 8).await;
    let refunded: Vec<_> = answers.iter().filter(|a| a.status == 201).collect();
    assert_eq!(refunded.len(), 1, "one reservation fits");
    for answer in answers.iter().filter(|a| a.status != 201) {
        answer.assert_problem(400, "amount_too_large");
    }
    assert_eq!(refunded_at_the_processor(&app, &charge).await, 600);
    assert_eq!(app.amount_refunded(&charge).await, 600);
    assert_eq!(app.refunds().await, 1);
}

#[tokio::test]
async fn the_naive_refund_replays_its_key_and_refuses_what_its_check_sees() {
    let app = spawn_app_with(Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")).await;
    let charge = app.paid_charge(1000).await;
    let path = "/demo/naive/refunds";
    let first = post(&app, path, "a", &json!({"charge": charge, "amount": 600})).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = post(&app, path, "a", &json!({"charge": charge, "amount": 600})).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "the key is done right");
    // One at a time, the check works: 400 left, 600 asked.
    post(&app, path, "b", &json!({"charge": charge, "amount": 600}))
        .await
        .assert_problem(400, "amount_too_large");
    // The refusal freed its key.
    let rest = post(&app, path, "b", &json!({"charge": charge})).await;
    assert_eq!(
        (rest.status, rest.json()["amount"].as_i64()),
        (201, Some(400))
    );
    post(&app, path, "c", &json!({"charge": charge}))
        .await
        .assert_problem(400, "charge_already_refunded");
    post(&app, path, "d", &json!({"charge": "ch_nope"}))
        .await
        .assert_problem(400, "resource_missing");
    let missing = Answer::of(
        app.client
            .post(app.url(path))
            .bearer_auth(&app.api_key)
            .json(&json!({"charge": charge}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    missing.assert_problem(400, "idempotency_key_missing");
    assert_eq!(refunded_at_the_processor(&app, &charge).await, 1000);
}

#[tokio::test]
async fn the_effect_counter_adds_what_was_charged_and_refunded() {
    let app = spawn_app_with(Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")).await;
    let charge = Answer::of(app.post_charge(None, &tagged("money", 1000)).await).await;
    let charge = charge.json()["id"].as_str().unwrap().to_owned();
    assert_eq!(
        app.post_charge(None, &tagged("money", 250)).await.status(),
        201
    );
    let real = Answer::of(
        app.post_refund(Some("r1"), &json!({"charge": charge, "amount": 300}))
            .await,
    )
    .await;
    assert_eq!(real.status, 201);
    let naive = post(
        &app,
        "/demo/naive/refunds",
        "n1",
        &json!({"charge": charge, "amount": 100}),
    )
    .await;
    assert_eq!(naive.status, 201);
    let effects = Answer::of(app.get("/demo/effects?run=money").await)
        .await
        .json();
    assert_eq!(
        [
            &effects["payments"],
            &effects["charged"],
            &effects["refunds"],
            &effects["refunded"]
        ],
        [&json!(2), &json!(1250), &json!(2), &json!(400)]
    );
}

// ---- a TTL shorter than the retry horizon ---------------------------------

#[tokio::test]
async fn a_retry_within_the_ttl_replays_and_a_retry_after_it_charges_again() {
    let app = spawn_app_with(
        Settings::new()
            .set("IDEMPOTENCY_KEY_TTL", "2s")
            .set("PROCESSING_TIMEOUT", "1s"),
    )
    .await;
    let body = tagged("ttl", 500);
    let first = Answer::of(app.post_charge(Some("ttl"), &body).await).await;
    assert_eq!(first.status, 201);
    let key = Answer::of(app.get("/v1/idempotency_keys/ttl").await)
        .await
        .json();
    let ttl = key["expires_at"].as_i64().unwrap() - key["created_at"].as_i64().unwrap();
    assert!(
        (2..=3).contains(&ttl),
        "expires_at is IDEMPOTENCY_KEY_TTL after the answer: {key}"
    );
    let within = Answer::of(app.post_charge(Some("ttl"), &body).await).await;
    assert!(within.replayed());
    assert_eq!(within.body, first.body);

    tokio::time::sleep(Duration::from_secs(3)).await;
    Answer::of(app.get("/v1/idempotency_keys/ttl").await)
        .await
        .assert_problem(404, "resource_missing");
    let after = Answer::of(app.post_charge(Some("ttl"), &body).await).await;
    assert_eq!(after.status, 201);
    assert!(
        !after.replayed(),
        "the documented contract: a key is remembered for its TTL"
    );
    assert_ne!(after.json()["id"], first.json()["id"]);
    assert_eq!(app.payments().await, 2);
}

#[tokio::test]
async fn the_settings_tell_a_workshop_what_the_server_runs_with() {
    let app = spawn_app_with(
        Settings::new()
            .set("IDEMPOTENCY_KEY_TTL", "2s")
            .set("PROCESSING_TIMEOUT", "1s")
            .set("FAULT_INJECTION", "true"),
    )
    .await;
    let settings = Answer::of(app.get("/demo/settings").await).await;
    assert_eq!(settings.status, 200);
    let settings = settings.json();
    assert_eq!(settings["idempotency_key_ttl_ms"], 2000);
    assert_eq!(settings["processing_timeout_ms"], 1000);
    assert_eq!(settings["fault_injection"], true);
    assert_eq!(settings["demo_unsafe_endpoints"], false);
    assert_eq!(settings["webhook_allow_private"], false);
    assert_eq!(settings["redis"], false);
    assert!(settings["started_at_ms"].as_u64().unwrap() > 1_700_000_000_000);
    Answer::of(app.get("/demo/settings?x=1").await)
        .await
        .assert_problem(400, "parameter_unknown");
    let anonymous = app
        .client
        .get(app.url("/demo/settings"))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
}

// ---- the key kept outside the business transaction --------------------------

/// The Redis to test against: `REDIS_URL`, else one on 127.0.0.1:6379. None
/// (the test is skipped, saying so) when there is none, except under CI.
fn redis_url() -> Option<String> {
    if let Some(url) = std::env::var("REDIS_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
    {
        return Some(url);
    }
    let local = "127.0.0.1:6379".parse().unwrap();
    if std::net::TcpStream::connect_timeout(&local, Duration::from_millis(500)).is_ok() {
        return Some("redis://127.0.0.1:6379".to_owned());
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "no Redis: set REDIS_URL (scripts/test finds or starts one)"
    );
    eprintln!("SKIPPED: no Redis; set REDIS_URL or run one on 127.0.0.1:6379");
    None
}

#[tokio::test]
async fn without_redis_the_redis_endpoint_refuses_before_it_charges() {
    let app = spawn_app_with(Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")).await;
    let answer = post(&app, "/demo/redis/charges", "k", &tagged("r", 500)).await;
    answer.assert_problem(503, "redis_unavailable");
    assert_eq!(answer.header("retry-after"), Some("1"));
    assert_eq!(app.charges().await, 0);
}

#[tokio::test]
async fn the_redis_endpoint_replays_a_retry_and_refuses_a_key_left_processing() {
    let Some(redis) = redis_url() else { return };
    let app = spawn_app_with(
        Settings::new()
            .set("DEMO_UNSAFE_ENDPOINTS", "true")
            .set("REDIS_URL", &redis)
            .set("IDEMPOTENCY_KEY_TTL", "2s")
            .set("PROCESSING_TIMEOUT", "1s"),
    )
    .await;
    let key = format!("redis-{}", uuid::Uuid::new_v4());
    let first = post(&app, "/demo/redis/charges", &key, &tagged("redis", 500)).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let retry = post(&app, "/demo/redis/charges", &key, &tagged("redis", 500)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.payments().await, 1);

    // A key claimed and never completed, as a crash between the commits leaves it.
    let client = redis::Client::open(redis.as_str()).unwrap();
    let mut conn = oncepay::workshop::redis_keys::connect(&client)
        .await
        .unwrap();
    let stuck = format!("stuck-{}", uuid::Uuid::new_v4());
    let claim = oncepay::workshop::redis_keys::claim(
        &mut conn,
        app.merchant_id,
        &stuck,
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    assert!(matches!(
        claim,
        oncepay::workshop::redis_keys::Claim::Claimed
    ));
    let in_use = post(&app, "/demo/redis/charges", &stuck, &tagged("redis", 500)).await;
    in_use.assert_problem(409, "idempotency_key_in_use");
    let left = in_use.json()["redis_ttl_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 2000, "{left}");
    assert_eq!(
        app.payments().await,
        1,
        "nothing charged while Redis says processing"
    );
}

/// `oncepay serve` as a process, restarted on the same port by `restart`,
/// as a supervisor restarts a service that crashed.
struct Served {
    child: Child,
    port: u16,
    env: Vec<(&'static str, String)>,
    base: String,
    client: reqwest::Client,
    key: String,
}

impl Served {
    async fn start(db: &TestDb, env: &[(&'static str, &str)]) -> Served {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let key = format!("sk_test_pitfalls{}", uuid::Uuid::new_v4().simple());
        let mut all: Vec<(&'static str, String)> = vec![
            ("DATABASE_URL", db.url.clone()),
            ("PORT", port.to_string()),
            ("BIND_ADDR", "127.0.0.1".into()),
            ("DEMO_API_KEY", key.clone()),
            ("RUST_LOG", "warn".into()),
        ];
        all.extend(env.iter().map(|(n, v)| (*n, (*v).to_owned())));
        let mut served = Served {
            child: Self::spawn(&all),
            port,
            env: all,
            base: format!("http://127.0.0.1:{port}"),
            client: reqwest::Client::new(),
            key,
        };
        served.until_healthy().await;
        served
    }

    fn spawn(env: &[(&'static str, String)]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .arg("serve")
            .env_clear()
            .current_dir(std::env::temp_dir())
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env.iter().map(|(n, v)| (*n, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start oncepay serve")
    }

    async fn until_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "oncepay serve exited at start"
            );
            if let Ok(r) = self
                .client
                .get(format!("{}/healthz", self.base))
                .send()
                .await
            {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no /healthz on port {}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for the crashed process to be gone, then starts it again.
    async fn restart_after_crash(&mut self) {
        let status = self.child.wait().unwrap();
        assert!(!status.success(), "it crashed: {status}");
        self.child = Self::spawn(&self.env);
        self.until_healthy().await;
    }

    async fn charge(
        &self,
        path: &str,
        key: &str,
        run: &str,
        fault: Option<&str>,
    ) -> Option<Answer> {
        let mut request = self
            .client
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.key)
            .header("Idempotency-Key", key)
            .json(&tagged(run, 500));
        if let Some(fault) = fault {
            request = request.header("Oncepay-Fault", fault);
        }
        match request.send().await {
            Ok(response) => Some(Answer::of(response).await),
            Err(_) => None, // the process died: no answer
        }
    }

    async fn payments(&self, run: &str) -> i64 {
        let answer = self
            .client
            .get(format!("{}/demo/effects?run={run}", self.base))
            .bearer_auth(&self.key)
            .send()
            .await
            .unwrap();
        Answer::of(answer).await.json()["payments"]
            .as_i64()
            .unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The settings of a server for the crash scenarios: short TTL and
/// processing timeout, a quick sweeper.
fn crash_settings(redis: &str) -> Vec<(&'static str, &str)> {
    vec![
        ("FAULT_INJECTION", "true"),
        ("DEMO_UNSAFE_ENDPOINTS", "true"),
        ("REDIS_URL", redis),
        ("IDEMPOTENCY_KEY_TTL", "2s"),
        ("PROCESSING_TIMEOUT", "1s"),
        ("SWEEP_INTERVAL", "200ms"),
    ]
}

#[tokio::test]
async fn a_crash_between_the_commit_and_the_redis_write_gets_409_until_the_ttl_then_a_second_charge()
 {
    let Some(redis) = redis_url() else { return };
    let db = TestDb::create_empty().await;
    let mut server = Served::start(&db, &crash_settings(&redis)).await;
    let key = format!("crash-{}", uuid::Uuid::new_v4());
    let crashed = Instant::now();
    let first = server
        .charge(
            "/demo/redis/charges",
            &key,
            "redis-crash",
            Some("crash-after-commit"),
        )
        .await;
    assert!(first.is_none(), "the process died before answering");
    server.restart_after_crash().await;
    assert_eq!(
        server.payments("redis-crash").await,
        1,
        "the charge committed before the crash"
    );

    // Within the TTL: Redis says processing, and nothing will ever change that.
    let mut conflicts = 0;
    while crashed.elapsed() < Duration::from_millis(1500) {
        let retry = server
            .charge("/demo/redis/charges", &key, "redis-crash", None)
            .await
            .unwrap();
        retry.assert_problem(409, "idempotency_key_in_use");
        conflicts += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(conflicts >= 1);
    assert_eq!(server.payments("redis-crash").await, 1);

    // After the TTL, Redis has forgotten the key: the retry charges again.
    tokio::time::sleep(Duration::from_millis(2100).saturating_sub(crashed.elapsed())).await;
    let after = server
        .charge("/demo/redis/charges", &key, "redis-crash", None)
        .await
        .unwrap();
    assert_eq!(after.status, 201, "{:?}", after.body);
    assert!(!after.replayed());
    assert_eq!(
        server.payments("redis-crash").await,
        2,
        "the bug: a second charge"
    );
}

#[tokio::test]
async fn the_same_crash_on_the_real_endpoint_is_settled_by_the_sweeper_and_the_retry_replays() {
    let Some(redis) = redis_url() else { return };
    let db = TestDb::create_empty().await;
    let mut server = Served::start(&db, &crash_settings(&redis)).await;
    let key = format!("crash-{}", uuid::Uuid::new_v4());
    let first = server
        .charge(
            "/v1/charges",
            &key,
            "real-crash",
            Some("crash-after-processor"),
        )
        .await;
    assert!(first.is_none(), "the process died before answering");
    server.restart_after_crash().await;

    let pool = db.pool().await;
    until(Duration::from_secs(10), "the sweeper settles the key", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE key = $1 AND status = 'completed')",
        )
        .bind(&key)
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    let retry = server
        .charge("/v1/charges", &key, "real-crash", None)
        .await
        .unwrap();
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed());
    assert_eq!(server.payments("real-crash").await, 1, "one charge");
    pool.close().await;
}
