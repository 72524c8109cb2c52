//! The reference consumer: a merchant ledger that books each
//! `charge.succeeded` (the amount in) and `refund.succeeded` (the amount
//! out) exactly once, however often the broker delivers it.
//!
//! It reads the stream through a durable JetStream consumer with explicit
//! acks. For each message, one Postgres transaction inserts `(consumer,
//! message id)` into the inbox `ON CONFLICT DO NOTHING`, and books the
//! effect only when that insert took a row; the message is acknowledged
//! after the commit. A crash before the commit leaves neither the inbox row
//! nor the booking, and the broker delivers the message again; a crash
//! after it (an ack lost) brings the message again too, to this process or
//! another on the same durable consumer, and the inbox row makes it a
//! no-op. Two processes on one durable consumer share its messages, as a
//! consumer group does after a rebalance.

use anyhow::Context as _;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use futures::StreamExt as _;
use serde::Deserialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{Broker, BrokerFault};

/// The consumer's name when none is given: the durable consumer's, and its
/// rows' in the inbox and the ledger.
pub const DEFAULT_NAME: &str = "ledger";

/// What one message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The first delivery of a charge's or refund's success: booked.
    Booked,
    /// The first delivery of another event: nothing to book.
    Ignored,
    /// A message this consumer had already applied: nothing done.
    Duplicate,
}

/// The durable consumer `name` on the stream, made when missing.
pub async fn consumer(config: &Broker, name: &str) -> anyhow::Result<PullConsumer> {
    let js = super::connect(config).await?;
    let stream = super::stream(&js, config).await?;
    let wanted = pull::Config {
        durable_name: Some(name.to_owned()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        ..Default::default()
    };
    stream
        .get_or_create_consumer(name, wanted)
        .await
        .with_context(|| format!("the durable consumer {name}"))
}

/// Consumes as `name` until `stop`; after an error (NATS or Postgres away,
/// a stream without a leader yet) it starts over a second later. A message
/// whose ack an error prevented comes again, and its inbox row holds.
pub async fn run(
    pool: PgPool,
    config: Broker,
    name: String,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        let consumed = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            consumed = consume(&pool, &config, &name) => consumed,
        };
        let Err(error) = consumed;
        tracing::warn!(consumer = %name, error = format!("{error:#}"), "the consumer stopped; it starts over");
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
        }
    }
}

/// Applies each message, then acks it, until an error.
async fn consume(
    pool: &PgPool,
    config: &Broker,
    name: &str,
) -> anyhow::Result<std::convert::Infallible> {
    let mut messages = consumer(config, name).await?.messages().await?;
    tracing::info!(consumer = %name, stream = %config.stream, "consuming events");
    loop {
        let message = messages
            .next()
            .await
            .context("the broker ended the consumer's messages")?
            .context("a message from the broker")?;
        let id = message_id(&message);
        let merchant = merchant_of(config, &message.subject);
        let applied = apply(pool, name, &id, merchant, &message.payload).await?;
        tracing::debug!(consumer = %name, message = %id, ?applied, "applied");
        match config.fault {
            Some(BrokerFault::CrashAfterCommit) => {
                tracing::error!(message = %id, "fault injection: the consumer aborts before its ack");
                std::process::abort();
            }
            Some(BrokerFault::AckLate) => tokio::time::sleep(config.ack_wait * 2).await,
            _ => {}
        }
        message
            .ack()
            .await
            .map_err(|e| anyhow::anyhow!("acknowledging {id}: {e}"))?;
    }
}

/// Applies one message in one transaction: the inbox row first, the
/// booking only when that row is new.
pub async fn apply(
    pool: &PgPool,
    consumer: &str,
    message_id: &str,
    merchant_id: Option<Uuid>,
    payload: &[u8],
) -> anyhow::Result<Applied> {
    let mut tx = pool.begin().await?;
    let first = sqlx::query!(
        "INSERT INTO consumer_inbox (consumer, message_id) VALUES ($1, $2)
         ON CONFLICT DO NOTHING",
        consumer,
        message_id,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if !first {
        return Ok(Applied::Duplicate);
    }
    let booked = book(&mut tx, consumer, merchant_id, payload).await?;
    tx.commit().await?;
    Ok(if booked {
        Applied::Booked
    } else {
        Applied::Ignored
    })
}

/// The effect alone, in `tx`: books the event in `payload` if it is a
/// charge's or a refund's success and the subject named its merchant.
/// Whether it booked. [`apply`] calls it once per message id; the
/// workshop's naive consumer calls it for every delivery.
pub async fn book(
    tx: &mut sqlx::PgConnection,
    consumer: &str,
    merchant_id: Option<Uuid>,
    payload: &[u8],
) -> anyhow::Result<bool> {
    match (Booking::of(payload), merchant_id) {
        (Some(booking), Some(merchant_id)) => {
            booking.insert(tx, consumer, merchant_id).await?;
            Ok(true)
        }
        (Some(booking), None) => {
            tracing::warn!(event = %booking.event_id, "an event on a subject without a merchant: not booked");
            Ok(false)
        }
        (None, _) => Ok(false),
    }
}

/// The message's id: its `Nats-Msg-Id` (the event's id), which the relay
/// always sets; else the stream's sequence, unique within the stream.
fn message_id(message: &async_nats::jetstream::Message) -> String {
    let header = message
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_owned());
    header.unwrap_or_else(|| {
        let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
        format!("stream-seq:{seq}")
    })
}

