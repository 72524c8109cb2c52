//! A real `oncepay serve` for the async-stripe tests, on a database of its own.
//!
//! The server is started once per test binary, on the first call to
//! [`oncepay`], with a short `PROCESSING_TIMEOUT` (an unknown outcome is
//! recovered within the SDK's retries) and webhook retries and polling of
//! 100 ms (a refused delivery is sent again at once). A shell watches the
//! test process: when the process ends and its end of the shell's standard
//! input closes, the shell stops the server and drops its databases.
//!
//! [`receiver::Receiver`] is an HTTP server on 127.0.0.1 that keeps every
//! webhook it is sent, raw body and signature, for the SDK's webhook helper.
//!
//! Settings (environment): DATABASE_URL (any database of a server where the
//! user may create databases), ONCEPAY_BIN (default target/debug/oncepay).
//! The server's log: target/sdk/rust-server.log.

pub mod receiver;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use stripe::{Client, ClientBuilder, RequestStrategy, StripeError};

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../..")
}

/// A running `oncepay serve`.
pub struct Oncepay {
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// A merchant's key (`DEMO_API_KEY`).
    pub api_key: String,
    /// The server's own database.
    pub db_url: String,
    /// The card gateway's ledger the server embeds, beside it.
    pub processor_url: String,
    /// The shell that stops the server once this end closes.
    _watch: Mutex<ChildStdin>,
}

static ONCEPAY: OnceLock<Oncepay> = OnceLock::new();

/// The server shared by the tests of this binary, started on first use.
pub fn oncepay() -> &'static Oncepay {
    ONCEPAY.get_or_init(start)
}

fn server_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// SERVER_URL with its database replaced by NAME (query string kept).
fn with_database(server_url: &str, name: &str) -> String {
    let (base, query) = match server_url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (server_url, String::new()),
    };
    let prefix = base.rsplit_once('/').map_or(base, |(p, _)| p);
    format!("{prefix}/{name}{query}")
}

/// A random lowercase hex string of 2 × BYTES characters.
pub fn random_hex(bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes * 2 {
        s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    s.truncate(bytes * 2);
    s
}

/// The port in the `addr` of the `oncepay listening` line of a log (text or
/// JSON).
fn listening_port(log: &str) -> Option<u16> {
    let line = log.lines().find(|l| l.contains("oncepay listening"))?;
    let (_, rest) = line
        .split_once("addr=")
        .or_else(|| line.split_once("\"addr\":\""))?;
    let addr = rest.split(|c: char| c.is_whitespace() || c == '"').next()?;
    addr.rsplit_once(':')?.1.parse().ok()
}

fn start() -> Oncepay {
    let root = root();
    let bin = std::env::var_os("ONCEPAY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/debug/oncepay"));
    assert!(
        bin.exists(),
        "{} is missing: run cargo build --bin oncepay first",
        bin.display()
    );
    let out = root.join("target/sdk");
    std::fs::create_dir_all(&out).unwrap();
    let log = out.join("rust-server.log");

    let server = server_url();
    let db = format!("oncepay_sdk_rust_{}", random_hex(6));
    psql(&server, &format!("CREATE DATABASE \"{db}\""));
    let db_url = with_database(&server, &db);
    let processor_url = with_database(&server, &format!("{db}_processor"));
    let api_key = format!("sk_test_sdkrust{}", random_hex(20));
    // The server runs under a shell that waits for its standard input to
    // close (this process ending, however it ends), then stops the server
    // and drops both databases.
    let watch = r#"
        "$ONCEPAY_BIN" serve &
        pid=$!
        read -r _ || true
        kill -TERM "$pid" 2>/dev/null
        wait "$pid"
        for db in "$DB" "${DB}_processor"; do
            psql -X -w -q "$SERVER_URL" -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null 2>&1
        done
    "#;
    let log_file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(watch)
        .current_dir(&out) // away from the repository's .env
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("ONCEPAY_BIN", &bin)
        .env("DB", &db)
        .env("SERVER_URL", &server)
        .env("DATABASE_URL", &db_url)
        // Its own choice, read from its log: no other process can take a
        // port between choice and use.
        .env("PORT", "0")
        .env("BIND_ADDR", "127.0.0.1")
        .env("DEMO_API_KEY", &api_key)
        .env("PROCESSING_TIMEOUT", "2s")
        .env("SWEEP_INTERVAL", "500ms")
        .env("WEBHOOK_RETRY_BASE", "100ms")
        .env("WEBHOOK_POLL_INTERVAL", "100ms")
        // The receiver is on 127.0.0.1; a server that refuses private
        // addresses for webhooks by default is told to allow them.
        .env("WEBHOOK_ALLOW_PRIVATE", "true")
        .env("RUST_LOG", "info,sqlx=warn")
        .stdin(Stdio::piped())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .expect("sh runs");
    let stdin = child.stdin.take().unwrap();

    let deadline = Instant::now() + Duration::from_secs(60);
    let base = loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("oncepay serve exited ({status}); see {}", log.display());
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(port) = listening_port(&text) {
            let base = format!("http://127.0.0.1:{port}");
            if matches!(http("GET", &base, "/healthz", None), Ok((200, _))) {
                break base;
            }
        }
        assert!(
            Instant::now() < deadline,
            "oncepay did not answer /healthz within 60 s; see {}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    Oncepay {
        base,
        api_key,
        db_url,
        processor_url,
        _watch: Mutex::new(stdin),
    }
}

