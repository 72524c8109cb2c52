//! The relay: publishes the outbox (the `events` table) to the stream in
//! commit order, each event with `Nats-Msg-Id` = its id, and records how
//! far it got only after the broker acknowledged every event up to there.
//!
//! Commit order is the events list's order, (txid, seq), with its rule: an
//! event is read only once its transaction id is below the xmin of the
//! snapshot, so no event can still commit before a position already passed
//! (see `docs/decisions.md#events`). Transaction ids are a server's own
//! counter, so `txid` and that xmin both carry the server's offset
//! (`event_txid_offset()`), which keeps the order across a move to another
//! server (`docs/broker.md#a-new-postgres-server`).
//!
//! A batch is sent whole and acknowledged [`ACKS_IN_FLIGHT`] at a time; the
//! relay's lag, and a transaction holding it back, are [`super::watch`]'s.
//!
//! One relay publishes at a time over every process on the database: the
//! one that holds a session-level advisory lock on its own connection, and
//! records its position on that connection, so a relay that lost its
//! session (and with it the lock) cannot record anything.
//!
//! A relay killed after the broker's ack and before its record publishes
//! those events again when it (or another) takes over: within the stream's
//! duplicate window the stream keeps one copy of each; after it, two, which
//! is why the consumer keeps an inbox.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, message::PublishMessage};
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::settings::Refused;
use super::watch;
use crate::config::{Broker, BrokerFault};
use crate::events::{Event, EventType};

/// The most publishes the relay leaves unacknowledged at once, which is
/// also the client's own limit ([`super::connect`] sets it): past its limit
/// async-nats waits for a free slot, with no timeout, so a batch sent whole
/// before any ack is awaited would wait forever, holding the relay's lock.
pub const ACKS_IN_FLIGHT: usize = 1_000;

/// How long a relay refused its stream waits before it looks again.
pub const REFUSED_RETRY: Duration = Duration::from_secs(30);

/// A position in the outbox: the last event published, in (txid, seq).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub txid: i64,
    pub seq: i64,
}

/// Runs the relay until `stop`: takes the lock when free, publishes while
/// it holds it, and starts over after an error (NATS or Postgres away) a
/// second later. A stream JetStream cannot bring to the configuration
/// ([`Refused`]) is an error logged as one, tried again every
/// [`REFUSED_RETRY`], so that fixing the stream is enough; the API it runs
/// beside serves on.
pub async fn run(pool: PgPool, config: Broker, stop: CancellationToken) {
    loop {
        let led = tokio::select! {
            () = stop.cancelled() => return,
            led = lead(&pool, &config) => led,
        };
        watch::forget(&config);
        let mut pause = config.poll_interval.max(Duration::from_secs(1));
        match led {
            Err(e) if e.is::<Refused>() => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "the relay cannot publish to this stream"
                );
                pause = REFUSED_RETRY;
            }
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "the relay stopped publishing; it tries again"
            ),
            Ok(()) => {}
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

/// Publishes while this process holds the relay's lock; returns at once
/// when another holds it. The lock lives as long as `conn`, its own session.
async fn lead(pool: &PgPool, config: &Broker) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
    if !try_lock(&mut conn, &config.stream).await? {
        return Ok(());
    }
    let js = super::connect(config).await?;
    let mut stream = super::stream(&js, config).await?;
    watch::emptied(&mut conn, &mut stream, config).await?;
    tracing::info!(stream = %config.stream, "the relay holds its lock: publishing events");
    let (mut watch, mut looked) = (watch::Watch::default(), tokio::time::Instant::now());
    loop {
        if looked.elapsed() >= watch::LOOK_EVERY {
            watch.look(&mut conn, &js, config).await?;
            looked = tokio::time::Instant::now();
        }
        let Some(published) = publish_next(&mut conn, &js, config).await? else {
            tokio::time::sleep(config.poll_interval).await;
            continue;
        };
        if config.fault == Some(BrokerFault::CrashAfterPublish) {
            tracing::error!(
                ?published,
                "fault injection: the relay aborts before its record"
            );
            std::process::abort();
        }
        record(&mut conn, &config.stream, published).await?;
    }
}

/// Takes the relay's lock for `stream` on `conn`, if no session holds it.
pub async fn try_lock(conn: &mut PgConnection, stream: &str) -> anyhow::Result<bool> {
    let locked = sqlx::query_scalar!(
        "SELECT pg_try_advisory_lock(hashtext('oncepay relay'), hashtext($1))",
        stream
    )
    .fetch_one(conn)
    .await?;
    Ok(locked == Some(true))
}

/// Where the relay of `stream` got to: the start when it never published.
pub async fn position(conn: &mut PgConnection, stream: &str) -> anyhow::Result<Position> {
    let row = sqlx::query_as!(
        Position,
        "SELECT txid, seq FROM relay_positions WHERE stream = $1",
        stream
    )
    .fetch_optional(conn)
    .await?;
    Ok(row.unwrap_or_default())
}

