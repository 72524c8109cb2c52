//! Connection pools on a Postgres URL that may name several hosts (a
//! primary and its standbys), following the primary when it moves. A library
//! both systems use, oncepay (its `db` module) and the card gateway
//! (crates/card-gateway), each with a database of its own; it knows neither.
//!
//! A URL with one host gives a pool exactly as sqlx makes it (with
//! `target_session_attrs=read-write`, a new connection to a read-only
//! server is also refused). A URL with several hosts gives a pool that
//! starts on the first and a [`Primary`] that moves it to the host that
//! serves (see [`follow`]).
//!
//! Either way no statement waits longer than the pool's statement timeout:
//! a live server cancels it, and every connection to a host that went
//! silent is cut (see [`liveness`]).

pub mod follow;
pub mod liveness;
pub mod url;

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};

pub use follow::Primary;
pub use url::{Host, PgUrl, Target, UrlError, redact};

/// How a pool on a [`PgUrl`] is made and followed.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The pool's name in logs and metrics, and each connection's
    /// `application_name` unless the URL gives one.
    pub name: &'static str,
    pub max_connections: u32,
    pub acquire_timeout: Duration,
    /// How often the host in use is asked whether it still serves (and,
    /// with one host, whether it still answers).
    pub check_interval: Duration,
    /// The longest a statement may go unanswered: the server's
    /// `statement_timeout`, and at least `check_interval` plus
    /// [`Settings::connect_timeout`], within which a silent host's
    /// connections are cut.
    pub statement_timeout: Duration,
}

impl Settings {
    /// The longest one host may take to accept a connection and answer, when
    /// the hosts are tried in turn: `acquire_timeout`, at most 2 s, so that a
    /// host that swallows packets does not hold the others up for long.
    pub fn connect_timeout(&self) -> Duration {
        self.acquire_timeout.min(Duration::from_secs(2))
    }

    /// How long after a host goes silent every connection to it is cut, at
    /// the latest: a check interval, then a check that times out.
    pub fn silence_bound(&self) -> Duration {
        self.check_interval + self.connect_timeout()
    }
}

/// A pool on `url`, made lazily (nothing is connected yet), without a ping
/// before each checkout; and, when `url` names several hosts, the
/// [`Primary`] that follows the host that serves, already at work in a task
/// of its own (so call this inside a Tokio runtime); with one host, the
/// [`liveness::watch`] on it instead. The task ends once the pool is closed.
pub fn pool(url: &PgUrl, settings: &Settings) -> (PgPool, Option<Primary>) {
    let url = url.clone().with_default_application_name(settings.name);
    let target = url.target();
    // Sent with the startup message: no round trip.
    let statement_timeout = settings.statement_timeout.as_millis().to_string();
    let hosts: Vec<Host> = url
        .hosts()
        .iter()
        .map(|host| Host {
            label: host.label.clone(),
            options: host
                .options
                .clone()
                .options([("statement_timeout", &statement_timeout)]),
        })
        .collect();
    let primary = url.is_multi_host().then(|| {
        Primary::new(
            hosts.clone(),
            target,
            settings.check_interval,
            settings.connect_timeout(),
            settings.name,
        )
    });
    let mut options = PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        // No ping before every checkout (one round trip each time, measured
        // by scripts/bench): a connection the database dropped fails its
        // next query instead, is discarded, and the request answers 503.
        .test_before_acquire(false);
    if target == Target::ReadWrite {
        // One round trip per new connection, none per checkout. A refusal
        // makes the pool try again (reading its options anew, so on the
        // host a re-target chose) until the acquire timeout: a 503.
        let primary = primary.clone();
        options = options.after_connect(move |conn, _| {
            let primary = primary.clone();
            Box::pin(async move {
                if follow::serves(conn, Target::ReadWrite).await? {
                    return Ok(());
                }
                if let Some(primary) = &primary {
                    primary.wake();
                }
                Err(sqlx::Error::Io(std::io::Error::other(
                    "the server is read-only and target_session_attrs=read-write",
                )))
            })
        });
    }
    if let Some(primary) = &primary {
        let primary = primary.clone();
        options = options.before_acquire(move |_, meta| {
            let fresh = !primary.predates_retarget(meta.age);
            Box::pin(async move { Ok(fresh) })
        });
    }
    let pool = options.connect_lazy_with(hosts[0].options.clone());
    match &primary {
        Some(primary) => {
            tokio::spawn(primary.clone().follow(pool.clone()));
        }
        None => {
            tokio::spawn(liveness::watch(
                pool.clone(),
                hosts[0].clone(),
                settings.check_interval,
                settings.connect_timeout(),
                settings.name,
            ));
        }
    }
    (pool, primary)
}

/// Runs `migrator` on a connection of `pool`'s of its own, with no
/// `statement_timeout`: a migration may rightly take longer than any
/// request's statement (an index built, the migration lock waited for
/// while another process migrates). The connection is closed after, so
/// that the setting never reaches a request.
pub async fn migrate(
    pool: &PgPool,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), sqlx::migrate::MigrateError> {
    let mut conn = pool.acquire().await?.detach();
    sqlx::query("SET statement_timeout = 0")
        .execute(&mut conn)
        .await?;
    let migrated = migrator.run(&mut conn).await;
    let _ = conn.close().await;
    migrated
}
