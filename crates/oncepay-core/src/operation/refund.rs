//! Creating a refund, as a guarded [`Operation`]: with the claim, one
//! conditional update reserves the amount on the charge (which decides any
//! race between refunds) and the refund is written as pending; if nothing
//! could be reserved, the claim is rolled back and the answer says why. A
//! reserved refund is never given back: when the processor is unavailable it
//! stays pending, and recovery rolls it forward.

use sqlx::PgConnection;
use uuid::Uuid;

use crate::charges::settle::Settled;
use crate::charges::{ChargeStatus, store as charges};
use crate::error::Error;
use crate::faults::Fault;
use crate::idempotency::{Resource, SavedResponse};
use crate::operation::claim::{self, Found};
use crate::operation::engine::{Engine, Request};
use crate::operation::workflow::Operation;
use crate::params::shorten;
use crate::problem::{Problem, ProblemCode};
use crate::processor::{Processor, ProcessorError, RefundOutcome, WireFault};
use crate::refunds::NewRefund;
use crate::refunds::domain::new_refund_id;
use crate::refunds::settle::{self, Pending};
use crate::refunds::store::{self, Reserved};
use crate::retry_after;

/// A refund to make for a merchant.
#[derive(Debug)]
pub struct CreateRefund {
    id: String,
    merchant_id: Uuid,
    refund: NewRefund,
    /// What step 2 reserved on the charge.
    reserved: Option<Reserved>,
}

impl CreateRefund {
    /// The refund, with a fresh id.
    pub fn new(merchant_id: Uuid, refund: NewRefund) -> Self {
        CreateRefund {
            id: new_refund_id(),
            merchant_id,
            refund,
            reserved: None,
        }
    }

    /// What the processor needs to know of the refund, once reserved.
    fn pending(&self) -> Pending {
        let (amount, currency) = self
            .reserved
            .as_ref()
            .map_or((0, String::new()), |r| (r.amount, r.currency.clone()));
        Pending {
            id: self.id.clone(),
            charge_id: self.refund.charge.clone(),
            amount,
            currency,
        }
    }
}

impl claim::Pending for CreateRefund {
    /// In one transaction: the claim, then one conditional update that
    /// reserves the amount on the charge (and decides any race between
    /// refunds), then the refund, pending. Nothing reserved: all rolled
    /// back, and the answer says why.
    async fn claim_with_record(
        &mut self,
        engine: &Engine,
        request: &Request,
    ) -> Result<Found, Error> {
        let mut tx = claim::transaction(engine, request).await?;
        let found = claim::claim(&mut tx, engine, request, Some(&self.resource()), None).await?;
        if !matches!(found, Found::Won { .. }) {
            tx.rollback().await?;
            return Ok(found);
        }
        let amount = self.refund.amount.map(|a| a.minor_units());
        let reserved =
            store::reserve(&mut tx, self.merchant_id, &self.refund.charge, amount).await?;
        let Some(reserved) = reserved else {
            let refused = refused(&mut tx, self.merchant_id, &self.refund).await;
            tx.rollback().await?;
            return Err(refused);
        };
        store::insert_pending(&mut tx, &self.id, self.merchant_id, &self.refund, &reserved).await?;
        tx.commit().await?;
        self.reserved = Some(reserved);
        Ok(found)
    }
}

impl Operation for CreateRefund {
    type Outcome = RefundOutcome;
    const ROUTE: &'static str = "/v1/refunds";
    const NOUN: &'static str = "refund";
    const OUTCOME_UNKNOWN: &'static str = "The card processor did not confirm the refund. Retry with the same Idempotency-Key to get it.";

    fn id(&self) -> &str {
        &self.id
    }

    fn resource(&self) -> Resource {
        Resource::Refund(self.id.clone())
    }

    fn canonical(&self) -> Vec<u8> {
        self.refund.canonical()
    }

