//! What every validated request body implements ([`FromParams`]), and the
//! checks more than one body shares.

use oncepay_core::params::{ParamError, Params, at_most};

/// The longest `description` a charge takes, in characters.
const MAX_DESCRIPTION_CHARS: usize = 1000;

/// A request's parameters, validated into `Self`.
pub trait FromParams: Sized {
    /// Validates every parameter, and refuses unknown ones.
    fn from_params(params: Params) -> Result<Self, ParamError>;
}

/// A charge's `description`, unless longer than 1000 characters.
pub fn description(description: String) -> Result<String, ParamError> {
    at_most(description, "description", MAX_DESCRIPTION_CHARS)
}
