//! The card processor: the trait, the derived keys and the failure classes
//! are the core's ([`oncepay_core::processor`]); here is its HTTP client,
//! [`HttpProcessor`], which speaks to the card gateway (`oncepay processor`,
//! or the one `oncepay serve` embeds), and [`LedgerClient`], which reads the
//! gateway's ledger for reconciliation.

mod http;
pub mod ledger;

pub use http::{HttpProcessor, HttpSettings};
pub use ledger::{LedgerClient, LedgerOperation};
pub use oncepay_core::processor::*;
