//! Creating a charge, as a guarded [`Operation`]: the pending charge is
//! written with the claim, the processor authorizes it, and settling makes
//! its answer. When the processor is unavailable nothing was recorded, so
//! the charge and its key are given back and a retry runs anew.

use sqlx::PgConnection;
use uuid::Uuid;

use crate::charges::domain::new_charge_id;
use crate::charges::settle::{self, Settled};
use crate::charges::{Charge, NewCharge, store};
use crate::error::Error;
use crate::faults::Fault;
use crate::idempotency::{Resource, SavedResponse};
use crate::operation::claim::{self, Found, Pending};
use crate::operation::engine::{Engine, Request};
use crate::operation::workflow::Operation;
use crate::problem::{Problem, ProblemCode};
use crate::processor::{self, Authorization, Outcome, Processor, ProcessorError, WireFault};
use crate::retry_after;

/// A charge to make for a merchant.
#[derive(Debug)]
pub struct CreateCharge {
    charge: NewCharge,
    /// The charge as step 2 writes it, pending, which the settle renders
    /// its answer and its event from.
    pending: Charge,
}

impl CreateCharge {
    /// The charge; its id is fresh.
    pub fn new(merchant_id: Uuid, charge: NewCharge) -> Self {
        let pending = charge.pending(new_charge_id(), merchant_id);
        CreateCharge { charge, pending }
    }
}

impl Pending for CreateCharge {
    /// The claim's own statement writes the pending charge.
    async fn claim_with_record(
        &mut self,
        engine: &Engine,
        request: &Request,
    ) -> Result<Found, Error> {
        let mut db = claim::connection(engine, request).await?;
        let resource = self.resource();
        claim::claim(
            &mut db,
            engine,
            request,
            Some(&resource),
            Some(&mut self.pending),
        )
        .await
    }
}

impl Operation for CreateCharge {
    type Outcome = Outcome;
    const ROUTE: &'static str = "/v1/charges";
    const NOUN: &'static str = "charge";
    const OUTCOME_UNKNOWN: &'static str = "The card processor did not confirm the outcome. Retry with the same Idempotency-Key to get it.";

    fn id(&self) -> &str {
        &self.pending.id
    }

    fn resource(&self) -> Resource {
        Resource::Charge(self.pending.id.clone())
    }

    fn canonical(&self) -> Vec<u8> {
        self.charge.canonical()
    }

    async fn call_processor(
        &self,
        processor: &dyn Processor,
        fault: Option<WireFault>,
    ) -> Result<Outcome, ProcessorError> {
        let processor_key = processor::authorization_key(self.id());
        processor
            .authorize(Authorization {
                processor_key: &processor_key,
                amount: self.charge.amount.minor_units(),
                currency: self.charge.currency.as_str(),
                source: self.charge.source,
                capture: self.charge.capture,
                fault,
            })
            .await
    }

    async fn settle(
        &self,
        engine: &Engine,
        db: &mut PgConnection,
        outcome: &Outcome,
        request_id: Option<&str>,
        fault: Option<Fault>,
    ) -> sqlx::Result<Settled> {
        let ttl = engine.timeouts.key_ttl;
        settle::settle_or_crash(db, &self.pending, outcome, ttl, request_id, fault).await
    }

    async fn render(
        &self,
        engine: &Engine,
        request_id: Option<&str>,
    ) -> Result<SavedResponse, Error> {
        let charge = store::find_any(&engine.pool, self.id())
            .await?
            .ok_or_else(|| Error::internal(format!("settled charge {} vanished", self.id())))?;
        Ok(settle::response_for(&charge, request_id))
    }

    async fn processor_unavailable(&self, engine: &Engine) -> Result<Option<Problem>, Error> {
        // Nothing was recorded: give the charge and its key back.
        if !store::release_pending(&engine.pool, self.id()).await? {
            return Ok(None);
        }
        Ok(Some(
            Problem::new(
                ProblemCode::ProcessorUnavailable,
                "The card processor is unavailable and nothing was charged. Retry with the same Idempotency-Key.",
            )
            .with_retry_after(retry_after::SOON),
        ))
    }
}
