//! Refunds: the domain, its SQL (including the reservation on the charge),
//! and how a refund settles and is rolled forward after a crash.

pub mod domain;
pub mod settle;
pub mod store;

pub use domain::{NewRefund, Refund, RefundReason, RefundStatus};
