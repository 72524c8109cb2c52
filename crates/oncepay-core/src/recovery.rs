//! Recovery of one stale record: a charge or refund whose request went
//! quiet (crashed, lost the processor's answer, or is just slow). Shared by
//! the sweeper (`request_id` is `None`) and by a retry that finds its own key
//! stale (`crate::operation::claim`; its request id, which the events name).

use std::time::Duration;

use sqlx::PgPool;

use crate::charges::settle as charge_settle;
use crate::charges::{capture, store as charges};
use crate::idempotency::Resource;
use crate::processor::{self, Outcome, Processor, RefundOutcome};
use crate::refunds::settle::{self as refund_settle, Pending};
use crate::refunds::{RefundStatus, store as refunds};
use crate::settled::Settled;

/// What recovering one stale record did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovered {
    /// A charge was settled with this outcome.
    Charge(Outcome),
    /// A refund was rolled forward and settled with this outcome.
    Refund(RefundOutcome),
    /// A capture was rolled forward and settled.
    Capture,
}

/// Settles a stale record with what the processor holds under its key;
/// `None` when something else settled it first.
///
/// - A charge is fenced first ([`Processor::void_unless_recorded`]), so no
///   late authorization can move money, then settled with what stands.
/// - A refund is rolled *forward*: its money was promised when its amount
///   was reserved, so the idempotent refund call is repeated, and its
///   recorded outcome settles it.
/// - A capture is rolled forward too, for the same reason.
pub async fn recover(
    pool: &PgPool,
    processor: &dyn Processor,
    resource: &Resource,
    key_ttl: Duration,
    request_id: Option<&str>,
) -> anyhow::Result<Option<Recovered>> {
    let recovered = match resource {
        Resource::Charge(id) => {
            let outcome = processor
                .void_unless_recorded(&processor::authorization_key(id))
                .await?;
            let settled = charge_settle::settle(pool, id, &outcome, key_ttl, request_id).await?;
            if let Settled::Already = settled {
                return Ok(None);
            }
            tracing::info!(charge = %id, ?outcome, "settled a stale charge");
            Recovered::Charge(outcome)
        }
        Resource::Refund(id) => {
            let refund = refunds::find_any(pool, id).await?;
            let Some(refund) = refund.filter(|r| r.status == RefundStatus::Pending) else {
                return Ok(None);
            };
            let outcome =
                refund_settle::refund_at_processor(processor, &Pending::from(refund), None).await?;
            let settled = refund_settle::settle(pool, id, &outcome, key_ttl, request_id).await?;
            if let Settled::Already = settled {
                return Ok(None);
            }
            tracing::info!(refund = %id, ?outcome, "rolled a stale refund forward");
            Recovered::Refund(outcome)
        }
        Resource::Capture(id) => {
            let charge = charges::find_any(pool, id).await?;
            let Some(charge) =
                charge.filter(|c| c.capture_amount.is_some() && c.captured_at.is_none())
            else {
                return Ok(None);
            };
            capture::at_processor(processor, &charge, None).await?;
            let mut db = pool.acquire().await?;
            let settled = capture::settle_or_crash(&mut db, id, key_ttl, request_id, None).await?;
            if let Settled::Already = settled {
                return Ok(None);
            }
            tracing::info!(charge = %id, "rolled a stale capture forward");
            Recovered::Capture
        }
    };
    Ok(Some(recovered))
}
