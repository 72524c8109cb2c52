//! The card gateway: a system of its own, reached only over HTTP.
//!
//! `oncepay processor` runs it (or `oncepay serve` embeds it on a loopback
//! port when no `PROCESSOR_URL` is set): its own configuration
//! ([`config`], `PROCESSOR_*`), its own database and migrations
//! (`migrations/` beside this crate), its own HTTP API ([`http`]), its own
//! callers ([`accounts`]: every call is made for an account, by its secret
//! key, and sees that account's ledger only). It authorizes payments, voids
//! attempts whose answer was lost, refunds, and lists an account's ledger,
//! each idempotent on the caller's `Idempotency-Key`, deciding
//! outcomes from the test card tokens ([`test_cards`]). Besides that table
//! it shares only [`pg_follow`], the connection pools that follow a primary,
//! with oncepay: two libraries of the workspace that know neither system.
//! It depends on no crate of oncepay's, and oncepay's domain imports nothing
//! of it: oncepay's `HttpProcessor` speaks its API. Only oncepay's binary
//! starts it (`oncepay processor`, or embedded in `serve`).

pub mod accounts;
pub mod config;
pub mod domain;
pub mod http;
pub mod store;

use std::net::SocketAddr;

use anyhow::Context;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::net::TcpListener;

use pg_follow::{self as postgres, PgUrl};

pub use config::Config;
use domain::Ledger;
use http::GatewayState;

/// The gateway's migrations, under `migrations/` beside this crate.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// A bound gateway, its database migrated.
pub struct Gateway {
    listener: TcpListener,
    state: GatewayState,
}

impl Gateway {
    /// Creates the gateway's database if it is missing, migrates it, and
    /// binds `PROCESSOR_BIND_ADDR:PROCESSOR_PORT`.
    pub async fn build(config: Config) -> anyhow::Result<Self> {
        let pool = connect(&config).await?;
        Self::build_with_pool(config, pool).await
    }

    /// [`Gateway::build`] on a pool of the caller's.
    pub async fn build_with_pool(config: Config, pool: PgPool) -> anyhow::Result<Self> {
        migrate(&pool).await?;
        if config.fault_injection {
            tracing::warn!(
                "PROCESSOR_FAULT_INJECTION=true: requests may drop, stall or crash the processor on purpose"
            );
        }
        let listener = TcpListener::bind((config.bind_addr, config.port))
            .await
            .with_context(|| {
                format!(
                    "binding the processor to {}:{}",
                    config.bind_addr, config.port
                )
            })?;
        let ledger = Ledger {
            pool,
            latency: config.latency,
        };
        Ok(Gateway {
            listener,
            state: GatewayState::new(ledger, config.fault_injection, config.fault_delay),
        })
    }

