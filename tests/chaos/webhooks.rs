//! The webhook boundary under faults, with the workshop's receivers as the
//! merchant's order system (an inbox that ships once per event id, and a
//! naive one that ships for every delivery): a worker killed between the
//! receiver's `2xx` and its record of it, a receiver that is down for a
//! while, three instances delivering from one database, and one merchant's
//! endpoints hanging while another's webhooks are timed. Each scenario
//! waits until every delivery has ended and checks that every event was
//! delivered, that nothing was lost, and that the inbox shipped exactly one
//! order per event ([`webhook_violations`](crate::harness::webhook_violations),
//! in its report row).

use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::FAULTS_ON;
use crate::database::TestDb as Database;
use crate::harness::{
    API_KEY, OpOutcome, Report, SLACK, Server, client, drive, eventually, merge, metric, post,
    scale, wait_until_delivered, webhook_violations,
};

/// The most sends a worker has in flight (`WEBHOOK_CONCURRENCY`'s default).
const BATCH: usize = 32;

/// The `WEBHOOK_*` settings of a scenario, short so that its retries and
/// leases take seconds; its deadlines are derived from them.
#[derive(Clone, Copy, Debug)]
struct Delivery {
    timeout: Duration,
    retry_base: Duration,
    retry_max: Duration,
    poll_interval: Duration,
    /// `DATABASE_ACQUIRE_TIMEOUT`: a part of the lease.
    acquire_timeout: Duration,
}

const DELIVERY: Delivery = Delivery {
    timeout: Duration::from_secs(2),
    retry_base: Duration::from_millis(200),
    retry_max: Duration::from_secs(1),
    poll_interval: Duration::from_millis(100),
    acquire_timeout: Duration::from_secs(5),
};

impl Delivery {
    fn env(&self) -> Vec<(&'static str, String)> {
        use crate::harness::setting;
        vec![
            ("WEBHOOK_TIMEOUT", setting(self.timeout)),
            ("WEBHOOK_RETRY_BASE", setting(self.retry_base)),
            ("WEBHOOK_RETRY_MAX", setting(self.retry_max)),
            ("WEBHOOK_POLL_INTERVAL", setting(self.poll_interval)),
            ("DATABASE_ACQUIRE_TIMEOUT", setting(self.acquire_timeout)),
        ]
    }

    /// How long a claimed delivery is held: a worker killed mid-attempt
    /// leaves it due again after this. The worker's own definition, so that
    /// the two cannot drift apart.
    fn lease(&self) -> Duration {
        oncepay::webhooks::deliver::DeliverySettings {
            timeout: self.timeout,
            max_attempts: 16,
            retry_base: self.retry_base,
            retry_max: self.retry_max,
            disable_after: Duration::from_secs(72 * 3600),
            poll_interval: self.poll_interval,
            acquire_timeout: self.acquire_timeout,
            fault_injection: true,
            concurrency: 32,
            bounds: oncepay::webhooks::store::InFlightBounds {
                per_endpoint: 4,
                per_merchant: 8,
            },
            guard: oncepay::webhooks::guard::AddressGuard::new(true),
        }
        .lease()
    }

    /// How long a due delivery may wait for its attempt to end: the next
    /// poll, then the attempt.
    fn attempted_within(&self) -> Duration {
        self.poll_interval + self.timeout + SLACK
    }
}

/// The settings of a process that takes requests and whose delivery
/// worker idles: after its pass at start, it sleeps for an hour.
const IDLE_WORKER: (&str, &str) = ("WEBHOOK_POLL_INTERVAL", "1h");
const RECEIVERS_ON: (&str, &str) = ("DEMO_UNSAFE_ENDPOINTS", "true");

/// Creates a webhook endpoint for `charge.succeeded` at `url` through the
/// API at `api`; returns its signing secret.
async fn endpoint(http: &reqwest::Client, api: &str, url: &str) -> String {
    let key = format!("endpoint-{url}");
    let body = json!({"url": url, "enabled_events": ["charge.succeeded"]});
    let (status, _, created) = post(http, api, "/v1/webhook_endpoints", &key, &body, &[])
        .await
        .unwrap();
    assert_eq!(status, 201, "{created}");
    created["secret"].as_str().unwrap().to_owned()
}

