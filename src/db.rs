//! oncepay's database: the connection pool (following the primary when
//! `DATABASE_URL` names several hosts, see [`crate::postgres`]) and the
//! migrations.

use anyhow::Context;
use sqlx::PgPool;

use crate::config::Config;
use pg_follow::{self as postgres, PgUrl, Primary};

/// The migrations under `migrations/`, built into the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The pool, and the watch on the primary when `DATABASE_URL` names
/// several hosts.
#[derive(Clone)]
pub struct Database {
    pub pool: PgPool,
    /// `None` for a URL with one host: nothing to follow.
    pub primary: Option<Primary>,
}

impl From<PgPool> for Database {
    fn from(pool: PgPool) -> Self {
        Database {
            pool,
            primary: None,
        }
    }
}

/// Connects lazily: the server starts even if the database is briefly away,
/// and each request waits at most `DATABASE_ACQUIRE_TIMEOUT` for a
/// connection. With several hosts in `DATABASE_URL`, a task of its own
/// follows the primary (so call this inside a Tokio runtime).
pub fn connect(config: &Config) -> anyhow::Result<Database> {
    let url = PgUrl::parse(&config.database_url)
        .with_context(|| format!("invalid DATABASE_URL {}", config.redacted_database_url()))?;
    let (pool, primary) = postgres::pool(&url, &config.pool_settings());
    Ok(Database { pool, primary })
}

/// [`connect`]'s pool alone (it follows the primary all the same; the
/// [`Database`] also gives the watch `/readyz` consults).
pub fn pool(config: &Config) -> anyhow::Result<PgPool> {
    Ok(connect(config)?.pool)
}

/// Applies pending migrations; safe from several processes at once (sqlx
/// takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    postgres::migrate(pool, &MIGRATOR)
        .await
        .context("applying migrations")
}

/// Waits, at most `DATABASE_ACQUIRE_TIMEOUT`, until the database takes a
/// connection (with several hosts, until one of them is found writable),
/// saying so in the log: a process that cannot reach its database stops
/// with a message naming `DATABASE_URL` (its password redacted) rather than
/// waiting in silence.
pub async fn wait_until_reachable(database: &Database, config: &Config) -> anyhow::Result<()> {
    let url = config.redacted_database_url();
    tracing::info!(database = %url, "waiting for the database");
    let timeout = humantime::format_duration(config.database.acquire_timeout);
    if let Some(primary) = &database.primary {
        if !primary.wait_known(config.database.acquire_timeout).await {
            anyhow::bail!(
                "no host of DATABASE_URL={url} accepted a connection that serves its \
                 target_session_attrs (writable, for read-write) within \
                 DATABASE_ACQUIRE_TIMEOUT ({timeout})"
            );
        }
        tracing::info!(
            host = primary.current_host().unwrap_or_default(),
            "database host chosen"
        );
    }
    match database.pool.acquire().await {
        Ok(_) => Ok(()),
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "cannot reach the database at DATABASE_URL={url} within DATABASE_ACQUIRE_TIMEOUT ({timeout})"
        ))),
    }
}

/// Whether `error` says a table does not exist (the migrations have not run).
pub fn undefined_table(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "42P01")
}

/// Whether `error` is Postgres's "undefined column" (a schema behind the
/// binary: migrations not applied).
pub fn undefined_column(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "42703")
}
