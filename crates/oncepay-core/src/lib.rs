//! oncepay's core: the exactly-once guarantee, with no HTTP, no command line
//! and no speed mechanism among its dependencies.
//!
//! - [`operation`]: one guarded request's workflow: claim the key with the
//!   pending record ([`operation::claim`]), call the processor outside any
//!   transaction, settle.
//! - [`idempotency`]: the key, the request's fingerprint, and the store that
//!   completes, reads, leases and expires keys.
//! - [`charges`], [`refunds`]: the records, their validated input, their SQL
//!   and their settle; [`settled`], which both use.
//! - [`events`]: the events a settle writes in its own transaction (the outbox).
//! - [`processor`]: the card processor behind a trait, the keys derived for
//!   it, and how a call can fail.
//! - [`recovery`], [`sweeper`]: settling a stale record, and the loop that
//!   finds them and deletes expired keys.
//! - [`speed`]: the two seams where a server may plug speed in (taking a
//!   connection, waiting for a key in flight), and their plain defaults.
//! - [`error`], [`retry_after`], [`settings`]: what fails and how, when a
//!   client should retry, and the durations it all runs by.
//! - [`faults`]: the crash points the failure tests ask for.
//!
//! [`problem`], [`params`], [`objects`] and [`amount`] are the API's
//! vocabulary (the `oncepay-api` crate). docs/design.md gives the reading order.

/// `as_str` (the name a status is stored and shown under) and `Display` for
/// an enum of unit variants stored as text: written once for every status.
macro_rules! stored_as_text {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// As stored, and as the API shows it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
pub(crate) use stored_as_text;

pub mod charges;
pub mod error;
pub mod events;
pub mod faults;
pub mod idempotency;
pub mod operation;
pub mod processor;
pub mod recovery;
pub mod refunds;
pub mod retry_after;
pub mod settings;
pub mod settled;
pub mod speed;
pub mod sweeper;

// The API's vocabulary, under the names the core has always used.
pub use oncepay_api::{amount, objects, params, problem};
