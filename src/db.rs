//! The connection pool and the migrations.

use std::str::FromStr;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::config::Config;

/// The migrations under `migrations/`, built into the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Connects lazily: the server starts even if the database is briefly away,
/// and each request waits at most `DATABASE_ACQUIRE_TIMEOUT` for a connection.
pub fn pool(config: &Config) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(&config.database_url)
        .with_context(|| format!("invalid DATABASE_URL {}", config.redacted_database_url()))?
        .application_name("oncepay");
    Ok(PgPoolOptions::new()
        .max_connections(config.database_max_connections)
        .acquire_timeout(config.database_acquire_timeout)
        // No ping before every checkout (one round trip each time, measured
        // by scripts/bench): a connection the database dropped fails its
        // next query instead, is discarded, and the request answers 503.
        .test_before_acquire(false)
        .connect_lazy_with(options))
}

/// Applies pending migrations; safe from several processes at once (sqlx
/// takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR.run(pool).await.context("applying migrations")
}

/// Waits, at most `DATABASE_ACQUIRE_TIMEOUT`, until the database takes a
/// connection, saying so in the log: a process that cannot reach its
/// database stops with a message naming `DATABASE_URL` (its password
/// redacted) rather than waiting in silence.
pub async fn wait_until_reachable(pool: &PgPool, config: &Config) -> anyhow::Result<()> {
    let url = config.redacted_database_url();
    tracing::info!(database = %url, "waiting for the database");
    match pool.acquire().await {
        Ok(_) => Ok(()),
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "cannot reach the database at DATABASE_URL={url} within DATABASE_ACQUIRE_TIMEOUT ({})",
            humantime::format_duration(config.database_acquire_timeout)
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
