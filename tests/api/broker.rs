//! Events through NATS JetStream: the relay publishes the outbox once per
//! position with the event's id as `Nats-Msg-Id`, the stream's duplicate
//! window drops a republish inside it, and the ledger's inbox applies each
//! event once whatever the broker delivers. Needs a NATS server with
//! JetStream at `NATS_URL` (default nats://127.0.0.1:4222; scripts/test
//! finds or starts one); each test has a stream and subjects of its own.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, message::PublishMessage};
use futures::StreamExt as _;
use oncepay::broker::{self, ledger, relay};
use oncepay::config::{Broker, NatsUrls};
use serde_json::json;
use sqlx::Connection as _;
use tokio_util::sync::CancellationToken;

use crate::capture::{authorized_charge, post_capture};
use crate::helpers::{Answer, Settings, TestApp, spawn_app, spawn_app_with, until};

/// One test's broker settings: NATS from `NATS_URL`, a stream and subject
/// prefix of its own, the given duplicate window and ack wait.
pub(crate) fn settings(app: &TestApp, window: Duration, ack_wait: Duration) -> Broker {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let mut config = app.config.broker.clone();
    config.nats_url = Some(NatsUrls(url.split(',').map(str::to_owned).collect()));
    config.stream = format!("TEST_{tag}");
    config.subject_prefix = format!("test.{tag}");
    config.duplicate_window = window;
    config.ack_wait = ack_wait;
    config.batch = 50;
    config
}

/// The JetStream context, with a message naming `NATS_URL` when there is
/// no server, and the test's stream made.
pub(crate) async fn js(config: &Broker) -> jetstream::Context {
    let js = broker::connect(config).await.unwrap_or_else(|e| {
        panic!("no NATS server with JetStream ({e:#}); set NATS_URL, or run scripts/test, which finds or starts one")
    });
    broker::stream(&js, config).await.unwrap();
    js
}

/// Three paid charges and a refund of one, and the events they wrote:
/// four that book money (three charges in, one refund out) among them.
async fn some_money_moved(app: &TestApp) {
    let first = app.paid_charge(1500).await;
    app.paid_charge(2500).await;
    app.paid_charge(700).await;
    let refund = Answer::of(
        app.post_refund(None, &json!({"charge": first, "amount": 500}))
            .await,
    )
    .await;
    assert_eq!(refund.status, 201, "{:?}", refund.body);
}

/// The relay's own session, with its lock taken.
pub(crate) async fn relay_session(app: &TestApp, config: &Broker) -> sqlx::PgConnection {
    let mut conn = sqlx::PgConnection::connect_with(&app.pool.connect_options())
        .await
        .unwrap();
    assert!(relay::try_lock(&mut conn, &config.stream).await.unwrap());
    conn
}

/// Publishes and records until every event of the database is published;
/// returns the batches. The relay sees an event only once every older
/// transaction on the server has ended, and tests of other databases on the
/// same server hold some open, so a pass may find nothing yet.
pub(crate) async fn relay_all(
    conn: &mut sqlx::PgConnection,
    js: &jetstream::Context,
    config: &Broker,
) -> usize {
    let newest = newest_event(conn).await;
    let mut batches = 0;
    while relay::position(conn, &config.stream).await.unwrap() < newest {
        let published = publish_visible(conn, js, config).await;
        relay::record(conn, &config.stream, published)
            .await
            .unwrap();
        batches += 1;
    }
    batches
}

