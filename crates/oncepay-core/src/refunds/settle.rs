//! Settling a refund: the processor's outcome becomes, in one transaction,
//! the refund's final status, its key's saved response and its events. The
//! request that made the refund and recovery ([`crate::recovery`]) both
//! settle here, taking `key_ttl` and `request_id` as a charge's settle does
//! ([`crate::charges::settle`]).

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

use super::{Refund, RefundReason, store};
use crate::events::{EventType, NewEvent, store as events};
use crate::faults::{Fault, crash_if};
use crate::idempotency::{Resource, SavedResponse, store as keys};
use crate::processor::{self, Processor, RefundOutcome};
use crate::settled::{Settled, created};

/// Settles `refund_id` with `outcome` if it is still pending
/// ([`store::succeed_pending`], [`store::fail_pending`]).
pub async fn settle(
    pool: &PgPool,
    refund_id: &str,
    outcome: &RefundOutcome,
    key_ttl: Duration,
    request_id: Option<&str>,
) -> sqlx::Result<Settled> {
    let mut db = pool.acquire().await?;
    settle_or_crash(&mut db, refund_id, outcome, key_ttl, request_id, None).await
}

/// [`settle`] on `db`, for a request that may ask to crash
/// ([`Fault::CrashBeforeSettleCommit`]).
pub async fn settle_or_crash(
    db: &mut PgConnection,
    refund_id: &str,
    outcome: &RefundOutcome,
    key_ttl: Duration,
    request_id: Option<&str>,
    fault: Option<Fault>,
) -> sqlx::Result<Settled> {
    let mut tx = db.begin().await?;
    // A refund that succeeds refunds its charge, in part or in full: Stripe
    // sends `charge.refunded` for both, with the charge as it stands, and
    // `charge.expired` for the release of an authorization that expired.
    let settled = match outcome {
        RefundOutcome::Refunded => match store::succeed_pending(&mut tx, refund_id).await? {
            Some((refund, charge)) => {
                let refunds = store::of_charges(&mut *tx, std::slice::from_ref(&charge.id)).await?;
                let expired = refund.reason.as_deref()
                    == Some(RefundReason::ExpiredUncapturedCharge.as_str());
                let charge_event = if expired {
                    EventType::ChargeExpired
                } else {
                    EventType::ChargeRefunded
                };
                let events = vec![
                    NewEvent::new(EventType::RefundCreated, &refund.id, &refund.to_object()),
                    NewEvent::new(charge_event, &charge.id, &charge.to_object(&refunds)),
                ];
                Some((refund, events))
            }
            None => None,
        },
        RefundOutcome::Failed { reason } => store::fail_pending(&mut tx, refund_id, reason)
            .await?
            .map(|refund| {
                let event = NewEvent::new(EventType::RefundFailed, &refund.id, &refund.to_object());
                (refund, vec![event])
            }),
    };
    let Some((refund, new_events)) = settled else {
        tx.rollback().await?;
        return Ok(Settled::Already);
    };
    let response = response_for(&refund);
    let guarded = Resource::Refund(refund.id.clone());
    let key = keys::complete_for(&mut tx, &guarded, &response, key_ttl).await?;
    events::insert(
        &mut tx,
        refund.merchant_id,
        request_id,
        key.as_deref(),
        &new_events,
    )
    .await?;
    crash_if(fault, Fault::CrashBeforeSettleCommit);
    tx.commit().await?;
    tracing::info!(refund = %refund.id, charge = %refund.charge_id, status = %refund.status, key_completed = key.is_some(), events = new_events.len(), "refund settled");
    Ok(Settled::Now(response))
}

/// What the processor needs to know of a pending refund.
#[derive(Clone, Debug)]
pub struct Pending {
    pub id: String,
    pub charge_id: String,
    pub amount: i64,
    pub currency: String,
}

impl From<Refund> for Pending {
    fn from(refund: Refund) -> Self {
        Pending {
            id: refund.id,
            charge_id: refund.charge_id,
            amount: refund.amount,
            currency: refund.currency,
        }
    }
}

/// The processor call of a refund, idempotent on [`processor::refund_key`],
/// asking the gateway for `fault` if any.
pub async fn refund_at_processor(
    processor: &dyn Processor,
    refund: &Pending,
    fault: Option<processor::WireFault>,
) -> Result<RefundOutcome, processor::ProcessorError> {
    let processor_key = processor::refund_key(&refund.id);
    let payment_key = processor::authorization_key(&refund.charge_id);
    processor
        .refund(processor::Refund {
            processor_key: &processor_key,
            payment_key: &payment_key,
            amount: refund.amount,
            currency: &refund.currency,
            fault,
        })
        .await
}

/// The response a settled refund gets, and that its key saves for replay.
pub fn response_for(refund: &Refund) -> SavedResponse {
    created(format!("/v1/refunds/{}", refund.id), &refund.to_object())
}
