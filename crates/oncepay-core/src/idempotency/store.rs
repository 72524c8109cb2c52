//! The idempotency-key table's SQL, but for the claim, which is written where
//! it is made (`crate::operation::claim`). Every state change is one
//! conditional statement; none reads a row and then writes it on what it read.
//!
//! The rules of a key's life are written once, as SQL in the migrations, and
//! every statement uses them: `idempotency_key_expired` (only a completed key
//! past its expiry has expired), `idempotency_key_takeover` (when a claim may
//! take an existing key over), `idempotency_key_stale` (when a key still
//! `processing` may be leased and its record settled), `idempotency_key_complete`
//! (complete a key and keep its answer a full TTL) and the view
//! `idempotency_key_reads` (a key as every read sees it, through [`key_query!`]).

use std::time::{Duration, Instant};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::{Fingerprint, IdempotencyKey};

/// A response saved for replay, byte for byte. Cloning it shares the body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedResponse {
    pub status: u16,
    pub content_type: String,
    pub location: Option<String>,
    pub body: Bytes,
}

/// A key's lifecycle: `processing` from the claim, `completed` once its
/// answer is saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum KeyStatus {
    /// Claimed; the work may be under way.
    Processing,
    /// Finished; the saved response is final.
    Completed,
}

crate::stored_as_text!(KeyStatus {
    Processing => "processing",
    Completed => "completed",
});

/// The record a key guards: the charge or the refund its request creates,
/// or the charge its request captures.
///
/// The key table names it in three nullable columns, `charge_id`,
/// `refund_id` and `capture_of`, of which the schema allows at most one.
/// `Resource::columns` and `Resource::from_columns` are the only places that
/// know it: every statement binds all three and matches `(charge_id = $a OR
/// refund_id = $b OR capture_of = $c)`, which a NULL side never matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resource {
    Charge(String),
    Refund(String),
    /// The capture of a charge made with `capture=false`: the charge's id.
    Capture(String),
}

/// The key table's `(charge_id, refund_id, capture_of)`.
pub(crate) type Columns<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>);

impl Resource {
    /// The record's id (a capture's is its charge's).
    pub fn id(&self) -> &str {
        match self {
            Resource::Charge(id) | Resource::Refund(id) | Resource::Capture(id) => id,
        }
    }

    /// The key table's columns for `resource`, if any.
    pub(crate) fn columns(resource: Option<&Self>) -> Columns<'_> {
        match resource {
            Some(Resource::Charge(id)) => (Some(id), None, None),
            Some(Resource::Refund(id)) => (None, Some(id), None),
            Some(Resource::Capture(id)) => (None, None, Some(id)),
            None => (None, None, None),
        }
    }

    /// From the key table's three columns.
    fn from_columns(
        charge_id: Option<String>,
        refund_id: Option<String>,
        capture_of: Option<String>,
    ) -> Option<Self> {
        match (charge_id, refund_id, capture_of) {
            (Some(id), _, _) => Some(Resource::Charge(id)),
            (None, Some(id), _) => Some(Resource::Refund(id)),
            (None, None, Some(id)) => Some(Resource::Capture(id)),
            (None, None, None) => None,
        }
    }
}

/// What a key's first request asked for: the method and route, and the
/// fingerprint of its parameters (which covers the method and route too).
/// The rule of "the same request" is written once, here ([`FirstRequest::is`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirstRequest {
    pub method: String,
    pub route: String,
    pub fingerprint: Fingerprint,
}

impl FirstRequest {
    /// Whether a request with `fingerprint` asks for the very operation the
    /// key was first used for: the same method, route and parameters.
    pub fn is(&self, fingerprint: &Fingerprint) -> bool {
        self.fingerprint == *fingerprint
    }
}

/// A key as stored.
#[derive(Clone, Debug)]
pub struct StoredKey {
    /// Whose key it is.
    pub merchant_id: Uuid,
    pub key: String,
    pub status: KeyStatus,
    /// What the request that claimed it asked for.
    pub first: FirstRequest,
    /// The record the key guards.
    pub resource: Option<Resource>,
    pub response: Option<SavedResponse>,
    pub created_at: DateTime<Utc>,
    /// When the key's holder took it, or a recovery last leased it (a whole
    /// `PROCESSING_TIMEOUT` before now once that lease was given back), while
    /// it is `processing`.
    pub locked_at: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
    /// When its answer was saved, once it is `completed`.
    pub completed_at: Option<DateTime<Utc>>,
    /// The `X-Request-Id` of the request that claimed it: the original
    /// request its replays name. `None` for a key claimed before it was
    /// recorded, or by a request without one.
    pub request_id: Option<String>,
    /// Still `processing` after `PROCESSING_TIMEOUT`, as the read that found
    /// it judged by `idempotency_key_stale`: its request may be gone.
    pub stale: bool,
    /// When the key expires at the latest, on this process's monotonic
    /// clock: the instant taken before the read plus the lifetime the
    /// database gave the row in that read. This instance's wall clock plays
    /// no part, so its skew cannot make an expired key look alive.
    pub deadline: Instant,
}

