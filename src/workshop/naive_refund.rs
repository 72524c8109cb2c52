//! The workshop's naive refund (`POST /demo/naive/refunds`), WRONG ON
//! PURPOSE. Its keys are done right: each is claimed first, atomically, and
//! its answer replayed. What it gets wrong is the money: what is left to
//! refund is read with one statement and written with another, so two
//! refunds of one charge with different keys, at the same moment, both pass
//! the check and together give back more than was charged. Keys make a
//! retry safe; they do nothing for two different operations that race.
//!
//! The real refund reserves the amount with one conditional update (see
//! `refunds::store::reserve`). Nothing here is used by it, nor uses it.

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::app::AppState;
use crate::processor::{self, RefundOutcome};
use crate::workshop::trace::{Lane, RequestTrace, timed};
use oncepay_core::charges::ChargeStatus;
use oncepay_core::error::Error;
use oncepay_core::idempotency::SavedResponse;
use oncepay_core::params::shorten;
use oncepay_core::problem::{Problem, ProblemCode};
use oncepay_core::refunds::domain::new_refund_id;
use oncepay_core::refunds::{NewRefund, Refund, RefundStatus};

/// What claiming a key of the naive refund found.
#[derive(Debug)]
pub enum Claim {
    /// The key is this request's now.
    Claimed,
    /// The key's request finished: its answer.
    Replay(SavedResponse),
    /// The key's request is still at work.
    InUse,
}

/// Claims `key` before any work, in one statement; otherwise says what
/// holds it. (This part is right.)
pub async fn claim(pool: &PgPool, merchant_id: Uuid, key: &str) -> sqlx::Result<Claim> {
    let claimed = sqlx::query_scalar!(
        r#"INSERT INTO demo_naive_refund_keys (merchant_id, key) VALUES ($1, $2)
           ON CONFLICT (merchant_id, key) DO NOTHING
           RETURNING true AS "claimed!""#,
        merchant_id,
        key,
    )
    .fetch_optional(pool)
    .await?;
    if claimed.is_some() {
        return Ok(Claim::Claimed);
    }
    let row = sqlx::query!(
        "SELECT status, content_type, response FROM demo_naive_refund_keys
          WHERE merchant_id = $1 AND key = $2",
        merchant_id,
        key,
    )
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        Some(row) => match (row.status, row.content_type, row.response) {
            (Some(status), Some(content_type), Some(body)) => Claim::Replay(SavedResponse {
                status: status as u16,
                content_type,
                location: None,
                body: body.into(),
            }),
            _ => Claim::InUse,
        },
        // Released a moment ago by a refused request: in use, as far as this one knows.
        None => Claim::InUse,
    })
}

