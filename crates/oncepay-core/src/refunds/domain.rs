//! What a refund is: its validated parameters and its stored row, which
//! hands its facts to the API's refund object (`oncepay_api::objects`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::amount::Amount;
use crate::objects::{RefundFacts, RefundObject};
use crate::params::{ParamError, Params, shorten};
use crate::params::{new_id, required, string};
use crate::problem::ProblemCode;

/// Why a refund was asked for, with Stripe's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundReason {
    Duplicate,
    Fraudulent,
    RequestedByCustomer,
}

impl RefundReason {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "duplicate" => Some(RefundReason::Duplicate),
            "fraudulent" => Some(RefundReason::Fraudulent),
            "requested_by_customer" => Some(RefundReason::RequestedByCustomer),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RefundReason::Duplicate => "duplicate",
            RefundReason::Fraudulent => "fraudulent",
            RefundReason::RequestedByCustomer => "requested_by_customer",
        }
    }
}

/// The parameters of `POST /v1/refunds`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRefund {
    /// The charge's id, as given: whether it exists, is the merchant's and can
    /// be refunded is decided by the reservation, not here.
    pub charge: String,
    /// `None` refunds whatever is left of the charge.
    pub amount: Option<Amount>,
    pub reason: Option<RefundReason>,
    pub metadata: BTreeMap<String, String>,
}

impl NewRefund {
    /// Validates every parameter, and refuses unknown ones.
    pub fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let encoding = params.encoding;
        let charge = string(required(&mut params, "charge")?, "charge")?;
        let amount = params
            .take("amount")
            .map(|v| Amount::from_param(v, encoding))
            .transpose()?;
        let reason = params
            .take("reason")
            .map(|v| string(v, "reason"))
            .transpose()?
            .map(|reason| {
                RefundReason::parse(&reason).ok_or_else(|| {
                    ParamError::new(ProblemCode::InvalidReason,
                        "reason",
                        format!(
                            "Invalid reason: {}. Use duplicate, fraudulent or requested_by_customer",
                            shorten(&reason)
                        ),
                    )
                })
            })
            .transpose()?;
        let metadata = params.take_metadata()?;
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(NewRefund {
            charge,
            amount,
            reason,
            metadata,
        })
    }

    /// A canonical encoding of the parameters for the request fingerprint
    /// (see [`crate::charges::NewCharge::canonical`]). An absent amount and
    /// an explicit one equal to what is left are different requests.
    pub fn canonical(&self) -> Vec<u8> {
        let canonical = serde_json::json!([
            self.charge,
            self.amount.map(Amount::minor_units),
            self.reason.map(RefundReason::as_str),
            self.metadata,
        ]);
        serde_json::to_vec(&canonical).expect("serialising a JSON value cannot fail")
    }
}

/// A refund's lifecycle: `pending` from the reservation until the processor
/// answers; then `succeeded`, or `failed` when the card's issuer refused it
/// for good (its reservation is given back on the charge).
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type)]
// The API's objects name this schema (`oncepay_api::objects`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(rename_all = "lowercase"))]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum RefundStatus {
    Pending,
    Succeeded,
    Failed,
}

crate::stored_as_text!(RefundStatus {
    Pending => "pending",
    Succeeded => "succeeded",
    Failed => "failed",
});

/// A refund as stored.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Refund {
    pub id: String,
    /// Who owns it; not part of the API object.
    pub merchant_id: Uuid,
    pub charge_id: String,
    pub amount: i64,
    pub currency: String,
    pub status: RefundStatus,
    pub reason: Option<String>,
    pub metadata: sqlx::types::Json<BTreeMap<String, String>>,
    pub created_at: DateTime<Utc>,
    /// Why the refund failed, when it did (Stripe's `failure_reason`).
    pub failure_reason: Option<String>,
}

impl Refund {
    /// The API object.
    pub fn to_object(&self) -> RefundObject<'_> {
        RefundObject::new(RefundFacts {
            id: &self.id,
            amount: self.amount,
            charge: &self.charge_id,
            created: self.created_at.timestamp(),
            currency: &self.currency,
            failure_reason: self.failure_reason.as_deref(),
            metadata: &self.metadata.0,
            reason: self.reason.as_deref(),
            status: self.status.as_str(),
            succeeded: self.status == RefundStatus::Succeeded,
        })
    }
}

/// A new refund id: `re_` and 24 random letters and digits.
pub fn new_refund_id() -> String {
    new_id("re")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn parse_json(body: Value) -> Result<NewRefund, ParamError> {
        NewRefund::from_params(Params::from_json(body.to_string().as_bytes()).unwrap())
    }

    fn code(body: Value) -> &'static str {
        parse_json(body).unwrap_err().code.as_str()
    }

    #[test]
    fn json_and_form_with_equal_parameters_are_equal() {
        let json = parse_json(json!({
            "charge": "ch_1", "amount": 500, "reason": "duplicate", "metadata": {"b": "2", "a": "1"}
        }))
        .unwrap();
        let form = NewRefund::from_params(
            Params::from_form(
                b"charge=ch_1&amount=500&reason=duplicate&metadata[a]=1&metadata[b]=2",
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(json, form);
        assert_eq!(json.canonical(), form.canonical());
    }

    #[test]
    fn only_the_charge_is_required() {
        let refund = parse_json(json!({"charge": "ch_1"})).unwrap();
        assert_eq!((refund.amount, refund.reason), (None, None));
        assert_eq!(code(json!({"amount": 100})), "parameter_missing");
        assert_eq!(code(json!({"charge": 7})), "parameter_invalid_type");
    }

    #[test]
    fn bad_amounts_reasons_metadata_and_unknown_parameters_are_refused() {
        assert_eq!(
            code(json!({"charge": "ch_1", "amount": 0})),
            "amount_too_small"
        );
        assert_eq!(
            code(json!({"charge": "ch_1", "amount": "5"})),
            "parameter_invalid_integer"
        );
        assert_eq!(
            code(json!({"charge": "ch_1", "amount": 100_000_000})),
            "amount_too_large"
        );
        assert_eq!(
            code(json!({"charge": "ch_1", "reason": "bored"})),
            "invalid_reason"
        );
        assert_eq!(
            code(json!({"charge": "ch_1", "metadata": {"k": 1}})),
            "metadata_invalid"
        );
        assert_eq!(
            code(json!({"charge": "ch_1", "currency": "usd"})),
            "parameter_unknown"
        );
    }

    #[test]
    fn any_changed_value_changes_the_canonical_form() {
        let base =
            json!({"charge": "ch_1", "amount": 500, "reason": "duplicate", "metadata": {"a": "1"}});
        let canonical = parse_json(base.clone()).unwrap().canonical();
        for (field, value) in [
            ("charge", json!("ch_2")),
            ("amount", json!(501)),
            ("amount", Value::Null),
            ("reason", json!("fraudulent")),
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
