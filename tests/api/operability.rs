//! Request ids, metrics, problems from layers, and the per-request timeout.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oncepay::merchants;
use sqlx::PgPool;
use uuid::Uuid;

use crate::helpers::{Answer, Settings, TestDb, spawn_app, spawn_app_with, until, visa};
use crate::sweeper::stale_claim_in;

#[tokio::test]
async fn every_response_carries_a_request_id_and_an_incoming_one_is_honoured() {
    let app = spawn_app().await;
    let made = app.client.get(app.url("/healthz")).send().await.unwrap();
    let id = made.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 36, "a UUID: {id}");

    let given = app
        .client
        .get(app.url("/v1/charges/ch_nope"))
        .bearer_auth(&app.api_key)
        .header("X-Request-Id", "trace-42")
        .send()
        .await
        .unwrap();
    assert_eq!(given.headers()["x-request-id"], "trace-42");
    let problem = Answer::of(given).await;
    problem.assert_problem(404, "resource_missing");
    assert_eq!(
        problem.json()["request_id"],
        "trace-42",
        "problems name their request"
    );

    let junk = app
        .client
        .get(app.url("/healthz"))
        .header("X-Request-Id", "x".repeat(500))
        .send()
        .await
        .unwrap();
    assert_eq!(
        junk.headers()["x-request-id"].len(),
        36,
        "an over-long id is replaced"
    );
}

/// `POST /v1/charges` with `X-Request-Id: request_id`.
async fn post_charge_with_id(
    app: &crate::helpers::TestApp,
    key: &str,
    request_id: &str,
    body: &serde_json::Value,
) -> Answer {
    Answer::of(
        app.client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", key)
            .header("X-Request-Id", request_id)
            .json(body)
            .send()
            .await
            .unwrap(),
    )
    .await
}

#[tokio::test]
async fn a_fresh_decline_names_its_request_id_and_its_replay_is_the_same_bytes() {
    let app = spawn_app().await;
    let body =
        serde_json::json!({"amount": 100, "currency": "usd", "source": "tok_chargeDeclined"});
    let first = post_charge_with_id(&app, "d", "decline-first", &body).await;
    first.assert_problem(402, "card_declined");
    assert_eq!(first.json()["request_id"], "decline-first");
    assert_eq!(first.header("x-request-id"), Some("decline-first"));

    // The replay is the saved answer byte for byte: it names the request
    // that first got it, while its own id is in its headers.
    let retry = post_charge_with_id(&app, "d", "decline-retry", &body).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("x-request-id"), Some("decline-retry"));
    let saved: Vec<u8> =
        sqlx::query_scalar("SELECT response_body FROM idempotency_keys WHERE key = 'd'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(saved, first.body, "what was sent is what was saved");
    assert_eq!(app.charges().await, 1);
}

/// `oncepay serve` as a process of its own, on a database of its own. Its
/// metrics are its own: this test binary's recorder is shared by every test
/// running in it, so counts there are never exact.
struct Served {
    child: Child,
    url: String,
    pool: PgPool,
    merchant_id: Uuid,
    api_key: String,
    stderr: PathBuf,
    _db: TestDb,
}

impl Served {
    /// Starts the binary with `env` and waits until it answers `/healthz`.
    async fn start(env: &[(&str, &str)]) -> Self {
        let db = TestDb::create().await;
        let pool = db.pool().await;
        let (merchant, key) = merchants::create(&pool, "served").await.unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let stderr = std::env::temp_dir().join(format!("oncepay-served-{}.log", db.name));
        let child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .arg("serve")
            .env_clear()
            // Away from any .env a developer keeps in the checkout.
            .current_dir(std::env::temp_dir())
            .env("DATABASE_URL", &db.url)
            .env("PORT", port.to_string())
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start oncepay serve");
        let mut served = Served {
            child,
            url: format!("http://127.0.0.1:{port}"),
            pool,
            merchant_id: merchant.id,
            api_key: key.expose().to_owned(),
            stderr,
            _db: db,
        };
        let healthz = format!("{}/healthz", served.url);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = served.child.try_wait().unwrap() {
                panic!("oncepay serve exited ({status}): {}", served.log());
            }
            if reqwest::get(&healthz)
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                return served;
            }
            assert!(
                Instant::now() < deadline,
                "oncepay serve did not start: {}",
                served.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    async fn metrics(&self) -> String {
        let response = reqwest::get(format!("{}/metrics", self.url)).await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain")
        );
        response.text().await.unwrap()
    }

