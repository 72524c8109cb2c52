//! The services an operation needs, whoever calls it: the database pool, the
//! configuration, the processor, the caches, the shared waits, the task
//! tracker and the workshop's Redis. One `Arc` around a plain struct: every
//! request clones the state (each middleware with state, each handler), and
//! a clone is then one reference count, not one per service.

use std::sync::Arc;

use sqlx::PgPool;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::idempotency::wait::Waits;
use crate::processor::Processor;

/// What every operation (and every handler) can reach; its fields are
/// [`Services`]'s, reached through `Deref`.
#[derive(Clone)]
pub struct AppState(Arc<Services>);

impl AppState {
    pub fn new(services: Services) -> Self {
        AppState(Arc::new(services))
    }
}

impl std::ops::Deref for AppState {
    type Target = Services;

    fn deref(&self) -> &Services {
        &self.0
    }
}

/// The services themselves.
pub struct Services {
    pub pool: PgPool,
    /// The bounded queue for the pool's connections in front of every
    /// guarded operation's first statement, see [`crate::admission`].
    pub admission: Arc<crate::admission::Admission>,
    pub config: Arc<Config>,
    pub processor: Arc<dyn Processor>,
    pub metrics: crate::telemetry::metrics::Metrics,
    /// The work a request hands to its own task (steps 2 to 4); shutdown
    /// waits for it, within `SHUTDOWN_GRACE`.
    pub tasks: TaskTracker,
    /// Completed answers and merchants, see [`crate::cache`].
    pub caches: Arc<crate::cache::Caches>,
    /// Each merchant's reads and writes on this instance, see
    /// [`crate::rate_limit`].
    pub rate_limits: Arc<crate::rate_limit::RateLimits>,
    /// Requests waiting on keys in flight, see [`crate::idempotency::wait`].
    pub waits: Waits,
    /// Reads of keys that missed the replay cache, see
    /// [`crate::idempotency::reads`].
    pub reads: crate::idempotency::reads::Reads,
    /// The watch on the primary when `DATABASE_URL` names several hosts
    /// (see [`pg_follow::follow`]); `/readyz` consults it, and a
    /// request that finds the database unavailable wakes it.
    pub primary: Option<pg_follow::Primary>,
    /// The workshop's Redis (`REDIS_URL`), for `POST /demo/redis/charges`
    /// only; nothing on the real path uses it.
    pub redis: Option<redis::Client>,
}
