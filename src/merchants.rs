//! Merchants and their secret API keys.
//!
//! A key is `sk_test_` followed by 32 or more letters and digits. Only its
//! SHA-256 is stored: the keys are long random strings, so a fast hash is as
//! strong as a slow one here, and it lets a request be authenticated with one
//! indexed lookup.
//!
//! A key can be rolled ([`roll_key`]): the merchant gets a new key, and the
//! one it replaces keeps working beside it until it expires (at once by
//! default). So a merchant holds at most two live keys: the one in use and
//! the one before it. Both name the same merchant, so charges and
//! idempotency keys (which belong to the merchant, not to an API key) carry
//! over from one to the other.
//!
//! A key hash names one merchant for good: `merchant_keys` keeps every hash
//! a merchant has held, in use, previous or rolled away, under a primary
//! key, so no merchant is ever made with, or given, a key another held, and
//! a key rolled away is never revived (see [`ensure`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;
use rand::distr::Alphanumeric;
use sha2::{Digest, Sha256};
use sqlx::PgExecutor;
use uuid::Uuid;

const PREFIX: &str = "sk_test_";
const MIN_RANDOM_CHARS: usize = 32;

/// A syntactically valid secret API key. Its `Debug` never shows the secret.
#[derive(Clone)]
pub struct ApiKey(String);

impl ApiKey {
    /// Accepts `sk_test_` followed by at least 32 ASCII letters or digits.
    pub fn parse(value: &str) -> Option<Self> {
        let random = value.strip_prefix(PREFIX)?;
        let valid = random.len() >= MIN_RANDOM_CHARS
            && random.len() <= 200
            && random.bytes().all(|b| b.is_ascii_alphanumeric());
        valid.then(|| ApiKey(value.to_owned()))
    }

    /// Makes a new key with 32 random letters and digits.
    pub fn generate() -> Self {
        let random: String = rand::rng()
            .sample_iter(&Alphanumeric)
            .take(MIN_RANDOM_CHARS)
            .map(char::from)
            .collect();
        ApiKey(format!("{PREFIX}{random}"))
    }

    /// The secret itself, to show the merchant once.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The SHA-256 of the key, as stored.
    pub fn hash(&self) -> Vec<u8> {
        Sha256::digest(self.0.as_bytes()).to_vec()
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(sk_test_***)")
    }
}

/// An authenticated merchant.
#[derive(Clone, Debug)]
pub struct Merchant {
    pub id: Uuid,
    pub name: String,
}

impl Merchant {
    /// The merchant from its row's `id` and `name`.
    fn from_row(id: Uuid, name: String) -> Self {
        Merchant { id, name }
    }
}

/// Creates a merchant with a new key and returns both.
pub async fn create(db: impl PgExecutor<'_>, name: &str) -> sqlx::Result<(Merchant, ApiKey)> {
    let key = ApiKey::generate();
    let merchant = sqlx::query_as!(
        Merchant,
        "INSERT INTO merchants (id, name, api_key_hash) VALUES ($1, $2, $3) RETURNING id, name",
        Uuid::now_v7(),
        name,
        key.hash(),
    )
    .fetch_one(db)
    .await?;
    Ok((merchant, key))
}

/// What [`ensure`] found a key to be.
#[derive(Clone, Debug)]
pub enum Ensured {
    /// The merchant's key in use, the merchant made now or before.
    InUse(Merchant),
    /// A key the merchant held and rolled away: it names this merchant,
    /// which holds a newer key, and works until `works_until` if that is
    /// set (a previous key not yet expired), else not at all.
    RolledAway {
        merchant: Merchant,
        works_until: Option<DateTime<Utc>>,
    },
}

impl Ensured {
    /// The merchant the key names.
    pub fn merchant(&self) -> &Merchant {
        match self {
            Ensured::InUse(merchant) | Ensured::RolledAway { merchant, .. } => merchant,
        }
    }
}

/// Makes sure the merchant `key` names exists: made, named `name`, if the
/// key was never any merchant's; found if it was, and then never made
/// twice nor its key revived, even if the key was rolled away. Safe to run
/// any number of times, from any number of processes at once: the key
/// hash's one owner in `merchant_keys` decides, and the loser of a race
/// simply reads the winner.
pub async fn ensure(
    db: impl PgExecutor<'_> + Copy,
    name: &str,
    key: &ApiKey,
) -> sqlx::Result<Ensured> {
    let hash = key.hash();
    let made = sqlx::query!(
        "INSERT INTO merchants (id, name, api_key_hash)
         SELECT $1, $2, $3 WHERE NOT EXISTS (SELECT 1 FROM merchant_keys WHERE hash = $3)
         ON CONFLICT (api_key_hash) DO NOTHING",
        Uuid::now_v7(),
        name,
        hash,
    )
    .execute(db)
    .await;
    match made {
        // The hash was claimed since the statement's snapshot: read whose.
        Err(sqlx::Error::Database(e)) if e.constraint() == Some("merchant_keys_pkey") => {}
        made => {
            made?;
        }
    }
    let row = sqlx::query!(
        r#"SELECT m.id, m.name, m.api_key_hash = k.hash AS "in_use!",
                  CASE WHEN m.previous_key_hash = k.hash
                        AND m.previous_key_expires_at > clock_timestamp()
                       THEN m.previous_key_expires_at END AS works_until
             FROM merchant_keys k JOIN merchants m ON m.id = k.merchant_id
            WHERE k.hash = $1"#,
        hash,
    )
    .fetch_optional(db)
    .await?
    .ok_or(sqlx::Error::RowNotFound)?;
    let merchant = Merchant::from_row(row.id, row.name);
    Ok(match row.in_use {
        true => Ensured::InUse(merchant),
        false => Ensured::RolledAway {
            merchant,
            works_until: row.works_until,
        },
    })
}

