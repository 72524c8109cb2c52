//! The reference consumer: a merchant ledger that books the money each of
//! oncepay's events moved exactly once, however often the broker delivers
//! it, and parks what it will not apply instead of losing it.
//!
//! It reads the stream through a durable JetStream consumer with explicit
//! acks, whose settings it brings to the configuration's at every start
//! ([`consumer`], [`durable`]). For each message, in one Postgres
//! transaction, it:
//!
//! 1. reads the event from the body and checks it against itself and
//!    against oncepay's record of the event ([`message`]); a message that
//!    fails a check is parked in `consumer_dead_letters` ([`parked`]);
//! 2. inserts `(consumer, event id)` into the inbox `ON CONFLICT DO
//!    NOTHING`, and books the money the event moved only when that insert
//!    took a row ([`book`]);
//!
//! and after the commit it acknowledges the message (terminates it, when
//! parked). A crash before the commit leaves nothing, and the broker
//! delivers the message again; a crash after it (an ack lost) brings the
//! message again too, to this process or another on the same durable
//! consumer, and the inbox row makes it a no-op, whatever envelope the
//! event comes in. A message whose transaction fails is given back and
//! tried again, and parked on its `CONSUMER_MAX_DELIVER`th delivery.
//! Two processes on one durable consumer share its messages, as a consumer
//! group does after a rebalance.

mod book;
pub mod durable;
pub mod message;
pub mod parked;

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures::StreamExt as _;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use book::{Booking, Difference, apply, book, check};
pub use message::{Delivery, Event};
pub use parked::{Parked, Reason};

use super::settings::Refused;
use crate::config::{Broker, BrokerFault};

/// The consumer's name when none is given: the durable consumer's, and its
/// rows' in the inbox, the ledger and the dead letters.
pub const DEFAULT_NAME: &str = "ledger";

/// How long a message whose transaction failed waits before it comes again.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// What one message came to: the `outcome` of
/// `broker_consumer_messages_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The first delivery of an event that moved money: booked.
    Booked,
    /// The first delivery of an event that moved none (an authorization, a
    /// release, a failure, an update): in the inbox, nothing booked.
    Ignored,
    /// An event this consumer had applied already: nothing done.
    Duplicate,
    /// Not applied: kept in `consumer_dead_letters`, for this reason.
    Parked(Reason),
}

impl Outcome {
    /// The metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Booked => "booked",
            Outcome::Ignored => "ignored",
            Outcome::Duplicate => "duplicate",
            Outcome::Parked(_) => "parked",
        }
    }
}

/// The durable consumer `name` on the stream: made when missing, and
/// updated where its settings differ from the configuration's and JetStream
/// lets them change; a [`Refused`] error names each setting that
/// differs and cannot.
pub async fn consumer(config: &Broker, name: &str) -> anyhow::Result<PullConsumer> {
    let js = super::connect(config).await?;
    let stream = super::stream(&js, config).await?;
    let wanted = durable::wanted(config, name);
    let found = stream
        .get_or_create_consumer(name, wanted.clone())
        .await
        .with_context(|| format!("the durable consumer {name} (it must be a pull consumer)"))?;
    let changes = durable::changes(&found.cached_info().config, &wanted);
    if changes.is_empty() {
        return Ok(found);
    }
    changes.refuse_fixed(
        format!(
            "the durable consumer {name} of the stream {}",
            config.stream
        ),
        "delete it (nats consumer rm <stream> <consumer>) and it is made again: a new one reads \
         the stream from its start, and the inbox skips every event already applied",
    )?;
    let update = durable::updated(&found.cached_info().config, &wanted)?;
    let updated = stream.create_consumer(update).await.with_context(|| {
        format!("JetStream refused to update the durable consumer {name}: {changes}")
    })?;
    tracing::info!(consumer = %name, %changes, "the durable consumer's settings updated to the configuration");
    Ok(updated)
}

/// Consumes as `name` until `stop`; after an error (NATS or Postgres away,
/// a stream without a leader yet) it starts over a second later. A message
/// whose ack an error prevented comes again, and its inbox row holds. A
/// durable consumer whose settings it cannot bring to the configuration
/// ends it with that error.
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
        if error.is::<Refused>() {
            return Err(error);
        }
        tracing::warn!(consumer = %name, error = format!("{error:#}"), "the consumer stopped; it starts over");
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Handles each message until an error. It takes none while the database
/// does not answer: a message it cannot apply would only come again.
async fn consume(
    pool: &PgPool,
    config: &Broker,
    name: &str,
) -> anyhow::Result<std::convert::Infallible> {
    database_answers(pool).await?;
    let mut messages = consumer(config, name).await?.messages().await?;
    tracing::info!(consumer = %name, stream = %config.stream, "consuming events");
    loop {
        let message = messages
            .next()
            .await
            .context("the broker ended the consumer's messages")?
            .context("a message from the broker")?;
        handle(pool, config, name, &message).await?;
    }
}

