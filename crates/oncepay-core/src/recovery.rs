//! Recovery of one stale record: a charge or refund whose request went
//! quiet (crashed, lost the processor's answer, or is just slow). Shared by
//! the sweeper (`request_id` is `None`) and by a retry that finds its own key
//! stale (`crate::operation::claim`; its request id, which the events name).
//! Both lease the key first; a recovery that fails gives its lease back
//! ([`recover_leased`]).

use std::time::Duration;

use sqlx::PgPool;

use crate::charges::settle as charge_settle;
use crate::charges::{capture, store as charges};
use crate::idempotency::Resource;
use crate::idempotency::store::{self as keys, Lease};
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

/// Recovers the record of a stale key this process leased ([`recover`]).
/// If that fails (the processor unreachable, most often), the lease is given
/// back ([`give_back`]), so the next retry or sweep pass tries again as soon
/// as the processor answers, not a whole `PROCESSING_TIMEOUT` (`timeout`)
/// later. The error is the recovery's, or the give-back's if that failed
/// too (the lease then lapses).
pub async fn recover_leased(
    pool: &PgPool,
    processor: &dyn Processor,
    lease: &Lease,
    timeout: Duration,
    key_ttl: Duration,
    request_id: Option<&str>,
) -> anyhow::Result<Option<Recovered>> {
    let recovered = recover(pool, processor, &lease.resource, key_ttl, request_id).await;
    if recovered.is_err() {
        give_back(pool, lease, timeout).await?;
    }
    recovered
}

/// Gives back a lease whose record will not be recovered now
/// ([`keys::give_back`]): its key is stale again at once.
pub async fn give_back(pool: &PgPool, lease: &Lease, timeout: Duration) -> anyhow::Result<()> {
    let resource = &lease.resource;
    if keys::give_back(pool, lease, timeout).await? {
        tracing::debug!(?resource, "gave a lease back; its key is stale again");
    } else {
        tracing::info!(
            ?resource,
            "a lease was no longer ours (it lapsed and the key was leased again, or it was settled); left alone"
        );
    }
    Ok(())
}