/// One batch, published and not recorded, once the relay sees one.
pub(crate) async fn publish_visible(
    conn: &mut sqlx::PgConnection,
    js: &jetstream::Context,
    config: &Broker,
) -> relay::Published {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(published) = relay::publish_next(conn, js, config).await.unwrap() {
            return published;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no event visible to the relay in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The position of the newest event written.
async fn newest_event(conn: &mut sqlx::PgConnection) -> relay::Position {
    let (txid, seq): (i64, i64) =
        sqlx::query_as("SELECT txid, seq FROM events ORDER BY txid DESC, seq DESC LIMIT 1")
            .fetch_one(conn)
            .await
            .unwrap();
    relay::Position { txid, seq }
}

/// How many events lie at or before `last`: what a batch up to it held.
async fn events_up_to(conn: &mut sqlx::PgConnection, last: relay::Position) -> u64 {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE (txid, seq) <= ($1, $2)")
        .bind(last.txid)
        .bind(last.seq)
        .fetch_one(conn)
        .await
        .unwrap();
    n as u64
}

pub(crate) async fn stream_messages(js: &jetstream::Context, config: &Broker) -> u64 {
    let mut stream = js.get_stream(&config.stream).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// The events' ids in the list's order (txid, seq), which is commit order.
async fn event_ids(app: &TestApp) -> Vec<String> {
    sqlx::query_scalar("SELECT id FROM events ORDER BY txid, seq")
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_relay_publishes_each_event_once_in_commit_order_under_its_id() {
    let app = spawn_app().await;
    some_money_moved(&app).await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;

    assert!(relay_all(&mut conn, &js, &config).await >= 1);
    let ids = event_ids(&app).await;
    assert_eq!(ids.len() as i64, app.events().await);
    let stream = js.get_stream(&config.stream).await.unwrap();
    for (n, id) in ids.iter().enumerate() {
        let message = stream.get_raw_message(n as u64 + 1).await.unwrap();
        let msg_id = message
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .unwrap();
        assert_eq!(msg_id.as_str(), id, "message {} is the {n}th event", n + 1);
        let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(event["id"], id.as_str());
        assert!(
            message
                .subject
                .starts_with(&format!("{}.{}.", config.subject_prefix, app.merchant_id))
        );
    }
    // Nothing new: nothing published again.
    assert!(
        (relay::publish_next(&mut conn, &js, &config).await.unwrap()).is_none(),
        "nothing left to publish"
    );
    assert_eq!(stream_messages(&js, &config).await, ids.len() as u64);
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn a_relay_killed_before_its_record_publishes_again_and_the_window_keeps_one_copy() {
    let app = spawn_app().await;
    some_money_moved(&app).await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let events = app.events().await as u64;
    {
        // Published and acknowledged, then killed before the record: the
        // position stays where it was.
        let mut conn = relay_session(&app, &config).await;
        publish_visible(&mut conn, &js, &config).await;
        assert_eq!(
            relay::position(&mut conn, &config.stream).await.unwrap(),
            Default::default()
        );
    }
    // The session died with the process, and its lock with it.
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;
    assert_eq!(
        stream_messages(&js, &config).await,
        events,
        "one copy of each event"
    );
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn after_the_window_the_stream_holds_two_copies_and_the_inbox_applies_one() {
    let app = spawn_app().await;
    some_money_moved(&app).await;
    let config = settings(&app, Duration::from_secs(1), Duration::from_secs(30));
    let js = js(&config).await;
    let events = app.events().await as u64;
    let mut conn = relay_session(&app, &config).await;
    let first = publish_visible(&mut conn, &js, &config).await;
    let republished = events_up_to(&mut conn, first.last).await;
    // A relay down longer than the window: its repeat is no duplicate to the
    // stream. The broker forgets ids on a timer, so well past the window.
    tokio::time::sleep(Duration::from_secs(3)).await;
    relay_all(&mut conn, &js, &config).await;
    assert!(republished >= 1);
    assert_eq!(
        stream_messages(&js, &config).await,
        events + republished,
        "two copies of each event of the first batch"
    );

    let stop = CancellationToken::new();
    let consumer = tokio::spawn(ledger::run(
        app.pool.clone(),
        config.clone(),
        "ledger".into(),
        stop.clone(),
    ));
    until(Duration::from_secs(20), "every copy consumed", || async {
        app.count("SELECT count(*) FROM consumer_inbox").await == events as i64
            && ack_pending(&js, &config, "ledger").await == (0, 0)
    })
    .await;
    stop.cancel();
    consumer.await.unwrap().unwrap();
    assert_eq!(
        ledger::check(&app.pool, "ledger").await.unwrap(),
        vec![],
        "one entry per charge and refund"
    );
    assert_eq!(app.count("SELECT count(*) FROM ledger_entries").await, 4);
    assert_eq!(
        app.count("SELECT sum(amount)::bigint FROM ledger_entries")
            .await,
        1500 + 2500 + 700 - 500
    );
    js.delete_stream(&config.stream).await.unwrap();
}

/// The durable consumer's messages not yet delivered and not yet acked.
async fn ack_pending(js: &jetstream::Context, config: &Broker, name: &str) -> (u64, usize) {
    let stream = js.get_stream(&config.stream).await.unwrap();
    let mut consumer: PullConsumer = stream.get_consumer(name).await.unwrap();
    let info = consumer.info().await.unwrap();
    (info.num_pending, info.num_ack_pending)
}

#[tokio::test]
async fn a_consumer_killed_after_its_commit_leaves_its_messages_to_another_and_the_inbox_holds() {
    let app = spawn_app().await;
    some_money_moved(&app).await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(1));
    let js = js(&config).await;
    let events = app.events().await as usize;
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;

    // The first consumer process applies every message and commits, then
    // dies before any ack.
    let first = ledger::consumer(&config, "ledger").await.unwrap();
    let mut messages = first.messages().await.unwrap();
    for _ in 0..events {
        let message = messages.next().await.unwrap().unwrap();
        let delivery = ledger::Delivery::of(&message).unwrap();
        let outcome = ledger::receive(&app.pool, &config, "ledger", &delivery)
            .await
            .unwrap();
        assert!(
            matches!(outcome, ledger::Outcome::Booked | ledger::Outcome::Ignored),
            "{outcome:?}"
        );
    }
    drop(messages);

    // The second process on the same durable consumer gets them again
    // after the ack wait, and its inbox finds each already applied.
    let stop = CancellationToken::new();
    let second = tokio::spawn(ledger::run(
        app.pool.clone(),
        config.clone(),
        "ledger".into(),
        stop.clone(),
    ));
    until(
        Duration::from_secs(20),
        "every message redelivered and acked",
        || async { ack_pending(&js, &config, "ledger").await == (0, 0) },
    )
    .await;
    stop.cancel();
    second.await.unwrap().unwrap();
    let stream = js.get_stream(&config.stream).await.unwrap();
    let mut durable: PullConsumer = stream.get_consumer("ledger").await.unwrap();
    // Its delivery count counts every delivery: each message twice.
    let deliveries = durable.info().await.unwrap().delivered.consumer_sequence;
    assert_eq!(
        deliveries,
        2 * events as u64,
        "the broker delivered each message again"
    );
    assert_eq!(ledger::check(&app.pool, "ledger").await.unwrap(), vec![]);
    assert_eq!(app.count("SELECT count(*) FROM ledger_entries").await, 4);
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn relays_racing_on_one_database_publish_each_event_once() {
    let app = spawn_app().await;
    for _ in 0..10 {
        app.paid_charge(1000).await;
    }
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    // Every publish, as sent: the stream would drop a repeat inside its
    // window, a plain subscriber on the subjects sees it.
    let url = &config.nats_url.as_ref().unwrap().0[0];
    let client = async_nats::connect(url.as_str()).await.unwrap();
    let mut sent = client
        .subscribe(format!("{}.>", config.subject_prefix))
        .await
        .unwrap();
    client.flush().await.unwrap();

    let stop = CancellationToken::new();
    let relays: Vec<_> = (0..4)
        .map(|_| tokio::spawn(relay::run(app.pool.clone(), config.clone(), stop.clone())))
        .collect();
    let events = app.events().await as u64;
    until(Duration::from_secs(20), "every event published", || async {
        stream_messages(&js, &config).await >= events
    })
    .await;
    // More charges while four relays run.
    for _ in 0..5 {
        app.paid_charge(1000).await;
    }
    let events = app.events().await as u64;
    until(
        Duration::from_secs(20),
        "the new events published",
        || async { stream_messages(&js, &config).await >= events },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    for relay in relays {
        relay.await.unwrap();
    }
    let mut publishes = 0;
    while tokio::time::timeout(Duration::from_millis(300), sent.next())
        .await
        .is_ok()
    {
        publishes += 1;
    }
    assert_eq!(publishes, events, "each event published once, by one relay");
    assert_eq!(stream_messages(&js, &config).await, events);
    js.delete_stream(&config.stream).await.unwrap();
}

/// A workshop server on NATS, its streams its own, the relay off.
async fn workshop_app() -> (TestApp, String) {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    // Under the workshop's own short timeouts, which the card must fit.
    let settings = Settings::workshop()
        .set("NATS_URL", &url)
        .set("NATS_STREAM", format!("TEST_{tag}"))
        .set("NATS_SUBJECT_PREFIX", format!("test.{tag}"));
    (
        spawn_app_with(settings).await,
        format!("TEST_{tag}_WORKSHOP"),
    )
}

async fn post_form(app: &TestApp, path: &str, form: &[(&str, &str)]) -> Answer {
    let request = app
        .client
        .post(app.url(path))
        .bearer_auth(&app.api_key)
        .form(form);
    Answer::of(request.send().await.unwrap()).await
}

#[tokio::test]
async fn a_redelivered_event_is_booked_twice_by_the_naive_handler_and_once_through_the_inbox() {
    let (app, stream) = workshop_app().await;
    for (handler, effects, handled) in [
        ("naive", 2, json!(["booked", "booked"])),
        (
            "inbox",
            1,
            json!(["booked", "in the inbox already: skipped"]),
        ),
    ] {
        let run = format!("demo-12-{handler}");
        let answer = post_form(
            &app,
            "/demo/broker/deliveries",
            &[("run", &run), ("handler", handler)],
        )
        .await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        let body = answer.json();
        assert_eq!(body["handled"], handled, "{handler}");
        assert_eq!(body["effects"], effects, "{handler}");
        assert_eq!(body["effects_before"], 0, "{handler}");
        let consumer = format!("workshop-{handler}-{run}");
        let booked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM ledger_entries WHERE consumer = $1")
                .bind(&consumer)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert_eq!(booked, effects, "{handler}: the effects in the database");
    }
    let js = js(&settings(
        &app,
        Duration::from_secs(1),
        Duration::from_secs(1),
    ))
    .await;
    js.delete_stream(&stream).await.unwrap();
}

#[tokio::test]
async fn a_publish_repeated_inside_the_window_is_one_message_and_after_it_two() {
    let (app, stream) = workshop_app().await;
    let answer = post_form(&app, "/demo/broker/window", &[("run", "demo-12-window")]).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let body = answer.json();
    assert_eq!(body["duplicate"], json!([false, true, false]));
    assert_eq!(
        (body["inside"].as_u64(), body["after"].as_u64()),
        (Some(1), Some(2))
    );
    let js = js(&settings(
        &app,
        Duration::from_secs(1),
        Duration::from_secs(1),
    ))
    .await;
    js.delete_stream(&stream).await.unwrap();
}

#[tokio::test]
async fn without_a_broker_the_workshop_scenario_is_503_broker_unavailable_saying_why() {
    let app = spawn_app_with(Settings::new().set("DEMO_UNSAFE_ENDPOINTS", "true")).await;
    let answer = post_form(&app, "/demo/broker/window", &[("run", "demo-12")]).await;
    answer.assert_problem(503, "broker_unavailable");
    let detail = answer.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(detail.contains("NATS_URL is not set"), "{detail}");
    let answer = post_form(
        &app,
        "/demo/broker/deliveries",
        &[("run", "demo-12"), ("handler", "both")],
    )
    .await;
    answer.assert_problem(400, "parameter_invalid_string");
}

/// The ledger's name in one test: its own, as the process's metrics are
/// shared by every test of the binary.
fn ledger_name(config: &Broker) -> String {
    format!("ledger-{}", config.stream.to_lowercase())
}

/// Runs the ledger consumer `name` until the broker has nothing left for it
/// (every message delivered and acknowledged or terminated), then stops it.
/// A message that comes again for ever fails the test.
async fn consume_all(app: &TestApp, js: &jetstream::Context, config: &Broker, name: &str) {
    let stop = CancellationToken::new();
    let consumer = tokio::spawn(ledger::run(
        app.pool.clone(),
        config.clone(),
        name.to_owned(),
        stop.clone(),
    ));
    until(
        Duration::from_secs(30),
        "every message acknowledged, none left to come again",
        || async { idle(js, config, name).await },
    )
    .await;
    stop.cancel();
    consumer.await.unwrap().unwrap();
}

/// Whether the durable consumer `name` exists and has nothing pending.
async fn idle(js: &jetstream::Context, config: &Broker, name: &str) -> bool {
    let Ok(stream) = js.get_stream(&config.stream).await else {
        return false;
    };
    let Ok(mut consumer) = stream.get_consumer::<pull::Config>(name).await else {
        return false;
    };
    consumer
        .info()
        .await
        .is_ok_and(|i| i.num_pending == 0 && i.num_ack_pending == 0)
}

/// The messages `name` parked, in stream order: (reason, deliveries).
async fn parked(app: &TestApp, name: &str) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT reason, deliveries FROM consumer_dead_letters
          WHERE consumer = $1 ORDER BY stream_sequence",
    )
    .bind(name)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

/// The ledger of `name`: its entries and their sum.
async fn ledger_of(app: &TestApp, name: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), coalesce(sum(amount), 0)::bigint FROM ledger_entries WHERE consumer = $1",
    )
    .bind(name)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// `broker_consumer_messages_total` of `name` and `outcome` in this process.
fn counted(name: &str, outcome: &str) -> u64 {
    let scrape = oncepay::telemetry::metrics::handle().render();
    let (consumer, outcome) = (
        format!("consumer=\"{name}\""),
        format!("outcome=\"{outcome}\""),
    );
    scrape
        .lines()
        .filter(|l| l.starts_with("broker_consumer_messages_total{"))
        .filter(|l| l.contains(&consumer) && l.contains(&outcome))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

/// A refund of `amount` (all that is left when `None`) of `charge`.
async fn refund(app: &TestApp, charge: &str, amount: Option<i64>) {
    let mut body = json!({"charge": charge});
    if let Some(amount) = amount {
        body["amount"] = json!(amount);
    }
    let refund = Answer::of(app.post_refund(None, &body).await).await;
    assert_eq!(refund.status, 201, "{:?}", refund.body);
}

/// A capture of `amount` (all of it when `None`) of the authorization `charge`.
async fn capture(app: &TestApp, charge: &str, amount: Option<i64>) {
    let body = amount.map_or(json!({}), |a| json!({"amount": a}));
    let captured = Answer::of(post_capture(app, charge, None, &body).await).await;
    assert_eq!(captured.status, 200, "{:?}", captured.body);
}

/// What `GET /v1/balance` says is available, in usd.
async fn balance(app: &TestApp) -> i64 {
    let balance = Answer::of(app.get("/v1/balance").await).await.json();
    assert_eq!(balance["available"][0]["currency"], "usd", "{balance}");
    balance["available"][0]["amount"].as_i64().unwrap()
}

#[tokio::test]
async fn the_ledger_books_money_not_authorizations_and_agrees_with_the_balance() {
    let app = spawn_app().await;
    // Paid at once: 1500, and 2500 of which 500 refunded.
    app.paid_charge(1500).await;
    let paid = app.paid_charge(2500).await;
    refund(&app, &paid, Some(500)).await;
    // Authorized, then captured whole: 2000; in part: 1200 of 3000, then 200 refunded.
    let whole = authorized_charge(&app, 2000).await;
    capture(&app, &whole, None).await;
    let part = authorized_charge(&app, 3000).await;
    capture(&app, &part, Some(1200)).await;
    refund(&app, &part, Some(200)).await;
    // No money: an authorization released by a refund, one expired, one
    // still held, and a declined charge.
    let released = authorized_charge(&app, 4000).await;
    refund(&app, &released, None).await;
    let expired = authorized_charge(&app, 5000).await;
    sqlx::query("UPDATE charges SET created_at = now() - interval '7 days 1 minute' WHERE id = $1")
        .bind(&expired)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(app.sweep_once().await.authorizations_expired, 1);
    authorized_charge(&app, 700).await;
    let declined = json!({"amount": 900, "currency": "usd", "source": "tok_chargeDeclined"});
    assert_eq!(app.post_charge(None, &declined).await.status(), 402);

    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;
    let name = ledger_name(&config);
    consume_all(&app, &js, &config, &name).await;

    let money = 1500 + 2500 - 500 + 2000 + 1200 - 200;
    assert_eq!(balance(&app).await, money);
    assert_eq!(
        ledger_of(&app, &name).await,
        (6, money),
        "the ledger books what the balance counts"
    );
    assert_eq!(ledger::check(&app.pool, &name).await.unwrap(), vec![]);
    let events = app.events().await as u64;
    assert_eq!(counted(&name, "booked"), 6);
    assert_eq!(counted(&name, "ignored"), events - 6);
    assert_eq!(counted(&name, "parked"), 0);

    // An authorization booked as money in is a difference to `--check`.
    sqlx::query(
        "INSERT INTO ledger_entries (consumer, event_id, merchant_id, object_id, type, amount, currency)
         SELECT $1, id, merchant_id, object_id, type, 4000, 'usd' FROM events
          WHERE object_id = $2 AND type = 'charge.succeeded'",
    )
    .bind(&name)
    .bind(&released)
    .execute(&app.pool)
    .await
    .unwrap();
    let differences = ledger::check(&app.pool, &name).await.unwrap();
    assert_eq!(differences.len(), 1, "{differences:?}");
    assert_eq!(
        (
            &differences[0].object_id,
            differences[0].expected,
            differences[0].booked
        ),
        (&released, None, Some(4000))
    );
    js.delete_stream(&config.stream).await.unwrap();
}

/// The stream's message holding the first event of type `kind`: its
/// subject and payload.
async fn stored_event(
    js: &jetstream::Context,
    config: &Broker,
    kind: &str,
) -> (String, serde_json::Value) {
    let stream = js.get_stream(&config.stream).await.unwrap();
    for seq in 1.. {
        let message = stream.get_raw_message(seq).await.unwrap();
        let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        if event["type"] == kind {
            return (message.subject.to_string(), event);
        }
    }
    unreachable!()
}

/// Publishes `payload` to `subject`, with `Nats-Msg-Id` = `id` when given,
/// as something other than the relay would.
async fn publish(js: &jetstream::Context, subject: &str, id: Option<&str>, payload: Vec<u8>) {
    let mut message = PublishMessage::build().payload(payload.into());
    if let Some(id) = id {
        message = message.message_id(id);
    }
    let ack = js.send_publish(subject.to_owned(), message).await.unwrap();
    assert!(!ack.await.unwrap().duplicate, "stored, not dropped");
}

#[tokio::test]
async fn an_event_in_a_forged_envelope_is_parked_and_each_real_event_is_booked_once() {
    let app = spawn_app().await;
    some_money_moved(&app).await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;
    let (subject, event) = stored_event(&js, &config, "charge.succeeded").await;
    let body = serde_json::to_vec(&event).unwrap();
    let (other, _) = oncepay::merchants::create(&app.pool, "another merchant")
        .await
        .unwrap();

    // The real event republished under a new message id: it disagrees with itself.
    publish(
        &js,
        &subject,
        Some("evt_republished000000000000"),
        body.clone(),
    )
    .await;
    // The same without a header: the event itself, a duplicate.
    publish(&js, &subject, None, body.clone()).await;
    // On another merchant's subject.
    let elsewhere = subject.replace(&app.merchant_id.to_string(), &other.id.to_string());
    publish(&js, &elsewhere, None, body.clone()).await;
    // A charge oncepay never made, in an event id it never wrote.
    let mut forged = event.clone();
    forged["id"] = json!("evt_forgedforgedforgedforged");
    forged["data"]["object"]["amount"] = json!(99_999);
    forged["data"]["object"]["amount_captured"] = json!(99_999);
    let forged = serde_json::to_vec(&forged).unwrap();
    publish(&js, &subject, Some("evt_forgedforgedforgedforged"), forged).await;
    // The real event, its amount changed.
    let mut changed = event.clone();
    changed["data"]["object"]["amount"] = json!(99_999);
    changed["data"]["object"]["amount_captured"] = json!(99_999);
    publish(&js, &subject, None, serde_json::to_vec(&changed).unwrap()).await;

    let name = ledger_name(&config);
    consume_all(&app, &js, &config, &name).await;
    assert_eq!(
        ledger_of(&app, &name).await,
        (4, 1500 + 2500 + 700 - 500),
        "each real event booked once, nothing else"
    );
    assert_eq!(ledger::check(&app.pool, &name).await.unwrap(), vec![]);
    let reasons: Vec<String> = parked(&app, &name).await.into_iter().map(|p| p.0).collect();
    assert_eq!(
        reasons,
        [
            "id_mismatch",
            "subject_mismatch",
            "unknown_event",
            "body_mismatch"
        ]
    );
    assert_eq!(counted(&name, "parked"), 4);
    assert_eq!(counted(&name, "duplicate"), 1);
    assert_eq!(counted(&name, "booked"), 4);
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn poison_messages_are_parked_with_their_reason_and_stop_coming() {
    let app = spawn_app_with(Settings::new().set("CONSUMER_MAX_DELIVER", "3")).await;
    some_money_moved(&app).await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;
    let (subject, event) = stored_event(&js, &config, "charge.succeeded").await;

    // A NUL byte in the id: every transaction that reads it fails.
    let mut nul = event.clone();
    nul["id"] = json!("evt_nul\u{0}byte");
    publish(&js, &subject, None, serde_json::to_vec(&nul).unwrap()).await;
    // Not JSON.
    publish(&js, &subject, None, b"{\"id\": \"evt_".to_vec()).await;
    // A type oncepay does not know.
    let mut unknown = event.clone();
    unknown["type"] = json!("charge.disputed");
    let disputed = subject.replace("charge.succeeded", "charge.disputed");
    publish(&js, &disputed, None, serde_json::to_vec(&unknown).unwrap()).await;
    // 900 KB.
    let mut large = event.clone();
    large["data"]["object"]["description"] = json!("x".repeat(900 * 1024));
    publish(&js, &subject, None, serde_json::to_vec(&large).unwrap()).await;

    let name = ledger_name(&config);
    consume_all(&app, &js, &config, &name).await;
    assert_eq!(ledger_of(&app, &name).await, (4, 1500 + 2500 + 700 - 500));
    assert_eq!(ledger::check(&app.pool, &name).await.unwrap(), vec![]);
    let parked = parked(&app, &name).await;
    let parked: Vec<(&str, i64)> = parked.iter().map(|(r, d)| (r.as_str(), *d)).collect();
    assert_eq!(
        parked,
        [
            ("apply_failed", 3),
            ("malformed", 1),
            ("unknown_type", 1),
            ("oversize", 1)
        ],
        "each parked once, the failing one on its third delivery"
    );
    assert_eq!(counted(&name, "parked"), 4);
    let (bytes, prefix): (i32, Vec<u8>) = sqlx::query_as(
        "SELECT payload_bytes, payload_prefix FROM consumer_dead_letters
          WHERE consumer = $1 AND reason = 'oversize'",
    )
    .bind(&name)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(
        bytes > 900 * 1024 && prefix.len() == 1024,
        "{bytes} {}",
        prefix.len()
    );
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn a_durable_consumer_made_with_other_settings_is_updated_or_refused_naming_each() {
    let app = spawn_app().await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(2));
    let js = js(&config).await;
    let stream = js.get_stream(&config.stream).await.unwrap();
    // Made earlier with a longer ack wait, and a bound after which JetStream
    // stops delivering a message without a word.
    let earlier = pull::Config {
        durable_name: Some("ledger".into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver: 5,
        ..Default::default()
    };
    stream.create_consumer(earlier).await.unwrap();
    ledger::consumer(&config, "ledger").await.unwrap();
    let held = stream.consumer_info("ledger").await.unwrap().config;
    assert_eq!(
        (held.ack_wait, held.max_deliver),
        (Duration::from_secs(2), -1),
        "the configuration wins"
    );

    // An ack policy JetStream cannot change: the consumer does not start.
    let acks_all = pull::Config {
        durable_name: Some("acks-all".into()),
        ack_policy: AckPolicy::All,
        ..Default::default()
    };
    stream.create_consumer(acks_all).await.unwrap();
    let refused = ledger::consumer(&config, "acks-all").await.unwrap_err();
    let said = format!("{refused:#}");
    assert!(said.contains("ack_policy is All"), "{said}");
    assert!(said.contains("nats consumer rm"), "{said}");
    let run = ledger::run(
        app.pool.clone(),
        config.clone(),
        "acks-all".into(),
        CancellationToken::new(),
    );
    let ended = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the consumer gives up rather than trying again");
    assert!(ended.is_err());
    js.delete_stream(&config.stream).await.unwrap();
}
