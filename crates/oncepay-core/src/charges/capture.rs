//! Capturing a charge made with `capture=false`: the one conditional update
//! that reserves the capture on the charge (so a charge is captured once at
//! most, whatever keys ask), why a capture was refused, and the settle that
//! marks it done, saves its answer and writes `charge.captured`, in one
//! transaction. A request and recovery ([`crate::recovery`]) both settle here.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgExecutor};
use uuid::Uuid;

use super::{Charge, ChargeStatus, store};
use crate::events::{EventType, NewEvent, store as events};
use crate::faults::{Fault, crash_if};
use crate::idempotency::{Resource, SavedResponse, store as keys};
use crate::params::shorten;
use crate::problem::{Problem, ProblemCode};
use crate::processor::{self, Processor, ProcessorError, WireFault};
use crate::refunds::store as refunds;
use crate::settled::{Settled, ok};

/// Reserves the capture of `amount` (all of it when `None`) on the
/// merchant's charge, in one conditional update that decides any race
/// between captures, and between a capture and a refund (both lock the
/// charge's row): only a succeeded charge made with `capture=false`, not
/// captured or asked to be, not refunded, authorized less than `window`
/// ago, and for no more than it holds. `None` when nothing was reserved;
/// [`refused`] says why.
pub async fn reserve(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    charge_id: &str,
    amount: Option<i64>,
    window: Duration,
) -> sqlx::Result<Option<Charge>> {
    crate::charge_query!(
        "UPDATE charges SET capture_amount = COALESCE($3, amount), capture_asked_at = now()
          WHERE id = $1 AND merchant_id = $2 AND status = 'succeeded'
            AND capture_later AND capture_amount IS NULL AND amount_refunded = 0
            AND created_at > now() - $4::float8 * interval '1 millisecond'
            AND COALESCE($3, amount) <= amount
          RETURNING",
        [],
        charge_id,
        merchant_id,
        amount,
        window.as_millis() as f64,
    )
    .fetch_optional(tx)
    .await
}

