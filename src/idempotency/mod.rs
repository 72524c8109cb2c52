//! Idempotency keys: the core's key, fingerprint and store
//! ([`oncepay_core::idempotency`]), and the server's two speed mechanisms
//! around them, neither of which decides an outcome:
//!
//! - [`reads`]: the reads of keys that missed the replay cache, coalesced.
//! - [`wait`]: requests waiting on a key in flight share one poll of it.

pub mod reads;
pub mod wait;

pub use oncepay_core::idempotency::*;
