//! The idempotency-key table's SQL. Every state change is one conditional
//! statement; none reads a row and then writes it on what it read.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::{Fingerprint, IdempotencyKey};

/// A response saved for replay, byte for byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedResponse {
    pub status: u16,
    pub content_type: String,
    pub location: Option<String>,
    pub body: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyStatus {
    /// Claimed; the work may be under way.
    Processing,
    /// Finished; the saved response is final.
    Completed,
}

/// The record a key guards: the charge or the refund its request creates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resource {
    Charge(String),
    Refund(String),
}

impl Resource {
    /// The record's id.
    pub fn id(&self) -> &str {
        match self {
            Resource::Charge(id) | Resource::Refund(id) => id,
        }
    }

    /// The `idempotency_keys` column that points at it.
    fn column(&self) -> &'static str {
        match self {
            Resource::Charge(_) => "charge_id",
            Resource::Refund(_) => "refund_id",
        }
    }

    fn charge_id(&self) -> Option<&str> {
        match self {
            Resource::Charge(id) => Some(id),
            Resource::Refund(_) => None,
        }
    }

    fn refund_id(&self) -> Option<&str> {
        match self {
            Resource::Refund(id) => Some(id),
            Resource::Charge(_) => None,
        }
    }

    /// From the two columns, of which the schema allows at most one.
    fn from_columns(charge_id: Option<String>, refund_id: Option<String>) -> Option<Self> {
        match (charge_id, refund_id) {
            (Some(id), _) => Some(Resource::Charge(id)),
            (None, Some(id)) => Some(Resource::Refund(id)),
            (None, None) => None,
        }
    }
}

/// A key as stored.
#[derive(Clone, Debug)]
pub struct StoredKey {
    pub key: String,
    pub status: KeyStatus,
    pub request_method: String,
    pub request_path: String,
    pub fingerprint: Fingerprint,
    /// The record the key guards.
    pub resource: Option<Resource>,
    pub response: Option<SavedResponse>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct KeyRow {
    key: String,
    status: String,
    request_method: String,
    request_path: String,
    fingerprint: Vec<u8>,
    charge_id: Option<String>,
    refund_id: Option<String>,
    response_status: Option<i16>,
    response_content_type: Option<String>,
    response_location: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

impl TryFrom<KeyRow> for StoredKey {
    type Error = sqlx::Error;

    fn try_from(row: KeyRow) -> Result<Self, Self::Error> {
        let corrupt = |what: &str| sqlx::Error::Decode(format!("idempotency_keys.{what}").into());
        let status = match row.status.as_str() {
            "processing" => KeyStatus::Processing,
            "completed" => KeyStatus::Completed,
            _ => return Err(corrupt("status")),
        };
        let response = match (
            row.response_status,
            row.response_content_type,
            row.response_body,
        ) {
            (Some(status), Some(content_type), Some(body)) => Some(SavedResponse {
                status: u16::try_from(status).map_err(|_| corrupt("response_status"))?,
                content_type,
                location: row.response_location,
                body,
            }),
            _ => None,
        };
        Ok(StoredKey {
            key: row.key,
            status,
            request_method: row.request_method,
            request_path: row.request_path,
            fingerprint: Fingerprint::from_slice(&row.fingerprint)
                .ok_or_else(|| corrupt("fingerprint"))?,
            resource: Resource::from_columns(row.charge_id, row.refund_id),
            response,
            created_at: row.created_at,
            expires_at: row.expires_at,
        })
    }
}

const COLUMNS: &str = "key, status, request_method, request_path, fingerprint, charge_id,
    refund_id, response_status, response_content_type, response_location, response_body, created_at, expires_at";

/// What a request asks to claim.
#[derive(Debug)]
pub struct Claim<'a> {
    pub merchant_id: Uuid,
    pub key: &'a IdempotencyKey,
    pub method: &'a str,
    pub path: &'a str,
    pub fingerprint: Fingerprint,
    /// The business record written in the same transaction.
    pub resource: &'a Resource,
    pub ttl: Duration,
}

#[derive(Debug)]
pub enum ClaimOutcome {
    /// This request holds the key now.
    Claimed {
        /// The key existed, had expired, and was taken over (`xmax <> 0`:
        /// the row was updated, not inserted).
        took_over: bool,
    },
    /// Someone else holds, or held, the key; here is its row.
    Taken(Box<StoredKey>),
}

/// Claims a key in one statement: insert it, or take over a completed row
/// that has expired (an expired key counts as never seen). A row still
/// `processing` is never taken over, however old: its request may still be
/// at work, so it is settled first (sweeper or stale retry). When neither happens, the
/// conflicting row is locked by the statement and read in the same
/// transaction, so the answer is built from a committed, current row.
pub async fn claim(tx: &mut PgConnection, claim: Claim<'_>) -> sqlx::Result<ClaimOutcome> {
    let claimed: Option<bool> = sqlx::query_scalar(
        "INSERT INTO idempotency_keys
             (merchant_id, key, status, request_method, request_path, fingerprint, charge_id,
              refund_id, created_at, locked_at, expires_at)
         VALUES ($1, $2, 'processing', $3, $4, $5, $6, $8,
                 now(), now(), now() + $7::float8 * interval '1 millisecond')
         ON CONFLICT (merchant_id, key) DO UPDATE SET
             status = 'processing',
             request_method = EXCLUDED.request_method,
             request_path = EXCLUDED.request_path,
             fingerprint = EXCLUDED.fingerprint,
             charge_id = EXCLUDED.charge_id,
             refund_id = EXCLUDED.refund_id,
             response_status = NULL,
             response_content_type = NULL,
             response_location = NULL,
             response_body = NULL,
             created_at = EXCLUDED.created_at,
             locked_at = EXCLUDED.locked_at,
             expires_at = EXCLUDED.expires_at,
             completed_at = NULL
         WHERE idempotency_keys.expires_at <= now()
           AND idempotency_keys.status = 'completed'
         RETURNING xmax <> 0 AS took_over",
    )
    .bind(claim.merchant_id)
    .bind(claim.key.as_str())
    .bind(claim.method)
    .bind(claim.path)
    .bind(&claim.fingerprint.0[..])
    .bind(claim.resource.charge_id())
    .bind(claim.ttl.as_millis() as f64)
    .bind(claim.resource.refund_id())
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(took_over) = claimed {
        return Ok(ClaimOutcome::Claimed { took_over });
    }
    let row: KeyRow = sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM idempotency_keys WHERE merchant_id = $1 AND key = $2"
    ))
    .bind(claim.merchant_id)
    .bind(claim.key.as_str())
    .fetch_one(&mut *tx)
    .await?;
    Ok(ClaimOutcome::Taken(Box::new(row.try_into()?)))
}

