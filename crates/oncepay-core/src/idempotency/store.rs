//! The idempotency-key table's SQL. Every state change is one conditional
//! statement; none reads a row and then writes it on what it read.
//!
//! The rules of a key's life are written once, as SQL in the migration
//! `20261211000100_key_rules.sql`, and every statement here uses them:
//! `idempotency_key_expired` (only a completed key past its expiry has
//! expired), `idempotency_key_takeover` (when a claim may take an existing key
//! over), `idempotency_key_complete` (complete a key and keep its answer a full
//! TTL) and the view `idempotency_key_reads` (a key as every read sees it).

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

impl KeyStatus {
    /// From its stored form.
    fn parse(stored: &str) -> Option<Self> {
        [KeyStatus::Processing, KeyStatus::Completed]
            .into_iter()
            .find(|status| status.as_str() == stored)
    }
}

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
type Columns<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>);

impl Resource {
    /// The record's id (a capture's is its charge's).
    pub fn id(&self) -> &str {
        match self {
            Resource::Charge(id) | Resource::Refund(id) | Resource::Capture(id) => id,
        }
    }

    /// The key table's columns for `resource`, if any.
    fn columns(resource: Option<&Self>) -> Columns<'_> {
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

/// A key as stored.
#[derive(Clone, Debug)]
pub struct StoredKey {
    /// Whose key it is.
    pub merchant_id: Uuid,
    pub key: String,
    pub status: KeyStatus,
    pub request_method: String,
    pub request_path: String,
    pub fingerprint: Fingerprint,
    /// The record the key guards.
    pub resource: Option<Resource>,
    pub response: Option<SavedResponse>,
    pub created_at: DateTime<Utc>,
    /// When the key's holder took it, or a sweeper last leased it, while it
    /// is `processing`.
    pub locked_at: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
    /// When its answer was saved, once it is `completed`.
    pub completed_at: Option<DateTime<Utc>>,
    /// The `X-Request-Id` of the request that claimed it: the original
    /// request its replays name. `None` for a key claimed before it was
    /// recorded, or by a request without one.
    pub request_id: Option<String>,
    /// When the key expires at the latest, on this process's monotonic
    /// clock: the instant taken before the read plus the lifetime the
    /// database gave the row in that read. This instance's wall clock plays
    /// no part, so its skew cannot make an expired key look alive.
    pub deadline: Instant,
}

/// A key as the view `idempotency_key_reads` returns it: every read selects
/// the view's columns (`k.*`), so the read is written once, in the view. A
/// view's columns decode as nullable; [`KeyRow::into_stored`] checks the ones
/// the table requires.
struct KeyRow {
    merchant_id: Option<Uuid>,
    key: Option<String>,
    status: Option<String>,
    request_method: Option<String>,
    request_path: Option<String>,
    fingerprint: Option<Vec<u8>>,
    charge_id: Option<String>,
    refund_id: Option<String>,
    capture_of: Option<String>,
    response_status: Option<i16>,
    response_content_type: Option<String>,
    response_location: Option<String>,
    response_body: Option<Vec<u8>>,
    created_at: Option<DateTime<Utc>>,
    locked_at: Option<DateTime<Utc>>,
    expires_at: Option<DateTime<Utc>>,
    completed_at: Option<DateTime<Utc>>,
    /// Milliseconds from the read to `expires_at`, by the database's clock.
    remaining_ms: Option<f64>,
    request_id: Option<String>,
}

/// A [`KeyRow`] from the record of a `query!` that selects the view's
/// columns next to columns of its own (each such record is a type of its own).
macro_rules! key_row {
    ($row:ident) => {
        KeyRow {
            merchant_id: $row.merchant_id,
            key: $row.key,
            status: $row.status,
            request_method: $row.request_method,
            request_path: $row.request_path,
            fingerprint: $row.fingerprint,
            charge_id: $row.charge_id,
            refund_id: $row.refund_id,
            capture_of: $row.capture_of,
            response_status: $row.response_status,
            response_content_type: $row.response_content_type,
            response_location: $row.response_location,
            response_body: $row.response_body,
            created_at: $row.created_at,
            locked_at: $row.locked_at,
            expires_at: $row.expires_at,
            completed_at: $row.completed_at,
            remaining_ms: $row.remaining_ms,
            request_id: $row.request_id,
        }
    };
}

impl KeyRow {
    /// The key, with its deadline counted from `sent`: an instant taken
    /// before the statement that read the row was sent.
    fn into_stored(self, sent: Instant) -> sqlx::Result<StoredKey> {
        let corrupt = |what: &str| sqlx::Error::Decode(format!("idempotency_keys.{what}").into());
        let required = |what: &'static str| move || corrupt(what);
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
        let status = self.status.ok_or_else(required("status"))?;
        Ok(StoredKey {
            merchant_id: self.merchant_id.ok_or_else(required("merchant_id"))?,
            key: self.key.ok_or_else(required("key"))?,
            status: KeyStatus::parse(&status).ok_or_else(required("status"))?,
            request_method: self.request_method.ok_or_else(required("request_method"))?,
            request_path: self.request_path.ok_or_else(required("request_path"))?,
            fingerprint: Fingerprint::from_slice(&self.fingerprint.unwrap_or_default())
                .ok_or_else(required("fingerprint"))?,
            resource: Resource::from_columns(self.charge_id, self.refund_id, self.capture_of),
            response,
            created_at: self.created_at.ok_or_else(required("created_at"))?,
            locked_at: self.locked_at,
            expires_at: self.expires_at.ok_or_else(required("expires_at"))?,
            completed_at: self.completed_at,
            request_id: self.request_id,
            deadline: deadline(sent, self.remaining_ms.ok_or_else(required("expires_at"))?),
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

/// What a request asks to claim.
#[derive(Debug)]
pub struct Claim<'a> {
    pub merchant_id: Uuid,
    pub key: &'a IdempotencyKey,
    pub method: &'a str,
    pub path: &'a str,
    pub fingerprint: Fingerprint,
    /// The claiming request's `X-Request-Id`, recorded with the key.
    pub request_id: Option<&'a str>,
    /// The business record written in the same transaction, when the key
    /// guards one that recovery may have to settle. A record written and
    /// answered in the claim's own transaction (a webhook endpoint) needs
    /// none: its key is never left `processing`.
    pub resource: Option<&'a Resource>,
    pub ttl: Duration,
    /// When the claiming request arrived (see [`claim`]).
    pub arrived: Instant,
    /// When it is answered `503 request_timeout` at the latest (see [`claim`]).
    pub deadline: Instant,
}

impl Claim<'_> {
    /// How long ago the request arrived, in milliseconds, just before the
    /// statement is sent: the statement subtracts it from
    /// `statement_timestamp()`, so the takeover rule compares two readings
    /// of the database's clock (a delay on the wire, bounded by the
    /// deadline, makes the request look younger).
    fn age_ms(&self) -> f64 {
        self.arrived.elapsed().as_secs_f64() * 1000.0
    }

    /// The request's deadline on this instance's wall clock, read just
    /// before the statement is sent, which compares it with
    /// `statement_timestamp()`. Clocks agree within the server's
    /// `config::MAX_CLOCK_SKEW`, and keys outlive the deadline plus that.
    fn deadline_at(&self) -> DateTime<Utc> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        Utc::now() + chrono::TimeDelta::from_std(left).unwrap_or(chrono::TimeDelta::MAX)
    }
}

/// What a claim's statement did.
#[derive(Debug)]
pub enum ClaimOutcome {
    /// This request holds the key now.
    Claimed {
        /// The key existed, had expired, and was taken over (`xmax <> 0`:
        /// the row was updated, not inserted).
        took_over: bool,
        /// When the statement wrote the pending record with the claim
        /// ([`claim_with_charge`]): the record's `created_at`.
        created_at: Option<DateTime<Utc>>,
    },
    /// Someone else holds, or held, the key: its row as the statement saw
    /// it; `None` when a request with the same key committed its claim
    /// while this one ran (the caller looks again).
    Taken(Option<Box<StoredKey>>),
    /// The statement reached the database after the request's deadline:
    /// nothing was claimed or written.
    TooLate,
}

/// Claims a key in one statement, the claim every request makes
/// (`idempotency_key_claim`): insert it, or take over an existing row where
/// the takeover rule (`idempotency_key_takeover`) allows: an expired key
/// whose answer was saved before the claiming request arrived. A row still
/// `processing` is settled first (sweeper or stale retry).
///
/// And the claim takes effect only if the statement reaches the database
/// before the request's deadline. A request answered `503` may have been
/// retried, and the retry's answer may expire (or be swept) while this
/// statement is still on the wire; arriving in time, it cannot find that
/// answer expired, because keys outlive the deadline. When no claim
/// happens, the conflicting row is locked by the statement and read in the
/// same transaction, so the answer is built from a committed, current row.
pub async fn claim(tx: &mut PgConnection, claim: Claim<'_>) -> sqlx::Result<ClaimOutcome> {
    let (charge_id, refund_id, capture_of) = Resource::columns(claim.resource);
    let claimed = sqlx::query_scalar!(
        r#"SELECT took_over AS "took_over!"
             FROM idempotency_key_claim($1, $2, $3, $4, $5, $6, $7, $8::float8, $9,
                                        $10::float8, true, $11, $12) AS claimed(took_over)"#,
        claim.merchant_id,
        claim.key.as_str(),
        claim.method,
        claim.path,
        &claim.fingerprint.0[..],
        charge_id,
        refund_id,
        claim.ttl.as_millis() as f64,
        claim.deadline_at(),
        claim.age_ms(),
        claim.request_id,
        capture_of,
    )
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(took_over) = claimed {
        return Ok(ClaimOutcome::Claimed {
            took_over,
            created_at: None,
        });
    }
    // No row means no conflict, so the insert itself was refused: too late.
    // So is a read that reaches the database after the deadline.
    let sent = Instant::now();
    let row = sqlx::query_as!(
        KeyRow,
        "SELECT k.* FROM idempotency_key_reads k
          WHERE k.merchant_id = $1 AND k.key = $2 AND statement_timestamp() < $3",
        claim.merchant_id,
        claim.key.as_str(),
        claim.deadline_at(),
    )
    .fetch_optional(&mut *tx)
    .await?;
    match row {
        Some(row) => Ok(ClaimOutcome::Taken(Some(Box::new(row.into_stored(sent)?)))),
        None => Ok(ClaimOutcome::TooLate),
    }
}

/// The pending charge a claim writes with it, as its columns.
#[derive(Debug)]
pub struct PendingCharge<'a> {
    pub id: &'a str,
    pub amount: i64,
    pub currency: &'a str,
    pub source: &'a str,
    pub description: Option<&'a str>,
    /// `metadata`, as JSON text.
    pub metadata: &'a str,
    /// Its details, as JSON text (`NewCharge::details`); `None` when it has none.
    pub details: Option<&'a str>,
    /// Made with `capture=false`.
    pub capture_later: bool,
}

/// Step 2 of a new charge in one statement, its own transaction: reads the
/// key; if there is none, or only one the takeover rule lets it take over,
/// claims it (the same `idempotency_key_claim` as [`claim`], in time as
/// there) and writes the pending charge from the claim's result, so the
/// charge exists exactly when the claim does. A key it may not take over is
/// only read, without a lock (the claim is not even tried, so the conflict
/// locks nothing), as the fast path of a replay reads it.
pub async fn claim_with_charge(
    db: impl PgExecutor<'_>,
    claim: &Claim<'_>,
    charge: &PendingCharge<'_>,
) -> sqlx::Result<ClaimOutcome> {
    let sent = Instant::now();
    let row = sqlx::query!(
        r#"WITH existing AS (
               SELECT k.* FROM idempotency_key_reads k WHERE k.merchant_id = $1 AND k.key = $2),
           claimed AS (
               SELECT took_over
                 FROM idempotency_key_claim(
                          $1, $2, $3, $4, $5, $6, NULL, $7::float8, $13, $14::float8,
                          NOT EXISTS (SELECT 1 FROM existing e
                                       WHERE NOT idempotency_key_takeover(
                                                 e.status, e.expires_at, e.completed_at,
                                                 $14::float8)), $15, NULL) AS c(took_over)),
           charge AS (
               INSERT INTO charges (id, merchant_id, amount, currency, source, description,
                                    metadata, status, receipt_email, statement_descriptor,
                                    statement_descriptor_suffix, shipping, transfer_group, capture_later)
               SELECT $6, $1, $8, $9, $10, $11, $12::text::jsonb, 'pending',
                      d->>'receipt_email', d->>'statement_descriptor',
                      d->>'statement_descriptor_suffix', NULLIF(d->'shipping', 'null'::jsonb),
                      d->>'transfer_group', $17
                 FROM claimed, (SELECT $16::text::jsonb AS d) AS details
               RETURNING created_at)
           SELECT statement_timestamp() < $13 AS "in_time!",
                  (SELECT took_over FROM claimed) AS took_over,
                  (SELECT created_at FROM charge) AS charge_created_at,
                  e.*
             FROM (SELECT 1) AS one LEFT JOIN existing e ON true"#,
        claim.merchant_id,
        claim.key.as_str(),
        claim.method,
        claim.path,
        &claim.fingerprint.0[..],
        charge.id,
        claim.ttl.as_millis() as f64,
        charge.amount,
        charge.currency,
        charge.source,
        charge.description,
        charge.metadata,
        claim.deadline_at(),
        claim.age_ms(),
        claim.request_id,
        charge.details,
        charge.capture_later,
    )
    .fetch_one(db)
    .await?;
    if !row.in_time {
        return Ok(ClaimOutcome::TooLate);
    }
    if let (Some(took_over), Some(created_at)) = (row.took_over, row.charge_created_at) {
        return Ok(ClaimOutcome::Claimed {
            took_over,
            created_at: Some(created_at),
        });
    }
    // An expired completed row the claim could not take over (another
    // request took it first) is as good as gone: look again.
    let existing = Some(key_row!(row)).filter(|row| {
        row.key.is_some()
            && (row.status.as_deref() == Some(KeyStatus::Processing.as_str())
                || row.remaining_ms.is_some_and(|ms| ms > 0.0))
    });
    Ok(ClaimOutcome::Taken(
        existing
            .map(|row| row.into_stored(sent).map(Box::new))
            .transpose()?,
    ))
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
        ttl.as_millis() as f64,
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
/// (`idempotency_key_expired`). A `completed` row never changes until it
/// expires, so reading it needs no transaction and no lock: a replay costs
/// this one statement.
pub async fn find(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
) -> sqlx::Result<Option<StoredKey>> {
    let sent = Instant::now();
    let row = sqlx::query_as!(
        KeyRow,
        "SELECT k.* FROM idempotency_key_reads k
          WHERE k.merchant_id = $1 AND k.key = $2
            AND NOT idempotency_key_expired(k.status, k.expires_at)",
        merchant_id,
        key.as_str(),
    )
    .fetch_optional(db)
    .await?;
    row.map(|row| row.into_stored(sent)).transpose()
}

/// The keys `asked` (merchant and key, in order) as [`find`] reads each, in
/// one statement: the position in `asked` of each key found, with its row.
/// Every deadline counts from `sent`, an instant taken before it is sent.
pub async fn find_many(
    db: impl PgExecutor<'_>,
    merchants: &[Uuid],
    keys: &[&str],
) -> sqlx::Result<Vec<(usize, StoredKey)>> {
    let sent = Instant::now();
    let rows = sqlx::query!(
        r#"SELECT a.i AS "i!", k.*
             FROM unnest($1::uuid[], $2::text[]) WITH ORDINALITY AS a(merchant_id, key, i)
             JOIN idempotency_key_reads k ON k.merchant_id = a.merchant_id AND k.key = a.key
            WHERE NOT idempotency_key_expired(k.status, k.expires_at)"#,
        merchants,
        keys as &[&str],
    )
    .fetch_all(db)
    .await?;
    rows.into_iter()
        .map(|row| {
            let at = usize::try_from(row.i - 1)
                .map_err(|_| sqlx::Error::Decode("unnest ordinality".into()))?;
            let stored = key_row!(row).into_stored(sent)?;
            Ok((at, stored))
        })
        .collect()
}

/// A merchant's key as a waiter sees it, and whether it is stale (still
/// `processing` after `timeout`): one plain read, no transaction, no lock,
/// which finds what [`find`] finds.
pub async fn watch(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    timeout: Duration,
) -> sqlx::Result<Option<(StoredKey, bool)>> {
    let sent = Instant::now();
    let row = sqlx::query!(
        r#"SELECT k.*,
                  k.status = 'processing'
                      AND k.locked_at < now() - $3::float8 * interval '1 millisecond' AS "stale!"
             FROM idempotency_key_reads k
            WHERE k.merchant_id = $1 AND k.key = $2
              AND NOT idempotency_key_expired(k.status, k.expires_at)"#,
        merchant_id,
        key.as_str(),
        timeout.as_millis() as f64,
    )
    .fetch_optional(db)
    .await?;
    row.map(|row| {
        let stale = row.stale;
        Ok((key_row!(row).into_stored(sent)?, stale))
    })
    .transpose()
}

/// A stale key taken on by one sweeper: the record it guards, and the
/// `locked_at` the lease wrote, which is the lease's token.
#[derive(Clone, Debug)]
pub struct Lease {
    pub resource: Resource,
    leased_at: DateTime<Utc>,
}

/// Leases up to `limit` keys stuck in `processing` for longer than `timeout`.
/// Taking the lease moves `locked_at` to now, so another sweeper skips these
/// rows (`SKIP LOCKED` while the statement runs, the fresh `locked_at`
/// afterwards) for another `timeout`. A sweeper works through its batch one
/// record at a time, so it renews each lease ([`renew`]) just before it
/// recovers that record.
pub async fn lease_stale(
    db: impl PgExecutor<'_>,
    timeout: Duration,
    limit: i64,
) -> sqlx::Result<Vec<Lease>> {
    let rows = sqlx::query!(
        r#"UPDATE idempotency_keys k SET locked_at = now()
           FROM (SELECT merchant_id, key FROM idempotency_keys
                  WHERE status = 'processing'
                    AND locked_at < now() - $1::float8 * interval '1 millisecond'
                  ORDER BY locked_at
                  LIMIT $2
                  FOR UPDATE SKIP LOCKED) stale
          WHERE k.merchant_id = stale.merchant_id AND k.key = stale.key
          RETURNING k.charge_id, k.refund_id, k.capture_of, k.locked_at AS "locked_at!""#,
        timeout.as_millis() as f64,
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

/// Leases one key if it has been `processing` for longer than `timeout`,
/// returning the id of the record it guards; `None` when it is fresh, done,
/// or someone else just leased it. Used by a retry that finds its key stuck.
pub async fn lease_one(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    key: &IdempotencyKey,
    timeout: Duration,
) -> sqlx::Result<Option<Resource>> {
    let leased = sqlx::query!(
        "UPDATE idempotency_keys SET locked_at = now()
          WHERE merchant_id = $1 AND key = $2 AND status = 'processing'
            AND locked_at < now() - $3::float8 * interval '1 millisecond'
          RETURNING charge_id, refund_id, capture_of",
        merchant_id,
        key.as_str(),
        timeout.as_millis() as f64,
    )
    .fetch_optional(db)
    .await?;
    Ok(leased.and_then(|row| Resource::from_columns(row.charge_id, row.refund_id, row.capture_of)))
}

/// The response saved on the completed key that guards `resource`, if any.
pub async fn saved_for_resource(
    db: impl PgExecutor<'_>,
    resource: &Resource,
) -> sqlx::Result<Option<SavedResponse>> {
    let (charge_id, refund_id, capture_of) = Resource::columns(Some(resource));
    let sent = Instant::now();
    let row = sqlx::query_as!(
        KeyRow,
        "SELECT k.* FROM idempotency_key_reads k
          WHERE (k.charge_id = $1 OR k.refund_id = $2 OR k.capture_of = $3)
            AND k.status = 'completed'",
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