    async fn post_charge(&self, key: &str, body: &serde_json::Value) -> u16 {
        reqwest::Client::new()
            .post(format!("{}/v1/charges", self.url))
            .bearer_auth(&self.api_key)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.stderr);
    }
}

/// The value of one series (`name{labels}` exactly as rendered) in a
/// Prometheus text scrape; 0 when it is not there yet.
fn sample(scrape: &str, series: &str) -> f64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.trim().parse().unwrap())
}

#[tokio::test]
async fn metrics_count_requests_idempotency_processor_calls_the_sweeper_and_the_pool() {
    // The stale claim below is settled by the process's own sweeper.
    let (processing_timeout, sweep_interval) = (Duration::from_secs(1), Duration::from_millis(200));
    let served = Served::start(&[
        ("PROCESSING_TIMEOUT", "1s"),
        ("SWEEP_INTERVAL", "200ms"),
        ("DATABASE_MAX_CONNECTIONS", "7"),
    ])
    .await;
    let before = served.metrics().await;

    assert_eq!(served.post_charge("m", &visa(100)).await, 201);
    assert_eq!(served.post_charge("m", &visa(100)).await, 201);
    assert_eq!(served.post_charge("m", &visa(200)).await, 422);
    stale_claim_in(
        &served.pool,
        served.merchant_id,
        "crashed",
        "ch_crashedbeforemetrics00001",
        "1 minute",
    )
    .await;
    // Recovery answers within PROCESSING_TIMEOUT plus one SWEEP_INTERVAL
    // (given five times that, on a loaded machine).
    let recovery = (processing_timeout + sweep_interval) * 5;
    until(recovery, "the sweeper settled it", || async {
        sqlx::query_scalar::<_, String>("SELECT status FROM idempotency_keys WHERE key = 'crashed'")
            .fetch_one(&served.pool)
            .await
            .unwrap()
            == "completed"
    })
    .await;
    // A pass records its metrics as it ends: once a pass has ended since,
    // the one that settled the claim has recorded its own.
    let runs = sample(&served.metrics().await, "sweeper_runs_total");
    until(recovery, "another sweeper pass", || async {
        sample(&served.metrics().await, "sweeper_runs_total") > runs
    })
    .await;
    let after = served.metrics().await;

    for (series, increase) in [
        (
            r#"http_requests_total{method="POST",route="/v1/charges",status="201"}"#,
            2.0,
        ),
        (
            r#"http_requests_total{method="POST",route="/v1/charges",status="422"}"#,
            1.0,
        ),
        (
            r#"http_request_duration_seconds_count{method="POST",route="/v1/charges",status="201"}"#,
            2.0,
        ),
        (r#"idempotency_outcomes_total{outcome="executed"}"#, 1.0),
        (r#"idempotency_outcomes_total{outcome="replayed"}"#, 1.0),
        (r#"idempotency_outcomes_total{outcome="reused"}"#, 1.0),
        (
            r#"processor_calls_total{call="authorize",outcome="succeeded"}"#,
            1.0,
        ),
        (
            r#"processor_call_duration_seconds_count{call="authorize",outcome="succeeded"}"#,
            1.0,
        ),
        (
            r#"processor_calls_total{call="void",outcome="voided"}"#,
            1.0,
        ),
        ("sweeper_leased_total", 1.0),
        (r#"sweeper_settled_total{outcome="charge_failed"}"#, 1.0),
        (r#"sweeper_settled_total{outcome="charge_succeeded"}"#, 0.0),
        ("sweeper_keys_deleted_total", 0.0),
        ("db_pool_timeouts_total", 0.0),
    ] {
        assert_eq!(
            sample(&after, series) - sample(&before, series),
            increase,
            "{series}\nbefore:\n{before}\nafter:\n{after}"
        );
    }
    // The sweeper runs on its clock: at least the pass that settled the claim.
    assert!(sample(&after, "sweeper_runs_total") > sample(&before, "sweeper_runs_total"));
    assert_eq!(sample(&after, "db_pool_max_connections"), 7.0);
    assert!(
        after.contains(r#"db_pool_connections{state="idle"}"#),
        "{after}"
    );
    assert!(
        after.contains(r#"db_pool_connections{state="in_use"}"#),
        "{after}"
    );
    assert!(!after.contains(&served.api_key));
}

/// Every series of the histogram part `name` (`..._sum`, `..._count`) in a
/// Prometheus text scrape whose labels include all of `labels`, summed.
fn histogram_part(scrape: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix('{')?;
            let (set, value) = rest.split_once("} ")?;
            labels
                .iter()
                .all(|(k, v)| set.split(',').any(|pair| pair == format!("{k}=\"{v}\"")))
                .then(|| value.trim().parse::<f64>().unwrap())
        })
        .sum()
}

#[tokio::test]
async fn a_charge_is_timed_phase_by_phase_and_its_phases_fit_within_the_whole() {
    let served = Served::start(&[]).await;
    assert_eq!(served.post_charge("timed", &visa(100)).await, 201);
    let scrape = served.metrics().await;
    let executed = [("route", "/v1/charges"), ("outcome", "executed")];
    let whole = histogram_part(&scrape, "operation_duration_seconds_sum", &executed);
    assert_eq!(
        histogram_part(&scrape, "operation_duration_seconds_count", &executed),
        1.0,
        "{scrape}"
    );
    let mut phases = 0.0;
    for phase in [
        "extract",
        "fingerprint",
        "task_handoff",
        "pool_wait",
        "claim",
        "processor",
        "settle_pool_wait",
        "settle",
        "render",
    ] {
        let labels = [executed[0], ("phase", phase), executed[1]];
        assert!(
            histogram_part(&scrape, "operation_phase_duration_seconds_count", &labels) >= 1.0,
            "{phase}: {scrape}"
        );
        phases += histogram_part(&scrape, "operation_phase_duration_seconds_sum", &labels);
    }
    // Nothing was waited for, and a charge has a processor, not a write.
    for phase in ["key_wait", "write"] {
        let labels = [("phase", phase)];
        assert_eq!(
            histogram_part(&scrape, "operation_phase_duration_seconds_count", &labels),
            0.0,
            "{phase}: {scrape}"
        );
    }
    assert!(phases > 0.0, "{scrape}");
    assert!(phases <= whole, "phases {phases} s, the whole {whole} s");
    // The whole is the handler's part of the HTTP request.
    let http = histogram_part(
        &scrape,
        "http_request_duration_seconds_sum",
        &[("route", "/v1/charges"), ("status", "201")],
    );
    assert!(whole <= http, "operation {whole} s, HTTP {http} s");
}

#[tokio::test]
async fn replays_are_timed_as_replayed_and_one_from_the_cache_only_as_a_whole() {
    let served = Served::start(&[]).await;
    assert_eq!(served.post_charge("again", &visa(100)).await, 201);
    // The first retry reads the key from the database before the core is
    // entered, with whatever other keys are read at that moment (no claim,
    // no connection of its own: no pool wait), and caches it; the second is
    // answered from the cache.
    assert_eq!(served.post_charge("again", &visa(100)).await, 201);
    assert_eq!(served.post_charge("again", &visa(100)).await, 201);
    assert_eq!(served.post_charge("again", &visa(200)).await, 422);
    let scrape = served.metrics().await;
    let replayed = [("route", "/v1/charges"), ("outcome", "replayed")];
    assert_eq!(
        histogram_part(&scrape, "operation_duration_seconds_count", &replayed),
        2.0,
        "{scrape}"
    );
    for (phase, count) in [
        ("key_read", 1.0),
        ("claim", 0.0),
        ("pool_wait", 0.0),
        ("processor", 0.0),
        ("settle", 0.0),
    ] {
        let labels = [replayed[0], ("phase", phase), replayed[1]];
        assert_eq!(
            histogram_part(&scrape, "operation_phase_duration_seconds_count", &labels),
            count,
            "{phase}: {scrape}"
        );
    }
    let reused = [("route", "/v1/charges"), ("outcome", "reused")];
    assert_eq!(
        histogram_part(&scrape, "operation_duration_seconds_count", &reused),
        1.0,
        "{scrape}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_finds_the_pool_exhausted_gets_503_and_is_counted() {
    let app = spawn_app_with(
        Settings::new()
            .set("DATABASE_MAX_CONNECTIONS", 2)
            .set("DATABASE_ACQUIRE_TIMEOUT", "300ms")
            // Longer than the pool's own timeout, which then answers first.
            .set("DATABASE_QUEUE_TIMEOUT", "2s")
            .set("DATABASE_QUEUE_OVERLOAD_TIMEOUT", "2s"),
    )
    .await;
    let timeouts = || async {
        let scrape = app
            .client
            .get(app.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        sample(&scrape, "db_pool_timeouts_total")
    };
    let before = timeouts().await;
    // The test's pool is the server's: holding every connection leaves
    // none for a request.
    let held = [
        app.pool.acquire().await.unwrap(),
        app.pool.acquire().await.unwrap(),
    ];
    let sent = Instant::now();
    let answer = Answer::of(app.post_charge(Some("dry"), &visa(100)).await).await;
    answer.assert_problem(503, "service_unavailable");
    assert_eq!(
        answer.header("retry-after"),
        Some("1"),
        "nothing was claimed"
    );
    assert!(
        sent.elapsed() >= app.config.database.acquire_timeout,
        "it waited DATABASE_ACQUIRE_TIMEOUT for a connection"
    );
    // Other tests in this process may add to the counter too; this one
    // added at least its own.
    assert!(timeouts().await >= before + 1.0);
    drop(held);

    // Nothing was written, and the key is free once the pool is back.
    assert_eq!((app.charges().await, app.keys().await), (0, 0));
    let retry = Answer::of(app.post_charge(Some("dry"), &visa(100)).await).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_the_timeout_gets_a_problem_and_its_work_still_completes() {
    // A processor slower than REQUEST_TIMEOUT, which PROCESSOR_LATENCY_MS
    // may not be.
    let latency = Duration::from_secs(1);
    let app = spawn_app_with(
        Settings::new()
            .set("REQUEST_TIMEOUT", "300ms")
            .processor("PROCESSOR_LATENCY_MS", latency.as_millis()),
    )
    .await;
    let slow = Answer::of(app.post_charge(Some("slow"), &visa(100)).await).await;
    slow.assert_problem(503, "request_timeout");
    assert_eq!(slow.header("retry-after"), Some("1"));
    assert!(slow.json()["request_id"].is_string());
    // The work went on in its own task; a retry gets its result once it is
    // done (409 until then: each retry must itself stay under the timeout).
    // It is done once the processor has answered.
    let deadline = Instant::now() + latency + app.config.request_timeout;
    let retry = loop {
        let retry = Answer::of(app.post_charge(Some("slow"), &visa(100)).await).await;
        if retry.status != 409 || Instant::now() > deadline {
            break retry;
        }
        assert_eq!(retry.header("retry-after"), Some("1"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!((app.charges().await, app.payments().await), (1, 1));
}

#[tokio::test]
async fn the_operational_routes_refuse_unknown_query_parameters_like_every_other_route() {
    let app = spawn_app().await;
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json"] {
        let plain = app.client.get(app.url(path)).send().await.unwrap();
        assert_eq!(plain.status(), 200, "{path}");
        let unknown = Answer::of(
            app.client
                .get(app.url(&format!("{path}?verbose=1")))
                .send()
                .await
                .unwrap(),
        )
        .await;
        unknown.assert_problem(400, "parameter_unknown");
        assert_eq!(unknown.json()["param"], "verbose", "{path}");
        let expand = Answer::of(
            app.client
                .get(app.url(&format!("{path}?expand[]=x")))
                .send()
                .await
                .unwrap(),
        )
        .await;
        expand.assert_problem(400, "property_not_expandable");
    }
}

#[tokio::test]
async fn made_up_methods_neither_grow_the_metrics_nor_reach_a_label_or_the_log() {
    let served = Served::start(&[("RUST_LOG", "info,sqlx=warn")]).await;
    let client = reqwest::Client::new();
    let junk = |i: usize| {
        let name = format!("JUNK{i}{}", "X".repeat(2_000));
        reqwest::Method::from_bytes(name.as_bytes()).unwrap()
    };
    let send = |i: usize| {
        let (client, url) = (&client, &served.url);
        async move {
            for path in ["/v1/charges".to_owned(), format!("/no/such/route/{i}")] {
                let response = client
                    .request(junk(i), format!("{url}{path}"))
                    .send()
                    .await
                    .unwrap();
                assert!(response.status().is_client_error(), "{path}");
            }
        }
    };
    // The first of each kind adds its series; a scrape adds its own.
    send(0).await;
    served.metrics().await;
    let before = served.metrics().await;
    for i in 1..=50 {
        send(i).await;
    }
    let after = served.metrics().await;
    assert!(
        after.len() < before.len() + 1_024,
        "the scrape grew from {} to {} bytes",
        before.len(),
        after.len()
    );
    assert!(!after.contains("JUNK"), "a method became a label");
    assert!(
        after
            .contains(r#"http_requests_total{method="other",route="/v1/charges",status="405"} 51"#),
        "{after}"
    );
    assert!(
        after.contains(r#"http_requests_total{method="other",route="unmatched",status="404"} 51"#),
        "{after}"
    );
    assert!(!served.log().contains("JUNK"), "a method reached the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_refusing_new_connections_is_answered_503_with_retry_after_never_500() {
    use sqlx::Connection;
    let app = spawn_app_with(Settings::new().set("DATABASE_ACQUIRE_TIMEOUT", "2s")).await;
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let admin_url = std::env::var("DATABASE_URL").unwrap();
    let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
    let allow = |allowed: bool| format!("ALTER DATABASE {name} ALLOW_CONNECTIONS {allowed}");
    // No new connection is let in, and every open one is cut: the server's
    // next request must open one, and Postgres refuses it (55000, FATAL).
    sqlx::query(&allow(false))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&name)
        .execute(&mut admin)
        .await
        .unwrap();

    let charge = Answer::of(app.post_charge(Some("refused"), &visa(100)).await).await;
    let list = Answer::of(app.get("/v1/charges").await).await;
    let ready = Answer::of(app.client.get(app.url("/readyz")).send().await.unwrap()).await;
    sqlx::query(&allow(true)).execute(&mut admin).await.unwrap();
    for (what, answer) in [
        ("a charge", &charge),
        ("a list", &list),
        ("/readyz", &ready),
    ] {
        assert_eq!(answer.status, 503, "{what}: {:?}", answer.body);
        answer.assert_problem(503, "service_unavailable");
        assert_eq!(answer.header("retry-after"), Some("1"), "{what}");
        assert_eq!(answer.header("stripe-should-retry"), Some("true"), "{what}");
    }

    // Nothing was written, and the same key charges once the database is back.
    let retry = Answer::of(app.post_charge(Some("refused"), &visa(100)).await).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!((app.charges().await, app.payments().await), (1, 1));
    admin.close().await.unwrap();
}
