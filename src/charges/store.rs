//! The charges table's SQL.

use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::{Charge, ChargeStatus, NewCharge};

/// Writes a new charge in status `pending`, before the processor is called.
pub async fn insert_pending(
    tx: &mut PgConnection,
    id: &str,
    merchant_id: Uuid,
    charge: &NewCharge,
) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, description, metadata, status)
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending')",
        id,
        merchant_id,
        charge.amount.minor_units(),
        charge.currency.as_str(),
        charge.source.as_str(),
        charge.description.as_deref(),
        sqlx::types::Json(&charge.metadata) as _,
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// Moves a pending charge to its final status. `None` means the charge was
/// not pending any more: something else settled it first, and what it wrote
/// stands.
pub async fn settle_pending(
    tx: &mut PgConnection,
    id: &str,
    status: ChargeStatus,
    failure: Option<(&str, &str)>,
) -> sqlx::Result<Option<Charge>> {
    sqlx::query_as!(
        Charge,
        r#"UPDATE charges SET status = $2, failure_code = $3, failure_message = $4
            WHERE id = $1 AND status = 'pending'
            RETURNING id, merchant_id, amount, currency, source, description,
                      metadata AS "metadata: _", status AS "status: _",
                      failure_code, failure_message, amount_refunded, created_at"#,
        id,
        status.as_str(),
        failure.map(|(code, _)| code),
        failure.map(|(_, message)| message),
    )
    .fetch_optional(tx)
    .await
}

/// Deletes a pending charge whose processor call certainly recorded nothing.
pub async fn delete_pending(tx: &mut PgConnection, id: &str) -> sqlx::Result<u64> {
    let deleted = sqlx::query!(
        "DELETE FROM charges WHERE id = $1 AND status = 'pending'",
        id
    )
    .execute(tx)
    .await?;
    Ok(deleted.rows_affected())
}

/// One charge by id; `merchant_id` scopes it, so another merchant's id is not found.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<Charge>> {
    sqlx::query_as!(
        Charge,
        r#"SELECT id, merchant_id, amount, currency, source, description,
                  metadata AS "metadata: _", status AS "status: _",
                  failure_code, failure_message, amount_refunded, created_at
             FROM charges WHERE merchant_id = $1 AND id = $2"#,
        merchant_id,
        id,
    )
    .fetch_optional(db)
    .await
}

/// One charge by id, whoever owns it (for the sweeper).
pub async fn find_any(db: impl PgExecutor<'_>, id: &str) -> sqlx::Result<Option<Charge>> {
    sqlx::query_as!(
        Charge,
        r#"SELECT id, merchant_id, amount, currency, source, description,
                  metadata AS "metadata: _", status AS "status: _",
                  failure_code, failure_message, amount_refunded, created_at
             FROM charges WHERE id = $1"#,
        id,
    )
    .fetch_optional(db)
    .await
}

/// Up to `limit` charges, newest first, strictly after the cursor charge
/// `starting_after` when given. The caller checks the cursor exists.
pub async fn list(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    starting_after: Option<&Charge>,
    limit: i64,
) -> sqlx::Result<Vec<Charge>> {
    sqlx::query_as!(
        Charge,
        r#"SELECT id, merchant_id, amount, currency, source, description,
                  metadata AS "metadata: _", status AS "status: _",
                  failure_code, failure_message, amount_refunded, created_at
             FROM charges
            WHERE merchant_id = $1
              AND ($2::timestamptz IS NULL OR (created_at, id) < ($2, $3))
            ORDER BY created_at DESC, id DESC
            LIMIT $4"#,
        merchant_id,
        starting_after.map(|c| c.created_at),
        starting_after.map(|c| c.id.as_str()),
        limit,
    )
    .fetch_all(db)
    .await
}

/// Up to `limit` charges strictly newer than `ending_before`, oldest first:
/// the ones nearest the cursor, which the caller shows newest first.
pub async fn list_before(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    ending_before: &Charge,
    limit: i64,
) -> sqlx::Result<Vec<Charge>> {
    sqlx::query_as!(
        Charge,
        r#"SELECT id, merchant_id, amount, currency, source, description,
                  metadata AS "metadata: _", status AS "status: _",
                  failure_code, failure_message, amount_refunded, created_at
             FROM charges
            WHERE merchant_id = $1 AND (created_at, id) > ($2, $3)
            ORDER BY created_at, id
            LIMIT $4"#,
        merchant_id,
        ending_before.created_at,
        ending_before.id.as_str(),
        limit,
    )
    .fetch_all(db)
    .await
}

/// Pending charges older than `timeout` that no `processing` key guards (the
/// keyless ones a crash left behind); keyed ones are found through their key.
pub async fn stale_unguarded(
    db: impl PgExecutor<'_>,
    timeout: std::time::Duration,
    limit: i64,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar!(
        "SELECT c.id FROM charges c
          WHERE c.status = 'pending'
            AND c.created_at < now() - $1::float8 * interval '1 millisecond'
            AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                             WHERE k.charge_id = c.id AND k.status = 'processing')
          ORDER BY c.created_at
          LIMIT $2",
        timeout.as_millis() as f64,
        limit,
    )
    .fetch_all(db)
    .await
}
