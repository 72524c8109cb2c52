//! Two in-process caches on the hot path, both `quick_cache` caches (sharded,
//! concurrent, evicting by a CLOCK-style policy), each bounded and each safe
//! with several instances because what it holds cannot change while cached:
//!
//! - **Completed answers**, bounded by bytes (`REPLAY_CACHE_BYTES`; 0 turns
//!   it off). A `completed` key's row never changes until it expires (only
//!   completed rows past `expires_at` can be taken over), so its saved answer
//!   can be replayed from memory. An entry is served until its deadline: the
//!   monotonic instant taken before the row was read plus the lifetime the
//!   database gave the row in that same read. Neither this instance's wall
//!   clock nor its skew from the database's enters into it. A hit shares the
//!   saved body (`Bytes`), it does not copy it. The fingerprint and route are
//!   still compared on every hit.
//! - **Merchants by key hash**, bounded by count. An entry lives
//!   `MERCHANT_TTL` from the moment it was read from the database (a hit does
//!   not extend it), or less when the key expires sooner: a rolled key's
//!   entry ends with the key, by the lifetime the database gave it in the
//!   same read. A key rolled at once is refused by every instance within
//!   `MERCHANT_TTL`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quick_cache::sync::Cache;
use quick_cache::{OptionsBuilder, Weighter};
use uuid::Uuid;

use crate::merchants::{KeyHolder, Merchant};
pub use oncepay_core::idempotency::SavedAnswer;

/// How long a merchant read from the database is trusted: a key rolled at
/// once stops working on every instance within it. One lookup per key and
/// instance every few seconds costs nothing measurable.
pub const MERCHANT_TTL: Duration = Duration::from_secs(5);
/// Merchants kept at most.
const MERCHANT_CAPACITY: usize = 10_000;
/// The largest answer cached, whatever the budget: well above any answer the
/// API makes with the default `MAX_BODY_BYTES` (a charge with the most and
/// longest metadata values, JSON-escaped, stays under 160 KiB).
const MAX_ENTRY_BYTES: u64 = 256 * 1024;
/// The most of the budget one answer may take, as a divisor: a few large
/// answers cannot flush a small cache.
const MAX_ENTRY_SHARE: u64 = 16;
/// What an entry costs beyond the bytes of its key, strings and body: the
/// `Arc`ed answer (about 240 bytes), the cache's slot and table entry (about
/// 120 with the slack of their growth), and the allocator's headers and
/// rounding of the eight allocations (about 130). Checked in the tests
/// against the structs' sizes.
const ENTRY_OVERHEAD: u64 = 640;
/// The answer cache's shards. Each holds an eighth of the budget, and
/// `quick_cache` refuses an entry larger than its shard's share, so the
/// per-entry cap (at most a sixteenth) always fits.
const ANSWER_SHARDS: usize = 8;
/// A guess at the average entry, only to size the shards' bookkeeping.
const TYPICAL_ENTRY_BYTES: u64 = 4096;

type AnswerKey = (Uuid, String);

/// An answer's weight in bytes: its body, key, strings and fixed overhead.
#[derive(Clone, Copy, Debug)]
struct AnswerWeighter;

impl Weighter<AnswerKey, Arc<SavedAnswer>> for AnswerWeighter {
    fn weight(&self, key: &AnswerKey, answer: &Arc<SavedAnswer>) -> u64 {
        answer_weight(&key.1, answer)
    }
}

fn answer_weight(key: &str, answer: &SavedAnswer) -> u64 {
    let response = &answer.response;
    let bytes = key.len()
        + answer.first.method.len()
        + answer.first.route.len()
        + answer.original_request.as_ref().map_or(0, String::len)
        + response.content_type.len()
        + response.location.as_ref().map_or(0, String::len)
        + response.body.len();
    ENTRY_OVERHEAD + bytes as u64
}

struct Answers {
    cache: Cache<AnswerKey, Arc<SavedAnswer>, AnswerWeighter>,
    max_entry: u64,
}