/// A completed key's answer, and what tells whether a request may replay
/// it: what the server's replay cache keeps, and what a retry is answered.
#[derive(Debug)]
pub struct SavedAnswer {
    pub first: FirstRequest,
    pub response: SavedResponse,
    /// The `X-Request-Id` of the request that claimed the key
    /// ([`StoredKey::request_id`]).
    pub original_request: Option<String>,
    /// When the answer stops being served ([`StoredKey::deadline`]).
    pub deadline: Instant,
}

impl StoredKey {
    /// The key's saved answer, if it is completed.
    pub fn into_answer(self) -> Option<SavedAnswer> {
        match (self.status, self.response) {
            (KeyStatus::Completed, Some(response)) => Some(SavedAnswer {
                first: self.first,
                response,
                original_request: self.request_id,
                deadline: self.deadline,
            }),
            _ => None,
        }
    }
}

/// A key as a read selects it from the view `idempotency_key_reads`
/// ([`key_query!`]).
struct KeyRow {
    merchant_id: Uuid,
    key: String,
    status: KeyStatus,
    request_method: String,
    request_path: String,
    fingerprint: Vec<u8>,
    charge_id: Option<String>,
    refund_id: Option<String>,
    capture_of: Option<String>,
    response_status: Option<i16>,
    response_content_type: Option<String>,
    response_location: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: DateTime<Utc>,
    locked_at: Option<DateTime<Utc>>,
    expires_at: DateTime<Utc>,
    completed_at: Option<DateTime<Utc>>,
    /// Milliseconds from the read to `expires_at`, by the database's clock.
    remaining_ms: f64,
    request_id: Option<String>,
    stale: bool,
}

/// A `query_as!` of [`KeyRow`]s: every read of a key selects the view's
/// columns through it, written here once. `$tail` goes on from the columns
/// and must select `stale` (the judgement of `idempotency_key_stale`, or
/// `false` where it cannot matter), then say `FROM idempotency_key_reads k`.
/// The view's columns decode as nullable; the ones the table requires are
/// marked `!`.
macro_rules! key_query {
    ([$($tail:literal),*], $($arg:expr),* $(,)?) => {
        sqlx::query_as!(
            KeyRow,
            r#"SELECT k.merchant_id AS "merchant_id!", k.key AS "key!",
                      k.status AS "status!: KeyStatus", k.request_method AS "request_method!",
                      k.request_path AS "request_path!", k.fingerprint AS "fingerprint!",
                      k.charge_id, k.refund_id, k.capture_of, k.response_status,
                      k.response_content_type, k.response_location, k.response_body,
                      k.created_at AS "created_at!", k.locked_at, k.expires_at AS "expires_at!",
                      k.completed_at, k.remaining_ms AS "remaining_ms!", k.request_id"#
                $(+ $tail)*,
            $($arg),*
        )
    };
}

impl KeyRow {
    /// The key, with its deadline counted from `sent`: an instant taken
    /// before the statement that read the row was sent.
    fn into_stored(self, sent: Instant) -> sqlx::Result<StoredKey> {
        let corrupt = |what: &str| sqlx::Error::Decode(format!("idempotency_keys.{what}").into());
        let response = match (
            self.response_status,
            self.response_content_type,
            self.response_body,
        ) {
            (Some(status), Some(content_type), Some(body)) => Some(SavedResponse {
                status: u16::try_from(status).map_err(|_| corrupt("response_status"))?,
                content_type,
                location: self.response_location,
                // Takes the decoded buffer over; no copy.
                body: Bytes::from(body),
            }),
            _ => None,
        };
        Ok(StoredKey {
            merchant_id: self.merchant_id,
            key: self.key,
            status: self.status,
            first: FirstRequest {
                method: self.request_method,
                route: self.request_path,
                fingerprint: Fingerprint::from_slice(&self.fingerprint)
                    .ok_or_else(|| corrupt("fingerprint"))?,
            },
            resource: Resource::from_columns(self.charge_id, self.refund_id, self.capture_of),
            response,
            created_at: self.created_at,
            locked_at: self.locked_at,
            expires_at: self.expires_at,
            completed_at: self.completed_at,
            request_id: self.request_id,
            stale: self.stale,
            deadline: deadline(sent, self.remaining_ms),
        })
    }
}

