//! The parameters of a charge besides its payment, read and checked once
//! for its create and its update: `receipt_email`, the statement
//! descriptors, `shipping`, `transfer_group`, `fraud_details`; Stripe's
//! parameters that need what oncepay does not model, refused by name; and
//! the updates' own parameters ([`ChargeUpdate`], [`RefundUpdate`]).

use serde_json::{Map, Value};

use super::from_params::{FromParams, description};
use crate::updates::charge::ChargeUpdate;
use crate::updates::refund::RefundUpdate;
use oncepay_core::objects::details::{Shipping, ShippingAddress, UserReport};
use oncepay_core::params::{ParamError, Params, at_most, shorten, string};
use oncepay_core::problem::ProblemCode;

/// The longest statement descriptor (and suffix) a card network shows.
const MAX_DESCRIPTOR_CHARS: usize = 22;
/// The characters no statement descriptor may hold, as Stripe refuses them.
const FORBIDDEN_IN_DESCRIPTOR: [char; 6] = ['<', '>', '\\', '\'', '"', '*'];
/// The longest email address taken.
const MAX_EMAIL_CHARS: usize = 512;
/// The longest of Stripe's other strings (`transfer_group`, shipping's).
const MAX_STRING_CHARS: usize = 5000;

/// Stripe's charge parameters that need a surface oncepay does not model,
/// each with what it needs.
const UNSUPPORTED: [(&str, &str); 4] = [
    ("customer", "customers"),
    ("on_behalf_of", "connected accounts"),
    ("transfer_data", "connected accounts"),
    (
        "application_fee_amount",
        "connected accounts (application fees go to a platform)",
    ),
];

/// A new charge's details, checked.
pub struct NewDetails {
    pub receipt_email: Option<String>,
    pub statement_descriptor: Option<String>,
    pub statement_descriptor_suffix: Option<String>,
    pub shipping: Option<Shipping>,
    pub transfer_group: Option<String>,
}

impl NewDetails {
    /// Takes a new charge's details out of `params`.
    pub fn take(params: &mut Params) -> Result<Self, ParamError> {
        refuse_unsupported(params)?;
        Ok(NewDetails {
            receipt_email: take_string(params, "receipt_email")?
                .map(receipt_email)
                .transpose()?,
            statement_descriptor: take_string(params, "statement_descriptor")?
                .map(|d| descriptor(d, "statement_descriptor"))
                .transpose()?,
            statement_descriptor_suffix: take_string(params, "statement_descriptor_suffix")?
                .map(|d| descriptor(d, "statement_descriptor_suffix"))
                .transpose()?,
            shipping: params.take("shipping").map(shipping).transpose()?,
            transfer_group: take_string(params, "transfer_group")?
                .map(|g| at_most(g, "transfer_group", MAX_STRING_CHARS))
                .transpose()?,
        })
    }
}

impl FromParams for ChargeUpdate {
    fn from_params(mut params: Params) -> Result<Self, ParamError> {
        refuse_unsupported(&mut params)?;
        let description = match take_string(&mut params, "description")? {
            Some(d) if d.is_empty() => Some(None),
            Some(d) => Some(Some(description(d)?)),
            None => None,
        };
        let receipt_email = match take_string(&mut params, "receipt_email")? {
            Some(e) if e.is_empty() => Some(None),
            Some(e) => Some(Some(receipt_email(e)?)),
            None => None,
        };
        let shipping = match params.take("shipping") {
            Some(Value::String(s)) if s.is_empty() => Some(None),
            Some(value) => Some(Some(shipping(value)?)),
            None => None,
        };
        let update = ChargeUpdate {
            description,
            metadata: params.take_metadata_update()?,
            receipt_email,
            shipping,
            fraud_details: params
                .take("fraud_details")
                .map(fraud_details)
                .transpose()?,
        };
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(update)
    }
}

impl FromParams for RefundUpdate {
    fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let update = RefundUpdate {
            metadata: params.take_metadata_update()?,
        };
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(update)
    }
}

/// Refuses, by name, a parameter of Stripe's that needs what oncepay does
/// not model: `parameter_unknown` would wrongly say Stripe has no such thing.
fn refuse_unsupported(params: &mut Params) -> Result<(), ParamError> {
    for (name, needs) in UNSUPPORTED {
        if params.take(name).is_some() {
            return Err(ParamError::new(
                ProblemCode::ParameterUnsupported,
                name,
                format!("{name} is not supported: oncepay has no {needs}."),
            ));
        }
    }
    Ok(())
}

/// Takes a parameter that must be a string, if given.
fn take_string(params: &mut Params, name: &str) -> Result<Option<String>, ParamError> {
    params.take(name).map(|v| string(v, name)).transpose()
}