/// The caches of one process.
pub struct Caches {
    /// `None` when `REPLAY_CACHE_BYTES` is 0.
    answers: Option<Answers>,
    /// Each with the instant after which it is read again.
    merchants: Cache<Vec<u8>, (Merchant, Instant)>,
    merchant_ttl: Duration,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("answer_bytes", &self.answer_bytes())
            .field("answer_budget", &self.answer_budget())
            .field("merchants", &self.merchants.len())
            .finish()
    }
}

impl Caches {
    /// Caches that hold at most `answer_budget` bytes of answers (0: none).
    pub fn new(answer_budget: u64) -> Self {
        Self::with_merchant_ttl(answer_budget, MERCHANT_TTL)
    }

    /// [`Caches::new`] with another merchant lifetime (tests).
    pub fn with_merchant_ttl(answer_budget: u64, merchant_ttl: Duration) -> Self {
        // A multiple of the shard count, so the shards' shares add up to no
        // more than the budget.
        let budget = answer_budget - answer_budget % ANSWER_SHARDS as u64;
        let answers = (budget > 0).then(|| {
            let options = OptionsBuilder::new()
                .shards(ANSWER_SHARDS)
                .weight_capacity(budget)
                .estimated_items_capacity((budget / TYPICAL_ENTRY_BYTES).max(1) as usize)
                .build()
                .expect("every option is set");
            Answers {
                cache: Cache::with_options(
                    options,
                    AnswerWeighter,
                    Default::default(),
                    Default::default(),
                ),
                max_entry: MAX_ENTRY_BYTES.min(budget / MAX_ENTRY_SHARE),
            }
        });
        Caches {
            answers,
            merchants: Cache::new(MERCHANT_CAPACITY),
            merchant_ttl,
        }
    }

    /// The cached answer of a merchant's completed key, if before its deadline.
    pub fn answer(&self, merchant_id: Uuid, key: &str) -> Option<Arc<SavedAnswer>> {
        let answers = self.answers.as_ref()?;
        let id = (merchant_id, key.to_owned());
        let answer = answers.cache.get(&id)?;
        if Instant::now() < answer.deadline {
            return Some(answer);
        }
        answers.cache.remove_if(&id, |a| Arc::ptr_eq(a, &answer));
        None
    }

    /// Remembers a completed key's answer (call only with a `completed`
    /// row), unless it is past its deadline or larger than the per-entry cap.
    pub fn remember_answer(&self, merchant_id: Uuid, key: &str, answer: Arc<SavedAnswer>) {
        let Some(answers) = &self.answers else {
            return;
        };
        if Instant::now() >= answer.deadline || answer_weight(key, &answer) > answers.max_entry {
            return;
        }
        answers.cache.insert((merchant_id, key.to_owned()), answer);
    }

    /// Bytes of answers held now, by the same count as the budget.
    pub fn answer_bytes(&self) -> u64 {
        self.answers.as_ref().map_or(0, |a| a.cache.weight())
    }

    /// The most bytes of answers held at once.
    pub fn answer_budget(&self) -> u64 {
        self.answers.as_ref().map_or(0, |a| a.cache.capacity())
    }

