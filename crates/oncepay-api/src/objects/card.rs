//! The card charged, as the charge object shows it twice: its details
//! (`payment_method_details.card`) and the card object (`source`), both
//! from the test token's card.

use serde::Serialize;
use test_cards::{Card, TestToken};

use super::{Empty, Unmodelled};

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PaymentMethodDetails {
    pub card: CardDetails,
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(example = "card"))]
    pub kind: &'static str,
}

/// The test token's card.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CardDetails {
    /// The amount authorized: the charge's, once the network approved it; null otherwise.
    #[cfg_attr(feature = "openapi", schema(example = 2000))]
    pub amount_authorized: Option<i64>,
    pub authorization_code: Unmodelled,
    /// `visa`, `mastercard`, `amex` or `discover`.
    #[cfg_attr(feature = "openapi", schema(example = "visa"))]
    pub brand: &'static str,
    pub checks: CardChecks,
    #[cfg_attr(feature = "openapi", schema(example = "US"))]
    pub country: &'static str,
    #[cfg_attr(feature = "openapi", schema(example = 12))]
    pub exp_month: i64,
    #[cfg_attr(feature = "openapi", schema(example = 2034))]
    pub exp_year: i64,
    pub extended_authorization: FeatureStatus,
    #[cfg_attr(feature = "openapi", schema(example = "Xt5EWLLDS7FJjR1c"))]
    pub fingerprint: &'static str,
    /// `credit` or `debit`.
    #[cfg_attr(feature = "openapi", schema(example = "credit"))]
    pub funding: &'static str,
    pub incremental_authorization: FeatureStatus,
    pub installments: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(example = "4242"))]
    pub last4: &'static str,
    pub mandate: Unmodelled,
    pub multicapture: FeatureStatus,
    #[cfg_attr(feature = "openapi", schema(example = "visa"))]
    pub network: &'static str,
    pub network_token: NetworkToken,
    pub network_transaction_id: Unmodelled,
    pub overcapture: Overcapture,
    pub regulated_status: Unmodelled,
    pub three_d_secure: Unmodelled,
    pub transaction_link_id: Unmodelled,
    pub wallet: Unmodelled,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CardChecks {
    pub address_line1_check: Unmodelled,
    pub address_postal_code_check: Unmodelled,
    /// `pass`, or `fail` for the card declined for its CVC.
    #[cfg_attr(feature = "openapi", schema(example = "pass"))]
    pub cvc_check: &'static str,
}

/// A card feature oncepay never offers.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FeatureStatus {
    /// `disabled` or `unavailable`.
    #[cfg_attr(feature = "openapi", schema(example = "unavailable"))]
    pub status: &'static str,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkToken {
    /// Always false.
    pub used: bool,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Overcapture {
    #[cfg_attr(feature = "openapi", schema(example = 2000))]
    pub maximum_amount_capturable: i64,
    /// Always `unavailable`.
    #[cfg_attr(feature = "openapi", schema(example = "unavailable"))]
    pub status: &'static str,
}

/// The charge's `source`: the card, as Stripe's card object shows it.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SourceCard {
    /// `card_...`, the same as the charge's `payment_method`.
    #[cfg_attr(feature = "openapi", schema(example = "card_FSqF13LohwPRt53icfinsfKa"))]
    pub id: String,
    #[cfg_attr(feature = "openapi", schema(example = "card"))]
    pub object: &'static str,
    pub address_city: Unmodelled,
    pub address_country: Unmodelled,
    pub address_line1: Unmodelled,
    pub address_line1_check: Unmodelled,
    pub address_line2: Unmodelled,
    pub address_state: Unmodelled,
    pub address_zip: Unmodelled,
    pub address_zip_check: Unmodelled,
    /// As the card object spells it: `Visa`, `MasterCard`, `American Express`, `Discover`.
    #[cfg_attr(feature = "openapi", schema(example = "Visa"))]
    pub brand: &'static str,
    #[cfg_attr(feature = "openapi", schema(example = "US"))]
    pub country: &'static str,
    pub customer: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(example = "pass"))]
    pub cvc_check: &'static str,
    pub dynamic_last4: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(example = 12))]
    pub exp_month: i64,
    #[cfg_attr(feature = "openapi", schema(example = 2034))]
    pub exp_year: i64,
    #[cfg_attr(feature = "openapi", schema(example = "Xt5EWLLDS7FJjR1c"))]
    pub fingerprint: &'static str,
    #[cfg_attr(feature = "openapi", schema(example = "credit"))]
    pub funding: &'static str,
    #[cfg_attr(feature = "openapi", schema(example = "4242"))]
    pub last4: &'static str,
    /// Always `{}`.
    pub metadata: Empty,
    pub name: Unmodelled,
    pub tokenization_method: Unmodelled,
    pub wallet: Unmodelled,
}

impl PaymentMethodDetails {
    /// The details of `token`'s card for a charge of `amount`, authorized
    /// when the charge was `paid`.
    pub(super) fn new(token: TestToken, amount: i64, paid: bool) -> Self {
        PaymentMethodDetails {
            card: CardDetails::new(token, amount, paid),
            kind: "card",
        }
    }
}

impl CardDetails {
    /// The card's part of [`PaymentMethodDetails::new`].
    fn new(token: TestToken, amount: i64, paid: bool) -> Self {
        let card = token.card();
        CardDetails {
            amount_authorized: paid.then_some(amount),
            authorization_code: Unmodelled,
            brand: card.brand,
            checks: CardChecks {
                address_line1_check: Unmodelled,
                address_postal_code_check: Unmodelled,
                cvc_check: token.cvc_check(),
            },
            country: card.country,
            exp_month: Card::EXP_MONTH,
            exp_year: Card::EXP_YEAR,
            extended_authorization: FeatureStatus { status: "disabled" },
            fingerprint: card.fingerprint,
            funding: card.funding,
            incremental_authorization: FeatureStatus {
                status: "unavailable",
            },
            installments: Unmodelled,
            last4: card.last4,
            mandate: Unmodelled,
            multicapture: FeatureStatus {
                status: "unavailable",
            },
            network: card.brand,
            network_token: NetworkToken { used: false },
            network_transaction_id: Unmodelled,
            overcapture: Overcapture {
                maximum_amount_capturable: amount,
                status: "unavailable",
            },
            regulated_status: Unmodelled,
            three_d_secure: Unmodelled,
            transaction_link_id: Unmodelled,
            wallet: Unmodelled,
        }
    }
}

impl SourceCard {
    /// `token`'s card as a card object with the id `id`.
    pub(super) fn new(token: TestToken, id: String) -> Self {
        let card = token.card();
        SourceCard {
            id,
            object: "card",
            address_city: Unmodelled,
            address_country: Unmodelled,
            address_line1: Unmodelled,
            address_line1_check: Unmodelled,
            address_line2: Unmodelled,
            address_state: Unmodelled,
            address_zip: Unmodelled,
            address_zip_check: Unmodelled,
            brand: card.display_brand(),
            country: card.country,
            customer: Unmodelled,
            cvc_check: token.cvc_check(),
            dynamic_last4: Unmodelled,
            exp_month: Card::EXP_MONTH,
            exp_year: Card::EXP_YEAR,
            fingerprint: card.fingerprint,
            funding: card.funding,
            last4: card.last4,
            metadata: Empty {},
            name: Unmodelled,
            tokenization_method: Unmodelled,
            wallet: Unmodelled,
        }
    }
}