    /// The account `name`, made unless it exists, and a new secret key of
    /// it: for the one who runs this gateway and calls it too (oncepay's
    /// embedded gateway).
    pub async fn own_account(&self, name: &str) -> anyhow::Result<accounts::Secret> {
        let (account, secret) = accounts::ensure(self.pool(), name)
            .await
            .with_context(|| format!("making the processor account {name:?}"))?;
        tracing::info!(account = %account, name, "processor account ready, with a new key");
        Ok(secret)
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The base URL callers use, `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr())
    }

    /// The ledger's pool.
    pub fn pool(&self) -> &PgPool {
        &self.state.ledger.pool
    }

    /// Serves until `shutdown` resolves, then finishes requests in flight.
    pub async fn run_until_stopped(self, shutdown: impl std::future::Future<Output = ()>) {
        tracing::info!(addr = %self.local_addr(), "processor listening");
        let pool = self.state.ledger.pool.clone();
        http::serve(self.listener, http::router(self.state), shutdown).await;
        pool.close().await;
        tracing::info!("processor stopped");
    }
}

/// Creates the database `PROCESSOR_DATABASE_URL` names if it is missing,
/// and a pool on it that follows its primary, once a connection is made.
pub async fn connect(config: &Config) -> anyhow::Result<PgPool> {
    create_database_if_missing(&config.database_url)
        .await
        .with_context(|| {
            format!(
                "creating the processor's database at PROCESSOR_DATABASE_URL={}",
                config.redacted_database_url()
            )
        })?;
    let url = PgUrl::parse(&config.database_url).with_context(|| {
        format!(
            "invalid PROCESSOR_DATABASE_URL {}",
            config.redacted_database_url()
        )
    })?;
    let settings = postgres::Settings {
        name: "oncepay-processor",
        max_connections: config.database_max_connections,
        acquire_timeout: DATABASE_ACQUIRE_TIMEOUT,
        check_interval: DATABASE_PRIMARY_CHECK_INTERVAL,
        statement_timeout: DATABASE_STATEMENT_TIMEOUT,
    };
    // No ping before every checkout, as in oncepay's pool: one round
    // trip per call saved (measured by scripts/bench). A connection the
    // database dropped fails its statement instead and is discarded; the
    // call answers 500 (outcome unknown) and the caller repeats it under
    // the same key. With several hosts, the pool follows the primary.
    let (pool, primary) = postgres::pool(&url, &settings);
    let reachable = match &primary {
        Some(primary) => primary.wait_known(DATABASE_ACQUIRE_TIMEOUT).await,
        None => true,
    };
    let connected = if reachable {
        pool.acquire().await.map(drop).map_err(anyhow::Error::new)
    } else {
        Err(anyhow::anyhow!("no host is writable"))
    };
    connected.with_context(|| {
        format!(
            "connecting to the processor's database at PROCESSOR_DATABASE_URL={}",
            config.redacted_database_url()
        )
    })?;
    Ok(pool)
}

/// Applies the gateway's migrations.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    postgres::migrate(pool, &MIGRATOR)
        .await
        .context("applying the processor's migrations")
}

/// `oncepay processor accounts create`: makes the account `name` in the
/// ledger's database (created and migrated if need be) and returns its
/// first secret key.
pub async fn create_account(config: &Config, name: &str) -> anyhow::Result<accounts::Secret> {
    let pool = connect(config).await?;
    migrate(&pool).await?;
    let (account, secret) = accounts::create(&pool, name)
        .await
        .with_context(|| format!("creating the processor account {name:?}"))?;
    tracing::info!(account = %account, name, "processor account created");
    pool.close().await;
    Ok(secret)
}

/// How long a call waits for a ledger connection (sqlx's default), and how
/// long the gateway waits at start for a writable host of its URL.
const DATABASE_ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// With several hosts in `PROCESSOR_DATABASE_URL`, how often the host in
/// use is asked whether it is still the primary (as oncepay's default).
const DATABASE_PRIMARY_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// The longest a ledger statement may go unanswered, as oncepay's default:
/// cancelled by a live server, cut on a silent host (see
/// [`pg_follow::liveness`]); at least the check interval plus the
/// check's timeout (2 s here).
const DATABASE_STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Creates the database `url` names, unless it exists (several processes
/// may race: a duplicate creation is fine). With several hosts, on the
/// first writable one.
pub async fn create_database_if_missing(url: &str) -> anyhow::Result<()> {
    let url = PgUrl::parse(url)?;
    let options = writable_host(&url).await?;
    let name = options
        .get_database()
        .context("the URL names no database")?
        .to_owned();
    let mut admin = options.database("postgres").connect().await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut admin)
            .await?;
    if !exists {
        let quoted = format!("\"{}\"", name.replace('"', "\"\""));
        match sqlx::query(&format!("CREATE DATABASE {quoted}"))
            .execute(&mut admin)
            .await
        {
            Ok(_) => tracing::info!(database = %name, "created the processor's database"),
            // 42P04: created meanwhile by another process.
            Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("42P04") => {}
            Err(e) => return Err(e.into()),
        }
    }
    admin.close().await?;
    Ok(())
}

/// The options of `url`'s only host, or of the first of its hosts that
/// takes writes.
async fn writable_host(url: &PgUrl) -> anyhow::Result<PgConnectOptions> {
    if !url.is_multi_host() {
        return Ok(url.hosts()[0].options.clone());
    }
    for host in url.hosts() {
        let admin = host.options.clone().database("postgres");
        let Ok(Ok(mut conn)) =
            tokio::time::timeout(std::time::Duration::from_secs(2), admin.connect()).await
        else {
            continue;
        };
        let writable = postgres::follow::serves(&mut conn, postgres::Target::ReadWrite).await;
        let _ = conn.close().await;
        if writable.unwrap_or(false) {
            return Ok(host.options.clone());
        }
    }
    anyhow::bail!("no host of the URL accepts a connection and takes writes")
}
