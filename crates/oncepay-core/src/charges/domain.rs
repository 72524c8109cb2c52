//! What a charge is: its validated parameters, its stored row and its API object.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::currency::Currency;
use crate::amount::Amount;
use crate::objects::Unmodelled;
use crate::params::{ParamError, Params, new_id, required, shorten, string};
use crate::problem::ProblemCode;
use crate::processor::TestToken;
use crate::refunds::Refund;
use test_cards::{Card, Decline};

/// The longest `description` a charge takes, in characters.
const MAX_DESCRIPTION_CHARS: usize = 1000;

/// The parameters of `POST /v1/charges`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewCharge {
    pub amount: Amount,
    pub currency: Currency,
    pub source: TestToken,
    pub description: Option<String>,
    pub metadata: BTreeMap<String, String>,
}

impl NewCharge {
    /// Validates every parameter, and refuses unknown ones.
    pub fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let encoding = params.encoding;
        let amount = Amount::from_param(required(&mut params, "amount")?, encoding)?;
        let currency = string(required(&mut params, "currency")?, "currency")?;
        let currency = Currency::parse(&currency).ok_or_else(|| {
            ParamError::new(
                ProblemCode::InvalidCurrency,
                "currency",
                format!(
                    "Invalid currency: {}. Use a three-letter ISO 4217 code such as usd",
                    shorten(&currency)
                ),
            )
        })?;
        let source = string(required(&mut params, "source")?, "source")?;
        let source = TestToken::parse(&source).ok_or_else(|| {
            ParamError::new(
                ProblemCode::ResourceMissing,
                "source",
                format!(
                    "No such token: '{}'. Use a test token such as tok_visa",
                    shorten(&source)
                ),
            )
        })?;
        let description = params
            .take("description")
            .map(|v| string(v, "description"))
            .transpose()?;
        if let Some(d) = &description {
            if d.chars().count() > MAX_DESCRIPTION_CHARS {
                return Err(ParamError::new(
                    ProblemCode::ParameterTooLong,
                    "description",
                    format!("Description must be at most {MAX_DESCRIPTION_CHARS} characters"),
                ));
            }
        }
        let metadata = params.take_metadata()?;
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(NewCharge {
            amount,
            currency,
            source,
            description,
            metadata,
        })
    }

    /// A canonical encoding of the parameters for the request fingerprint:
    /// fixed field order, sorted metadata, normalised values. Key order,
    /// white space and JSON versus form do not change it; any value does.
    pub fn canonical(&self) -> Vec<u8> {
        let canonical = serde_json::json!([
            self.amount.minor_units(),
            self.currency.as_str(),
            self.source.as_str(),
            self.description,
            self.metadata,
        ]);
        serde_json::to_vec(&canonical).expect("serialising a JSON value cannot fail")
    }
}

/// A charge's lifecycle: `pending` until the processor's outcome is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(rename_all = "lowercase"))]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum ChargeStatus {
    Pending,
    Succeeded,
    Failed,
}

crate::stored_as_text!(ChargeStatus {
    Pending => "pending",
    Succeeded => "succeeded",
    Failed => "failed",
});

/// A charge as stored.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Charge {
    pub id: String,
    /// Who owns it; not part of the API object.
    pub merchant_id: Uuid,
    pub amount: i64,
    pub currency: String,
    pub source: String,
    pub description: Option<String>,
    pub metadata: sqlx::types::Json<BTreeMap<String, String>>,
    pub status: ChargeStatus,
    pub failure_code: Option<String>,
    pub failure_message: Option<String>,
    pub amount_refunded: i64,
    pub created_at: DateTime<Utc>,
}

/// Stripe's empty form of an object oncepay does not model: `{}`.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Empty {}

