//! A TCP proxy of the test's own between a server and its Postgres, that
//! can hold the traffic: while held, whatever either side sends waits in
//! the proxy (as bytes wait in TCP retransmission while a link is cut),
//! and it all goes on, in order, once released. Nothing is lost, only
//! delayed: the statement a server sent before the cut still reaches the
//! database after it.

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct HoldingProxy {
    /// The proxy's own address, on loopback.
    addr: SocketAddr,
    /// `true` while bytes flow.
    flowing: watch::Sender<bool>,
    /// Bytes the server's side sent and not yet passed on to Postgres.
    pending: Arc<AtomicUsize>,
    accept: JoinHandle<()>,
}

impl HoldingProxy {
    /// A proxy to the Postgres server of `database_url`, listening on a
    /// port of its own (bound once, never probed), traffic flowing.
    pub async fn to_database(database_url: &str) -> Self {
        let options = PgConnectOptions::from_str(database_url).expect("a postgres:// URL");
        let upstream = format!("{}:{}", options.get_host(), options.get_port());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (flowing, _) = watch::channel(true);
        let pending = Arc::new(AtomicUsize::new(0));
        let (gate, counted) = (flowing.clone(), pending.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, gate) = (upstream.clone(), gate.subscribe());
                let counted = counted.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        pipe(client, server, gate, counted).await;
                    }
                });
            }
        });
        HoldingProxy {
            addr,
            flowing,
            pending,
            accept,
        }
    }

    /// `database_url` with its host and port replaced by the proxy's.
    pub fn url(&self, database_url: &str) -> String {
        let scheme_end = database_url.find("://").expect("a URL") + 3;
        let rest = &database_url[scheme_end..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let hosts_start = rest[..authority_end].rfind('@').map_or(0, |at| at + 1);
        format!(
            "{}{}{}{}",
            &database_url[..scheme_end],
            &rest[..hosts_start],
            self.addr,
            &rest[authority_end..]
        )
    }

    /// Holds every byte from now on, in both directions.
    pub fn hold(&self) {
        self.flowing.send_replace(false);
    }

    /// Lets everything held go on, in order.
    pub fn release(&self) {
        self.flowing.send_replace(true);
    }

    /// Whether every byte sent towards Postgres has been passed on to it
    /// (none held or in transit); what Postgres answers is not counted.
    pub fn drained(&self) -> bool {
        self.pending.load(Ordering::SeqCst) == 0
    }
}

impl Drop for HoldingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies both ways between `client` and `server` until either side closes.
/// Bytes the client sent before it closed are still passed on, as a
/// kernel still sends what a closed socket had queued.
async fn pipe(
    client: TcpStream,
    server: TcpStream,
    gate: watch::Receiver<bool>,
    pending: Arc<AtomicUsize>,
) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = forward(client_read, server_write, gate.clone(), pending) => {}
        _ = forward(server_read, client_write, gate, Arc::default()) => {}
    }
}

/// Copies `from` to `to`, each chunk once the gate is open.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut gate: watch::Receiver<bool>,
    pending: Arc<AtomicUsize>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        pending.fetch_add(read, Ordering::SeqCst);
        let passed = gate.wait_for(|flowing| *flowing).await.is_ok()
            && to.write_all(&buffer[..read]).await.is_ok();
        pending.fetch_sub(read, Ordering::SeqCst);
        if !passed {
            return;
        }
    }
}
