//! Events as the server reads them back, for `GET /v1/events` and for the
//! webhook deliveries: an event as stored, and its API object. The core
//! writes them, in the settle's transaction ([`oncepay_core::events`]);
//! nothing here changes one.

use chrono::{DateTime, Utc};
use serde_json::Value;

pub use oncepay_core::events::{EventType, NewEvent, domain, store};

use oncepay_core::objects::{EventObject, EventRequest};

/// An event as stored.
#[derive(Clone, Debug)]
pub struct Event {
    /// The order events were inserted in (not committed in); what
    /// deliveries refer to.
    pub seq: i64,
    pub id: String,
    pub kind: EventType,
    /// The object's snapshot, key order kept.
    pub data: sqlx::types::Json<Value>,
    pub request_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    /// The deliveries it was given when written, one per endpoint that
    /// enabled its type then: fixed, so every copy and read shows the same bytes.
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