/// The charge object of the API: every field of Stripe's charge, in Stripe's
/// order (`id`, `object`, then by name). What oncepay does not model is
/// `null` or Stripe's empty form (see docs/decisions.md).
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Charge))]
pub struct ChargeObject<'a> {
    /// `ch_` and 24 letters or digits.
    #[cfg_attr(feature = "openapi", schema(example = "ch_FSqF13LohwPRt53icfinsfKa"))]
    pub id: &'a str,
    #[cfg_attr(feature = "openapi", schema(example = "charge"))]
    pub object: &'static str,
    /// Integer minor units (2000 = 20.00 USD).
    #[cfg_attr(feature = "openapi", schema(example = 2000))]
    pub amount: i64,
    /// The amount captured: all of it for a paid charge (oncepay captures
    /// at once), nothing otherwise.
    #[cfg_attr(feature = "openapi", schema(example = 2000))]
    pub amount_captured: i64,
    #[cfg_attr(feature = "openapi", schema(example = 0))]
    pub amount_refunded: i64,
    pub application: Unmodelled,
    pub application_fee: Unmodelled,
    pub application_fee_amount: Unmodelled,
    /// `txn_...` for a paid charge, `null` otherwise.
    #[cfg_attr(feature = "openapi", schema(example = "txn_FSqF13LohwPRt53icfinsfKa"))]
    pub balance_transaction: Option<String>,
    pub billing_details: BillingDetails,
    /// `ONCEPAY` for a paid charge, `null` otherwise.
    #[cfg_attr(feature = "openapi", schema(example = "ONCEPAY"))]
    pub calculated_statement_descriptor: Option<&'static str>,
    /// Stripe's flags: the charge succeeded (oncepay captures at once, so
    /// a paid charge is a captured one).
    pub captured: bool,
    /// Unix seconds.
    #[cfg_attr(feature = "openapi", schema(example = 1764892800))]
    pub created: i64,
    #[cfg_attr(feature = "openapi", schema(example = "usd"))]
    pub currency: &'a str,
    pub customer: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(example = "Order 6735"))]
    pub description: Option<&'a str>,
    /// Always false.
    pub disputed: bool,
    pub failure_balance_transaction: Unmodelled,
    /// The decline's code (`card_declined`, `insufficient_funds`, `expired_card`,
    /// `incorrect_cvc`, `processing_error`) or `processing_abandoned`.
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub failure_code: Option<&'a str>,
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub failure_message: Option<&'a str>,
    /// Always `{}`.
    pub fraud_details: Empty,
    pub livemode: bool,
    #[cfg_attr(feature = "openapi", schema(example = json!({"order_id": "6735"})))]
    pub metadata: &'a BTreeMap<String, String>,
    pub on_behalf_of: Unmodelled,
    /// What the card network (or the fraud check) said; `null` while the
    /// charge is pending and for an abandoned one, which no network answered.
    pub outcome: Option<ChargeOutcome>,
    /// The charge succeeded.
    pub paid: bool,
    pub payment_intent: Unmodelled,
    /// The card's id, `card_...` (the same as `source.id`).
    #[cfg_attr(feature = "openapi", schema(example = "card_FSqF13LohwPRt53icfinsfKa"))]
    pub payment_method: Option<String>,
    pub payment_method_details: Option<PaymentMethodDetails>,
    pub receipt_email: Unmodelled,
    pub receipt_number: Unmodelled,
    pub receipt_url: Unmodelled,
    pub refunded: bool,
    /// The charge's refunds, newest first, as a list object.
    pub refunds: RefundList<'a>,
    pub review: Unmodelled,
    pub shipping: Unmodelled,
    /// The card charged, as a card object.
    pub source: Option<SourceCard>,
    pub source_transfer: Unmodelled,
    pub statement_descriptor: Unmodelled,
    pub statement_descriptor_suffix: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(value_type = ChargeStatus, example = "succeeded"))]
    pub status: &'a str,
    pub transfer_data: Unmodelled,
    pub transfer_group: Unmodelled,
}

/// The charge's statement descriptor when the merchant sets none.
pub const STATEMENT_DESCRIPTOR: &str = "ONCEPAY";

/// How many of a charge's refunds its object lists, as Stripe does.
pub const EMBEDDED_REFUNDS: usize = 10;

