//! Connections that send nothing, or never finish a request head: each is
//! closed after its timeout, whatever the client does.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::{Settings, TestApp, spawn_app_with};

/// What a loaded machine may add to a timeout before the close is seen.
const SLACK: Duration = Duration::from_secs(3);

async fn connect(app: &TestApp) -> TcpStream {
    let address = app.address.trim_start_matches("http://");
    TcpStream::connect(address).await.expect("connect")
}

/// How long until the server closes `stream` (end of file or a reset),
/// reading and discarding whatever it sends first; `None` if it is still
/// open after `within`.
async fn closed_after(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + within;
    let mut buffer = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_left_unfinished_is_cut_off_after_the_header_read_timeout() {
    let header_read_timeout = Duration::from_secs(1);
    let app = spawn_app_with(
        Settings::new()
            .set("HTTP_HEADER_READ_TIMEOUT", "1s")
            .set("HTTP_KEEP_ALIVE_TIMEOUT", "1s"),
    )
    .await;
    let mut stream = connect(&app).await;
    // The head's first lines, then nothing: never the blank line that ends it.
    stream
        .write_all(b"POST /v1/charges HTTP/1.1\r\nHost: oncepay\r\n")
        .await
        .unwrap();
    let closed = closed_after(&mut stream, header_read_timeout + SLACK)
        .await
        .expect("the unfinished head was cut off");
    assert!(
        closed >= header_read_timeout / 2,
        "closed after {closed:?}, not at once"
    );
    // The server goes on answering.
    let health = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_idle_after_its_answer_or_silent_from_the_start_is_closed_after_the_keep_alive_timeout()
 {
    // The header timer is long: only the keep-alive timeout can close these.
    let keep_alive = Duration::from_millis(500);
    let app = spawn_app_with(
        Settings::new()
            .set("HTTP_HEADER_READ_TIMEOUT", "30s")
            .set("HTTP_KEEP_ALIVE_TIMEOUT", "500ms"),
    )
    .await;

    let mut used = connect(&app).await;
    used.write_all(b"GET /healthz HTTP/1.1\r\nHost: oncepay\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&answer).contains(r#"{"status":"ok"}"#) {
        let n = tokio::time::timeout(SLACK, used.read(&mut buffer))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed before answering");
        answer.extend_from_slice(&buffer[..n]);
    }
    assert!(answer.starts_with(b"HTTP/1.1 200"));
    let mut silent = connect(&app).await;

    let (used, silent) = tokio::join!(
        closed_after(&mut used, keep_alive + SLACK),
        closed_after(&mut silent, keep_alive + SLACK)
    );
    for (what, closed) in [("idle after its answer", used), ("silent", silent)] {
        let closed = closed.unwrap_or_else(|| panic!("the {what} connection was closed"));
        assert!(closed >= keep_alive / 2, "{what}: closed after {closed:?}");
    }
}
