//! oncepay's core: the records that carry the exactly-once guarantee and the
//! SQL that keeps it, with no HTTP, no command line and no speed mechanism
//! among its dependencies.
//!
//! - [`idempotency`]: the key, the request's fingerprint, and the store that
//!   claims, completes, reads, leases and expires keys.
//! - [`charges`], [`refunds`]: the records, their validated input, their SQL
//!   and the settle that ends a pending one; [`amount`] and [`settled`],
//!   which both use and neither owns.
//! - [`events`]: the events a settle writes in its own transaction (the outbox).
//! - [`processor`]: the card processor behind a trait, the keys derived for
//!   it, and how a call can fail.
//! - [`recovery`], [`sweeper`]: settling a stale record, and the loop that
//!   finds them and deletes expired keys.
//! - [`problem`], [`params`]: the errors a client is shown, and request
//!   bodies decoded to one shape before validation.
//! - [`faults`]: the crash points the failure tests ask for.
//!
//! The server (the `oncepay` crate) runs the workflow on top of these; see
//! docs/design.md for the reading order.

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

pub mod amount;
pub mod charges;
pub mod events;
pub mod faults;
pub mod idempotency;
pub mod params;
pub mod problem;
pub mod processor;
pub mod recovery;
pub mod refunds;
pub mod settled;
pub mod sweeper;
