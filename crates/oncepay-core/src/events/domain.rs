//! What an event is: its type, the row a settle writes, and its API object.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use crate::params::{ParamError, Params, shorten};
use crate::params::{new_id, string};
use crate::problem::ProblemCode;

/// The most types one `types` filter may name, as Stripe allows.
pub const MAX_FILTER_TYPES: usize = 20;

/// What happened, with Stripe's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text")]
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

/// The event object of the API, in Stripe's shape: what happened to a
/// charge or a refund, one event per final state change, written in the
/// same transaction as the change, never changed afterwards.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Event))]
pub struct EventObject<'a> {
    /// `evt_` and 24 letters or digits.
    #[cfg_attr(feature = "openapi", schema(example = "evt_1NbB3eCTYkz2mVgqA8rW0hXp"))]
    pub id: &'a str,
    #[cfg_attr(feature = "openapi", schema(example = "event"))]
    pub object: &'static str,
    /// Always null: oncepay renders its objects one way only, so no version is named.
    pub api_version: Option<&'static str>,
    /// Unix seconds: when the change was made.
    #[cfg_attr(feature = "openapi", schema(example = 1764892800))]
    pub created: i64,
    pub data: EventData<'a>,
    pub livemode: bool,
    /// Webhook deliveries the event was given when it was written, one per
    /// endpoint that enabled its type then; fixed, like the rest of the
    /// event (where each stands: `/v1/events/{id}/deliveries`).
    #[cfg_attr(feature = "openapi", schema(minimum = 0, example = 1))]
    pub pending_webhooks: i32,
    pub request: EventRequest<'a>,
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(value_type = EventType))]
    pub kind: &'static str,
}

/// The object the event is about, as the API rendered it at that moment.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventData<'a> {
    #[cfg_attr(feature = "openapi", schema(schema_with = charge_or_refund))]
    pub object: &'a Value,
}

/// The schema of an event's `data.object`: a charge or a refund.
#[cfg(feature = "openapi")]
fn charge_or_refund() -> utoipa::openapi::schema::Schema {
    use utoipa::ToSchema;
    use utoipa::openapi::Ref;
    utoipa::openapi::schema::OneOfBuilder::new()
        .item(Ref::from_schema_name(crate::objects::ChargeObject::name()))
        .item(Ref::from_schema_name(crate::objects::RefundObject::name()))
        .description(Some(
            "A charge for `charge.*` events, a refund for `refund.*` events",
        ))
        .build()
        .into()
}

/// The API request that settled the object.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventRequest<'a> {
    /// Its `X-Request-Id`; null when the sweeper settled the object.
    #[cfg_attr(
        feature = "openapi",
        schema(example = "0b6f3a52-5d1e-4c8a-9a57-2f1d8e4b7c90")
    )]
    pub id: Option<&'a str>,
    /// The key that guards the object, if it has one.
    #[cfg_attr(feature = "openapi", schema(example = "order-6735-charge"))]
    pub idempotency_key: Option<&'a str>,
}

impl Event {
    pub fn to_object(&self) -> EventObject<'_> {
        EventObject {
            id: &self.id,
            object: "event",
            api_version: None,
            created: self.created_at.timestamp(),
            data: EventData {
                object: &self.data.0,
            },
            livemode: false,
            pending_webhooks: self.pending_webhooks,
            request: EventRequest {
                id: self.request_id.as_deref(),
                idempotency_key: self.idempotency_key.as_deref(),
            },
            kind: self.kind.as_str(),
        }
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