/// `sent` plus `remaining_ms` (none if negative or not a number).
fn deadline(sent: Instant, remaining_ms: f64) -> Instant {
    let remaining = if remaining_ms > 0.0 {
        Duration::try_from_secs_f64(remaining_ms / 1000.0).unwrap_or(Duration::MAX)
    } else {
        Duration::ZERO
    };
    sent.checked_add(remaining).unwrap_or(sent)
}

/// `timeout` in milliseconds, as the SQL rules take durations.
pub(crate) fn millis(timeout: Duration) -> f64 {
    timeout.as_secs_f64() * 1000.0
}

/// Completes a `processing` key with its saved response and keeps the answer
/// a full `ttl`, by the rule's one statement (`idempotency_key_complete`):
/// the key that guards `resource`, or the one `held` names (merchant, key).
/// Returns the key it completed: `None` when there is none, or when it is no
/// longer `processing` (someone else completed it first).
async fn complete_key(
    tx: &mut PgConnection,
    resource: Option<&Resource>,
    held: Option<(Uuid, &str)>,
    response: &SavedResponse,
    ttl: Duration,
) -> sqlx::Result<Option<String>> {
    let (charge_id, refund_id, capture_of) = Resource::columns(resource);
    let (merchant_id, key) = held.unzip();
    sqlx::query_scalar!(
        r#"SELECT key AS "key!"
             FROM idempotency_key_complete($1, $2, $10, $3, $4, $5, $6, $7, $8, $9::float8)
                  AS completed(key)"#,
        charge_id,
        refund_id,
        merchant_id,
        key,
        response.status as i16,
        response.content_type,
        response.location.as_deref(),
        &response.body[..],
        millis(ttl),
        capture_of,
    )
    .fetch_optional(tx)
    .await
}

/// Marks the key that guards `resource`, a refund or a capture, completed
/// with its saved response, kept for at least `ttl` (`complete_key`).
/// Returns the key it completed, if any. (A charge's key is completed by the
/// charge's one-statement settle,
/// [`crate::charges::store::settle_and_complete`], with the same SQL
/// function.)
pub async fn complete_for(
    tx: &mut PgConnection,
    resource: &Resource,
    response: &SavedResponse,
    ttl: Duration,
) -> sqlx::Result<Option<String>> {
    complete_key(tx, Some(resource), None, response, ttl).await
}

/// Marks the key `merchant_id` holds as `key` completed with its saved
/// response (`complete_key`), in the claim's own transaction: for a record
/// written and answered there (a webhook endpoint), which needs no settle
/// later. `false` when the key is not this transaction's `processing` claim.
pub async fn complete(
    tx: &mut PgConnection,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    response: &SavedResponse,
    ttl: Duration,
) -> sqlx::Result<bool> {
    let held = Some((merchant_id, key.as_str()));
    Ok(complete_key(tx, None, held, response, ttl).await?.is_some())
}

/// A merchant's key, unless it is unknown or expired
/// (`idempotency_key_expired`), judged stale after `processing_timeout`:
/// the read of a wait, of a replay before the core, of `GET
/// /v1/idempotency_keys/{key}`. A `completed` row never changes until it
/// expires, so reading it needs no transaction and no lock: a replay costs
/// this one statement.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    processing_timeout: Duration,
) -> sqlx::Result<Option<StoredKey>> {
    read(db, merchant_id, key, processing_timeout, false).await
}

/// A merchant's key as a claim that found it taken reads it: expired or
/// not, since an answer saved after the claiming request arrived is
/// replayed, never taken over, even once it has expired
/// (`idempotency_key_takeover`).
pub async fn find_taken(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    processing_timeout: Duration,
) -> sqlx::Result<Option<StoredKey>> {
    read(db, merchant_id, key, processing_timeout, true).await
}

/// The one read of one key, for [`find`] and [`find_taken`].
async fn read(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    processing_timeout: Duration,
    expired_too: bool,
) -> sqlx::Result<Option<StoredKey>> {
    let sent = Instant::now();
    let row = key_query!(
        [
            r#", idempotency_key_stale(k.status, k.locked_at, $3) AS "stale!"
              FROM idempotency_key_reads k
             WHERE k.merchant_id = $1 AND k.key = $2
               AND ($4 OR NOT idempotency_key_expired(k.status, k.expires_at))"#
        ],
        merchant_id,
        key.as_str(),
        millis(processing_timeout),
        expired_too,
    )
    .fetch_optional(db)
    .await?;
    row.map(|row| row.into_stored(sent)).transpose()
}

