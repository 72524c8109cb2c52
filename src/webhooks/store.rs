//! The webhook tables' SQL: endpoints, and the deliveries the worker claims
//! and records. Deliveries are written with their events (see
//! [`oncepay_core::events::store::insert`]); every change after that is one
//! conditional statement.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool};
use uuid::Uuid;

use super::domain::{
    Attempt, Delivery, DeliveryEnd, DeliveryStatus, Endpoint, EndpointStatus, MAX_ENDPOINTS,
    NewEndpoint,
};
use crate::events::{Event, EventType};

fn millis(d: Duration) -> f64 {
    d.as_millis() as f64
}

/// Writes a new endpoint, unless the merchant has [`MAX_ENDPOINTS`]
/// already (`None`). The merchant's row is locked first, so that two
/// creates at once count each other. `FOR NO KEY UPDATE`, not `FOR UPDATE`:
/// the claim in the same transaction already holds the `KEY SHARE` lock its
/// foreign key takes on that row, and two creates holding one each while
/// waiting for `FOR UPDATE` would deadlock.
pub async fn insert(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    id: &str,
    secret: &str,
    new: &NewEndpoint,
) -> sqlx::Result<Option<Endpoint>> {
    sqlx::query!(
        "SELECT id FROM merchants WHERE id = $1 FOR NO KEY UPDATE",
        merchant_id
    )
    .fetch_one(&mut *tx)
    .await?;
    // A statement of its own, after the lock: its snapshot sees every
    // endpoint committed before the lock was granted.
    sqlx::query_as!(
        Endpoint,
        r#"INSERT INTO webhook_endpoints (id, merchant_id, url, enabled_events, description, secret,
                                         metadata)
           SELECT $2, $1, $3, $4, $5, $6, $8
            WHERE (SELECT count(*) FROM webhook_endpoints
                    WHERE merchant_id = $1 AND status <> 'deleted') < $7
        RETURNING id, url, enabled_events, description, secret, status AS "status: _",
                  disabled_reason, created_at, metadata AS "metadata: _""#,
        merchant_id,
        id,
        new.url,
        &new.enabled_events,
        new.description,
        secret,
        MAX_ENDPOINTS,
        sqlx::types::Json(&new.metadata) as _,
    )
    .fetch_optional(&mut *tx)
    .await
}

/// One endpoint of the merchant's, unless deleted.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<Endpoint>> {
    sqlx::query_as!(
        Endpoint,
        r#"SELECT id, url, enabled_events, description, secret, status AS "status: _",
                  disabled_reason, created_at, metadata AS "metadata: _"
             FROM webhook_endpoints
            WHERE merchant_id = $1 AND id = $2 AND status <> 'deleted'"#,
        merchant_id,
        id,
    )
    .fetch_optional(db)
    .await
}

/// The merchant's endpoints, newest first (there are at most
/// [`MAX_ENDPOINTS`], so one page holds them all).
pub async fn list(db: impl PgExecutor<'_>, merchant_id: Uuid) -> sqlx::Result<Vec<Endpoint>> {
    sqlx::query_as!(
        Endpoint,
        r#"SELECT id, url, enabled_events, description, secret, status AS "status: _",
                  disabled_reason, created_at, metadata AS "metadata: _"
             FROM webhook_endpoints
            WHERE merchant_id = $1 AND status <> 'deleted'
            ORDER BY created_at DESC, id DESC"#,
        merchant_id,
    )
    .fetch_all(db)
    .await
}

