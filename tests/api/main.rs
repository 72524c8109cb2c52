//! oncepay's integration tests: the real server over HTTP, a fresh migrated
//! database per test, every assertion checked in the database too.

#[path = "../common/database.rs"]
mod database;

mod auth;
mod bad_input;
mod broker;
mod capture;
mod cli;
mod concurrency;
mod connections;
mod deadlines;
mod demo;
mod docs;
mod event_polling;
mod events;
mod faults;
mod helpers;
mod idempotency;
mod leases;
mod limits;
mod lists;
mod openapi;
mod operability;
mod pitfalls;
mod processor;
mod reads;
mod receivers;
mod reconcile;
mod refunds;
mod relay;
mod rotation;
mod shapes;
mod shedding;
mod stripe;
mod sweeper;
mod timelines;
mod updates;
mod waits;
mod webhooks;
mod wire;
