//! The workshop's SQL: effect counts, and the naive endpoint's key table;
//! in [`receiver`], the webhook receivers; in [`naive_refund`], a refund
//! that checks and writes in two statements; in [`redis_keys`], keys kept
//! in Redis, outside the business transaction. Nothing here is used by the
//! real charge or refund path.

pub mod naive_refund;
pub mod receiver;
pub mod redis_keys;

use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use crate::app::AppState;
use crate::charges::domain::new_charge_id;
use crate::charges::settle::Settled;
use crate::charges::settle::{response_for, settle};
use crate::charges::{NewCharge, store};
use crate::idempotency::SavedResponse;
use crate::processor::{self, Authorization};

/// What the database holds for a set of charges.
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

/// The statement of [`effects`].
fn effects_statement(
    merchant_id: Uuid,
    run: &str,
) -> sqlx::query::Map<
    '_,
    sqlx::Postgres,
    impl FnMut(sqlx::postgres::PgRow) -> sqlx::Result<Effects> + Send,
    sqlx::postgres::PgArguments,
> {
    sqlx::query_as!(
        Effects,
        r#"SELECT coalesce(sum(p.payments), 0)::bigint AS "payments!",
                  coalesce(sum(p.charged), 0)::bigint AS "charged!",
                  coalesce(sum(r.refunds), 0)::bigint AS "refunds!",
                  coalesce(sum(r.refunded), 0)::bigint AS "refunded!",
                  count(*) AS "charges!",
                  count(*) FILTER (WHERE c.status = 'succeeded') AS "succeeded!",
                  count(*) FILTER (WHERE c.status = 'failed') AS "failed!",
                  count(*) FILTER (WHERE c.status = 'pending') AS "pending!"
             FROM charges c
             -- Per charge, its payment by key and its refunds by the payment's
             -- key: index lookups, however long the ledger.
             CROSS JOIN LATERAL (
                   SELECT count(*) AS payments, sum(o.amount) AS charged
                     FROM processor_operations o
                    WHERE o.processor_key = 'auth:' || c.id AND o.outcome = 'succeeded') p
             CROSS JOIN LATERAL (
                   SELECT count(*) AS refunds, sum(o.amount) AS refunded
                     FROM processor_operations o
                    WHERE o.payment_key = 'auth:' || c.id AND o.outcome = 'refunded') r
            WHERE c.merchant_id = $1 AND c.metadata->>'demo_run' = $2"#,
        merchant_id,
        run,
    )
}

/// The SQL of [`effects`], for tests that check its plan.
pub fn effects_sql() -> &'static str {
    sqlx::Execute::sql(&effects_statement(Uuid::nil(), ""))
}

/// Counts the merchant's charges tagged `metadata.demo_run = run`, the
/// payments behind them and the refunds from those payments, with their
/// amounts. The partial index on tagged charges serves it, and each payment
/// and its refunds are looked up by key, so it reads that run's rows only,
/// however long the merchant's history or the processor's ledger.
pub async fn effects(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    run: &str,
) -> sqlx::Result<Effects> {
    effects_statement(merchant_id, run).fetch_one(db).await
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

/// The naive endpoint's work: a pending charge, the processor, the settle
/// (whose event names `request_id`). Returns the charge id and its answer.
pub async fn naive_charge(
    state: &AppState,
    merchant_id: Uuid,
    charge: &NewCharge,
    request_id: Option<&str>,
) -> anyhow::Result<(String, SavedResponse)> {
    let id = new_charge_id();
    let mut tx = state.pool.begin().await?;
    store::insert_pending(&mut tx, &id, merchant_id, charge).await?;
    tx.commit().await?;
    let processor_key = processor::authorization_key(&id);
    let outcome = state
        .processor
        .authorize(Authorization {
            processor_key: &processor_key,
            amount: charge.amount.minor_units(),
            currency: charge.currency.as_str(),
            source: charge.source,
        })
        .await?;
    let ttl = state.config.idempotency_key_ttl;
    let saved = match settle(&state.pool, &id, &outcome, ttl, request_id).await? {
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
