//! An amount of money in integer minor units, validated once at the edge:
//! what a charge takes and a refund gives back, so both charges and refunds
//! import it from here.

use serde::Serialize;
use serde_json::Value;

use crate::params::{Encoding, ParamError};
use crate::problem::ProblemCode;

/// Smallest and largest amount, in minor units (cents for USD).
pub const MIN_AMOUNT: i64 = 1;
pub const MAX_AMOUNT: i64 = 99_999_999;

/// An amount in integer minor units, within the accepted range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Amount(i64);

impl Amount {
    pub fn new(minor_units: i64) -> Result<Self, ParamError> {
        if minor_units < MIN_AMOUNT {
            Err(ParamError::new(
                ProblemCode::AmountTooSmall,
                "amount",
                format!("Amount must be at least {MIN_AMOUNT} (in minor units, e.g. cents)"),
            ))
        } else if minor_units > MAX_AMOUNT {
            Err(too_large())
        } else {
            Ok(Amount(minor_units))
        }
    }

    pub fn minor_units(self) -> i64 {
        self.0
    }

    /// Reads `amount`: a JSON integer, or a string of digits in a form.
    pub fn from_param(value: Value, encoding: Encoding) -> Result<Self, ParamError> {
        let invalid = || {
            ParamError::new(
                ProblemCode::ParameterInvalidInteger,
                "amount",
                "Amount must be a whole number of minor units (e.g. 2000 for 20.00 USD)",
            )
        };
        let number = match (value, encoding) {
            (Value::Number(n), Encoding::Json) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => i,
                (None, Some(_)) => return Err(too_large()),
                (None, None) => return Err(invalid()),
            },
            (Value::String(s), Encoding::Form) => {
                let digits = s.strip_prefix('-').unwrap_or(&s);
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(invalid());
                }
                match s.parse::<i64>() {
                    Ok(i) => i,
                    Err(_) if s.starts_with('-') => i64::MIN,
                    Err(_) => return Err(too_large()),
                }
            }
            _ => return Err(invalid()),
        };
        Amount::new(number)
    }
}

fn too_large() -> ParamError {
    ParamError::new(
        ProblemCode::AmountTooLarge,
        "amount",
        format!("Amount must be no more than {MAX_AMOUNT} (in minor units)"),
    )
}
