//! Every `Retry-After` the API sends, computed here from the [`Timeouts`]:
//! how long until a retry with the same key can get the answer.
//!
//! | answer | why the client waits | seconds |
//! | --- | --- | --- |
//! | `409 idempotency_key_in_use` | the first request is still at work; `Prefer: wait=N` waits instead | [`SOON`] |
//! | `503 request_timeout` | the work goes on in its own task; a retry gets its answer or a `409` | [`SOON`] |
//! | `503 processor_unavailable` for a charge | nothing was recorded and the claim was released: a retry runs anew | [`SOON`] |
//! | `503 service_unavailable` before the processor was called | nothing was claimed, or the claim was rolled back | [`SOON`] |
//! | `503 overloaded` | the request was shed before it began any work | [`SOON`] |
//! | `503 processor_unavailable` for a refund | the refund stays reserved and pending; recovery rolls it forward | [`until_recovered`] |
//! | `503 processing_outcome_unknown` | the key stays claimed; recovery settles the record from the processor's own record | [`until_recovered`] |
//! | `503 service_unavailable` after the processor was called | the record could not be settled and stays pending for recovery | [`until_recovered`] |
//! | `503` from a retry whose recovery of a stale key failed at the processor | the recovery gave its lease back: the key is stale at once, and a retry recovers it as soon as the processor answers | [`SOON`] |
//!
//! A record left pending is settled by recovery: by a retry once its key has
//! been `processing` for `PROCESSING_TIMEOUT`, and by the sweeper at its first
//! pass after that, at most one `SWEEP_INTERVAL` later. Retrying sooner only
//! gets `409`. A recovery that fails gives its lease back
//! ([`crate::recovery::recover_leased`]), so the key stays stale: the next
//! retry or sweep pass tries again.

use std::time::Duration;

use crate::settings::Timeouts;

/// A retry may get the answer at once; one second keeps clients from spinning.
pub const SOON: u64 = 1;

/// Seconds until recovery has settled a record left pending now:
/// `PROCESSING_TIMEOUT` plus one `SWEEP_INTERVAL`, rounded up to whole
/// seconds (35 with the defaults).
pub fn until_recovered(timeouts: &Timeouts) -> u64 {
    whole_seconds(timeouts.processing + timeouts.sweep_interval)
}

/// `duration` rounded up to whole seconds, at least one.
fn whole_seconds(duration: Duration) -> u64 {
    let seconds = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    seconds.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeouts(processing: Duration, sweep_interval: Duration) -> Timeouts {
        Timeouts {
            key_ttl: Duration::from_secs(86_400),
            processing,
            request: Duration::from_secs(10),
            sweep_interval,
        }
    }

    #[test]
    fn a_pending_record_is_answered_after_the_timeout_and_one_sweep_rounded_up() {
        let defaults = timeouts(Duration::from_secs(30), Duration::from_secs(5));
        assert_eq!(until_recovered(&defaults), 35);
        let short = timeouts(Duration::from_millis(1500), Duration::from_millis(700));
        assert_eq!(until_recovered(&short), 3);
        let exact = timeouts(Duration::from_millis(1500), Duration::from_millis(500));
        assert_eq!(until_recovered(&exact), 2);
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::ZERO), 1);
    }
}
