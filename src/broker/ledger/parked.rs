//! Parking: what the ledger does with a message it will not apply. The
//! message goes to `consumer_dead_letters` with a stable reason, its detail
//! and a bounded prefix of its payload, in the transaction that decided it;
//! the caller logs the reason (never the payload) and terminates the
//! message, so it stops coming. Nothing is booked, and no inbox row is
//! written: a parked event can still be applied once its cause is fixed.

use sqlx::PgConnection;

use super::message::Delivery;

/// How much of a parked payload its row keeps.
pub const PAYLOAD_PREFIX_BYTES: usize = 1024;

/// Why a message was parked: the stable code its row carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Larger than [`super::message::MAX_PAYLOAD_BYTES`].
    Oversize,
    /// Not JSON, or not an event's shape (`id`, `type`, `data.object`), or
    /// an event whose object lacks what its booking reads.
    Malformed,
    /// A `type` oncepay does not know.
    UnknownType,
    /// Its `Nats-Msg-Id` is not the id its body gives.
    IdMismatch,
    /// Its subject names another merchant or type than the event's.
    SubjectMismatch,
    /// An event id oncepay never wrote: forged, or from another database.
    UnknownEvent,
    /// Its type or object differs from oncepay's record of the event.
    BodyMismatch,
    /// Applying it failed on each of `CONSUMER_MAX_DELIVER` deliveries.
    ApplyFailed,
}

impl Reason {
    /// Its code, as the `reason` column stores it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Oversize => "oversize",
            Reason::Malformed => "malformed",
            Reason::UnknownType => "unknown_type",
            Reason::IdMismatch => "id_mismatch",
            Reason::SubjectMismatch => "subject_mismatch",
            Reason::UnknownEvent => "unknown_event",
            Reason::BodyMismatch => "body_mismatch",
            Reason::ApplyFailed => "apply_failed",
        }
    }
}

/// A message the ledger will not apply: why, in a sentence that never
/// quotes the payload, and the event id its body gave, if it gave one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parked {
    pub reason: Reason,
    pub detail: String,
    pub event_id: Option<String>,
}

impl Parked {
    /// A message parked for `reason`, `detail` saying what disagreed or failed.
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Parked {
            reason,
            detail: detail.into(),
            event_id: None,
        }
    }

    /// The same, about the event `id` the body gave.
    pub fn about(mut self, id: &str) -> Self {
        self.event_id = Some(id.to_owned());
        self
    }
}

/// Writes `parked` for `delivery` in the dead letters of `consumer`, on
/// `tx`; a second parking of one stream sequence (a consumer that died
/// before its ack) keeps the first row.
pub async fn park(
    tx: &mut PgConnection,
    consumer: &str,
    delivery: &Delivery<'_>,
    parked: &Parked,
) -> anyhow::Result<()> {
    let prefix = &delivery.payload[..delivery.payload.len().min(PAYLOAD_PREFIX_BYTES)];
    sqlx::query!(
        "INSERT INTO consumer_dead_letters
                (consumer, reason, detail, stream, stream_sequence, subject, message_id,
                 event_id, deliveries, payload_bytes, payload_prefix)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
         ON CONFLICT (consumer, stream, stream_sequence) DO NOTHING",
        consumer,
        parked.reason.as_str(),
        storable(&parked.detail),
        storable(delivery.stream),
        delivery.stream_sequence as i64,
        storable(delivery.subject),
        delivery.message_id.map(storable),
        parked.event_id.as_deref().map(storable),
        delivery.deliveries,
        delivery.payload.len() as i32,
        prefix,
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// `text` as Postgres can store it: a NUL, which a `text` value cannot
/// hold, becomes U+FFFD. What the sender wrote must never be what makes a
/// parking fail.
fn storable(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}