/// Sets up the receiver of `run` in `mode` on the server at `url`, with the
/// secret of the endpoint that sends to it, failing the first `fail_first`
/// deliveries of each event as `fault` says (`None`: with a `500`).
async fn receiver(
    http: &reqwest::Client,
    url: &str,
    run: &str,
    mode: &str,
    secret: &str,
    fail_first: i64,
    fault: Option<&str>,
) {
    let mut body = json!({"run": run, "mode": mode, "secret": secret, "fail_first": fail_first});
    if let Some(fault) = fault {
        body["fault"] = json!(fault);
    }
    let answer = http
        .post(format!("{url}/demo/receivers"))
        .bearer_auth(API_KEY)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200, "{}", answer.text().await.unwrap());
}

/// The receiver of `run` in `mode` that `url` serves.
fn receiver_url(url: &str, mode: &str, run: &str) -> String {
    format!("{url}/demo/receiver/{mode}?run={run}")
}

/// A charge of operation `op`, tagged for the receivers of `run`.
fn run_charge(op: &str, run: &str) -> Value {
    json!({"amount": 1200, "currency": "usd", "source": "tok_visa",
           "metadata": {"op": op, "demo_run": run}})
}

/// Charges `count` operations of `run`, each driven to its answer by one
/// client that starts at a different one of `urls`, the `n`th sent `n`
/// times `pace` after the first.
async fn charge_all(urls: &[String], run: &str, count: usize, pace: Duration) -> Vec<OpOutcome> {
    let http = client(Duration::from_secs(15));
    let deadline = Instant::now() + pace * count as u32 + Duration::from_secs(60);
    let drivers = (0..count).map(|op| {
        let http = &http;
        async move {
            tokio::time::sleep(pace * op as u32).await;
            let rotated: Vec<String> = urls
                .iter()
                .cycle()
                .skip(op)
                .take(urls.len())
                .cloned()
                .collect();
            let key = format!("{run}-{op}");
            drive(http, &rotated, &key, &run_charge(&key, run), &[], deadline).await
        }
    });
    merge(join_all(drivers).await)
}

/// What the receivers of `run` took in of one event.
#[derive(Debug, sqlx::FromRow)]
struct Received {
    event: String,
    naive_deliveries: i32,
    naive_shipped: i64,
    inbox_deliveries: i32,
    inbox_shipped: i64,
}

