//! Connection pools on a Postgres URL that may name several hosts (a
//! primary and its standbys), following the primary when it moves. Shared
//! by both systems, oncepay ([`crate::db`]) and the card gateway
//! ([`crate::gateway`]), each with a database of its own; it knows neither.
//!
//! A URL with one host gives a pool exactly as sqlx makes it (with
//! `target_session_attrs=read-write`, a new connection to a read-only
//! server is also refused). A URL with several hosts gives a pool that
//! starts on the first and a [`Primary`] that moves it to the host that
//! serves (see [`follow`]).

pub mod follow;
pub mod url;

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

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
    /// How often the host in use is asked whether it still serves.
    pub check_interval: Duration,
}

impl Settings {
    /// The longest one host may take to accept a connection and answer, when
    /// the hosts are tried in turn: `acquire_timeout`, at most 2 s, so that a
    /// host that swallows packets does not hold the others up for long.
    pub fn connect_timeout(&self) -> Duration {
        self.acquire_timeout.min(Duration::from_secs(2))
    }
}

/// A pool on `url`, made lazily (nothing is connected yet), without a ping
/// before each checkout; and, when `url` names several hosts, the
/// [`Primary`] that follows the host that serves, already at work in a task
/// of its own (so call this inside a Tokio runtime). The task ends once the
/// pool is closed.
pub fn pool(url: &PgUrl, settings: &Settings) -> (PgPool, Option<Primary>) {
    let url = url.clone().with_default_application_name(settings.name);
    let target = url.target();
    let hosts = url.hosts().to_vec();
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
    if let Some(primary) = &primary {
        tokio::spawn(primary.clone().follow(pool.clone()));
    }
    (pool, primary)
}
