//! The charges table's SQL.

use sqlx::PgExecutor;
use uuid::Uuid;

use super::Charge;
use crate::events::NewEvent;
use crate::idempotency::SavedResponse;

/// A `query_as!` of [`Charge`]s: `$head` (a statement up to where the
/// columns go: `SELECT`, or an `INSERT` or `UPDATE` up to `RETURNING`),
/// every column of a charge, then the `$tail` literals. The columns are
/// written here once; a macro because sqlx checks only literal text, and
/// each expansion is checked against the schema like any query.
#[macro_export]
macro_rules! charge_query {
    ($head:literal, [$($tail:literal),*], $($arg:expr),* $(,)?) => {
        sqlx::query_as!(
            $crate::charges::Charge,
            $head + r#" id, merchant_id, amount, currency, source, description,
                  metadata AS "metadata: _", status AS "status: _",
                  failure_code, failure_message, amount_refunded, created_at,
                  receipt_email, statement_descriptor, statement_descriptor_suffix,
                  shipping AS "shipping: _", transfer_group,
                  fraud_details AS "fraud_details: _",
                  capture_later, capture_amount, captured_at "# $(+ $tail)*,
            $($arg),*
        )
    };
}

/// What a charge's settle writes: what the charge becomes, the answer its
/// key saves, and the event that says so.
pub struct Settle<'a> {
    /// The charge as it will be once settled.
    pub settled: &'a Charge,
    pub response: &'a SavedResponse,
    pub key_ttl: std::time::Duration,
    pub event: &'a NewEvent,
    pub request_id: Option<&'a str>,
}

/// Settles a pending charge in one statement, its own transaction. The
/// conditional update (`WHERE status = 'pending'`) decides: only if it
/// changed the row are the key completed (by `idempotency_key_complete`, as
/// every key is, see [`crate::idempotency::store`]), the event written and
/// its webhook deliveries fanned out, so whichever settle comes second
/// changes nothing. `None` when the charge was not pending any more, else
/// the key it completed, if any.
pub async fn settle_and_complete(
    db: impl PgExecutor<'_>,
    settle: &Settle<'_>,
) -> sqlx::Result<Option<Option<String>>> {
    let charge = settle.settled;
    let response = settle.response;
    let row = sqlx::query!(
        r#"WITH settled AS (
               UPDATE charges SET status = $2, failure_code = $3, failure_message = $4
                WHERE id = $1 AND status = 'pending'
               RETURNING id, merchant_id),
           completed AS (
               SELECT c.key
                 FROM settled,
                      idempotency_key_complete(settled.id, NULL, NULL, NULL, NULL,
                                               $5, $6, $7, $8, $9::float8) AS c(key)),
           written AS (
               INSERT INTO events (id, merchant_id, type, object_id, data, request_id, idempotency_key)
               SELECT $10, settled.merchant_id, $11, settled.id, $12::text::json, $13,
                      (SELECT key FROM completed)
                 FROM settled
               RETURNING seq, type, merchant_id),
           delivered AS (
               INSERT INTO webhook_deliveries (event_seq, endpoint_id)
               SELECT written.seq, w.id
                 FROM written
                 JOIN webhook_endpoints w
                   ON w.merchant_id = written.merchant_id AND w.status = 'enabled'
                  AND (written.type = ANY (w.enabled_events) OR '*' = ANY (w.enabled_events)))
           SELECT EXISTS (SELECT 1 FROM settled) AS "settled!",
                  (SELECT key FROM completed) AS key"#,
        charge.id,
        charge.status.as_str(),
        charge.failure_code.as_deref(),
        charge.failure_message.as_deref(),
        response.status as i16,
        response.content_type,
        response.location.as_deref(),
        &response.body[..],
        settle.key_ttl.as_millis() as f64,
        settle.event.id,
        settle.event.kind.as_str(),
        settle.event.data,
        settle.request_id,
    )
    .fetch_one(db)
    .await?;
    Ok(row.settled.then_some(row.key))
}

/// Gives a charge back with its key, in one statement, when its processor
/// call certainly recorded nothing: deletes the charge if still pending and,
/// then only, its key if still `processing`, so a retry runs anew (the
/// charge goes first, in the settle's lock order). `false` when the charge
/// was settled meanwhile (by the sweeper): that answer stands.
pub async fn release_pending(db: impl PgExecutor<'_>, id: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"WITH charge AS (
               DELETE FROM charges WHERE id = $1 AND status = 'pending' RETURNING id),
           key AS (
               DELETE FROM idempotency_keys
                WHERE charge_id = $1 AND status = 'processing'
                  AND EXISTS (SELECT 1 FROM charge))
           SELECT EXISTS (SELECT 1 FROM charge) AS "released!""#,
        id
    )
    .fetch_one(db)
    .await
}

/// One charge by id; `merchant_id` scopes it, so another merchant's id is not found.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<Charge>> {
    find_scoped(db, Some(merchant_id), id).await
}

/// One charge by id, whoever owns it (for the sweeper).
pub async fn find_any(db: impl PgExecutor<'_>, id: &str) -> sqlx::Result<Option<Charge>> {
    find_scoped(db, None, id).await
}

/// One charge by id, of `merchant_id` when given.
async fn find_scoped(
    db: impl PgExecutor<'_>,
    merchant_id: Option<Uuid>,
    id: &str,
) -> sqlx::Result<Option<Charge>> {
    crate::charge_query!(
        "SELECT",
        ["FROM charges WHERE id = $2 AND ($1::uuid IS NULL OR merchant_id = $1)"],
        merchant_id,
        id,
    )
    .fetch_optional(db)
    .await
}
