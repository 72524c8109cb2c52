//! Following the primary of a Postgres URL that names several hosts.
//!
//! A background task keeps a connection of its own to the host the pool
//! targets and asks it `SHOW transaction_read_only` every check interval
//! (at once when [`Primary::wake`] is called). When that host is gone, or
//! has become read-only, it tries every host in the URL's order, each
//! within a bounded connect timeout, and re-targets the pool to the first
//! that answers `off` (`Pool::set_connect_options`). The pool's
//! `before_acquire` hook then drops every idle connection opened before the
//! re-target (by its age: no round trip), and its `after_connect` hook
//! refuses a new connection to a read-only server, so a write never runs on
//! a standby. A host that does not answer the check in time is silent:
//! every connection to it is cut first ([`super::liveness`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::sync::{Notify, watch};

use super::liveness;
use super::url::{Host, Target};

/// The shortest time between two checks, however often the task is woken:
/// a burst of failing requests costs one check, not one each.
const MIN_CHECK_GAP: Duration = Duration::from_millis(50);

/// The watch on which host of a URL is the one to use; cheap to clone.
#[derive(Clone)]
pub struct Primary(Arc<Shared>);

struct Shared {
    hosts: Vec<Host>,
    target: Target,
    /// The index of the host known to serve (writable, for a read-write
    /// target); `None` while none is.
    current: watch::Sender<Option<usize>>,
    /// When the pool was last re-targeted, in nanoseconds after `epoch`.
    retargeted: AtomicU64,
    epoch: Instant,
    wake: Notify,
    check_interval: Duration,
    connect_timeout: Duration,
    /// The pool's name in logs and metrics (`oncepay`, `oncepay-processor`).
    name: String,
}

impl Primary {
    pub(super) fn new(
        hosts: Vec<Host>,
        target: Target,
        check_interval: Duration,
        connect_timeout: Duration,
        name: &str,
    ) -> Self {
        metrics::gauge!("db_primary_known", "pool" => name.to_owned()).set(0.0);
        metrics::counter!("db_primary_retargets_total", "pool" => name.to_owned()).increment(0);
        let (current, _) = watch::channel(None);
        let epoch = Instant::now();
        Primary(Arc::new(Shared {
            hosts,
            target,
            current,
            retargeted: AtomicU64::new(0),
            epoch,
            wake: Notify::new(),
            check_interval,
            connect_timeout,
            name: name.to_owned(),
        }))
    }

    /// Whether a host that serves (a writable one, for `read-write`) is known.
    pub fn known(&self) -> bool {
        self.0.current.borrow().is_some()
    }

    /// The `host:port` the pool targets and that is known to serve.
    pub fn current_host(&self) -> Option<String> {
        self.0
            .current
            .borrow()
            .map(|i| self.0.hosts[i].label.clone())
    }

    /// Asks for a check now rather than at the next interval: a request
    /// saw the database unavailable or read-only.
    pub fn wake(&self) {
        self.0.wake.notify_one();
    }

