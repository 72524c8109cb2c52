//! What a charge is: its validated parameters and its stored row, which
//! hands its facts to the API's charge object (`oncepay_api::objects`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::currency::Currency;
use crate::amount::Amount;
use crate::objects::{ChargeFacts, ChargeObject};
use crate::params::{ParamError, Params, new_id, required, shorten, string};
use crate::problem::ProblemCode;
use crate::processor::TestToken;
use crate::refunds::Refund;
use test_cards::{Decline, Verdict};

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
            paid: self.status == ChargeStatus::Succeeded,
            status: self.status.as_str(),
            token: self.token(),
            verdict: self.verdict(),
        };
        ChargeObject::new(facts, refunds.iter().map(Refund::to_object))
    }

    /// What the card network (or the fraud check) said: for a charge that
    /// succeeded or was declined; `None` while it is pending and for an
    /// abandoned one, which no network answered.
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
