//! The chaos harness: real `oncepay serve` processes, a database of their
//! own (or a private Postgres cluster the test may restart), a retrying
//! client, and the report every scenario prints and asserts.

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// The demo merchant's key every server ensures at start.
pub const API_KEY: &str = "sk_test_chaosMerchantKey000000000000000000";

/// How many operations a scenario runs, times this (`CHAOS_SCALE`, default 1).
pub fn scale() -> usize {
    std::env::var("CHAOS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn scratch_dir(what: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("oncepay-chaos-{what}-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(false)
}

/// A Postgres binary: on PATH, or in Debian's versioned folder.
fn pg_binary(name: &str) -> PathBuf {
    if let Ok(path) = std::env::var("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join(name).is_file() {
                return dir.join(name);
            }
        }
    }
    let mut versions: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin").join(name))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    versions.sort();
    versions
        .pop()
        .unwrap_or_else(|| panic!("no {name}: install Debian's postgresql (scripts/test does)"))
}

/// A Postgres cluster of the test's own, so it can be stopped and started
/// under load without disturbing anything else.
pub struct PrivateCluster {
    dir: PathBuf,
    pub port: u16,
    root: bool,
}

impl PrivateCluster {
    pub fn start() -> Self {
        let dir = scratch_dir("pg");
        let root = is_root();
        if root {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            assert!(status.success(), "chown the cluster folder");
        }
        let cluster = PrivateCluster {
            dir,
            port: free_port(),
            root,
        };
        let data = cluster.dir.join("data");
        let out = cluster
            .pg(
                &pg_binary("initdb"),
                &[
                    "-D",
                    data.to_str().unwrap(),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                ],
            )
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.pg_ctl("start");
        cluster
    }

    fn pg(&self, binary: &Path, args: &[&str]) -> Command {
        let mut command = if self.root {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(binary);
            c
        } else {
            Command::new(binary)
        };
        command.args(args).current_dir("/").stdin(Stdio::null());
        command
    }

