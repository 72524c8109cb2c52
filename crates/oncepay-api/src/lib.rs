//! The API's vocabulary, which the core and the server share and which
//! carries none of the guarantee:
//!
//! - [`problem`]: every error a client can be shown, with its status, its
//!   stable `code` and its Stripe-shaped twin.
//! - [`params`]: JSON and form bodies decoded to one shape, so that both
//!   are validated (and fingerprinted) alike.

pub mod params;
pub mod problem;
