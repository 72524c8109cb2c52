//! Idempotency keys: a client sends one key per logical operation; the first
//! request with it *claims* it, later ones get the saved response.
//!
//! - [`key`]: the `Idempotency-Key` header's value, parsed once.
//! - [`fingerprint`]: what makes two requests "the same".
//! - [`store`]: the SQL that completes, reads, leases and expires keys (the
//!   claim is written where it is made, `crate::operation::claim`).

pub mod fingerprint;
pub mod key;
pub mod store;

pub use fingerprint::Fingerprint;
pub use key::IdempotencyKey;
pub use store::{FirstRequest, KeyStatus, Resource, SavedAnswer, SavedResponse, StoredKey};