/// Deletes an endpoint: it is marked deleted (its deliveries keep naming
/// it) and its pending deliveries end `failed`. How many deliveries it
/// ended; `None` when there was no such endpoint, or it was deleted already.
///
/// The deliveries are ended first, then the endpoint, in one transaction:
/// the order in which recording an attempt locks them (delivery, then
/// endpoint), so the two never deadlock. A delivery a settle writes
/// meanwhile, having seen the endpoint still enabled, is ended by the
/// worker when it claims it ([`claim_due`] reports the endpoint's status).
pub async fn delete(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<u64>> {
    let ended = end_pending_of(tx, merchant_id, id, DeliveryEnd::EndpointDeleted).await?;
    let deleted = sqlx::query!(
        "UPDATE webhook_endpoints SET status = 'deleted', disabled_reason = NULL
          WHERE merchant_id = $1 AND id = $2 AND status <> 'deleted'",
        merchant_id,
        id,
    )
    .execute(&mut *tx)
    .await?;
    Ok((deleted.rows_affected() == 1).then_some(ended))
}

/// A delivery a worker has claimed: the attempt it may make, and what to send.
pub struct Claimed {
    pub delivery_id: i64,
    /// This attempt's number; only the holder of it may record it.
    pub attempt: i32,
    pub endpoint_id: String,
    /// Not `enabled` when the endpoint was deleted or disabled after the
    /// delivery was written: then nothing is sent.
    pub endpoint_status: EndpointStatus,
    pub url: String,
    pub secret: String,
    pub event: Event,
}

/// Without the URL and the secret, which must never reach a log.
impl std::fmt::Debug for Claimed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claimed")
            .field("delivery_id", &self.delivery_id)
            .field("attempt", &self.attempt)
            .field("endpoint_id", &self.endpoint_id)
            .field("endpoint_status", &self.endpoint_status)
            .field("event", &self.event.id)
            .finish_non_exhaustive()
    }
}

/// How many deliveries may be in flight at once, counted over every
/// instance from the leases not yet ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlightBounds {
    /// To one endpoint (`WEBHOOK_ENDPOINT_CONCURRENCY`).
    pub per_endpoint: i64,
    /// To all the endpoints of one merchant (`WEBHOOK_MERCHANT_CONCURRENCY`).
    pub per_merchant: i64,
}

/// The advisory lock that makes claims take turns, across instances, so
/// that each counts the leases of the one before it.
const CLAIM_LOCK: i64 = 0x6f6e_6365_7061_7901;

/// How many due deliveries, past those of endpoints and merchants already
/// at their bound, one claim looks at for each it may take.
const SCAN_PER_CLAIM: i64 = 4;

/// Claims up to `limit` due deliveries for one attempt each, the earliest
/// due first, within `bounds`: the deliveries of an endpoint or a merchant
/// already at its bound are passed over, and no more are taken for one
/// than its bound leaves room for. Each claimed delivery's attempt count
/// goes up and its next attempt and its lease move `lease` ahead, in the
/// same statement. A worker that dies mid-attempt leaves the delivery due
/// again after the lease: redelivered, never lost.
///
/// The rows are taken `FOR UPDATE SKIP LOCKED`, so that workers in several
/// processes never take the same one, and the claims take turns (an
/// advisory lock held to the commit, a few milliseconds), so that each
/// counts the leases the one before it committed and the bounds hold
/// across instances.
pub async fn claim_due(
    pool: &PgPool,
    limit: i64,
    lease: Duration,
    bounds: InFlightBounds,
) -> sqlx::Result<Vec<Claimed>> {
    let mut tx = pool.begin().await?;
    sqlx::query!(
        r#"SELECT true AS "locked!" FROM pg_advisory_xact_lock($1)"#,
        CLAIM_LOCK
    )
    .fetch_one(&mut *tx)
    .await?;
    let rows = sqlx::query!(
        r#"WITH leased AS (
               SELECT d.endpoint_id, w.merchant_id
                 FROM webhook_deliveries d JOIN webhook_endpoints w ON w.id = d.endpoint_id
                WHERE d.leased_until IS NOT NULL AND d.leased_until > now()
                  AND d.status = 'pending'),
           endpoint_load AS (SELECT endpoint_id, count(*) AS n FROM leased GROUP BY endpoint_id),
           merchant_load AS (SELECT merchant_id, count(*) AS n FROM leased GROUP BY merchant_id),
           due AS (
               SELECT d.id, d.endpoint_id, w.merchant_id, d.next_attempt_at
                 FROM webhook_deliveries d JOIN webhook_endpoints w ON w.id = d.endpoint_id
                WHERE d.status = 'pending' AND d.next_attempt_at <= now()
                  AND d.endpoint_id NOT IN (SELECT endpoint_id FROM endpoint_load WHERE n >= $3)
                  AND w.merchant_id NOT IN (SELECT merchant_id FROM merchant_load WHERE n >= $4)
                ORDER BY d.next_attempt_at
                LIMIT $5),
           ranked AS (
               SELECT due.id, due.next_attempt_at,
                      coalesce(el.n, 0) + row_number() OVER (
                          PARTITION BY due.endpoint_id ORDER BY due.next_attempt_at, due.id)
                          AS endpoint_slot,
                      coalesce(ml.n, 0) + row_number() OVER (
                          PARTITION BY due.merchant_id ORDER BY due.next_attempt_at, due.id)
                          AS merchant_slot
                 FROM due
                 LEFT JOIN endpoint_load el ON el.endpoint_id = due.endpoint_id
                 LEFT JOIN merchant_load ml ON ml.merchant_id = due.merchant_id),
           chosen AS (
               SELECT d.id FROM webhook_deliveries d
                WHERE d.id IN (SELECT id FROM ranked
                                WHERE endpoint_slot <= $3 AND merchant_slot <= $4
                                ORDER BY next_attempt_at, id
                                LIMIT $1)
                  AND d.status = 'pending' AND d.next_attempt_at <= now()
                  FOR UPDATE SKIP LOCKED)
           UPDATE webhook_deliveries d
              SET attempts = d.attempts + 1,
                  next_attempt_at = now() + $2::float8 * interval '1 millisecond',
                  leased_until = now() + $2::float8 * interval '1 millisecond'
             FROM chosen, webhook_endpoints w, events e
            WHERE d.id = chosen.id AND w.id = d.endpoint_id AND e.seq = d.event_seq
        RETURNING d.id, d.attempts, w.id AS endpoint_id,
                  w.status AS "endpoint_status: EndpointStatus", w.url, w.secret,
                  e.seq, e.id AS event_id, e.type AS "kind: EventType", e.data AS "data: sqlx::types::Json<serde_json::Value>",
                  e.request_id, e.idempotency_key, e.created_at,
                  (SELECT count(*) FROM webhook_deliveries p WHERE p.event_seq = e.seq)::int
                      AS "pending_webhooks!""#,
        limit,
        millis(lease),
        bounds.per_endpoint,
        bounds.per_merchant,
        limit.saturating_mul(SCAN_PER_CLAIM),
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows
        .into_iter()
        .map(|row| Claimed {
            delivery_id: row.id,
            attempt: row.attempts,
            endpoint_id: row.endpoint_id,
            endpoint_status: row.endpoint_status,
            url: row.url,
            secret: row.secret,
            event: Event {
                seq: row.seq,
                id: row.event_id,
                kind: row.kind,
                data: row.data,
                request_id: row.request_id,
                idempotency_key: row.idempotency_key,
                created_at: row.created_at,
                pending_webhooks: row.pending_webhooks,
            },
        })
        .collect())
}