/// Marks the key that guards `resource` completed with its saved response.
/// Returns how many keys changed: 0 when the record had no key, or when its
/// key is no longer `processing` (someone else completed it first).
pub async fn complete_for(
    tx: &mut PgConnection,
    resource: &Resource,
    response: &SavedResponse,
) -> sqlx::Result<u64> {
    let done = sqlx::query(&format!(
        "UPDATE idempotency_keys
            SET status = 'completed', response_status = $2, response_content_type = $3,
                response_location = $4, response_body = $5, completed_at = now(), locked_at = NULL
          WHERE {} = $1 AND status = 'processing'",
        resource.column()
    ))
    .bind(resource.id())
    .bind(response.status as i16)
    .bind(&response.content_type)
    .bind(&response.location)
    .bind(&response.body)
    .execute(tx)
    .await?;
    Ok(done.rows_affected())
}

/// Gives a key back when the work could not start: the claim is deleted, so a
/// retry runs anew. Only the holder's own claim, still processing, is deleted.
pub async fn release(tx: &mut PgConnection, resource: &Resource) -> sqlx::Result<u64> {
    let released = sqlx::query(&format!(
        "DELETE FROM idempotency_keys WHERE {} = $1 AND status = 'processing'",
        resource.column()
    ))
    .bind(resource.id())
    .execute(tx)
    .await?;
    Ok(released.rows_affected())
}

/// A merchant's key if it is `completed` and unexpired. Such a row never
/// changes until it expires, so reading it needs no transaction and no lock:
/// a replay costs one statement.
pub async fn find_completed(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
) -> sqlx::Result<Option<StoredKey>> {
    let row: Option<KeyRow> = sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM idempotency_keys
          WHERE merchant_id = $1 AND key = $2 AND status = 'completed' AND expires_at > now()"
    ))
    .bind(merchant_id)
    .bind(key.as_str())
    .fetch_optional(db)
    .await?;
    row.map(StoredKey::try_from).transpose()
}

