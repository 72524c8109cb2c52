//! Failure scenarios against real `oncepay serve` processes: retry storms,
//! lost answers, processor faults, crashes at each point, a database restart
//! under load, three instances on one database. Each scenario measures its
//! row of the reliability report in the database and asserts the invariant:
//! one logical operation, one effect, nothing acknowledged lost.
//!
//! `scripts/chaos` runs these with `CHAOS_SCALE=3` and prints the table.

#[path = "../common/database.rs"]
mod database;
mod harness;
mod waits;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::future::join_all;

use database::TestDb as Database;
use harness::{
    OpOutcome, PrivateCluster, Report, Server, charge_body, client, drive, post, scale, send,
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
    assert_eq!(report.charges, operations as i64);
    assert_eq!(report.five_xx, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_replayed_on_retry() {
    let db = Database::create_empty().await;
    let server = Server::start(&db.url, &[FAULTS_ON]).await;
    let urls = [server.url()];
    let http = client(Duration::from_secs(15));
    let operations = 10 * scale();
    let mut outcomes = Vec::new();
    for op in 0..operations {
        let key = format!("lost-{op}");
        let body = charge_body(&key, 1500, "tok_visa");
        // The first try commits, then the connection closes with no answer.
        let first = send(
            &http,
            &urls[0],
            &key,
            &body,
            &[("Oncepay-Fault", "drop-response")],
        )
        .await;
        assert!(first.is_err(), "no answer on the first try: {first:?}");
        let pool = db.pool().await;
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
        pool.close().await;
        let (status, headers, body_seen) = send(&http, &urls[0], &key, &body, &[]).await.unwrap();
        assert_eq!(status, 201);
        assert_eq!(
            headers.get("idempotent-replayed").map(String::as_str),
            Some("true")
        );
        outcomes.push(OpOutcome {
            key,
            acked: body_seen["id"].as_str().map(str::to_owned),
            definite: Some(status),
            requests: 2,
            ..OpOutcome::default()
        });
    }
    let pool = db.pool().await;
    let report = Report::measure("lost answer, then retry", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.effects, operations as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_timeout_after_capture_ends_succeeded_after_the_sweep() {
    let db = Database::create_empty().await;
    let server = Server::start(
        &db.url,
        &[("PROCESSING_TIMEOUT", "1s"), ("SWEEP_INTERVAL", "300ms")],
    )
    .await;
    let urls = [server.url()];
    let http = client(Duration::from_secs(15));
    let operations = 5 * scale();
    let mut outcomes = Vec::new();
    for op in 0..operations {
        let key = format!("timeout-{op}");
        let body = charge_body(&key, 2500, "tok_processorTimeoutAfterCapture");
        let (status, headers, problem) = send(&http, &urls[0], &key, &body, &[]).await.unwrap();
        assert_eq!(
            (status, problem["code"].as_str()),
            (503, Some("processing_outcome_unknown"))
        );
        assert!(headers.contains_key("retry-after"));
        // Before PROCESSING_TIMEOUT the key is still in flight.
        let (status, _, _) = send(&http, &urls[0], &key, &body, &[]).await.unwrap();
        assert_eq!(status, 409);
        let mut outcome = drive(
            &http,
            &urls,
            &key,
            &body,
            &[],
            Instant::now() + Duration::from_secs(20),
        )
        .await;
        assert_eq!(
            outcome.definite,
            Some(201),
            "the money moved, so the charge succeeded"
        );
        outcome.requests += 2;
        outcome.five_xx += 1;
        outcomes.push(outcome);
    }
    let pool = db.pool().await;
    let report = Report::measure("processor timeout after capture", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.charges, operations as i64);
}

/// Crashes the server at `fault` on every operation, restarts it, and
/// retries; returns the outcomes and the slowest time to a definite answer.
async fn crash_and_recover(
    fault: &'static str,
    source: &str,
) -> (Database, Vec<OpOutcome>, Duration) {
    let db = Database::create_empty().await;
    let mut server = Server::start(
        &db.url,
        &[
            FAULTS_ON,
            ("PROCESSING_TIMEOUT", "2s"),
            ("SWEEP_INTERVAL", "500ms"),
        ],
    )
    .await;
    let http = client(Duration::from_secs(15));
    let mut outcomes = Vec::new();
    let mut slowest = Duration::ZERO;
    for op in 0..3 * scale() {
        let key = format!("{fault}-{op}");
        let body = charge_body(&key, 3000, source);
        let first = send(
            &http,
            &server.url(),
            &key,
            &body,
            &[("Oncepay-Fault", fault)],
        )
        .await;
        assert!(
            first.is_err(),
            "the process died before answering: {first:?}"
        );
        let status = server.wait_exit().await;
        assert!(!status.success(), "aborted, as kill -9 would: {status}");
        server.restart().await;
        let restarted = Instant::now();
        let mut outcome = drive(
            &http,
            &[server.url()],
            &key,
            &body,
            &[],
            restarted + Duration::from_secs(20),
        )
        .await;
        slowest = slowest.max(restarted.elapsed());
        outcome.requests += 1;
        outcomes.push(outcome);
    }
    (db, outcomes, slowest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_claim_is_settled_as_abandoned_and_moves_no_money() {
    let (db, outcomes, slowest) = crash_and_recover("crash-after-claim", "tok_visa").await;
    let pool = db.pool().await;
    let report = Report::measure("crash after claim", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes.iter().all(|o| o.definite == Some(402)),
        "abandoned: {outcomes:?}"
    );
    assert_eq!(report.effects, 0);
    // PROCESSING_TIMEOUT (2 s) plus one sweep (0.5 s), with slack for a loaded machine.
    assert!(
        slowest < Duration::from_secs(5),
        "a definite answer came after {slowest:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_processor_is_settled_as_succeeded() {
    let (db, outcomes, slowest) = crash_and_recover("crash-after-processor", "tok_visa").await;
    let pool = db.pool().await;
    let report = Report::measure("crash after processor", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes.iter().all(|o| o.definite == Some(201)),
        "{outcomes:?}"
    );
    assert_eq!(report.effects, outcomes.len() as i64);
    assert!(
        slowest < Duration::from_secs(5),
        "a definite answer came after {slowest:?}"
    );
}

/// A server whose keys live 2 s and whose stale work is recovered after 1 s,
/// so an outage of 3 s outlasts every key in flight.
const SHORT_TTL: [(&str, &str); 5] = [
    FAULTS_ON,
    ("IDEMPOTENCY_KEY_TTL", "2s"),
    ("PROCESSING_TIMEOUT", "1s"),
    ("REQUEST_TIMEOUT", "800ms"),
    ("SWEEP_INTERVAL", "200ms"),
];
/// How long the server stays down: longer than the keys' TTL.
const OUTAGE_PAST_THE_TTL: Duration = Duration::from_secs(3);

/// Waits until the sweeper has settled every pending charge and refund.
async fn wait_until_settled(pool: &sqlx::PgPool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let pending: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM charges WHERE status = 'pending')
                  + (SELECT count(*) FROM refunds WHERE status = 'pending')",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if pending == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "{pending} still pending");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_settled_after_its_key_expired_is_replayed_and_never_charged_again() {
    let db = Database::create_empty().await;
    let mut server = Server::start(&db.url, &SHORT_TTL).await;
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
        wait_until_settled(&pool).await;
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
        outcomes.push(OpOutcome {
            key: key.clone(),
            acked: Some(charge),
            definite: Some(201),
            requests: 2,
            ..OpOutcome::default()
        });
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
async fn a_refund_settled_after_its_key_expired_is_replayed_and_never_refunded_again() {
    let db = Database::create_empty().await;
    let mut server = Server::start(&db.url, &SHORT_TTL).await;
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let operations = 2 * scale();
    for op in 0..operations {
        let paid = format!("late-refund-charge-{op}");
        let (status, _, charge) = send(
            &http,
            &server.url(),
            &paid,
            &charge_body(&paid, 5000, "tok_visa"),
            &[],
        )
        .await
        .unwrap();
        assert_eq!(status, 201, "{charge}");
        let key = format!("late-refund-{op}");
        let body = serde_json::json!({"charge": charge["id"], "amount": 1500});
        let fault = [("Oncepay-Fault", "crash-after-processor")];
        let first = post(&http, &server.url(), "/v1/refunds", &key, &body, &fault).await;
        assert!(
            first.is_err(),
            "the process died before answering: {first:?}"
        );
        assert!(!server.wait_exit().await.success());
        tokio::time::sleep(OUTAGE_PAST_THE_TTL).await;
        server.restart().await;
        wait_until_settled(&pool).await;

        let (status, headers, answer) = post(&http, &server.url(), "/v1/refunds", &key, &body, &[])
            .await
            .unwrap();
        assert_eq!(status, 201, "{answer}");
        assert_eq!(
            headers.get("idempotent-replayed").map(String::as_str),
            Some("true")
        );
        assert_eq!(answer["status"], "succeeded");
        assert_eq!(answer["amount"], 1500);
    }
    let (refunds, processor_refunds, refunded): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM refunds),
                (SELECT count(*) FROM processor_operations WHERE outcome = 'refunded'),
                (SELECT coalesce(sum(amount_refunded), 0)::bigint FROM charges)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let operations = operations as i64;
    assert_eq!(refunds, operations, "one refund per operation");
    assert_eq!(
        processor_refunds, operations,
        "one processor refund per operation"
    );
    assert_eq!(refunded, 1500 * operations);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_under_load_loses_nothing_and_doubles_nothing() {
    let cluster = PrivateCluster::start();
    let db = Database::create_empty_on(&cluster.admin_url()).await;
    let mut server = Server::start(
        &db.url,
        &[
            ("PROCESSING_TIMEOUT", "1s"),
            ("SWEEP_INTERVAL", "300ms"),
            ("PROCESSOR_LATENCY_MS", "20"),
            ("DATABASE_ACQUIRE_TIMEOUT", "500ms"),
        ],
    )
    .await;
    let urls = [server.url()];
    let http = client(Duration::from_secs(15));
    let deadline = Instant::now() + Duration::from_secs(60);
    let load_until = Instant::now() + Duration::from_secs(5);
    // Eight clients, each running operations one after another.
    let clients = (0..8).map(|c| {
        let (urls, http) = (&urls, &http);
        async move {
            let mut outcomes = Vec::new();
            let mut op = 0;
            while Instant::now() < load_until {
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
        down.elapsed()
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
    // Let the sweeper settle anything the outage left pending.
    wait_until_nothing_pending(&pool).await;
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
    // A request slower than REQUEST_TIMEOUT would be a 5xx: give requests
    // all the time PROCESSING_TIMEOUT allows.
    let settings = [
        ("PROCESSING_TIMEOUT", "1s"),
        ("REQUEST_TIMEOUT", "950ms"),
        ("SWEEP_INTERVAL", "200ms"),
        ("PROCESSOR_LATENCY_MS", "30"),
    ];
    let servers = vec![
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
    ];
    let pool = db.pool().await;
    // Work for the three sweepers: charges a crash left pending long ago.
    let stale = 30;
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

    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let http = client(Duration::from_secs(15));
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

    wait_until_nothing_pending(&pool).await;
    let report = Report::measure("three instances, one database", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.five_xx, 0, "no 5xx: {report:?}");
    assert_eq!(report.charges, operations as i64);

    // Each stale row was settled by exactly one sweeper.
    let mut settled: HashMap<String, usize> = HashMap::new();
    for server in &servers {
        for line in server
            .log_text()
            .lines()
            .filter(|l| l.contains("settled a stale charge"))
        {
            if let Some(id) = line
                .split("charge=")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
            {
                *settled.entry(id.to_owned()).or_default() += 1;
            }
        }
    }
    let twice: Vec<_> = settled.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "settled more than once: {twice:?}");
    let stale_settled = settled
        .keys()
        .filter(|id| id.starts_with("ch_stale"))
        .count();
    assert_eq!(
        stale_settled, stale as usize,
        "every stale row settled once: {settled:?}"
    );
}

/// Waits (up to ten seconds) until the sweepers have settled every pending charge.
async fn wait_until_nothing_pending(pool: &sqlx::PgPool) {
    let settle_by = Instant::now() + Duration::from_secs(10);
    loop {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM charges WHERE status = 'pending'")
                .fetch_one(pool)
                .await
                .unwrap();
        if pending == 0 {
            return;
        }
        assert!(
            Instant::now() < settle_by,
            "{pending} pending charges were never settled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Folds the outcomes of several drivers of the same operation into one per
/// operation: requests and 5xx add up; acknowledgements must agree.
fn merge(outcomes: Vec<OpOutcome>) -> Vec<OpOutcome> {
    let mut by_key: HashMap<String, OpOutcome> = HashMap::new();
    for o in outcomes {
        let entry = by_key.entry(o.key.clone()).or_insert_with(|| OpOutcome {
            key: o.key.clone(),
            ..OpOutcome::default()
        });
        entry.requests += o.requests;
        entry.five_xx += o.five_xx;
        entry.hung += o.hung;
        match (&entry.acked, &o.acked) {
            (Some(a), Some(b)) => {
                assert_eq!(a, b, "two different charges acknowledged for {}", o.key)
            }
            (None, Some(b)) => entry.acked = Some(b.clone()),
            _ => {}
        }
        if o.definite.is_some() {
            entry.definite = o.definite;
        } else if entry.definite.is_none() {
            entry.definite = None;
        }
    }
    let mut merged: Vec<_> = by_key.into_values().collect();
    merged.sort_by(|a, b| a.key.cmp(&b.key));
    merged
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_requests_in_flight_finish_and_leaves_nothing_half_done() {
    let db = Database::create_empty().await;
    let mut server = Server::start(
        &db.url,
        &[("PROCESSOR_LATENCY_MS", "1500"), ("SHUTDOWN_GRACE", "10s")],
    )
    .await;
    let url = server.url();
    let http = client(Duration::from_secs(20));
    let requests = (0..10).map(|i| {
        let (http, url) = (&http, &url);
        async move {
            let key = format!("term-{i}");
            let answer = send(http, url, &key, &charge_body(&key, 100, "tok_visa"), &[]).await;
            (key, answer.map(|(status, _, body)| (status, body)))
        }
    });
    let signal = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        server.terminate();
        // A request after the signal finds the door closed.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let key = "term-late".to_owned();
        let answer = send(&http, &url, &key, &charge_body(&key, 100, "tok_visa"), &[]).await;
        (key, answer.map(|(status, _, body)| (status, body)))
    };
    let (mut answers, late) = tokio::join!(join_all(requests), signal);
    assert!(late.1.is_err(), "refused after SIGTERM: {:?}", late.1);
    answers.push(late);
    let status = server.wait_exit().await;
    assert!(
        status.success(),
        "a clean exit: {status}\n{}",
        server.log_text()
    );

    let pool = db.pool().await;
    for (key, answer) in &answers {
        let stored: Option<(String, Option<String>)> = sqlx::query_as(
            "SELECT k.status, c.status FROM idempotency_keys k LEFT JOIN charges c ON c.id = k.charge_id
              WHERE k.key = $1",
        )
        .bind(key)
        .fetch_optional(&pool)
        .await
        .unwrap();
        match answer {
            // In flight at the signal: it finished, and its answer is what is stored.
            Ok((201, body)) => {
                assert_eq!(
                    stored,
                    Some(("completed".into(), Some("succeeded".into()))),
                    "{key}"
                );
                let id: Option<String> =
                    sqlx::query_scalar("SELECT charge_id FROM idempotency_keys WHERE key = $1")
                        .bind(key)
                        .fetch_one(&pool)
                        .await
                        .unwrap();
                assert_eq!(body["id"].as_str(), id.as_deref());
            }
            // Refused at the door: never claimed.
            Err(_) => assert_eq!(stored, None, "{key}"),
            Ok((status, body)) => panic!("{key}: {status} {body}"),
        }
    }
    assert!(
        answers.iter().any(|(_, a)| matches!(a, Ok((201, _)))),
        "some were in flight"
    );
    let half_done: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM idempotency_keys WHERE status = 'processing')
              + (SELECT count(*) FROM charges WHERE status = 'pending')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(half_done, 0);
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
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = server.log_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let settled = lines
        .iter()
        .find(|l| l["message"] == "charge settled")
        .unwrap_or_else(|| panic!("no settle line in {log}"));
    let span = &settled["span"];
    assert_eq!(span["request_id"], "req-log-1", "{settled}");
    assert_eq!(span["route"], "/v1/charges");
    assert_eq!(span["idempotency_key"], "log-me");
    assert!(span["merchant"].is_string());
    assert!(
        !log.contains(harness::API_KEY),
        "the API key never reaches the log"
    );
    assert!(!log.to_lowercase().contains("authorization"));
}
