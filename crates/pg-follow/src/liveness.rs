//! Cutting every connection to a database host that has gone silent.
//!
//! A host whose processes are frozen (a hung machine, a paused VM) still
//! looks connected: its kernel accepts and acknowledges every packet, and
//! answers keepalives, so a statement sent to it waits for an answer that
//! never comes, and nothing below the application notices; behind a
//! partition TCP gives up only after about 15 minutes. sqlx has no
//! client-side timeout, and its pool pings a connection going back to it
//! with none either, so such a wait holds its caller and its pool slot
//! for as long as the silence lasts.
//!
//! So the host a pool uses is asked whether it answers, every check
//! interval, on a connection of the watch's own: by the [`super::follow`]
//! task for a URL with several hosts, by [`watch`] for one with a single
//! host. When it does not answer within the check timeout, [`sever`] shuts
//! down every TCP connection of this process to that host (`shutdown(2)`
//! on each socket whose peer is its address): each statement, ping or
//! connect waiting on it fails at once with an I/O error, and the pool
//! discards the connection without waiting (its ping on release fails on
//! the shut socket). No statement pays for this: no round trip, no timer.
//!
//! A live server bounds its statements itself (`statement_timeout`, see
//! [`super::pool`]). Together: a statement is answered, cancelled or cut
//! within `DATABASE_STATEMENT_TIMEOUT`, which is at least the check
//! interval plus the check timeout (the configuration refuses less).
//!
//! The sockets are found in `/proc/self/fd` (Linux); elsewhere nothing is
//! cut, and the log says so once.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::sys::socket::{Shutdown, SockaddrStorage, getpeername, shutdown};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection, PgPool};

use super::url::Host;

/// The longest the host's name may take to resolve before a cut.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(1);

/// Shuts down every TCP connection of this process to `host`, which did
/// not answer in time; how many were cut. `pool` names the pool in logs.
pub async fn sever(host: &Host, pool: &str) -> usize {
    let peers = match resolve(&host.options).await {
        Some(peers) => peers,
        None => {
            tracing::warn!(pool, host = %host.label, "a silent database host could not be resolved; nothing cut");
            return 0;
        }
    };
    let cut = tokio::task::spawn_blocking(move || cut_sockets_to(&peers))
        .await
        .unwrap_or(0);
    if cut > 0 {
        metrics::counter!("db_silent_host_cuts_total", "pool" => pool.to_owned())
            .increment(cut as u64);
        tracing::warn!(
            pool,
            host = %host.label,
            connections = cut,
            "the database host did not answer in time; every connection to it was cut"
        );
    } else {
        tracing::debug!(pool, host = %host.label, "the database host did not answer in time");
    }
    cut
}

/// The addresses `options` connects to; `None` for a Unix socket (no
/// network between, nothing to cut) or a name that does not resolve.
async fn resolve(options: &PgConnectOptions) -> Option<HashSet<SocketAddr>> {
    let host = options.get_host();
    if host.starts_with('/') {
        return None;
    }
    let found = tokio::time::timeout(
        RESOLVE_TIMEOUT,
        tokio::net::lookup_host((host, options.get_port())),
    )
    .await
    .ok()?
    .ok()?;
    Some(found.collect())
}

/// Shuts down each socket of this process whose peer is in `peers`.
fn cut_sockets_to(peers: &HashSet<SocketAddr>) -> usize {
    static UNSUPPORTED: AtomicBool = AtomicBool::new(false);
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        if !UNSUPPORTED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "no /proc/self/fd: connections to a silent database host cannot be cut here"
            );
        }
        return 0;
    };
    let mut cut = 0;
    for fd in fds.flatten() {
        let Some(fd) = fd.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // Not a connected socket (a file, a listener): no peer.
        let Ok(peer) = getpeername::<SockaddrStorage>(fd) else {
            continue;
        };
        let peer = match (peer.as_sockaddr_in(), peer.as_sockaddr_in6()) {
            (Some(v4), _) => SocketAddr::from(std::net::SocketAddrV4::from(*v4)),
            (_, Some(v6)) => SocketAddr::from(std::net::SocketAddrV6::from(*v6)),
            _ => continue,
        };
        // The descriptor may have been closed and reused since it was
        // listed; the peer was read just now, so what is cut is a
        // connection to the silent host all the same.
        if peers.contains(&peer) && shutdown(fd, Shutdown::Both).is_ok() {
            cut += 1;
        }
    }
    cut
}

/// Watches the single host of `pool` until the pool is closed: asks it
/// every `interval` on a connection of its own, and cuts every connection
/// to it when it does not answer within `timeout`. Run it in a task.
pub(super) async fn watch(
    pool: PgPool,
    host: Host,
    interval: Duration,
    timeout: Duration,
    name: &'static str,
) {
    let mut watching: Option<PgConnection> = None;
    while !pool.is_closed() {
        let asked = match watching.as_mut() {
            Some(conn) => tokio::time::timeout(timeout, conn.ping()).await,
            None => match tokio::time::timeout(timeout, host.options.connect()).await {
                Ok(Ok(conn)) => {
                    watching = Some(conn);
                    Ok(Ok(()))
                }
                // A host that refuses is not silent: its connections fail by themselves.
                Ok(Err(e)) => Ok(Err(e)),
                Err(elapsed) => Err(elapsed),
            },
        };
        match asked {
            Ok(Ok(())) => {}
            Ok(Err(_)) => watching = None,
            Err(_) => {
                watching = None;
                sever(&host, name).await;
            }
        }
        tokio::time::sleep(interval).await;
    }
    if let Some(conn) = watching {
        let _ = tokio::time::timeout(timeout, conn.close()).await;
    }
}