/// An event waiting to be published, with what its subject needs.
struct Outgoing {
    txid: i64,
    seq: i64,
    merchant_id: Uuid,
    id: String,
    kind: EventType,
    data: sqlx::types::Json<Value>,
    request_id: Option<String>,
    idempotency_key: Option<String>,
    created_at: DateTime<Utc>,
    pending_webhooks: i32,
}

/// A batch published and acknowledged: the position it started after and
/// the position of its last event, which the caller records.
#[derive(Clone, Copy, Debug)]
pub struct Published {
    pub from: Position,
    pub last: Position,
}

/// Publishes the next batch of events after the recorded position and
/// waits until the broker has acknowledged each; `None` when there was none.
pub async fn publish_next(
    conn: &mut PgConnection,
    js: &jetstream::Context,
    config: &Broker,
) -> anyhow::Result<Option<Published>> {
    let from = position(conn, &config.stream).await?;
    let batch = sqlx::query_as!(
        Outgoing,
        r#"SELECT e.txid, e.seq, e.merchant_id, e.id, e.type AS "kind: EventType",
                  e.data AS "data: _", e.request_id, e.idempotency_key, e.created_at,
                  (SELECT count(*) FROM webhook_deliveries d
                    WHERE d.event_seq = e.seq)::int AS "pending_webhooks!"
             FROM events e
            WHERE (e.txid, e.seq) > ($1, $2)
              AND e.txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint
                           + (SELECT event_txid_offset())
            ORDER BY e.txid, e.seq
            LIMIT $3"#,
        from.txid,
        from.seq,
        config.batch,
    )
    .fetch_all(conn)
    .await?;
    let count = batch.len() as u64;
    let Some(last) = batch.last().map(|e| Position {
        txid: e.txid,
        seq: e.seq,
    }) else {
        return Ok(None);
    };
    // Sent one after another on one connection, so the stream stores them
    // in this order; acknowledged a window at a time.
    let mut events = batch.into_iter().peekable();
    while events.peek().is_some() {
        let mut acks = Vec::with_capacity(ACKS_IN_FLIGHT);
        for outgoing in events.by_ref().take(ACKS_IN_FLIGHT) {
            acks.push(send(js, config, outgoing).await?);
        }
        for ack in acks {
            ack.await.context("the broker's acknowledgement")?;
        }
    }
    metrics::counter!("broker_relay_published_total", "stream" => config.stream.clone())
        .increment(count);
    Ok(Some(Published { from, last }))
}

/// Publishes one event, `Nats-Msg-Id` = its id; the ack to await.
async fn send(
    js: &jetstream::Context,
    config: &Broker,
    outgoing: Outgoing,
) -> anyhow::Result<jetstream::context::PublishAckFuture> {
    let subject = super::subject(config, outgoing.merchant_id, outgoing.kind.as_str());
    let event = outgoing.event();
    let payload = serde_json::to_vec(&event.to_object()).context("an event as JSON")?;
    let message = PublishMessage::build()
        .payload(payload.into())
        .message_id(&event.id);
    Ok(js.send_publish(subject, message).await?)
}

/// Records how far the relay of `stream` got: from the position the batch
/// started after to its last event. "0 rows" (the position is no longer
/// where the batch started) is an error that ends the relay's turn: another
/// relay published (this one had lost its lock), or the position was
/// rewound ([`super::watch::rewind`]) and the next turn starts from there.
pub async fn record(conn: &mut PgConnection, stream: &str, batch: Published) -> anyhow::Result<()> {
    let Published { from, last } = batch;
    let moved = sqlx::query!(
        "INSERT INTO relay_positions AS p (stream, txid, seq) VALUES ($1, $4, $5)
         ON CONFLICT (stream) DO UPDATE SET txid = excluded.txid, seq = excluded.seq,
                                            updated_at = now()
          WHERE (p.txid, p.seq) = ($2, $3)",
        stream,
        from.txid,
        from.seq,
        last.txid,
        last.seq,
    )
    .execute(conn)
    .await?
    .rows_affected();
    anyhow::ensure!(
        moved == 1,
        "the relay's position of {stream} moved from {from:?} while it published up to \
         {last:?}: another relay published, or the position was rewound"
    );
    Ok(())
}

impl Outgoing {
    /// The event as the API shows it, which is what the stream carries.
    fn event(self) -> Event {
        Event {
            seq: self.seq,
            id: self.id,
            kind: self.kind,
            data: self.data,
            request_id: self.request_id,
            idempotency_key: self.idempotency_key,
            created_at: self.created_at,
            pending_webhooks: self.pending_webhooks,
        }
    }
}
