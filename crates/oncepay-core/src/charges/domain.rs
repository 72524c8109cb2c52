//! What a charge is: its parameters as the server's edge validated them
//! (`http/input.rs`), and its stored row, which hands its facts to the
//! API's charge object (`oncepay_api::objects`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::currency::Currency;
use crate::amount::Amount;
use crate::objects::details::{FraudDetails, Shipping};
use crate::objects::{ChargeFacts, ChargeObject};
use crate::params::new_id;
use crate::processor::TestToken;
use crate::refunds::Refund;
use test_cards::{Decline, Verdict};

/// The parameters of `POST /v1/charges`, validated. The API's document
/// describes them under the name `CreateCharge`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = CreateCharge, description = CREATE_CHARGE))]
pub struct NewCharge {
    /// Integer minor units (2000 = 20.00 USD), 1 to 99 999 999.
    #[cfg_attr(feature = "openapi", schema(value_type = i64, minimum = 1, maximum = 99_999_999, example = 2000))]
    pub amount: Amount,
    /// An ISO 4217 code, any case; stored in lower case.
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "usd", min_length = 3, max_length = 3))]
    pub currency: Currency,
    /// A test token: `tok_visa`, `tok_visa_debit`, `tok_mastercard`,
    /// `tok_mastercard_debit`, `tok_amex`, `tok_discover`,
    /// `tok_mastercard_prepaid`, `tok_jcb`, `tok_unionpay`, `tok_diners`
    /// succeed, and so does `tok_riskLevelElevated` (placed in review);
    /// `tok_chargeDeclined`, `tok_chargeDeclinedInsufficientFunds`,
    /// `tok_chargeDeclinedExpiredCard`, `tok_chargeDeclinedIncorrectCvc`,
    /// `tok_chargeDeclinedProcessingError`, `tok_chargeDeclinedFraudulent`,
    /// `tok_chargeDeclinedLostCard`, `tok_chargeDeclinedStolenCard` are declined;
    /// `tok_processorTimeoutAfterCapture`, `tok_processorUnavailable` simulate faults;
    /// `tok_refundFail` pays, and the first refund of it is refused (`failed`).
    /// Stripe's test payment methods for the same cards name them too
    /// (`pm_card_visa` is `tok_visa`).
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "tok_visa"))]
    pub source: TestToken,
    /// Up to 1000 characters.
    #[cfg_attr(feature = "openapi", schema(max_length = 1000, example = "Order 6735"))]
    pub description: Option<String>,
    /// Up to 50 keys of 1 to 40 characters; string values of up to 500.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<BTreeMap<String, String>>, example = json!({"order_id": "6735"})))]
    pub metadata: BTreeMap<String, String>,
    /// Where the receipt would go: an email address, up to 512 characters.
    #[cfg_attr(
        feature = "openapi",
        schema(max_length = 512, example = "jenny.rosen@example.com")
    )]
    pub receipt_email: Option<String>,
    /// Up to 22 characters, at least one letter, none of `<>\'"*`. Every
    /// charge is a card charge, so, as at Stripe, it is shown after the
    /// account's `ONCEPAY* ` when no `statement_descriptor_suffix` is given,
    /// and ignored when one is.
    #[cfg_attr(feature = "openapi", schema(max_length = 22, example = "ORDER 6735"))]
    pub statement_descriptor: Option<String>,
    /// Shown after the account's `ONCEPAY* `: up to 22 characters, at least
    /// one letter, none of `<>\'"*`.
    #[cfg_attr(feature = "openapi", schema(max_length = 22, example = "ORDER 6735"))]
    pub statement_descriptor_suffix: Option<String>,
    /// Where the goods ship: `name` and `address` required.
    pub shipping: Option<Shipping>,
    /// A string that groups the charge with others; up to 5000 characters.
    #[cfg_attr(feature = "openapi", schema(max_length = 5000, example = "order-6735"))]
    pub transfer_group: Option<String>,
    /// `true` (the default) pays at once; `false` only authorizes: the
    /// amount is held on the card until `POST /v1/charges/{id}/capture`.
    #[cfg_attr(feature = "openapi", schema(default = true))]
    pub capture: bool,
}

/// How the API's document describes [`NewCharge`]: as a request's body.
#[cfg(feature = "openapi")]
const CREATE_CHARGE: &str = "The parameters of `POST /v1/charges`, as JSON or as a form\n(`metadata[key]=value`). Unknown parameters are refused.";

