//! The wire between oncepay and the card gateway, broken on purpose: the
//! gateway takes the money and its answer is dropped, it answers later than
//! oncepay's per-call timeout, it is killed (`SIGKILL`) with calls in
//! flight, and it stays down for longer than `PROCESSING_TIMEOUT`. Each
//! charge's processor call carries one processor key, whoever repeats it
//! (oncepay's client, a retry that finds the key stale, the sweeper), so the
//! gateway's ledger holds one payment per charge whatever the wire did.
//!
//! The faults are asked for with `Oncepay-Fault: processor-<fault>`, which
//! oncepay sends on to the gateway as `Processor-Fault: <fault>`.

use std::time::{Duration, Instant};

use futures::future::join_all;
use sqlx::PgPool;

use crate::FAULTS_ON;
use crate::database::TestDb as Database;
use crate::harness::{
    OpOutcome, Report, Server, Timing, charge_body, client, drive, eventually, metric,
    processor_pool, scale, send, setting,
};

/// Payments the gateway recorded (money moved), read from its own ledger.
async fn payments(ledger: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE kind = 'authorization' AND outcome = 'succeeded'",
    )
    .fetch_one(ledger)
    .await
    .unwrap()
}

/// Charges in `status`, in oncepay's database.
async fn charges(pool: &PgPool, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges WHERE status = $1")
        .bind(status)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// How many times the gateway applied `fault`, from its own `/metrics`.
async fn faults_applied(http: &reqwest::Client, gateway: &str, fault: &str) -> f64 {
    metric(
        http,
        gateway,
        &format!("gateway_faults_total{{fault=\"{fault}\"}}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_whose_answer_is_dropped_is_asked_again_under_its_key_and_charged_once() {
    let db = Database::create_empty().await;
    let server = Server::start(&db.url, &[FAULTS_ON]).await;
    let urls = [server.url()];
    let gateway = server.processor.as_ref().expect("its own gateway").url();
    let http = client(Duration::from_secs(15));
    let deadline = Instant::now() + Duration::from_secs(60);
    let operations = 10 * scale();
    // Every other charge: the gateway records the payment, then closes the
    // connection unanswered; oncepay asks again under the same key.
    let outcomes = join_all((0..operations).map(|op| {
        let (urls, http) = (&urls, &http);
        async move {
            let key = format!("dropped-{op}");
            let fault: &[(&str, &str)] = if op % 2 == 0 {
                &[("Oncepay-Fault", "processor-drop-after-record")]
            } else {
                &[]
            };
            let body = charge_body(&key, 1200, "tok_visa");
            drive(http, urls, &key, &body, fault, deadline).await
        }
    }))
    .await;

    let pool = db.pool().await;
    let report = Report::measure("processor answer dropped", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, operations as i64);
    assert_eq!(
        faults_applied(&http, &gateway, "drop-after-record").await,
        operations.div_ceil(2) as f64,
        "the gateway dropped the answer of every other payment"
    );
    assert_eq!(
        (report.requests, report.five_xx),
        (operations as u64, 0),
        "oncepay's own repeat got the answer within each request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_dropped_without_a_repeat_is_settled_once_the_key_is_stale() {
    let db = Database::create_empty().await;
    let timing = Timing {
        processing_timeout: Duration::from_secs(2),
        sweep_interval: Duration::from_millis(300),
    };
    let mut env = timing.env();
    env.extend([
        ("FAULT_INJECTION", "true".to_owned()),
        ("PROCESSOR_RETRIES", "0".to_owned()),
    ]);
    let server = Server::start(&db.url, &env).await;
    let urls = [server.url()];
    let gateway = server.processor.as_ref().expect("its own gateway").url();
    let http = client(Duration::from_secs(15));
    let operations = 5 * scale();
    let started = Instant::now();
    let deadline = started + timing.recovered_within() + Duration::from_secs(10);
    // Every payment's answer is lost and oncepay does not ask again: the
    // request answers 503, and the record is settled from the gateway's
    // ledger once its key is stale, by a retry or by the sweeper.
    let outcomes = join_all((0..operations).map(|op| {
        let (urls, http) = (&urls, &http);
        async move {
            let key = format!("dropped-once-{op}");
            let body = charge_body(&key, 1300, "tok_visa");
            let fault = [("Oncepay-Fault", "processor-drop-after-record")];
            drive(http, urls, &key, &body, &fault, deadline).await
        }
    }))
    .await;

    let pool = db.pool().await;
    let report = Report::measure("processor answer dropped, no repeat", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, operations as i64);
    assert_eq!(
        faults_applied(&http, &gateway, "drop-after-record").await,
        operations as f64
    );
    assert!(
        outcomes.iter().all(|o| o.five_xx >= 1),
        "each first request was answered outcome unknown: {outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_slower_than_the_call_timeout_is_asked_again_and_charges_once() {
    let db = Database::create_empty().await;
    let call_timeout = Duration::from_secs(1);
    let server = Server::start(
        &db.url,
        &[
            FAULTS_ON,
            ("PROCESSOR_TIMEOUT", &setting(call_timeout)),
            // Far longer than oncepay waits for one answer.
            ("PROCESSOR_FAULT_DELAY", "6s"),
        ],
    )
    .await;
    let urls = [server.url()];
    let gateway = server.processor.as_ref().expect("its own gateway").url();
    let http = client(Duration::from_secs(15));
    let deadline = Instant::now() + Duration::from_secs(60);
    let operations = 5 * scale();
    let outcomes: Vec<(OpOutcome, Duration)> = join_all((0..operations).map(|op| {
        let (urls, http) = (&urls, &http);
        async move {
            let key = format!("slow-{op}");
            let body = charge_body(&key, 1400, "tok_visa");
            let sent = Instant::now();
            let fault = [("Oncepay-Fault", "processor-slow")];
            let outcome = drive(http, urls, &key, &body, &fault, deadline).await;
            (outcome, sent.elapsed())
        }
    }))
    .await;
    let slowest = outcomes.iter().map(|(_, d)| *d).max().unwrap();
    let outcomes: Vec<OpOutcome> = outcomes.into_iter().map(|(o, _)| o).collect();

    let pool = db.pool().await;
    let report = Report::measure("processor slower than its timeout", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, operations as i64);
    assert_eq!(
        faults_applied(&http, &gateway, "slow").await,
        operations as f64
    );
    assert_eq!(
        (report.requests, report.five_xx),
        (operations as u64, 0),
        "the repeat after the timeout found the payment and answered"
    );
    assert!(
        slowest >= call_timeout && slowest < Duration::from_secs(6),
        "answered after one PROCESSOR_TIMEOUT, not after the gateway's delay: {slowest:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_call_and_restarted_charges_each_key_once() {
    let db = Database::create_empty().await;
    let timing = Timing {
        processing_timeout: Duration::from_secs(3),
        sweep_interval: Duration::from_millis(300),
    };
    let mut env = timing.env();
    env.extend([
        ("FAULT_INJECTION", "true".to_owned()),
        ("PROCESSOR_FAULT_DELAY", "30s".to_owned()),
    ]);
    let mut server = Server::start(&db.url, &env).await;
    let urls = [server.url()];
    let pool = db.pool().await;
    let ledger = processor_pool(&pool).await;
    let http = client(Duration::from_secs(15));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(60);
    let in_flight = 4 * scale();
    let during = 2 * scale();
    let gateway = server.processor.as_mut().expect("its own gateway");

    // Payments recorded and held unanswered (`slow`), then the gateway is
    // killed with all of them in flight; charges sent while it is down are
    // refused and retried. It is restarted a second later.
    let held = join_all((0..in_flight).map(|op| {
        let (urls, http) = (&urls, &http);
        async move {
            let key = format!("killed-{op}");
            let body = charge_body(&key, 1500, "tok_visa");
            let fault = [("Oncepay-Fault", "processor-slow")];
            drive(http, urls, &key, &body, &fault, deadline).await
        }
    }));
    let outage = async {
        eventually(deadline, "every payment is recorded", || async {
            (payments(&ledger).await == in_flight as i64).then_some(())
        })
        .await;
        gateway.kill();
        let refused = join_all((0..during).map(|op| {
            let (urls, http) = (&urls, &http);
            async move {
                let key = format!("refused-{op}");
                let body = charge_body(&key, 1600, "tok_visa");
                drive(http, urls, &key, &body, &[], deadline).await
            }
        }));
        let restart = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            gateway.restart().await;
        };
        tokio::join!(refused, restart).0
    };
    let (held, refused) = tokio::join!(held, outage);
    let outcomes: Vec<OpOutcome> = held.into_iter().chain(refused).collect();

    let report = Report::measure("processor killed mid-call", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, (in_flight + during) as i64);
    assert_eq!(payments(&ledger).await, (in_flight + during) as i64);
    assert!(server.alive(), "oncepay does not crash with its gateway");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_down_longer_than_the_processing_timeout_is_settled_by_the_sweeper_once_back() {
    let db = Database::create_empty().await;
    let timing = Timing {
        processing_timeout: Duration::from_secs(2),
        sweep_interval: Duration::from_millis(300),
    };
    let mut env = timing.env();
    env.extend([
        ("FAULT_INJECTION", "true".to_owned()),
        ("PROCESSOR_FAULT_DELAY", "30s".to_owned()),
    ]);
    let mut server = Server::start(&db.url, &env).await;
    let url = server.url();
    let pool = db.pool().await;
    let ledger = processor_pool(&pool).await;
    let http = client(Duration::from_secs(15));
    let recorded = 4 * scale();
    let refused = 2 * scale();
    let deadline = Instant::now() + Duration::from_secs(30);
    let gateway = server.processor.as_mut().expect("its own gateway");

    // Payments recorded and held unanswered, then the gateway is killed:
    // each request answers "outcome unknown", and its client waits.
    let first = join_all((0..recorded).map(|op| {
        let (url, http) = (&url, &http);
        async move {
            let key = format!("down-{op}");
            let body = charge_body(&key, 1700, "tok_visa");
            let fault = [("Oncepay-Fault", "processor-slow")];
            send(http, url, &key, &body, &fault).await.unwrap()
        }
    }));
    let kill = async {
        eventually(deadline, "every payment is recorded", || async {
            (payments(&ledger).await == recorded as i64).then_some(())
        })
        .await;
        gateway.kill();
    };
    let (first, ()) = tokio::join!(first, kill);
    for (status, _, problem) in &first {
        assert_eq!(
            (*status, problem["code"].as_str()),
            (503, Some("processing_outcome_unknown")),
            "{problem}"
        );
    }
    // Charges asked for while it is down: refused, nothing recorded, nothing
    // left pending.
    let mut outcomes: Vec<OpOutcome> = Vec::new();
    for op in 0..refused {
        let key = format!("down-refused-{op}");
        let body = charge_body(&key, 1800, "tok_visa");
        let (status, _, problem) = send(&http, &url, &key, &body, &[]).await.unwrap();
        assert_eq!(
            (status, problem["code"].as_str()),
            (503, Some("processor_unavailable")),
            "{problem}"
        );
    }

    // Down for twice PROCESSING_TIMEOUT and more: every key turns stale and
    // the sweeper tries them, but cannot fence or read what the gateway
    // holds, so it settles none of them and forgets none.
    tokio::time::sleep(timing.processing_timeout * 2 + timing.sweep_interval * 3).await;
    assert_eq!(charges(&pool, "pending").await, recorded as i64);
    assert_eq!(charges(&pool, "failed").await, 0);
    assert!(server.alive(), "oncepay does not crash with its gateway");

    // Back: the sweeper settles every charge from the gateway's ledger.
    server.processor.as_mut().unwrap().restart().await;
    let back = Instant::now();
    eventually(
        back + timing.sweep_interval + crate::harness::SLACK,
        "the sweeper settled every charge",
        || async { (charges(&pool, "pending").await == 0).then_some(()) },
    )
    .await;
    assert_eq!(charges(&pool, "succeeded").await, recorded as i64);

    // The clients retry with their keys: the recorded payments are
    // replayed, the refused charges go through now.
    let deadline = Instant::now() + Duration::from_secs(30);
    let urls = [url.clone()];
    for op in 0..recorded {
        let key = format!("down-{op}");
        let body = charge_body(&key, 1700, "tok_visa");
        let mut outcome = drive(&http, &urls, &key, &body, &[], deadline).await;
        outcome.requests += 1;
        outcome.five_xx += 1;
        outcomes.push(outcome);
    }
    for op in 0..refused {
        let key = format!("down-refused-{op}");
        let body = charge_body(&key, 1800, "tok_visa");
        let mut outcome = drive(&http, &urls, &key, &body, &[], deadline).await;
        outcome.requests += 1;
        outcome.five_xx += 1;
        outcomes.push(outcome);
    }

    let report = Report::measure("processor down past PROCESSING_TIMEOUT", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, (recorded + refused) as i64);
    assert_eq!(payments(&ledger).await, (recorded + refused) as i64);
}
