//! Shared waits on keys in flight (`Prefer: wait`).
//!
//! However many requests of this process wait on one key, one task polls it:
//! one plain `SELECT` per interval, no transaction, no row lock, and no
//! connection held between polls. What it reads goes to every waiter through
//! a `watch` channel. The task stops as soon as the last waiter leaves. The
//! request holding the key wakes the poll when its work ends here, so a
//! waiter on this instance hears at once; a key held by another instance is
//! seen within one interval. It plugs into the core's one seam for waits
//! (`oncepay_core::speed::Waits`): it only says when the key may have
//! changed, and the waiter's next claim says what it holds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::Instrument;
use uuid::Uuid;

use oncepay_core::idempotency::IdempotencyKey;
use oncepay_core::idempotency::store::{self, KeyStatus};

/// The first interval between polls; it doubles up to [`LONGEST_INTERVAL`].
const FIRST_INTERVAL: Duration = Duration::from_millis(20);
const LONGEST_INTERVAL: Duration = Duration::from_millis(250);

/// One poll's result, and when the poll began.
#[derive(Clone, Debug)]
struct Observation {
    polled_at: Instant,
    /// Still `processing` and not stale: nothing for a waiter to act on.
    in_flight: bool,
}

/// One key's shared wait: the channel its waiters listen on, and the bell
/// that makes its poller look at once.
struct Shared {
    news: watch::Sender<Observation>,
    wake: Notify,
}

type KeyId = (Uuid, IdempotencyKey);

/// The shared waits of one process.
#[derive(Clone)]
pub struct Waits {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    processing_timeout: Duration,
    /// Weak: a shared wait lives as long as its poller, which keeps the
    /// strong reference.
    keys: Mutex<HashMap<KeyId, Weak<Shared>>>,
}

impl Waits {
    pub fn new(pool: PgPool, processing_timeout: Duration) -> Self {
        Waits {
            inner: Arc::new(Inner {
                pool,
                processing_timeout,
                keys: Mutex::default(),
            }),
        }
    }

    /// Joins the shared wait on a merchant's key, starting its poller if
    /// nobody waits on it yet.
    pub fn join(&self, merchant_id: Uuid, key: &IdempotencyKey) -> Waiter {
        let id = (merchant_id, key.clone());
        let mut keys = self.inner.lock();
        // Subscribing under the lock: the poller decides to stop under it too,
        // so it never stops with a waiter that has just joined.
        let news = match keys.get(&id).and_then(Weak::upgrade) {
            Some(shared) => shared.news.subscribe(),
            None => {
                let (news, receiver) = watch::channel(Observation {
                    polled_at: Instant::now(),
                    in_flight: true,
                });
                let shared = Arc::new(Shared {
                    news,
                    wake: Notify::new(),
                });
                keys.insert(id.clone(), Arc::downgrade(&shared));
                let span = tracing::info_span!(
                    "shared wait",
                    merchant = %merchant_id,
                    idempotency_key = key.as_str()
                );
                tokio::spawn(self.clone().poll(id, shared).instrument(span));
                receiver
            }
        };
        metrics::gauge!("idempotency_waiters").increment(1.0);
        Waiter { news }
    }

    /// Tells the wait on a key (if any) to look now: the request that held it
    /// here has finished its work.
    pub fn wake(&self, merchant_id: Uuid, key: &IdempotencyKey) {
        let keys = self.inner.lock();
        if let Some(shared) = keys
            .get(&(merchant_id, key.clone()))
            .and_then(Weak::upgrade)
        {
            shared.wake.notify_one();
        }
    }

    /// The poller of one key: runs until no waiter is left.
    async fn poll(self, id: KeyId, shared: Arc<Shared>) {
        let (merchant_id, key) = &id;
        let mut interval = FIRST_INTERVAL;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shared.wake.notified() => {}
                _ = shared.news.closed() => {}
            }
            if self.stop_if_unwatched(&id, &shared) {
                return;
            }
            interval = (interval * 2).min(LONGEST_INTERVAL);
            let polled_at = Instant::now();
            metrics::counter!("idempotency_wait_polls_total").increment(1);
            let seen = store::find(
                &self.inner.pool,
                *merchant_id,
                key,
                self.inner.processing_timeout,
            )
            .await;
            let in_flight = match seen {
                Ok(Some(stored)) => stored.status == KeyStatus::Processing && !stored.stale,
                Ok(None) => false,
                Err(e) => {
                    // The waiters keep waiting; their deadline bounds it.
                    tracing::warn!(error = %e, "a shared wait could not read its key");
                    continue;
                }
            };
            // A key steadily in flight wakes nobody; anything else wakes
            // every waiter, which acts on it once (see `Waiter::news_since`).
            shared.news.send_if_modified(|current| {
                *current = Observation {
                    polled_at,
                    in_flight,
                };
                !in_flight
            });
        }
    }

    /// Ends a shared wait nobody listens to any more; `true` if it ended.
    fn stop_if_unwatched(&self, id: &KeyId, shared: &Arc<Shared>) -> bool {
        let mut keys = self.inner.lock();
        if shared.news.receiver_count() > 0 {
            return false;
        }
        keys.remove(id);
        true
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<KeyId, Weak<Shared>>> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One request's place in a shared wait; leaving is dropping it.
pub struct Waiter {
    news: watch::Receiver<Observation>,
}

impl Waiter {
    /// Waits for a poll, begun after `since` (the moment this request last
    /// claimed the key), that saw the key anything but still in flight:
    /// older news is already known, so each waiter acts on each poll at most
    /// once. Returns at once if the poller died: the caller claims again.
    async fn changed_since(&mut self, since: Instant) {
        let fresh = self
            .news
            .wait_for(|seen| seen.polled_at > since && !seen.in_flight);
        let _ = fresh.await;
    }
}

#[async_trait::async_trait]
impl oncepay_core::speed::Waits for Waits {
    async fn changed(
        &self,
        _pool: &PgPool,
        _processing_timeout: Duration,
        merchant_id: Uuid,
        key: &IdempotencyKey,
        since: Instant,
    ) {
        self.join(merchant_id, key).changed_since(since).await;
    }

    fn wake(&self, merchant_id: Uuid, key: &IdempotencyKey) {
        Waits::wake(self, merchant_id, key);
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        metrics::gauge!("idempotency_waiters").decrement(1.0);
    }
}
