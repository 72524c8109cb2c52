//! Per-merchant rate limits, one for reads and one for writes, held in this
//! process (GCRA, by `governor`): a merchant may send `burst` requests at
//! once and then `per_second` a second. Reads (`GET`, `HEAD`, `OPTIONS`) and
//! writes (everything else, replays of saved answers included) draw on
//! separate allowances, so a merchant polling its charges does not use up
//! its charges. A limit of 0 turns that kind off.
//!
//! The state is one entry per merchant seen lately, per kind; [`upkeep`]
//! drops the entries that are back to a full allowance, so memory follows
//! the merchants active in the last seconds, not every merchant ever seen.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use governor::clock::MonotonicClock;
use governor::state::keyed::HashMapStateStore;
use governor::{Quota, RateLimiter};
use uuid::Uuid;

/// One kind's limit as configured: 0 per second turns it off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    pub per_second: u32,
    pub burst: u32,
}

impl Limit {
    fn quota(self) -> Option<Quota> {
        let per_second = NonZeroU32::new(self.per_second)?;
        let burst = NonZeroU32::new(self.burst).unwrap_or(per_second);
        Some(Quota::per_second(per_second).allow_burst(burst))
    }
}

/// Which allowance a request draws on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
}

impl Kind {
    /// `read` or `write`, the metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Read => "read",
            Kind::Write => "write",
        }
    }
}

type Limiter = RateLimiter<Uuid, HashMapStateStore<Uuid>, MonotonicClock>;

/// The limits of one process.
pub struct RateLimits {
    reads: Option<Limiter>,
    writes: Option<Limiter>,
}

impl std::fmt::Debug for RateLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimits")
            .field("reads", &self.reads.as_ref().map(|l| l.len()))
            .field("writes", &self.writes.as_ref().map(|l| l.len()))
            .finish()
    }
}

impl RateLimits {
    pub fn new(reads: Limit, writes: Limit) -> Self {
        let limiter = |limit: Limit| {
            limit
                .quota()
                .map(|quota| RateLimiter::hashmap_with_clock(quota, MonotonicClock))
        };
        RateLimits {
            reads: limiter(reads),
            writes: limiter(writes),
        }
    }

    /// Takes one request from `merchant`'s allowance of `kind`, or tells how
    /// long until one is there.
    pub fn check(&self, merchant: Uuid, kind: Kind) -> Result<(), Duration> {
        let limiter = match kind {
            Kind::Read => &self.reads,
            Kind::Write => &self.writes,
        };
        let Some(limiter) = limiter else {
            return Ok(());
        };
        limiter
            .check_key(&merchant)
            .map_err(|not_until| not_until.wait_time_from(Instant::now()))
    }

    /// Merchants whose state is held, both kinds together.
    pub fn tracked(&self) -> usize {
        [&self.reads, &self.writes]
            .into_iter()
            .flatten()
            .map(|l| l.len())
            .sum()
    }

    /// Forgets the merchants back to a full allowance (indistinguishable
    /// from one never seen), and gives back the memory they held.
    pub fn forget_idle(&self) {
        for limiter in [&self.reads, &self.writes].into_iter().flatten() {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
    }
}

/// How often [`upkeep`] forgets idle merchants.
pub const UPKEEP_INTERVAL: Duration = Duration::from_secs(10);

/// Calls [`RateLimits::forget_idle`] every [`UPKEEP_INTERVAL`] until `stop`
/// resolves, and sets the gauge `rate_limit_merchants_tracked`.
pub async fn upkeep(
    limits: std::sync::Arc<RateLimits>,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                limits.forget_idle();
                metrics::gauge!("rate_limit_merchants_tracked").set(limits.tracked() as f64);
            }
            () = &mut stop => return,
        }
    }
}

/// `duration` in whole seconds, rounded up, at least one: a `Retry-After`.
pub fn retry_after_seconds(duration: Duration) -> u64 {
    let seconds = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    seconds.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OFF: Limit = Limit {
        per_second: 0,
        burst: 0,
    };

    #[test]
    fn a_merchant_gets_its_burst_then_waits_while_another_is_untouched() {
        let limits = RateLimits::new(
            OFF,
            Limit {
                per_second: 2,
                burst: 3,
            },
        );
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        for _ in 0..3 {
            assert_eq!(limits.check(a, Kind::Write), Ok(()));
        }
        let wait = limits.check(a, Kind::Write).unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(500),
            "{wait:?}"
        );
        assert_eq!(retry_after_seconds(wait), 1);
        assert_eq!(limits.check(b, Kind::Write), Ok(()), "another merchant");
        for _ in 0..100 {
            assert_eq!(limits.check(a, Kind::Read), Ok(()), "reads are off");
        }
        std::thread::sleep(Duration::from_millis(520));
        assert_eq!(limits.check(a, Kind::Write), Ok(()), "one more after 1/2 s");
    }

    #[test]
    fn reads_and_writes_draw_on_separate_allowances() {
        let one = Limit {
            per_second: 1,
            burst: 1,
        };
        let limits = RateLimits::new(one, one);
        let a = Uuid::now_v7();
        assert_eq!(limits.check(a, Kind::Write), Ok(()));
        assert!(limits.check(a, Kind::Write).is_err());
        assert_eq!(limits.check(a, Kind::Read), Ok(()));
        assert!(limits.check(a, Kind::Read).is_err());
    }

    #[test]
    fn idle_merchants_are_forgotten_and_busy_ones_kept() {
        let limits = RateLimits::new(
            OFF,
            Limit {
                per_second: 1000,
                burst: 1000,
            },
        );
        let busy = Uuid::now_v7();
        for _ in 0..1000 {
            let _ = limits.check(busy, Kind::Write);
        }
        for _ in 0..500 {
            limits.check(Uuid::now_v7(), Kind::Write).unwrap();
        }
        assert_eq!(limits.tracked(), 501);
        // One request each is one millisecond of allowance; after it, only
        // the merchant that used a whole second's worth is still held.
        std::thread::sleep(Duration::from_millis(50));
        limits.forget_idle();
        assert_eq!(limits.tracked(), 1);
    }

    #[test]
    fn a_zero_rate_turns_a_kind_off() {
        let limits = RateLimits::new(OFF, OFF);
        let a = Uuid::now_v7();
        for _ in 0..10_000 {
            assert_eq!(limits.check(a, Kind::Write), Ok(()));
        }
        assert_eq!(limits.tracked(), 0);
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_at_least_one() {
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_seconds(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1001)), 2);
    }
}
