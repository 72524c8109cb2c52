//! oncepay: a payments API that charges a card exactly once, however often a
//! client retries. See README.md for a tour, and docs/design.md for how it works.

pub mod admission;
pub mod app;
pub mod broker;
pub mod cache;
pub mod cli;
pub mod config;
pub mod db;
pub mod events;
pub mod fast_paths;
pub mod http;
pub mod idempotency;
pub mod merchants;
pub mod processor;
pub mod rate_limit;
pub mod reconcile;
pub mod startup;
pub mod telemetry;
pub mod updates;
pub mod webhooks;
pub mod workshop;

// The core's modules, under the names the server has always used.
pub use oncepay_core::{
    charges, error, faults, objects, operation, params, problem, recovery, refunds, retry_after,
    speed, sweeper,
};
