//! Events as the server reads them back: an event as stored, its API
//! object, and the reads `GET /v1/events` makes. The core writes them, in
//! the settle's transaction ([`oncepay_core::events`]); nothing here
//! changes one.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgExecutor;
use uuid::Uuid;

pub use oncepay_core::events::{EventType, NewEvent, domain, store};

use crate::objects::{EventObject, EventRequest};

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

/// One event by id; `merchant_id` scopes it, so another merchant's id is not found.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<Event>> {
    sqlx::query_as!(
        Event,
        r#"SELECT seq, id, type AS "kind: EventType", data AS "data: _",
                  request_id, idempotency_key, created_at,
                  (SELECT count(*) FROM webhook_deliveries d
                    WHERE d.event_seq = events.seq)::int AS "pending_webhooks!"
             FROM events WHERE merchant_id = $1 AND id = $2"#,
        merchant_id,
        id,
    )
    .fetch_optional(db)
    .await
}

/// Where an event stands in the list, `txid` then `seq`: a page is a range
/// of positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub txid: i64,
    pub seq: i64,
}

impl Position {
    /// After every event: the first page's upper bound.
    pub const END: Position = Position {
        txid: i64::MAX,
        seq: i64::MAX,
    };
}

/// The list position of one event, by id; `merchant_id` scopes it.
pub async fn position(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<Position>> {
    sqlx::query_as!(
        Position,
        "SELECT txid, seq FROM events WHERE merchant_id = $1 AND id = $2",
        merchant_id,
        id,
    )
    .fetch_optional(db)
    .await
}