impl NewCharge {
    /// A canonical encoding of the parameters for the request fingerprint:
    /// fixed field order, sorted metadata, normalised values. Key order,
    /// white space and JSON versus form do not change it; any value does.
    ///
    /// The details (`receipt_email` and those after it) are appended only
    /// when one is given, so a charge without them keeps the fingerprint it
    /// had before they were taken: a retry across the upgrade still replays.
    pub fn canonical(&self) -> Vec<u8> {
        let mut canonical = vec![
            serde_json::json!(self.amount.minor_units()),
            serde_json::json!(self.currency.as_str()),
            serde_json::json!(self.source.as_str()),
            serde_json::json!(self.description),
            serde_json::json!(self.metadata),
        ];
        if let Some(details) = self.details() {
            canonical.push(serde_json::json!(details));
        }
        // Appended only when false, so that a charge paid at once keeps the
        // fingerprint it had before captures existed.
        if !self.capture {
            canonical.push(serde_json::json!({"capture": false}));
        }
        serde_json::to_vec(&canonical).expect("serialising a JSON value cannot fail")
    }

    /// The charge as step 2 writes it, `pending`: the one place a new
    /// charge becomes a stored one. Its `created_at` is the database's,
    /// which the claim's statement sets when it writes the charge.
    pub fn pending(&self, id: String, merchant_id: Uuid) -> Charge {
        Charge {
            id,
            merchant_id,
            amount: self.amount.minor_units(),
            currency: self.currency.as_str().to_owned(),
            source: self.source.as_str().to_owned(),
            description: self.description.clone(),
            metadata: sqlx::types::Json(self.metadata.clone()),
            status: ChargeStatus::Pending,
            failure_code: None,
            failure_message: None,
            amount_refunded: 0,
            created_at: Utc::now(),
            receipt_email: self.receipt_email.clone(),
            statement_descriptor: self.statement_descriptor.clone(),
            statement_descriptor_suffix: self.statement_descriptor_suffix.clone(),
            shipping: self.shipping.clone().map(sqlx::types::Json),
            transfer_group: self.transfer_group.clone(),
            fraud_details: Default::default(),
            capture_later: !self.capture,
            capture_amount: None,
            captured_at: None,
        }
    }

    /// The details (`receipt_email`, `statement_descriptor`,
    /// `statement_descriptor_suffix`, `shipping`, `transfer_group`) as a
    /// JSON object's text, as the fingerprint appends it; `None` when none
    /// is given.
    fn details(&self) -> Option<String> {
        let details = serde_json::json!({
            "receipt_email": self.receipt_email,
            "statement_descriptor": self.statement_descriptor,
            "statement_descriptor_suffix": self.statement_descriptor_suffix,
            "shipping": self.shipping,
            "transfer_group": self.transfer_group,
        });
        let given = details
            .as_object()
            .is_some_and(|d| d.values().any(|v| !v.is_null()));
        given.then(|| details.to_string())
    }
}

/// A charge's lifecycle: `pending` until the processor's outcome is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type, serde::Serialize)]
#[serde(rename_all = "lowercase")]
// The API's objects name this schema (`oncepay_api::objects`).
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

/// A charge as stored. Serialised, its members are its columns (the claim
/// writes a pending charge from them, `crate::operation::claim`).
#[derive(Clone, Debug, sqlx::FromRow, serde::Serialize)]
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
    pub receipt_email: Option<String>,
    pub statement_descriptor: Option<String>,
    pub statement_descriptor_suffix: Option<String>,
    pub shipping: Option<sqlx::types::Json<Shipping>>,
    pub transfer_group: Option<String>,
    pub fraud_details: sqlx::types::Json<FraudDetails>,
    /// Made with `capture=false`: a succeeded charge is authorized, and
    /// paid once captured.
    pub capture_later: bool,
    /// What a capture takes, from the moment it is asked (reserved).
    pub capture_amount: Option<i64>,
    /// When the processor confirmed the capture.
    pub captured_at: Option<DateTime<Utc>>,
}

impl Charge {
    /// The charge's card, from its test token (every stored `source` is one).
    pub fn token(&self) -> Option<TestToken> {
        TestToken::parse(&self.source)
    }

    /// The decline of a charge its card declined; `None` for any other,
    /// a declining card's charge abandoned before the network answered
    /// included. (A charge declined before the codes followed Stripe's table
    /// stored its decline code as its `failure_code`: any failure code but
    /// the abandoned one is the card's decline.)
    pub fn decline(&self) -> Option<Decline> {
        let decline = self.token()?.decline()?;
        let failure = self.failure_code.as_deref()?;
        (failure != ABANDONED).then_some(decline)
    }