/// The merchant owning `key`, if any, its key in use or a previous one
/// not yet expired.
pub async fn find_by_key(db: impl PgExecutor<'_>, key: &ApiKey) -> sqlx::Result<Option<Merchant>> {
    Ok(authenticate(db, key).await?.map(|found| found.merchant))
}

/// A merchant found by one of its keys.
#[derive(Clone, Debug)]
pub struct KeyHolder {
    pub merchant: Merchant,
    /// How long the key has left, by the database's clock: `None` for the
    /// key in use, which does not expire; a duration for a previous key.
    pub expires_in: Option<Duration>,
}

/// The merchant `key` belongs to, if it is the merchant's key in use or a
/// previous key not yet expired. The key in use is looked up first, and a
/// previous key only when that finds nothing (`LIMIT 1` stops the `UNION
/// ALL` at the first row): an authenticated request costs one lookup in a
/// unique index, as with one key per merchant.
pub async fn authenticate(
    db: impl PgExecutor<'_>,
    key: &ApiKey,
) -> sqlx::Result<Option<KeyHolder>> {
    let hash = key.hash();
    let row = sqlx::query!(
        r#"SELECT id AS "id!", name AS "name!", expires_in_ms
             FROM (SELECT id, name, NULL::float8 AS expires_in_ms
                     FROM merchants WHERE api_key_hash = $1
                   UNION ALL
                   SELECT id, name,
                          EXTRACT(EPOCH FROM previous_key_expires_at - clock_timestamp())::float8 * 1000
                     FROM merchants
                    WHERE previous_key_hash = $1 AND previous_key_expires_at > clock_timestamp()
                   LIMIT 1) found"#,
        hash,
    )
    .fetch_optional(db)
    .await?;
    Ok(row.map(|row| KeyHolder {
        merchant: Merchant::from_row(row.id, row.name),
        expires_in: row
            .expires_in_ms
            .map(|ms| Duration::from_millis(ms.max(0.0) as u64)),
    }))
}

/// The longest a rolled key may keep working.
pub const MAX_EXPIRE_OLD_IN: Duration = Duration::from_secs(7 * 24 * 3600);

/// What [`roll_key`] did.
#[derive(Debug)]
pub struct Rolled {
    pub merchant: Merchant,
    /// The new key, to show once.
    pub key: ApiKey,
    /// When the key it replaced stops working.
    pub old_key_expires_at: DateTime<Utc>,
    /// When a key older still was live (two keys were), it expired now.
    pub expired_older: bool,
}

/// Gives the merchant `id` a new key; the key in use until now keeps working
/// for `expire_old_in` (zero: it stops at once). A merchant holds at most
/// two live keys: if the key before the one replaced is still live, it
/// expires now, so a leaked key can always be replaced at once. `None` if
/// there is no such merchant. One statement, so two rolls at once are
/// applied one after the other.
pub async fn roll_key(
    db: impl PgExecutor<'_>,
    id: Uuid,
    expire_old_in: Duration,
) -> sqlx::Result<Option<Rolled>> {
    let key = ApiKey::generate();
    let row = sqlx::query!(
        r#"WITH old AS (
               SELECT id, previous_key_expires_at FROM merchants WHERE id = $1 FOR UPDATE
           )
           UPDATE merchants m
              SET previous_key_hash = m.api_key_hash,
                  previous_key_expires_at = clock_timestamp() + make_interval(secs => $2),
                  api_key_hash = $3
             FROM old
            WHERE m.id = old.id
        RETURNING m.id, m.name, m.previous_key_expires_at AS "old_key_expires_at!",
                  coalesce(old.previous_key_expires_at > clock_timestamp(), false) AS "expired_older!""#,
        id,
        expire_old_in.as_secs_f64(),
        key.hash(),
    )
    .fetch_optional(db)
    .await?;
    Ok(row.map(|row| Rolled {
        merchant: Merchant::from_row(row.id, row.name),
        key,
        old_key_expires_at: row.old_key_expires_at,
        expired_older: row.expired_older,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_parse_and_are_distinct() {
        let a = ApiKey::generate();
        let b = ApiKey::generate();
        assert!(ApiKey::parse(a.expose()).is_some());
        assert_ne!(a.expose(), b.expose());
    }

    #[test]
    fn short_or_foreign_keys_are_refused() {
        assert!(ApiKey::parse("sk_test_short").is_none());
        assert!(ApiKey::parse(&format!("sk_live_{}", "a".repeat(32))).is_none());
        assert!(ApiKey::parse(&format!("sk_test_{}!", "a".repeat(32))).is_none());
    }

    #[test]
    fn debug_output_hides_the_secret() {
        let key = ApiKey::generate();
        assert!(!format!("{key:?}").contains(&key.expose()[8..]));
    }
}
