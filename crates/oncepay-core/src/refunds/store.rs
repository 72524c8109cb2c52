//! The refunds table's SQL, and the reservation of a refund's amount on its charge.

use std::collections::BTreeMap;

use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::{NewRefund, Refund, RefundStatus};
use crate::charges::{Charge, ChargeStatus};
use crate::objects::details::{FraudDetails, Shipping};

/// An amount reserved on a charge for a refund.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserved {
    pub amount: i64,
    pub currency: String,
}

/// Reserves `amount` (or, when `None`, whatever is left) on the merchant's
/// charge, in one conditional update that decides any race between refunds:
/// the charge row is locked, and the amount is added only if the charge
/// succeeded and the sum stays within what refunds may give back
/// ([`Charge::refundable`]: what a capture took, else the whole amount).
/// `None` when nothing was reserved; the caller finds out why with a read
/// afterwards.
pub async fn reserve(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    charge_id: &str,
    amount: Option<i64>,
) -> sqlx::Result<Option<Reserved>> {
    sqlx::query_as!(
        Reserved,
        r#"UPDATE charges c SET amount_refunded = c.amount_refunded + r.amount
             FROM (SELECT id,
                          COALESCE($2, COALESCE(capture_amount, amount) - amount_refunded) AS amount
                     FROM charges WHERE id = $1 AND merchant_id = $3
                      FOR UPDATE) r
            WHERE c.id = r.id AND c.status = 'succeeded' AND r.amount > 0
              AND c.amount_refunded + r.amount <= COALESCE(c.capture_amount, c.amount)
              -- A charge authorized first is refunded once captured, or
              -- released whole before; never while its capture is in flight.
              AND (NOT c.capture_later OR c.captured_at IS NOT NULL
                   OR (c.capture_amount IS NULL AND r.amount = c.amount))
            RETURNING r.amount AS "amount!", c.currency"#,
        charge_id,
        amount,
        merchant_id,
    )
    .fetch_optional(tx)
    .await
}

/// Writes a new refund in status `pending`, after its amount was reserved.
pub async fn insert_pending(
    tx: &mut PgConnection,
    id: &str,
    merchant_id: Uuid,
    refund: &NewRefund,
    reserved: &Reserved,
) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO refunds (id, merchant_id, charge_id, amount, currency, status, reason, metadata)
         VALUES ($1, $2, $3, $4, $5, 'pending', $6, $7)",
        id,
        merchant_id,
        refund.charge,
        reserved.amount,
        reserved.currency,
        refund.reason.map(|r| r.as_str()),
        sqlx::types::Json(&refund.metadata) as _,
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// Marks a pending refund succeeded, and returns it with its charge as it
/// stands (its `amount_refunded` counts the refund since its reservation).
/// `None` when it was not pending any more: another settle came first.
pub async fn succeed_pending(
    tx: &mut PgConnection,
    id: &str,
) -> sqlx::Result<Option<(Refund, Charge)>> {
    // One statement: the charge comes from the join, not a read of its own.
    let row = sqlx::query!(
        r#"UPDATE refunds r SET status = 'succeeded'
             FROM charges c
            WHERE r.id = $1 AND r.status = 'pending' AND c.id = r.charge_id
            RETURNING r.id, r.merchant_id, r.charge_id, r.amount, r.currency,
                      r.status AS "status: RefundStatus", r.reason,
                      r.metadata AS "metadata: Json<BTreeMap<String, String>>",
                      r.created_at, r.failure_reason,
                      c.amount AS "charge_amount!", c.currency AS "charge_currency!",
                      c.source AS "charge_source!", c.description AS charge_description,
                      c.metadata AS "charge_metadata!: Json<BTreeMap<String, String>>",
                      c.status AS "charge_status!: ChargeStatus",
                      c.failure_code AS charge_failure_code,
                      c.failure_message AS charge_failure_message,
                      c.amount_refunded AS "charge_amount_refunded!",
                      c.created_at AS "charge_created_at!",
                      c.receipt_email AS charge_receipt_email,
                      c.statement_descriptor AS charge_statement_descriptor,
                      c.statement_descriptor_suffix AS charge_statement_descriptor_suffix,
                      c.shipping AS "charge_shipping: Json<Shipping>",
                      c.transfer_group AS charge_transfer_group,
                      c.fraud_details AS "charge_fraud_details!: Json<FraudDetails>",

                      c.capture_later AS "charge_capture_later!",
                      c.capture_amount AS charge_capture_amount,
                      c.captured_at AS charge_captured_at"#,
        id,
    )
    .fetch_optional(tx)
    .await?;
    Ok(row.map(|row| {
        let charge = Charge {
            id: row.charge_id.clone(),
            merchant_id: row.merchant_id,
            amount: row.charge_amount,
            currency: row.charge_currency,
            source: row.charge_source,
            description: row.charge_description,
            metadata: row.charge_metadata,
            status: row.charge_status,
            failure_code: row.charge_failure_code,
            failure_message: row.charge_failure_message,
            amount_refunded: row.charge_amount_refunded,
            created_at: row.charge_created_at,
            capture_later: row.charge_capture_later,
            capture_amount: row.charge_capture_amount,
            captured_at: row.charge_captured_at,
            receipt_email: row.charge_receipt_email,
            statement_descriptor: row.charge_statement_descriptor,
            statement_descriptor_suffix: row.charge_statement_descriptor_suffix,
            shipping: row.charge_shipping,
            transfer_group: row.charge_transfer_group,
            fraud_details: row.charge_fraud_details,
        };
        let refund = Refund {
            id: row.id,
            merchant_id: row.merchant_id,
            charge_id: row.charge_id,
            amount: row.amount,
            currency: row.currency,
            status: row.status,
            reason: row.reason,
            metadata: row.metadata,
            created_at: row.created_at,
            failure_reason: row.failure_reason,
        };
        (refund, charge)
    }))
}

