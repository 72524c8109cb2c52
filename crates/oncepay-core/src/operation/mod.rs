//! One guarded operation, whatever it makes: the exactly-once workflow that
//! charges, refunds and captures share, and that knows nothing of HTTP.
//!
//! 1. the server's edge has validated the request: nothing is written yet;
//! 2. the claim ([`claim`]): the key is claimed and the record written as
//!    pending with it (in the claim's one statement for a charge, in one
//!    transaction for a refund or a capture), or the key says what it
//!    already holds;
//! 3. the processor call, outside any transaction;
//! 4. one transaction settles the record if still pending and saves the
//!    answer on the key.
//!
//! Steps 2 to 4 run in their own task ([`workflow::run`]), so that a client
//! hanging up cannot cancel the work half-way once the claim may have
//! committed. A record left pending by a failure is settled later by
//! [`crate::recovery`].
//!
//! Read in this order: [`engine`] (what a request is and what it is
//! answered), [`claim`] (step 2), [`workflow`] (steps 2 to 4), then a kind:
//! [`charge`], [`refund`], [`capture`]. An operation with no processor call
//! (creating a webhook endpoint) is a [`write::Write`] instead: claim,
//! record and answer in one transaction. Each step is timed once, at its
//! boundary ([`timing`]).

pub mod capture;
pub mod charge;
pub mod claim;
pub mod engine;
pub mod refund;
pub mod timing;
pub mod workflow;
pub mod write;

#[cfg(test)]
mod plain;
