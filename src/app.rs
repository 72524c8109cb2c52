//! The services every handler can reach: the database pool, the
//! configuration, the processor, the engine that runs guarded operations,
//! the caches, the rate limits and the workshop's Redis. One `Arc` around a plain struct: every
//! request clones the state (each middleware with state, each handler), and
//! a clone is then one reference count, not one per service.

use std::sync::Arc;

use sqlx::PgPool;

use crate::config::Config;
use oncepay_core::operation::engine::Engine;

use crate::processor::Processor;
use crate::speed::front::Front;

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
    pub config: Arc<Config>,
    pub processor: Arc<dyn Processor>,
    pub metrics: crate::telemetry::metrics::Metrics,
    /// What runs guarded operations: the pool, the processor and the
    /// timeouts again, the tasks the work runs in (shutdown waits for them,
    /// within `SHUTDOWN_GRACE`) and the two seams the server plugs speed
    /// into (`crate::speed::admission`, `crate::speed::wait`).
    pub engine: Engine,
    /// What answers a completed key before the engine is entered
    /// ([`crate::speed::front`]).
    pub front: Front,
    /// Completed answers and merchants, see [`crate::speed::cache`].
    pub caches: Arc<crate::speed::cache::Caches>,
    /// Each merchant's reads and writes on this instance, see
    /// [`crate::rate_limit`].
    pub rate_limits: Arc<crate::rate_limit::RateLimits>,
    /// The watch on the primary when `DATABASE_URL` names several hosts
    /// (see [`pg_follow::follow`]); `/readyz` consults it, and a
    /// request that finds the database unavailable wakes it.
    pub primary: Option<pg_follow::Primary>,
    /// The workshop's Redis (`REDIS_URL`), for `POST /demo/redis/charges`
    /// only; nothing on the real path uses it.
    pub redis: Option<redis::Client>,
    /// The workshop's recorded requests, for the lab's timelines (see
    /// [`crate::workshop::trace`]); empty unless `DEMO_UNSAFE_ENDPOINTS=true`.
    pub traces: Arc<crate::workshop::trace::Traces>,
}
