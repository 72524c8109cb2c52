//! Two small in-process caches on the hot path, each bounded and each safe
//! with several instances because what it holds cannot change while cached:
//!
//! - **Completed answers.** A `completed` key's row never changes until it
//!   expires (only completed rows past `expires_at` can be taken over), so its
//!   saved answer can be replayed from memory. Entries are dropped a minute
//!   before `expires_at`, so a clock skew between this instance and the
//!   database of less than that cannot replay an expired key. The fingerprint
//!   and route are still compared on every hit.
//! - **Merchants by key hash.** Keys are never rotated or revoked in oncepay;
//!   an entry lives `MERCHANT_TTL` anyway, so a future revocation would take
//!   effect within that time.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::idempotency::{Fingerprint, SavedResponse};
use crate::merchants::Merchant;

/// Entries kept at most, per cache; when full, the oldest half is dropped.
const CAPACITY: usize = 10_000;
/// Margin before a key's `expires_at` after which a cached answer is not used.
const EXPIRY_MARGIN: chrono::TimeDelta = chrono::TimeDelta::seconds(60);
const MERCHANT_TTL: Duration = Duration::from_secs(60);

/// A completed key's answer.
#[derive(Clone, Debug)]
pub struct CachedAnswer {
    pub route: String,
    pub fingerprint: Fingerprint,
    pub response: SavedResponse,
    pub expires_at: DateTime<Utc>,
}

/// The caches of one process.
#[derive(Debug, Default)]
pub struct Caches {
    answers: Mutex<Bounded<(Uuid, String), CachedAnswer>>,
    merchants: Mutex<Bounded<Vec<u8>, (Merchant, Instant)>>,
}

impl Caches {
    /// The cached answer of a merchant's completed key, if still well before its expiry.
    pub fn answer(&self, merchant_id: Uuid, key: &str) -> Option<CachedAnswer> {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        let id = (merchant_id, key.to_owned());
        match answers.get(&id) {
            Some(answer) if Utc::now() < answer.expires_at - EXPIRY_MARGIN => Some(answer.clone()),
            Some(_) => {
                answers.remove(&id);
                None
            }
            None => None,
        }
    }

    /// Remembers a completed key's answer (call only with a `completed` row).
    pub fn remember_answer(&self, merchant_id: Uuid, key: &str, answer: CachedAnswer) {
        if Utc::now() < answer.expires_at - EXPIRY_MARGIN {
            let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
            answers.insert((merchant_id, key.to_owned()), answer);
        }
    }

    pub fn merchant(&self, key_hash: &[u8]) -> Option<Merchant> {
        let merchants = self.merchants.lock().unwrap_or_else(|e| e.into_inner());
        merchants
            .get(&key_hash.to_vec())
            .filter(|(_, at)| at.elapsed() < MERCHANT_TTL)
            .map(|(merchant, _)| merchant.clone())
    }

    pub fn remember_merchant(&self, key_hash: Vec<u8>, merchant: Merchant) {
        let mut merchants = self.merchants.lock().unwrap_or_else(|e| e.into_inner());
        merchants.insert(key_hash, (merchant, Instant::now()));
    }
}

/// A map that never grows past `CAPACITY`: when full, it drops its older half
/// (by insertion order), which keeps every operation cheap on average.
#[derive(Debug)]
struct Bounded<K, V> {
    map: HashMap<K, (u64, V)>,
    next: u64,
}

impl<K, V> Default for Bounded<K, V> {
    fn default() -> Self {
        Bounded {
            map: HashMap::new(),
            next: 0,
        }
    }
}

impl<K: std::hash::Hash + Eq, V> Bounded<K, V> {
    fn get(&self, key: &K) -> Option<&V> {
        self.map.get(key).map(|(_, v)| v)
    }

    fn remove(&mut self, key: &K) {
        self.map.remove(key);
    }

    fn insert(&mut self, key: K, value: V) {
        if self.map.len() >= CAPACITY && !self.map.contains_key(&key) {
            let cutoff = self.next - (CAPACITY as u64) / 2;
            self.map.retain(|_, (at, _)| *at >= cutoff);
        }
        self.map.insert(key, (self.next, value));
        self.next += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(expires_in: chrono::TimeDelta) -> CachedAnswer {
        CachedAnswer {
            route: "/v1/charges".into(),
            fingerprint: Fingerprint([0; 32]),
            response: SavedResponse {
                status: 201,
                content_type: "application/json".into(),
                location: None,
                body: b"{}".to_vec(),
            },
            expires_at: Utc::now() + expires_in,
        }
    }

    #[test]
    fn answers_close_to_their_expiry_are_not_served() {
        let caches = Caches::default();
        let merchant = Uuid::now_v7();
        caches.remember_answer(merchant, "soon", answer(chrono::TimeDelta::seconds(30)));
        caches.remember_answer(merchant, "later", answer(chrono::TimeDelta::hours(1)));
        assert!(caches.answer(merchant, "soon").is_none());
        assert!(caches.answer(merchant, "later").is_some());
        assert!(
            caches.answer(Uuid::now_v7(), "later").is_none(),
            "scoped per merchant"
        );
    }

    #[test]
    fn the_map_stays_bounded() {
        let mut map = Bounded::default();
        for i in 0..(CAPACITY * 3) {
            map.insert(i, i);
        }
        assert!(map.map.len() <= CAPACITY);
        assert_eq!(map.get(&(CAPACITY * 3 - 1)), Some(&(CAPACITY * 3 - 1)));
    }
}