/// A charge's refunds as its object embeds them, newest first: the first
/// 10, with `has_more` for the rest.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RefundList<'a> {
    #[cfg_attr(feature = "openapi", schema(example = "list"))]
    pub object: &'static str,
    pub data: Vec<crate::objects::RefundObject<'a>>,
    pub has_more: bool,
    /// `/v1/charges/{id}/refunds`.
    pub url: String,
}

/// Billing details: oncepay takes none, so every member is null.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BillingDetails {
    pub address: Address,
    pub email: Unmodelled,
    pub name: Unmodelled,
    pub phone: Unmodelled,
    pub tax_id: Unmodelled,
}

/// An address oncepay does not know: every member null.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Address {
    pub city: Unmodelled,
    pub country: Unmodelled,
    pub line1: Unmodelled,
    pub line2: Unmodelled,
    pub postal_code: Unmodelled,
    pub state: Unmodelled,
}

const NO_BILLING_DETAILS: BillingDetails = BillingDetails {
    address: Address {
        city: Unmodelled,
        country: Unmodelled,
        line1: Unmodelled,
        line2: Unmodelled,
        postal_code: Unmodelled,
        state: Unmodelled,
    },
    email: Unmodelled,
    name: Unmodelled,
    phone: Unmodelled,
    tax_id: Unmodelled,
};

/// Stripe's outcome of the authorization.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ChargeOutcome {
    pub advice_code: Unmodelled,
    pub network_advice_code: Unmodelled,
    pub network_decline_code: Unmodelled,
    /// `approved_by_network`, `declined_by_network` or `not_sent_to_network`.
    #[cfg_attr(feature = "openapi", schema(example = "approved_by_network"))]
    pub network_status: &'static str,
    /// The decline code, or `highest_risk_level` for a charge blocked as fraud; null when authorized.
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub reason: Option<&'static str>,
    /// `normal`, or `highest` for a charge blocked as fraud.
    #[cfg_attr(feature = "openapi", schema(example = "normal"))]
    pub risk_level: &'static str,
    #[cfg_attr(feature = "openapi", schema(example = "Payment complete."))]
    pub seller_message: &'static str,
    /// `authorized`, `issuer_declined` or `blocked`.
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(example = "authorized"))]
    pub kind: &'static str,
}

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

impl Charge {
    /// The charge's card, from its test token (every stored `source` is one).
    pub fn token(&self) -> Option<TestToken> {
        TestToken::parse(&self.source)
    }

    /// The decline of a failed charge, as its card reports it: `None` for a
    /// charge that did not fail, or failed otherwise (an abandoned one).
    pub fn decline(&self) -> Option<Decline> {
        let decline = self.token()?.decline()?;
        (self.failure_code.as_deref() == Some(decline.code)).then_some(decline)
    }