    /// The merchant with this key hash: from the cache if it was read from
    /// the database less than the merchant lifetime ago and its key has not
    /// expired since, else from `load` (which then starts a new lifetime). A
    /// hit does not extend the entry.
    pub async fn merchant_or_load<E, F>(
        &self,
        key_hash: Vec<u8>,
        load: F,
    ) -> Result<Option<Merchant>, E>
    where
        F: Future<Output = Result<Option<KeyHolder>, E>>,
    {
        if let Some((merchant, deadline)) = self.merchants.get(&key_hash) {
            if Instant::now() < deadline {
                return Ok(Some(merchant));
            }
            self.merchants
                .remove_if(&key_hash, |(_, at)| *at == deadline);
        }
        let read_at = Instant::now();
        let Some(found) = load.await? else {
            return Ok(None);
        };
        let lives = found
            .expires_in
            .map_or(self.merchant_ttl, |left| left.min(self.merchant_ttl));
        self.merchants
            .insert(key_hash, (found.merchant.clone(), read_at + lives));
        Ok(Some(found.merchant))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use oncepay_core::idempotency::{Fingerprint, FirstRequest, SavedResponse};

    fn answer(body_bytes: usize, lives: Duration) -> Arc<SavedAnswer> {
        Arc::new(SavedAnswer {
            first: FirstRequest {
                method: "POST".into(),
                route: "/v1/charges".into(),
                fingerprint: Fingerprint([0; 32]),
            },
            response: SavedResponse {
                status: 201,
                content_type: "application/json".into(),
                location: None,
                body: vec![b'x'; body_bytes].into(),
            },
            original_request: None,
            deadline: Instant::now() + lives,
        })
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn answers_are_served_until_their_deadline_and_not_after() {
        let caches = Caches::new(1 << 20);
        let merchant = Uuid::now_v7();
        caches.remember_answer(merchant, "soon", answer(2, Duration::from_millis(300)));
        caches.remember_answer(merchant, "later", answer(2, HOUR));
        assert!(
            caches.answer(merchant, "soon").is_some(),
            "before its deadline"
        );
        assert!(
            caches.answer(Uuid::now_v7(), "later").is_none(),
            "scoped per merchant"
        );
        std::thread::sleep(Duration::from_millis(350));
        assert!(
            caches.answer(merchant, "soon").is_none(),
            "after its deadline"
        );
        assert!(caches.answer(merchant, "later").is_some());
    }

    #[test]
    fn answers_past_their_deadline_are_not_remembered() {
        let caches = Caches::new(1 << 20);
        let merchant = Uuid::now_v7();
        caches.remember_answer(merchant, "gone", answer(2, Duration::ZERO));
        assert!(caches.answer(merchant, "gone").is_none());
        assert_eq!(caches.answer_bytes(), 0);
    }

    #[test]
    fn a_hit_shares_the_body_instead_of_copying_it() {
        let caches = Caches::new(1 << 20);
        let merchant = Uuid::now_v7();
        let saved = answer(1000, HOUR);
        caches.remember_answer(merchant, "k", saved.clone());
        let hit = caches.answer(merchant, "k").unwrap();
        assert_eq!(hit.response.body.as_ptr(), saved.response.body.as_ptr());
    }

    #[test]
    fn the_answers_never_weigh_more_than_the_budget() {
        let budget = 1 << 20;
        let caches = Caches::new(budget);
        let merchant = Uuid::now_v7();
        // 40 times the budget, in answers of 1 to 60 KiB.
        let mut inserted = 0;
        for i in 0..2_000u64 {
            let body = 1024 * (1 + (i * 7919 % 60)) as usize;
            inserted += body as u64;
            caches.remember_answer(merchant, &format!("key-{i}"), answer(body, HOUR));
            assert!(caches.answer_bytes() <= budget, "over budget after {i}");
        }
        assert!(inserted > 40 * budget);
        assert!(caches.answer_budget() <= budget);
        // Counted again from what is served, not from the cache's own tally.
        let held: u64 = (0..2_000u64)
            .filter_map(|i| caches.answer(merchant, &format!("key-{i}")))
            .map(|a| a.response.body.len() as u64)
            .sum();
        assert!(held <= budget, "{held} bytes of bodies held");
        assert!(
            caches.answer_bytes() > budget / 2,
            "the cache is used: {} bytes",
            caches.answer_bytes()
        );
    }

    #[test]
    fn an_answer_larger_than_the_per_entry_cap_is_not_cached() {
        let caches = Caches::new(64 << 20);
        let merchant = Uuid::now_v7();
        caches.remember_answer(merchant, "big", answer(MAX_ENTRY_BYTES as usize, HOUR));
        assert!(caches.answer(merchant, "big").is_none());
        assert_eq!(caches.answer_bytes(), 0);
        let fits = MAX_ENTRY_BYTES as usize - ENTRY_OVERHEAD as usize - 64;
        caches.remember_answer(merchant, "fits", answer(fits, HOUR));
        assert!(caches.answer(merchant, "fits").is_some());

        // With a small budget, the cap is a sixteenth of it.
        let small = Caches::new(160 * 1024);
        small.remember_answer(merchant, "big", answer(12 * 1024, HOUR));
        assert!(small.answer(merchant, "big").is_none());
        small.remember_answer(merchant, "fits", answer(8 * 1024, HOUR));
        assert!(small.answer(merchant, "fits").is_some());
    }

    #[test]
    fn a_zero_budget_turns_the_answer_cache_off() {
        let caches = Caches::new(0);
        let merchant = Uuid::now_v7();
        caches.remember_answer(merchant, "k", answer(2, HOUR));
        assert!(caches.answer(merchant, "k").is_none());
        assert_eq!(caches.answer_budget(), 0);
    }

    #[test]
    fn the_fixed_overhead_covers_the_entry_structs() {
        let structs = std::mem::size_of::<AnswerKey>()
            + std::mem::size_of::<Arc<SavedAnswer>>()
            + std::mem::size_of::<SavedAnswer>()
            + 2 * std::mem::size_of::<usize>();
        // Leaves room for the cache's slot links, its table entry and the
        // allocator's headers.
        assert!(structs * 2 <= ENTRY_OVERHEAD as usize, "{structs} bytes");
    }

    /// Reads the merchant of the key `hash` through `caches`, loading on a
    /// miss one whose key expires in `expires_in` (`None`: never); how many
    /// loads `loads` has counted, this read's included.
    async fn read_key(
        caches: &Caches,
        hash: &[u8],
        expires_in: Option<Duration>,
        loads: &AtomicUsize,
    ) -> usize {
        let load = async {
            loads.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>(Some(KeyHolder {
                merchant: Merchant {
                    id: Uuid::nil(),
                    name: "m".into(),
                },
                expires_in,
            }))
        };
        caches.merchant_or_load(hash.to_vec(), load).await.unwrap();
        loads.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_merchant_hit_does_not_extend_its_life() {
        let caches = Caches::with_merchant_ttl(0, Duration::from_millis(600));
        let loads = AtomicUsize::new(0);
        let read = || read_key(&caches, b"hash", None, &loads);
        assert_eq!(read().await, 1, "a miss reads the database");
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            read().await;
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1, "hits within the lifetime");
        // 350 ms after the last hit, 750 ms after the read: expired, though a
        // lifetime counted from the last hit would still run.
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(read().await, 2, "read again after the lifetime");
    }

    #[tokio::test]
    async fn a_rolled_keys_entry_ends_when_the_key_expires() {
        let caches = Caches::with_merchant_ttl(0, Duration::from_secs(60));
        let loads = AtomicUsize::new(0);
        let read = || {
            read_key(
                &caches,
                b"old key",
                Some(Duration::from_millis(300)),
                &loads,
            )
        };
        read().await;
        assert_eq!(read().await, 1, "a hit before it expires");
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(
            read().await,
            2,
            "read again once the key expired, well within the lifetime"
        );
    }

    #[tokio::test]
    async fn an_unknown_key_is_not_cached() {
        let caches = Caches::new(0);
        let loads = AtomicUsize::new(0);
        for _ in 0..2 {
            let found = caches
                .merchant_or_load(b"nope".to_vec(), async {
                    loads.fetch_add(1, Ordering::SeqCst);
                    Ok::<Option<KeyHolder>, ()>(None)
                })
                .await
                .unwrap();
            assert!(found.is_none());
        }
        assert_eq!(loads.load(Ordering::SeqCst), 2);
    }
}
