//! Reading an event out of a message, and the checks that decide whether
//! the ledger may apply it. The ledger applies events, not envelopes: its
//! inbox is keyed by the event's id as the body gives it, and the event
//! must be one oncepay wrote, as oncepay wrote it. In order, cheapest first:
//!
//! 1. at most [`MAX_PAYLOAD_BYTES`] (else `oversize`);
//! 2. JSON of an event's shape (else `malformed`), of a type oncepay knows
//!    (else `unknown_type`);
//! 3. its `Nats-Msg-Id`, where it has one, is the body's id (else
//!    `id_mismatch`), and its subject is `<prefix>.<merchant id>.<the
//!    body's type>` (else `subject_mismatch`);
//! 4. oncepay's record of the event (`events`, by id): there is one (else
//!    `unknown_event`), it is the subject's merchant's (else
//!    `subject_mismatch`), and its type and object are the body's (else
//!    `body_mismatch`).
//!
//! The body names no merchant (an event's object is the API's, and the
//! API's objects do not name their account), so the merchant a booking
//! goes to is the record's; the subject's is only checked against it.

use async_nats::jetstream;
use serde::Deserialize;
use serde_json::Value;
use sqlx::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

use super::book::Booking;
use super::parked::{Parked, Reason};
use crate::config::Broker;
use crate::events::EventType;

/// The largest message the ledger reads. Events are a few kilobytes; only
/// metadata filled to Stripe's limits, in characters of several bytes, on a
/// charge and the ten refunds its object embeds, comes near it, and such an
/// event is parked as `oversize`, not lost. Below NATS's default 1 MB.
pub const MAX_PAYLOAD_BYTES: usize = 512 * 1024;

/// A message as the broker delivered it: what the checks read and what a
/// parked row keeps.
#[derive(Clone, Debug)]
pub struct Delivery<'a> {
    pub subject: &'a str,
    /// Its `Nats-Msg-Id` header, if it has one.
    pub message_id: Option<&'a str>,
    pub payload: &'a [u8],
    pub stream: &'a str,
    pub stream_sequence: u64,
    /// Deliveries of it so far, this one included.
    pub deliveries: i64,
}

impl<'a> Delivery<'a> {
    /// The delivery `message` is; an error for a message JetStream did not
    /// deliver (no acknowledgement subject to read it from).
    pub fn of(message: &'a jetstream::Message) -> anyhow::Result<Self> {
        let info = message
            .info()
            .map_err(|e| anyhow::anyhow!("a message without JetStream's delivery info: {e}"))?;
        let message_id = message
            .headers
            .as_ref()
            .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|v| v.as_str());
        Ok(Delivery {
            subject: message.subject.as_str(),
            message_id,
            payload: &message.payload,
            stream: info.stream,
            stream_sequence: info.stream_sequence,
            deliveries: info.delivered,
        })
    }
}

/// An event the ledger may apply: its id, merchant and type as oncepay's
/// record has them, and what it books.
#[derive(Clone, Debug)]
pub struct Event {
    pub id: String,
    pub merchant_id: Uuid,
    pub kind: EventType,
    pub booking: Option<Booking>,
}

impl Event {
    /// The event `payload` holds, as `merchant_id`'s, checked for its shape
    /// alone: for the workshop's handlers, which apply an event they
    /// published themselves rather than one of oncepay's.
    pub fn unchecked(payload: &[u8], merchant_id: Uuid) -> Result<Self, Parked> {
        let body = Body::parse(payload)?;
        let kind = body.kind()?;
        Event::new(body.id, merchant_id, kind, &body.data.object)
    }

    fn new(id: String, merchant_id: Uuid, kind: EventType, object: &Value) -> Result<Self, Parked> {
        let booking = Booking::of(kind, object).map_err(|p| p.about(&id))?;
        Ok(Event {
            id,
            merchant_id,
            kind,
            booking,
        })
    }
}

/// Reads the event `delivery` carries and checks it against itself and
/// against oncepay's record on `tx`: the event, or why it is parked.
pub async fn read(
    tx: &mut PgConnection,
    config: &Broker,
    delivery: &Delivery<'_>,
) -> anyhow::Result<Result<Event, Parked>> {
    let claimed = match Claimed::of(config, delivery) {
        Ok(claimed) => claimed,
        Err(parked) => return Ok(Err(parked)),
    };
    let record = sqlx::query_as!(
        Record,
        r#"SELECT merchant_id, type AS "kind: EventType", data AS "data: Json<Value>"
             FROM events WHERE id = $1"#,
        claimed.id,
    )
    .fetch_optional(tx)
    .await?;
    Ok(claimed.against(record))
}