    /// The API object, with `refunds`, the charge's refunds, newest first.
    pub fn to_object<'a>(&'a self, refunds: &'a [Refund]) -> ChargeObject<'a> {
        let facts = ChargeFacts {
            id: &self.id,
            amount: self.amount,
            amount_refunded: self.amount_refunded,
            created: self.created_at.timestamp(),
            currency: &self.currency,
            description: self.description.as_deref(),
            failure_code: self.failure_code.as_deref(),
            failure_message: self.failure_message.as_deref(),
            metadata: &self.metadata.0,
            amount_captured: self.amount_captured(),
            paid: self.status == ChargeStatus::Succeeded,
            status: self.status.as_str(),
            token: self.token(),
            verdict: self.verdict(),
            receipt_email: self.receipt_email.as_deref(),
            statement_descriptor: self.statement_descriptor.as_deref(),
            statement_descriptor_suffix: self.statement_descriptor_suffix.as_deref(),
            shipping: self.shipping.as_ref().map(|s| &s.0),
            transfer_group: self.transfer_group.as_deref(),
            fraud_details: &self.fraud_details.0,
        };
        ChargeObject::new(facts, refunds.iter().map(Refund::to_object))
    }

    /// What was captured: all of it at once for a charge paid at once, what
    /// its capture took, once confirmed, for a charge captured later.
    pub fn amount_captured(&self) -> i64 {
        match (self.status, self.capture_later) {
            (ChargeStatus::Succeeded, false) => self.amount,
            (ChargeStatus::Succeeded, true) => self
                .captured_at
                .and(self.capture_amount)
                .unwrap_or_default(),
            _ => 0,
        }
    }

    /// What refunds may give back in all: what its capture took, for a
    /// charge captured later (the rest was released, never charged); the
    /// whole amount otherwise, a charge paid at once or an authorization a
    /// refund releases whole. The refunds' reservation
    /// ([`crate::refunds::store::reserve`]) holds the same bound in SQL.
    pub fn refundable(&self) -> i64 {
        self.capture_amount.unwrap_or(self.amount)
    }

    /// What the card network (or the fraud check) said; `None` for a pending
    /// or abandoned charge, which no network answered.
    fn verdict(&self) -> Option<Verdict> {
        let token = self.token()?;
        let answered = match self.status {
            ChargeStatus::Succeeded => true,
            ChargeStatus::Failed => self.decline().is_some(),
            ChargeStatus::Pending => false,
        };
        answered.then(|| token.verdict())
    }
}

/// The failure code of a charge whose processor attempt was voided.
pub const ABANDONED: &str = crate::problem::ProblemCode::ProcessingAbandoned.as_str();

/// A new charge id: `ch_` and 24 random letters and digits.
pub fn new_charge_id() -> String {
    new_id("ch")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The columns the claim's statement inserts from the serialised charge
    /// (`crate::operation::claim::claim`), by name.
    const INSERTED: [&str; 13] = [
        "id",
        "merchant_id",
        "amount",
        "currency",
        "source",
        "description",
        "metadata",
        "receipt_email",
        "statement_descriptor",
        "statement_descriptor_suffix",
        "shipping",
        "transfer_group",
        "capture_later",
    ];

    #[test]
    fn a_pending_charge_serialises_to_every_column_the_claim_inserts_by_its_name() {
        let charge = NewCharge {
            amount: Amount::new(2000).unwrap(),
            currency: Currency::parse("usd").unwrap(),
            source: TestToken::parse("tok_visa").unwrap(),
            description: Some("Order 6735".into()),
            metadata: BTreeMap::from([("order".into(), "6735".into())]),
            receipt_email: Some("jenny@example.com".into()),
            statement_descriptor: None,
            statement_descriptor_suffix: None,
            shipping: None,
            transfer_group: Some("order-6735".into()),
            capture: false,
        };
        let pending = charge.pending("ch_1".into(), Uuid::nil());
        let value = serde_json::to_value(&pending).unwrap();
        let members = value.as_object().unwrap();
        for column in INSERTED {
            assert!(members.contains_key(column), "{column} is missing");
        }
        assert_eq!(members["amount"], 2000);
        assert_eq!(members["metadata"]["order"], "6735");
        assert_eq!(members["capture_later"], true);
        assert_eq!(members["status"], "pending");
        assert!(members["shipping"].is_null());
    }
}
