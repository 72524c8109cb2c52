//! No event without its change, no change without its event: charges and
//! refunds killed at each point of their settle path (after the claim, after
//! the processor, inside the settle's transaction just before its commit,
//! and an answer lost after the commit) end, once retried, with exactly the
//! events of their final state; and at the moment of each crash the record
//! is still pending with no event at all.

use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::PgPool;

use crate::database::TestDb as Database;
use crate::harness::{
    OpOutcome, Report, Server, assert_events_paired, charge_body, client, drive_to, post,
    refund_body, scale, send, unpaired_events, wait_until_settled,
};
use crate::{CRASH_TIMING, FAULTS_ON};

/// Where each operation's first attempt fails, in the order of the path.
const POINTS: [&str; 4] = [
    "crash-after-claim",
    "crash-after-processor",
    "crash-before-settle-commit",
    "drop-response",
];

/// One operation, and how it must end.
struct Case {
    /// Its key, also its `op`.
    key: String,
    body: Value,
    /// Where its first attempt fails (one of [`POINTS`]).
    point: &'static str,
    /// The status its record ends in.
    ends: &'static str,
    /// The events its settle writes, in one transaction.
    events: i64,
}

/// The last `seq` the events table handed out, committed or not: a settle
/// that inserted its events and then rolled back still moved it.
async fn events_seq(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('events', 'seq')::regclass), 0)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn events_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The record of operation `op` in `table`: its status and how many events
/// name it.
async fn record(pool: &PgPool, table: &str, op: &str) -> (String, i64) {
    sqlx::query_as(&format!(
        "SELECT r.status, (SELECT count(*) FROM events e WHERE e.object_id = r.id)
           FROM {table} r WHERE r.metadata->>'op' = $1"
    ))
    .bind(op)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Sends each case's first attempt to `server` with its fault, then checks
/// the database at that moment: after a crash, the record is still pending
/// and no event names it (a settle that had begun inserted its events and
/// then vanished with its transaction), and after a lost answer the record
/// is settled with its events. Starts a crashed process again and retries
/// each case until a definite answer, within the time recovery takes.
async fn kill_at_each_point(
    server: &mut Server,
    pool: &PgPool,
    path: &str,
    table: &str,
    cases: &[Case],
) -> Vec<OpOutcome> {
    let http = client(Duration::from_secs(15));
    let mut outcomes = Vec::new();
    for case in cases {
        let (seq, count) = (events_seq(pool).await, events_count(pool).await);
        let fault = [("Oncepay-Fault", case.point)];
        let first = post(&http, &server.url(), path, &case.key, &case.body, &fault).await;
        let claimed = Instant::now();
        assert!(first.is_err(), "{}: no answer: {first:?}", case.key);
        let written = if case.point == "drop-response" {
            assert_eq!(
                record(pool, table, &case.key).await,
                (case.ends.to_owned(), 1),
                "{}: committed with its event before the answer was lost",
                case.key
            );
            case.events
        } else {
            let status = server.wait_exit().await;
            assert!(!status.success(), "aborted, as kill -9 would: {status}");
            assert_eq!(
                record(pool, table, &case.key).await,
                ("pending".to_owned(), 0),
                "{}: the crash left the record pending, with no event",
                case.key
            );
            0
        };
        assert_eq!(
            events_count(pool).await - count,
            written,
            "{}: events written",
            case.key
        );
        // The settle's events were inserted before the crash, and are gone.
        let tried = if case.point == "crash-before-settle-commit" {
            case.events
        } else {
            written
        };
        assert_eq!(
            events_seq(pool).await - seq,
            tried,
            "{}: events inserted, committed or not",
            case.key
        );
        assert_events_paired(pool).await;
        if !server.alive() {
            server.restart().await;
        }
        let deadline = claimed + CRASH_TIMING.recovered_within();
        let mut outcome = drive_to(
            &http,
            &[server.url()],
            path,
            &case.key,
            &case.body,
            &[],
            deadline,
        )
        .await;
        outcome.requests += 1;
        outcomes.push(outcome);
    }
    wait_until_settled(pool, Instant::now() + CRASH_TIMING.recovered_within()).await;
    for case in cases {
        assert_eq!(
            record(pool, table, &case.key).await,
            (case.ends.to_owned(), 1),
            "{} ({}): its final state, and its one event of that state",
            case.key,
            case.point
        );
    }
    outcomes
}

/// A server that takes faults and recovers within [`CRASH_TIMING`].
async fn crash_server(db: &Database) -> Server {
    let mut settings = CRASH_TIMING.env();
    settings.push((FAULTS_ON.0, FAULTS_ON.1.into()));
    Server::start(&db.url, &settings).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_killed_at_any_point_of_its_settle_path_ends_with_exactly_the_events_of_its_state()
{
    let db = Database::create_empty().await;
    let mut server = crash_server(&db).await;
    let pool = db.pool().await;
    // A card that pays and one that is declined, at every point: a crash
    // after the claim is abandoned (`charge.failed`), any later point keeps
    // what the processor recorded.
    let mut cases = Vec::new();
    for n in 0..scale() {
        for point in POINTS {
            for (source, ends) in [("tok_visa", "succeeded"), ("tok_chargeDeclined", "failed")] {
                let ends = if point == "crash-after-claim" {
                    "failed"
                } else {
                    ends
                };
                let key = format!("events-{point}-{source}-{n}");
                cases.push(Case {
                    body: charge_body(&key, 1200, source),
                    key,
                    point,
                    ends,
                    events: 1,
                });
            }
        }
    }
    let outcomes = kill_at_each_point(&mut server, &pool, "/v1/charges", "charges", &cases).await;

    let report = Report::measure("killed at each settle point", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    let paid = cases.iter().filter(|c| c.ends == "succeeded").count() as i64;
    assert_eq!((report.succeeded, report.effects), (paid, paid));
    let events: Vec<(String, i64)> =
        sqlx::query_as("SELECT type, count(*) FROM events GROUP BY type ORDER BY type")
            .fetch_all(&pool)
            .await
            .unwrap();
    let failed = cases.len() as i64 - paid;
    assert_eq!(
        events,
        [
            ("charge.failed".to_owned(), failed),
            ("charge.succeeded".to_owned(), paid)
        ],
        "one event per charge, of its final state"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_killed_at_any_point_of_its_settle_path_ends_with_exactly_the_events_of_its_state()
{
    let db = Database::create_empty().await;
    let mut server = crash_server(&db).await;
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    // A refund that goes through and one the issuer refuses (the first
    // refund of a `tok_refundFail` payment), at every point: a refund is
    // rolled forward from any of them.
    let mut cases = Vec::new();
    for n in 0..scale() {
        for point in POINTS {
            for (source, ends) in [("tok_visa", "succeeded"), ("tok_refundFail", "failed")] {
                let key = format!("events-refund-{point}-{source}-{n}");
                let paid = format!("paid-{key}");
                let (status, _, charge) = send(
                    &http,
                    &server.url(),
                    &paid,
                    &charge_body(&paid, 4000, source),
                    &[],
                )
                .await
                .unwrap();
                assert_eq!(status, 201, "{charge}");
                cases.push(Case {
                    body: refund_body(&key, charge["id"].as_str().unwrap(), 1500),
                    key,
                    point,
                    ends,
                    // `refund.created` and `charge.refunded`, or `refund.failed`.
                    events: if ends == "succeeded" { 2 } else { 1 },
                });
            }
        }
    }
    let outcomes = kill_at_each_point(&mut server, &pool, "/v1/refunds", "refunds", &cases).await;

    let report =
        Report::measure_refunds("refund: killed at each settle point", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    let refunded = cases.iter().filter(|c| c.ends == "succeeded").count() as i64;
    assert_eq!((report.succeeded, report.effects), (refunded, refunded));
    assert!(
        outcomes.iter().zip(&cases).all(|(o, c)| o
            .answers
            .iter()
            .all(|a| a.status == 201 && a.state.as_deref() == Some(c.ends))),
        "each refund answered as it ended: {outcomes:?}"
    );
    let events: Vec<(String, i64)> =
        sqlx::query_as("SELECT type, count(*) FROM events GROUP BY type ORDER BY type")
            .fetch_all(&pool)
            .await
            .unwrap();
    let refused = cases.len() as i64 - refunded;
    assert_eq!(
        events,
        [
            ("charge.refunded".to_owned(), refunded),
            ("charge.succeeded".to_owned(), cases.len() as i64),
            ("refund.created".to_owned(), refunded),
            ("refund.failed".to_owned(), refused),
        ],
        "one event per charge paid, and the events of each refund's final state"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pairing_check_finds_every_change_without_its_event_and_every_event_without_its_change()
{
    let db = Database::create().await;
    let pool = db.pool().await;
    assert_eq!(unpaired_events(&pool).await, Vec::<String>::new());
    // One charge paired with its event, and one of each way to break it.
    sqlx::query(
        "WITH m AS (INSERT INTO merchants (id, name, api_key_hash)
                    VALUES (gen_random_uuid(), 'pairing', sha256('pairing'::bytea)) RETURNING id),
         c AS (INSERT INTO charges (id, merchant_id, amount, currency, source, status,
                                    failure_code, amount_refunded)
               SELECT c.id, m.id, 100, 'usd', 'tok_visa', c.status, c.code, c.refunded
                 FROM m, (VALUES ('ch_paired', 'succeeded', NULL, 0),
                                 ('ch_silent', 'succeeded', NULL, 0),
                                 ('ch_pending', 'pending', NULL, 0),
                                 ('ch_declined', 'failed', 'card_declined', 0),
                                 ('ch_refunded', 'succeeded', NULL, 80))
                      AS c(id, status, code, refunded)
               RETURNING id, merchant_id),
         r AS (INSERT INTO refunds (id, merchant_id, charge_id, amount, currency, status)
               SELECT r.id, c.merchant_id, c.id, 40, 'usd', 'succeeded'
                 FROM c, (VALUES ('re_paired000000000000000000'),
                                 ('re_silent000000000000000000')) AS r(id)
                WHERE c.id = 'ch_refunded'
               RETURNING id)
         INSERT INTO events (id, merchant_id, type, object_id, data)
         SELECT rpad('evt_' || e.n, 28, '0'), m.id, e.type, e.object_id,
                json_build_object('id', e.object_id, 'object', split_part(e.type, '.', 1),
                                  'status', e.status)
           FROM m, (VALUES (1, 'charge.succeeded', 'ch_paired', 'succeeded'),
                           (2, 'charge.succeeded', 'ch_pending', 'succeeded'),
                           (3, 'charge.succeeded', 'ch_declined', 'succeeded'),
                           (4, 'charge.succeeded', 'ch_refunded', 'succeeded'),
                           (5, 'refund.created', 're_paired000000000000000000', 'succeeded'),
                           (6, 'charge.refunded', 'ch_refunded', 'succeeded'),
                           (7, 'charge.failed', 'ch_gone', 'failed'))
                AS e(n, type, object_id, status)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let unpaired = unpaired_events(&pool).await;
    // The ids the statement above gave the events.
    let evt = |n: u8| format!("evt_{n:0<24}");
    for what in [
        // A change without its event.
        "charge ch_silent is succeeded, with 0 charge.succeeded and 0 charge.failed".to_owned(),
        // An event without its change.
        "charge ch_pending is pending, with 1 charge.succeeded and 0 charge.failed".to_owned(),
        format!(
            "charge.succeeded {} says charge ch_pending is succeeded",
            evt(2)
        ),
        // The wrong event for the change.
        "charge ch_declined is failed, with 1 charge.succeeded and 0 charge.failed".to_owned(),
        format!(
            "charge.succeeded {} says charge ch_declined is succeeded",
            evt(3)
        ),
        // A refund without its events.
        "refund re_silent000000000000000000 is succeeded, with 0 refund.created".to_owned(),
        "charge ch_refunded has 1 charge.refunded for 2 succeeded refunds".to_owned(),
        // An event about nothing.
        format!("charge.failed {} says charge ch_gone is failed", evt(7)),
    ] {
        assert!(
            unpaired.iter().any(|u| u.starts_with(&what)),
            "{what}: {unpaired:#?}"
        );
    }
    assert_eq!(unpaired.len(), 8, "and nothing else: {unpaired:#?}");
}