/// What becomes of a delivery after an attempt.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Next {
    /// Answered `2xx`: delivered.
    Delivered,
    /// Failed: try again after this long.
    RetryAfter(Duration),
    /// Failed, and it was the last attempt allowed.
    GiveUp,
}

/// An attempt that ran to its end.
#[derive(Debug)]
pub struct Finished<'a> {
    pub delivery_id: i64,
    pub attempt: i32,
    pub started_at: DateTime<Utc>,
    pub duration: Duration,
    pub response_status: Option<u16>,
    pub error: Option<&'a str>,
    pub next: Next,
}

/// What recording an attempt changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// The delivery was still this worker's to settle: pending, at this
    /// attempt. `false` when it was claimed again meanwhile (the attempt
    /// outlived its lease) or ended otherwise (the endpoint went away).
    pub held: bool,
    /// This failure disabled the endpoint: it had failed every delivery
    /// since `disable_after` ago.
    pub disabled_endpoint: Option<String>,
}

/// Records an attempt and, if the delivery is still held at that attempt,
/// its consequence, in one statement: the attempt's row, the delivery's
/// new state, and the endpoint's run of failures (cleared by a success;
/// begun, or ended by disabling the endpoint, by a failure). A failure
/// more than `run_gap` after the previous one begins a new run, so that an
/// endpoint idle for days is not disabled by its next single failure.
pub async fn record(
    db: impl PgExecutor<'_>,
    finished: &Finished<'_>,
    disable_after: Duration,
    run_gap: Duration,
) -> sqlx::Result<Recorded> {
    let delivered = finished.next == Next::Delivered;
    let retry_ms = match finished.next {
        Next::RetryAfter(after) => Some(millis(after)),
        Next::Delivered | Next::GiveUp => None,
    };
    let duration_ms = i32::try_from(finished.duration.as_millis()).unwrap_or(i32::MAX);
    let row = sqlx::query!(
        r#"WITH attempt AS (
               INSERT INTO webhook_attempts
                      (delivery_id, attempt, started_at, duration_ms, response_status, error)
               VALUES ($1, $2, $3, $4, $5, $6)
               ON CONFLICT DO NOTHING),
           delivery AS (
               UPDATE webhook_deliveries
                  SET status = CASE WHEN $7 THEN 'succeeded'
                                    WHEN $8::float8 IS NULL THEN 'failed'
                                    ELSE 'pending' END,
                      next_attempt_at = CASE WHEN $8::float8 IS NULL THEN next_attempt_at
                                             ELSE now() + $8::float8 * interval '1 millisecond' END,
                      finished_at = CASE WHEN $7 OR $8::float8 IS NULL THEN now() END,
                      failure_reason = CASE WHEN NOT $7 AND $8::float8 IS NULL
                                            THEN 'attempts_exhausted' END,
                      leased_until = NULL
                WHERE id = $1 AND status = 'pending' AND attempts = $2
               RETURNING endpoint_id),
           run AS (
               SELECT w.id,
                      w.failing_since IS NOT NULL
                          AND w.last_failed_at >= now() - $11::float8 * interval '1 millisecond'
                          AS continues
                 FROM webhook_endpoints w JOIN delivery ON w.id = delivery.endpoint_id),
           endpoint AS (
               UPDATE webhook_endpoints w
                  SET failing_since = CASE WHEN $7 THEN NULL
                                           WHEN run.continues THEN w.failing_since
                                           ELSE now() END,
                      last_failed_at = CASE WHEN $7 THEN w.last_failed_at ELSE now() END,
                      status = CASE WHEN NOT $7 AND run.continues
                                         AND w.failing_since <= now() - $9::float8 * interval '1 millisecond'
                                    THEN 'disabled' ELSE w.status END,
                      disabled_reason = CASE WHEN NOT $7 AND run.continues
                                                  AND w.failing_since <= now() - $9::float8 * interval '1 millisecond'
                                             THEN 'every delivery failed for ' || $10::text
                                             ELSE w.disabled_reason END
                 FROM run
                WHERE w.id = run.id AND w.status = 'enabled'
                  AND (NOT $7 OR w.failing_since IS NOT NULL)
               RETURNING w.id, w.status)
           SELECT (SELECT count(*) FROM delivery) AS "held!",
                  (SELECT id FROM endpoint WHERE status = 'disabled') AS disabled"#,
        finished.delivery_id,
        finished.attempt,
        finished.started_at,
        duration_ms,
        finished.response_status.map(|s| s as i16),
        finished.error,
        delivered,
        retry_ms,
        millis(disable_after),
        humantime::format_duration(disable_after).to_string(),
        millis(run_gap),
    )
    .fetch_one(db)
    .await?;
    Ok(Recorded {
        held: row.held > 0,
        disabled_endpoint: row.disabled,
    })
}

