//! Serving connections: hyper's HTTP/1 connection with its header-read
//! timer, an idle timeout of our own, and a cap on open connections.
//!
//! - A request head must be complete within `HTTP_HEADER_READ_TIMEOUT` of
//!   the server starting to wait for it (hyper's timer, which `axum::serve`
//!   does not set).
//! - A connection with no request in flight that sends nothing for
//!   `HTTP_KEEP_ALIVE_TIMEOUT` is closed.
//! - At most [`Limits::max_connections`] connections are open. When a new
//!   one arrives at the cap, the open connection that has waited longest for
//!   a request (none in flight) is closed to make room; if every one has a
//!   request in flight, the new one is closed at once. A flood of
//!   connections that never finish a request can then neither exhaust the
//!   process's file descriptors nor lock real clients out.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use crate::config::Config;

/// The fewest connections the cap is ever lowered to.
const MIN_CONNECTIONS: usize = 8;

/// File descriptors kept for everything but client connections, on top of
/// the database pool: the listener, webhook deliveries, logs, libraries.
const RESERVED_FILES: u64 = 64;

/// The timeouts and the connection cap.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub keep_alive_timeout: Duration,
    pub max_connections: usize,
}

impl Limits {
    /// The configured limits, with the cap lowered so that the connections
    /// (and those being closed to make room) fit in `open_files`, the
    /// process's open-file limit, beside the database pool.
    pub fn new(config: &Config, open_files: Option<u64>) -> Self {
        let reserved = u64::from(config.database.max_connections) + RESERVED_FILES;
        Limits {
            header_read_timeout: config.server.header_read_timeout,
            keep_alive_timeout: config.server.keep_alive_timeout,
            max_connections: connection_cap(config.server.max_connections, open_files, reserved),
        }
    }
}

/// `configured`, lowered so that the cap plus a quarter of it (connections
/// closed to make room take a moment to go) fit in `open_files` less
/// `reserved`.
fn connection_cap(configured: usize, open_files: Option<u64>, reserved: u64) -> usize {
    let Some(open_files) = open_files else {
        return configured;
    };
    let room = open_files.saturating_sub(reserved) * 4 / 5;
    let room = usize::try_from(room).unwrap_or(usize::MAX);
    configured.min(room).max(MIN_CONNECTIONS)
}