/// Marks a pending refund failed with `reason` and gives its reservation
/// back, so the amount can be refunded again; `None` as for
/// [`succeed_pending`]. Locks the refund, then the charge: the order
/// settling and reserving use.
pub async fn fail_pending(
    tx: &mut PgConnection,
    id: &str,
    reason: &str,
) -> sqlx::Result<Option<Refund>> {
    let failed = sqlx::query_as!(
        Refund,
        r#"UPDATE refunds SET status = 'failed', failure_reason = $2
            WHERE id = $1 AND status = 'pending'
            RETURNING id, merchant_id, charge_id, amount, currency, status AS "status: _", reason,
                      metadata AS "metadata: _", created_at, failure_reason"#,
        id,
        reason,
    )
    .fetch_optional(&mut *tx)
    .await?;
    let Some(refund) = failed else {
        return Ok(None);
    };
    // The pending refund's amount is part of `amount_refunded`; the schema's
    // check (0 <= amount_refunded) refuses to give back more than that.
    sqlx::query!(
        "UPDATE charges SET amount_refunded = amount_refunded - $2 WHERE id = $1",
        refund.charge_id,
        refund.amount,
    )
    .execute(&mut *tx)
    .await?;
    Ok(Some(refund))
}

/// One refund by id; `merchant_id` scopes it, so another merchant's id is not found.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<Refund>> {
    find_scoped(db, Some(merchant_id), id).await
}

/// One refund by id, whoever owns it (for recovery).
pub async fn find_any(db: impl PgExecutor<'_>, id: &str) -> sqlx::Result<Option<Refund>> {
    find_scoped(db, None, id).await
}

/// One refund by id, of `merchant_id` when given.
async fn find_scoped(
    db: impl PgExecutor<'_>,
    merchant_id: Option<Uuid>,
    id: &str,
) -> sqlx::Result<Option<Refund>> {
    sqlx::query_as!(
        Refund,
        r#"SELECT id, merchant_id, charge_id, amount, currency, status AS "status: _", reason,
                  metadata AS "metadata: _", created_at, failure_reason
             FROM refunds WHERE id = $2 AND ($1::uuid IS NULL OR merchant_id = $1)"#,
        merchant_id,
        id,
    )
    .fetch_optional(db)
    .await
}

/// The refunds of `charge_ids` (a page of charges, one statement), each
/// charge's newest first. Charge ids are unique, so they alone scope them.
pub async fn of_charges(
    db: impl PgExecutor<'_>,
    charge_ids: &[String],
) -> sqlx::Result<Vec<Refund>> {
    sqlx::query_as!(
        Refund,
        r#"SELECT id, merchant_id, charge_id, amount, currency, status AS "status: _", reason,
                  metadata AS "metadata: _", created_at, failure_reason
             FROM refunds WHERE charge_id = ANY($1)
            ORDER BY charge_id COLLATE "C", created_at DESC, id DESC"#,
        charge_ids,
    )
    .fetch_all(db)
    .await
}

/// `refunds` (from [`of_charges`]) that belong to `charge_id`.
pub fn of_charge<'a>(refunds: &'a [Refund], charge_id: &str) -> &'a [Refund] {
    let start = refunds.partition_point(|r| r.charge_id.as_str() < charge_id);
    let end = refunds.partition_point(|r| r.charge_id.as_str() <= charge_id);
    &refunds[start..end]
}
