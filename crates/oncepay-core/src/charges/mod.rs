//! Charges: the domain, its SQL, how a processor outcome settles a charge,
//! and how a charge authorized first is captured.

pub mod capture;
pub mod domain;
pub mod expiry;
pub mod settle;
pub mod store;

pub use crate::amount::Amount;
pub use domain::{Charge, ChargeStatus, NewCharge};
pub use oncepay_api::currency::{self, Currency};
