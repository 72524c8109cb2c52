//! A simulated card network with its own ledger table, `processor_operations`.
//!
//! It shares the database with the service only for convenience: it writes
//! in its own transactions, never in the service's, exactly as a remote
//! gateway would. One row per processor key makes it idempotent, and makes a
//! void recorded first a fence against any later authorization.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::PgPool;

use super::{Authorization, Outcome, Processor, ProcessorError, Refund, RefundOutcome, TestToken};

/// Why the simulated issuer refuses the first refund of a `tok_refundFail` payment.
const REFUND_REFUSED: &str = "declined";

/// The simulated processor.
#[derive(Clone, Debug)]
pub struct SimulatedProcessor {
    pool: PgPool,
    latency: Duration,
}

impl SimulatedProcessor {
    /// `latency` delays every authorization and every refund before it is
    /// recorded, so that races and in-flight duplicates can be shown.
    pub fn new(pool: PgPool, latency: Duration) -> Self {
        SimulatedProcessor { pool, latency }
    }

    async fn recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        let row = sqlx::query!(
            "SELECT outcome, decline_code FROM processor_operations WHERE processor_key = $1",
            processor_key,
        )
        .fetch_one(&self.pool)
        .await
        .map_err(unknown)?;
        Ok(outcome((row.outcome, row.decline_code)))
    }
}

#[async_trait]
impl Processor for SimulatedProcessor {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        if request.source == TestToken::ProcessorUnavailable {
            return Err(ProcessorError::Unavailable);
        }
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        let (result, decline_code) = match request.source.decline() {
            None => ("succeeded", None),
            Some((code, _)) => ("declined", Some(code)),
        };
        // First writer wins: a repeat, or an authorization arriving after a
        // void, inserts nothing and reads what was recorded first.
        let inserted = sqlx::query!(
            "INSERT INTO processor_operations
                 (processor_key, kind, outcome, amount, currency, source, decline_code)
             VALUES ($1, 'authorization', $2, $3, $4, $5, $6)
             ON CONFLICT (processor_key) DO NOTHING
             RETURNING outcome, decline_code",
            request.processor_key,
            result,
            request.amount,
            request.currency,
            request.source.as_str(),
            decline_code,
        )
        .fetch_optional(&self.pool)
        .await
        .map_err(unknown)?;
        let outcome = match inserted {
            Some(row) => outcome((row.outcome, row.decline_code)),
            None => self.recorded(request.processor_key).await?,
        };
        if request.source == TestToken::ProcessorTimeoutAfterCapture {
            // The money moved; the answer never arrives.
            return Err(ProcessorError::OutcomeUnknown(anyhow::anyhow!(
                "simulated timeout after capture"
            )));
        }
        Ok(outcome)
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        sqlx::query!(
            "INSERT INTO processor_operations (processor_key, kind, outcome)
             VALUES ($1, 'void', 'voided')
             ON CONFLICT (processor_key) DO NOTHING",
            processor_key,
        )
        .execute(&self.pool)
        .await
        .map_err(unknown)?;
        self.recorded(processor_key).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
        // Only a recorded payment can be refunded; a repeat inserts nothing.
        // The issuer of a `tok_refundFail` card refuses the payment's first
        // refund: recorded as `refund_failed`, so a repeat gets it again.
        sqlx::query!(
            "INSERT INTO processor_operations
                 (processor_key, kind, outcome, amount, currency, payment_key)
             SELECT $1, 'refund',
                    CASE WHEN p.source = $5
                          AND NOT EXISTS (SELECT 1 FROM processor_operations r
                                           WHERE r.payment_key = p.processor_key)
                         THEN 'refund_failed' ELSE 'refunded' END,
                    $2, $3, $4
               FROM processor_operations p
              WHERE p.processor_key = $4 AND p.outcome = 'succeeded'
             ON CONFLICT (processor_key) DO NOTHING",
            request.processor_key,
            request.amount,
            request.currency,
            request.payment_key,
            TestToken::RefundFail.as_str(),
        )
        .execute(&self.pool)
        .await
        .map_err(unknown)?;
        let recorded = sqlx::query_scalar!(
            "SELECT outcome FROM processor_operations WHERE processor_key = $1",
            request.processor_key,
        )
        .fetch_optional(&self.pool)
        .await
        .map_err(unknown)?;
        match recorded.as_deref() {
            Some("refunded") => Ok(RefundOutcome::Refunded),
            Some("refund_failed") => Ok(RefundOutcome::Failed {
                reason: REFUND_REFUSED.to_owned(),
            }),
            // Cannot happen for a succeeded charge; the refund stays pending
            // and the failure is logged on every recovery attempt.
            _ => Err(ProcessorError::OutcomeUnknown(anyhow::anyhow!(
                "no refund recorded under {}: no payment under {}",
                request.processor_key,
                request.payment_key
            ))),
        }
    }
}

fn outcome((outcome, decline_code): (String, Option<String>)) -> Outcome {
    match (outcome.as_str(), decline_code) {
        ("succeeded", _) => Outcome::Succeeded,
        ("voided", _) => Outcome::Voided,
        (_, code) => {
            let code = code.unwrap_or_else(|| "card_declined".into());
            let message = super::TestToken::decline_message(&code).to_owned();
            Outcome::Declined { code, message }
        }
    }
}

/// A database error in the middle of a call: the write may or may not have
/// committed, so the outcome is unknown.
fn unknown(error: sqlx::Error) -> ProcessorError {
    ProcessorError::OutcomeUnknown(anyhow::Error::new(error).context("simulated processor ledger"))
}
