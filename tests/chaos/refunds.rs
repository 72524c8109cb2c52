//! Refunds under the same faults as charges: a crash after the reservation
//! and after the processor, a lost answer, three instances, two identical
//! refunds racing on one key, a settle after the key expired. The money is
//! checked at the processor's own ledger: one refund per operation, as much
//! refunded as the operations asked for, never more than was charged.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::future::join_all;

use crate::database::TestDb as Database;
use crate::harness::{
    OpOutcome, Report, Server, Timing, charge_body, client, crash_each, drive_to, merge, post,
    processor_pool, refund_body, scale, send, wait_until_settled,
};
use crate::{CRASH_TIMING, FAULTS_ON, OUTAGE_PAST_THE_TTL, SHORT_TTL_TIMING, short_ttl_settings};

const ROUTE: &str = "/v1/refunds";

/// One refund operation: its key (also its `op`), the charge it refunds,
/// and how much.
#[derive(Clone, Debug)]
struct Operation {
    key: String,
    charge: String,
    amount: i64,
}

impl Operation {
    fn body(&self) -> serde_json::Value {
        refund_body(&self.key, &self.charge, self.amount)
    }
}

/// Makes a succeeded charge of `amount` to refund; returns its id.
async fn paid_charge(http: &reqwest::Client, url: &str, op: &str, amount: i64) -> String {
    let (status, _, charge) = send(http, url, op, &charge_body(op, amount, "tok_visa"), &[])
        .await
        .unwrap();
    assert_eq!(status, 201, "{charge}");
    charge["id"].as_str().unwrap().to_owned()
}

/// A refund, with what the processor recorded under its key.
#[derive(Debug, PartialEq, Eq, sqlx::FromRow)]
struct Refunded {
    status: String,
    amount: i64,
    charge_id: String,
    processor_outcome: Option<String>,
    processor_amount: Option<i64>,
    payment_key: Option<String>,
}

/// Checks the money at the processor's ledger and in the database: each
/// operation has one refund, succeeded, of its amount, against its charge's
/// payment, recorded once by the processor as refunded; the processor
/// refunded exactly what the operations asked for, and no payment or charge
/// more than it was for.
async fn assert_refunded_once(pool: &sqlx::PgPool, operations: &[Operation]) {
    let ledger = processor_pool(pool).await;
    for op in operations {
        let records: Vec<(String, i64, String, String)> = sqlx::query_as(
            "SELECT r.status, r.amount, r.charge_id, r.id FROM refunds r
              WHERE r.metadata->>'op' = $1",
        )
        .bind(&op.key)
        .fetch_all(pool)
        .await
        .unwrap();
        let mut refunds = Vec::new();
        for (status, amount, charge_id, id) in records {
            let at_processor: Option<(String, Option<i64>, Option<String>)> = sqlx::query_as(
                "SELECT outcome, amount, payment_key FROM operations
                  WHERE key = 'refund:' || $1 AND kind = 'refund'",
            )
            .bind(&id)
            .fetch_optional(&ledger)
            .await
            .unwrap();
            let (processor_outcome, processor_amount, payment_key) = match at_processor {
                Some((outcome, amount, payment)) => (Some(outcome), amount, payment),
                None => (None, None, None),
            };
            refunds.push(Refunded {
                status,
                amount,
                charge_id,
                processor_outcome,
                processor_amount,
                payment_key,
            });
        }
        assert_eq!(
            refunds,
            [Refunded {
                status: "succeeded".to_owned(),
                amount: op.amount,
                charge_id: op.charge.clone(),
                processor_outcome: Some("refunded".to_owned()),
                processor_amount: Some(op.amount),
                payment_key: Some(format!("auth:{}", op.charge)),
            }],
            "{}: one refund, refunded once at the processor",
            op.key
        );
    }
    let asked: i64 = operations.iter().map(|op| op.amount).sum();
    let at_processor: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(amount), 0)::bigint FROM operations
          WHERE kind = 'refund' AND outcome = 'refunded'",
    )
    .fetch_one(&ledger)
    .await
    .unwrap();
    let (refunds, reserved): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(amount), 0)::bigint FROM refunds WHERE status = 'succeeded'),
                (SELECT coalesce(sum(amount_refunded), 0)::bigint FROM charges)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (at_processor, refunds, reserved),
        (asked, asked, asked),
        "refunded at the processor, in refunds, and on the charges"
    );
    let mut by_charge: HashMap<&str, i64> = HashMap::new();
    for op in operations {
        *by_charge.entry(&op.charge).or_default() += op.amount;
    }
    for (charge, asked) in by_charge {
        let (amount, refunded): (i64, i64) =
            sqlx::query_as("SELECT c.amount, c.amount_refunded FROM charges c WHERE c.id = $1")
                .bind(charge)
                .fetch_one(pool)
                .await
                .unwrap();
        let at_processor: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(r.amount), 0)::bigint FROM operations r
              WHERE r.payment_key = 'auth:' || $1 AND r.outcome = 'refunded'",
        )
        .bind(charge)
        .fetch_one(&ledger)
        .await
        .unwrap();
        assert_eq!((refunded, at_processor), (asked, asked), "{charge}");
        assert!(
            at_processor <= amount,
            "{charge}: {at_processor} refunded of {amount}"
        );
    }
}