/// An email address: one `@` between a local part and a domain of dotted
/// labels (letters, digits, `-`), no spaces: `email_invalid` otherwise.
fn receipt_email(email: String) -> Result<String, ParamError> {
    let email = at_most(email, "receipt_email", MAX_EMAIL_CHARS)?;
    let label_ok = |label: &str| {
        !label.is_empty()
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label.chars().all(|c| c.is_alphanumeric() || c == '-')
    };
    let valid = match email.split_once('@') {
        Some((local, domain)) => {
            let labels: Vec<&str> = domain.split('.').collect();
            !local.is_empty()
                && !local
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control() || c == '@')
                && labels.len() >= 2
                && labels.iter().all(|l| label_ok(l))
                && labels
                    .last()
                    .is_some_and(|tld| tld.chars().all(char::is_alphabetic))
        }
        None => false,
    };
    if !valid {
        return Err(ParamError::new(
            ProblemCode::EmailInvalid,
            "receipt_email",
            format!("Invalid email address: {}", shorten(&email)),
        ));
    }
    Ok(email)
}

/// A statement descriptor or suffix: 1 to 22 characters, at least one
/// letter, none of `<>\'"*`.
fn descriptor(value: String, name: &str) -> Result<String, ParamError> {
    let value = at_most(value, name, MAX_DESCRIPTOR_CHARS)?;
    let invalid = |why: &str| {
        ParamError::new(
            ProblemCode::ParameterInvalidString,
            name,
            format!("{name} {why}: '{value}'"),
        )
    };
    if value.contains(FORBIDDEN_IN_DESCRIPTOR) {
        return Err(invalid("must not contain any of < > \\ ' \" *"));
    }
    if !value.chars().any(char::is_alphabetic) {
        return Err(invalid("must contain at least one letter"));
    }
    Ok(value)
}

/// `shipping`: an object with `name` and `address` (each of its lines
/// optional), and `phone`, `carrier`, `tracking_number` if given.
fn shipping(value: Value) -> Result<Shipping, ParamError> {
    let mut members = object(value, "shipping", &Shipping::MEMBERS)?;
    let address = members
        .remove("address")
        .ok_or_else(|| missing("shipping[address]"))?;
    let mut address = object(address, "shipping[address]", &ShippingAddress::MEMBERS)?;
    let mut line = |name: &str| member(&mut address, "shipping[address]", name);
    let address = ShippingAddress {
        city: line("city")?,
        country: line("country")?,
        line1: line("line1")?,
        line2: line("line2")?,
        postal_code: line("postal_code")?,
        state: line("state")?,
    };
    let mut member = |name: &str| member(&mut members, "shipping", name);
    Ok(Shipping {
        address,
        carrier: member("carrier")?,
        name: member("name")?.ok_or_else(|| missing("shipping[name]"))?,
        phone: member("phone")?,
        tracking_number: member("tracking_number")?,
    })
}

/// `fraud_details`: `{"user_report": "fraudulent" | "safe"}`.
fn fraud_details(value: Value) -> Result<UserReport, ParamError> {
    let mut members = object(value, "fraud_details", &["user_report"])?;
    let report = member(&mut members, "fraud_details", "user_report")?
        .ok_or_else(|| missing("fraud_details[user_report]"))?;
    UserReport::parse(&report).ok_or_else(|| {
        ParamError::new(
            ProblemCode::ParameterInvalidString,
            "fraud_details[user_report]",
            format!(
                "Invalid user_report: '{}'. Use fraudulent or safe",
                shorten(&report)
            ),
        )
    })
}

/// A parameter that must be an object with only `known` members.
fn object(value: Value, name: &str, known: &[&str]) -> Result<Map<String, Value>, ParamError> {
    let Value::Object(members) = value else {
        return Err(ParamError::new(
            ProblemCode::ParameterInvalidType,
            name,
            format!("{name} must be an object"),
        ));
    };
    match members.keys().find(|k| !known.contains(&k.as_str())) {
        Some(unknown) => Err(ParamError::unknown(&format!("{name}[{unknown}]"))),
        None => Ok(members),
    }
}

/// Member `name` of the object `parent`: a string of up to 5000
/// characters; `""` counts as not given.
fn member(
    members: &mut Map<String, Value>,
    parent: &str,
    name: &str,
) -> Result<Option<String>, ParamError> {
    let param = format!("{parent}[{name}]");
    match members.remove(name).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(value) => {
            let value = at_most(string(value, &param)?, &param, MAX_STRING_CHARS)?;
            Ok((!value.is_empty()).then_some(value))
        }
    }
}

fn missing(param: &str) -> ParamError {
    ParamError::new(
        ProblemCode::ParameterMissing,
        param,
        format!("Missing required param: {param}"),
    )
}
