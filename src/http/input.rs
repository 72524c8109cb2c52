//! The bodies and queries of the API's requests, validated into the core's
//! types at the edge: each parameter read once, with a problem that names
//! it, and every unknown one refused. The core takes the validated values
//! ([`NewCharge`], [`NewRefund`]) and never sees a body.

use serde_json::Value;

use super::details::NewDetails;
pub use super::from_params::{FromParams, description};
use crate::events::EventType;
use crate::processor::TestToken;
use oncepay_core::amount::{Amount, too_large};
use oncepay_core::charges::{Currency, NewCharge};
use oncepay_core::params::{Encoding, ParamError, Params, boolean, required, shorten, string};
use oncepay_core::problem::ProblemCode;
use oncepay_core::refunds::{NewRefund, RefundReason};

/// The most types one `types` filter may name, as Stripe allows.
const MAX_FILTER_TYPES: usize = 20;

impl FromParams for NewCharge {
    fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let encoding = params.encoding;
        let amount = parse_amount(required(&mut params, "amount")?, encoding)?;
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
            .map(|v| description(string(v, "description")?))
            .transpose()?;
        let metadata = params.take_metadata()?;
        let details = NewDetails::take(&mut params)?;
        let capture = params
            .take("capture")
            .map(|v| boolean(v, "capture"))
            .transpose()?
            .unwrap_or(true);
        params.refuse_expand()?;
        params.reject_unknown()?;
        // Once every parameter is read: the rule of the two together.
        currency.check_charge(amount)?;
        Ok(NewCharge {
            amount,
            currency,
            source,
            description,
            metadata,
            receipt_email: details.receipt_email,
            statement_descriptor: details.statement_descriptor,
            statement_descriptor_suffix: details.statement_descriptor_suffix,
            shipping: details.shipping,
            transfer_group: details.transfer_group,
            capture,
        })
    }
}

/// The parameters of `POST /v1/charges/{id}/capture`, validated.
#[derive(utoipa::ToSchema)]
#[schema(as = CaptureCharge)]
pub struct CaptureParams {
    /// Integer minor units, at most what the charge holds; default: all of
    /// it. What is not captured goes back to the card.
    #[schema(value_type = Option<i64>, minimum = 1, example = 1500)]
    pub amount: Option<Amount>,
}

impl FromParams for CaptureParams {
    fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let encoding = params.encoding;
        let amount = params
            .take("amount")
            .map(|v| parse_amount(v, encoding))
            .transpose()?;
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(CaptureParams { amount })
    }
}

impl FromParams for NewRefund {
    fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let encoding = params.encoding;
        let charge = string(required(&mut params, "charge")?, "charge")?;
        let amount = params
            .take("amount")
            .map(|v| parse_amount(v, encoding))
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
}