impl Oncepay {
    /// An SDK client pointed at this server with the merchant's key. It
    /// calls as an integration should: each call keyed by the SDK and
    /// retried after 1 s and 2 s on a `409` or `5xx` (`503 overloaded` when
    /// the machine is busy), never on another `4xx`. A test about one
    /// answer sends once (`RequestStrategy::Once`).
    pub fn client(&self) -> Client {
        self.client_with_key(&self.api_key)
    }

    pub fn client_with_key(&self, key: &str) -> Client {
        ClientBuilder::new(key)
            .url(format!("{}/", self.base))
            .timeout(Duration::from_secs(30))
            .request_strategy(RequestStrategy::ExponentialBackoff(3))
            .build()
            .expect("a valid client configuration")
    }

    /// Runs SQL on the server's database; its unaligned output.
    pub fn sql(&self, query: &str) -> String {
        psql(&self.db_url, query)
    }

    pub fn count(&self, query: &str) -> i64 {
        let out = self.sql(query);
        out.parse()
            .unwrap_or_else(|_| panic!("{query}: not a number: {out}"))
    }

    /// Charges whose metadata carries `test=TAG`.
    pub fn charges_tagged(&self, tag: &str) -> i64 {
        self.count(&format!(
            "SELECT count(*) FROM charges WHERE metadata->>'test' = '{tag}'"
        ))
    }

    /// Money moved at the processor for the charges tagged TAG: the charges
    /// from oncepay's database, their payments from the card gateway's ledger.
    pub fn payments_tagged(&self, tag: &str) -> i64 {
        let keys = self.sql(&format!(
            "SELECT coalesce(string_agg(quote_literal('auth:' || id), ','), 'NULL') \
               FROM charges WHERE metadata->>'test' = '{tag}'"
        ));
        let out = psql(
            &self.processor_url,
            &format!(
                "SELECT count(*) FROM operations WHERE outcome = 'succeeded' AND key IN ({keys})"
            ),
        );
        out.parse().unwrap()
    }

    /// The body of `GET PATH` with the merchant's key, as the server sent it:
    /// what a typed call could not read is shown with its error.
    pub fn raw(&self, path: &str) -> String {
        match http("GET", &self.base, path, Some(&self.api_key)) {
            Ok((status, body)) => format!("HTTP {status}: {body}"),
            Err(e) => format!("(GET {path} failed: {e})"),
        }
    }

    /// The value of a typed call, or a panic that says what the SDK could
    /// not read: its error and, for an answer it could not deserialize into
    /// its type, the object as the server shows it at RAW_PATH.
    pub fn typed<T>(&self, what: &str, raw_path: &str, result: Result<T, StripeError>) -> T {
        match result {
            Ok(value) => value,
            Err(StripeError::JSONDeserialize(e)) => panic!(
                "async-stripe could not read {what} into its type ({e}); \
                 the object it was given: {}",
                self.raw(raw_path)
            ),
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Charge parameters' metadata with a tag of its own, to count them in the
/// database: `(tag, metadata)`.
pub fn tagged() -> (String, HashMap<String, String>) {
    let tag = format!("rust-{}", random_hex(6));
    let metadata = HashMap::from([("test".to_string(), tag.clone())]);
    (tag, metadata)
}

/// Runs SQL on URL with psql and returns its unaligned output.
pub fn psql(url: &str, sql: &str) -> String {
    let out = Command::new("psql")
        .args(["-X", "-w", "-Atq", "-v", "ON_ERROR_STOP=1", url, "-c", sql])
        .output()
        .expect("psql runs");
    assert!(
        out.status.success(),
        "psql failed on {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// One plain HTTP/1.0 request (no chunked answers): `(status, body)`.
pub fn http(
    method: &str,
    base: &str,
    path: &str,
    key: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let host = base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {host}\r\n{auth}\r\n"
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}