/// The keys `asked` (merchant and key, in order) as [`find`] reads each, in
/// one statement: the position in `asked` of each key found, with its row (a
/// key asked twice comes back twice). Every deadline counts from `sent`, an
/// instant taken before it is sent.
pub async fn find_many(
    db: impl PgExecutor<'_>,
    merchants: &[Uuid],
    keys: &[&str],
    processing_timeout: Duration,
) -> sqlx::Result<Vec<(usize, StoredKey)>> {
    let sent = Instant::now();
    let rows = key_query!(
        [
            r#", idempotency_key_stale(k.status, k.locked_at, $3) AS "stale!"
              FROM idempotency_key_reads k
             WHERE (k.merchant_id, k.key) IN (SELECT * FROM unnest($1::uuid[], $2::text[]))
               AND NOT idempotency_key_expired(k.status, k.expires_at)"#
        ],
        merchants,
        keys as &[&str],
        millis(processing_timeout),
    )
    .fetch_all(db)
    .await?;
    let mut found = Vec::new();
    for row in rows {
        let stored = row.into_stored(sent)?;
        let places = merchants.iter().zip(keys).enumerate();
        for (at, _) in places.filter(|(_, (m, k))| **m == stored.merchant_id && **k == stored.key) {
            found.push((at, stored.clone()));
        }
    }
    Ok(found)
}

/// A stale key taken on by one recovery (a sweeper's, or a retry's): the
/// record it guards, and the `locked_at` the lease wrote, which is the
/// lease's token. A lease lasts until `locked_at` plus `PROCESSING_TIMEOUT`,
/// or until it is given back ([`give_back`]).
#[derive(Clone, Debug)]
pub struct Lease {
    pub resource: Resource,
    leased_at: DateTime<Utc>,
}

/// Leases up to `limit` keys stuck in `processing` for longer than `timeout`.
/// Taking the lease moves `locked_at` to now, so another sweeper skips these
/// rows (`SKIP LOCKED` while the statement runs, the fresh `locked_at`
/// afterwards) for another `timeout`, or until the lease is given back
/// ([`give_back`]). A sweeper works through its batch one record at a time,
/// so it renews each lease ([`renew`]) just before it recovers that record.
pub async fn lease_stale(
    db: impl PgExecutor<'_>,
    timeout: Duration,
    limit: i64,
) -> sqlx::Result<Vec<Lease>> {
    let rows = sqlx::query!(
        r#"UPDATE idempotency_keys k SET locked_at = now()
           FROM (SELECT merchant_id, key FROM idempotency_keys
                  WHERE idempotency_key_stale(status, locked_at, $1)
                  ORDER BY locked_at
                  LIMIT $2
                  FOR UPDATE SKIP LOCKED) stale
          WHERE k.merchant_id = stale.merchant_id AND k.key = stale.key
          RETURNING k.charge_id, k.refund_id, k.capture_of, k.locked_at AS "locked_at!""#,
        millis(timeout),
        limit,
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|row| {
            Some(Lease {
                resource: Resource::from_columns(row.charge_id, row.refund_id, row.capture_of)?,
                leased_at: row.locked_at,
            })
        })
        .collect())
}