/// A merchant's key, unless it is unknown or expired.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
) -> sqlx::Result<Option<StoredKey>> {
    let row: Option<KeyRow> = sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM idempotency_keys
          WHERE merchant_id = $1 AND key = $2 AND expires_at > now()"
    ))
    .bind(merchant_id)
    .bind(key.as_str())
    .fetch_optional(db)
    .await?;
    row.map(StoredKey::try_from).transpose()
}

/// Leases up to `limit` keys stuck in `processing` for longer than `timeout`,
/// returning the records they guard. Taking the lease moves `locked_at` to now, so
/// another sweeper skips these rows (`SKIP LOCKED` while the statement runs,
/// the fresh `locked_at` afterwards) for another `timeout`.
pub async fn lease_stale(
    db: impl PgExecutor<'_>,
    timeout: Duration,
    limit: i64,
) -> sqlx::Result<Vec<Resource>> {
    sqlx::query_as(
        "UPDATE idempotency_keys k SET locked_at = now()
           FROM (SELECT merchant_id, key FROM idempotency_keys
                  WHERE status = 'processing'
                    AND locked_at < now() - $1::float8 * interval '1 millisecond'
                  ORDER BY locked_at
                  LIMIT $2
                  FOR UPDATE SKIP LOCKED) stale
          WHERE k.merchant_id = stale.merchant_id AND k.key = stale.key
          RETURNING k.charge_id, k.refund_id",
    )
    .bind(timeout.as_millis() as f64)
    .bind(limit)
    .fetch_all(db)
    .await
    .map(|rows: Vec<(Option<String>, Option<String>)>| {
        rows.into_iter()
            .filter_map(|(charge, refund)| Resource::from_columns(charge, refund))
            .collect()
    })
}

/// Leases one key if it has been `processing` for longer than `timeout`,
/// returning the id of the record it guards; `None` when it is fresh, done,
/// or someone else just leased it. Used by a retry that finds its key stuck.
pub async fn lease_one(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    timeout: Duration,
) -> sqlx::Result<Option<Resource>> {
    let leased: Option<(Option<String>, Option<String>)> = sqlx::query_as(
        "UPDATE idempotency_keys SET locked_at = now()
          WHERE merchant_id = $1 AND key = $2 AND status = 'processing'
            AND locked_at < now() - $3::float8 * interval '1 millisecond'
          RETURNING charge_id, refund_id",
    )
    .bind(merchant_id)
    .bind(key.as_str())
    .bind(timeout.as_millis() as f64)
    .fetch_optional(db)
    .await?;
    Ok(leased.and_then(|(charge, refund)| Resource::from_columns(charge, refund)))
}

/// The response saved on the completed key that guards `resource`, if any.
pub async fn saved_for_resource(
    db: impl PgExecutor<'_>,
    resource: &Resource,
) -> sqlx::Result<Option<SavedResponse>> {
    let row: Option<(i16, String, Option<String>, Vec<u8>)> = sqlx::query_as(&format!(
        "SELECT response_status, response_content_type, response_location, response_body
           FROM idempotency_keys WHERE {} = $1 AND status = 'completed'",
        resource.column()
    ))
    .bind(resource.id())
    .fetch_optional(db)
    .await?;
    row.map(|(status, content_type, location, body)| {
        Ok(SavedResponse {
            status: u16::try_from(status)
                .map_err(|_| sqlx::Error::Decode("idempotency_keys.response_status".into()))?,
            content_type,
            location,
            body,
        })
    })
    .transpose()
}

/// The statement of [`delete_expired`], for tests that check its plan.
pub const DELETE_EXPIRED: &str = "DELETE FROM idempotency_keys
  WHERE ctid = ANY (ARRAY(SELECT ctid FROM idempotency_keys
                           WHERE expires_at <= now() AND status = 'completed'
                           ORDER BY expires_at
                           LIMIT $1
                           FOR UPDATE SKIP LOCKED))";

/// Deletes up to `limit` completed keys past their expiry, oldest first;
/// returns how many. Small batches keep each statement's locks short however
/// large the backlog. The rows are found through the partial index on
/// completed keys' `expires_at` and deleted by their row address (locked, so
/// unchanged): a batch reads only the rows it deletes, never the table.
pub async fn delete_expired(db: impl PgExecutor<'_>, limit: i64) -> sqlx::Result<u64> {
    let deleted = sqlx::query(DELETE_EXPIRED).bind(limit).execute(db).await?;
    Ok(deleted.rows_affected())
}
