//! The relay at its edges: a backlog past the client's ack limit, a stream
//! made beforehand with other settings, a transaction that holds
//! publishing back, and a stream that lost events the position passed.
//! Needs a NATS server with JetStream, as `broker` does.

use std::time::Duration;

use async_nats::jetstream::{consumer, stream};
use oncepay::broker::{self, relay, watch};
use sqlx::Connection as _;
use tokio_util::sync::CancellationToken;

use crate::broker::{js, publish_visible, relay_all, relay_session, settings, stream_messages};
use crate::database::write_backlog;
use crate::helpers::{spawn_app, until};

#[tokio::test]
async fn a_batch_larger_than_the_clients_ack_limit_is_published_whole() {
    let app = spawn_app().await;
    // async-nats leaves 5,000 publishes unacknowledged at most by default.
    write_backlog(&app.pool, app.merchant_id, 6_000).await;
    let mut config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    config.batch = 10_000;
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;

    let published =
        tokio::time::timeout(Duration::from_secs(90), relay_all(&mut conn, &js, &config)).await;
    assert!(published.is_ok(), "the relay hung on its own acks");
    assert_eq!(stream_messages(&js, &config).await, 6_000);
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn a_stream_made_beforehand_takes_the_configured_window_and_no_limit() {
    let app = spawn_app().await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = oncepay::broker::connect(&config).await.unwrap();
    js.create_stream(stream::Config {
        name: config.stream.clone(),
        subjects: vec![format!("{}.>", config.subject_prefix)],
        duplicate_window: Duration::from_secs(1),
        max_age: Duration::from_secs(15),
        max_messages: 1_000,
        ..Default::default()
    })
    .await
    .unwrap();

    let mut made = broker::stream(&js, &config).await.unwrap();
    let has = made.info().await.unwrap().config.clone();
    assert_eq!(has.duplicate_window, Duration::from_secs(120));
    assert_eq!(has.max_age, Duration::ZERO, "no event expires");
    assert!(
        has.max_messages <= 0,
        "no count limit: {}",
        has.max_messages
    );
    // A second start finds nothing to change.
    broker::stream(&js, &config).await.unwrap();
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn a_stream_whose_storage_cannot_change_is_refused_naming_the_setting() {
    let app = spawn_app().await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = oncepay::broker::connect(&config).await.unwrap();
    js.create_stream(stream::Config {
        name: config.stream.clone(),
        subjects: vec![format!("{}.>", config.subject_prefix)],
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();

    let refused = broker::stream(&js, &config).await.expect_err("refused");
    let message = format!("{refused:#}");
    assert!(message.contains("storage is Memory"), "{message}");
    let mut kept = js.get_stream(&config.stream).await.unwrap();
    let storage = kept.info().await.unwrap().config.storage;
    assert_eq!(storage, stream::StorageType::Memory, "nothing changed");
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn events_held_back_by_an_old_transaction_are_seen_and_its_session_named() {
    let app = spawn_app().await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    // A transaction that holds an id, begun before the charge.
    let mut holder = app.pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *holder)
        .await
        .unwrap();
    app.paid_charge(1000).await;

    let mut conn = relay_session(&app, &config).await;
    let backlog = watch::backlog(&mut conn, &config.stream).await.unwrap();
    assert!(backlog.held_back.is_some(), "{backlog:?}");
    // Other tests' transactions come and go on this server; the holder
    // soon is the oldest.
    until(Duration::from_secs(20), "the holder named", || async {
        let mut conn = app.pool.acquire().await.unwrap();
        watch::blocker(&mut conn)
            .await
            .unwrap()
            .is_some_and(|b| b.pid == pid)
    })
    .await;

    holder.rollback().await.unwrap();
    until(Duration::from_secs(20), "nothing held back", || async {
        let mut conn = app.pool.acquire().await.unwrap();
        let backlog = watch::backlog(&mut conn, &config.stream).await.unwrap();
        backlog.held_back.is_none()
    })
    .await;
}

#[tokio::test]
async fn events_a_purged_stream_lost_are_found_by_the_check_and_published_again_by_a_rewind() {
    let app = spawn_app().await;
    for _ in 0..3 {
        app.paid_charge(1000).await;
    }
    let config = settings(&app, Duration::from_secs(1), Duration::from_secs(30));
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;
    let events = app.events().await as usize;
    let clean = watch::missing(&mut conn, &js, &config).await.unwrap();
    assert_eq!((clean.count, clean.stream_messages), (0, events as u64));

    js.get_stream(&config.stream)
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    let lost = watch::missing(&mut conn, &js, &config).await.unwrap();
    assert_eq!(lost.count, events, "every event the position passed");
    let first = lost.first.expect("the first lost event");

    // Past the duplicate window, the republished ids are new to the stream.
    tokio::time::sleep(Duration::from_secs(3)).await;
    watch::rewind(&mut conn, &config.stream, &first)
        .await
        .unwrap();
    relay_all(&mut conn, &js, &config).await;
    let found = watch::missing(&mut conn, &js, &config).await.unwrap();
    assert_eq!(found.count, 0, "{found:?}");
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn a_batch_published_across_a_rewind_is_not_recorded_over_it() {
    let app = spawn_app().await;
    app.paid_charge(1000).await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;
    app.paid_charge(1000).await;
    let published = publish_visible(&mut conn, &js, &config).await;

    let first: String = sqlx::query_scalar("SELECT id FROM events ORDER BY txid, seq LIMIT 1")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let rewound = watch::rewind(&mut conn, &config.stream, &first)
        .await
        .unwrap();
    let recorded = relay::record(&mut conn, &config.stream, published).await;
    assert!(recorded.is_err(), "the batch began before the rewind");
    assert_eq!(
        relay::position(&mut conn, &config.stream).await.unwrap(),
        rewound
    );
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn the_relays_lag_and_each_consumers_pending_and_parked_messages_are_in_the_metrics() {
    let app = spawn_app().await;
    for _ in 0..2 {
        app.paid_charge(1000).await;
    }
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let durable = consumer::pull::Config {
        durable_name: Some("probe".into()),
        ..Default::default()
    };
    let stream = js.get_stream(&config.stream).await.unwrap();
    stream.create_consumer(durable).await.unwrap();
    // A message the consumer parked (as the ledger writes one).
    sqlx::query(
        "INSERT INTO consumer_dead_letters (consumer, reason, detail, stream, stream_sequence,
                                            subject, deliveries, payload_bytes, payload_prefix)
         VALUES ('probe', 'malformed', 'not JSON', $1, 1, 'x', 1, 3, 'abc')",
    )
    .bind(&config.stream)
    .execute(&app.pool)
    .await
    .unwrap();
    let stop = CancellationToken::new();
    let relay = tokio::spawn(relay::run(app.pool.clone(), config.clone(), stop.clone()));

    let events = app.events().await;
    let parked = format!(
        "broker_parked_messages{{stream=\"{}\",consumer=\"probe\",reason=\"malformed\"}} 1",
        config.stream
    );
    let pending = format!(
        "broker_consumer_pending_messages{{stream=\"{}\",consumer=\"probe\"}} {events}",
        config.stream
    );
    let lag = format!("broker_relay_lag_seconds{{stream=\"{}\"}} 0", config.stream);
    until(Duration::from_secs(20), "the gauges scraped", || async {
        let scrape = app.client.get(app.url("/metrics")).send().await.unwrap();
        let scrape = scrape.text().await.unwrap();
        [&pending, &lag, &parked]
            .iter()
            .all(|wanted| scrape.lines().any(|l| l == wanted.as_str()))
    })
    .await;
    stop.cancel();
    relay.await.unwrap();
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn a_rewind_past_what_was_published_is_refused_and_changes_nothing() {
    let app = spawn_app().await;
    app.paid_charge(1000).await;
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let js = js(&config).await;
    let mut conn = relay_session(&app, &config).await;
    relay_all(&mut conn, &js, &config).await;
    let published = relay::position(&mut conn, &config.stream).await.unwrap();
    app.paid_charge(1000).await;
    let newest: String = sqlx::query_scalar("SELECT id FROM events ORDER BY txid DESC, seq DESC")
        .fetch_one(&app.pool)
        .await
        .unwrap();

    let refused = watch::rewind(&mut conn, &config.stream, &newest).await;
    assert!(refused.is_err(), "a rewind forward would skip events");
    assert_eq!(
        relay::position(&mut conn, &config.stream).await.unwrap(),
        published
    );
    js.delete_stream(&config.stream).await.unwrap();
}

#[tokio::test]
async fn events_copied_in_after_the_offset_was_chosen_are_an_error_until_it_is_chosen_again() {
    let app = spawn_app().await;
    // An event copied in from a busy server after this one chose its
    // offset (the migrations ran on an empty database first).
    let copied: i64 = sqlx::query_scalar(
        "INSERT INTO events (id, merchant_id, type, object_id, data, txid)
         VALUES ('evt_' || lpad('1', 24, '0'), $1, 'charge.updated', 'ch_copied', '{}',
                 pg_snapshot_xmax(pg_current_snapshot())::text::bigint + 1000000)
         RETURNING txid",
    )
    .bind(app.merchant_id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let fresh = || async {
        sqlx::PgConnection::connect_with(&app.pool.connect_options())
            .await
            .unwrap()
    };

    let refused = sqlx::query_scalar::<_, i64>("SELECT event_txid_offset()")
        .fetch_one(&mut fresh().await)
        .await
        .expect_err("a new event would sort before the copied one");
    assert!(format!("{refused}").contains("copied in"), "{refused}");
    let config = settings(&app, Duration::from_secs(120), Duration::from_secs(30));
    let mut conn = relay_session(&app, &config).await;
    assert!(watch::backlog(&mut conn, &config.stream).await.is_err());

    let mut session = fresh().await;
    sqlx::query("SELECT event_txid_readopt()")
        .execute(&mut session)
        .await
        .unwrap();
    let next: i64 = sqlx::query_scalar(
        "INSERT INTO events (id, merchant_id, type, object_id, data)
         VALUES ('evt_' || lpad('2', 24, '0'), $1, 'charge.updated', 'ch_new', '{}')
         RETURNING txid",
    )
    .bind(app.merchant_id)
    .fetch_one(&mut session)
    .await
    .unwrap();
    assert!(next > copied, "a new event sorts after the copied one");
}
