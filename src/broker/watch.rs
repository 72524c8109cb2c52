//! What the relay tells about itself, so no stall and no loss goes unseen:
//! how far behind it is, an old transaction that holds publishing back,
//! and events the stream no longer holds.
//!
//! An event is published only once its transaction id is below the xmin
//! of the relay's snapshot (the events list's rule, [`super::relay`]), so
//! one transaction that holds an id anywhere on the server holds back
//! every event committed after it began, for as long as it runs. The relay
//! cannot publish past it; it can say so, naming the session.
//!
//! The relay's position means "published and acknowledged", not "still
//! stored": a stream deleted, purged or past a limit loses events the
//! position has passed. [`missing`] compares the stream with the outbox,
//! and [`rewind`] moves the position back so the relay publishes them
//! again (the stream's duplicate window and the consumers' inboxes absorb
//! what was still there).

use std::collections::HashSet;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer::pull};
use chrono::{DateTime, Utc};
use futures::StreamExt as _;
use sqlx::PgConnection;

use super::relay::{self, Position};
use crate::config::Broker;

/// The relay's backlog at one moment.
#[derive(Debug, Default)]
pub struct Backlog {
    /// When the first event not yet published was written.
    pub oldest: Option<DateTime<Utc>>,
    /// When the first event that is committed but held back was written:
    /// an older transaction still runs.
    pub held_back: Option<DateTime<Utc>>,
}

/// The backlog of the relay of `stream`: two reads of one row each in the
/// outbox's order. An error when an event or the relay's position lies
/// beyond the transaction ids this server hands out (copied in from
/// another server after it chose its offset; `event_txid_offset()` says
/// what to do), since new events would sort before them unseen.
pub async fn backlog(conn: &mut PgConnection, stream: &str) -> anyhow::Result<Backlog> {
    let from = relay::position(conn, stream).await?;
    let row = sqlx::query!(
        r#"WITH bound AS (
               SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint + o.n AS horizon,
                      pg_snapshot_xmax(pg_current_snapshot())::text::bigint + o.n AS next_id
                 FROM (SELECT event_txid_offset() AS n) o)
           SELECT (SELECT created_at FROM events WHERE (txid, seq) > ($1, $2)
                    ORDER BY txid, seq LIMIT 1) AS oldest,
                  (SELECT created_at FROM events WHERE (txid, seq) > ($1, $2)
                      AND txid >= (SELECT horizon FROM bound)
                    ORDER BY txid, seq LIMIT 1) AS held_back,
                  greatest((SELECT max(txid) FROM events), $1) AS "highest!",
                  (SELECT next_id FROM bound) AS "next_id!""#,
        from.txid,
        from.seq,
    )
    .fetch_one(conn)
    .await?;
    anyhow::ensure!(
        row.highest < row.next_id,
        "the outbox or the relay's position holds transaction id {}, beyond the {} this server \
         hands out next: it was copied in from another server after this one chose its offset \
         (docs/broker.md#a-new-postgres-server)",
        row.highest,
        row.next_id
    );
    Ok(Backlog {
        oldest: row.oldest,
        held_back: row.held_back,
    })
}

/// The session whose transaction holds publishing back: the one holding
/// the oldest transaction id on the server (which is the xmin).
#[derive(Debug)]
pub struct Blocker {
    pub pid: i32,
    pub database: Option<String>,
    pub application_name: Option<String>,
    pub state: Option<String>,
    /// How long its transaction has run.
    pub seconds: Option<f64>,
}

/// The session holding the oldest transaction id, if one is a session (a
/// prepared transaction is not).
pub async fn blocker(conn: &mut PgConnection) -> anyhow::Result<Option<Blocker>> {
    let blocker = sqlx::query_as!(
        Blocker,
        r#"SELECT pid AS "pid!", datname AS database, application_name, state,
                  extract(epoch FROM now() - xact_start)::float8 AS seconds
             FROM pg_stat_activity
            WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
            ORDER BY age(backend_xid) DESC
            LIMIT 1"#
    )
    .fetch_optional(conn)
    .await?;
    Ok(blocker)
}

/// What the relay last warned about, so a long stall is told once per
/// `RELAY_STALL_WARNING`, not on every pass.
#[derive(Debug, Default)]
pub struct Watch {
    warned: Option<tokio::time::Instant>,
    /// The (consumer, reason) pairs of parked messages seen so far.
    parked: HashSet<(String, String)>,
}