/// Crashes the server at `fault` on every refund, restarts it, and retries
/// each until a definite answer, within the time recovery takes.
async fn crash_refunds(fault: &'static str) -> (Database, Vec<Operation>, Vec<OpOutcome>) {
    let db = Database::create_empty().await;
    let mut settings = CRASH_TIMING.env();
    settings.push((FAULTS_ON.0, FAULTS_ON.1.into()));
    let mut server = Server::start(&db.url, &settings).await;
    let http = client(Duration::from_secs(15));
    let mut operations = Vec::new();
    for op in 0..3 * scale() {
        let charge = paid_charge(&http, &server.url(), &format!("paid-{fault}-{op}"), 5000).await;
        operations.push(Operation {
            key: format!("refund-{fault}-{op}"),
            charge,
            amount: 2000,
        });
    }
    let requests: Vec<_> = operations
        .iter()
        .map(|o| (o.key.clone(), o.body()))
        .collect();
    let (outcomes, slowest) = crash_each(&mut server, ROUTE, &requests, fault, CRASH_TIMING).await;
    eprintln!("refund {fault}: the slowest definite answer came {slowest:?} after a restart");
    (db, operations, outcomes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_crashed_after_its_reservation_is_rolled_forward_and_refunds_once() {
    let (db, operations, outcomes) = crash_refunds("crash-after-claim").await;
    let pool = db.pool().await;
    let report = Report::measure_refunds("refund: crash after reservation", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes.iter().all(|o| o.definite() == Some(201)),
        "the reserved refund was completed: {outcomes:?}"
    );
    assert_refunded_once(&pool, &operations).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_crashed_after_the_processor_is_settled_and_refunds_once() {
    let (db, operations, outcomes) = crash_refunds("crash-after-processor").await;
    let pool = db.pool().await;
    let report = Report::measure_refunds("refund: crash after processor", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes.iter().all(|o| o.definite() == Some(201)),
        "{outcomes:?}"
    );
    assert_refunded_once(&pool, &operations).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_whose_answer_was_lost_is_replayed_on_retry() {
    let db = Database::create_empty().await;
    let server = Server::start(&db.url, &[FAULTS_ON]).await;
    let url = server.url();
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let mut operations = Vec::new();
    let mut outcomes = Vec::new();
    for op in 0..5 * scale() {
        let charge = paid_charge(&http, &url, &format!("paid-lost-{op}"), 3000).await;
        let operation = Operation {
            key: format!("refund-lost-{op}"),
            charge,
            amount: 3000,
        };
        let (key, body) = (&operation.key, operation.body());
        // The first try commits, then the connection closes with no answer.
        let fault = [("Oncepay-Fault", "drop-response")];
        let first = post(&http, &url, ROUTE, key, &body, &fault).await;
        assert!(first.is_err(), "no answer on the first try: {first:?}");
        let committed: Option<String> = sqlx::query_scalar(
            "SELECT id FROM refunds WHERE metadata->>'op' = $1 AND status = 'succeeded'",
        )
        .bind(key)
        .fetch_optional(&pool)
        .await
        .unwrap();
        let committed = committed.expect("the refund was committed before the answer was lost");
        let (status, headers, answer) = post(&http, &url, ROUTE, key, &body, &[]).await.unwrap();
        assert_eq!(status, 201, "{answer}");
        assert_eq!(
            headers.get("idempotent-replayed").map(String::as_str),
            Some("true")
        );
        assert_eq!(answer["id"], committed.as_str(), "the committed refund");
        let mut outcome = OpOutcome::new(key, key);
        outcome.requests = 2;
        outcome.answered(status, &answer);
        outcomes.push(outcome);
        operations.push(operation);
    }
    let report = Report::measure_refunds("refund: lost answer, then retry", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_refunded_once(&pool, &operations).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_refund_each_key_once_and_never_more_than_was_charged() {
    let db = Database::create_empty().await;
    let timing = Timing {
        processing_timeout: Duration::from_secs(4),
        sweep_interval: Duration::from_millis(200),
    };
    let mut settings = timing.env();
    settings.extend([
        (FAULTS_ON.0, FAULTS_ON.1.to_owned()),
        ("PROCESSOR_LATENCY_MS", "30".to_owned()),
    ]);
    let servers = [
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
    ];
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let http = client(Duration::from_secs(15));
    // Four refunds per charge, of which three add up to all of it: one of
    // the four must be refused.
    let (per_charge, amount, charged) = (4, 1000, 3000);
    let mut operations = Vec::new();
    for c in 0..5 * scale() {
        let charge = paid_charge(&http, &urls[c % 3], &format!("paid-multi-{c}"), charged).await;
        for r in 0..per_charge {
            operations.push(Operation {
                key: format!("refund-multi-{c}-{r}"),
                charge: charge.clone(),
                amount,
            });
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    // Every refund is sent by three clients at once, each starting at a
    // different instance and retrying over all three; the first client's
    // first answer is lost after its commit.
    let drivers = operations.iter().enumerate().flat_map(|(i, op)| {
        let (urls, http) = (&urls, &http);
        (0..3).map(move |client| async move {
            let rotated: Vec<String> = urls
                .iter()
                .cycle()
                .skip(client + i)
                .take(urls.len())
                .cloned()
                .collect();
            let fault: &[(&str, &str)] = if client == 0 {
                &[("Oncepay-Fault", "drop-response")]
            } else {
                &[]
            };
            drive_to(http, &rotated, ROUTE, &op.key, &op.body(), fault, deadline).await
        })
    });
    let outcomes = merge(join_all(drivers).await);

    let pool = db.pool().await;
    wait_until_settled(&pool, Instant::now() + timing.recovered_within()).await;
    let report =
        Report::measure_refunds("refund: three instances, one database", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.five_xx, 0, "no 5xx: {report:?}");
    assert!(
        outcomes.iter().all(|o| o.answers.len() == 3),
        "every client got its answer: {outcomes:?}"
    );
    let answers: HashMap<&str, Option<u16>> = outcomes
        .iter()
        .map(|o| (o.key.as_str(), o.definite()))
        .collect();
    let (refunded, refused): (Vec<Operation>, Vec<Operation>) = operations
        .iter()
        .cloned()
        .partition(|op| answers[op.key.as_str()] == Some(201));
    assert!(
        refused
            .iter()
            .all(|op| answers[op.key.as_str()] == Some(400)),
        "{outcomes:?}"
    );
    let charges = operations.len() / per_charge;
    assert_eq!(
        (refunded.len(), refused.len()),
        (3 * charges, charges),
        "three refunded and one refused per charge: {outcomes:?}"
    );
    assert_eq!(report.succeeded, refunded.len() as i64);
    assert_refunded_once(&pool, &refunded).await;
    let refused_keys: Vec<String> = refused.iter().map(|op| op.key.clone()).collect();
    let written: i64 =
        sqlx::query_scalar("SELECT count(*) FROM refunds WHERE metadata->>'op' = ANY($1)")
            .bind(&refused_keys)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(written, 0, "a refused refund writes nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_identical_refunds_racing_on_one_key_refund_once() {
    let db = Database::create_empty().await;
    // A slow processor: the second request arrives while the first is there.
    let server = Server::start(&db.url, &[("PROCESSOR_LATENCY_MS", "300")]).await;
    let urls = [server.url()];
    let http = client(Duration::from_secs(15));
    let mut operations = Vec::new();
    for op in 0..10 * scale() {
        let charge = paid_charge(&http, &urls[0], &format!("paid-race-{op}"), 5000).await;
        operations.push(Operation {
            key: format!("refund-race-{op}"),
            charge,
            amount: 2500,
        });
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let pairs = operations.iter().map(|op| {
        let (urls, http) = (&urls, &http);
        async move {
            let body = op.body();
            let (a, b) = tokio::join!(
                drive_to(http, urls, ROUTE, &op.key, &body, &[], deadline),
                drive_to(http, urls, ROUTE, &op.key, &body, &[], deadline),
            );
            [a, b]
        }
    });
    let outcomes = merge(join_all(pairs).await.into_iter().flatten().collect());

    let pool = db.pool().await;
    let report = Report::measure_refunds("refund: two at once, one key", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert!(
        outcomes.iter().all(|o| o.answers.len() == 2),
        "both got the refund: {outcomes:?}"
    );
    assert!(
        outcomes.iter().any(|o| o.in_use > 0),
        "the two were in flight together: {outcomes:?}"
    );
    assert_refunded_once(&pool, &operations).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_settled_after_its_key_expired_is_replayed_and_never_refunded_again() {
    let db = Database::create_empty().await;
    let mut server = Server::start(&db.url, &short_ttl_settings()).await;
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let mut operations = Vec::new();
    let mut outcomes = Vec::new();
    for op in 0..2 * scale() {
        let charge = paid_charge(&http, &server.url(), &format!("paid-late-{op}"), 5000).await;
        let operation = Operation {
            key: format!("late-refund-{op}"),
            charge,
            amount: 1500,
        };
        let (key, body) = (&operation.key, operation.body());
        let fault = [("Oncepay-Fault", "crash-after-processor")];
        let first = post(&http, &server.url(), ROUTE, key, &body, &fault).await;
        assert!(
            first.is_err(),
            "the process died before answering: {first:?}"
        );
        assert!(!server.wait_exit().await.success());
        // Down for longer than the key lives.
        tokio::time::sleep(OUTAGE_PAST_THE_TTL).await;
        server.restart().await;
        wait_until_settled(&pool, Instant::now() + SHORT_TTL_TIMING.recovered_within()).await;

        let (status, headers, answer) = post(&http, &server.url(), ROUTE, key, &body, &[])
            .await
            .unwrap();
        assert_eq!(status, 201, "{answer}");
        assert_eq!(
            headers.get("idempotent-replayed").map(String::as_str),
            Some("true")
        );
        assert_eq!(answer["status"], "succeeded");
        assert_eq!(answer["amount"], 1500);
        let mut outcome = OpOutcome::new(key, key);
        outcome.requests = 2;
        outcome.answered(status, &answer);
        outcomes.push(outcome);
        operations.push(operation);
    }
    let report =
        Report::measure_refunds("refund: late settle, down past the TTL", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_refunded_once(&pool, &operations).await;
}
