//! The durations the guarantee is tuned by, as the server's configuration
//! sets them, and the rules between them ([`Timeouts::new`]).

use std::time::Duration;

/// How far the clocks of an instance and of Postgres may disagree: a claim
/// compares the request's deadline, read on the instance's clock, with the
/// database's (`crate::operation::claim`). Keep both on NTP.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(1);

/// How long keys live, how long work may take, and how often recovery runs.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// How long a completed key is kept (`IDEMPOTENCY_KEY_TTL`).
    pub key_ttl: Duration,
    /// How long a key may stay `processing` before a retry or the sweeper
    /// may lease it and settle its record (`PROCESSING_TIMEOUT`).
    pub processing: Duration,
    /// How long a request may take before it is answered `503` (`REQUEST_TIMEOUT`).
    pub request: Duration,
    /// How often the sweeper looks for stale records (`SWEEP_INTERVAL`).
    pub sweep_interval: Duration,
}

/// Timeouts the guarantee cannot keep: the setting at fault, and why.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct Unsafe {
    pub setting: &'static str,
    pub reason: String,
}

impl Timeouts {
    /// The timeouts, if the guarantee holds with them:
    /// - `request < processing`: a request must be over before its key counts
    ///   as stale, or a retry or the sweeper would settle its record (fencing
    ///   the processor off) while it is still at work;
    /// - `key_ttl >= 2 x processing`: a key outlives any request holding it;
    /// - `key_ttl > request + MAX_CLOCK_SKEW`: a claim counts only if it
    ///   reaches the database before its deadline, by clocks that agree within
    ///   the skew, and a retry's answer must outlive that, or a claim made in
    ///   time could find it expired and take the key over.
    pub fn new(
        key_ttl: Duration,
        processing: Duration,
        request: Duration,
        sweep_interval: Duration,
    ) -> Result<Self, Unsafe> {
        let unsafe_ = |setting, reason: String| Err(Unsafe { setting, reason });
        if request >= processing {
            return unsafe_(
                "REQUEST_TIMEOUT",
                format!(
                    "must be below PROCESSING_TIMEOUT ({processing:?}): a request still at work \
                     then would have its record settled under it"
                ),
            );
        }
        if key_ttl < processing * 2 {
            let reason = format!("must be at least twice PROCESSING_TIMEOUT ({processing:?})");
            return unsafe_("IDEMPOTENCY_KEY_TTL", reason);
        }
        if key_ttl <= request + MAX_CLOCK_SKEW {
            return unsafe_(
                "IDEMPOTENCY_KEY_TTL",
                format!(
                    "must be longer than REQUEST_TIMEOUT ({request:?}) plus the clock skew \
                     allowed between oncepay and Postgres ({MAX_CLOCK_SKEW:?})"
                ),
            );
        }
        Ok(Timeouts {
            key_ttl,
            processing,
            request,
            sweep_interval,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_the_guarantee_cannot_keep_are_refused_naming_the_setting() {
        let ms = Duration::from_millis;
        let refused = |ttl, processing, request| {
            Timeouts::new(ms(ttl), ms(processing), ms(request), ms(5_000)).err()
        };
        assert_eq!(refused(86_400_000, 30_000, 15_000), None);
        let setting = |ttl, processing, request| refused(ttl, processing, request).unwrap().setting;
        assert_eq!(setting(86_400_000, 30_000, 30_000), "REQUEST_TIMEOUT");
        assert_eq!(setting(59_000, 30_000, 15_000), "IDEMPOTENCY_KEY_TTL");
        // Twice the processing timeout, but not a request and the skew.
        assert_eq!(setting(1_200, 600, 500), "IDEMPOTENCY_KEY_TTL");
        assert_eq!(refused(1_600, 600, 500), None);
    }
}