    /// Waits until a serving host is known, at most `timeout`; whether one is.
    pub async fn wait_known(&self, timeout: Duration) -> bool {
        let mut current = self.0.current.subscribe();
        tokio::time::timeout(timeout, current.wait_for(Option::is_some))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Whether a connection `age` old was opened before the last re-target
    /// (so perhaps to a host that no longer serves).
    pub(super) fn predates_retarget(&self, age: Duration) -> bool {
        let retargeted = Duration::from_nanos(self.0.retargeted.load(Ordering::Acquire));
        // Opened at `now - age`; re-targeted at `epoch + retargeted`.
        age > self.0.epoch.elapsed().saturating_sub(retargeted)
    }

    /// Watches the hosts until `pool` is closed; run it in a task of its own.
    pub(super) async fn follow(self, pool: PgPool) {
        let shared = &self.0;
        // The host the pool's options point at now: the URL's first.
        let mut targeted = 0;
        let mut checking: Option<(usize, PgConnection)> = None;
        loop {
            if pool.is_closed() {
                break;
            }
            let last_check = Instant::now();
            let still_serves = match checking.as_mut() {
                Some((at, conn)) => {
                    match tokio::time::timeout(shared.connect_timeout, serves(conn, shared.target))
                        .await
                    {
                        Ok(answer) => answer.is_ok_and(|serves| serves),
                        // Silent, not gone: nothing would end the waits
                        // on it (see `liveness`).
                        Err(_) => {
                            liveness::sever(&shared.hosts[*at], &shared.name).await;
                            false
                        }
                    }
                }
                None => false,
            };
            if !still_serves {
                let lost = checking.take().map(|(i, _)| i);
                match self.scan(targeted).await {
                    Some((found, conn)) => {
                        let was_known = shared.current.borrow().is_some();
                        if found != targeted || !was_known {
                            // Connections opened before now may be to a
                            // server that has gone, or restarted since.
                            pool.set_connect_options(shared.hosts[found].options.clone());
                            let now = shared.epoch.elapsed().as_nanos();
                            shared
                                .retargeted
                                .store(u64::try_from(now).unwrap_or(u64::MAX), Ordering::Release);
                        }
                        if found != targeted {
                            metrics::counter!("db_primary_retargets_total", "pool" => shared.name.clone())
                                .increment(1);
                            tracing::warn!(
                                pool = %shared.name,
                                from = %shared.hosts[targeted].label,
                                to = %shared.hosts[found].label,
                                "database re-targeted to the host that serves"
                            );
                        } else if !was_known {
                            tracing::info!(
                                pool = %shared.name,
                                host = %shared.hosts[found].label,
                                "database host found"
                            );
                        }
                        targeted = found;
                        shared.current.send_replace(Some(found));
                        metrics::gauge!("db_primary_known", "pool" => shared.name.clone()).set(1.0);
                        checking = Some((found, conn));
                    }
                    None => {
                        if shared.current.send_replace(None).is_some() || lost.is_some() {
                            tracing::warn!(
                                pool = %shared.name,
                                last = %shared.hosts[targeted].label,
                                target = ?shared.target,
                                "no host of the database URL serves; requests get 503 until one does"
                            );
                        }
                        metrics::gauge!("db_primary_known", "pool" => shared.name.clone()).set(0.0);
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(shared.check_interval) => {}
                () = shared.wake.notified() => {
                    tokio::time::sleep_until((last_check + MIN_CHECK_GAP).into()).await;
                }
            }
        }
        if let Some((_, conn)) = checking {
            let _ = conn.close().await;
        }
    }

    /// Tries every host in order; the first that serves, with the
    /// connection that asked it. The pool's connections to `targeted` are
    /// cut if it does not answer in time.
    async fn scan(&self, targeted: usize) -> Option<(usize, PgConnection)> {
        let shared = &self.0;
        for (i, host) in shared.hosts.iter().enumerate() {
            match tokio::time::timeout(
                shared.connect_timeout,
                connect_and_check(&host.options, shared.target),
            )
            .await
            {
                Ok(Ok(Some(conn))) => return Some((i, conn)),
                Ok(Ok(None)) => {
                    tracing::debug!(pool = %shared.name, host = %host.label, "host is read-only");
                }
                Ok(Err(e)) => {
                    tracing::debug!(pool = %shared.name, host = %host.label, error = %e, "host does not answer");
                }
                Err(_) => {
                    tracing::debug!(pool = %shared.name, host = %host.label, "host timed out");
                    if i == targeted {
                        liveness::sever(host, &shared.name).await;
                    }
                }
            }
        }
        None
    }
}

/// A connection to `options`'s host if it serves `target`.
async fn connect_and_check(
    options: &PgConnectOptions,
    target: Target,
) -> Result<Option<PgConnection>, sqlx::Error> {
    let mut conn = options.connect().await?;
    if serves(&mut conn, target).await? {
        Ok(Some(conn))
    } else {
        let _ = conn.close().await;
        Ok(None)
    }
}

/// Whether the server behind `conn` serves `target`: for read-write, what
/// libpq asks, `SHOW transaction_read_only` (`on` on a standby, and on a
/// primary made read-only); for any, that it answers.
pub async fn serves(conn: &mut PgConnection, target: Target) -> Result<bool, sqlx::Error> {
    match target {
        Target::Any => conn.ping().await.map(|()| true),
        // A setting, not a table: nothing for the query macros to check.
        Target::ReadWrite => sqlx::query_scalar::<_, String>("SHOW transaction_read_only")
            .fetch_one(conn)
            .await
            .map(|read_only| read_only == "off"),
    }
}
