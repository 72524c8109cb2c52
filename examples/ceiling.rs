//! The HTTP ceiling of `scripts/bench`: the most a server built like oncepay
//! (the same axum, tokio and release profile) can answer on loopback, with
//! no database, no authentication, no idempotency and no middleware. It
//! serves one saved answer, byte for byte, on `POST /v1/charges` (or the
//! path given) and nothing else, so a replay's rate can be set against it.
//! Started on a gateway's saved answer at `/v1/authorizations`, it is the
//! bare HTTP hop of a new charge's anchor.
//!
//! ```text
//! ceiling PORT RESPONSE_FILE [PATH]
//! ```
//!
//! `RESPONSE_FILE` is a response as `curl -i` writes it (status line,
//! headers, blank line, body): scripts/bench saves a real replay there.
//! `Date`, `Content-Length`, `Connection` and `Transfer-Encoding` are left
//! to hyper, as they are in the service; every other header is sent as
//! saved. The request body is read, as any handler of a `POST` must.

use std::sync::Arc;

use anyhow::{Context, bail};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::post;

/// The service's allocator, so that the ceiling is built as the service is.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The answer sent to every request.
struct Saved {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

/// Parses a response as `curl -i` writes it.
fn parse(raw: &[u8]) -> anyhow::Result<Saved> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no blank line after the headers")?;
    let head = std::str::from_utf8(&raw[..split]).context("headers are not UTF-8")?;
    let body = Bytes::copy_from_slice(&raw[split + 4..]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().context("no status line")?;
    let code = status_line
        .split_whitespace()
        .nth(1)
        .context("no status code")?;
    let status = StatusCode::from_bytes(code.as_bytes()).context("bad status code")?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':').context("a header without ':'")?;
        let name = HeaderName::from_bytes(name.trim().as_bytes()).context("bad header name")?;
        if [
            header::DATE,
            header::CONTENT_LENGTH,
            header::CONNECTION,
            header::TRANSFER_ENCODING,
        ]
        .contains(&name)
        {
            continue;
        }
        headers.append(name, HeaderValue::from_str(value.trim())?);
    }
    Ok(Saved {
        status,
        headers,
        body,
    })
}

async fn answer(State(saved): State<Arc<Saved>>, _body: Bytes) -> Response {
    let mut response = Response::new(Body::from(saved.body.clone()));
    *response.status_mut() = saved.status;
    *response.headers_mut() = saved.headers.clone();
    response
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (port, file, path) = match &args[..] {
        [_, port, file] => (port, file, "/v1/charges"),
        [_, port, file, path] if path.starts_with('/') => (port, file, path.as_str()),
        _ => bail!("usage: ceiling PORT RESPONSE_FILE [PATH]"),
    };
    let port: u16 = port.parse().context("PORT")?;
    let raw = std::fs::read(file).with_context(|| format!("reading {file}"))?;
    let saved = Arc::new(parse(&raw).with_context(|| format!("parsing {file}"))?);
    let app = Router::new().route(path, post(answer)).with_state(saved);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .with_context(|| format!("binding 127.0.0.1:{port}"))?;
    axum::serve(listener, app).await?;
    Ok(())
}