    fn pg_ctl(&self, action: &str) {
        let data = self.dir.join("data");
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("postgres.log");
        let mut args = vec![
            action,
            "-D",
            data.to_str().unwrap(),
            "-w",
            "-t",
            "30",
            "-m",
            "fast",
        ];
        if action == "start" {
            args.extend(["-o", &options, "-l", log.to_str().unwrap()]);
        }
        let out = self.pg(&pg_binary("pg_ctl"), &args).output().unwrap();
        assert!(
            out.status.success(),
            "pg_ctl {action}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (fast shutdown: connections are cut).
    pub fn stop(&self) {
        self.pg_ctl("stop");
    }

    pub fn start_again(&self) {
        self.pg_ctl("start");
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = self
            .pg(
                &pg_binary("pg_ctl"),
                &[
                    "stop",
                    "-D",
                    data.to_str().unwrap(),
                    "-m",
                    "immediate",
                    "-w",
                ],
            )
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One `oncepay serve` process.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    env: Vec<(String, String)>,
    pub log: PathBuf,
}

impl Server {
    /// Starts the real binary and waits until it answers `/healthz`.
    pub async fn start(database_url: &str, env: &[(&str, &str)]) -> Self {
        let mut vars: Vec<(String, String)> = vec![
            ("DATABASE_URL".into(), database_url.into()),
            ("DEMO_API_KEY".into(), API_KEY.into()),
            ("RUST_LOG".into(), "info,sqlx=warn".into()),
            ("DATABASE_MAX_CONNECTIONS".into(), "8".into()),
        ];
        vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let log = scratch_dir("log").join("server.log");
        let mut server = Server {
            child: None,
            port: free_port(),
            env: vars,
            log,
        };
        server.spawn().await;
        server
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .arg("serve")
            .env_clear()
            .envs(self.env.iter().cloned())
            .env("PORT", self.port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start oncepay");
        self.child = Some(child);
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = client.get(format!("{}/healthz", self.url())).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("oncepay exited at start ({status}): {}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "oncepay did not start: {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process to exit on its own (after an injected crash).
    pub async fn wait_exit(&mut self) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(Instant::now() < deadline, "the process did not exit");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends SIGTERM, as an orchestrator stopping the service would.
    pub fn terminate(&self) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM {pid}");
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// Starts the process again on the same port, with the same settings.
    pub async fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn().await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A charge body tagged with its logical operation, so duplicates can be
/// counted in the database.
pub fn charge_body(op: &str, amount: i64, source: &str) -> Value {
    json!({"amount": amount, "currency": "usd", "source": source, "metadata": {"op": op}})
}

/// What happened to one logical operation, seen from the client.
#[derive(Debug, Default, Clone)]
pub struct OpOutcome {
    pub key: String,
    /// The charge id of the `201` the client received, if it did.
    pub acked: Option<String>,
    /// The final status the client saw (201, 402), if it got one.
    pub definite: Option<u16>,
    pub requests: u64,
    pub five_xx: u64,
    /// Requests that hit the client's timeout: hung.
    pub hung: u64,
}

/// Sends one charge attempt; an error means no answer at all (connection
/// closed, refused, or timed out).
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> Result<(u16, HashMap<String, String>, Value), reqwest::Error> {
    post(client, url, "/v1/charges", key, body, extra).await
}

/// Sends one `POST` to `path` with an `Idempotency-Key`: the status, the
/// headers (names in lower case) and the JSON body (`Null` if none).
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    path: &str,
    key: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> Result<(u16, HashMap<String, String>, Value), reqwest::Error> {
    let mut request = client
        .post(format!("{url}{path}"))
        .bearer_auth(API_KEY)
        .header("Idempotency-Key", key)
        .json(body);
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let body = response.json().await.unwrap_or(Value::Null);
    Ok((status, headers, body))
}

/// A well-behaved client: retries one logical operation with the same key
/// (rotating over `urls`) until it gets a definite answer or `deadline`.
/// `first` is sent with the first attempt only (a fault to inject).
pub async fn drive(
    client: &reqwest::Client,
    urls: &[String],
    key: &str,
    body: &Value,
    first: &[(&str, &str)],
    deadline: Instant,
) -> OpOutcome {
    let mut outcome = OpOutcome {
        key: key.to_owned(),
        ..OpOutcome::default()
    };
    let mut attempt = 0usize;
    while Instant::now() < deadline {
        let url = &urls[attempt % urls.len()];
        let extra = if attempt == 0 { first } else { &[] };
        attempt += 1;
        outcome.requests += 1;
        match send(client, url, key, body, extra).await {
            Ok((201, _, body)) => {
                outcome.acked = body["id"].as_str().map(str::to_owned);
                outcome.definite = Some(201);
                return outcome;
            }
            Ok((402, _, _)) => {
                outcome.definite = Some(402);
                return outcome;
            }
            Ok((409, _, _)) => tokio::time::sleep(Duration::from_millis(100)).await,
            Ok((status, _, _)) if status >= 500 => {
                outcome.five_xx += 1;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            Ok((status, _, body)) => panic!("{key}: unexpected {status}: {body}"),
            Err(e) => {
                if e.is_timeout() {
                    outcome.hung += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    outcome
}

/// A client whose requests give up after `timeout` (a request longer than
/// that counts as hung).
pub fn client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder().timeout(timeout).build().unwrap()
}

/// One row of the reliability report, every figure read from the database
/// except what only the client knows (requests, acknowledgements, 5xx).
#[derive(Debug)]
pub struct Report {
    pub scenario: &'static str,
    pub operations: usize,
    pub requests: u64,
    /// Payments recorded by the processor: money moved.
    pub effects: i64,
    /// Succeeded charges.
    pub charges: i64,
    /// Extra effects: operations with more than one charge, plus payments
    /// whose charge is not succeeded.
    pub duplicates: i64,
    /// `201`s the client received whose charge is not in the database as succeeded.
    pub lost: i64,
    pub five_xx: u64,
    pub hung: u64,
    pub undecided: usize,
}

impl Report {
    pub async fn measure(scenario: &'static str, pool: &PgPool, outcomes: &[OpOutcome]) -> Self {
        let count = |sql: &'static str| async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(pool)
                .await
                .expect(sql)
        };
        let effects =
            count("SELECT count(*) FROM processor_operations WHERE outcome = 'succeeded'").await;
        let charges = count("SELECT count(*) FROM charges WHERE status = 'succeeded'").await;
        let duplicate_charges = count(
            "SELECT coalesce(sum(n - 1), 0)::bigint FROM (
                 SELECT count(*) AS n FROM charges
                  GROUP BY metadata->>'op' HAVING count(*) > 1) d",
        )
        .await;
        let orphan_payments = count(
            "SELECT count(*) FROM processor_operations p
              WHERE p.outcome = 'succeeded' AND p.kind = 'authorization'
                AND NOT EXISTS (SELECT 1 FROM charges c
                                 WHERE 'auth:' || c.id = p.processor_key AND c.status = 'succeeded')",
        )
        .await;
        let acked: Vec<String> = outcomes.iter().filter_map(|o| o.acked.clone()).collect();
        let lost: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM unnest($1::text[]) AS a(id)
              WHERE NOT EXISTS (SELECT 1 FROM charges c WHERE c.id = a.id AND c.status = 'succeeded')",
        )
        .bind(&acked)
        .fetch_one(pool)
        .await
        .unwrap();
        Report {
            scenario,
            operations: outcomes.len(),
            requests: outcomes.iter().map(|o| o.requests).sum(),
            effects,
            charges,
            duplicates: duplicate_charges + orphan_payments,
            lost,
            five_xx: outcomes.iter().map(|o| o.five_xx).sum(),
            hung: outcomes.iter().map(|o| o.hung).sum(),
            undecided: outcomes.iter().filter(|o| o.definite.is_none()).count(),
        }
    }

    /// Appends this row to `CHAOS_REPORT` (for `scripts/chaos`) and prints it.
    pub fn publish(&self) {
        let line = format!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            self.scenario,
            self.operations,
            self.requests,
            self.effects,
            self.charges,
            self.duplicates,
            self.lost,
            self.five_xx
        );
        eprintln!("chaos report: {self:?}");
        if let Ok(path) = std::env::var("CHAOS_REPORT") {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap();
            writeln!(file, "{line}").unwrap();
        }
    }

    /// The invariant: one logical operation, one effect, nothing acknowledged lost.
    #[track_caller]
    pub fn assert_exactly_once(&self) {
        assert_eq!(self.duplicates, 0, "{self:?}");
        assert_eq!(self.lost, 0, "{self:?}");
        assert_eq!(
            self.effects, self.charges,
            "payments equal succeeded charges: {self:?}"
        );
        assert_eq!(
            self.hung, 0,
            "no request hung past the client timeout: {self:?}"
        );
        assert_eq!(
            self.undecided, 0,
            "every operation got a definite answer: {self:?}"
        );
    }
}