/// What each receiver of `run` took in, per `charge.succeeded` event (zeros
/// for a receiver that did not get it).
async fn received(pool: &PgPool, run: &str) -> Vec<Received> {
    sqlx::query_as(
        "SELECT e.id AS event,
                coalesce((SELECT deliveries FROM demo_receiver_deliveries r
                           WHERE r.run = $1 AND r.mode = 'naive' AND r.event_id = e.id), 0)
                    AS naive_deliveries,
                (SELECT count(*) FROM demo_shipments s
                  WHERE s.run = $1 AND s.mode = 'naive' AND s.event_id = e.id) AS naive_shipped,
                coalesce((SELECT deliveries FROM demo_receiver_deliveries r
                           WHERE r.run = $1 AND r.mode = 'inbox' AND r.event_id = e.id), 0)
                    AS inbox_deliveries,
                (SELECT count(*) FROM demo_shipments s
                  WHERE s.run = $1 AND s.mode = 'inbox' AND s.event_id = e.id) AS inbox_shipped
           FROM events e WHERE e.type = 'charge.succeeded' ORDER BY e.seq",
    )
    .bind(run)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The counts `GET /demo/receivers` gives for `mode`: deliveries, distinct
/// events, shipments.
async fn counts(http: &reqwest::Client, url: &str, run: &str, mode: &str) -> (i64, i64, i64) {
    let counts: Value = http
        .get(format!("{url}/demo/receivers?run={run}"))
        .bearer_auth(API_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let r = &counts["receivers"][mode];
    let n = |field: &str| r[field].as_i64().unwrap_or_else(|| panic!("{counts}"));
    (n("deliveries"), n("events"), n("shipments"))
}

/// One delivery, as the sender recorded it.
#[derive(Debug, sqlx::FromRow)]
struct Sent {
    id: i64,
    status: String,
    /// Attempts begun.
    attempts: i32,
    /// Attempts recorded (one cut short by a crash is not).
    recorded: i64,
    /// Recorded attempts the receiver answered `2xx`.
    answered_2xx: i64,
}

async fn sent(pool: &PgPool) -> Vec<Sent> {
    sqlx::query_as(
        "SELECT d.id, d.status, d.attempts,
                (SELECT count(*) FROM webhook_attempts a WHERE a.delivery_id = d.id) AS recorded,
                (SELECT count(*) FROM webhook_attempts a
                  WHERE a.delivery_id = d.id AND a.response_status BETWEEN 200 AND 299)
                    AS answered_2xx
           FROM webhook_deliveries d ORDER BY d.id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Starts `hooks` again until it is ready, counting in `aborts` the times
/// it aborted first: a worker claims what is due before its process
/// answers `/healthz`, so it may be killed during its start too.
async fn start_through_aborts(hooks: &mut Server, aborts: &mut usize) {
    while let Err(status) = hooks.try_restart().await {
        assert!(!status.success(), "aborted, as kill -9 would: {status}");
        *aborts += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_the_receivers_2xx_and_its_record_sends_again_and_the_inbox_ships_once()
 {
    let db = Database::create_empty().await;
    let run = "killed";
    // One delivery per event and receiver; all of them fit the worker's
    // places (a claim takes them in turns of WEBHOOK_MERCHANT_CONCURRENCY).
    let events = (3 * scale()).min(BATCH / 2);
    // The process under test: its worker delivers to its own receivers,
    // which answer the first delivery of each event `200` with
    // `Oncepay-Fault: crash-after-delivery`, and the worker aborts the
    // process on reading it, before recording the attempt.
    let mut settings = DELIVERY.env();
    settings.extend([
        (FAULTS_ON.0, FAULTS_ON.1.to_owned()),
        (RECEIVERS_ON.0, RECEIVERS_ON.1.to_owned()),
    ]);
    let mut hooks = Server::start(&db.url, &settings).await;
    // The charges are taken by another process, whose worker idles, while
    // the one under test is down: when it starts, every event is due.
    let api = Server::start(&db.url, &[IDLE_WORKER]).await;
    let http = client(Duration::from_secs(15));
    for mode in ["naive", "inbox"] {
        let secret = endpoint(&http, &api.url(), &receiver_url(&hooks.url(), mode, run)).await;
        let fault = Some("crash-after-delivery");
        receiver(&http, &hooks.url(), run, mode, &secret, 1, fault).await;
    }
    hooks.stop();
    let outcomes = charge_all(&[api.url()], run, events, Duration::ZERO).await;
    let pool = db.pool().await;

    // Started again after each abort, until every delivery has ended. Each
    // abort ends a claim whose deliveries are due again after the lease;
    // every claim sends at least one delivery its first time, so there are
    // at most as many aborts as deliveries. How many there are depends on
    // how the sends of one claim interleave, so the time allowed is per
    // step, not in all: after each abort, or each delivery ended, the next
    // one comes within a lease and an attempt.
    let deliveries = 2 * events;
    let step = DELIVERY.lease() + DELIVERY.attempted_within();
    let mut aborts = 0;
    start_through_aborts(&mut hooks, &mut aborts).await;
    let mut deadline = Instant::now() + step;
    let mut last_pending = i64::MAX;
    loop {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE status = 'pending'")
                .fetch_one(&pool)
                .await
                .unwrap();
        if pending == 0 {
            break;
        }
        if pending < last_pending {
            last_pending = pending;
            deadline = Instant::now() + step;
        }
        if !hooks.alive() {
            let status = hooks.wait_exit().await;
            assert!(!status.success(), "aborted, as kill -9 would: {status}");
            aborts += 1;
            start_through_aborts(&mut hooks, &mut aborts).await;
            deadline = Instant::now() + step;
        }
        assert!(
            Instant::now() < deadline,
            "no delivery ended and no abort within {step:?} ({pending} pending, {aborts} aborts)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("{deliveries} deliveries, {aborts} aborts");
    assert!(aborts >= 1, "the worker was killed");
    assert!(
        aborts <= deliveries,
        "each abort cost at least one delivery its first send: {aborts} aborts for {deliveries}"
    );
    // Each start of the process begins a run of its log. Sends run side by
    // side, so two may reach the fault point before the first abort ends
    // the process: count the runs that aborted on purpose, not the lines.
    let log = hooks.log_text();
    let injected = log
        .split("waiting for the database")
        .filter(|run| run.contains("fault injection: aborting the process"))
        .count();
    assert_eq!(
        injected, aborts,
        "every abort was the injected one, after a receiver answered: {log}"
    );

    let report =
        Report::measure("webhook: killed after the receiver's 2xx", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, events as i64);
    let received = received(&pool, run).await;
    assert_eq!(received.len(), events, "one charge.succeeded per charge");
    for r in &received {
        // A receiver's first delivery of an event always asks for the
        // abort, so a delivery recorded succeeded is its second at least.
        assert!(
            r.inbox_deliveries >= 2 && r.naive_deliveries >= 2,
            "{} delivered again after the abort: {r:?}",
            r.event
        );
        assert_eq!(r.inbox_shipped, 1, "the inbox shipped once: {r:?}");
        assert_eq!(
            r.naive_shipped,
            i64::from(r.naive_deliveries),
            "the naive receiver shipped every delivery: {r:?}"
        );
    }
    let (inbox_deliveries, inbox_events, inbox_shipped) =
        counts(&http, &hooks.url(), run, "inbox").await;
    let (naive_deliveries, naive_events, naive_shipped) =
        counts(&http, &hooks.url(), run, "naive").await;
    let events = events as i64;
    assert!(inbox_deliveries >= 2 * events && naive_deliveries >= 2 * events);
    assert_eq!((inbox_events, inbox_shipped), (events, events));
    assert_eq!(naive_events, events);
    assert!(
        naive_shipped >= 2 * events,
        "the naive receiver shipped every event more than once: {naive_shipped}"
    );
    let sent = sent(&pool).await;
    assert_eq!(
        sent.len(),
        deliveries,
        "one delivery per event and endpoint"
    );
    for s in &sent {
        assert_eq!(s.status, "succeeded", "{s:?}");
        assert!(s.attempts >= 2, "the killed attempt, then another: {s:?}");
        assert_eq!(s.answered_2xx, 1, "one recorded 2xx: {s:?}");
    }
    let begun: i64 = sent.iter().map(|s| i64::from(s.attempts)).sum();
    let recorded: i64 = sent.iter().map(|s| s.recorded).sum();
    assert!(
        recorded < begun,
        "the killed attempts have no record: {recorded} of {begun}"
    );
    assert_eq!(report.delivered.map(|d| d.shipped), Some(events));
}

/// One recorded attempt.
#[derive(Debug, sqlx::FromRow)]
struct Attempt {
    delivery_id: i64,
    attempt: i32,
    started_at: chrono::DateTime<chrono::Utc>,
    response_status: Option<i16>,
    error: Option<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_a_while_gets_every_event_once_it_is_back_and_the_inbox_ships_each_once()
 {
    let db = Database::create_empty().await;
    let run = "down";
    let events = 5 * scale();
    // The API and the worker under test.
    let server = Server::start(&db.url, &DELIVERY.env()).await;
    // The merchant's order system: another process, serving the receivers.
    // Its worker idles after its pass at start (which delivers what is due
    // then, as any instance would).
    let mut order_system = Server::start(&db.url, &[RECEIVERS_ON, IDLE_WORKER]).await;
    let http = client(Duration::from_secs(15));
    let url = receiver_url(&order_system.url(), "inbox", run);
    let secret = endpoint(&http, &server.url(), &url).await;
    receiver(&http, &order_system.url(), run, "inbox", &secret, 0, None).await;
    // Down: nothing listens on its port.
    order_system.stop();
    let outcomes = charge_all(&[server.url()], run, events, Duration::ZERO).await;
    let pool = db.pool().await;

    // Every delivery fails, and is retried with backoff: wait until each
    // has failed three times.
    let failures: usize = 3;
    let retried_by = Instant::now()
        + (DELIVERY.retry_base * 7).min(DELIVERY.retry_max * 3)
        + DELIVERY.attempted_within() * failures as u32;
    eventually(retried_by, "every delivery failed three times", || async {
        let short: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM webhook_deliveries d
              WHERE (SELECT count(*) FROM webhook_attempts a WHERE a.delivery_id = d.id) < $1",
        )
        .bind(failures as i64)
        .fetch_one(&pool)
        .await
        .unwrap();
        (short == 0).then_some(())
    })
    .await;
    let back_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&pool)
        .await
        .unwrap();
    order_system.restart().await;
    // Each delivery is due again within RETRY_MAX of its last failure.
    wait_until_delivered(
        &pool,
        Instant::now() + DELIVERY.retry_max + DELIVERY.attempted_within(),
    )
    .await;

    let report = Report::measure("webhook: receiver down, then back", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, events as i64);

    // The attempts while it was down: refused connections. Each retry came
    // after at least half its backoff (the jitter keeps half).
    let attempts: Vec<Attempt> = sqlx::query_as(
        "SELECT delivery_id, attempt, started_at, response_status, error
           FROM webhook_attempts ORDER BY delivery_id, attempt",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let sent = sent(&pool).await;
    assert_eq!(sent.len(), events);
    for s in &sent {
        let mine: Vec<_> = attempts.iter().filter(|a| a.delivery_id == s.id).collect();
        assert_eq!(s.status, "succeeded", "{s:?}");
        assert_eq!(i64::from(s.attempts), s.recorded, "none cut short: {s:?}");
        assert!(s.attempts > failures as i32, "{s:?}");
        let (last, failed) = mine.split_last().unwrap();
        assert_eq!(
            last.response_status,
            Some(200),
            "the last attempt delivered: {last:?}"
        );
        let down: Vec<_> = failed.iter().filter(|a| a.started_at < back_at).collect();
        assert!(down.len() >= failures, "{mine:?}");
        for a in &down {
            assert!(
                a.response_status.is_none()
                    && a.error.as_deref().is_some_and(|e| e.starts_with("connect")),
                "a refused connection while the receiver was down: {a:?}"
            );
        }
        for pair in mine.windows(2) {
            let (n, waited) = (pair[0].attempt, pair[1].started_at - pair[0].started_at);
            let backoff = DELIVERY
                .retry_base
                .saturating_mul(1 << (n - 1).min(20))
                .min(DELIVERY.retry_max);
            assert!(
                waited.to_std().unwrap() >= backoff / 2,
                "attempt {} came {waited} after attempt {n}, sooner than half of {backoff:?}",
                n + 1
            );
        }
    }
    let refused = metric(
        &http,
        &server.url(),
        r#"webhook_attempts_total{result="connect_error"}"#,
    )
    .await;
    assert!(refused >= (failures * events) as f64, "{refused}");
    let received = received(&pool, run).await;
    assert_eq!(received.len(), events);
    for r in &received {
        assert!(r.inbox_deliveries >= 1, "{r:?}");
        assert_eq!(r.inbox_shipped, 1, "the inbox shipped once: {r:?}");
    }
    let (_, inbox_events, inbox_shipped) = counts(&http, &order_system.url(), run, "inbox").await;
    assert_eq!(
        (inbox_events, inbox_shipped),
        (events as i64, events as i64)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_delivering_from_one_database_send_each_attempt_once_and_the_inbox_ships_each_once()
 {
    let db = Database::create_empty().await;
    let run = "three";
    let events = 20 * scale();
    // Workers that poll often, so that two or three of them often claim at
    // the same moment: were the claim not to lock what it takes, two would
    // take one delivery (this is how the test was seen to fail without it).
    let delivery = Delivery {
        poll_interval: Duration::from_millis(10),
        ..DELIVERY
    };
    let mut settings = delivery.env();
    settings.extend([
        (RECEIVERS_ON.0, RECEIVERS_ON.1.to_owned()),
        ("PROCESSOR_LATENCY_MS", "30".to_owned()),
    ]);
    let servers = [
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
        Server::start(&db.url, &settings).await,
    ];
    let urls: Vec<String> = servers.iter().map(Server::url).collect();
    let http = client(Duration::from_secs(15));
    // The order system is the first instance's receiver; every worker
    // sends to it.
    let secret = endpoint(&http, &urls[0], &receiver_url(&urls[0], "inbox", run)).await;
    receiver(&http, &urls[0], run, "inbox", &secret, 0, None).await;
    // A burst of charges across the three, one every 20 ms (two polls), so
    // that each worker finds some of the deliveries due.
    let outcomes = charge_all(&urls, run, events, Duration::from_millis(20)).await;
    let pool = db.pool().await;
    wait_until_delivered(&pool, Instant::now() + delivery.attempted_within() * 2).await;

    let report = Report::measure("webhook: three instances, one database", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, events as i64);
    let sent = sent(&pool).await;
    assert_eq!(sent.len(), events);
    for s in &sent {
        assert_eq!(s.status, "succeeded", "{s:?}");
        assert_eq!(
            s.answered_2xx, 1,
            "no attempt was sent by two workers: {s:?}"
        );
    }
    let received = received(&pool, run).await;
    assert_eq!(received.len(), events);
    for r in &received {
        assert_eq!(r.inbox_shipped, 1, "the inbox shipped once: {r:?}");
    }

    // Who delivered, from each process's own counters.
    let mut delivered = Vec::new();
    let mut lost_leases = Vec::new();
    for url in &urls {
        delivered
            .push(metric(&http, url, r#"webhook_attempts_total{result="delivered"}"#).await as i64);
        lost_leases.push(metric(&http, url, "webhook_leases_lost_total").await as i64);
    }
    eprintln!("{events} events; delivered per instance: {delivered:?}");
    assert_eq!(
        delivered.iter().sum::<i64>(),
        events as i64,
        "each delivery delivered once, by one instance: {delivered:?}"
    );
    assert!(
        delivered.iter().filter(|n| **n > 0).count() >= 2,
        "more than one instance delivered: {delivered:?}"
    );
    assert_eq!(lost_leases, [0, 0, 0], "no worker overtook another");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_check_finds_every_lost_delivery_every_wrong_shipment_and_every_charge_without_its_event()
 {
    let db = Database::create().await;
    let pool = db.pool().await;
    assert_eq!(webhook_violations(&pool).await, Vec::<String>::new());
    // The ids the statement below gives the events.
    let evt = |n: u8| format!("evt_{n:0<24}");
    // One event delivered and shipped once, and one of each way to break
    // the property.
    sqlx::query(
        "WITH m AS (INSERT INTO merchants (id, name, api_key_hash)
                    VALUES (gen_random_uuid(), 'hooks', sha256('hooks'::bytea)) RETURNING id),
         c AS (INSERT INTO charges (id, merchant_id, amount, currency, source, status)
               SELECT c.id, m.id, 100, 'usd', 'tok_visa', 'succeeded'
                 FROM m, (VALUES ('ch_1'), ('ch_2'), ('ch_3'), ('ch_4'), ('ch_5'),
                                 ('ch_silent')) AS c(id)
               RETURNING id),
         e AS (INSERT INTO events (id, merchant_id, type, object_id, data)
               SELECT rpad('evt_' || e.n, 28, '0'), m.id, 'charge.succeeded', e.object_id,
                      json_build_object('id', e.object_id, 'object', 'charge',
                                        'status', 'succeeded')
                 FROM m, (VALUES (1, 'ch_1'), (2, 'ch_2'), (3, 'ch_3'), (4, 'ch_4'),
                                 (5, 'ch_5')) AS e(n, object_id)
               RETURNING seq, id),
         w AS (INSERT INTO webhook_endpoints (id, merchant_id, url, enabled_events, secret)
               SELECT 'we_' || repeat('a', 24), m.id, 'http://127.0.0.1:9/hooks',
                      ARRAY['charge.succeeded'], 'whsec_' || repeat('a', 32)
                 FROM m RETURNING id),
         d AS (INSERT INTO webhook_deliveries (event_seq, endpoint_id, status, attempts,
                                               failure_reason, finished_at)
               SELECT e.seq, w.id, s.status, 2, s.reason,
                      CASE WHEN s.status <> 'pending' THEN now() END
                 FROM w, e JOIN (VALUES (1, 'succeeded', NULL), (2, 'succeeded', NULL),
                                        (3, 'succeeded', NULL), (4, 'pending', NULL),
                                        (5, 'failed', 'attempts_exhausted'))
                               AS s(n, status, reason) ON e.id = rpad('evt_' || s.n, 28, '0')),
         run AS (INSERT INTO demo_receiver_runs (run, merchant_id) SELECT 'r', m.id FROM m),
         r AS (INSERT INTO demo_receivers (run, mode, merchant_id, secret)
               SELECT 'r', mode, m.id, 'whsec_a' FROM m, (VALUES ('naive'), ('inbox')) AS r(mode)
               RETURNING run, mode),
         received AS (
               INSERT INTO demo_receiver_deliveries (run, mode, event_id, deliveries)
               SELECT 'r', r.mode, r.event_id, r.n
                 FROM (VALUES ('naive', rpad('evt_1', 28, '0'), 3),
                              ('inbox', rpad('evt_1', 28, '0'), 3),
                              ('inbox', rpad('evt_2', 28, '0'), 2),
                              ('inbox', 'evt_nowhere', 1)) AS r(mode, event_id, n)
                WHERE EXISTS (SELECT 1 FROM r))
         INSERT INTO demo_shipments (run, mode, event_id)
         SELECT 'r', s.mode, s.event_id
           FROM (VALUES ('naive', rpad('evt_1', 28, '0')), ('naive', rpad('evt_1', 28, '0')),
                        ('naive', rpad('evt_1', 28, '0')), ('inbox', rpad('evt_1', 28, '0')),
                        ('inbox', rpad('evt_2', 28, '0')), ('inbox', rpad('evt_2', 28, '0')),
                        ('inbox', 'evt_nowhere'), ('inbox', rpad('evt_3', 28, '0')))
                AS s(mode, event_id)
          WHERE EXISTS (SELECT 1 FROM r)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let violations = webhook_violations(&pool).await;
    for what in [
        // A change without its event (a second one the schema refuses).
        "charge ch_silent succeeded with 0 charge.succeeded events".to_owned(),
        // The inbox shipping twice, shipping what it never received, and
        // receiving what oncepay never sent.
        format!(
            "the inbox of run r received {} 2 times and shipped 2 orders for it",
            evt(2)
        ),
        format!(
            "the inbox of run r shipped an order for {}, which it never received",
            evt(3)
        ),
        "the inbox of run r received evt_nowhere, which is no event of this database".to_owned(),
        // Deliveries lost: one never ended, one given up.
        format!("the delivery of {} to we_", evt(4)),
        format!("the delivery of {} to we_", evt(5)),
    ] {
        assert!(
            violations.iter().any(|v| v.starts_with(&what)),
            "{what}: {violations:#?}"
        );
    }
    assert_eq!(
        violations.len(),
        6,
        "and nothing else (the naive receiver ships as it likes): {violations:#?}"
    );
}

/// A receiver in this process that, while `hang` is set, takes each request
/// in and never answers (holding the connection), and otherwise answers
/// `200` at once. Setting it to answer drops the held connections.
struct Switchable {
    url: String,
    hang: std::sync::Arc<std::sync::atomic::AtomicBool>,
    held: std::sync::Arc<std::sync::Mutex<Vec<tokio::net::TcpStream>>>,
    requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    server: tokio::task::JoinHandle<()>,
}

impl Switchable {
    async fn start(hang: bool) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let hang = Arc::new(AtomicBool::new(hang));
        let held = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(AtomicUsize::new(0));
        let (h, k, r) = (hang.clone(), held.clone(), requests.clone());
        let server = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                let (h, k, r) = (h.clone(), k.clone(), r.clone());
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    // The request, headers and body, read whole.
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                            let length: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            if buf.len() >= end + 4 + length {
                                break;
                            }
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    r.fetch_add(1, Ordering::SeqCst);
                    if h.load(Ordering::SeqCst) {
                        k.lock().unwrap().push(stream);
                        return;
                    }
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        )
                        .await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Switchable {
            url,
            hang,
            held,
            requests,
            server,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Answers from now on, and lets go of the connections it held.
    fn answer(&self) {
        self.hang.store(false, std::sync::atomic::Ordering::SeqCst);
        self.held.lock().unwrap().clear();
    }
}

impl Drop for Switchable {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Latencies in milliseconds: the median, the 90th percentile, the most.
fn summary(latencies: &[f64]) -> (f64, f64, f64) {
    let mut sorted = latencies.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.9), at(1.0))
}

/// Charges the quiet merchant `count` times, one after the other, each
/// once the webhook of the one before has been delivered; returns each
/// operation and how long from its event's writing to the end of the
/// attempt that delivered it, in milliseconds, as recorded.
async fn timed_charges(
    http: &reqwest::Client,
    url: &str,
    pool: &PgPool,
    phase: &str,
    count: usize,
    within: Duration,
) -> (Vec<OpOutcome>, Vec<f64>) {
    let mut outcomes = Vec::new();
    let mut latencies = Vec::new();
    for n in 0..count {
        let op = format!("quiet-{phase}-{n}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let outcome = drive(
            http,
            &[url.to_owned()],
            &op,
            &crate::harness::charge_body(&op, 500, "tok_visa"),
            &[],
            deadline,
        )
        .await;
        let charge = outcome.answers[0].id.clone().expect("a charge id");
        outcomes.push(outcome);
        let latency: f64 = eventually(
            Instant::now() + within,
            &format!("the quiet merchant's webhook of {charge} delivered"),
            || async {
                sqlx::query_scalar::<_, f64>(
                    "SELECT (extract(epoch FROM a.started_at - e.created_at) * 1000
                             + a.duration_ms)::float8
                       FROM webhook_attempts a
                       JOIN webhook_deliveries d ON d.id = a.delivery_id
                       JOIN events e ON e.seq = d.event_seq
                      WHERE e.object_id = $1 AND a.response_status BETWEEN 200 AND 299",
                )
                .bind(&charge)
                .fetch_optional(pool)
                .await
                .unwrap()
            },
        )
        .await;
        latencies.push(latency);
    }
    (outcomes, latencies)
}

/// One merchant has sixteen endpoints that never answer and six charges
/// (96 deliveries, each held for `WEBHOOK_TIMEOUT`); another merchant's
/// webhooks are timed, alone and then beside them, in one run. The figures
/// are printed (and appended to `CHAOS_FIGURES` for `scripts/chaos`); the
/// assertion is only that the quiet merchant's webhooks, beside the
/// hanging ones, arrive well within the time a hanging send takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_merchants_hanging_endpoints_leave_another_merchants_webhooks_on_time() {
    let db = Database::create_empty().await;
    let delivery = Delivery {
        poll_interval: Duration::from_millis(20),
        ..DELIVERY
    };
    let server = Server::start(&db.url, &delivery.env()).await;
    let pool = db.pool().await;
    let http = client(Duration::from_secs(15));
    let samples = 10 * scale();

    // The quiet merchant (the servers' demo merchant) and its receiver.
    let quiet = Switchable::start(false).await;
    endpoint(&http, &server.url(), &format!("{}/hooks", quiet.url)).await;
    // The noisy merchant, with sixteen endpoints that hang.
    let (_, noisy_key) = oncepay::merchants::create(&pool, "noisy").await.unwrap();
    let noisy_key = noisy_key.expose().to_owned();
    let hanging = Switchable::start(true).await;
    for n in 0..16 {
        let created = http
            .post(format!("{}/v1/webhook_endpoints", server.url()))
            .bearer_auth(&noisy_key)
            .json(&json!({"url": format!("{}/hooks/{n}", hanging.url),
                          "enabled_events": ["charge.succeeded"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(created.status(), 201);
    }

    let within = delivery.attempted_within();
    let (mut outcomes, alone) =
        timed_charges(&http, &server.url(), &pool, "alone", samples, within).await;

    let noisy_charges = 6;
    for n in 0..noisy_charges {
        let op = format!("noisy-{n}");
        let answer = http
            .post(format!("{}/v1/charges", server.url()))
            .bearer_auth(&noisy_key)
            .header("Idempotency-Key", &op)
            .json(&crate::harness::charge_body(&op, 700, "tok_visa"))
            .send()
            .await
            .unwrap();
        let status = answer.status().as_u16();
        let body: Value = answer.json().await.unwrap();
        assert_eq!(status, 201, "{body}");
        let mut outcome = OpOutcome::new(&op, &op);
        outcome.requests = 1;
        outcome.answered(status, &body);
        outcomes.push(outcome);
    }
    eventually(
        Instant::now() + within,
        "the hanging endpoints hold the noisy merchant's senders",
        || async { (hanging.requests() >= 8).then_some(()) },
    )
    .await;
    let (quiet_beside, beside) =
        timed_charges(&http, &server.url(), &pool, "beside", samples, within).await;
    outcomes.extend(quiet_beside);
    let hung_sends = hanging.requests();

    let (a50, a90, amax) = summary(&alone);
    let (b50, b90, bmax) = summary(&beside);
    let ratio = b50 / a50.max(1.0);
    let figures = format!(
        "webhook latency of a quiet merchant, {samples} charges each (ms, event written to \
         delivered; WEBHOOK_TIMEOUT={timeout:?}): alone p50 {a50:.0} p90 {a90:.0} max {amax:.0}; \
         beside 16 hanging endpoints of another merchant ({noisy_charges} charges, {hung_sends} \
         sends taken in by them, none answered) p50 {b50:.0} p90 {b90:.0} max {bmax:.0}; p50 ratio {ratio:.2} ({verdict} 1.5x)",
        timeout = delivery.timeout,
        verdict = if ratio <= 1.5 { "within" } else { "over" },
    );
    eprintln!("{figures}");
    if let Ok(path) = std::env::var("CHAOS_FIGURES") {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        writeln!(file, "{figures}").unwrap();
    }
    assert!(
        b50 < delivery.timeout.as_secs_f64() * 1000.0 / 2.0,
        "the quiet merchant's webhooks waited for the hanging sends: {figures}"
    );

    // The noisy merchant's endpoints come back; everything is delivered.
    hanging.answer();
    wait_until_delivered(
        &pool,
        Instant::now() + delivery.retry_max + delivery.attempted_within() * 4,
    )
    .await;
    let report = Report::measure("webhook: one merchant's endpoints hang", &pool, &outcomes).await;
    report.publish();
    report.assert_exactly_once();
    assert_eq!(report.succeeded, (2 * samples + noisy_charges) as i64);
}
