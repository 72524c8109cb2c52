//! Expiring an authorization left uncaptured past `CAPTURE_WINDOW`, as
//! Stripe does: the sweeper releases it with a refund of the whole amount
//! (`reason: expired_uncaptured_charge`). The refunds' own conditional
//! update reserves it, so a refund, a capture or another sweeper racing the
//! release leaves one of them standing; the refund is then rolled forward
//! like any other ([`crate::recovery`]), and its settle writes
//! `charge.expired`.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use crate::refunds::domain::new_refund_id;
use crate::refunds::{NewRefund, RefundReason, store as refunds};

/// How many releases of one authorization the issuer may refuse before the
/// sweeper stops asking: a person must look then (a client's refund still
/// releases it).
pub const MAX_RELEASES: i64 = 3;

/// Authorizations made more than `window` ago and neither captured nor
/// released, oldest first, up to `limit`, leaving out those whose release
/// was refused [`MAX_RELEASES`] times: `(merchant, charge id)`.
pub async fn expired(
    db: impl PgExecutor<'_>,
    window: Duration,
    limit: i64,
) -> sqlx::Result<Vec<(Uuid, String)>> {
    let rows = sqlx::query!(
        r#"SELECT merchant_id, id FROM charges
            WHERE capture_later AND capture_amount IS NULL AND amount_refunded = 0
              AND status = 'succeeded'
              AND created_at <= now() - $1::float8 * interval '1 millisecond'
              AND (SELECT count(*) FROM refunds r
                    WHERE r.charge_id = charges.id AND r.status = 'failed'
                      AND r.reason = 'expired_uncaptured_charge') < $3
            ORDER BY created_at
            LIMIT $2"#,
        window.as_millis() as f64,
        limit,
        MAX_RELEASES,
    )
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|r| (r.merchant_id, r.id)).collect())
}

/// Reserves the release of the merchant's charge and writes its refund
/// pending, in one transaction: the refund's id, or `None` when nothing is
/// left to release (a capture, a refund or another sweeper came first).
pub async fn release(
    pool: &PgPool,
    merchant_id: Uuid,
    charge_id: &str,
) -> sqlx::Result<Option<String>> {
    let mut tx = pool.begin().await?;
    let Some(reserved) = refunds::reserve(&mut tx, merchant_id, charge_id, None).await? else {
        return Ok(None);
    };
    let id = new_refund_id();
    let refund = NewRefund {
        charge: charge_id.to_owned(),
        amount: None,
        reason: Some(RefundReason::ExpiredUncapturedCharge),
        metadata: BTreeMap::new(),
    };
    refunds::insert_pending(&mut tx, &id, merchant_id, &refund, &reserved).await?;
    tx.commit().await?;
    tracing::info!(charge = %charge_id, refund = %id, "an uncaptured authorization expired; releasing it");
    Ok(Some(id))
}