/// Ends a claimed delivery without sending it: its endpoint is gone
/// (`endpoint_deleted`, `endpoint_disabled`) or its attempts are spent
/// (`attempts_exhausted`, after crashes that left attempts unrecorded).
/// The claim's count goes back, as no attempt was made. `false` when the
/// delivery is no longer held at `attempt`.
pub async fn end_unsent(
    db: impl PgExecutor<'_>,
    delivery_id: i64,
    attempt: i32,
    reason: &str,
) -> sqlx::Result<bool> {
    let ended = sqlx::query!(
        "UPDATE webhook_deliveries
            SET status = 'failed', failure_reason = $3, finished_at = now(),
                attempts = attempts - 1, leased_until = NULL
          WHERE id = $1 AND status = 'pending' AND attempts = $2",
        delivery_id,
        attempt,
        reason,
    )
    .execute(db)
    .await?;
    Ok(ended.rows_affected() == 1)
}

/// Ends the pending deliveries of an endpoint just disabled: they fail, as
/// nothing will be sent to it any more.
pub async fn end_deliveries_of_disabled(
    db: impl PgExecutor<'_>,
    endpoint_id: &str,
) -> sqlx::Result<u64> {
    let ended = sqlx::query!(
        "UPDATE webhook_deliveries
            SET status = 'failed', failure_reason = 'endpoint_disabled', finished_at = now(),
                leased_until = NULL
          WHERE endpoint_id = $1 AND status = 'pending'",
        endpoint_id,
    )
    .execute(db)
    .await?;
    Ok(ended.rows_affected())
}

