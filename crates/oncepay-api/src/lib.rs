//! The API's vocabulary, which the core and the server share and which
//! carries none of the guarantee:
//!
//! - [`problem`]: every error a client can be shown, with its status, its
//!   stable `code` and its Stripe-shaped twin.
//! - [`params`]: JSON and form bodies decoded to one shape, so that both
//!   are validated (and fingerprinted) alike.
//! - [`objects`]: the objects the API sends, in Stripe's shapes, built
//!   from the facts the core's records hold.
//! - [`amount`], [`currency`]: money as a charge or refund takes it, in
//!   integer minor units of an ISO 4217 currency, validated at the edge.

pub mod amount;
pub mod currency;
pub mod objects;
pub mod params;
pub mod problem;
