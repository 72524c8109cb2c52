//! Failure scenarios against real `oncepay serve` processes: retry storms,
//! lost answers, processor faults, crashes at each point, a database restart
//! under load, three instances on one database, refunds under the same
//! faults, charges and refunds killed at each point of their settle, and
//! the webhook boundary (a worker killed after the receiver answered, a
//! receiver down for a while, three instances delivering), and hundreds of
//! connections that never finish their request head, and the wire between
//! oncepay and the card gateway (answers dropped after the money moved, a
//! gateway slower than the call's timeout, killed mid-call, down for longer
//! than `PROCESSING_TIMEOUT`), a Postgres failover (a primary and its
//! standby in one multi-host `DATABASE_URL`), and a fleet behind HAProxy on
//! a Postgres that fails over (`scripts/cluster`): its primary, one
//! instance, its standby killed under load.
//! Each scenario measures its row of the reliability report in the database
//! and asserts the invariant: one logical operation, one effect, nothing
//! acknowledged lost, one answer per operation and true to the database,
//! every change paired with its event (no event without its change, no
//! change without its event), and every event delivered, and shipped once by
//! an inbox receiver. Every deadline is derived from the servers' settings.
//!
//! `scripts/chaos` runs these with `CHAOS_SCALE=3` and prints the table.

mod broker;
mod connections;
#[path = "../common/database.rs"]
mod database;
mod failover;
mod fleet;
mod gateway;
mod harness;
mod late_claims;
mod pairing;
mod proxy;
mod refunds;
mod waits;
mod webhooks;
mod wire;

use std::time::{Duration, Instant};

use futures::future::join_all;

use database::TestDb as Database;
use harness::{
    Answer, OpOutcome, PrivateCluster, Report, SLACK, Server, Timing, assert_events_paired,
    charge_body, client, crash_each, drive, eventually, merge, metric, processor_pool, scale, send,
    setting, wait_until_settled,
};

const FAULTS_ON: (&str, &str) = ("FAULT_INJECTION", "true");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_storm_on_one_key_per_operation_charges_each_once() {
    let db = Database::create_empty().await;
    let server = Server::start(&db.url, &[("PROCESSOR_LATENCY_MS", "100")]).await;
    let urls = [server.url()];
    let http = client(Duration::from_secs(15));
    let deadline = Instant::now() + Duration::from_secs(60);
    let operations = 20 * scale();
    // Five copies of every operation in flight at once.
    let drivers = (0..operations).flat_map(|op| {
        let (urls, http) = (&urls, &http);
        (0..5).map(move |_| async move {
            let key = format!("storm-{op}");
            drive(
                http,
                urls,
                &key,
                &charge_body(&key, 1000, "tok_visa"),
                &[],
                deadline,
            )
            .await
        })
    });
    let outcomes = merge(join_all(drivers).await);

    let pool = db.pool().await;
    let report = Report::measure("retry storm, one instance", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, operations as i64);
    assert_eq!(report.five_xx, 0);
    assert!(
        outcomes.iter().all(|o| o.answers.len() == 5),
        "every copy got its answer"
    );
    assert!(
        outcomes.iter().any(|o| o.in_use > 0),
        "copies of one operation were in flight together"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_replayed_on_retry() {
    let db = Database::create_empty().await;
    let server = Server::start(&db.url, &[FAULTS_ON]).await;
    let url = server.url();
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let operations = 10 * scale();
    let mut outcomes = Vec::new();
    for op in 0..operations {
        let key = format!("lost-{op}");
        let body = charge_body(&key, 1500, "tok_visa");
        // The first try commits, then the connection closes with no answer.
        let first = send(
            &http,
            &url,
            &key,
            &body,
            &[("Oncepay-Fault", "drop-response")],
        )
        .await;
        assert!(first.is_err(), "no answer on the first try: {first:?}");
        let committed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM charges WHERE metadata->>'op' = $1 AND status = 'succeeded'",
        )
        .bind(&key)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            committed, 1,
            "the work was committed before the answer was lost"
        );
        let (status, headers, answer) = send(&http, &url, &key, &body, &[]).await.unwrap();
        assert_eq!(status, 201, "{answer}");
        assert_eq!(
            headers.get("idempotent-replayed").map(String::as_str),
            Some("true")
        );
        let mut outcome = OpOutcome::new(&key, &key);
        outcome.requests = 2;
        outcome.answered(status, &answer);
        outcomes.push(outcome);
    }
    let report = Report::measure("lost answer, then retry", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.effects, operations as i64);
}

