//! What a charge carries besides its payment, in Stripe's shapes: where the
//! goods ship ([`Shipping`]) and what the merchant reported of its fraud
//! ([`FraudDetails`]). Each is stored as the API shows it (`jsonb`), so the
//! one type is the validated parameter, the stored value and the object.

use serde::{Deserialize, Serialize};

/// Where a charge's goods go, as Stripe's `shipping`: every member shown,
/// `null` when not given.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Shipping {
    pub address: ShippingAddress,
    /// The delivery service (`UPS`, `FedEx`, ...).
    #[cfg_attr(feature = "openapi", schema(example = "UPS"))]
    pub carrier: Option<String>,
    /// The recipient's name; required.
    #[cfg_attr(feature = "openapi", schema(example = "Jenny Rosen"))]
    pub name: String,
    #[cfg_attr(feature = "openapi", schema(example = "+15555550123"))]
    pub phone: Option<String>,
    #[cfg_attr(feature = "openapi", schema(example = "1Z999AA10123456784"))]
    pub tracking_number: Option<String>,
}

/// A shipping address; each line may be left out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ShippingAddress {
    #[cfg_attr(feature = "openapi", schema(example = "San Francisco"))]
    pub city: Option<String>,
    /// Two-letter country code (ISO 3166-1 alpha-2).
    #[cfg_attr(feature = "openapi", schema(example = "US"))]
    pub country: Option<String>,
    #[cfg_attr(feature = "openapi", schema(example = "510 Townsend St"))]
    pub line1: Option<String>,
    pub line2: Option<String>,
    #[cfg_attr(feature = "openapi", schema(example = "94103"))]
    pub postal_code: Option<String>,
    #[cfg_attr(feature = "openapi", schema(example = "CA"))]
    pub state: Option<String>,
}

impl Shipping {
    /// The names of its members, for refusing any other.
    pub const MEMBERS: [&'static str; 5] =
        ["address", "carrier", "name", "phone", "tracking_number"];
}

impl ShippingAddress {
    /// The names of its members, for refusing any other.
    pub const MEMBERS: [&'static str; 6] =
        ["city", "country", "line1", "line2", "postal_code", "state"];
}

/// What the merchant reported of a charge's fraud: `{}` until it reports,
/// then `{"user_report": "fraudulent"}` or `"safe"`. (Stripe's own
/// `stripe_report` needs Stripe's fraud checks: oncepay never sets it.)
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FraudDetails {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub user_report: Option<UserReport>,
}

/// The merchant's report of a charge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum UserReport {
    Fraudulent,
    Safe,
}

impl UserReport {
    /// The report a name names: `fraudulent` or `safe`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "fraudulent" => Some(UserReport::Fraudulent),
            "safe" => Some(UserReport::Safe),
            _ => None,
        }
    }
}

/// What the customer's statement shows for a paid card charge: the
/// account's `prefix`, then `* ` and the charge's `suffix`, else its
/// `descriptor` (Stripe takes a card charge's `statement_descriptor` as
/// its suffix when it has none, and ignores it when it has one), cut to
/// Stripe's 22 characters; the prefix alone when the charge gives neither.
pub fn calculated_statement_descriptor(
    prefix: &str,
    descriptor: Option<&str>,
    suffix: Option<&str>,
) -> String {
    match suffix.or(descriptor) {
        Some(suffix) => format!("{prefix}* {suffix}").chars().take(22).collect(),
        None => prefix.to_owned(),
    }
}
