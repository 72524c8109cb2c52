//! The API's vocabulary, which the core and the server share and which
//! carries none of the guarantee:
//!
//! - [`problem`]: every error a client can be shown, with its status, its
//!   stable `code` and its Stripe-shaped twin.
//! - [`params`]: JSON and form bodies decoded to one shape, so that both
//!   are validated (and fingerprinted) alike.
//! - [`objects`]: the objects the API sends, in Stripe's shapes, built
//!   from the facts the core's records hold.

pub mod objects;
pub mod params;
pub mod problem;