/// Frees a key whose request was refused before any money moved.
pub async fn release(pool: &PgPool, merchant_id: Uuid, key: &str) -> sqlx::Result<()> {
    sqlx::query!(
        "DELETE FROM demo_naive_refund_keys
          WHERE merchant_id = $1 AND key = $2 AND status IS NULL",
        merchant_id,
        key,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Saves the answer of a key's request, for its retries.
pub async fn complete(
    pool: &PgPool,
    merchant_id: Uuid,
    key: &str,
    saved: &SavedResponse,
) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE demo_naive_refund_keys SET status = $3, content_type = $4, response = $5
          WHERE merchant_id = $1 AND key = $2",
        merchant_id,
        key,
        saved.status as i16,
        saved.content_type,
        &saved.body[..],
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The charge as the naive check reads it.
struct Refundable {
    amount: i64,
    amount_refunded: i64,
    currency: String,
    status: ChargeStatus,
}

/// Refunds `refund`: reads what is left, checks, refunds at the processor,
/// then writes the new total. THE BUG: between the read and the write,
/// another refund can read the same total and pass the same check.
pub async fn refund(
    state: &AppState,
    merchant_id: Uuid,
    refund: &NewRefund,
    trace: Option<&RequestTrace>,
) -> Result<Refund, Error> {
    // 1. Read what is left to refund. (Bug: nothing stops another request
    //    from reading the same, until this one has written.)
    let read = sqlx::query_as!(
        Refundable,
        r#"SELECT amount, amount_refunded, currency, status AS "status: ChargeStatus" FROM charges
          WHERE id = $1 AND merchant_id = $2"#,
        refund.charge,
        merchant_id,
    )
    .fetch_optional(&state.pool);
    let charge = timed(trace, Lane::Database, "read what is refunded", read).await?;
    // 2. Check.
    let charge = check(
        &refund.charge,
        charge,
        refund.amount.map(|a| a.minor_units()),
    )?;
    let amount = refund
        .amount
        .map_or(charge.amount - charge.amount_refunded, |a| a.minor_units());

    // 3. Give the money back, at the processor (which takes its time).
    let id = new_refund_id();
    let (processor_key, payment_key) = (
        processor::refund_key(&id),
        processor::authorization_key(&refund.charge),
    );
    let asked = state.processor.refund(processor::Refund {
        processor_key: &processor_key,
        payment_key: &payment_key,
        amount,
        currency: &charge.currency,
        fault: None,
    });
    let outcome = timed(trace, Lane::Gateway, "the card gateway's refund", asked)
        .await
        .map_err(|e| Error::from_recovery(e.into(), &state.engine.timeouts))?;
    let status = match outcome {
        RefundOutcome::Refunded => RefundStatus::Succeeded,
        RefundOutcome::Failed { .. } => RefundStatus::Failed,
    };

    // 4. Write the new total: what was read plus this refund, as an ORM's
    //    `charge.amount_refunded += amount; charge.save()` does. (Bug: a
    //    total read before another refund's write overwrites that write.)
    let write = async {
        let mut tx = state.pool.begin().await?;
        if status == RefundStatus::Succeeded {
            sqlx::query!(
                "UPDATE charges SET amount_refunded = $2 WHERE id = $1",
                refund.charge,
                charge.amount_refunded + amount,
            )
            .execute(&mut *tx)
            .await?;
        }
        let created_at: DateTime<Utc> = sqlx::query_scalar!(
            "INSERT INTO demo_naive_refunds (id, merchant_id, charge_id, amount, currency)
         VALUES ($1, $2, $3, $4, $5)
         RETURNING created_at",
            id,
            merchant_id,
            refund.charge,
            amount,
            charge.currency,
        )
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(created_at)
    };
    let created_at = timed(
        trace,
        Lane::Database,
        "write what was read plus this refund",
        write,
    )
    .await?;
    Ok(Refund {
        id,
        merchant_id,
        charge_id: refund.charge.clone(),
        amount,
        currency: charge.currency,
        status,
        reason: refund.reason.map(|r| r.as_str().to_owned()),
        metadata: sqlx::types::Json(refund.metadata.clone()),
        created_at,
        failure_reason: (status == RefundStatus::Failed).then(|| "declined".to_owned()),
    })
}

/// The check, on what was read: the same refusals as the real refund's.
fn check(
    charge_id: &str,
    charge: Option<Refundable>,
    amount: Option<i64>,
) -> Result<Refundable, Error> {
    let Some(charge) = charge else {
        return Err(Problem::new(
            ProblemCode::ResourceMissing,
            format!("No such charge: '{}'", shorten(charge_id)),
        )
        .with_param("charge")
        .into());
    };
    let left = charge.amount - charge.amount_refunded;
    if charge.status != ChargeStatus::Succeeded {
        return Err(Problem::new(
            ProblemCode::ChargeNotRefundable,
            format!(
                "Charge {charge_id} is {}: only a succeeded charge can be refunded.",
                charge.status
            ),
        )
        .with_param("charge")
        .into());
    }
    if left == 0 {
        return Err(Problem::new(
            ProblemCode::ChargeAlreadyRefunded,
            format!("Charge {charge_id} has already been refunded in full."),
        )
        .with_param("charge")
        .into());
    }
    if amount.is_some_and(|a| a > left) {
        return Err(Problem::new(
            ProblemCode::AmountTooLarge,
            format!(
                "Refund amount is greater than what is left to refund on charge {charge_id} ({left})."
            ),
        )
        .with_param("amount")
        .into());
    }
    Ok(charge)
}
