//! Load shedding: how long a request may queue for a pooled database
//! connection before its work begins, and when it is turned away instead.
//!
//! Every guarded operation begins by taking a connection from the pool (to
//! claim its key), through the core's one seam for it
//! (`oncepay_core::speed::Admission`). When more requests arrive than the pool
//! can serve, they queue for one; without a bound the queue grows as long
//! as the load lasts, and every request waits in it, the ones that are
//! admitted included. So the wait is bounded, CoDel-style, as Facebook's
//! servers bound theirs ("Fail at scale", ACM Queue, 2015):
//!
//! - while the queue keeps emptying, a request waits at most
//!   `DATABASE_QUEUE_TIMEOUT` (100 ms by default): a burst is absorbed;
//! - once the queue has not been empty for a whole `DATABASE_QUEUE_TIMEOUT`
//!   (a standing queue: the load is above what the pool serves), a request
//!   arriving then waits at most `DATABASE_QUEUE_OVERLOAD_TIMEOUT` (5 ms by
//!   default): the requests admitted are those that found a connection
//!   almost at once, and so keep their latency, while the excess is
//!   answered `503 overloaded` with `Retry-After` within milliseconds.
//!
//! Only a wait in the queue is cut: when the bound passes while the pool is
//! still opening connections (fewer open than its size, or one idle), the
//! request goes on waiting, since that is a database that is slow or away,
//! which `DATABASE_ACQUIRE_TIMEOUT` answers `503 service_unavailable`.
//!
//! A request turned away has done nothing: it held no connection, so it
//! claimed no key and wrote no row, and its retry with the same key runs as
//! if it were the first. Work already done is never turned away: the
//! connections that settle a record are taken from the pool directly, and so
//! is the next one of a request that settled its stale key (it has written;
//! see `oncepay_core::operation::claim`), which waits until its deadline instead.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::time::Instant;

pub use oncepay_core::speed::Refused;

/// The bounded queue in front of a pool.
pub struct Admission {
    /// The longest wait while the queue keeps emptying; also how long the
    /// queue must stay non-empty to count as standing.
    timeout: Duration,
    /// The longest wait once the queue is standing.
    overload_timeout: Duration,
    /// Requests waiting for a connection here now.
    waiting: AtomicUsize,
    /// When the queue was last empty, in milliseconds since `epoch`.
    last_empty: AtomicU64,
    epoch: Instant,
}

impl Admission {
    /// A queue whose waits are bounded by `timeout`, and by
    /// `overload_timeout` (at most `timeout`) while it stands.
    pub fn new(timeout: Duration, overload_timeout: Duration) -> Self {
        Admission {
            timeout,
            overload_timeout,
            waiting: AtomicUsize::new(0),
            last_empty: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn millis(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether the queue has not been empty for a whole `timeout`.
    pub fn standing(&self) -> bool {
        let since = self
            .millis()
            .saturating_sub(self.last_empty.load(Ordering::Relaxed));
        Duration::from_millis(since) > self.timeout
    }

    /// How long a request that starts waiting now may wait.
    fn bound(&self) -> Duration {
        if self.standing() {
            self.overload_timeout
        } else {
            self.timeout
        }
    }

    /// A connection from `pool`, waited for at most the queue's bound and
    /// never past `deadline`. A wait cut short is safe: sqlx closes a
    /// connection it had half handed over.
    pub async fn acquire(
        &self,
        pool: &PgPool,
        deadline: Instant,
    ) -> Result<PoolConnection<Postgres>, Refused> {
        let entered = Instant::now();
        let _waiting = Waiting::enter(self);
        let acquire = pool.acquire();
        tokio::pin!(acquire);
        let mut bound = entered + self.bound();
        loop {
            match tokio::time::timeout_at(bound.min(deadline), &mut acquire).await {
                Ok(acquired) => return acquired.map_err(Refused::Pool),
                Err(_) if Instant::now() >= deadline => return Err(Refused::Deadline),
                Err(_) if queued(pool) => {
                    return Err(Refused::Shed {
                        waited: entered.elapsed(),
                    });
                }
                // The pool is opening a connection, not full: wait on, and
                // look again after another bound.
                Err(_) => bound = Instant::now() + self.bound(),
            }
        }
    }
}

/// The core's seam for taking a connection: this bounded queue.
#[async_trait::async_trait]
impl oncepay_core::speed::Admission for Admission {
    async fn acquire(
        &self,
        pool: &PgPool,
        deadline: Instant,
    ) -> Result<PoolConnection<Postgres>, Refused> {
        Admission::acquire(self, pool, deadline).await
    }
}

/// Whether a request still waiting for `pool` waits in its queue: every
/// connection is open and none is idle.
fn queued(pool: &PgPool) -> bool {
    pool.size() >= pool.options().get_max_connections() && pool.num_idle() == 0
}

/// Counts a request waiting in [`Admission::acquire`], and notes when
/// the queue was last empty: as the first one enters, and as the last one
/// leaves.
struct Waiting<'a>(&'a Admission);

impl<'a> Waiting<'a> {
    fn enter(admission: &'a Admission) -> Self {
        if admission.waiting.fetch_add(1, Ordering::AcqRel) == 0 {
            admission
                .last_empty
                .store(admission.millis(), Ordering::Relaxed);
        }
        Waiting(admission)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let admission = self.0;
        if admission.waiting.fetch_sub(1, Ordering::AcqRel) == 1 {
            admission
                .last_empty
                .store(admission.millis(), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_stands_once_it_has_not_been_empty_for_a_whole_timeout() {
        let admission = Admission::new(Duration::from_millis(100), Duration::from_millis(5));
        let first = Waiting::enter(&admission);
        assert!(!admission.standing(), "it was empty just now");
        assert_eq!(admission.bound(), Duration::from_millis(100));
        std::thread::sleep(Duration::from_millis(110));
        let second = Waiting::enter(&admission);
        assert!(admission.standing(), "not empty for 110 ms");
        assert_eq!(admission.bound(), Duration::from_millis(5));
        drop(first);
        assert!(admission.standing(), "one is still waiting");
        drop(second);
        assert!(!admission.standing(), "the last one left: empty again");
        assert_eq!(admission.bound(), Duration::from_millis(100));
    }
}
