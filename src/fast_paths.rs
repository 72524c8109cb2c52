//! The server's fast paths around the guarantee, plugged into the core's
//! seams ([`oncepay_core::speed`]): the replay cache ([`crate::cache`]), the
//! coalesced reads of keys ([`crate::idempotency::reads`]), the shared waits
//! on keys in flight ([`crate::idempotency::wait`]) and the bounded queue for
//! connections ([`crate::admission`]). None of them decides an outcome: the
//! claim's statement does.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::time::Instant;
use uuid::Uuid;

use crate::admission::Admission;
use crate::cache::Caches;
use crate::idempotency::reads::Reads;
use crate::idempotency::wait::Waits;
use crate::idempotency::{IdempotencyKey, StoredKey};
use crate::speed::{CachedAnswer, FastPaths, KeyWatch, Refused, Shed};

/// The four mechanisms, as one plug-in.
pub struct ServerPaths {
    pub caches: Arc<Caches>,
    pub reads: Reads,
    pub waits: Waits,
    pub admission: Arc<Admission>,
}

#[async_trait]
impl FastPaths for ServerPaths {
    fn cached(&self, merchant_id: Uuid, key: &IdempotencyKey) -> Option<Arc<CachedAnswer>> {
        self.caches.answer(merchant_id, key.as_str())
    }

    fn remember(&self, merchant_id: Uuid, key: &IdempotencyKey, answer: Arc<CachedAnswer>) {
        self.caches
            .remember_answer(merchant_id, key.as_str(), answer);
    }

    fn worth_reading(&self) -> bool {
        self.reads.worth_reading()
    }

    fn learn(&self, taken: bool) {
        self.reads.learn(taken);
    }

    async fn read(
        &self,
        _pool: &PgPool,
        merchant_id: Uuid,
        key: &IdempotencyKey,
        deadline: Instant,
    ) -> Result<Option<StoredKey>, Shed> {
        self.reads.find(merchant_id, key, deadline).await
    }

    async fn connection(
        &self,
        pool: &PgPool,
        deadline: Instant,
    ) -> Result<PoolConnection<Postgres>, Refused> {
        self.admission.connection(pool, deadline).await
    }

    fn watch(
        &self,
        _pool: &PgPool,
        _processing_timeout: Duration,
        merchant_id: Uuid,
        key: &IdempotencyKey,
    ) -> Box<dyn KeyWatch> {
        Box::new(self.waits.join(merchant_id, key))
    }

    fn wake(&self, merchant_id: Uuid, key: &IdempotencyKey) {
        self.waits.wake(merchant_id, key);
    }
}
