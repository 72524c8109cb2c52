//! The exactly-once protocol as a model: every interleaving of a bounded
//! system, checked by Stateright, rather than the interleavings a test
//! thought of.
//!
//! The system: a client that retries one logical operation (a charge)
//! under one key, and one that reuses the key with other parameters; two
//! oncepay instances whose request handlers take the core's steps (the
//! claim, the gateway's call under the derived processor key, the
//! conditional settle) and may crash between any two; the card gateway,
//! idempotent by processor key, with its void; the sweeper; a clock that
//! makes records stale and expires keys; and a network that loses,
//! delays, duplicates and reorders, between the client and oncepay and
//! between oncepay and the gateway. Each action names, in its doc
//! comment, the statement or function of the core it stands for.
//!
//! [`Variant`] switches the same model to the naive designs the workshop
//! warns against; each breaks a property, and the checker finds the
//! shortest way (breadth first). What the model leaves out is in
//! docs/model.md.

pub mod check;
pub mod explain;
pub mod model;
pub mod properties;
pub mod variant;

pub use model::{Bounds, Protocol};
pub use variant::Variant;
