//! Recovery of one stale record: a charge or refund whose request went
//! quiet (crashed, lost the processor's answer, or is just slow). Shared by
//! the sweeper, which finds such records, and by a retry that finds its own
//! key stale (the server's `operation::claim`), so both settle a record the
//! same way and whichever comes second changes nothing.

use std::time::Duration;

use sqlx::PgPool;

use crate::charges::settle as charge_settle;
use crate::idempotency::Resource;
use crate::processor::{Outcome, Processor, RefundOutcome};
use crate::refunds::settle as refund_settle;

/// What recovering one stale record did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovered {
    /// A charge was settled with this outcome.
    Charge(Outcome),
    /// A refund was rolled forward and settled with this outcome.
    Refund(RefundOutcome),
}

/// Settles a record whose request went quiet, by its kind: a charge is fenced
/// at the processor and settled with what it holds
/// ([`charge_settle::recover`]); a refund is rolled forward
/// ([`refund_settle::recover`]). `None` when something else settled it first.
/// Used by the sweeper (`request_id` is `None`) and by a retry that finds its
/// key stale (its own request id, which the record's events name).
pub async fn recover(
    pool: &PgPool,
    processor: &dyn Processor,
    resource: &Resource,
    key_ttl: Duration,
    request_id: Option<&str>,
) -> anyhow::Result<Option<Recovered>> {
    Ok(match resource {
        Resource::Charge(id) => charge_settle::recover(pool, processor, id, key_ttl, request_id)
            .await?
            .map(Recovered::Charge),
        Resource::Refund(id) => refund_settle::recover(pool, processor, id, key_ttl, request_id)
            .await?
            .map(Recovered::Refund),
    })
}