/// Why nothing could be reserved for capturing `charge_id`, read on `db`
/// after the update decided.
pub async fn refused(
    db: &mut PgConnection,
    merchant_id: Uuid,
    charge_id: &str,
    window: Duration,
) -> crate::error::Error {
    let charge = match store::find(&mut *db, merchant_id, charge_id).await {
        Ok(Some(charge)) => charge,
        Ok(None) => {
            return Problem::with_status(
                http::StatusCode::NOT_FOUND,
                ProblemCode::ResourceMissing,
                format!("No such charge: '{}'", shorten(charge_id)),
            )
            .with_param("charge")
            .into();
        }
        Err(e) => return e.into(),
    };
    let id = &charge.id;
    // On the database's clock, as the reservation and the sweeper's
    // release decided.
    let now = match sqlx::query_scalar!(r#"SELECT now() AS "now!""#)
        .fetch_one(&mut *db)
        .await
    {
        Ok(now) => now,
        Err(e) => return e.into(),
    };
    let expired = now - charge.created_at
        >= chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
    let (code, detail, param) = if charge.status != ChargeStatus::Succeeded {
        let detail = format!(
            "Charge {id} is {}: only a succeeded charge can be captured.",
            charge.status
        );
        (ProblemCode::ChargeNotCapturable, detail, None)
    } else if !charge.capture_later || charge.capture_amount.is_some() {
        let detail = format!("Charge {id} has already been captured.");
        (ProblemCode::ChargeAlreadyCaptured, detail, None)
    } else if expired {
        let detail =
            format!("Charge {id} has expired for capture: it was authorized too long ago.");
        (ProblemCode::ChargeExpiredForCapture, detail, None)
    } else if charge.amount_refunded > 0 {
        let detail = format!("Charge {id} has already been refunded.");
        (ProblemCode::ChargeAlreadyRefunded, detail, None)
    } else {
        let detail = format!(
            "Amount must be no more than the {} authorized on charge {id}.",
            charge.amount
        );
        (ProblemCode::AmountTooLarge, detail, Some("amount"))
    };
    let problem = Problem::new(code, detail);
    match param {
        Some(param) => problem.with_param(param).into(),
        None => problem.into(),
    }
}

/// Settles the capture of `charge_id`, which the processor recorded, if it
/// is still in flight: marks it captured (what it did not take goes back to
/// the card with no refund, as at Stripe since 2025-03-31.basil, so
/// `amount_refunded` does not change), saves the answer on the key that
/// guards the capture, if any, and writes
/// `charge.captured`, in one transaction (aborting just before its commit
/// with [`Fault::CrashBeforeSettleCommit`]).
pub async fn settle_or_crash(
    db: &mut PgConnection,
    charge_id: &str,
    key_ttl: Duration,
    request_id: Option<&str>,
    fault: Option<Fault>,
) -> sqlx::Result<Settled> {
    let mut tx = db.begin().await?;
    let Some(charge) = mark_captured(&mut *tx, charge_id).await? else {
        tx.rollback().await?;
        return Ok(Settled::Already);
    };
    let refunds = refunds::of_charges(&mut *tx, std::slice::from_ref(&charge.id)).await?;
    let response = response_for(&charge, &refunds);
    let captured = Resource::Capture(charge.id.clone());
    let key = keys::complete_for(&mut tx, &captured, &response, key_ttl).await?;
    let event = NewEvent::new(
        EventType::ChargeCaptured,
        &charge.id,
        &charge.to_object(&refunds),
    );
    let new_events = std::slice::from_ref(&event);
    events::insert(
        &mut tx,
        charge.merchant_id,
        request_id,
        key.as_deref(),
        new_events,
    )
    .await?;
    crash_if(fault, Fault::CrashBeforeSettleCommit);
    tx.commit().await?;
    tracing::info!(charge = %charge.id, amount = charge.amount_captured(), key_completed = key.is_some(), event = %event.id, "capture settled");
    Ok(Settled::Now(response))
}

/// The conditional update of a capture's settle: `None` when the capture
/// was not in flight any more (another settle came first).
async fn mark_captured(db: impl PgExecutor<'_>, charge_id: &str) -> sqlx::Result<Option<Charge>> {
    crate::charge_query!(
        "UPDATE charges SET captured_at = now()
          WHERE id = $1 AND capture_amount IS NOT NULL AND captured_at IS NULL
          RETURNING",
        [],
        charge_id,
    )
    .fetch_optional(db)
    .await
}

/// The answer to a capture, which its key saves: `200` with the charge.
pub fn response_for(charge: &Charge, refunds: &[crate::refunds::Refund]) -> SavedResponse {
    ok(&charge.to_object(refunds))
}

/// Captures in flight older than `timeout` that no `processing` key guards
/// (a capture asked without a key, whose request died), up to `limit`.
pub async fn stale_unguarded(
    db: impl PgExecutor<'_>,
    timeout: Duration,
    limit: i64,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar!(
        r#"SELECT c.id FROM charges c
            WHERE c.capture_amount IS NOT NULL AND c.captured_at IS NULL
              AND c.capture_asked_at < now() - $1::float8 * interval '1 millisecond'
              AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                               WHERE k.capture_of = c.id AND k.status = 'processing')
            ORDER BY c.capture_asked_at
            LIMIT $2"#,
        timeout.as_millis() as f64,
        limit,
    )
    .fetch_all(db)
    .await
}

/// The processor call of a reserved capture, idempotent on
/// [`processor::capture_key`], asking the gateway for `fault` if any.
pub async fn at_processor(
    processor: &dyn Processor,
    charge: &Charge,
    fault: Option<WireFault>,
) -> Result<(), ProcessorError> {
    let processor_key = processor::capture_key(&charge.id);
    let payment_key = processor::authorization_key(&charge.id);
    processor
        .capture(processor::Capture {
            processor_key: &processor_key,
            payment_key: &payment_key,
            amount: charge.capture_amount.unwrap_or(charge.amount),
            currency: &charge.currency,
            fault,
        })
        .await
}
