//! The seams for speed: what a guarded operation asks of the process around
//! it to remember answers, read keys, wait for a key in flight and take a
//! connection, each with a plain implementation here ([`Plain`]).
//!
//! The server plugs in faster ones (a replay cache, coalesced reads, shared
//! waits, a bounded admission queue). None of them decides an outcome: each
//! only answers sooner, or more cheaply, what the plain way would have
//! answered, or refuses before any work begins. Who does the work is decided
//! by the claim's one statement (`INSERT ... ON CONFLICT`,
//! [`crate::idempotency::store::claim`]), whatever these say.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::time::Instant;
use uuid::Uuid;

use crate::idempotency::store::{self, KeyStatus, StoredKey};
use crate::idempotency::{Fingerprint, IdempotencyKey, SavedResponse};

/// A completed key's saved answer, with what tells whether a request may
/// replay it.
#[derive(Debug)]
pub struct CachedAnswer {
    /// The method the key was claimed with (`POST`).
    pub method: String,
    /// The route the key was claimed on.
    pub route: String,
    /// The fingerprint of the request that claimed it.
    pub fingerprint: Fingerprint,
    pub response: SavedResponse,
    /// The `X-Request-Id` of the request that claimed the key
    /// ([`StoredKey::request_id`]).
    pub original_request: Option<String>,
    /// When the answer stops being served ([`StoredKey::deadline`]).
    pub deadline: std::time::Instant,
}

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

/// A read of a key refused at once because too many are queued: the
/// request is shed before any work.
#[derive(Debug)]
pub struct Shed;

/// What a look at a key in flight saw.
#[derive(Clone, Debug)]
pub enum News {
    /// Still `processing`, and younger than `PROCESSING_TIMEOUT`.
    InFlight,
    /// `processing` for longer than `PROCESSING_TIMEOUT`: its request may be
    /// gone, and someone should lease and settle it.
    Stale,
    /// Completed: the row, with its saved answer.
    Completed(Arc<StoredKey>),
    /// No such key (given back after a failure before the work, or
    /// expired): the next claim may win it.
    Gone,
}

impl News {
    /// The news in a row read by [`store::watch`] (the key, and whether it
    /// is stale).
    pub fn of(seen: Option<(StoredKey, bool)>) -> News {
        match seen {
            None => News::Gone,
            Some((stored, _)) if stored.status == KeyStatus::Completed => {
                News::Completed(Arc::new(stored))
            }
            Some((_, true)) => News::Stale,
            Some((_, false)) => News::InFlight,
        }
    }
}

/// One request's wait for news of a key in flight.
#[async_trait]
pub trait KeyWatch: Send {
    /// Waits for news of the key other than [`News::InFlight`], from a look
    /// that began after `since` (when the request last read the key
    /// itself). `None` if the watch ended: the caller reads the key itself
    /// and watches anew.
    async fn news_since(&mut self, since: Instant) -> Option<News>;
}

/// The fast paths a server may plug in around the guarantee. Every method
/// has the plain behaviour as its default.
#[async_trait]
pub trait FastPaths: Send + Sync + 'static {
    /// The saved answer of a merchant's completed key, if remembered.
    fn cached(&self, merchant_id: Uuid, key: &IdempotencyKey) -> Option<Arc<CachedAnswer>> {
        let _ = (merchant_id, key);
        None
    }

    /// Remembers a completed key's answer, read from the database.
    fn remember(&self, merchant_id: Uuid, key: &IdempotencyKey, answer: Arc<CachedAnswer>) {
        let _ = (merchant_id, key, answer);
    }

    /// Whether a request whose key was not remembered should read it before
    /// claiming it: a read answers a retry more cheaply than the claim's
    /// statement, and costs a new key a round trip more.
    fn worth_reading(&self) -> bool {
        true
    }

    /// Notes whether a key that was not remembered turned out `taken`.
    fn learn(&self, taken: bool) {
        let _ = taken;
    }

    /// The merchant's key as [`store::find`] reads it; `None` too when the
    /// read could not be made before `deadline` (the claim that follows
    /// finds a taken key itself). [`Shed`] when reads are refused.
    async fn read(
        &self,
        pool: &PgPool,
        merchant_id: Uuid,
        key: &IdempotencyKey,
        deadline: Instant,
    ) -> Result<Option<StoredKey>, Shed> {
        let read = tokio::time::timeout_at(deadline, store::find(pool, merchant_id, key)).await;
        Ok(read.ok().and_then(Result::ok).flatten())
    }

    /// A connection to begin a request's work on, never past `deadline`.
    async fn connection(
        &self,
        pool: &PgPool,
        deadline: Instant,
    ) -> Result<PoolConnection<Postgres>, Refused> {
        match tokio::time::timeout_at(deadline, pool.acquire()).await {
            Ok(acquired) => acquired.map_err(Refused::Pool),
            Err(_) => Err(Refused::Deadline),
        }
    }

    /// Starts a wait on a merchant's key in flight: by default, a poll of
    /// the key's row of the request's own.
    fn watch(
        &self,
        pool: &PgPool,
        processing_timeout: Duration,
        merchant_id: Uuid,
        key: &IdempotencyKey,
    ) -> Box<dyn KeyWatch> {
        Box::new(Poll {
            pool: pool.clone(),
            processing_timeout,
            merchant_id,
            key: key.clone(),
            interval: Poll::FIRST_INTERVAL,
        })
    }

    /// Tells the waits on a key that the request holding it here has
    /// finished its work.
    fn wake(&self, merchant_id: Uuid, key: &IdempotencyKey) {
        let _ = (merchant_id, key);
    }
}

/// The plain fast paths: none.
pub struct Plain;

impl FastPaths for Plain {}

/// A request's own poll of a key in flight, its interval doubling from
/// [`Poll::FIRST_INTERVAL`] up to [`Poll::LONGEST_INTERVAL`].
struct Poll {
    pool: PgPool,
    processing_timeout: Duration,
    merchant_id: Uuid,
    key: IdempotencyKey,
    interval: Duration,
}

impl Poll {
    const FIRST_INTERVAL: Duration = Duration::from_millis(20);
    const LONGEST_INTERVAL: Duration = Duration::from_millis(250);
}

#[async_trait]
impl KeyWatch for Poll {
    async fn news_since(&mut self, _since: Instant) -> Option<News> {
        // Every poll here begins after the request's last read.
        loop {
            tokio::time::sleep(self.interval).await;
            self.interval = (self.interval * 2).min(Self::LONGEST_INTERVAL);
            let seen = store::watch(
                &self.pool,
                self.merchant_id,
                &self.key,
                self.processing_timeout,
            )
            .await;
            match seen.map(News::of) {
                Ok(News::InFlight) => {}
                Ok(news) => return Some(news),
                Err(e) => {
                    // The request keeps waiting; its deadline bounds it.
                    tracing::warn!(error = %e, "a wait could not read its key");
                }
            }
        }
    }
}