    /// The API object, with `refunds`, the charge's refunds, newest first
    /// (the first [`EMBEDDED_REFUNDS`] are shown). Ids derived from the
    /// charge's (`card_...`, `txn_...`) are the same at every render.
    pub fn to_object<'a>(&'a self, refunds: &'a [Refund]) -> ChargeObject<'a> {
        let succeeded = self.status == ChargeStatus::Succeeded;
        let suffix = self.id.strip_prefix("ch_").unwrap_or(&self.id);
        let card_id = format!("card_{suffix}");
        let token = self.token();
        let outcome = match (self.status, token) {
            (ChargeStatus::Succeeded, Some(token)) => Some(token.verdict()),
            (ChargeStatus::Failed, Some(token)) if self.decline().is_some() => {
                Some(token.verdict())
            }
            _ => None,
        }
        .map(|verdict| ChargeOutcome {
            advice_code: Unmodelled,
            network_advice_code: Unmodelled,
            network_decline_code: Unmodelled,
            network_status: verdict.network_status,
            reason: verdict.reason,
            risk_level: verdict.risk_level,
            seller_message: verdict.seller_message,
            kind: verdict.kind,
        });
        let details = token.map(|token| {
            let card = token.card();
            PaymentMethodDetails {
                card: CardDetails {
                    amount_authorized: succeeded.then_some(self.amount),
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
                        maximum_amount_capturable: self.amount,
                        status: "unavailable",
                    },
                    regulated_status: Unmodelled,
                    three_d_secure: Unmodelled,
                    transaction_link_id: Unmodelled,
                    wallet: Unmodelled,
                },
                kind: "card",
            }
        });
        let source = token.map(|token| {
            let card = token.card();
            SourceCard {
                id: card_id.clone(),
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
        });
        ChargeObject {
            id: &self.id,
            object: "charge",
            amount: self.amount,
            amount_captured: if succeeded { self.amount } else { 0 },
            amount_refunded: self.amount_refunded,
            application: Unmodelled,
            application_fee: Unmodelled,
            application_fee_amount: Unmodelled,
            balance_transaction: succeeded.then(|| format!("txn_{suffix}")),
            billing_details: NO_BILLING_DETAILS,
            calculated_statement_descriptor: succeeded.then_some(STATEMENT_DESCRIPTOR),
            captured: succeeded,
            created: self.created_at.timestamp(),
            currency: &self.currency,
            customer: Unmodelled,
            description: self.description.as_deref(),
            disputed: false,
            failure_balance_transaction: Unmodelled,
            failure_code: self.failure_code.as_deref(),
            failure_message: self.failure_message.as_deref(),
            fraud_details: Empty {},
            livemode: false,
            metadata: &self.metadata.0,
            on_behalf_of: Unmodelled,
            outcome,
            paid: succeeded,
            payment_intent: Unmodelled,
            payment_method: token.map(|_| card_id),
            payment_method_details: details,
            receipt_email: Unmodelled,
            receipt_number: Unmodelled,
            receipt_url: Unmodelled,
            refunded: self.amount_refunded > 0 && self.amount_refunded == self.amount,
            refunds: RefundList {
                object: "list",
                data: refunds
                    .iter()
                    .take(EMBEDDED_REFUNDS)
                    .map(Refund::to_object)
                    .collect(),
                has_more: refunds.len() > EMBEDDED_REFUNDS,
                url: format!("/v1/charges/{}/refunds", self.id),
            },
            review: Unmodelled,
            shipping: Unmodelled,
            source,
            source_transfer: Unmodelled,
            statement_descriptor: Unmodelled,
            statement_descriptor_suffix: Unmodelled,
            status: self.status.as_str(),
            transfer_data: Unmodelled,
            transfer_group: Unmodelled,
        }
    }
}

