//! Events: what happened to a merchant's charges and refunds, one for every
//! final state change, written by the settle that made the change in its own
//! transaction (a transactional outbox). An event holds the object as the API
//! rendered it at that moment and is never changed afterwards.
//!
//! - [`domain`]: the types, and the new events a settle writes.
//! - [`store`]: the SQL that writes them.

pub mod domain;
pub mod store;

pub use domain::{EventType, NewEvent};