    async fn call_processor(
        &self,
        processor: &dyn Processor,
        fault: Option<WireFault>,
    ) -> Result<RefundOutcome, ProcessorError> {
        settle::refund_at_processor(processor, &self.pending(), fault).await
    }

    async fn settle(
        &self,
        engine: &Engine,
        db: &mut PgConnection,
        outcome: &RefundOutcome,
        request_id: Option<&str>,
        fault: Option<Fault>,
    ) -> sqlx::Result<Settled> {
        settle::settle_or_crash(
            db,
            &self.id,
            outcome,
            engine.timeouts.key_ttl,
            request_id,
            fault,
        )
        .await
    }

    async fn render(&self, engine: &Engine, _: Option<&str>) -> Result<SavedResponse, Error> {
        let refund = store::find_any(&engine.pool, &self.id)
            .await?
            .ok_or_else(|| Error::internal(format!("settled refund {} vanished", self.id)))?;
        Ok(settle::response_for(&refund))
    }

    async fn processor_unavailable(&self, engine: &Engine) -> Result<Option<Problem>, Error> {
        // Unlike a charge, a reserved refund is never given back: the money
        // was promised, and a recovery may already be re-driving the
        // idempotent refund call, so giving the amount back here could leave
        // money refunded at the processor with no record. The claim stays;
        // the sweeper (or a retry after PROCESSING_TIMEOUT) rolls the refund
        // forward once the processor answers.
        tracing::warn!(refund = %self.id, "processor unavailable; the refund stays reserved");
        Ok(Some(
            Problem::new(
                ProblemCode::ProcessorUnavailable,
                "The card processor is unavailable. The refund is reserved and will be completed; retry with the same Idempotency-Key to get it.",
            )
            .with_extra("refund", self.id.clone())
            .with_retry_after(retry_after::until_recovered(&engine.timeouts)),
        ))
    }
}

/// Why nothing could be reserved, read on `db` after the update decided. The
/// charge may have changed since; the answer describes what the update saw
/// as well as a later read can. An unknown charge (or another merchant's)
/// is `404` naming `id`, as Stripe answers it: the resource the refund is
/// made on, though the body names it.
async fn refused(db: &mut PgConnection, merchant_id: Uuid, refund: &NewRefund) -> Error {
    let charge = match charges::find(db, merchant_id, &refund.charge).await {
        Ok(Some(charge)) => charge,
        Ok(None) => {
            return Problem::with_status(
                http::StatusCode::NOT_FOUND,
                ProblemCode::ResourceMissing,
                format!("No such charge: '{}'", shorten(&refund.charge)),
            )
            .with_param("id")
            .into();
        }
        Err(e) => return e.into(),
    };
    let problem = if charge.status != ChargeStatus::Succeeded {
        Problem::new(
            ProblemCode::ChargeNotRefundable,
            format!(
                "Charge {} is {}: only a succeeded charge can be refunded.",
                charge.id, charge.status
            ),
        )
        .with_param("charge")
    } else if charge.capture_later && charge.captured_at.is_none() {
        let detail = if charge.capture_amount.is_some() {
            format!(
                "Charge {} is being captured: refund it once captured.",
                charge.id
            )
        } else {
            "You cannot partially refund an uncaptured charge. Instead, capture the charge for an amount less than the original amount.".to_owned()
        };
        Problem::new(ProblemCode::ChargeNotRefundable, detail).with_param("amount")
    } else if charge.amount_refunded >= charge.refundable() {
        Problem::new(
            ProblemCode::ChargeAlreadyRefunded,
            format!("Charge {} has already been refunded in full.", charge.id),
        )
        .with_param("charge")
    } else {
        Problem::new(
            ProblemCode::AmountTooLarge,
            format!(
                "Refund amount is greater than what is left to refund on charge {} ({}).",
                charge.id,
                charge.refundable() - charge.amount_refunded
            ),
        )
        .with_param("amount")
    };
    problem.into()
}
