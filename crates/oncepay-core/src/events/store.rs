//! The events table's SQL: events are inserted, never changed. Each row
//! keeps the id of the transaction that wrote it (`txid`, the column's
//! default), the order the API lists them in.

use sqlx::PgConnection;
use uuid::Uuid;

use super::NewEvent;

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