/// The part of an event's body the ledger reads.
#[derive(Deserialize)]
struct Body {
    id: String,
    #[serde(rename = "type")]
    kind: String,
    data: Data,
}

#[derive(Deserialize)]
struct Data {
    object: Value,
}

impl Body {
    /// The body of `payload`, when it is small enough and an event's JSON.
    fn parse(payload: &[u8]) -> Result<Self, Parked> {
        if payload.len() > MAX_PAYLOAD_BYTES {
            let detail = format!(
                "{} bytes; the ledger reads up to {MAX_PAYLOAD_BYTES}",
                payload.len()
            );
            return Err(Parked::new(Reason::Oversize, detail));
        }
        // The error's category and place only: its message may quote the payload.
        serde_json::from_slice(payload).map_err(|e| {
            let detail = format!(
                "not an event's JSON ({:?} error at line {} column {})",
                e.classify(),
                e.line(),
                e.column()
            );
            Parked::new(Reason::Malformed, detail)
        })
    }

    /// Its type, if oncepay knows it.
    fn kind(&self) -> Result<EventType, Parked> {
        EventType::parse(&self.kind).ok_or_else(|| {
            let shown = oncepay_core::params::shorten(&self.kind);
            let detail = format!("the type {shown:?} is not one oncepay knows");
            Parked::new(Reason::UnknownType, detail).about(&self.id)
        })
    }
}

/// What a message claims: an event of a known type, of the subject's
/// merchant, with this object.
struct Claimed {
    id: String,
    kind: EventType,
    merchant_id: Uuid,
    object: Value,
}

/// oncepay's record of an event.
struct Record {
    merchant_id: Uuid,
    kind: EventType,
    data: Json<Value>,
}

impl Claimed {
    /// What `delivery` claims, when it agrees with itself.
    fn of(config: &Broker, delivery: &Delivery<'_>) -> Result<Self, Parked> {
        let body = Body::parse(delivery.payload)?;
        let kind = body.kind()?;
        if delivery.message_id.is_some_and(|id| id != body.id) {
            let detail = "its Nats-Msg-Id is not the id its body gives";
            return Err(Parked::new(Reason::IdMismatch, detail).about(&body.id));
        }
        let Some(merchant_id) = subject_merchant(config, delivery.subject, kind) else {
            let detail = format!(
                "its subject is not {}.<merchant id>.{kind}",
                config.subject_prefix
            );
            return Err(Parked::new(Reason::SubjectMismatch, detail).about(&body.id));
        };
        Ok(Claimed {
            id: body.id,
            kind,
            merchant_id,
            object: body.data.object,
        })
    }

    /// The event, when oncepay wrote it as claimed.
    fn against(self, record: Option<Record>) -> Result<Event, Parked> {
        let park = |reason, detail: String| Err(Parked::new(reason, detail).about(&self.id));
        let Some(record) = record else {
            return park(
                Reason::UnknownEvent,
                "oncepay wrote no event of this id".into(),
            );
        };
        if record.merchant_id != self.merchant_id {
            let detail = format!(
                "its subject names merchant {}; the event is merchant {}'s",
                self.merchant_id, record.merchant_id
            );
            return park(Reason::SubjectMismatch, detail);
        }
        if record.kind != self.kind {
            let detail = format!("its type is {}; the event's is {}", self.kind, record.kind);
            return park(Reason::BodyMismatch, detail);
        }
        if record.data.0 != self.object {
            let detail = format!("its data.object is not the {} event's object", record.kind);
            return park(Reason::BodyMismatch, detail);
        }
        Event::new(self.id, record.merchant_id, record.kind, &record.data.0)
    }
}

/// The merchant a subject names, when it is `<prefix>.<merchant id>.<kind>`.
fn subject_merchant(config: &Broker, subject: &str, kind: EventType) -> Option<Uuid> {
    let rest = subject
        .strip_prefix(&config.subject_prefix)?
        .strip_prefix('.')?;
    let (merchant, named) = rest.split_once('.')?;
    (named == kind.as_str()).then_some(())?;
    merchant.parse().ok()
}
