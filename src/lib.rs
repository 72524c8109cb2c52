//! oncepay: a payments API that charges a card exactly once, however often a
//! client retries. See README.md for a tour, and docs/design.md for how it works.

pub mod admission;
pub mod app;
pub mod cache;
pub mod charges;
pub mod cli;
pub mod config;
pub mod db;
pub mod error;
pub mod events;
pub mod faults;
pub mod http;
pub mod idempotency;
pub mod merchants;
pub mod operation;
pub mod params;
pub mod problem;
pub mod processor;
pub mod rate_limit;
pub mod reconcile;
pub mod recovery;
pub mod refunds;
pub mod retry_after;
pub mod startup;
pub mod sweeper;
pub mod telemetry;
pub mod webhooks;
pub mod workshop;
