//! Idempotency keys: a client sends one key per logical operation; the first
//! request with it *claims* it, later ones get the saved response.
//!
//! - [`key`]: the `Idempotency-Key` header.
//! - [`fingerprint`]: what makes two requests "the same".
//! - [`store`]: the SQL that claims, completes, reads, leases and expires keys.
//! - [`reads`]: the reads of keys that missed the replay cache, coalesced.
//! - [`wait`]: requests waiting on a key in flight share one poll of it.

pub mod fingerprint;
pub mod key;
pub mod reads;
pub mod store;
pub mod wait;

pub use fingerprint::Fingerprint;
pub use key::IdempotencyKey;
pub use store::{Claim, ClaimOutcome, KeyStatus, Resource, SavedResponse, StoredKey};