/// Raises the soft open-file limit to the hard one, where the system allows;
/// the soft limit in force afterwards.
pub fn raise_open_file_limit() -> Option<u64> {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => Some(limit),
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the open-file limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE)
                .ok()
                .map(|(soft, _)| soft)
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves;
/// then stops accepting, lets each connection finish its request in flight,
/// and resolves once every connection is closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let connections = Arc::new(Connections::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    // Out of descriptors, say: wait rather than spin.
                    tracing::error!(error = %e, "accept error");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        () = &mut shutdown => break,
                    }
                }
            },
            () = &mut shutdown => break,
        };
        let Some(connection) = connections.admit() else {
            metrics::counter!("http_connections_shed_total", "reason" => "refused").increment(1);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(Watched {
            stream,
            connection: connection.clone(),
        });
        let service = {
            let (router, connection) = (router.clone(), connection.clone());
            hyper::service::service_fn(move |request: Request<Incoming>| {
                let in_flight = InFlight::start(&connection);
                let answer = router.clone().oneshot(request);
                async move {
                    let answer = answer.await;
                    drop(in_flight);
                    answer
                }
            })
        };
        let served = graceful.watch(http.serve_connection(io, service));
        let (connections, keep_alive) = (connections.clone(), limits.keep_alive_timeout);
        tokio::spawn(async move {
            tokio::select! {
                result = served => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                }
                () = connection.close.notified() => {}
                () = idle_timeout(&connection, keep_alive) => {}
            }
            connections.release(connection.id);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Errors about one connection, not the listener: accept the next.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Resolves once `connection` has had no request in flight, and has sent
/// nothing, for `keep_alive`. A request head on its way is hyper's header
/// timer's to cut off.
async fn idle_timeout(connection: &Connection, keep_alive: Duration) {
    loop {
        match connection.idle_deadline(keep_alive) {
            Some(deadline) if deadline <= Instant::now() => return,
            Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
            None => tokio::time::sleep(keep_alive).await,
        }
    }
}

/// The open connections.
struct Connections {
    max: usize,
    /// The most open at once, counting those closed to make room and not
    /// gone yet.
    hard_max: usize,
    open: Mutex<HashMap<u64, Arc<Connection>>>,
    next_id: AtomicU64,
    epoch: Instant,
}

/// One open connection, as the cap and the idle timeout see it.
struct Connection {
    id: u64,
    /// The start of its clock: its set's [`Connections::epoch`].
    epoch: Instant,
    /// Requests handed to the router and not answered yet.
    in_flight: AtomicUsize,
    /// When it last went without a request in flight, in milliseconds
    /// since [`Connections::epoch`].
    idle_since: AtomicU64,
    /// Whether any bytes arrived since `idle_since`.
    read_since_idle: AtomicBool,
    /// Whether it was chosen to close, to make room.
    evicted: AtomicBool,
    close: tokio::sync::Notify,
}

impl Connections {
    fn new(max: usize) -> Self {
        Connections {
            max,
            hard_max: max + (max / 4).max(1),
            open: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn millis(&self) -> u64 {
        millis_since(self.epoch)
    }

    /// Makes room for a new connection, closing the one that has waited
    /// longest for a request if the cap is reached; `None` if there is no
    /// room to make.
    fn admit(&self) -> Option<Arc<Connection>> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.len() >= self.max {
            if open.len() >= self.hard_max {
                return None;
            }
            let oldest = open
                .values()
                .filter(|c| {
                    c.in_flight.load(Ordering::Acquire) == 0 && !c.evicted.load(Ordering::Relaxed)
                })
                .min_by_key(|c| c.idle_since.load(Ordering::Relaxed))?;
            oldest.evicted.store(true, Ordering::Relaxed);
            oldest.close.notify_one();
            metrics::counter!("http_connections_shed_total", "reason" => "evicted").increment(1);
        }
        let connection = Arc::new(Connection {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            epoch: self.epoch,
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.millis()),
            read_since_idle: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            close: tokio::sync::Notify::new(),
        });
        open.insert(connection.id, connection.clone());
        metrics::gauge!("http_connections_open").set(open.len() as f64);
        Some(connection)
    }

    fn release(&self, id: u64) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.remove(&id);
        metrics::gauge!("http_connections_open").set(open.len() as f64);
    }
}

fn millis_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Connection {
    fn millis(&self) -> u64 {
        millis_since(self.epoch)
    }

    /// When the idle timeout closes it, if nothing changes; `None` while a
    /// request is in flight or a head is arriving.
    fn idle_deadline(&self, keep_alive: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0
            || self.read_since_idle.load(Ordering::Acquire)
        {
            return None;
        }
        let since = Duration::from_millis(self.idle_since.load(Ordering::Acquire));
        Some(self.epoch + since + keep_alive)
    }
}

/// Counts a request in flight on its connection, until dropped.
struct InFlight(Arc<Connection>);

impl InFlight {
    fn start(connection: &Arc<Connection>) -> Self {
        connection.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(connection.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let connection = &self.0;
        if connection.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            connection
                .idle_since
                .store(connection.millis(), Ordering::Release);
            connection.read_since_idle.store(false, Ordering::Release);
        }
    }
}

/// A client's stream that notes when bytes arrive, for the idle timeout.
struct Watched {
    stream: TcpStream,
    connection: Arc<Connection>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.connection
                .read_since_idle
                .store(true, Ordering::Release);
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_lowered_to_fit_the_open_file_limit() {
        assert_eq!(connection_cap(1024, None, 74), 1024);
        assert_eq!(connection_cap(1024, Some(1_048_576), 74), 1024);
        // 256 descriptors, 74 kept: 182, of which four fifths.
        assert_eq!(connection_cap(1024, Some(256), 74), 145);
        assert_eq!(connection_cap(1024, Some(50), 74), MIN_CONNECTIONS);
    }

    #[test]
    fn at_the_cap_the_connection_waiting_longest_makes_room_and_busy_ones_never_do() {
        let connections = Connections::new(2);
        let first = connections.admit().unwrap();
        let second = connections.admit().unwrap();
        let _busy = InFlight::start(&second);
        let third = connections.admit().expect("room made");
        assert!(first.evicted.load(Ordering::Relaxed), "the oldest idle one");
        assert!(
            !second.evicted.load(Ordering::Relaxed),
            "never one in flight"
        );
        connections.release(first.id);
        let _busy = InFlight::start(&third);
        assert!(connections.admit().is_none(), "every one is busy: refused");
    }
}
