//! The workshop's SQL: effect counts (with the processor's ledger, read
//! through its API), and the naive endpoint's key table;
//! in [`receiver`], the webhook receivers; in [`naive_refund`], a refund
//! that checks and writes in two statements; in [`redis_keys`], keys kept
//! in Redis, outside the business transaction; in [`processor_keys`], a
//! payment asked of the gateway with a new key per attempt or the same
//! one; in [`trace`], the lab's timelines; in [`http`], the workshop's
//! routes. Nothing here is used by the real charge or refund path.

pub mod broker_demo;
pub mod http;
pub mod naive_refund;
pub mod processor_keys;
pub mod receiver;
pub mod redis_keys;
pub mod trace;

use sqlx::{PgConnection, PgExecutor, PgPool};
use uuid::Uuid;

use crate::app::AppState;
use crate::processor::{self, Authorization, Outcome, Processor};
use crate::workshop::trace::{Lane, RequestTrace, timed};
use oncepay_core::charges::domain::new_charge_id;
use oncepay_core::charges::settle::Settled;
use oncepay_core::charges::settle::{response_for, settle};
use oncepay_core::charges::{Charge, NewCharge, store};
use oncepay_core::idempotency::SavedResponse;

/// What the two systems hold for a set of charges: oncepay's charges by
/// status, and the processor's payments and refunds behind them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Effects {
    /// Payments the processor recorded: money moved.
    pub payments: i64,
    /// What those payments took, in minor units.
    pub charged: i64,
    /// Refunds the processor recorded from those payments: money given back.
    pub refunds: i64,
    /// What those refunds gave back, in minor units.
    pub refunded: i64,
    pub charges: i64,
    pub succeeded: i64,
    pub failed: i64,
    pub pending: i64,
}

/// The statement of [`effects`]'s side in oncepay's database.
fn run_charges_statement(
    merchant_id: Uuid,
    run: &str,
) -> sqlx::query::Map<
    '_,
    sqlx::Postgres,
    impl FnMut(sqlx::postgres::PgRow) -> sqlx::Result<(String, String)> + Send,
    sqlx::postgres::PgArguments,
> {
    sqlx::query!(
        "SELECT id, status FROM charges WHERE merchant_id = $1 AND metadata->>'demo_run' = $2",
        merchant_id,
        run,
    )
    .map(|row| (row.id, row.status))
}

/// The SQL of [`effects`], for tests that check its plan.
pub fn effects_sql() -> &'static str {
    sqlx::Execute::sql(&run_charges_statement(Uuid::nil(), ""))
}

/// Counts the merchant's charges tagged `metadata.demo_run = run` by
/// status (through the partial index on tagged charges, so only that run's
/// rows are read), then asks the processor, over its API, for the payment
/// behind each and the refunds of it: the money that moved, as the
/// processor's ledger says, not as oncepay believes.
pub async fn effects(
    db: impl PgExecutor<'_>,
    processor: &dyn Processor,
    merchant_id: Uuid,
    run: &str,
) -> anyhow::Result<Effects> {
    let charges = run_charges_statement(merchant_id, run)
        .fetch_all(db)
        .await?;
    let mut effects = Effects::default();
    for (id, status) in charges {
        effects.charges += 1;
        match status.as_str() {
            "succeeded" => effects.succeeded += 1,
            "failed" => effects.failed += 1,
            _ => effects.pending += 1,
        }
        let Some(payment) = processor
            .payment(&processor::authorization_key(&id))
            .await?
        else {
            continue;
        };
        if payment.outcome == Outcome::Succeeded {
            effects.payments += 1;
            effects.charged += payment.amount;
            effects.refunds += payment.refunds;
            effects.refunded += payment.amount_refunded;
        }
    }
    Ok(effects)
}

/// The naive endpoint's lookup.
pub async fn naive_lookup(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &str,
) -> sqlx::Result<Option<SavedResponse>> {
    let row = sqlx::query!(
        "SELECT status, content_type, response FROM naive_demo_keys WHERE merchant_id = $1 AND key = $2",
        merchant_id,
        key,
    )
    .fetch_optional(db)
    .await?;
    Ok(row.map(|row| SavedResponse {
        status: row.status as u16,
        content_type: row.content_type,
        location: None,
        body: row.response.into(),
    }))
}

/// The naive endpoint's pending charge, written with no key at all (the
/// guarded path writes it with the claim, `oncepay_core::operation::claim`).
async fn insert_pending(
    tx: &mut PgConnection,
    id: &str,
    merchant_id: Uuid,
    charge: &NewCharge,
) -> sqlx::Result<Charge> {
    oncepay_core::charge_query!(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, description, metadata,
                              status, receipt_email, statement_descriptor,
                              statement_descriptor_suffix, shipping, transfer_group, capture_later)
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending', $8, $9, $10, $11, $12, $13)
         RETURNING",
        [],
        id,
        merchant_id,
        charge.amount.minor_units(),
        charge.currency.as_str(),
        charge.source.as_str(),
        charge.description.as_deref(),
        sqlx::types::Json(&charge.metadata) as _,
        charge.receipt_email.as_deref(),
        charge.statement_descriptor.as_deref(),
        charge.statement_descriptor_suffix.as_deref(),
        charge.shipping.as_ref().map(sqlx::types::Json) as _,
        charge.transfer_group.as_deref(),
        !charge.capture,
    )
    .fetch_one(tx)
    .await
}

/// The naive endpoint's work: a pending charge, the processor, the settle
/// (whose event names `request_id`), each step on `trace` when recorded.
/// Returns the charge id and its answer.
pub async fn naive_charge(
    state: &AppState,
    merchant_id: Uuid,
    charge: &NewCharge,
    request_id: Option<&str>,
    trace: Option<&RequestTrace>,
) -> anyhow::Result<(String, SavedResponse)> {
    let id = new_charge_id();
    let pending = async {
        let mut tx = state.pool.begin().await?;
        insert_pending(&mut tx, &id, merchant_id, charge).await?;
        tx.commit().await
    };
    let written = format!("charge {id} written, pending");
    timed(trace, Lane::Database, &written, pending).await?;
    let processor_key = processor::authorization_key(&id);
    let asked = state.processor.authorize(Authorization {
        capture: true,
        processor_key: &processor_key,
        amount: charge.amount.minor_units(),
        currency: charge.currency.as_str(),
        source: charge.source,
        fault: None,
    });
    let outcome = timed(trace, Lane::Gateway, "the card gateway's call", asked).await?;
    let ttl = state.config.keys.ttl;
    let settled = settle(&state.pool, &id, &outcome, ttl, request_id);
    let saved = match timed(trace, Lane::Database, "settle the charge", settled).await? {
        Settled::Now(saved) => saved,
        Settled::Already => {
            let charge = store::find_any(&state.pool, &id)
                .await?
                .ok_or_else(|| anyhow::anyhow!("charge {id} vanished"))?;
            response_for(&charge, request_id)
        }
    };
    Ok((id, saved))
}

/// The naive endpoint's write, after the work. The loser of a race inserts
/// nothing; its duplicate charge already happened.
pub async fn naive_remember(
    pool: &PgPool,
    merchant_id: Uuid,
    key: &str,
    charge_id: &str,
    saved: &SavedResponse,
) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO naive_demo_keys (merchant_id, key, charge_id, status, content_type, response)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (merchant_id, key) DO NOTHING",
        merchant_id,
        key,
        charge_id,
        saved.status as i16,
        saved.content_type,
        &saved.body[..],
    )
    .execute(pool)
    .await?;
    Ok(())
}
