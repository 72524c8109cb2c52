//! oncepay: a payments API that charges a card exactly once, however often a
//! client retries. See README.md for a tour, and docs/design.md for how it works.

pub mod app;
pub mod broker;
pub mod cli;
pub mod config;
pub mod db;
pub mod events;
pub mod http;
pub mod merchants;
pub mod processor;
pub mod rate_limit;
pub mod reconcile;
pub mod speed;
pub mod startup;
pub mod telemetry;
pub mod updates;
pub mod webhooks;
pub mod workshop;
