//! Workshop block 12, "The message handler forgot its inbox", on a real
//! NATS JetStream: one event delivered twice (its first ack lost) to a
//! naive handler, which books every delivery, and to the ledger's inbox
//! handler ([`ledger::apply`]), which books an event id once; and the
//! stream's duplicate window shown as a TTL. Everything goes to a stream of
//! the workshop's own, beside the events' stream, and every count is read
//! back from the broker or the database.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use futures::StreamExt as _;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::broker::{self, ledger};
use crate::config::Broker;

/// The workshop stream's duplicate window: short, so a block can wait it out.
pub const WINDOW: Duration = Duration::from_secs(1);
/// How long the broker waits for an ack before delivering again.
const ACK_WAIT: Duration = Duration::from_secs(1);
/// How long one of the card's requests may take: a few of the broker's
/// waits above, with room for a busy machine.
pub const BUDGET: Duration = Duration::from_secs(15);

/// How a handler applies a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handler {
    /// Books every delivery: no inbox.
    Naive,
    /// Books an event id once: the ledger's inbox.
    Inbox,
}

impl Handler {
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "naive" => Some(Handler::Naive),
            "inbox" => Some(Handler::Inbox),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Handler::Naive => "naive",
            Handler::Inbox => "inbox",
        }
    }
}

/// What one run of [`deliver_twice`] saw.
#[derive(Debug)]
pub struct Deliveries {
    /// What the handler did with each delivery, in order.
    pub handled: Vec<&'static str>,
    /// Ledger entries of the run's handler before the event was published,
    /// and after its second delivery: the effect.
    pub effects_before: i64,
    pub effects: i64,
}

/// The workshop's stream, made when missing: subjects under
/// `workshop.<prefix>`, a window of [`WINDOW`], messages kept an hour.
async fn stream(js: &jetstream::Context, config: &Broker) -> anyhow::Result<stream::Stream> {
    js.get_or_create_stream(stream::Config {
        name: format!("{}_WORKSHOP", config.stream),
        subjects: vec![format!("workshop.{}.>", config.subject_prefix)],
        duplicate_window: WINDOW,
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await
    .context("the workshop's stream")
}

/// A durable consumer of `subject` alone, from its first message.
async fn consumer(
    stream: &stream::Stream,
    name: &str,
    subject: &str,
) -> anyhow::Result<PullConsumer> {
    let config = pull::Config {
        durable_name: Some(name.to_owned()),
        filter_subject: subject.to_owned(),
        ack_policy: AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        ..Default::default()
    };
    Ok(stream.get_or_create_consumer(name, config).await?)
}

/// One `charge.succeeded` of 1000 for run `run`, published once and
/// delivered twice to `handler`: the first delivery is applied and its ack
/// lost (the handler dies before it), the broker delivers it again after
/// the ack wait, and the second is applied and acked.
pub async fn deliver_twice(
    pool: &PgPool,
    config: &Broker,
    merchant_id: Uuid,
    run: &str,
    handler: Handler,
) -> anyhow::Result<Deliveries> {
    let name = format!("workshop-{}-{run}", handler.as_str());
    let effects_before = effects(pool, &name).await?;
    let js = broker::connect(config).await?;
    let stream = stream(&js, config).await?;
    let subject = format!(
        "workshop.{}.{run}.{}",
        config.subject_prefix,
        handler.as_str()
    );
    let event_id = format!("evt_{}", Uuid::new_v4().simple());
    let event = json!({
        "id": event_id, "object": "event", "type": "charge.succeeded",
        "data": {"object": {
            "id": format!("ch_{run}"), "object": "charge", "amount": 1000,
            "amount_captured": 1000, "captured": true, "currency": "usd",
        }},
    });
    let message = PublishMessage::build()
        .payload(serde_json::to_vec(&event)?.into())
        .message_id(&event_id);
    js.send_publish(subject.clone(), message).await?.await?;
    let consumer = consumer(&stream, &name, &subject).await?;
    let mut messages = consumer.messages().await?;
    let mut handled = Vec::new();
    for ack in [false, true] {
        let message = tokio::time::timeout(ACK_WAIT * 10, messages.next())
            .await
            .context("no delivery from the broker")?
            .context("the consumer's messages ended")?
            .map_err(|e| anyhow::anyhow!("a delivery: {e}"))?;
        handled.push(handle(pool, &name, handler, merchant_id, &message.payload).await?);
        if ack {
            message
                .ack()
                .await
                .map_err(|e| anyhow::anyhow!("the ack: {e}"))?;
        }
    }
    drop(messages);
    stream.delete_consumer(&name).await?;
    Ok(Deliveries {
        handled,
        effects_before,
        effects: effects(pool, &name).await?,
    })
}

/// The ledger entries of consumer `name`.
async fn effects(pool: &PgPool, name: &str) -> anyhow::Result<i64> {
    let n = sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM ledger_entries WHERE consumer = $1"#,
        name
    )
    .fetch_one(pool)
    .await?;
    Ok(n)
}

/// One delivery to `handler`, in one transaction; what it did. The event
/// is the workshop's own, not one of oncepay's, so it is read for its shape
/// alone (`oncepay consume` checks every event against oncepay's record).
async fn handle(
    pool: &PgPool,
    name: &str,
    handler: Handler,
    merchant_id: Uuid,
    payload: &[u8],
) -> anyhow::Result<&'static str> {
    let event = ledger::Event::unchecked(payload, merchant_id)
        .map_err(|parked| anyhow::anyhow!("the workshop's event: {}", parked.detail))?;
    let mut tx = pool.begin().await?;
    let handled = match handler {
        Handler::Naive => {
            ledger::book(&mut tx, name, &event).await?;
            "booked"
        }
        Handler::Inbox => match ledger::apply(&mut tx, name, &event).await? {
            ledger::Outcome::Booked => "booked",
            ledger::Outcome::Ignored => "ignored",
            ledger::Outcome::Duplicate => "in the inbox already: skipped",
            ledger::Outcome::Parked(_) => "parked",
        },
    };
    tx.commit().await?;
    Ok(handled)
}

/// What the duplicate window did to three publishes of one message id.
#[derive(Debug)]
pub struct Window {
    /// Whether the broker called each publish a duplicate.
    pub duplicate: [bool; 3],
    /// Copies in the stream after the two publishes inside the window, and
    /// after the third, past it.
    pub inside: u64,
    pub after: u64,
}

/// The same message id published twice within the window, then once after
/// it: the stream keeps one copy, then holds two.
pub async fn window(config: &Broker, run: &str) -> anyhow::Result<Window> {
    let js = broker::connect(config).await?;
    let stream = stream(&js, config).await?;
    let subject = format!("workshop.{}.{run}.window", config.subject_prefix);
    let name = format!("workshop-window-{run}");
    let id = format!("workshop-{run}");
    let publish = || async {
        let message = PublishMessage::build()
            .payload("the same event".into())
            .message_id(&id);
        let ack = js.send_publish(subject.clone(), message).await?.await?;
        anyhow::Ok(ack.duplicate)
    };
    let copies = || async {
        let mut consumer = consumer(&stream, &name, &subject).await?;
        let pending = consumer.info().await?.num_pending;
        stream.delete_consumer(&name).await?;
        anyhow::Ok(pending)
    };
    let first = publish().await?;
    let second = publish().await?;
    let inside = copies().await?;
    // The broker forgets ids on a timer, which a busy machine runs late:
    // well past the window.
    tokio::time::sleep(WINDOW * 3).await;
    let third = publish().await?;
    let after = copies().await?;
    Ok(Window {
        duplicate: [first, second, third],
        inside,
        after,
    })
}