/// The merchant a subject names: `<prefix>.<merchant id>.<event type>`.
pub fn merchant_of(config: &Broker, subject: &str) -> Option<Uuid> {
    let rest = subject
        .strip_prefix(&config.subject_prefix)?
        .strip_prefix('.')?;
    rest.split('.').next()?.parse().ok()
}

/// What an event books: a charge's amount in, a refund's out.
struct Booking {
    event_id: String,
    event_type: &'static str,
    object_id: String,
    amount: i64,
    currency: String,
}

/// The part of an event the ledger reads.
#[derive(Deserialize)]
struct EventView {
    id: String,
    #[serde(rename = "type")]
    kind: String,
    data: DataView,
}

#[derive(Deserialize)]
struct DataView {
    object: ObjectView,
}

#[derive(Deserialize)]
struct ObjectView {
    id: String,
    amount: i64,
    currency: String,
}

impl Booking {
    /// The booking an event's JSON asks for; `None` for other events (and
    /// for what is not an event).
    fn of(payload: &[u8]) -> Option<Self> {
        let event: EventView = serde_json::from_slice(payload).ok()?;
        let (event_type, sign) = match event.kind.as_str() {
            "charge.succeeded" => ("charge.succeeded", 1),
            "refund.succeeded" => ("refund.succeeded", -1),
            _ => return None,
        };
        Some(Booking {
            event_id: event.id,
            event_type,
            object_id: event.data.object.id,
            amount: sign * event.data.object.amount,
            currency: event.data.object.currency,
        })
    }

    async fn insert(
        &self,
        tx: &mut sqlx::PgConnection,
        consumer: &str,
        merchant_id: Uuid,
    ) -> anyhow::Result<()> {
        sqlx::query!(
            "INSERT INTO ledger_entries
                    (consumer, event_id, merchant_id, object_id, type, amount, currency)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            consumer,
            self.event_id,
            merchant_id,
            self.object_id,
            self.event_type,
            self.amount,
            self.currency,
        )
        .execute(tx)
        .await?;
        Ok(())
    }
}

/// An object whose ledger entries disagree with oncepay's records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub object_id: String,
    /// The signed amount oncepay's record asks for; `None` when oncepay has
    /// no succeeded charge or refund of that id.
    pub expected: Option<i64>,
    /// How many entries the ledger holds for it, and their sum.
    pub entries: i64,
    pub booked: Option<i64>,
}

/// Each succeeded charge and refund against the ledger of `consumer`: one
/// entry of its signed amount, no more, no less, and no entry for anything
/// else. Empty when the ledger agrees.
pub async fn check(pool: &PgPool, consumer: &str) -> anyhow::Result<Vec<Difference>> {
    let rows = sqlx::query_as!(
        Difference,
        r#"WITH expected AS (
               SELECT id AS object_id, amount FROM charges WHERE status = 'succeeded'
               UNION ALL
               SELECT id, -amount FROM refunds WHERE status = 'succeeded'
           ), booked AS (
               SELECT object_id, count(*) AS entries, sum(amount)::bigint AS amount
                 FROM ledger_entries WHERE consumer = $1 GROUP BY object_id
           )
           SELECT coalesce(e.object_id, b.object_id) AS "object_id!", e.amount AS expected,
                  coalesce(b.entries, 0) AS "entries!", b.amount AS booked
             FROM expected e FULL JOIN booked b ON b.object_id = e.object_id
            WHERE b.entries IS DISTINCT FROM 1 OR b.amount IS DISTINCT FROM e.amount
            ORDER BY 1"#,
        consumer,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