/// Applies or parks one message and acknowledges it (terminates it, when
/// parked). A message whose transaction failed is given back to come again
/// after [`RETRY_DELAY`], or parked as `apply_failed` on its
/// `CONSUMER_MAX_DELIVER`th delivery unless the failure was the database's
/// ([`transient`]); an error when the database is away,
/// so the caller starts over once it answers.
async fn handle(
    pool: &PgPool,
    config: &Broker,
    name: &str,
    message: &jetstream::Message,
) -> anyhow::Result<()> {
    let delivery = Delivery::of(message)?;
    let outcome = match receive(pool, config, name, &delivery).await {
        Ok(outcome) => outcome,
        Err(error) if delivery.deliveries >= config.max_deliver && !transient(&error) => {
            let parked = Parked::new(Reason::ApplyFailed, format!("{error:#}"));
            park(pool, name, &delivery, &parked).await?
        }
        Err(error) => {
            tracing::warn!(consumer = %name, stream_sequence = delivery.stream_sequence, deliveries = delivery.deliveries, error = format!("{error:#}"), "applying a message failed; it comes again");
            acknowledge(message, AckKind::Nak(Some(RETRY_DELAY))).await?;
            return database_answers(pool).await;
        }
    };
    metrics::counter!("broker_consumer_messages_total", "consumer" => name.to_owned(), "outcome" => outcome.as_str()).increment(1);
    if let Outcome::Parked(_) = outcome {
        return acknowledge(message, AckKind::Term).await;
    }
    tracing::debug!(consumer = %name, stream_sequence = delivery.stream_sequence, ?outcome, "applied");
    match config.fault {
        Some(BrokerFault::CrashAfterCommit) => {
            tracing::error!(
                stream_sequence = delivery.stream_sequence,
                "fault injection: the consumer aborts before its ack"
            );
            std::process::abort();
        }
        Some(BrokerFault::AckLate) => tokio::time::sleep(config.ack_wait * 2).await,
        _ => {}
    }
    acknowledge(message, AckKind::Ack).await
}

/// Reads, checks and applies one delivery as `consumer`, in one
/// transaction: booked, ignored or a duplicate when it carries one of
/// oncepay's events as oncepay wrote it, else parked. An error (the
/// transaction failed) leaves nothing behind.
pub async fn receive(
    pool: &PgPool,
    config: &Broker,
    consumer: &str,
    delivery: &Delivery<'_>,
) -> anyhow::Result<Outcome> {
    let mut tx = pool.begin().await?;
    let (outcome, parked) = match message::read(&mut tx, config, delivery).await? {
        Ok(event) => (apply(&mut tx, consumer, &event).await?, None),
        Err(parked) => {
            parked::park(&mut tx, consumer, delivery, &parked).await?;
            (Outcome::Parked(parked.reason), Some(parked))
        }
    };
    tx.commit().await?;
    if let Some(parked) = parked {
        log_parked(consumer, delivery, &parked);
    }
    Ok(outcome)
}

/// Parks `delivery` in a transaction of its own (its own failed).
async fn park(
    pool: &PgPool,
    consumer: &str,
    delivery: &Delivery<'_>,
    parked: &Parked,
) -> anyhow::Result<Outcome> {
    let mut tx = pool.begin().await?;
    parked::park(&mut tx, consumer, delivery, parked).await?;
    tx.commit().await?;
    log_parked(consumer, delivery, parked);
    Ok(Outcome::Parked(parked.reason))
}

/// The log line of a parked message: where it is and why, never its payload.
fn log_parked(consumer: &str, delivery: &Delivery<'_>, parked: &Parked) {
    tracing::warn!(
        consumer,
        reason = parked.reason.as_str(),
        detail = %parked.detail,
        stream = delivery.stream,
        stream_sequence = delivery.stream_sequence,
        deliveries = delivery.deliveries,
        event = parked.event_id.as_deref(),
        bytes = delivery.payload.len(),
        "a message was parked in consumer_dead_letters, not applied"
    );
}

/// Sends the broker `kind` for `message`.
async fn acknowledge(message: &jetstream::Message, kind: AckKind) -> anyhow::Result<()> {
    message
        .ack_with(kind)
        .await
        .map_err(|e| anyhow::anyhow!("acknowledging a message: {e}"))
}

/// Whether `error` says the database was away or busy (a lost connection,
/// a pool timeout, a serialization failure or deadlock, a shutdown), not
/// that it refused this message: such a failure never parks a message,
/// however often the broker has delivered it (restarts redeliver too).
fn transient(error: &anyhow::Error) -> bool {
    match error.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(e)) => e.code().is_some_and(|code| {
            ["08", "53", "57P", "40001", "40P01"]
                .iter()
                .any(|class| code.starts_with(class))
        }),
        Some(
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed,
        ) => true,
        _ => false,
    }
}

/// An error unless the database answers a query.
async fn database_answers(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::query("SELECT 1")
        .execute(pool)
        .await
        .context("the database does not answer")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::transient;

    #[test]
    fn a_database_away_or_busy_never_counts_as_the_messages_own_failure() {
        for away in [sqlx::Error::PoolTimedOut, sqlx::Error::PoolClosed] {
            assert!(transient(&anyhow::Error::from(away).context("applying")));
        }
        let refused = sqlx::Error::Decode("a NUL byte in a text".into());
        assert!(!transient(&refused.into()));
        assert!(!transient(&anyhow::anyhow!("not a database error")));
    }
}
