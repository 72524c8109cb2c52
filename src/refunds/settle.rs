//! Settling a refund: once the processor has recorded it, the refund becomes
//! `succeeded` and its key saves the response, in one transaction. Shared by
//! the request that made the refund and by recovery (the sweeper, a retry
//! finding its key stale), which rolls a stuck refund *forward*: the money
//! was promised when the amount was reserved, and the processor's refund is
//! idempotent on its key, so repeating it is always safe.

use axum::http::StatusCode;
use sqlx::PgPool;

use super::{Refund, store};
use crate::charges::settle::Settled;
use crate::idempotency::{Resource, SavedResponse, store as keys};
use crate::processor::{self, Processor};

/// Marks `refund_id` succeeded if it is still pending, and completes its key.
pub async fn settle(pool: &PgPool, refund_id: &str) -> sqlx::Result<Settled> {
    let mut tx = pool.begin().await?;
    let Some(refund) = store::succeed_pending(&mut tx, refund_id).await? else {
        tx.rollback().await?;
        return Ok(Settled::Already);
    };
    let response = response_for(&refund);
    let completed =
        keys::complete_for(&mut tx, &Resource::Refund(refund.id.clone()), &response).await?;
    tx.commit().await?;
    tracing::info!(refund = %refund.id, charge = %refund.charge_id, keys_completed = completed, "refund settled");
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

/// The processor call of a refund: idempotent on `refund:{id}`, against the
/// payment recorded under the charge's authorization key.
pub async fn refund_at_processor(
    processor: &dyn Processor,
    refund: &Pending,
) -> Result<(), processor::ProcessorError> {
    let processor_key = processor::refund_key(&refund.id);
    let payment_key = processor::authorization_key(&refund.charge_id);
    processor
        .refund(processor::Refund {
            processor_key: &processor_key,
            payment_key: &payment_key,
            amount: refund.amount,
            currency: &refund.currency,
        })
        .await
}

/// Rolls a refund whose request went quiet forward: repeats the processor's
/// refund under the same processor key, then settles it. Returns whether
/// this call settled it; a refund already settled (or released) is left alone.
pub async fn recover(
    pool: &PgPool,
    processor: &dyn Processor,
    refund_id: &str,
) -> anyhow::Result<bool> {
    let Some(refund) = store::find_any(pool, refund_id).await? else {
        return Ok(false);
    };
    if refund.status != super::RefundStatus::Pending.as_str() {
        return Ok(false);
    }
    refund_at_processor(processor, &Pending::from(refund)).await?;
    match settle(pool, refund_id).await? {
        Settled::Now(_) => {
            tracing::info!(refund = %refund_id, "rolled a stale refund forward");
            Ok(true)
        }
        Settled::Already => Ok(false),
    }
}

/// The response a settled refund gets, and that its key saves for replay.
pub fn response_for(refund: &Refund) -> SavedResponse {
    SavedResponse {
        status: StatusCode::CREATED.as_u16(),
        content_type: "application/json".into(),
        location: Some(format!("/v1/refunds/{}", refund.id)),
        body: serde_json::to_vec(&refund.to_object())
            .expect("a refund serialises")
            .into(),
    }
}
