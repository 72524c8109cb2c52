//! Webhooks: each event, sent to each endpoint of its merchant that enabled
//! its type, signed, retried with backoff until answered `2xx` or out of
//! attempts. The deliveries are written with the events, in the settle's
//! transaction; delivering them is at least once, so receivers keep an
//! inbox of event ids (see `docs/webhooks.md`).
//!
//! - [`domain`]: endpoints, their parameters and objects; deliveries and attempts.
//! - [`store`]: the SQL.
//! - [`signature`]: the `Stripe-Signature` header, signed and verified.
//! - [`deliver`]: the worker in every `serve` process.
//! - [`guard`]: the address guard, which keeps endpoints out of the network.

pub mod create_endpoint;
pub mod deliver;
pub mod domain;
pub mod guard;
pub mod signature;
pub mod store;
pub mod update_endpoint;