/// Renews a lease just before its record is recovered: moves `locked_at` to
/// now if it is still the lease's own, so nobody else takes the key for
/// another `PROCESSING_TIMEOUT`. `false` when the lease was lost: its key went
/// stale while the batch was being worked through and someone else leased
/// it (or it was settled); that record is theirs now and must be left alone.
pub async fn renew(db: impl PgExecutor<'_>, lease: &mut Lease) -> sqlx::Result<bool> {
    let (charge_id, refund_id, capture_of) = Resource::columns(Some(&lease.resource));
    let renewed = sqlx::query_scalar!(
        r#"UPDATE idempotency_keys SET locked_at = now()
            WHERE (charge_id = $1 OR refund_id = $2 OR capture_of = $4)
              AND status = 'processing' AND locked_at = $3
            RETURNING locked_at AS "locked_at!""#,
        charge_id,
        refund_id,
        lease.leased_at,
        capture_of,
    )
    .fetch_optional(db)
    .await?;
    match renewed {
        Some(at) => {
            lease.leased_at = at;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Leases one key if it has been `processing` for longer than `timeout`;
/// `None` when it is fresh, done, or someone else just leased it. Used by a
/// retry that finds its key stuck.
pub async fn lease_one(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    timeout: Duration,
) -> sqlx::Result<Option<Lease>> {
    let leased = sqlx::query!(
        r#"UPDATE idempotency_keys SET locked_at = now()
            WHERE merchant_id = $1 AND key = $2
              AND idempotency_key_stale(status, locked_at, $3)
            RETURNING charge_id, refund_id, capture_of, locked_at AS "locked_at!""#,
        merchant_id,
        key.as_str(),
        millis(timeout),
    )
    .fetch_optional(db)
    .await?;
    Ok(leased.and_then(|row| {
        Some(Lease {
            resource: Resource::from_columns(row.charge_id, row.refund_id, row.capture_of)?,
            leased_at: row.locked_at,
        })
    }))
}

/// Gives a lease back before it lapses, when its recovery failed or was
/// never begun, so that the key is stale again at once: the next retry or
/// sweep pass takes it on, not one a whole `timeout` later. A lease lasts
/// until `locked_at` plus `timeout`, so ending it now means `locked_at =
/// now() - timeout`, which is also later than every lease taken on the key
/// before this one: no earlier holder's token matches it again.
///
/// Only while the key is still this lease's (`locked_at` is its token):
/// `false` when it is not, because the lease lapsed and someone else leased
/// the key since, or settled it; the key is theirs then, and left alone.
pub async fn give_back(
    db: impl PgExecutor<'_>,
    lease: &Lease,
    timeout: Duration,
) -> sqlx::Result<bool> {
    let (charge_id, refund_id, capture_of) = Resource::columns(Some(&lease.resource));
    let given_back = sqlx::query!(
        "UPDATE idempotency_keys
            SET locked_at = now() - $5::float8 * interval '1 millisecond'
          WHERE (charge_id = $1 OR refund_id = $2 OR capture_of = $4)
            AND status = 'processing' AND locked_at = $3",
        charge_id,
        refund_id,
        lease.leased_at,
        capture_of,
        millis(timeout),
    )
    .execute(db)
    .await?;
    Ok(given_back.rows_affected() == 1)
}

/// The response saved on the completed key that guards `resource`, if any.
pub async fn saved_for_resource(
    db: impl PgExecutor<'_>,
    resource: &Resource,
) -> sqlx::Result<Option<SavedResponse>> {
    let (charge_id, refund_id, capture_of) = Resource::columns(Some(resource));
    let sent = Instant::now();
    let row = key_query!(
        [r#", false AS "stale!"
              FROM idempotency_key_reads k
             WHERE (k.charge_id = $1 OR k.refund_id = $2 OR k.capture_of = $3)
               AND k.status = 'completed'"#],
        charge_id,
        refund_id,
        capture_of,
    )
    .fetch_optional(db)
    .await?;
    Ok(row
        .map(|row| row.into_stored(sent))
        .transpose()?
        .and_then(|stored| stored.response))
}

/// The statement of [`delete_expired`], deleting up to `limit` rows.
fn delete_expired_statement(limit: i64) -> impl sqlx::Execute<'static, sqlx::Postgres> {
    sqlx::query!(
        "DELETE FROM idempotency_keys
          WHERE ctid = ANY (ARRAY(SELECT ctid FROM idempotency_keys
                                   WHERE idempotency_key_expired(status, expires_at)
                                   ORDER BY expires_at
                                   LIMIT $1
                                   FOR UPDATE SKIP LOCKED))",
        limit
    )
}

/// The SQL of [`delete_expired`], for tests that check its plan.
pub fn delete_expired_sql() -> &'static str {
    sqlx::Execute::sql(&delete_expired_statement(0))
}

/// Deletes up to `limit` completed keys past their expiry, oldest first;
/// returns how many. Small batches keep each statement's locks short however
/// large the backlog. The rows are found through the partial index on
/// completed keys' `expires_at` and deleted by their row address (locked, so
/// unchanged): a batch reads only the rows it deletes, never the table.
pub async fn delete_expired(db: impl PgExecutor<'_>, limit: i64) -> sqlx::Result<u64> {
    let deleted = db.execute(delete_expired_statement(limit)).await?;
    Ok(deleted.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_is_the_read_instant_plus_the_databases_remaining_lifetime() {
        let sent = Instant::now();
        assert_eq!(deadline(sent, 2_000.0), sent + Duration::from_secs(2));
        assert_eq!(deadline(sent, 250.0), sent + Duration::from_millis(250));
        assert_eq!(deadline(sent, -5.0), sent, "already expired");
        assert_eq!(deadline(sent, f64::NAN), sent);
        assert_eq!(deadline(sent, f64::INFINITY), sent, "no overflow");
    }
}