/// Reads `amount`: a JSON integer, or a string of digits in a form.
fn parse_amount(value: Value, encoding: Encoding) -> Result<Amount, ParamError> {
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

/// Takes the list's type filter out of `params`: `type` (one type) or
/// `types` (up to [`MAX_FILTER_TYPES`]; a form sends `types[]=...` or
/// `types[N]=...`, as the Stripe SDKs send a list), not both. `None`: every
/// type.
pub fn take_type_filter(params: &mut Params) -> Result<Option<Vec<EventType>>, ParamError> {
    match (params.take("type"), params.take("types")) {
        (Some(_), Some(_)) => Err(ParamError::new(
            ProblemCode::ParametersExclusive,
            "types",
            "You may only specify one of these parameters: type, types.",
        )),
        (Some(one), None) => Ok(Some(parse_pattern(&string(one, "type")?)?)),
        (None, Some(many)) => {
            let invalid_type = || {
                ParamError::new(
                    ProblemCode::ParameterInvalidType,
                    "types",
                    "types must be a list of event types, e.g. types[]=charge.succeeded",
                )
            };
            let items: Vec<Value> = match many {
                Value::Array(items) => items,
                Value::Object(entries) => {
                    if let Some(name) = entries
                        .keys()
                        .find(|k| !k.bytes().all(|b| b.is_ascii_digit()))
                    {
                        return Err(ParamError::unknown(&format!("types[{name}]")));
                    }
                    entries.into_iter().map(|(_, v)| v).collect()
                }
                _ => return Err(invalid_type()),
            };
            if items.len() > MAX_FILTER_TYPES {
                return Err(ParamError::new(
                    ProblemCode::ParameterTooLong,
                    "types",
                    format!("types can name at most {MAX_FILTER_TYPES} event types"),
                ));
            }
            let types = items
                .into_iter()
                .map(|item| match item {
                    Value::String(name) => parse_filter(&name, "types"),
                    _ => Err(invalid_type()),
                })
                .collect::<Result<_, _>>()?;
            Ok(Some(types))
        }
        (None, None) => Ok(None),
    }
}

/// The event type `name` names, or `invalid_event_type` for `param`.
fn parse_filter(name: &str, param: &str) -> Result<EventType, ParamError> {
    EventType::parse(name).ok_or_else(|| invalid_event_type(name, param))
}

/// The event types `type` names: one, or every one a pattern matches, `*`
/// standing for any characters (`charge.*`), as Stripe's `type` takes it.
/// A pattern that matches no type is `invalid_event_type`, as an unknown
/// type is.
fn parse_pattern(pattern: &str) -> Result<Vec<EventType>, ParamError> {
    let matched: Vec<EventType> = EventType::ALL
        .into_iter()
        .filter(|t| matches_pattern(pattern, t.as_str()))
        .collect();
    if matched.is_empty() {
        return Err(invalid_event_type(pattern, "type"));
    }
    Ok(matched)
}

/// Whether `name` matches `pattern`, in which each `*` stands for any
/// characters, none included, and every other character for itself.
fn matches_pattern(pattern: &str, name: &str) -> bool {
    let mut pieces = pattern.split('*');
    let first = pieces.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let pieces: Vec<&str> = pieces.collect();
    let Some((last, middle)) = pieces.split_last() else {
        return rest.is_empty();
    };
    for piece in middle {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

/// `invalid_event_type` for `name`, given as `param`.
fn invalid_event_type(name: &str, param: &str) -> ParamError {
    let known: Vec<&str> = EventType::ALL.iter().map(|t| t.as_str()).collect();
    ParamError::new(
        ProblemCode::InvalidEventType,
        param,
        format!(
            "Invalid event type: {}. Use one of {}",
            shorten(name),
            known.join(", ")
        ),
    )
}

/// The bodies of charges and refunds: what every body must do (read alike
/// from JSON and from a form, change its canonical form with any value),
/// then what each refuses.
#[cfg(test)]
mod body_tests {
    use super::*;
    use serde_json::json;

    /// `T` read from `body`, sent as JSON.
    fn parse_json<T: FromParams>(body: Value) -> Result<T, ParamError> {
        T::from_params(Params::from_json(body.to_string().as_bytes()).unwrap())
    }

    /// The code of the problem `T` refuses `body` with.
    fn code<T: FromParams + std::fmt::Debug>(body: Value) -> &'static str {
        parse_json::<T>(body).unwrap_err().code.as_str()
    }

    /// The code of the problem a charge's `body` is refused with.
    fn charge_code(body: Value) -> &'static str {
        code::<NewCharge>(body)
    }

    /// The code of the problem a refund's `body` is refused with.
    fn refund_code(body: Value) -> &'static str {
        code::<NewRefund>(body)
    }

    /// Asserts that `json` and the form `form` read as one `T`, with one
    /// canonical form.
    #[track_caller]
    fn assert_json_and_form_agree<T: FromParams + PartialEq + std::fmt::Debug>(
        json: Value,
        form: &[u8],
        canonical: fn(&T) -> Vec<u8>,
    ) {
        let json: T = parse_json(json).unwrap();
        let form = T::from_params(Params::from_form(form).unwrap()).unwrap();
        assert_eq!(json, form);
        assert_eq!(canonical(&json), canonical(&form));
    }

    /// Asserts that each of `changes`, made to `base` alone, changes the
    /// canonical form.
    #[track_caller]
    fn assert_each_change_changes_canonical<T: FromParams + std::fmt::Debug>(
        base: Value,
        changes: Vec<(&str, Value)>,
        canonical: fn(&T) -> Vec<u8>,
    ) {
        let unchanged = canonical(&parse_json(base.clone()).unwrap());
        for (field, value) in changes {
            let mut changed = base.clone();
            changed[field] = value;
            assert_ne!(
                canonical(&parse_json(changed).unwrap()),
                unchanged,
                "{field}"
            );
        }
    }

    #[test]
    fn json_and_form_with_equal_parameters_are_equal() {
        assert_json_and_form_agree(
            json!({
                "source": "tok_visa", "currency": "USD", "amount": 2000,
                "metadata": {"b": "2", "a": "1"}
            }),
            b"amount=2000&currency=usd&source=tok_visa&metadata[a]=1&metadata[b]=2",
            NewCharge::canonical,
        );
        assert_json_and_form_agree(
            json!({
                "charge": "ch_1", "amount": 500, "reason": "duplicate", "metadata": {"b": "2", "a": "1"}
            }),
            b"charge=ch_1&amount=500&reason=duplicate&metadata[a]=1&metadata[b]=2",
            NewRefund::canonical,
        );
    }

    #[test]
    fn any_changed_value_changes_the_canonical_form() {
        assert_each_change_changes_canonical(
            json!({"amount": 2000, "currency": "usd", "source": "tok_visa", "metadata": {"a": "1"}}),
            vec![
                ("amount", json!(2001)),
                ("currency", json!("eur")),
                ("source", json!("tok_mastercard")),
                ("description", json!("x")),
                ("metadata", json!({"a": "2"})),
            ],
            NewCharge::canonical,
        );
        assert_each_change_changes_canonical(
            json!({"charge": "ch_1", "amount": 500, "reason": "duplicate", "metadata": {"a": "1"}}),
            vec![
                ("charge", json!("ch_2")),
                ("amount", json!(501)),
                ("amount", Value::Null),
                ("reason", json!("fraudulent")),
                ("metadata", json!({"a": "2"})),
            ],
            NewRefund::canonical,
        );
    }
    #[test]
    fn amounts_must_be_whole_positive_numbers_in_range() {
        let base =
            |amount: Value| json!({"amount": amount, "currency": "usd", "source": "tok_visa"});
        assert_eq!(charge_code(base(json!(0))), "parameter_invalid_integer");
        assert_eq!(charge_code(base(json!(-5))), "parameter_invalid_integer");
        assert_eq!(charge_code(base(json!(49))), "amount_too_small");
        assert!(parse_json::<NewCharge>(base(json!(50))).is_ok());
        assert_eq!(charge_code(base(json!(100_000_000))), "amount_too_large");
        assert_eq!(charge_code(base(json!(u64::MAX))), "amount_too_large");
        assert_eq!(charge_code(base(json!(20.5))), "parameter_invalid_integer");
        assert_eq!(charge_code(base(json!(20.0))), "parameter_invalid_integer");
        assert_eq!(
            charge_code(base(json!("2000"))),
            "parameter_invalid_integer"
        );
        assert_eq!(charge_code(base(json!(true))), "parameter_invalid_integer");
        assert!(parse_json::<NewCharge>(base(json!(99_999_999))).is_ok());
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
        assert_eq!(form("-1"), Err("parameter_invalid_integer"));
        assert_eq!(form("5"), Err("amount_too_small"));
        assert_eq!(form("99999999999999999999"), Err("amount_too_large"));
        assert_eq!(
            form("-99999999999999999999"),
            Err("parameter_invalid_integer")
        );
        assert!(form("2000").is_ok());
    }

    #[test]
    fn unknown_missing_and_mistyped_parameters_are_named() {
        let err = parse_json::<NewCharge>(
            json!({"amount": 2000, "currency": "usd", "source": "tok_visa", "captur": false}),
        )
        .unwrap_err();
        assert_eq!(
            (err.code.as_str(), err.param.as_str()),
            ("parameter_unknown", "captur")
        );
        let err = parse_json::<NewCharge>(json!({"amount": 1, "source": "tok_visa"})).unwrap_err();
        assert_eq!(
            (err.code.as_str(), err.param.as_str()),
            ("parameter_missing", "currency")
        );
        assert_eq!(
            charge_code(json!({"amount": 1, "currency": 840, "source": "tok_visa"})),
            "parameter_invalid_type"
        );
        assert_eq!(
            charge_code(json!({"amount": 1, "currency": "usx", "source": "tok_visa"})),
            "invalid_currency"
        );
        assert_eq!(
            charge_code(json!({"amount": 1, "currency": "usd", "source": "tok_nope"})),
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
            charge_code(body)
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
            parse_json::<NewCharge>(json!({
                "amount": 50, "currency": "usd", "source": "tok_visa",
                "description": "é".repeat(1000), "metadata": {"k".repeat(40): "v".repeat(500)}
            }))
            .is_ok()
        );
    }

    #[test]
    fn only_the_charge_is_required() {
        let refund = parse_json::<NewRefund>(json!({"charge": "ch_1"})).unwrap();
        assert_eq!((refund.amount, refund.reason), (None, None));
        assert_eq!(refund_code(json!({"amount": 100})), "parameter_missing");
        assert_eq!(refund_code(json!({"charge": 7})), "parameter_invalid_type");
    }

    #[test]
    fn bad_amounts_reasons_metadata_and_unknown_parameters_are_refused() {
        for (field, value, expected) in [
            ("amount", json!(0), "parameter_invalid_integer"),
            ("amount", json!("5"), "parameter_invalid_integer"),
            ("amount", json!(100_000_000), "amount_too_large"),
            ("reason", json!("bored"), "invalid_reason"),
            ("metadata", json!({"k": 1}), "metadata_invalid"),
            ("currency", json!("usd"), "parameter_unknown"),
        ] {
            let mut body = json!({"charge": "ch_1"});
            body[field] = value;
            assert_eq!(refund_code(body), expected, "{field}");
        }
    }
}