/// The charge of operation `op`: its status, or `None` while there is none.
async fn charge_status(pool: &sqlx::PgPool, op: &str) -> Option<String> {
    sqlx::query_scalar("SELECT status FROM charges WHERE metadata->>'op' = $1")
        .bind(op)
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_timeout_after_capture_ends_succeeded_after_the_sweep() {
    let db = Database::create_empty().await;
    let timing = Timing {
        processing_timeout: Duration::from_secs(3),
        sweep_interval: Duration::from_millis(300),
    };
    let server = Server::start(&db.url, &timing.env()).await;
    let url = server.url();
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let operations = 5 * scale();
    // The operations run side by side; each client sends no retry until the
    // sweeper has settled its charge, so only the sweeper can settle it.
    let outcomes = join_all((0..operations).map(|op| {
        let (http, url, pool) = (&http, &url, &pool);
        async move {
            let key = format!("timeout-{op}");
            let body = charge_body(&key, 2500, "tok_processorTimeoutAfterCapture");
            let sent = Instant::now();
            let (status, headers, problem) = send(http, url, &key, &body, &[]).await.unwrap();
            assert_eq!(
                (status, problem["code"].as_str()),
                (503, Some("processing_outcome_unknown"))
            );
            // PROCESSING_TIMEOUT plus one SWEEP_INTERVAL, in whole seconds.
            assert_eq!(headers.get("retry-after").map(String::as_str), Some("4"));
            // Before PROCESSING_TIMEOUT the key is still in flight.
            assert!(
                sent.elapsed() < timing.processing_timeout,
                "the first answer took longer than PROCESSING_TIMEOUT"
            );
            let (status, _, _) = send(http, url, &key, &body, &[]).await.unwrap();
            assert_eq!(status, 409);
            let settled = eventually(
                sent + timing.recovered_within(),
                "the sweeper settled the charge",
                || async {
                    charge_status(pool, &key)
                        .await
                        .filter(|status| status != "pending")
                },
            )
            .await;
            assert_eq!(settled, "succeeded", "the money moved");
            let (status, headers, answer) = send(http, url, &key, &body, &[]).await.unwrap();
            assert_eq!(status, 201, "{answer}");
            assert_eq!(
                headers.get("idempotent-replayed").map(String::as_str),
                Some("true")
            );
            let mut outcome = OpOutcome::new(&key, &key);
            outcome.requests = 3;
            outcome.five_xx = 1;
            outcome.in_use = 1;
            outcome.answered(status, &answer);
            outcome
        }
    }))
    .await;
    let report = Report::measure("processor timeout after capture", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, operations as i64);
    assert_eq!(
        metric(
            &http,
            &url,
            r#"sweeper_settled_total{outcome="charge_succeeded"}"#
        )
        .await,
        operations as f64,
        "the sweeper settled every charge"
    );
    assert_eq!(
        metric(
            &http,
            &url,
            r#"idempotency_outcomes_total{outcome="stale_recovered"}"#
        )
        .await,
        0.0,
        "no retry settled one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_timeout_after_capture_is_settled_by_a_retry_once_its_key_is_stale() {
    let db = Database::create_empty().await;
    // The sweeper's first pass would come after an hour: only retries settle.
    let processing_timeout = Duration::from_secs(2);
    let server = Server::start(
        &db.url,
        &[
            ("PROCESSING_TIMEOUT", setting(processing_timeout)),
            ("SWEEP_INTERVAL", "1h".into()),
        ],
    )
    .await;
    let urls = [server.url()];
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let operations = 5 * scale();
    let outcomes = join_all((0..operations).map(|op| {
        let (http, urls) = (&http, &urls);
        async move {
            let key = format!("timeout-retry-{op}");
            let body = charge_body(&key, 2500, "tok_processorTimeoutAfterCapture");
            let sent = Instant::now();
            let (status, _, problem) = send(http, &urls[0], &key, &body, &[]).await.unwrap();
            assert_eq!(
                (status, problem["code"].as_str()),
                (503, Some("processing_outcome_unknown"))
            );
            // 409 until the key is stale, then the retry settles it itself.
            let deadline = sent + processing_timeout + SLACK;
            let mut outcome = drive(http, urls, &key, &body, &[], deadline).await;
            outcome.requests += 1;
            outcome.five_xx += 1;
            outcome
        }
    }))
    .await;
    let report = Report::measure("processor timeout, settled by a retry", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes
            .iter()
            .all(|o| o.definite() == Some(201) && o.in_use > 0),
        "a 409 while in flight, then the charge, succeeded: {outcomes:?}"
    );
    assert_eq!(
        metric(
            &http,
            &urls[0],
            r#"idempotency_outcomes_total{outcome="stale_recovered"}"#
        )
        .await,
        operations as f64,
        "a retry settled every charge"
    );
    assert_eq!(
        metric(&http, &urls[0], "sweeper_runs_total").await,
        0.0,
        "the sweeper never ran"
    );
}

/// The settings of the crash scenarios.
const CRASH_TIMING: Timing = Timing {
    processing_timeout: Duration::from_secs(2),
    sweep_interval: Duration::from_millis(500),
};

/// Crashes the server at `fault` on every charge, restarts it, and retries
/// each until a definite answer, within the time recovery takes.
async fn crash_charges(fault: &'static str, source: &str) -> (Database, Vec<OpOutcome>) {
    let db = Database::create_empty().await;
    let mut settings = CRASH_TIMING.env();
    settings.push((FAULTS_ON.0, FAULTS_ON.1.into()));
    let mut server = Server::start(&db.url, &settings).await;
    let operations: Vec<_> = (0..3 * scale())
        .map(|op| {
            let key = format!("{fault}-{op}");
            let body = charge_body(&key, 3000, source);
            (key, body)
        })
        .collect();
    let (outcomes, slowest) =
        crash_each(&mut server, "/v1/charges", &operations, fault, CRASH_TIMING).await;
    eprintln!("{fault}: the slowest definite answer came {slowest:?} after a restart");
    (db, outcomes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_claim_is_settled_as_abandoned_and_moves_no_money() {
    let (db, outcomes) = crash_charges("crash-after-claim", "tok_visa").await;
    let pool = db.pool().await;
    let report = Report::measure("crash after claim", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes.iter().all(|o| o.definite() == Some(402)),
        "abandoned: {outcomes:?}"
    );
    assert_eq!(report.effects, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_processor_is_settled_as_succeeded() {
    let (db, outcomes) = crash_charges("crash-after-processor", "tok_visa").await;
    let pool = db.pool().await;
    let report = Report::measure("crash after processor", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes.iter().all(|o| o.definite() == Some(201)),
        "{outcomes:?}"
    );
    assert_eq!(report.effects, outcomes.len() as i64);
}

/// How long keys live in the late-settle scenarios.
const SHORT_TTL: Duration = Duration::from_secs(2);
/// The recovery settings of the late-settle scenarios: stale work is
/// recovered well within the keys' lifetime.
const SHORT_TTL_TIMING: Timing = Timing {
    processing_timeout: Duration::from_secs(1),
    sweep_interval: Duration::from_millis(200),
};

/// A server whose keys live [`SHORT_TTL`].
fn short_ttl_settings() -> Vec<(&'static str, String)> {
    let mut settings = SHORT_TTL_TIMING.env();
    settings.extend([
        (FAULTS_ON.0, FAULTS_ON.1.to_owned()),
        ("IDEMPOTENCY_KEY_TTL", setting(SHORT_TTL)),
        ("REQUEST_TIMEOUT", "800ms".to_owned()),
    ]);
    settings
}

/// How long the server stays down: longer than the keys' TTL.
const OUTAGE_PAST_THE_TTL: Duration = SHORT_TTL.saturating_add(Duration::from_secs(1));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_settled_after_its_key_expired_is_replayed_and_never_charged_again() {
    let db = Database::create_empty().await;
    let mut server = Server::start(&db.url, &short_ttl_settings()).await;
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let mut outcomes = Vec::new();
    for op in 0..3 * scale() {
        let key = format!("late-settle-{op}");
        let body = charge_body(&key, 4000, "tok_visa");
        let fault = [("Oncepay-Fault", "crash-after-processor")];
        let first = send(&http, &server.url(), &key, &body, &fault).await;
        assert!(
            first.is_err(),
            "the process died before answering: {first:?}"
        );
        assert!(!server.wait_exit().await.success());
        // Down for longer than the key lives: when the charge is settled,
        // the key's original expiry is already in the past.
        tokio::time::sleep(OUTAGE_PAST_THE_TTL).await;
        server.restart().await;
        wait_until_settled(&pool, Instant::now() + SHORT_TTL_TIMING.recovered_within()).await;
        let charge: String = sqlx::query_scalar(
            "SELECT id FROM charges WHERE metadata->>'op' = $1 AND status = 'succeeded'",
        )
        .bind(&key)
        .fetch_one(&pool)
        .await
        .unwrap();

        let (status, headers, answer) = send(&http, &server.url(), &key, &body, &[]).await.unwrap();
        assert_eq!(status, 201, "{answer}");
        assert_eq!(
            headers.get("idempotent-replayed").map(String::as_str),
            Some("true")
        );
        assert_eq!(
            answer["id"],
            charge.as_str(),
            "the retry gets the settled charge"
        );
        let mut outcome = OpOutcome::new(&key, &key);
        outcome.requests = 2;
        outcome.answered(status, &answer);
        outcomes.push(outcome);
    }
    let report = Report::measure("late settle, down past the TTL", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(
        report.effects,
        outcomes.len() as i64,
        "one payment per operation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_under_load_loses_nothing_and_doubles_nothing() {
    let cluster = PrivateCluster::start();
    let db = Database::create_empty_on(&cluster.admin_url()).await;
    let timing = Timing {
        processing_timeout: Duration::from_secs(1),
        sweep_interval: Duration::from_millis(300),
    };
    let mut settings = timing.env();
    settings.extend([
        ("PROCESSOR_LATENCY_MS", "20".to_owned()),
        ("DATABASE_ACQUIRE_TIMEOUT", "500ms".to_owned()),
    ]);
    let mut server = Server::start(&db.url, &settings).await;
    let urls = [server.url()];
    let http = client(Duration::from_secs(15));
    let deadline = Instant::now() + Duration::from_secs(60);
    // The load goes on until the database has been back for a second.
    let (back_tx, back) = tokio::sync::watch::channel(false);
    // Eight clients, each running operations one after another.
    let clients = (0..8).map(|c| {
        let (urls, http, back) = (&urls, &http, back.clone());
        async move {
            let mut outcomes = Vec::new();
            let mut op = 0;
            while !*back.borrow() {
                let key = format!("db-{c}-{op}");
                outcomes.push(
                    drive(
                        http,
                        urls,
                        &key,
                        &charge_body(&key, 700, "tok_visa"),
                        &[],
                        deadline,
                    )
                    .await,
                );
                op += 1;
            }
            outcomes
        }
    });
    let outage = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let down = Instant::now();
        tokio::task::block_in_place(|| cluster.stop());
        tokio::time::sleep(Duration::from_millis(2500)).await;
        tokio::task::block_in_place(|| cluster.start_again());
        let downtime = down.elapsed();
        tokio::time::sleep(Duration::from_secs(1)).await;
        back_tx.send(true).unwrap();
        downtime
    };
    let (outcomes, downtime) = tokio::join!(join_all(clients), outage);
    let outcomes: Vec<OpOutcome> = outcomes.into_iter().flatten().collect();

    assert!(
        server.alive(),
        "the service survived the outage: {}",
        server.log_text()
    );
    // It serves again without a restart of its own.
    let ready = http
        .get(format!("{}/readyz", server.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let pool = db.pool().await;
    // The sweeper settles anything the outage left pending.
    wait_until_settled(&pool, Instant::now() + timing.recovered_within()).await;
    let report = Report::measure("database restart under load", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        report.five_xx > 0,
        "the outage ({downtime:?}) was seen as 503s: {report:?}"
    );
    pool.close().await;
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_database_charge_each_key_once_and_sweep_each_row_once() {
    let db = Database::create_empty().await;
    // Small batches, so that the stale backlog takes many passes and the
    // three sweepers share it; and a PROCESSING_TIMEOUT no live request
    // comes near, so the sweepers lease the stale rows and nothing else.
    let batch = 4;
    let passes = 12;
    let stale = batch * passes;
    // Its half, the default REQUEST_TIMEOUT, leaves room for three servers
    // and their clients sharing two cores.
    let timing = Timing {
        processing_timeout: Duration::from_secs(10),
        sweep_interval: Duration::from_millis(100),
    };
    let mut settings = timing.env();
    settings.extend([
        ("SWEEP_BATCH_SIZE", batch.to_string()),
        ("PROCESSOR_LATENCY_MS", "30".to_owned()),
    ]);
    let servers = [
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
    ];
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let http = client(Duration::from_secs(15));
    let pool = db.pool().await;
    // Work for the three sweepers: charges a crash left pending long ago.
    let merchant: uuid::Uuid = sqlx::query_scalar("SELECT id FROM merchants WHERE name = 'demo'")
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::query(
        "WITH c AS (
             INSERT INTO charges (id, merchant_id, amount, currency, source, metadata, status, created_at)
             SELECT 'ch_stale' || lpad(i::text, 20, '0'), $1, 100, 'usd', 'tok_visa',
                    jsonb_build_object('op', 'stale-' || i), 'pending', now() - interval '1 minute'
               FROM generate_series(1, $2) i
             RETURNING id)
         INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path, fingerprint,
                                       charge_id, created_at, locked_at, expires_at)
         SELECT $1, 'stale-' || id, 'processing', 'POST', '/v1/charges', sha256(id::bytea), id,
                now() - interval '1 minute', now() - interval '1 minute', now() + interval '1 day'
           FROM c",
    )
    .bind(merchant)
    .bind(stale)
    .execute(&pool)
    .await
    .unwrap();

    let deadline = Instant::now() + Duration::from_secs(60);
    let operations = 30 * scale();
    // Every operation is sent by three clients at once, each starting at a
    // different instance.
    let drivers = (0..operations).flat_map(|op| {
        let (urls, http) = (&urls, &http);
        (0..3).map(move |start| async move {
            let rotated: Vec<String> = urls
                .iter()
                .cycle()
                .skip(start + op)
                .take(urls.len())
                .cloned()
                .collect();
            let key = format!("multi-{op}");
            drive(
                http,
                &rotated,
                &key,
                &charge_body(&key, 900, "tok_visa"),
                &[],
                deadline,
            )
            .await
        })
    });
    let outcomes = merge(join_all(drivers).await);

    // The backlog needs `passes` passes of one sweeper or another.
    let swept_by = Instant::now() + timing.sweep_interval * passes as u32 + SLACK;
    wait_until_settled(&pool, swept_by).await;
    let report = Report::measure("three instances, one database", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.five_xx, 0, "no 5xx: {report:?}");
    assert_eq!(report.succeeded, operations as i64);
    assert!(
        outcomes.iter().any(|o| o.in_use > 0),
        "clients of one operation met at different instances"
    );

    // Each stale row was voided and settled, once, with its key.
    let abandoned: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM charges c JOIN idempotency_keys k ON k.charge_id = c.id
          WHERE c.id LIKE 'ch\\_stale%' AND c.status = 'failed'
            AND c.failure_code = 'processing_abandoned'
            AND k.status = 'completed' AND k.response_status = 402",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let voids: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE key LIKE 'auth:ch\\_stale%' AND kind = 'void'",
    )
    .fetch_one(&processor_pool(&pool).await)
    .await
    .unwrap();
    assert_eq!((abandoned, voids), (stale, stale));

    // What each sweeper did, from its own counters. A pass records them
    // when it ends: once the settles add up, two more passes of every
    // sweeper have ended, so none is still counting.
    let sum = |series: &'static str| {
        let (http, urls) = (&http, &urls);
        async move {
            let mut values = Vec::new();
            for url in urls {
                values.push(metric(http, url, series).await as i64);
            }
            values
        }
    };
    let settled = r#"sweeper_settled_total{outcome="charge_failed"}"#;
    eventually(swept_by, "the sweepers counted every settle", || async {
        (sum(settled).await.iter().sum::<i64>() >= stale).then_some(())
    })
    .await;
    let runs = sum("sweeper_runs_total").await;
    eventually(
        Instant::now() + timing.sweep_interval * 2 + SLACK,
        "every sweeper ran two more passes",
        || async {
            let now = sum("sweeper_runs_total").await;
            now.iter()
                .zip(&runs)
                .all(|(n, r)| n >= &(r + 2))
                .then_some(())
        },
    )
    .await;
    let leased = sum("sweeper_leased_total").await;
    let settled = sum(settled).await;
    let live = sum(r#"sweeper_settled_total{outcome="charge_succeeded"}"#).await;
    eprintln!("{stale} stale rows, batches of {batch}: leased {leased:?}, settled {settled:?}");
    assert_eq!(
        leased.iter().sum::<i64>(),
        stale,
        "each stale row leased once, by one sweeper: {leased:?}"
    );
    assert_eq!(
        settled.iter().sum::<i64>(),
        stale,
        "each stale row settled once: {settled:?}"
    );
    assert!(
        leased.iter().filter(|n| **n > 0).count() >= 2,
        "the sweepers shared the backlog: {leased:?}"
    );
    assert_eq!(live, [0, 0, 0], "no live request was swept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_requests_in_flight_finish_and_leaves_nothing_half_done() {
    let db = Database::create_empty().await;
    let latency = Duration::from_secs(3);
    let mut server = Server::start(
        &db.url,
        &[
            ("PROCESSOR_LATENCY_MS", latency.as_millis().to_string()),
            ("SHUTDOWN_GRACE", "10s".to_owned()),
        ],
    )
    .await;
    let url = server.url();
    let port = server.port;
    let pool = db.pool().await;
    let http = client(Duration::from_secs(20));
    let in_flight = 10;
    let requests = (0..in_flight).map(|i| {
        let (http, url) = (&http, &url);
        async move {
            let key = format!("term-{i}");
            let answer = send(http, url, &key, &charge_body(&key, 100, "tok_visa"), &[]).await;
            (key, answer.map(|(status, _, body)| (status, body)))
        }
    });
    let signal = async {
        // Every request has claimed its key and is at the processor, where
        // each stays for the processor's latency.
        let sent = Instant::now();
        eventually(
            sent + latency,
            "every request is at the processor",
            || async {
                let claimed: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM idempotency_keys k JOIN charges c ON c.id = k.charge_id
                      WHERE k.status = 'processing' AND c.status = 'pending'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                (claimed == in_flight).then_some(())
            },
        )
        .await;
        server.terminate();
        // The door closes at once, while the requests are still at work.
        let signalled = Instant::now();
        eventually(signalled + latency, "the listener is closed", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
                .then_some(())
        })
        .await;
        let key = "term-late".to_owned();
        let answer = send(&http, &url, &key, &charge_body(&key, 100, "tok_visa"), &[]).await;
        (key, answer.map(|(status, _, body)| (status, body)))
    };
    let (answers, late) = tokio::join!(join_all(requests), signal);
    assert!(late.1.is_err(), "refused after SIGTERM: {:?}", late.1);
    let status = server.wait_exit().await;
    assert!(
        status.success(),
        "a clean exit: {status}\n{}",
        server.log_text()
    );

    // In flight at the signal: each finished, and its answer is what is stored.
    for (key, answer) in &answers {
        let (status, body) = answer.as_ref().unwrap();
        assert_eq!(*status, 201, "{key}: {body}");
        let stored: (String, Option<String>, Option<String>) = sqlx::query_as(
            "SELECT k.status, c.status, k.charge_id FROM idempotency_keys k
               LEFT JOIN charges c ON c.id = k.charge_id
              WHERE k.key = $1",
        )
        .bind(key)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            stored,
            (
                "completed".into(),
                Some("succeeded".into()),
                body["id"].as_str().map(str::to_owned)
            ),
            "{key}"
        );
    }
    // Refused at the door: never claimed.
    let late_claims: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
            .bind(&late.0)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(late_claims, 0);
    let half_done: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM idempotency_keys WHERE status = 'processing')
              + (SELECT count(*) FROM charges WHERE status = 'pending')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(half_done, 0);
    assert_events_paired(&pool).await;
    let log = server.log_text();
    assert!(
        log.contains("shutting down") && log.contains("stopped"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_request_id_merchant_route_and_key_but_never_the_api_key() {
    let db = Database::create_empty().await;
    let server = Server::start(&db.url, &[("LOG_FORMAT", "json")]).await;
    let http = client(Duration::from_secs(10));
    let response = http
        .post(format!("{}/v1/charges", server.url()))
        .bearer_auth(harness::API_KEY)
        .header("Idempotency-Key", "log-me")
        .header("X-Request-Id", "req-log-1")
        .json(&charge_body("log-me", 100, "tok_visa"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let settled = eventually(
        Instant::now() + SLACK,
        "the log has the settle line",
        || async {
            server.log_text().lines().find_map(|line| {
                let line: serde_json::Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                (line["message"] == "charge settled").then_some(line)
            })
        },
    )
    .await;
    let span = &settled["span"];
    assert_eq!(span["request_id"], "req-log-1", "{settled}");
    assert_eq!(span["route"], "/v1/charges");
    assert_eq!(span["idempotency_key"], "log-me");
    assert!(span["merchant"].is_string());
    let log = server.log_text();
    assert!(
        !log.contains(harness::API_KEY),
        "the API key never reaches the log"
    );
    assert!(!log.to_lowercase().contains("authorization"));
    assert_events_paired(&db.pool().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_counts_unreadable_or_foreign_acknowledgements_as_lost_and_disagreements_as_wrong()
 {
    let db = Database::create().await;
    let pool = db.pool().await;
    sqlx::query(
        "WITH m AS (INSERT INTO merchants (id, name, api_key_hash)
                    VALUES (gen_random_uuid(), 'report', sha256('report'::bytea)) RETURNING id)
         INSERT INTO charges (id, merchant_id, amount, currency, source, metadata, status, failure_code)
         SELECT c.id, m.id, 100, 'usd', 'tok_visa', jsonb_build_object('op', c.op), c.status, c.code
           FROM m, (VALUES ('ch_a', 'a', 'succeeded', NULL),
                           ('ch_b', 'b', 'succeeded', NULL),
                           ('ch_c', 'c', 'failed', 'card_declined')) AS c(id, op, status, code)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let outcome = |op: &str, answers: &[(u16, Option<&str>)]| OpOutcome {
        answers: answers
            .iter()
            .map(|(status, id)| Answer {
                status: *status,
                id: id.map(str::to_owned),
                state: None,
            })
            .collect(),
        requests: 1,
        ..OpOutcome::new(op, op)
    };
    let sound = [
        outcome("a", &[(201, Some("ch_a")), (201, Some("ch_a"))]),
        outcome("c", &[(402, Some("ch_c"))]),
    ];
    let report = Report::measure("sound", &pool, &sound).await;
    assert_eq!((report.lost, report.wrong, report.undecided), (0, 0, 0));

    let unsound = [
        // A 201 whose body named no charge.
        outcome("x", &[(201, None)]),
        // A 201 naming another operation's charge.
        outcome("a2", &[(201, Some("ch_a"))]),
        // Two clients of one operation: a charge, and a refusal.
        outcome("b", &[(201, Some("ch_b")), (402, Some("ch_b"))]),
        // A refusal naming a charge that succeeded.
        outcome("a3", &[(402, Some("ch_a"))]),
        outcome("undecided", &[]),
    ];
    let report = Report::measure("unsound", &pool, &unsound).await;
    assert_eq!(
        (report.lost, report.wrong, report.undecided),
        (2, 2, 1),
        "{report:?}"
    );
}
