//! The two seams where a server may put speed mechanisms inside the core,
//! each with the plain behaviour as its default ([`Plain`]): taking the
//! connection a request's work begins on ([`Admission`]), and waiting for a
//! key in flight ([`Waits`]).
//!
//! None of them decides an outcome. Who does the work, and what a retry is
//! answered, is decided by the claim's one statement
//! ([`crate::operation::claim::claim`]) whatever these do: an admission only
//! refuses a request before it has begun anything, and a wait only says when
//! to claim again. The server's other mechanisms (the replay cache, the
//! coalesced reads of keys) sit in front of the core, and the core knows
//! nothing of them (the server's `src/speed/`).

use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::time::Instant;
use uuid::Uuid;

use crate::idempotency::IdempotencyKey;
use crate::idempotency::store::{self, KeyStatus};

/// Why a request got no connection.
#[derive(Debug)]
pub enum Refused {
    /// It waited in a queue past the queue's bound: shed, before any work.
    Shed {
        /// How long it waited.
        waited: Duration,
    },
    /// The request's deadline passed first.
    Deadline,
    /// The pool failed (its own acquire timeout, closed, the database away).
    Pool(sqlx::Error),
}

/// Where a request takes the connection its work begins on.
#[async_trait]
pub trait Admission: Send + Sync + 'static {
    /// A connection from `pool`, never past `deadline`; by default the
    /// pool's own queue.
    async fn acquire(
        &self,
        pool: &PgPool,
        deadline: Instant,
    ) -> Result<PoolConnection<Postgres>, Refused> {
        match tokio::time::timeout_at(deadline, pool.acquire()).await {
            Ok(acquired) => acquired.map_err(Refused::Pool),
            Err(_) => Err(Refused::Deadline),
        }
    }
}

/// How a request waits for a key another request holds (`Prefer: wait`).
#[async_trait]
pub trait Waits: Send + Sync + 'static {
    /// Returns once the merchant's key may have changed since `since` (the
    /// request's last claim): completed, given back, expired or stale. The
    /// caller claims again, and the claim says what the key holds now. By
    /// default, a poll of the key by the request itself ([`store::find`]),
    /// its interval doubling from 20 ms to 250 ms. The caller bounds the
    /// wait by its deadline.
    async fn changed(
        &self,
        pool: &PgPool,
        processing_timeout: Duration,
        merchant_id: Uuid,
        key: &IdempotencyKey,
        since: Instant,
    ) {
        let _ = since; // every poll here begins after it
        let mut interval = Duration::from_millis(20);
        loop {
            tokio::time::sleep(interval).await;
            interval = (interval * 2).min(Duration::from_millis(250));
            match store::find(pool, merchant_id, key, processing_timeout).await {
                Ok(Some(stored)) if stored.status == KeyStatus::Processing && !stored.stale => {}
                Ok(_) => return,
                // The request keeps waiting; its deadline bounds it.
                Err(e) => tracing::warn!(error = %e, "a wait could not read its key"),
            }
        }
    }

    /// Tells the waits on a key that the request holding it here has
    /// finished its work; by default nobody listens.
    fn wake(&self, merchant_id: Uuid, key: &IdempotencyKey) {
        let _ = (merchant_id, key);
    }
}

/// The plain seams: the pool's own queue, and a poll of one's own.
pub struct Plain;

impl Admission for Plain {}

impl Waits for Plain {}
