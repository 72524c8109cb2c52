//! An amount of money in integer minor units, validated once at the edge:
//! what a charge takes and a refund gives back.

use serde::Serialize;

use crate::params::ParamError;
use crate::problem::ProblemCode;

/// Smallest and largest amount, in minor units (cents for USD).
pub const MIN_AMOUNT: i64 = 1;
pub const MAX_AMOUNT: i64 = 99_999_999;

/// An amount in integer minor units, within the accepted range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Amount(i64);

impl Amount {
    /// `minor_units` if within range, else the parameter error to show.
    /// (Below 1 is no positive integer, as Stripe says; a charge's
    /// currency asks for more, see [`crate::currency::Currency::check_charge`],
    /// while a refund may give back a single minor unit.)
    pub fn new(minor_units: i64) -> Result<Self, ParamError> {
        if minor_units < MIN_AMOUNT {
            Err(ParamError::new(
                ProblemCode::ParameterInvalidInteger,
                "amount",
                "Invalid positive integer",
            ))
        } else if minor_units > MAX_AMOUNT {
            Err(too_large())
        } else {
            Ok(Amount(minor_units))
        }
    }

    /// The amount in minor units.
    pub fn minor_units(self) -> i64 {
        self.0
    }
}

/// The error of an amount above [`MAX_AMOUNT`].
pub fn too_large() -> ParamError {
    ParamError::new(
        ProblemCode::AmountTooLarge,
        "amount",
        format!("Amount must be no more than {MAX_AMOUNT} (in minor units)"),
    )
}
