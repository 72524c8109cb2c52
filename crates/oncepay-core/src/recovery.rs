//! Recovery of one stale record: a charge or refund whose request went
//! quiet (crashed, lost the processor's answer, or is just slow). Shared by
//! the sweeper, which finds such records, and by a retry that finds its own
//! key stale (the server's `operation::claim`), so both settle a record the
//! same way and whichever comes second changes nothing.

use std::time::Duration;

use sqlx::PgPool;

use crate::charges::settle as charge_settle;
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
}

/// Settles a record whose request went quiet, by its kind, with what the
/// processor holds under the record's processor key; `None` when something
/// else settled it first.
///
/// - A charge is fenced first: its authorization key is voided unless a
///   payment was recorded under it, so no late authorization can move money
///   any more; then it is settled with the payment if one was recorded first,
///   otherwise with the void.
/// - A refund is rolled *forward*: the money was promised when its amount was
///   reserved, and the processor's refund is idempotent on its key, so the
///   refund call is repeated and returns the recorded outcome, which settles
///   it. A refund already settled is left alone.
///
/// Used by the sweeper (`request_id` is `None`) and by a retry that finds its
/// key stale (its own request id, which the record's events name).
pub async fn recover(
    pool: &PgPool,
    processor: &dyn Processor,
    resource: &Resource,
    key_ttl: Duration,
    request_id: Option<&str>,
) -> anyhow::Result<Option<Recovered>> {
    let (settled, recovered) = match resource {
        Resource::Charge(id) => {
            let outcome = processor
                .void_unless_recorded(&processor::authorization_key(id))
                .await?;
            let settled = charge_settle::settle(pool, id, &outcome, key_ttl, request_id).await?;
            (settled, Recovered::Charge(outcome))
        }
        Resource::Refund(id) => {
            let Some(refund) = refunds::find_any(pool, id).await? else {
                return Ok(None);
            };
            if refund.status != RefundStatus::Pending {
                return Ok(None);
            }
            let outcome =
                refund_settle::refund_at_processor(processor, &Pending::from(refund), None).await?;
            let settled = refund_settle::settle(pool, id, &outcome, key_ttl, request_id).await?;
            (settled, Recovered::Refund(outcome))
        }
    };
    if let Settled::Already = settled {
        return Ok(None);
    }
    match &recovered {
        Recovered::Charge(outcome) => {
            tracing::info!(charge = %resource.id(), ?outcome, "settled a stale charge");
        }
        Recovered::Refund(outcome) => {
            tracing::info!(refund = %resource.id(), ?outcome, "rolled a stale refund forward");
        }
    }
    Ok(Some(recovered))
}