/// The deliveries of one event, one per endpoint.
pub async fn deliveries_of(db: impl PgExecutor<'_>, event_seq: i64) -> sqlx::Result<Vec<Delivery>> {
    sqlx::query_as!(
        Delivery,
        r#"SELECT d.endpoint_id, w.url, d.status AS "status: DeliveryStatus", d.attempts,
                  d.next_attempt_at, d.failure_reason, d.finished_at
             FROM webhook_deliveries d JOIN webhook_endpoints w ON w.id = d.endpoint_id
            WHERE d.event_seq = $1
            ORDER BY d.id"#,
        event_seq,
    )
    .fetch_all(db)
    .await
}

/// The recorded attempts of one event's deliveries, in order.
pub async fn attempts_of(db: impl PgExecutor<'_>, event_seq: i64) -> sqlx::Result<Vec<Attempt>> {
    sqlx::query_as!(
        Attempt,
        r#"SELECT d.endpoint_id, a.attempt, a.started_at, a.duration_ms, a.response_status, a.error
             FROM webhook_attempts a JOIN webhook_deliveries d ON d.id = a.delivery_id
            WHERE d.event_seq = $1
            ORDER BY d.id, a.attempt"#,
        event_seq,
    )
    .fetch_all(db)
    .await
}

/// How long the oldest event with a delivery still pending has waited, in
/// seconds; `None` when every delivery has ended.
pub async fn oldest_pending_age(db: impl PgExecutor<'_>) -> sqlx::Result<Option<f64>> {
    sqlx::query_scalar!(
        r#"SELECT extract(epoch FROM now() - min(created_at))::float8
             FROM webhook_deliveries WHERE status = 'pending'"#
    )
    .fetch_one(db)
    .await
}

/// One endpoint of the merchant's, unless deleted, its row locked for the
/// rest of the transaction, so that two updates at once apply one after
/// the other.
pub async fn lock(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    id: &str,
) -> sqlx::Result<Option<Endpoint>> {
    let locked = sqlx::query_scalar!(
        "SELECT id FROM webhook_endpoints
          WHERE merchant_id = $1 AND id = $2 AND status <> 'deleted'
            FOR NO KEY UPDATE",
        merchant_id,
        id,
    )
    .fetch_optional(&mut *tx)
    .await?;
    match locked {
        Some(_) => find(&mut *tx, merchant_id, id).await,
        None => Ok(None),
    }
}

/// Writes what an update may change of `endpoint`. An endpoint enabled
/// again starts with no run of failures behind it.
pub async fn save(tx: &mut PgConnection, endpoint: &Endpoint) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE webhook_endpoints
            SET url = $2, enabled_events = $3, description = $4, metadata = $5,
                failing_since = CASE WHEN status = 'disabled' AND $6 = 'enabled'
                                     THEN NULL ELSE failing_since END,
                last_failed_at = CASE WHEN status = 'disabled' AND $6 = 'enabled'
                                      THEN NULL ELSE last_failed_at END,
                status = $6, disabled_reason = $7
          WHERE id = $1",
        endpoint.id,
        endpoint.url,
        &endpoint.enabled_events,
        endpoint.description,
        &endpoint.metadata as _,
        endpoint.status.as_str(),
        endpoint.disabled_reason,
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// Ends the pending deliveries of the merchant's endpoint `id` as it is
/// deleted or disabled by its merchant: they fail (`end`'s reason), as
/// nothing will be sent to it any more. How many it ended.
pub async fn end_pending_of(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    id: &str,
    end: DeliveryEnd,
) -> sqlx::Result<u64> {
    let ended = sqlx::query!(
        "UPDATE webhook_deliveries
            SET status = 'failed', failure_reason = $3, finished_at = now(),
                leased_until = NULL
          WHERE endpoint_id = (SELECT id FROM webhook_endpoints
                                WHERE merchant_id = $1 AND id = $2 AND status <> 'deleted')
            AND status = 'pending'",
        merchant_id,
        id,
        end.reason(),
    )
    .execute(tx)
    .await?;
    Ok(ended.rows_affected())
}