impl Watch {
    /// Sets the broker's gauges: the relay's from its backlog, the
    /// consumers' from the stream ([`consumers`]); and warns when events
    /// have been held back by an old transaction for longer than
    /// `RELAY_STALL_WARNING`, naming its session.
    pub async fn look(
        &mut self,
        conn: &mut PgConnection,
        js: &jetstream::Context,
        config: &Broker,
    ) -> anyhow::Result<()> {
        // The broker's gauges are told, not relied on: a JetStream API call
        // that times out during an election does not stop publishing.
        if let Err(e) = consumers(js, config).await {
            tracing::warn!(
                error = format!("{e:#}"),
                "the consumers' gauges were not read"
            );
        }
        parked(conn, config, &mut self.parked).await?;
        let backlog = backlog(conn, &config.stream).await?;
        let age = |at: Option<DateTime<Utc>>| {
            at.map_or(0.0, |at| (Utc::now() - at).as_seconds_f64().max(0.0))
        };
        let (lag, held) = (age(backlog.oldest), age(backlog.held_back));
        let stream = config.stream.clone();
        metrics::gauge!("broker_relay_lag_seconds", "stream" => stream.clone()).set(lag);
        metrics::gauge!("broker_relay_held_back_seconds", "stream" => stream).set(held);
        let warning = config.stall_warning;
        let due = self.warned.is_none_or(|at| at.elapsed() >= warning);
        if held < warning.as_secs_f64() || !due {
            return Ok(());
        }
        self.warned = Some(tokio::time::Instant::now());
        match blocker(conn).await? {
            Some(b) => tracing::warn!(
                held_back_seconds = held,
                pid = b.pid,
                database = b.database.as_deref(),
                application_name = b.application_name.as_deref(),
                state = b.state.as_deref(),
                transaction_seconds = b.seconds,
                "events are held back: an older transaction still runs, and no event committed \
                 after it began is published until it ends"
            ),
            None => tracing::warn!(
                held_back_seconds = held,
                "events are held back by an older transaction that is not a session's \
                 (a prepared transaction? see pg_prepared_xacts)"
            ),
        }
        Ok(())
    }
}

/// Sets the relay's gauges to 0 in a process that no longer holds its
/// lock: the relay that does reports the lag now.
pub fn forget(config: &Broker) {
    let stream = config.stream.clone();
    metrics::gauge!("broker_relay_lag_seconds", "stream" => stream.clone()).set(0.0);
    metrics::gauge!("broker_relay_held_back_seconds", "stream" => stream).set(0.0);
}

/// Sets each durable consumer's gauges from what the stream knows of it:
/// its messages not yet delivered, and delivered but not yet acknowledged.
pub async fn consumers(js: &jetstream::Context, config: &Broker) -> anyhow::Result<()> {
    let stream = js.get_stream(&config.stream).await?;
    let mut consumers = stream.consumers();
    while let Some(info) = consumers.next().await {
        let info = info?;
        let Some(name) = info.config.durable_name else {
            continue;
        };
        let labels = [("stream", config.stream.clone()), ("consumer", name)];
        metrics::gauge!("broker_consumer_pending_messages", &labels).set(info.num_pending as f64);
        metrics::gauge!("broker_consumer_ack_pending_messages", &labels)
            .set(info.num_ack_pending as f64);
    }
    Ok(())
}

/// Sets `broker_parked_messages` from the dead-letter table: the messages
/// each consumer of the stream parked, by reason; 0 for a pair in `seen`
/// whose rows were cleared since. `seen` becomes the pairs counted now.
async fn parked(
    conn: &mut PgConnection,
    config: &Broker,
    seen: &mut HashSet<(String, String)>,
) -> anyhow::Result<()> {
    let counts = sqlx::query!(
        r#"SELECT consumer, reason, count(*) AS "count!"
             FROM consumer_dead_letters WHERE stream = $1
            GROUP BY consumer, reason"#,
        config.stream
    )
    .fetch_all(conn)
    .await?;
    for (consumer, reason) in std::mem::take(seen) {
        if !(counts.iter()).any(|c| c.consumer == consumer && c.reason == reason) {
            parked_gauge(config, &consumer, &reason).set(0.0);
        }
    }
    for row in counts {
        parked_gauge(config, &row.consumer, &row.reason).set(row.count as f64);
        seen.insert((row.consumer, row.reason));
    }
    Ok(())
}

/// The gauge of the messages `consumer` parked for `reason`.
fn parked_gauge(config: &Broker, consumer: &str, reason: &str) -> metrics::Gauge {
    let labels = [
        ("stream", config.stream.clone()),
        ("consumer", consumer.to_owned()),
        ("reason", reason.to_owned()),
    ];
    metrics::gauge!("broker_parked_messages", &labels)
}

