//! Charges: the domain, its SQL, and how a processor outcome settles a charge.

pub mod currency;
pub mod domain;
pub mod settle;
pub mod store;

pub use crate::amount::Amount;
pub use currency::Currency;
pub use domain::{Charge, ChargeStatus, NewCharge};