/// A new charge id: `ch_` and 24 random letters and digits.
pub fn new_charge_id() -> String {
    new_id("ch")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn parse_json(body: Value) -> Result<NewCharge, ParamError> {
        NewCharge::from_params(Params::from_json(body.to_string().as_bytes()).unwrap())
    }

    fn code(body: Value) -> &'static str {
        parse_json(body).unwrap_err().code.as_str()
    }

    #[test]
    fn json_and_form_with_equal_parameters_are_equal() {
        let json = parse_json(json!({
            "source": "tok_visa", "currency": "USD", "amount": 2000,
            "metadata": {"b": "2", "a": "1"}
        }))
        .unwrap();
        let form = NewCharge::from_params(
            Params::from_form(
                b"amount=2000&currency=usd&source=tok_visa&metadata[a]=1&metadata[b]=2",
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(json, form);
        assert_eq!(json.canonical(), form.canonical());
    }

    #[test]
    fn amounts_must_be_whole_positive_numbers_in_range() {
        let base =
            |amount: Value| json!({"amount": amount, "currency": "usd", "source": "tok_visa"});
        assert_eq!(code(base(json!(0))), "amount_too_small");
        assert_eq!(code(base(json!(-5))), "amount_too_small");
        assert_eq!(code(base(json!(100_000_000))), "amount_too_large");
        assert_eq!(code(base(json!(u64::MAX))), "amount_too_large");
        assert_eq!(code(base(json!(20.5))), "parameter_invalid_integer");
        assert_eq!(code(base(json!(20.0))), "parameter_invalid_integer");
        assert_eq!(code(base(json!("2000"))), "parameter_invalid_integer");
        assert_eq!(code(base(json!(true))), "parameter_invalid_integer");
        assert!(parse_json(base(json!(99_999_999))).is_ok());
    }

    #[test]
    fn form_amounts_must_be_digits() {
        let form = |amount: &str| {
            let body = format!("amount={amount}&currency=usd&source=tok_visa");
            NewCharge::from_params(Params::from_form(body.as_bytes()).unwrap())
                .map_err(|e| e.code.as_str())
        };
        assert_eq!(form("20.5"), Err("parameter_invalid_integer"));
        assert_eq!(form("1e3"), Err("parameter_invalid_integer"));
        assert_eq!(form(""), Err("parameter_invalid_integer"));
        assert_eq!(form("-1"), Err("amount_too_small"));
        assert_eq!(form("99999999999999999999"), Err("amount_too_large"));
        assert_eq!(form("-99999999999999999999"), Err("amount_too_small"));
        assert!(form("2000").is_ok());
    }

    #[test]
    fn unknown_missing_and_mistyped_parameters_are_named() {
        let err = parse_json(
            json!({"amount": 1, "currency": "usd", "source": "tok_visa", "capture": false}),
        )
        .unwrap_err();
        assert_eq!(
            (err.code.as_str(), err.param.as_str()),
            ("parameter_unknown", "capture")
        );
        let err = parse_json(json!({"amount": 1, "source": "tok_visa"})).unwrap_err();
        assert_eq!(
            (err.code.as_str(), err.param.as_str()),
            ("parameter_missing", "currency")
        );
        assert_eq!(
            code(json!({"amount": 1, "currency": 840, "source": "tok_visa"})),
            "parameter_invalid_type"
        );
        assert_eq!(
            code(json!({"amount": 1, "currency": "usx", "source": "tok_visa"})),
            "invalid_currency"
        );
        assert_eq!(
            code(json!({"amount": 1, "currency": "usd", "source": "tok_nope"})),
            "resource_missing"
        );
    }

    #[test]
    fn descriptions_and_metadata_have_limits() {
        let base = |extra: Value| {
            let mut body = json!({"amount": 1, "currency": "usd", "source": "tok_visa"});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            code(body)
        };
        assert_eq!(
            base(json!({"description": "x".repeat(1001)})),
            "parameter_too_long"
        );
        let many: serde_json::Map<String, Value> =
            (0..51).map(|i| (format!("k{i}"), json!("v"))).collect();
        assert_eq!(base(json!({"metadata": many})), "metadata_invalid");
        assert_eq!(
            base(json!({"metadata": {"k".repeat(41): "v"}})),
            "metadata_invalid"
        );
        assert_eq!(
            base(json!({"metadata": {"k": "v".repeat(501)}})),
            "metadata_invalid"
        );
        assert_eq!(base(json!({"metadata": {"k": 1}})), "metadata_invalid");
        assert_eq!(base(json!({"metadata": ["k"]})), "metadata_invalid");
        assert!(
            parse_json(json!({
                "amount": 1, "currency": "usd", "source": "tok_visa",
                "description": "é".repeat(1000), "metadata": {"k".repeat(40): "v".repeat(500)}
            }))
            .is_ok()
        );
    }

    #[test]
    fn any_changed_value_changes_the_canonical_form() {
        let base = json!({"amount": 2000, "currency": "usd", "source": "tok_visa", "metadata": {"a": "1"}});
        let canonical = parse_json(base.clone()).unwrap().canonical();
        for (field, value) in [
            ("amount", json!(2001)),
            ("currency", json!("eur")),
            ("source", json!("tok_mastercard")),
            ("description", json!("x")),
            ("metadata", json!({"a": "2"})),
        ] {
            let mut changed = base.clone();
            changed[field] = value;
            assert_ne!(
                parse_json(changed).unwrap().canonical(),
                canonical,
                "{field}"
            );
        }
    }
}
