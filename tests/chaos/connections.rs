//! Hundreds of connections that never finish their request head, against a
//! process with few file descriptors: the server keeps answering, and the
//! hanging connections are closed.

use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::database::TestDb as Database;
use crate::harness::{SLACK, Server, charge_body, client, send, setting};

/// The process's open-file limit, soft and hard: below the connections
/// opened, so that without a cap the process would run out of them.
const OPEN_FILES: u64 = 256;
const HANGING: usize = 300;

/// Opens `n` connections to `port`, each sending the first lines of a
/// request head and never the blank line that ends it.
async fn hanging_heads(port: u16, n: usize) -> Vec<TcpStream> {
    let mut streams = Vec::with_capacity(n);
    for _ in 0..n {
        let mut stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        // The server may already have closed it to make room: a failed
        // write is one of the outcomes under test, not an error.
        let _ = stream
            .write_all(b"POST /v1/charges HTTP/1.1\r\nHost: oncepay\r\n")
            .await;
        streams.push(stream);
    }
    streams
}

/// Whether the server closes `stream` (end of file or a reset) by `deadline`.
async fn closed_by(stream: &mut TcpStream, deadline: Instant) -> bool {
    let mut buffer = [0u8; 1024];
    loop {
        let read = tokio::time::timeout_at(deadline.into(), stream.read(&mut buffer)).await;
        match read {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// How many of `streams` the server has closed by `deadline`.
async fn count_closed(streams: &mut [TcpStream], deadline: Instant) -> usize {
    join_all(streams.iter_mut().map(|s| closed_by(s, deadline)))
        .await
        .into_iter()
        .filter(|closed| *closed)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_unfinished_request_heads_neither_exhaust_descriptors_nor_block_health_and_charges()
 {
    let db = Database::create_empty().await;
    // Longer than the test: only the connection cap can make room.
    let server = Server::start_with_open_files(
        &db.url,
        &[
            ("HTTP_HEADER_READ_TIMEOUT", "1m"),
            ("HTTP_KEEP_ALIVE_TIMEOUT", "1m"),
        ],
        OPEN_FILES,
    )
    .await;
    let mut hanging = hanging_heads(server.port, HANGING).await;
    let http = client(Duration::from_secs(10));

    let health = http
        .get(format!("{}/healthz", server.url()))
        .send()
        .await
        .expect("/healthz answers while the heads hang");
    assert_eq!(health.status(), 200);
    let body = charge_body("during-the-flood", 1000, "tok_visa");
    let (status, _, answer) = send(&http, &server.url(), "flood-1", &body, &[])
        .await
        .expect("a charge is answered while the heads hang");
    assert_eq!(status, 201, "{answer}");

    // The server closed hanging connections to stay under its cap: at
    // least every one beyond its descriptors, promptly.
    let closed = count_closed(&mut hanging, Instant::now() + SLACK).await;
    assert!(
        closed >= HANGING - OPEN_FILES as usize,
        "only {closed} of {HANGING} hanging connections were closed"
    );
    let log = server.log_text();
    assert!(!log.contains("Too many open files"), "{log}");
    assert!(log.contains("connection cap"), "the cap is logged: {log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_request_heads_are_all_closed_after_the_header_read_timeout() {
    let db = Database::create_empty().await;
    let header_read_timeout = Duration::from_secs(1);
    let server = Server::start_with_open_files(
        &db.url,
        &[
            ("HTTP_HEADER_READ_TIMEOUT", setting(header_read_timeout)),
            ("HTTP_KEEP_ALIVE_TIMEOUT", setting(header_read_timeout)),
        ],
        OPEN_FILES,
    )
    .await;
    let opened = Instant::now();
    let mut hanging = hanging_heads(server.port, HANGING).await;
    let closed = count_closed(&mut hanging, opened + header_read_timeout + SLACK).await;
    assert_eq!(closed, HANGING, "every hanging connection was closed");

    let http = client(Duration::from_secs(10));
    let health = http
        .get(format!("{}/healthz", server.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let body = charge_body("after-the-flood", 1000, "tok_visa");
    let (status, _, answer) = send(&http, &server.url(), "flood-2", &body, &[])
        .await
        .unwrap();
    assert_eq!(status, 201, "{answer}");
}
