//! Who calls the gateway: an account per caller, and its secret keys.
//!
//! As at a real processor, every call names its account by a secret sent as
//! `Authorization: Bearer <secret>`, and everything it reads, refunds or
//! lists is that account's alone. A secret is `gwsk_<key id>_<32 random
//! letters and digits>`; only its SHA-256 is stored. The key id finds the
//! row, and the hashes are compared in constant time, so a wrong secret
//! takes as long to refuse however much of it is right. Keys are never
//! revoked here, so a secret once verified is remembered (by its hash) and
//! costs no query after that.

use std::sync::Arc;

use rand::Rng;
use rand::distr::Alphanumeric;
use sha2::{Digest, Sha256};
use sqlx::{PgExecutor, PgPool};

const PREFIX: &str = "gwsk_";
const ID_CHARS: usize = 16;
const RANDOM_CHARS: usize = 32;

/// How many verified secrets the gateway remembers.
const VERIFIED_CAPACITY: usize = 1024;

/// A caller's secret key. Its `Debug` never shows the secret.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    fn generate() -> (String, Self) {
        let id = random(ID_CHARS);
        let secret = Secret(format!("{PREFIX}{id}_{}", random(RANDOM_CHARS)));
        (id, secret)
    }

    /// The secret itself, to show its owner once.
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn hash(&self) -> [u8; 32] {
        sha256(&self.0)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(gwsk_***)")
    }
}

/// Why an account was not created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// Names are unique: the caller picks another.
    #[error("an account named {0:?} exists already")]
    NameTaken(String),
    #[error("the gateway's database failed")]
    Database(#[from] sqlx::Error),
}

/// Creates the account `name` with a first key: its id and the secret.
pub async fn create(pool: &PgPool, name: &str) -> Result<(String, Secret), CreateError> {
    let id = format!("acct_{}", random(ID_CHARS));
    let mut tx = pool.begin().await?;
    let inserted = sqlx::query!(
        "INSERT INTO accounts (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        id,
        name,
    )
    .execute(&mut *tx)
    .await?;
    if inserted.rows_affected() == 0 {
        return Err(CreateError::NameTaken(name.to_owned()));
    }
    let secret = add_key(&mut *tx, &id).await?;
    tx.commit().await?;
    Ok((id, secret))
}

/// The account `name`, created unless it exists, with a new key of it: its
/// id and the secret. For a caller that runs the gateway itself (oncepay's
/// embedded gateway) and so needs no secret handed over.
pub async fn ensure(pool: &PgPool, name: &str) -> sqlx::Result<(String, Secret)> {
    sqlx::query!(
        "INSERT INTO accounts (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        format!("acct_{}", random(ID_CHARS)),
        name,
    )
    .execute(pool)
    .await?;
    let id = sqlx::query_scalar!("SELECT id FROM accounts WHERE name = $1", name)
        .fetch_one(pool)
        .await?;
    let secret = add_key(pool, &id).await?;
    Ok((id, secret))
}

/// A new key of `account`.
async fn add_key(db: impl PgExecutor<'_>, account: &str) -> sqlx::Result<Secret> {
    let (id, secret) = Secret::generate();
    sqlx::query!(
        "INSERT INTO api_keys (id, account, hash) VALUES ($1, $2, $3)",
        id,
        account,
        &secret.hash()[..],
    )
    .execute(db)
    .await?;
    Ok(secret)
}

/// Finds the account a presented secret belongs to.
#[derive(Clone)]
pub struct Accounts {
    pool: PgPool,
    /// Secrets verified before, by their hash, and their account.
    verified: Arc<quick_cache::sync::Cache<[u8; 32], String>>,
}

impl std::fmt::Debug for Accounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accounts").finish_non_exhaustive()
    }
}

impl Accounts {
    pub fn new(pool: PgPool) -> Self {
        Accounts {
            pool,
            verified: Arc::new(quick_cache::sync::Cache::new(VERIFIED_CAPACITY)),
        }
    }

    /// The account whose key `presented` is, or `None` for a secret that is
    /// malformed or no key's.
    pub async fn authenticate(&self, presented: &str) -> sqlx::Result<Option<String>> {
        let hash = sha256(presented);
        if let Some(account) = self.verified.get(&hash) {
            return Ok(Some(account));
        }
        let Some(id) = key_id(presented) else {
            return Ok(None);
        };
        let row = sqlx::query!("SELECT account, hash FROM api_keys WHERE id = $1", id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row.filter(|row| constant_time_eq(&row.hash, &hash)) else {
            return Ok(None);
        };
        self.verified.insert(hash, row.account.clone());
        Ok(Some(row.account))
    }
}

/// The key id of a well-formed secret.
fn key_id(secret: &str) -> Option<&str> {
    let (id, random) = secret.strip_prefix(PREFIX)?.split_once('_')?;
    let alphanumeric = |s: &str, n| s.len() == n && s.bytes().all(|b| b.is_ascii_alphanumeric());
    (alphanumeric(id, ID_CHARS) && alphanumeric(random, RANDOM_CHARS)).then_some(id)
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn sha256(value: &str) -> [u8; 32] {
    Sha256::digest(value.as_bytes()).into()
}

fn random(n: usize) -> String {
    rand::rng()
        .sample_iter(&Alphanumeric)
        .take(n)
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_secret_names_its_key_and_a_malformed_one_names_none() {
        let (id, secret) = Secret::generate();
        assert_eq!(key_id(secret.expose()), Some(id.as_str()));
        assert!(!format!("{secret:?}").contains(&id));
        for bad in [
            "",
            "gwsk_",
            "gwsk_abc_def",
            "sk_test_x",
            &secret.0[..secret.0.len() - 1],
        ] {
            assert_eq!(key_id(bad), None, "{bad}");
        }
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
