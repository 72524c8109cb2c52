//! The events table's SQL: events are inserted and read, never changed.
//! Each row keeps the id of the transaction that wrote it (`txid`, the
//! column's default), the list's order.

use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::{Event, EventType, NewEvent};

/// Writes `events`, of one merchant, in the order given: called by a settle
/// in its transaction, once its conditional update changed the record.
pub async fn insert(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    request_id: Option<&str>,
    idempotency_key: Option<&str>,
    events: &[NewEvent],
) -> sqlx::Result<()> {
    let ids: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
    let types: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    let objects: Vec<&str> = events.iter().map(|e| e.object_id.as_str()).collect();
    let data: Vec<&str> = events.iter().map(|e| e.data.as_str()).collect();
    // One statement writes the events and, for each, a delivery to every
    // enabled endpoint of the merchant that wants its type: an event is
    // never committed without its deliveries, and the delivery worker needs
    // no cursor over the events (whose `seq` may commit out of order).
    sqlx::query!(
        "WITH written AS (
             INSERT INTO events (id, merchant_id, type, object_id, data, request_id, idempotency_key)
             SELECT e.id, $1, e.type, e.object_id, e.data::json, $2, $3
               FROM unnest($4::text[], $5::text[], $6::text[], $7::text[])
                    WITH ORDINALITY AS e(id, type, object_id, data, n)
              ORDER BY e.n
             RETURNING seq, type)
         INSERT INTO webhook_deliveries (event_seq, endpoint_id)
         SELECT written.seq, w.id
           FROM written
           JOIN webhook_endpoints w
             ON w.merchant_id = $1 AND w.status = 'enabled'
            AND (written.type = ANY (w.enabled_events) OR '*' = ANY (w.enabled_events))
          ORDER BY written.seq, w.id",
        merchant_id,
        request_id,
        idempotency_key,
        &ids as &[&str],
        &types as &[&str],
        &objects as &[&str],
        &data as &[&str],
    )
    .execute(tx)
    .await?;
    Ok(())
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
