//! The inbox and the ledger: [`apply`] books an event once per consumer,
//! [`book`] is the booking alone, and [`check`] compares a ledger with the
//! money `GET /v1/balance` counts.
//!
//! The ledger books money, not authorizations:
//!
//! - a charge's money comes in when it is captured: at `charge.succeeded`
//!   for a charge paid at once (`captured: true`), at `charge.captured` for
//!   one authorized first (`capture=false`), for its `amount_captured` (what
//!   a partial capture did not take was never charged);
//! - a refund's goes out at `refund.created`, unless the refund released
//!   an authorization never captured (a client's refund of it, or its
//!   expiry's, with `charge.expired`): that moved no money, and oncepay's
//!   record says which it was, by the balance's own rule
//!   (`balance_movements`), since the refund's object does not;
//! - every other event (an authorization's `charge.succeeded`,
//!   `charge.failed`, `charge.refunded`, `charge.expired`, the updates,
//!   `refund.failed`, and `charge.refund.updated`, which oncepay never
//!   writes) books nothing: the inbox takes it, and it is counted as
//!   ignored.

use oncepay_core::events::EventType;
use serde::Deserialize;
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::Outcome;
use super::message::Event;
use super::parked::{Parked, Reason};

/// What an event books: money in (a capture) or out (a refund), in minor
/// units of `currency`, signed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Booking {
    kind: EventType,
    object_id: String,
    amount: i64,
    currency: String,
}

/// The part of a charge's object a booking reads.
#[derive(Deserialize)]
struct ChargeView {
    id: String,
    captured: bool,
    amount_captured: i64,
    currency: String,
}

/// The part of a refund's object a booking reads.
#[derive(Deserialize)]
struct RefundView {
    id: String,
    amount: i64,
    currency: String,
}

impl Booking {
    /// What an event of `kind` about `object` books, if anything; `malformed`
    /// when the object lacks what its booking reads (an event in a shape
    /// the ledger does not know is parked, never skipped).
    pub(super) fn of(kind: EventType, object: &Value) -> Result<Option<Self>, Parked> {
        // The error's message is not kept: it may quote the object.
        let malformed = |shape: &str| {
            let detail = format!("the object of a {kind} event does not read as {shape}");
            Parked::new(Reason::Malformed, detail)
        };
        match kind {
            EventType::ChargeSucceeded | EventType::ChargeCaptured => {
                let charge = ChargeView::deserialize(object)
                    .map_err(|_| malformed("a charge (id, captured, amount_captured, currency)"))?;
                Ok(charge.captured.then_some(Booking {
                    kind,
                    object_id: charge.id,
                    amount: charge.amount_captured,
                    currency: charge.currency,
                }))
            }
            EventType::RefundCreated => {
                let refund = RefundView::deserialize(object)
                    .map_err(|_| malformed("a refund (id, amount, currency)"))?;
                Ok(Some(Booking {
                    kind,
                    object_id: refund.id,
                    amount: -refund.amount,
                    currency: refund.currency,
                }))
            }
            // Named one by one, so that a new type is a decision here.
            EventType::ChargeFailed
            | EventType::ChargeExpired
            | EventType::ChargeRefunded
            | EventType::ChargeUpdated
            | EventType::ChargeRefundUpdated
            | EventType::RefundFailed
            | EventType::RefundUpdated => Ok(None),
        }
    }
}

/// Applies `event` once for `consumer`, on `tx`: the inbox row first, the
/// booking only when that row is new.
pub async fn apply(
    tx: &mut PgConnection,
    consumer: &str,
    event: &Event,
) -> anyhow::Result<Outcome> {
    let first = sqlx::query!(
        "INSERT INTO consumer_inbox (consumer, event_id) VALUES ($1, $2)
         ON CONFLICT DO NOTHING",
        consumer,
        event.id,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if !first {
        return Ok(Outcome::Duplicate);
    }
    Ok(if book(tx, consumer, event).await? {
        Outcome::Booked
    } else {
        Outcome::Ignored
    })
}

/// The effect alone, on `tx`: books the money `event` moved, if it moved
/// any. Whether it booked. [`apply`] calls it once per event; the
/// workshop's naive handler, for every delivery.
pub async fn book(tx: &mut PgConnection, consumer: &str, event: &Event) -> anyhow::Result<bool> {
    let Some(booking) = &event.booking else {
        return Ok(false);
    };
    if booking.kind == EventType::RefundCreated
        && !gave_money_back(&mut *tx, &booking.object_id).await?
    {
        return Ok(false);
    }
    sqlx::query!(
        "INSERT INTO ledger_entries
                (consumer, event_id, merchant_id, object_id, type, amount, currency)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        consumer,
        event.id,
        event.merchant_id,
        booking.object_id,
        booking.kind.as_str(),
        booking.amount,
        booking.currency,
    )
    .execute(tx)
    .await?;
    Ok(true)
}

/// Whether the succeeded refund `refund_id` gave money back as the balance
/// counts it: not when it released an authorization never captured.
async fn gave_money_back(tx: &mut PgConnection, refund_id: &str) -> anyhow::Result<bool> {
    let moved = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM balance_movements
                           WHERE kind = 'refund' AND object_id = $1) AS "moved!""#,
        refund_id,
    )
    .fetch_one(tx)
    .await?;
    Ok(moved)
}

/// An object whose ledger entries disagree with the money oncepay counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub object_id: String,
    pub merchant_id: Uuid,
    /// The signed amount the balance counts for it; `None` when it counts
    /// no money for it (no such charge or refund, an authorization never
    /// captured, a release, or another merchant's).
    pub expected: Option<i64>,
    /// How many entries the ledger holds for it, and their sum.
    pub entries: i64,
    pub booked: Option<i64>,
}

/// The ledger of `consumer` against the money `GET /v1/balance` counts
/// (`balance_movements`): one entry of its signed amount, for its merchant,
/// for every charge and refund that moved money, and no entry for anything
/// else. Empty when the ledger agrees.
pub async fn check(pool: &PgPool, consumer: &str) -> anyhow::Result<Vec<Difference>> {
    let rows = sqlx::query_as!(
        Difference,
        r#"WITH expected AS (
               SELECT merchant_id, object_id, amount FROM balance_movements WHERE amount <> 0
           ), booked AS (
               SELECT merchant_id, object_id, count(*) AS entries, sum(amount)::bigint AS amount
                 FROM ledger_entries WHERE consumer = $1 GROUP BY merchant_id, object_id
           )
           SELECT coalesce(e.object_id, b.object_id) AS "object_id!",
                  coalesce(e.merchant_id, b.merchant_id) AS "merchant_id!",
                  e.amount AS expected, coalesce(b.entries, 0) AS "entries!", b.amount AS booked
             FROM expected e
             FULL JOIN booked b ON b.merchant_id = e.merchant_id AND b.object_id = e.object_id
            WHERE b.entries IS DISTINCT FROM 1 OR b.amount IS DISTINCT FROM e.amount
            ORDER BY 1, 2"#,
        consumer,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
