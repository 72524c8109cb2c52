//! Capturing a charge authorized with `capture=false`, as a guarded
//! [`Operation`] of its own, under its own key: with the claim, one
//! conditional update reserves the capture on the charge, so a charge is
//! captured once at most, whatever keys ask (a second capture is refused
//! `charge_already_captured`, its claim rolled back); the processor captures
//! under a key derived from the charge ([`processor::capture_key`]), so a
//! repeat or a recovery captures once; the settle marks the capture done.
//! Like a refund, a reserved capture is rolled forward, never given back.

use std::time::Duration;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::amount::Amount;
use crate::charges::capture;
use crate::charges::currency::Currency;
use crate::charges::settle::Settled;
use crate::charges::{Charge, store as charges};
use crate::error::Error;
use crate::faults::Fault;
use crate::idempotency::{Resource, SavedResponse};
use crate::operation::claim::{self, Found, Pending};
use crate::operation::engine::{Engine, Request};
use crate::operation::workflow::Operation;
use crate::params::ParamError;
use crate::problem::{Problem, ProblemCode};
use crate::processor::{Processor, ProcessorError, WireFault};
use crate::refunds::store as refunds;
use crate::retry_after;

/// A capture of a merchant's charge.
#[derive(Debug)]
pub struct CaptureCharge {
    merchant_id: Uuid,
    charge_id: String,
    /// What to capture; `None`: all the charge holds.
    amount: Option<Amount>,
    /// How long after its authorization a charge can be captured.
    window: Duration,
    /// The charge as step 2 reserved its capture.
    reserved: Option<Charge>,
}

impl CaptureCharge {
    /// The capture of `amount` (or all) of `charge_id`, within `window` of
    /// its authorization.
    pub fn new(
        merchant_id: Uuid,
        charge_id: String,
        amount: Option<Amount>,
        window: Duration,
    ) -> Self {
        CaptureCharge {
            merchant_id,
            charge_id,
            amount,
            window,
            reserved: None,
        }
    }
}

impl Pending for CaptureCharge {
    /// In one transaction: the claim, then one conditional update that
    /// reserves the capture on the charge, so a charge is captured once at
    /// most. Nothing reserved: both rolled back, and the answer says why.
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
        let (merchant_id, id, window) = (self.merchant_id, &self.charge_id, self.window);
        let amount = self.amount.map(|a| a.minor_units());
        let Some(charge) = capture::reserve(&mut tx, merchant_id, id, amount, window).await? else {
            let refused = capture::refused(&mut tx, merchant_id, id, window).await;
            tx.rollback().await?;
            return Err(refused);
        };
        if let Err(small) = at_least_the_minimum(&charge, self.amount) {
            tx.rollback().await?;
            return Err(small.into());
        }
        tx.commit().await?;
        self.reserved = Some(charge);
        Ok(found)
    }
}

/// `amount_too_small` when a partial capture asks for less than a charge
/// in the charge's currency may be, as Stripe refuses it; the charge's own
/// amount passed that check when it was made.
fn at_least_the_minimum(charge: &Charge, amount: Option<Amount>) -> Result<(), ParamError> {
    match (amount, Currency::parse(&charge.currency)) {
        (Some(amount), Some(currency)) => currency.check_charge(amount),
        _ => Ok(()),
    }
}

impl Operation for CaptureCharge {
    type Outcome = ();
    const ROUTE: &'static str = "/v1/charges/{charge}/capture";
    const NOUN: &'static str = "charge";
    const OUTCOME_UNKNOWN: &'static str = "The card processor did not confirm the capture. Retry with the same Idempotency-Key to get it.";

    fn id(&self) -> &str {
        &self.charge_id
    }

    fn resource(&self) -> Resource {
        Resource::Capture(self.charge_id.clone())
    }

    fn canonical(&self) -> Vec<u8> {
        let canonical = serde_json::json!([self.charge_id, self.amount.map(|a| a.minor_units())]);
        serde_json::to_vec(&canonical).expect("serialising a JSON value cannot fail")
    }

    async fn call_processor(
        &self,
        processor: &dyn Processor,
        fault: Option<WireFault>,
    ) -> Result<(), ProcessorError> {
        let charge = self.reserved.as_ref().expect("the capture is reserved");
        capture::at_processor(processor, charge, fault).await
    }

    async fn settle(
        &self,
        engine: &Engine,
        db: &mut PgConnection,
        _: &(),
        request_id: Option<&str>,
        fault: Option<Fault>,
    ) -> sqlx::Result<Settled> {
        let ttl = engine.timeouts.key_ttl;
        capture::settle_or_crash(db, &self.charge_id, ttl, request_id, fault).await
    }

    async fn render(&self, engine: &Engine, _: Option<&str>) -> Result<SavedResponse, Error> {
        let charge = charges::find_any(&engine.pool, &self.charge_id)
            .await?
            .ok_or_else(|| {
                Error::internal(format!("captured charge {} vanished", self.charge_id))
            })?;
        let refunds = refunds::of_charges(&engine.pool, std::slice::from_ref(&charge.id)).await?;
        Ok(capture::response_for(&charge, &refunds))
    }

    async fn processor_unavailable(&self, engine: &Engine) -> Result<Option<Problem>, Error> {
        // As for a refund: a recovery may already be re-driving the
        // idempotent capture, so the reservation stays and is rolled forward.
        tracing::warn!(charge = %self.charge_id, "processor unavailable; the capture stays reserved");
        Ok(Some(
            Problem::new(
                ProblemCode::ProcessorUnavailable,
                "The card processor is unavailable. The capture is reserved and will be completed; retry with the same Idempotency-Key to get it.",
            )
            .with_extra("charge", self.charge_id.clone())
            .with_retry_after(retry_after::until_recovered(&engine.timeouts)),
        ))
    }
}
