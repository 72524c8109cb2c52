//! Creating a charge, as a guarded [`Operation`]: the pending charge is
//! written with the claim, the processor authorizes it, and settling makes
//! its answer. When the processor is unavailable nothing was recorded, so
//! the charge and its key are given back and a retry runs anew.

use std::sync::OnceLock;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::charges::domain::new_charge_id;
use crate::charges::settle::{self, Settled};
use crate::charges::{Charge, ChargeStatus, NewCharge, store};
use crate::error::Error;
use crate::faults::Fault;
use crate::idempotency::store::PendingCharge;
use crate::idempotency::{Claim, ClaimOutcome, Resource, SavedResponse, store as keys};
use crate::operation::Engine;
use crate::operation::{Operation, claim};
use crate::problem::{Problem, ProblemCode};
use crate::processor::{self, Authorization, Outcome, Processor, ProcessorError, WireFault};
use crate::retry_after;

/// A charge to make for a merchant.
#[derive(Debug)]
pub struct CreateCharge {
    /// Made when first asked for: a request answered from the replay cache
    /// never needs one.
    id: OnceLock<String>,
    merchant_id: Uuid,
    charge: NewCharge,
    /// The charge as written pending (step 2), which the settle renders
    /// its answer and its event from.
    pending: Option<Charge>,
}

impl CreateCharge {
    /// The charge; its id is fresh, made when first needed.
    pub fn new(merchant_id: Uuid, charge: NewCharge) -> Self {
        CreateCharge {
            id: OnceLock::new(),
            merchant_id,
            charge,
            pending: None,
        }
    }
}

impl Operation for CreateCharge {
    type Outcome = Outcome;
    const ROUTE: &'static str = "/v1/charges";
    const NOUN: &'static str = "charge";
    const OUTCOME_UNKNOWN: &'static str = "The card processor did not confirm the outcome. Retry with the same Idempotency-Key to get it.";

    fn id(&self) -> &str {
        self.id.get_or_init(new_charge_id)
    }

    fn resource(&self) -> Resource {
        Resource::Charge(self.id().to_owned())
    }

    fn canonical(&self) -> Vec<u8> {
        self.charge.canonical()
    }

    async fn claim_with_record(
        &mut self,
        engine: &Engine,
        request: &claim::Request,
        claim: &Claim<'_>,
    ) -> Result<Option<ClaimOutcome>, Error> {
        let metadata = serde_json::to_string(&self.charge.metadata).expect("metadata serialises");
        let details = self.charge.details();
        let pending = PendingCharge {
            id: self.id(),
            amount: self.charge.amount.minor_units(),
            currency: self.charge.currency.as_str(),
            source: self.charge.source.as_str(),
            description: self.charge.description.as_deref(),
            metadata: &metadata,
            capture_later: !self.charge.capture,
            details: details.as_deref(),
        };
        let mut db = request.connection(engine).await?;
        let first = keys::claim_with_charge(&mut *db, claim, &pending).await?;
        if let ClaimOutcome::Claimed {
            created_at: Some(created_at),
            ..
        } = &first
        {
            self.pending = Some(Charge {
                id: self.id().to_owned(),
                merchant_id: self.merchant_id,
                amount: self.charge.amount.minor_units(),
                currency: self.charge.currency.as_str().to_owned(),
                source: self.charge.source.as_str().to_owned(),
                description: self.charge.description.clone(),
                metadata: sqlx::types::Json(self.charge.metadata.clone()),
                status: ChargeStatus::Pending,
                failure_code: None,
                failure_message: None,
                amount_refunded: 0,
                created_at: *created_at,
                capture_later: !self.charge.capture,
                capture_amount: None,
                captured_at: None,
                receipt_email: self.charge.receipt_email.clone(),
                statement_descriptor: self.charge.statement_descriptor.clone(),
                statement_descriptor_suffix: self.charge.statement_descriptor_suffix.clone(),
                shipping: self.charge.shipping.clone().map(sqlx::types::Json),
                transfer_group: self.charge.transfer_group.clone(),
                fraud_details: Default::default(),
            });
        }
        Ok(Some(first))
    }

    async fn write_pending(&mut self, tx: &mut PgConnection) -> Result<(), Error> {
        self.pending =
            Some(store::insert_pending(tx, self.id(), self.merchant_id, &self.charge).await?);
        Ok(())
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
        // Step 2 wrote the pending charge (or its statement did) before
        // any settle can run.
        let pending = self
            .pending
            .as_ref()
            .expect("the charge is written pending");
        let ttl = engine.timeouts.key_ttl;
        settle::settle_or_crash(db, pending, outcome, ttl, request_id, fault).await
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
