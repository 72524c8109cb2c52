//! Settling a charge: the processor's outcome becomes the charge's final
//! status, its key's saved response and its event, in one statement
//! ([`store::settle_and_complete`]). The request that made the charge and
//! recovery ([`crate::recovery`]) both settle here. Every settle takes
//! `key_ttl`, how long its key keeps the answer at least, and `request_id`,
//! the request its event names (`None` for the sweeper).

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

use super::{Charge, ChargeStatus, store};
use crate::events::{EventType, NewEvent};
use crate::faults::{Fault, crash_if};
use crate::idempotency::SavedResponse;
use crate::problem::{self, Problem, ProblemCode};
use crate::processor::Outcome;
pub use crate::settled::Settled;
use crate::settled::created;

pub use super::domain::ABANDONED;

/// Settles `charge_id` with `outcome` if it is still pending, reading the
/// charge first: how recovery and the tests settle.
pub async fn settle(
    pool: &PgPool,
    charge_id: &str,
    outcome: &Outcome,
    key_ttl: Duration,
    request_id: Option<&str>,
) -> sqlx::Result<Settled> {
    let mut db = pool.acquire().await?;
    match store::find_any(&mut *db, charge_id).await? {
        Some(charge) if charge.status == ChargeStatus::Pending => {
            settle_or_crash(&mut db, &charge, outcome, key_ttl, request_id, None).await
        }
        _ => Ok(Settled::Already),
    }
}

/// Settles `pending`, the charge as the request wrote it, with `outcome`:
/// renders what it becomes, its answer and its event, and writes them if it
/// is still pending. With [`Fault::CrashBeforeSettleCommit`] the statement
/// runs in a transaction the process dies in before its commit.
pub async fn settle_or_crash(
    db: &mut PgConnection,
    pending: &Charge,
    outcome: &Outcome,
    key_ttl: Duration,
    request_id: Option<&str>,
    fault: Option<Fault>,
) -> sqlx::Result<Settled> {
    let failure = match outcome {
        Outcome::Succeeded => None,
        Outcome::Declined { code, message } => Some((code.as_str(), message.as_str())),
        // An abandoned attempt is a `charge.failed` too, told apart by its
        // `failure_code`, as it is in the API.
        Outcome::Voided => Some((
            ABANDONED,
            "The payment was abandoned before the card network answered; no money moved.",
        )),
    };
    let (status, kind) = match failure {
        None => (ChargeStatus::Succeeded, EventType::ChargeSucceeded),
        Some(_) => (ChargeStatus::Failed, EventType::ChargeFailed),
    };
    let charge = Charge {
        status,
        failure_code: failure.map(|(code, _)| code.to_owned()),
        failure_message: failure.map(|(_, message)| message.to_owned()),
        ..pending.clone()
    };
    let response = response_for(&charge, request_id);
    // A charge is settled before any refund of it can be made.
    let event = NewEvent::new(kind, &charge.id, &charge.to_object(&[]));
    let settle = store::Settle {
        settled: &charge,
        response: &response,
        key_ttl,
        event: &event,
        request_id,
    };
    let settled = if fault == Some(Fault::CrashBeforeSettleCommit) {
        let mut tx = db.begin().await?;
        let settled = store::settle_and_complete(&mut *tx, &settle).await?;
        crash_if(fault, Fault::CrashBeforeSettleCommit);
        tx.commit().await?;
        settled
    } else {
        store::settle_and_complete(db, &settle).await?
    };
    let Some(key) = settled else {
        return Ok(Settled::Already);
    };
    tracing::info!(charge = %charge.id, status = %charge.status, key_completed = key.is_some(), event = %event.id, "charge settled");
    Ok(Settled::Now(response))
}

/// The response a settled charge gets, and its key saves for replay: `201`
/// with the charge, or `402` with a problem naming the failed charge and
/// `request_id`, the request that settled it, so a replay is byte for byte
/// what that request got.
pub fn response_for(charge: &Charge, request_id: Option<&str>) -> SavedResponse {
    if charge.status == ChargeStatus::Succeeded {
        return created(format!("/v1/charges/{}", charge.id), &charge.to_object(&[]));
    }
    let code = match charge.failure_code.as_deref() {
        Some("expired_card") => ProblemCode::ExpiredCard,
        Some("incorrect_cvc") => ProblemCode::IncorrectCvc,
        Some("processing_error") => ProblemCode::ProcessingError,
        Some(ABANDONED) => ProblemCode::ProcessingAbandoned,
        _ => ProblemCode::CardDeclined,
    };
    let detail = charge
        .failure_message
        .clone()
        .unwrap_or_else(|| "The payment failed.".into());
    let mut problem = Problem::new(code, detail);
    // The card's decline says why (`decline_code`) and which of its fields
    // is at fault (`param`), as Stripe's error does.
    if let Some(decline) = charge.decline() {
        if let Some(decline_code) = decline.decline_code {
            problem = problem.with_decline_code(decline_code);
        }
        if let Some(param) = decline.param {
            problem = problem.with_param(param);
        }
    }
    problem = problem.with_extra("charge", charge.id.clone());
    if let Some(request_id) = request_id {
        problem = problem.with_extra("request_id", request_id);
    }
    SavedResponse {
        status: problem.status.as_u16(),
        content_type: problem::CONTENT_TYPE.into(),
        location: None,
        body: problem.body().into(),
    }
}
