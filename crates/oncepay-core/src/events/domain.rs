//! What an event is: its type, the row a settle writes, and the filter a
//! list takes; the row hands its facts to the API's event object
//! (`oncepay_api::objects`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use crate::objects::{EventObject, EventRequest};
use crate::params::{ParamError, Params, shorten};
use crate::params::{new_id, string};
use crate::problem::ProblemCode;

/// The most types one `types` filter may name, as Stripe allows.
pub const MAX_FILTER_TYPES: usize = 20;

/// What happened, with Stripe's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text")]
// The API's objects name this schema (`oncepay_api::objects`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum EventType {
    /// A charge succeeded: the money moved.
    #[sqlx(rename = "charge.succeeded")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.succeeded"))]
    ChargeSucceeded,
    /// A charge failed: declined, or abandoned by recovery before the card
    /// network answered (`failure_code: processing_abandoned`).
    #[sqlx(rename = "charge.failed")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.failed"))]
    ChargeFailed,
    /// A refund of the charge succeeded, in part or in full; `data.object`
    /// is the charge.
    #[sqlx(rename = "charge.refunded")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.refunded"))]
    ChargeRefunded,
    /// A refund succeeded; `data.object` is the refund.
    #[sqlx(rename = "refund.succeeded")]
    #[cfg_attr(feature = "openapi", schema(rename = "refund.succeeded"))]
    RefundSucceeded,
    /// The card's issuer refused a refund; its amount can be refunded again.
    #[sqlx(rename = "refund.failed")]
    #[cfg_attr(feature = "openapi", schema(rename = "refund.failed"))]
    RefundFailed,
}

impl EventType {
    /// Every type, in the order the documentation lists them.
    pub const ALL: [EventType; 5] = [
        EventType::ChargeSucceeded,
        EventType::ChargeFailed,
        EventType::ChargeRefunded,
        EventType::RefundSucceeded,
        EventType::RefundFailed,
    ];

    /// As stored, and as the API shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::ChargeSucceeded => "charge.succeeded",
            EventType::ChargeFailed => "charge.failed",
            EventType::ChargeRefunded => "charge.refunded",
            EventType::RefundSucceeded => "refund.succeeded",
            EventType::RefundFailed => "refund.failed",
        }
    }

    /// The type a name names, if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }
}

impl std::fmt::Display for EventType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event a settle is about to write: its id, what happened, and the
/// object it happened to, rendered by the API's own serialisation.
#[derive(Clone, Debug)]
pub struct NewEvent {
    pub id: String,
    pub kind: EventType,
    /// The charge's or refund's id.
    pub object_id: String,
    /// The object as the API renders it (`Charge::to_object`, ...), as JSON text.
    pub data: String,
}

impl NewEvent {
    /// A new event of `kind` about `object` (whose id is `object_id`), with a fresh id.
    pub fn new(kind: EventType, object_id: &str, object: &impl Serialize) -> Self {
        NewEvent {
            id: new_event_id(),
            kind,
            object_id: object_id.to_owned(),
            data: serde_json::to_string(object).expect("an API object serialises"),
        }
    }
}

/// An event as stored.
#[derive(Clone, Debug)]
pub struct Event {
    /// The order events were inserted in (not the order they committed in);
    /// what deliveries refer to.
    pub seq: i64,
    pub id: String,
    pub kind: EventType,
    /// The object's snapshot, key order kept.
    pub data: sqlx::types::Json<Value>,
    pub request_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    /// The webhook deliveries it was given when it was written, one per
    /// endpoint that enabled its type then: fixed, like the rest of the
    /// event, so that every copy sent and every read show the same bytes.
    pub pending_webhooks: i32,
}

impl Event {
    /// The API object.
    pub fn to_object(&self) -> EventObject<'_> {
        let request = EventRequest {
            id: self.request_id.as_deref(),
            idempotency_key: self.idempotency_key.as_deref(),
        };
        EventObject::new(
            &self.id,
            self.kind.as_str(),
            self.created_at.timestamp(),
            &self.data.0,
            self.pending_webhooks,
            request,
        )
    }
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
        (Some(one), None) => Ok(Some(vec![parse_filter(&string(one, "type")?, "type")?])),
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
    EventType::parse(name).ok_or_else(|| {
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
    })
}

/// A new event id: `evt_` and 24 random letters and digits.
pub fn new_event_id() -> String {
    new_id("evt")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_parses_back_from_its_name() {
        for kind in EventType::ALL {
            assert_eq!(EventType::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(EventType::parse("charge.*"), None);
        assert_eq!(EventType::parse("charge.succeed"), None);
    }

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
    fn a_bad_type_filter_is_refused_with_its_code() {
        assert_eq!(filter("type=charge.*"), Err(ProblemCode::InvalidEventType));
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

    #[test]
    fn a_new_event_keeps_the_objects_own_rendering() {
        let object = serde_json::json!({"id": "ch_1", "object": "charge", "amount": 5});
        let event = NewEvent::new(EventType::ChargeSucceeded, "ch_1", &object);
        assert_eq!(event.data, r#"{"id":"ch_1","object":"charge","amount":5}"#);
        assert!(event.id.starts_with("evt_") && event.id.len() == 28);
    }
}
