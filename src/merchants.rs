//! Merchants and their secret API keys.
//!
//! A key is `sk_test_` followed by 32 or more letters and digits. Only its
//! SHA-256 is stored: the keys are long random strings, so a fast hash is as
//! strong as a slow one here, and it lets a request be authenticated with one
//! indexed lookup.

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

/// Makes sure a merchant with this key exists, named `name` if it is created.
/// Safe to run any number of times, from any number of processes at once: the
/// unique key hash decides, and the loser of a race simply reads the winner.
pub async fn ensure(
    db: impl PgExecutor<'_> + Copy,
    name: &str,
    key: &ApiKey,
) -> sqlx::Result<Merchant> {
    sqlx::query!(
        "INSERT INTO merchants (id, name, api_key_hash) VALUES ($1, $2, $3)
         ON CONFLICT (api_key_hash) DO NOTHING",
        Uuid::now_v7(),
        name,
        key.hash(),
    )
    .execute(db)
    .await?;
    find_by_key(db, key).await?.ok_or(sqlx::Error::RowNotFound)
}

/// The merchant owning `key`, if any.
pub async fn find_by_key(db: impl PgExecutor<'_>, key: &ApiKey) -> sqlx::Result<Option<Merchant>> {
    sqlx::query_as!(
        Merchant,
        "SELECT id, name FROM merchants WHERE api_key_hash = $1",
        key.hash(),
    )
    .fetch_optional(db)
    .await
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
