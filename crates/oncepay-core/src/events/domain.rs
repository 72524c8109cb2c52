//! What an event is: its type, and the row a settle writes. (The server
//! reads events back, for the API and for webhook deliveries.)

use serde::Serialize;

use crate::params::new_id;

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
    /// A charge authorized with `capture=false` was captured; `data.object`
    /// is the charge.
    #[sqlx(rename = "charge.captured")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.captured"))]
    ChargeCaptured,
    /// A charge authorized with `capture=false` was not captured within
    /// `CAPTURE_WINDOW`, and its authorization was released (a refund of
    /// the whole amount, `reason: expired_uncaptured_charge`); `data.object`
    /// is the charge.
    #[sqlx(rename = "charge.expired")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.expired"))]
    ChargeExpired,
    /// A refund of the charge succeeded, in part or in full; `data.object`
    /// is the charge.
    #[sqlx(rename = "charge.refunded")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.refunded"))]
    ChargeRefunded,
    /// A charge's description, metadata, receipt email, shipping or fraud
    /// report was changed by an update.
    #[sqlx(rename = "charge.updated")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.updated"))]
    ChargeUpdated,
    /// Stripe's type for a refund updated on some payment methods: never
    /// written (a refund's update writes `refund.updated`), and taken where
    /// a type is named, so that an integration written for Stripe may name it.
    #[sqlx(rename = "charge.refund.updated")]
    #[cfg_attr(feature = "openapi", schema(rename = "charge.refund.updated"))]
    ChargeRefundUpdated,
    /// A refund succeeded; `data.object` is the refund. Stripe's type for a
    /// new refund, written once the refund is final (one the issuer refuses
    /// has `refund.failed` alone).
    #[sqlx(rename = "refund.created")]
    #[cfg_attr(feature = "openapi", schema(rename = "refund.created"))]
    RefundCreated,
    /// The card's issuer refused a refund; its amount can be refunded again.
    #[sqlx(rename = "refund.failed")]
    #[cfg_attr(feature = "openapi", schema(rename = "refund.failed"))]
    RefundFailed,
    /// A refund's metadata was changed by an update.
    #[sqlx(rename = "refund.updated")]
    #[cfg_attr(feature = "openapi", schema(rename = "refund.updated"))]
    RefundUpdated,
}

impl EventType {
    /// Every type, in the order the documentation lists them.
    pub const ALL: [EventType; 10] = [
        EventType::ChargeSucceeded,
        EventType::ChargeFailed,
        EventType::ChargeCaptured,
        EventType::ChargeExpired,
        EventType::ChargeRefunded,
        EventType::ChargeUpdated,
        EventType::ChargeRefundUpdated,
        EventType::RefundCreated,
        EventType::RefundFailed,
        EventType::RefundUpdated,
    ];

    /// The type a name names, if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == name)
    }
}

crate::stored_as_text!(EventType {
    ChargeSucceeded => "charge.succeeded",
    ChargeFailed => "charge.failed",
    ChargeCaptured => "charge.captured",
    ChargeExpired => "charge.expired",
    ChargeRefunded => "charge.refunded",
    ChargeUpdated => "charge.updated",
    ChargeRefundUpdated => "charge.refund.updated",
    RefundCreated => "refund.created",
    RefundFailed => "refund.failed",
    RefundUpdated => "refund.updated",
});

/// An event a settle is about to write.
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
    /// A new event of `kind` about `object`, whose id is `object_id`.
    pub fn new(kind: EventType, object_id: &str, object: &impl Serialize) -> Self {
        NewEvent {
            id: new_event_id(),
            kind,
            object_id: object_id.to_owned(),
            data: serde_json::to_string(object).expect("an API object serialises"),
        }
    }
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
        // Stripe has no `refund.succeeded`: a refund that succeeded is `refund.created`.
        assert_eq!(EventType::parse("refund.succeeded"), None);
    }

    #[test]
    fn a_new_event_keeps_the_objects_own_rendering() {
        let object = serde_json::json!({"id": "ch_1", "object": "charge", "amount": 5});
        let event = NewEvent::new(EventType::ChargeSucceeded, "ch_1", &object);
        assert_eq!(event.data, r#"{"id":"ch_1","object":"charge","amount":5}"#);
        assert!(event.id.starts_with("evt_") && event.id.len() == 28);
    }
}