/// How often the relay looks at its backlog and the consumers.
pub const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Warns when the stream holds no message though the relay's position says
/// it published some: the stream was deleted (and made anew) or purged, and
/// what it held is lost to consumers until the relay is rewound.
pub async fn emptied(
    conn: &mut PgConnection,
    stream: &mut async_nats::jetstream::stream::Stream,
    config: &Broker,
) -> anyhow::Result<()> {
    let position = relay::position(conn, &config.stream).await?;
    let messages = stream.info().await?.state.messages;
    if messages == 0 && position != Position::default() {
        tracing::error!(
            stream = %config.stream,
            ?position,
            "the stream holds no message though the relay published up to its position: it was \
             deleted or purged; `oncepay relay --check` names the first event lost and \
             `oncepay relay --rewind-to` publishes from there again"
        );
    }
    Ok(())
}

/// Events the relay's position has passed that the stream does not hold.
#[derive(Debug)]
pub struct Missing {
    /// How many.
    pub count: usize,
    /// The first of them in the outbox's order: where to rewind to.
    pub first: Option<String>,
    /// How many distinct message ids the stream holds.
    pub stream_messages: u64,
}

/// Compares the stream's message ids with the events up to the relay's
/// position, each of which should be there. The position is read first: an
/// event a running relay publishes meanwhile is then in the stream, never
/// counted as lost.
pub async fn missing(
    conn: &mut PgConnection,
    js: &jetstream::Context,
    config: &Broker,
) -> anyhow::Result<Missing> {
    let up_to = relay::position(conn, &config.stream).await?;
    let held = stream_ids(js, config).await?;
    let passed = sqlx::query!(
        "SELECT id FROM events WHERE (txid, seq) <= ($1, $2) ORDER BY txid, seq",
        up_to.txid,
        up_to.seq,
    )
    .fetch_all(conn)
    .await?;
    let lost: Vec<String> = (passed.into_iter())
        .map(|e| e.id)
        .filter(|id| !held.contains(id))
        .collect();
    Ok(Missing {
        count: lost.len(),
        first: lost.into_iter().next(),
        stream_messages: held.len() as u64,
    })
}

/// Every message id in the stream, read with an ordered consumer that
/// takes headers only.
async fn stream_ids(js: &jetstream::Context, config: &Broker) -> anyhow::Result<HashSet<String>> {
    let mut stream = js
        .get_stream(&config.stream)
        .await
        .with_context(|| format!("the stream {}", config.stream))?;
    let mut left = stream.info().await?.state.messages;
    let mut ids = HashSet::new();
    if left == 0 {
        return Ok(ids);
    }
    let reader = pull::OrderedConfig {
        headers_only: true,
        ..Default::default()
    };
    let mut messages = stream.create_consumer(reader).await?.messages().await?;
    while left > 0 {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("the stream stopped sending its messages")?
            .context("the stream's messages ended")??;
        let id = message.headers.as_ref().and_then(|h| {
            h.get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str().to_owned())
        });
        ids.extend(id);
        left = message.info().map_or(0, |i| i.pending);
    }
    Ok(ids)
}

/// Moves the relay's position of `stream` back to just before the event
/// `event_id`, so the relay publishes it and every event after it again;
/// an error, changing nothing, when the relay has not published it yet. A
/// relay in the middle of a batch then fails to record it (its position
/// moved under it) and starts over from here.
pub async fn rewind(
    conn: &mut PgConnection,
    stream: &str,
    event_id: &str,
) -> anyhow::Result<Position> {
    let event = sqlx::query_as!(
        Position,
        "SELECT txid, seq FROM events WHERE id = $1",
        event_id
    )
    .fetch_optional(&mut *conn)
    .await?
    .with_context(|| format!("no event {event_id}"))?;
    let before = Position {
        txid: event.txid,
        seq: event.seq - 1,
    };
    let moved = sqlx::query!(
        "UPDATE relay_positions SET txid = $2, seq = $3, updated_at = now()
          WHERE stream = $1 AND (txid, seq) > ($2, $3)",
        stream,
        before.txid,
        before.seq,
    )
    .execute(conn)
    .await?
    .rows_affected();
    anyhow::ensure!(
        moved == 1,
        "the relay of {stream} has not published {event_id} yet: a rewind only moves back"
    );
    Ok(before)
}