#[cfg(test)]
mod filter_tests {
    use super::*;

    fn filter(query: &str) -> Result<Option<Vec<EventType>>, ProblemCode> {
        let mut params = Params::from_form(query.as_bytes()).unwrap();
        take_type_filter(&mut params).map_err(|e| e.code)
    }

    #[test]
    fn a_type_filter_is_read_in_every_spelling() {
        assert_eq!(filter(""), Ok(None));
        assert_eq!(
            filter("type=charge.failed"),
            Ok(Some(vec![EventType::ChargeFailed]))
        );
        let both = Ok(Some(vec![
            EventType::RefundFailed,
            EventType::ChargeRefunded,
        ]));
        assert_eq!(
            filter("types[]=refund.failed&types[]=charge.refunded"),
            both
        );
        assert_eq!(
            filter("types[0]=refund.failed&types[1]=charge.refunded"),
            both
        );
    }

    #[test]
    fn a_type_with_a_wildcard_names_every_type_it_matches() {
        use EventType::*;
        assert_eq!(
            filter("type=charge.*"),
            Ok(Some(vec![
                ChargeSucceeded,
                ChargeFailed,
                ChargeCaptured,
                ChargeExpired,
                ChargeRefunded,
                ChargeUpdated,
                ChargeRefundUpdated
            ]))
        );
        assert_eq!(
            filter("type=*.failed"),
            Ok(Some(vec![ChargeFailed, RefundFailed]))
        );
        assert_eq!(filter("type=*"), Ok(Some(EventType::ALL.to_vec())));
        assert_eq!(filter("type=re*.cre*"), Ok(Some(vec![RefundCreated])));
        assert_eq!(
            filter("type=*refund.*"),
            Ok(Some(vec![
                ChargeRefundUpdated,
                RefundCreated,
                RefundFailed,
                RefundUpdated
            ]))
        );
        for unmatched in ["type=dispute.*", "type=charge.*.x", "type=charge.*x"] {
            assert_eq!(
                filter(unmatched),
                Err(ProblemCode::InvalidEventType),
                "{unmatched}"
            );
        }
        // `types` names types, as at Stripe; only `type` takes a pattern.
        assert_eq!(
            filter("types[]=charge.*"),
            Err(ProblemCode::InvalidEventType)
        );
    }

    #[test]
    fn a_bad_type_filter_is_refused_with_its_code() {
        assert_eq!(filter("type=charge"), Err(ProblemCode::InvalidEventType));
        assert_eq!(filter("types[]=charge"), Err(ProblemCode::InvalidEventType));
        assert_eq!(
            filter("type=charge.failed&types[]=charge.failed"),
            Err(ProblemCode::ParametersExclusive)
        );
        assert_eq!(
            filter("types[x]=charge.failed"),
            Err(ProblemCode::ParameterUnknown)
        );
        assert_eq!(
            filter("types=charge.failed"),
            Err(ProblemCode::ParameterInvalidType)
        );
        assert_eq!(
            filter("type[]=charge.failed"),
            Err(ProblemCode::ParameterInvalidType)
        );
        let many = vec!["types[]=charge.failed"; 21].join("&");
        assert_eq!(filter(&many), Err(ProblemCode::ParameterTooLong));
        let twenty = vec!["types[]=charge.failed"; 20].join("&");
        assert!(filter(&twenty).is_ok());
    }
}
