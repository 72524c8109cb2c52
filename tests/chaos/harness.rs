//! The chaos harness: real `oncepay serve` processes, each beside an
//! `oncepay processor` process (the card gateway, with its ledger in the
//! database `<the test's database>_processor`), a database of their own
//! (or a private Postgres cluster the test may restart), a retrying client,
//! and the report every scenario prints and asserts.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
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

/// How long a process or a Postgres may take to start on a loaded machine: a
/// budget for start-up only, never one a test measures.
pub const START_BUDGET: Duration = Duration::from_secs(60);

/// What a process that ended at start wrote when starting it again may
/// succeed: its port was taken meanwhile (a restart on its old port), or the
/// machine was too loaded for its database to answer within its
/// `DATABASE_ACQUIRE_TIMEOUT`.
const START_AGAIN: [&str; 2] = ["Address already in use", "within DATABASE_ACQUIRE_TIMEOUT"];

/// Whether a failed start says its port was taken: the system's message
/// (Postgres: `could not bind IPv4 address "127.0.0.1": Address already in
/// use`, and pg_autoctl's), HAProxy's `cannot bind socket`, or
/// scripts/cluster's `port N (for PART) is in use`.
pub fn port_taken(output: &str) -> bool {
    [
        "Address already in use",
        "cannot bind socket",
        ") is in use",
    ]
    .iter()
    .any(|m| output.contains(m))
}

/// The length of a log file now: where a new start's lines begin.
pub fn log_end(log: &Path) -> u64 {
    std::fs::metadata(log).map_or(0, |m| m.len())
}

/// The log's text from byte `from` on.
pub fn log_since(log: &Path, from: u64) -> String {
    let text = std::fs::read(log).unwrap_or_default();
    let from = usize::try_from(from).unwrap_or(usize::MAX).min(text.len());
    String::from_utf8_lossy(&text[from..]).into_owned()
}

/// The port in the `addr` of the first `message` line (`oncepay listening`,
/// `processor listening`), in the text or the JSON log format.
fn logged_port(log: &str, message: &str) -> Option<u16> {
    let line = log.lines().find(|l| l.contains(message))?;
    let (_, rest) = line
        .split_once("addr=")
        .or_else(|| line.split_once("\"addr\":\""))?;
    let addr = rest.split(|c: char| c.is_whitespace() || c == '"').next()?;
    addr.rsplit_once(':')?.1.parse().ok()
}

/// Waits until `child`, started with its port `*port` (0: one of its own
/// choosing, read from `log` after byte `from`), answers `/healthz`; the exit
/// status if it ends before that.
async fn wait_started(
    child: &mut Option<Child>,
    port: &mut u16,
    log: &Path,
    from: u64,
    message: &str,
) -> Result<(), ExitStatus> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + START_BUDGET;
    loop {
        if *port == 0 {
            *port = logged_port(&log_since(log, from), message).unwrap_or(0);
        }
        if *port != 0 {
            let url = format!("http://127.0.0.1:{port}/healthz");
            if let Ok(r) = client.get(url).send().await {
                if r.status() == 200 {
                    return Ok(());
                }
            }
        }
        if let Some(status) = child.as_mut().unwrap().try_wait().unwrap() {
            *child = None;
            return Err(status);
        }
        assert!(
            Instant::now() < deadline,
            "{message}: not started within {START_BUDGET:?}: {}",
            log_since(log, from)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn scratch_dir(what: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("oncepay-chaos-{what}-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(false)
}

/// A Postgres binary: on PATH, or in Debian's versioned folder.
pub fn pg_binary(name: &str) -> PathBuf {
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
        let mut cluster = PrivateCluster { dir, port: 0, root };
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
        // Postgres must be told its port: another process may take the one
        // chosen before Postgres binds it, and then a new one is chosen.
        for _ in 0..5 {
            cluster.port = free_port();
            match cluster.try_pg_ctl("start") {
                Ok(()) => return cluster,
                Err(e) if port_taken(&e) => continue,
                Err(e) => panic!("pg_ctl start: {e}"),
            }
        }
        panic!("pg_ctl start: five ports in a row were taken before Postgres bound them");
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
        if let Err(e) = self.try_pg_ctl(action) {
            panic!("pg_ctl {action}: {e}");
        }
    }

    /// `pg_ctl ACTION`; what it and the server's log said if it failed.
    fn try_pg_ctl(&self, action: &str) -> Result<(), String> {
        let data = self.dir.join("data");
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("postgres.log");
        let from = log_end(&log);
        let timeout = START_BUDGET.as_secs().to_string();
        let mut args = vec![
            action,
            "-D",
            data.to_str().unwrap(),
            "-w",
            "-t",
            &timeout,
            "-m",
            "fast",
        ];
        if action == "start" {
            args.extend(["-o", &options, "-l", log.to_str().unwrap()]);
        }
        let out = self.pg(&pg_binary("pg_ctl"), &args).output().unwrap();
        if out.status.success() {
            return Ok(());
        }
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            log_since(&log, from)
        ))
    }

    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (fast shutdown: connections are cut).
    pub fn stop(&self) {
        self.pg_ctl("stop");
    }

    /// Starts the server again on its port, trying again while another
    /// process holds the port (within [`START_BUDGET`]).
    pub fn start_again(&self) {
        let deadline = Instant::now() + START_BUDGET;
        loop {
            match self.try_pg_ctl("start") {
                Ok(()) => return,
                Err(e) if port_taken(&e) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("pg_ctl start: {e}"),
            }
        }
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

/// The database of the card gateway's ledger beside `database_url`'s:
/// the same server, the name suffixed `_processor`.
pub fn processor_database_url(database_url: &str) -> String {
    let (base, query) = database_url
        .split_once('?')
        .map_or((database_url, None), |(b, q)| (b, Some(q)));
    match query {
        Some(q) => format!("{base}_processor?{q}"),
        None => format!("{base}_processor"),
    }
}

/// A pool on the card gateway's ledger beside `pool`'s database, created
/// and migrated if no gateway has yet (an empty ledger).
pub async fn processor_pool(pool: &PgPool) -> PgPool {
    let options = pool.connect_options();
    let name = format!(
        "{}_processor",
        options.get_database().expect("the pool names its database")
    );
    let options = (*options).clone().database(&name);
    let url = sqlx::ConnectOptions::to_url_lossy(&options).to_string();
    card_gateway::create_database_if_missing(&url)
        .await
        .expect("create the processor's ledger");
    let ledger = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("connect to the processor's ledger");
    card_gateway::MIGRATOR
        .run(&ledger)
        .await
        .expect("migrate the processor's ledger");
    ledger
}

/// The card gateway account oncepay calls under in these tests.
pub const ACCOUNT: &str = "chaos oncepay";

/// One `oncepay processor` process: the card gateway, fault injection on.
pub struct ProcessorProcess {
    child: Option<Child>,
    pub port: u16,
    /// A secret key of [`ACCOUNT`], for oncepay's `PROCESSOR_API_KEY`.
    pub api_key: String,
    env: Vec<(String, String)>,
    pub log: PathBuf,
}

impl ProcessorProcess {
    /// Starts the gateway with its ledger in `<database_url's>_processor`
    /// (created if missing) and waits until it answers `/healthz`; `env`
    /// adds its own settings (`PROCESSOR_LATENCY_MS`, ...).
    pub async fn start(database_url: &str, env: &[(&str, impl AsRef<str>)]) -> Self {
        let mut vars: Vec<(String, String)> = vec![
            (
                "PROCESSOR_DATABASE_URL".into(),
                processor_database_url(database_url),
            ),
            ("PROCESSOR_FAULT_INJECTION".into(), "true".into()),
            ("RUST_LOG".into(), "info,sqlx=warn".into()),
        ];
        vars.extend(
            env.iter()
                .map(|(k, v)| (k.to_string(), v.as_ref().to_owned())),
        );
        let mut processor = ProcessorProcess {
            child: None,
            // Its own choice at the first start, kept for its restarts.
            port: 0,
            api_key: String::new(),
            env: vars,
            log: scratch_dir("log").join("processor.log"),
        };
        processor.spawn().await;
        processor.api_key = processor.account_key().await;
        processor
    }

    /// A new secret key of [`ACCOUNT`] in the running gateway's ledger.
    async fn account_key(&self) -> String {
        let env = self.env.clone();
        let config = card_gateway::Config::from_lookup(|name| {
            env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
        .expect("the gateway's configuration");
        let pool = card_gateway::connect(&config)
            .await
            .expect("connect to the gateway's ledger");
        let (_, secret) = card_gateway::accounts::ensure(&pool, ACCOUNT)
            .await
            .expect("an account at the gateway");
        pool.close().await;
        secret.expose().to_owned()
    }

    async fn spawn(&mut self) {
        let deadline = Instant::now() + START_BUDGET;
        loop {
            let from = log_end(&self.log);
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .unwrap();
            let child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
                .arg("processor")
                .env_clear()
                .envs(self.env.iter().cloned())
                .env("PROCESSOR_PORT", self.port.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start oncepay processor");
            self.child = Some(child);
            let started = wait_started(
                &mut self.child,
                &mut self.port,
                &self.log,
                from,
                "processor listening",
            )
            .await;
            let Err(status) = started else { return };
            let text = log_since(&self.log, from);
            assert!(
                START_AGAIN.iter().any(|m| text.contains(m)) && Instant::now() < deadline,
                "oncepay processor exited at start ({status}): {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still running (a `crash-after-record` fault
    /// aborts it).
    pub fn alive(&mut self) -> bool {
        running(&mut self.child)
    }

    /// Kills the process (`SIGKILL`) and waits for it: connections to its
    /// port are refused until [`ProcessorProcess::restart`].
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }

    /// Starts the process again on the same port, with the same settings.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

impl Drop for ProcessorProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One `oncepay serve` process, with its own `oncepay processor` process
/// unless the test gives it a `PROCESSOR_URL`.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    env: Vec<(String, String)>,
    pub log: PathBuf,
    /// The open-file limit the process starts with (soft and hard), when
    /// the test sets one.
    open_files: Option<u64>,
    /// The card gateway it calls, a process of its own, when it started one.
    pub processor: Option<ProcessorProcess>,
}

impl Server {
    /// Starts the real binary and waits until it answers `/healthz`.
    pub async fn start(database_url: &str, env: &[(&str, impl AsRef<str>)]) -> Self {
        Self::start_limited(database_url, env, None).await
    }

    /// [`Server::start`] with the process's open-file limit, soft and hard,
    /// set to `open_files` (through the shell's `ulimit -n`, so that the
    /// process cannot raise it).
    pub async fn start_with_open_files(
        database_url: &str,
        env: &[(&str, impl AsRef<str>)],
        open_files: u64,
    ) -> Self {
        Self::start_limited(database_url, env, Some(open_files)).await
    }

    async fn start_limited(
        database_url: &str,
        env: &[(&str, impl AsRef<str>)],
        open_files: Option<u64>,
    ) -> Self {
        let mut vars: Vec<(String, String)> = vec![
            ("DATABASE_URL".into(), database_url.into()),
            ("DEMO_API_KEY".into(), API_KEY.into()),
            ("RUST_LOG".into(), "info,sqlx=warn".into()),
            ("DATABASE_MAX_CONNECTIONS".into(), "8".into()),
            // The scenarios' webhook receivers listen on loopback.
            ("WEBHOOK_ALLOW_PRIVATE".into(), "true".into()),
            // The scenarios storm one key from many clients on purpose and
            // count every 5xx as a fault; shedding that storm is the
            // subject of tests/api/shedding.rs and scripts/bench shed, not
            // of these. A scenario may still turn it on.
            ("DATABASE_QUEUE_TIMEOUT".into(), "1h".into()),
            ("DATABASE_QUEUE_OVERLOAD_TIMEOUT".into(), "1h".into()),
        ];
        vars.extend(
            env.iter()
                .map(|(k, v)| (k.to_string(), v.as_ref().to_owned())),
        );
        // The gateway runs as a process of its own, with the latency (and
        // the delay of its `slow` fault) the test asks of the processor.
        let processor = if vars.iter().any(|(k, _)| k == "PROCESSOR_URL") {
            None
        } else {
            let gateway_env: Vec<(&str, String)> = vars
                .iter()
                .filter_map(|(k, v)| {
                    ["PROCESSOR_LATENCY_MS", "PROCESSOR_FAULT_DELAY"]
                        .into_iter()
                        .find(|name| k == name)
                        .map(|name| (name, v.clone()))
                })
                .collect();
            let processor = ProcessorProcess::start(database_url, &gateway_env).await;
            vars.push(("PROCESSOR_URL".into(), processor.url()));
            vars.push(("PROCESSOR_API_KEY".into(), processor.api_key.clone()));
            Some(processor)
        };
        let log = scratch_dir("log").join("server.log");
        let mut server = Server {
            child: None,
            // Its own choice at the first start, kept for its restarts.
            port: 0,
            env: vars,
            log,
            open_files,
            processor,
        };
        server.spawn().await;
        server
    }

    async fn spawn(&mut self) {
        if let Err(status) = self.try_spawn().await {
            panic!("oncepay exited at start ({status}): {}", self.log_text());
        }
    }

    /// Starts the process and waits until it answers `/healthz`, starting it
    /// again while it ends at start for a cause of [`START_AGAIN`]; the exit
    /// status if it ends before that for another.
    async fn try_spawn(&mut self) -> Result<(), ExitStatus> {
        let deadline = Instant::now() + START_BUDGET;
        loop {
            let from = log_end(&self.log);
            self.child = Some(self.command().spawn().expect("start oncepay"));
            let started = wait_started(
                &mut self.child,
                &mut self.port,
                &self.log,
                from,
                "oncepay listening",
            )
            .await;
            let Err(status) = started else { return Ok(()) };
            let text = log_since(&self.log, from);
            if !START_AGAIN.iter().any(|m| text.contains(m)) || Instant::now() >= deadline {
                return Err(status);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The command that starts the process, on its port (0 at first).
    fn command(&self) -> Command {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let binary = env!("CARGO_BIN_EXE_oncepay");
        let mut command = match self.open_files {
            Some(limit) => {
                let mut sh = Command::new("sh");
                sh.args([
                    "-c",
                    &format!("ulimit -n {limit} && exec \"$0\" serve"),
                    binary,
                ]);
                sh
            }
            None => {
                let mut command = Command::new(binary);
                command.arg("serve");
                command
            }
        };
        command
            .env_clear()
            .envs(self.env.iter().cloned())
            .env("PORT", self.port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        command
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
        running(&mut self.child)
    }

    /// Kills the process (`SIGKILL`) and waits for it: nothing listens on
    /// its port until [`Server::restart`].
    pub fn stop(&mut self) {
        kill(&mut self.child);
    }

    /// Starts the process again on the same port, with the same settings.
    pub async fn restart(&mut self) {
        self.stop();
        self.spawn().await;
    }

    /// [`Server::restart`], for a process that may abort on purpose before
    /// it is ready (its webhook worker starts before it answers): the exit
    /// status if it did.
    pub async fn try_restart(&mut self) -> Result<(), ExitStatus> {
        self.stop();
        self.try_spawn().await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        kill(&mut self.child);
    }
}

/// Kills a child process (`SIGKILL`), if there is one, and waits for it.
fn kill(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Whether a child process is there and still running.
fn running(child: &mut Option<Child>) -> bool {
    child
        .as_mut()
        .is_some_and(|c| c.try_wait().unwrap().is_none())
}

/// Slack on every deadline derived from the settings: what a loaded machine
/// may add to the time the settings say the work takes.
pub const SLACK: Duration = Duration::from_secs(3);

/// A duration as a server setting (`1500ms`).
pub fn setting(duration: Duration) -> String {
    format!("{}ms", duration.as_millis())
}

/// The server settings a scenario's deadlines are derived from.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub processing_timeout: Duration,
    pub sweep_interval: Duration,
}

impl Timing {
    /// `PROCESSING_TIMEOUT` and `SWEEP_INTERVAL`, as server settings.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("PROCESSING_TIMEOUT", setting(self.processing_timeout)),
            ("SWEEP_INTERVAL", setting(self.sweep_interval)),
        ]
    }

    /// How long after its claim a record left pending is settled at the
    /// latest: it turns stale after `PROCESSING_TIMEOUT`, and the next sweep
    /// comes within one `SWEEP_INTERVAL` (a retry may settle it sooner).
    pub fn recovered_within(&self) -> Duration {
        self.processing_timeout + self.sweep_interval + SLACK
    }
}

/// Polls `check` every 50 ms until it gives a value; panics, naming `what`,
/// once `deadline` has passed.
pub async fn eventually<T, F, Fut>(deadline: Instant, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One series from `url`'s `/metrics`: its name, with its labels as the
/// exporter writes them (`sweeper_settled_total{outcome="charge_failed"}`);
/// 0 when not recorded yet.
pub async fn metric(client: &reqwest::Client, url: &str, series: &str) -> f64 {
    let text = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map(|value| value.trim().parse::<f64>().unwrap())
        .next()
        .unwrap_or(0.0)
}

/// A charge body tagged with its logical operation, so duplicates can be
/// counted in the database.
pub fn charge_body(op: &str, amount: i64, source: &str) -> Value {
    json!({"amount": amount, "currency": "usd", "source": source, "metadata": {"op": op}})
}

/// A refund body tagged with its logical operation.
pub fn refund_body(op: &str, charge: &str, amount: i64) -> Value {
    json!({"charge": charge, "amount": amount, "metadata": {"op": op}})
}

/// The `400`s that are definite answers: a refund refused because the
/// charge has nothing left to refund. Nothing was written, and a retry gets
/// the same answer.
pub const REFUSALS: [&str; 2] = ["charge_already_refunded", "amount_too_large"];

/// A definite answer one client received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// `201`, `402`, or `400` for one of the [`REFUSALS`].
    pub status: u16,
    /// The record the answer names: a `201`'s `id`, a `402`'s `charge`;
    /// `None` when the body had none (which no check accepts).
    pub id: Option<String>,
    /// The state a `201` says its record is in (its body's `status`: a
    /// refund the issuer refused is a `201` too, `failed`); `None` otherwise.
    pub state: Option<String>,
}

impl Answer {
    pub fn of(status: u16, body: &Value) -> Self {
        let field = if status == 402 { "charge" } else { "id" };
        Answer {
            status,
            id: body[field].as_str().map(str::to_owned),
            state: body["status"].as_str().map(str::to_owned),
        }
    }
}

/// What happened to one logical operation, seen from its clients.
#[derive(Debug, Default, Clone)]
pub struct OpOutcome {
    /// The operation: the `op` in the body's metadata.
    pub op: String,
    pub key: String,
    /// Every definite answer its clients received, one per client that got
    /// one; the report checks that they agree, and with the database.
    pub answers: Vec<Answer>,
    pub requests: u64,
    /// `409`s: the key was in flight.
    pub in_use: u64,
    pub five_xx: u64,
    /// Requests that hit the client's timeout: hung.
    pub hung: u64,
}

impl OpOutcome {
    pub fn new(op: &str, key: &str) -> Self {
        OpOutcome {
            op: op.to_owned(),
            key: key.to_owned(),
            ..OpOutcome::default()
        }
    }

    /// Records a definite answer.
    pub fn answered(&mut self, status: u16, body: &Value) {
        self.answers.push(Answer::of(status, body));
    }

    /// The status of the definite answer, if a client got one.
    pub fn definite(&self) -> Option<u16> {
        self.answers.first().map(|a| a.status)
    }
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

/// A well-behaved client of `POST /v1/charges`: see [`drive_to`].
pub async fn drive(
    client: &reqwest::Client,
    urls: &[String],
    key: &str,
    body: &Value,
    first: &[(&str, &str)],
    deadline: Instant,
) -> OpOutcome {
    drive_to(client, urls, "/v1/charges", key, body, first, deadline).await
}

/// A well-behaved client: retries one logical operation on `path` with the
/// same key (rotating over `urls`) until it gets a definite answer (`201`,
/// `402`, a `400` of the [`REFUSALS`]) or `deadline`. `first` is sent with
/// the first attempt only (a fault to inject). Any other `4xx` fails the
/// test.
pub async fn drive_to(
    client: &reqwest::Client,
    urls: &[String],
    path: &str,
    key: &str,
    body: &Value,
    first: &[(&str, &str)],
    deadline: Instant,
) -> OpOutcome {
    drive_observed(client, urls, path, key, body, first, deadline, |_, _| {}).await
}

/// [`drive_to`], telling `observe` of every attempt as it ends: when it was
/// sent and its status (`None`: no answer).
#[allow(clippy::too_many_arguments)]
pub async fn drive_observed(
    client: &reqwest::Client,
    urls: &[String],
    path: &str,
    key: &str,
    body: &Value,
    first: &[(&str, &str)],
    deadline: Instant,
    mut observe: impl FnMut(Instant, Option<u16>),
) -> OpOutcome {
    let op = body["metadata"]["op"].as_str().unwrap_or(key);
    let mut outcome = OpOutcome::new(op, key);
    let mut attempt = 0usize;
    while Instant::now() < deadline {
        let url = &urls[attempt % urls.len()];
        let extra = if attempt == 0 { first } else { &[] };
        attempt += 1;
        outcome.requests += 1;
        let sent = Instant::now();
        let result = post(client, url, path, key, body, extra).await;
        observe(sent, result.as_ref().ok().map(|(status, _, _)| *status));
        match result {
            Ok((status @ (201 | 402), _, body)) => {
                outcome.answered(status, &body);
                return outcome;
            }
            Ok((400, _, body)) if REFUSALS.contains(&body["code"].as_str().unwrap_or("")) => {
                outcome.answered(400, &body);
                return outcome;
            }
            Ok((409, _, _)) => {
                outcome.in_use += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
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

/// The records a scenario's operations create, and the processor's
/// operations that move their money.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ledger {
    /// Charges, and the payments (authorizations) behind them.
    Charges,
    /// Refunds, and the processor's refunds.
    Refunds,
}

impl Ledger {
    fn table(self) -> &'static str {
        match self {
            Ledger::Charges => "charges",
            Ledger::Refunds => "refunds",
        }
    }

    /// The processor operations that moved money, as a `WHERE` clause on `p`.
    fn effects(self) -> &'static str {
        match self {
            Ledger::Charges => "p.kind = 'authorization' AND p.outcome = 'succeeded'",
            Ledger::Refunds => "p.kind = 'refund' AND p.outcome = 'refunded'",
        }
    }

    /// The processor key of a record `r`.
    fn processor_key(self) -> &'static str {
        match self {
            Ledger::Charges => "'auth:' || r.id",
            Ledger::Refunds => "'refund:' || r.id",
        }
    }
}

/// One row of the reliability report, every figure read from the database
/// except what only the clients know (requests, answers, 5xx).
#[derive(Debug)]
pub struct Report {
    pub scenario: &'static str,
    pub operations: usize,
    pub requests: u64,
    /// Money moved by the processor: payments, or refunds.
    pub effects: i64,
    /// Succeeded records: charges, or refunds.
    pub succeeded: i64,
    /// Extra effects: operations with more than one record, plus money moved
    /// by the processor whose record is not succeeded.
    pub duplicates: i64,
    /// Operations a client got a `201` for whose record is not in the
    /// database as a record of that operation in the state the answer says:
    /// a succeeded charge, a succeeded (or refused, `failed`) refund; or
    /// whose body named no record at all.
    pub lost: i64,
    /// Operations whose clients got definite answers that disagree (`201`
    /// and `402`, or two records), or a `402` naming anything but a failed
    /// charge of that operation.
    pub wrong: i64,
    /// Changes without their event and events without their change, of
    /// every charge and refund in the database ([`unpaired_events`]).
    pub events: i64,
    /// The first of them, described.
    pub unpaired: Vec<String>,
    /// What crossed the webhook boundary; `None` when the scenario
    /// registered no webhook endpoint.
    pub delivered: Option<Delivered>,
    /// What breaks the webhook property ([`webhook_violations`]).
    pub webhooks: i64,
    /// The first of them, described.
    pub webhook_violations: Vec<String>,
    pub five_xx: u64,
    pub hung: u64,
    pub undecided: usize,
    /// What reconciling the database with the gateway's ledger found
    /// ([`reconciliation_differences_with`]), described.
    pub reconciliation: Vec<String>,
}

/// What crossed the webhook boundary in a scenario, read in one statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    /// Events with deliveries, every one of which succeeded.
    pub events: i64,
    /// Delivery attempts begun, over every delivery: those a crash cut
    /// short (which have no recorded attempt) included.
    pub attempts: i64,
    /// Orders the inbox receivers shipped.
    pub shipped: i64,
}

impl Delivered {
    /// The counts, or `None` when there is no webhook endpoint.
    pub async fn measure(pool: &PgPool) -> Option<Self> {
        let (endpoints, events, attempts, shipped): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM webhook_endpoints),
                    (SELECT count(*) FROM events e
                      WHERE EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.event_seq = e.seq)
                        AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d
                                         WHERE d.event_seq = e.seq AND d.status <> 'succeeded')),
                    (SELECT coalesce(sum(attempts), 0)::bigint FROM webhook_deliveries),
                    (SELECT count(*) FROM demo_shipments WHERE mode = 'inbox')",
        )
        .fetch_one(pool)
        .await
        .expect("count the webhook deliveries");
        (endpoints > 0).then_some(Delivered {
            events,
            attempts,
            shipped,
        })
    }
}

impl Report {
    /// The row of a scenario of charges.
    pub async fn measure(scenario: &'static str, pool: &PgPool, outcomes: &[OpOutcome]) -> Self {
        let ledger_pool = processor_pool(pool).await;
        Self::measure_with(
            Ledger::Charges,
            scenario,
            pool,
            (&ledger_pool, None),
            outcomes,
        )
        .await
    }

    /// The row of a scenario of refunds.
    pub async fn measure_refunds(
        scenario: &'static str,
        pool: &PgPool,
        outcomes: &[OpOutcome],
    ) -> Self {
        let ledger_pool = processor_pool(pool).await;
        Self::measure_with(
            Ledger::Refunds,
            scenario,
            pool,
            (&ledger_pool, None),
            outcomes,
        )
        .await
    }

    /// The row of a scenario of `ledger`'s records, the gateway's ledger in
    /// `gateway.0`, wherever that database is (closed by the reconciliation
    /// at the end), read as the account whose secret key is `gateway.1`
    /// ([`ACCOUNT`] when `None`).
    pub async fn measure_with(
        ledger: Ledger,
        scenario: &'static str,
        pool: &PgPool,
        gateway: (&PgPool, Option<&str>),
        outcomes: &[OpOutcome],
    ) -> Self {
        let (ledger_pool, account_key) = gateway;
        let table = ledger.table();
        let count = |sql: String| async move {
            sqlx::query_scalar::<_, i64>(&sql)
                .fetch_one(pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
        };
        // The money moved, from the gateway's ledger, by processor key.
        let moved: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT p.key FROM operations p WHERE {}",
            ledger.effects()
        ))
        .fetch_all(ledger_pool)
        .await
        .expect("read the processor's ledger");
        let effects = moved.len() as i64;
        let succeeded = count(format!(
            "SELECT count(*) FROM {table} WHERE status = 'succeeded'"
        ))
        .await;
        let duplicate_records = count(format!(
            "SELECT coalesce(sum(n - 1), 0)::bigint FROM (
                 SELECT count(*) AS n FROM {table}
                  GROUP BY metadata->>'op' HAVING count(*) > 1) d"
        ))
        .await;
        let orphan_effects: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM unnest($1::text[]) AS p(key)
              WHERE NOT EXISTS (SELECT 1 FROM {table} r
                                 WHERE {} = p.key AND r.status = 'succeeded')",
            ledger.processor_key()
        ))
        .bind(&moved)
        .fetch_one(pool)
        .await
        .expect("match the ledger to the records");

        // Each acknowledgement must name a record of its own operation, in
        // the state it says: a succeeded charge; a refund as its body says,
        // succeeded or refused by the issuer (`failed`).
        type Named = (Vec<String>, Vec<Option<String>>, Vec<Option<String>>);
        let answered = |status: u16| -> Named {
            let mut named: Named = Default::default();
            for (o, a) in outcomes
                .iter()
                .flat_map(|o| o.answers.iter().map(move |a| (o, a)))
                .filter(|(_, a)| a.status == status)
            {
                let state = match (ledger, status) {
                    (Ledger::Refunds, 201) => a.state.clone().filter(|s| s != "pending"),
                    (_, 201) => Some("succeeded".to_owned()),
                    _ => Some("failed".to_owned()),
                };
                named.0.push(o.op.clone());
                named.1.push(a.id.clone());
                named.2.push(state);
            }
            named
        };
        let not_found = |(ops, ids, states): Named| {
            let sql = format!(
                "SELECT DISTINCT a.op FROM unnest($1::text[], $2::text[], $3::text[]) AS a(op, id, state)
                  WHERE NOT EXISTS (SELECT 1 FROM {table} r
                                     WHERE r.id = a.id AND r.status = a.state
                                       AND r.metadata->>'op' = a.op)"
            );
            async move {
                sqlx::query_scalar::<_, String>(&sql)
                    .bind(ops)
                    .bind(ids)
                    .bind(states)
                    .fetch_all(pool)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"))
            }
        };
        let lost = not_found(answered(201)).await.len() as i64;

        // A refusal names the failed charge of its own operation; nothing
        // else answers 402.
        let refused = answered(402);
        let mut wrong: BTreeSet<String> = match ledger {
            Ledger::Charges => not_found(refused).await.into_iter().collect(),
            Ledger::Refunds => refused.0.into_iter().collect(),
        };
        // And every client of one operation heard the same answer.
        wrong.extend(
            outcomes
                .iter()
                .filter(|o| o.answers.windows(2).any(|w| w[0] != w[1]))
                .map(|o| o.op.clone()),
        );

        let mut unpaired = unpaired_events(pool).await;
        let events = unpaired.len() as i64;
        unpaired.truncate(10);
        let mut webhook_violations = webhook_violations(pool).await;
        let webhooks = webhook_violations.len() as i64;
        webhook_violations.truncate(10);

        Report {
            scenario,
            operations: outcomes.len(),
            requests: outcomes.iter().map(|o| o.requests).sum(),
            effects,
            succeeded,
            duplicates: duplicate_records + orphan_effects,
            lost,
            wrong: wrong.len() as i64,
            events,
            unpaired,
            delivered: Delivered::measure(pool).await,
            webhooks,
            webhook_violations,
            five_xx: outcomes.iter().map(|o| o.five_xx).sum(),
            hung: outcomes.iter().map(|o| o.hung).sum(),
            undecided: outcomes.iter().filter(|o| o.answers.is_empty()).count(),
            reconciliation: reconciliation_differences_with(pool, ledger_pool.clone(), account_key)
                .await,
        }
    }

    /// Appends this row to `CHAOS_REPORT` (for `scripts/chaos`) and prints it.
    /// The webhook counts are empty fields when the scenario had no endpoint.
    pub fn publish(&self) {
        let (delivered, attempts, shipped) = match self.delivered {
            Some(d) => (
                d.events.to_string(),
                d.attempts.to_string(),
                d.shipped.to_string(),
            ),
            None => Default::default(),
        };
        let line = format!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            self.scenario,
            self.operations,
            self.requests,
            self.effects,
            self.succeeded,
            self.duplicates,
            self.lost,
            self.wrong,
            self.events,
            self.five_xx,
            delivered,
            attempts,
            shipped,
            self.webhooks,
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

    /// The invariant: one logical operation, one effect, nothing acknowledged
    /// lost, one answer per operation, true to the database, every change
    /// paired with its event, and every event delivered and shipped once.
    #[track_caller]
    pub fn assert_exactly_once(&self) {
        assert_eq!(self.duplicates, 0, "{self:?}");
        assert_eq!(self.lost, 0, "{self:?}");
        assert_eq!(self.wrong, 0, "{self:?}");
        assert_eq!(
            self.events, 0,
            "every change has its event and every event its change: {:#?}\n{self:?}",
            self.unpaired
        );
        assert_eq!(
            self.webhooks, 0,
            "every event delivered, and shipped once by the inbox: {:#?}\n{self:?}",
            self.webhook_violations
        );
        assert_eq!(
            self.effects, self.succeeded,
            "money moved equals succeeded records: {self:?}"
        );
        assert_eq!(
            self.hung, 0,
            "no request hung past the client timeout: {self:?}"
        );
        assert_eq!(
            self.undecided, 0,
            "every operation got a definite answer: {self:?}"
        );
        assert_eq!(
            self.reconciliation,
            Vec::<String>::new(),
            "reconciliation finds no difference: {self:?}"
        );
    }
}

/// Reconciles the scenario's database with its gateway's ledger, all of
/// time, through the library's reconciler and the ledger's HTTP API (a
/// gateway started here on the ledger, on a free port, whatever became of
/// the scenario's): each difference found, described. The scenario is over,
/// so nothing counts as in flight by age; pending records still do.
/// The ledger is `ledger`, wherever that database is (beside the scenario's,
/// or on a server of its own in a fleet), read as the account whose secret
/// key is `account_key`, or else as [`ACCOUNT`].
pub async fn reconciliation_differences_with(
    pool: &PgPool,
    ledger: PgPool,
    account_key: Option<&str>,
) -> Vec<String> {
    use oncepay::processor::{HttpProcessor, HttpSettings, LedgerClient};
    use oncepay::reconcile::{Reconciler, Window};

    let config = card_gateway::Config::from_lookup(|name| match name {
        "PROCESSOR_DATABASE_URL" => {
            Some(sqlx::ConnectOptions::to_url_lossy(&*ledger.connect_options()).to_string())
        }
        "PROCESSOR_BIND_ADDR" => Some("127.0.0.1".into()),
        "PROCESSOR_PORT" => Some("0".into()),
        _ => None,
    })
    .expect("a gateway configuration");
    let gateway = card_gateway::Gateway::build_with_pool(config, ledger)
        .await
        .expect("a gateway on the scenario's ledger");
    let api_key = match account_key {
        Some(key) => key.to_owned(),
        None => gateway
            .own_account(ACCOUNT)
            .await
            .expect("the tests' account at the gateway")
            .expose()
            .to_owned(),
    };
    let settings = HttpSettings {
        url: gateway.url(),
        api_key,
        connect_timeout: Duration::from_secs(1),
        timeout: Duration::from_secs(10),
        retries: 2,
        budget: Duration::from_secs(30),
        retry_window: Duration::from_secs(15),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(gateway.run_until_stopped(async {
        let _ = stopped.await;
    }));
    let reconciler = Reconciler::new(
        pool.clone(),
        LedgerClient::new(&settings).expect("a ledger client"),
        std::sync::Arc::new(HttpProcessor::new(settings).expect("a processor client")),
        Duration::ZERO,
    );
    let now = chrono::Utc::now();
    let window = Window::new(
        chrono::DateTime::UNIX_EPOCH,
        now + chrono::Duration::seconds(2),
    )
    .expect("a window");
    let reconciliation = reconciler.run(window, false).await;
    let _ = stop.send(());
    let _ = serving.await;
    reconciliation
        .expect("reconcile the scenario's databases")
        .differences
        .iter()
        .map(|d| format!("{} {}: {}", d.kind.as_str(), d.key, d.detail))
        .collect()
}

/// Folds the outcomes of several clients of the same operation into one
/// per operation: requests, `409`s and `5xx` add up, and every client's
/// answer is kept, for the report to check that they agree.
pub fn merge(outcomes: Vec<OpOutcome>) -> Vec<OpOutcome> {
    let mut by_key: HashMap<String, OpOutcome> = HashMap::new();
    for o in outcomes {
        let entry = by_key
            .entry(o.key.clone())
            .or_insert_with(|| OpOutcome::new(&o.op, &o.key));
        assert_eq!(entry.op, o.op, "one key, one operation");
        entry.requests += o.requests;
        entry.in_use += o.in_use;
        entry.five_xx += o.five_xx;
        entry.hung += o.hung;
        entry.answers.extend(o.answers);
    }
    let mut merged: Vec<_> = by_key.into_values().collect();
    merged.sort_by(|a, b| a.key.cmp(&b.key));
    merged
}

/// Waits until nothing is pending (charges and refunds), or panics at
/// `deadline`.
pub async fn wait_until_settled(pool: &PgPool, deadline: Instant) {
    eventually(deadline, "no charge or refund is pending", || async {
        let pending: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM charges WHERE status = 'pending')
                  + (SELECT count(*) FROM refunds WHERE status = 'pending')",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        (pending == 0).then_some(())
    })
    .await
}

/// Sends each operation's first attempt to `server` with `fault`, which
/// aborts the process; starts the process again and retries the operation
/// until a definite answer, for as long as `timing` says recovery may take
/// from the claim. Returns the outcomes, and the slowest time from a restart
/// to a definite answer.
pub async fn crash_each(
    server: &mut Server,
    path: &str,
    operations: &[(String, Value)],
    fault: &str,
    timing: Timing,
) -> (Vec<OpOutcome>, Duration) {
    let http = client(Duration::from_secs(15));
    let mut outcomes = Vec::new();
    let mut slowest = Duration::ZERO;
    for (key, body) in operations {
        let first = post(
            &http,
            &server.url(),
            path,
            key,
            body,
            &[("Oncepay-Fault", fault)],
        )
        .await;
        // The claim committed before this instant.
        let claimed = Instant::now();
        assert!(
            first.is_err(),
            "the process died before answering: {first:?}"
        );
        let status = server.wait_exit().await;
        assert!(!status.success(), "aborted, as kill -9 would: {status}");
        server.restart().await;
        let restarted = Instant::now();
        let deadline = claimed + timing.recovered_within();
        let mut outcome = drive_to(&http, &[server.url()], path, key, body, &[], deadline).await;
        slowest = slowest.max(restarted.elapsed());
        outcome.requests += 1;
        outcomes.push(outcome);
    }
    (outcomes, slowest)
}

/// Every way the database breaks "no event without its change, no change
/// without its event", described, read in one statement (one snapshot, so
/// a settle committing meanwhile is seen whole or not at all):
///
/// - a succeeded charge has exactly one `charge.succeeded` and no
///   `charge.failed`; a failed one exactly one `charge.failed` and no
///   `charge.succeeded`; a pending one neither;
/// - a charge has one `charge.refunded` per succeeded refund of it;
/// - a succeeded refund has exactly one `refund.created` and no
///   `refund.failed`; a failed one exactly one `refund.failed` and no
///   `refund.created`; a pending one neither;
/// - every event is about an object of the merchant that exists, of the
///   kind its type names, whose snapshot (`data.object`) names it and is in
///   the state the type says, as the row is: `succeeded` for
///   `charge.succeeded`, `charge.refunded` and `refund.created`, `failed`
///   for `charge.failed` and `refund.failed`.
pub async fn unpaired_events(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar::<_, String>(
        "WITH n AS (
             SELECT object_id,
                    count(*) FILTER (WHERE type = 'charge.succeeded') AS charge_succeeded,
                    count(*) FILTER (WHERE type = 'charge.failed') AS charge_failed,
                    count(*) FILTER (WHERE type = 'charge.refunded') AS charge_refunded,
                    count(*) FILTER (WHERE type = 'refund.created') AS refund_created,
                    count(*) FILTER (WHERE type = 'refund.failed') AS refund_failed
               FROM events GROUP BY object_id),
         c AS (
             SELECT c.id, c.status,
                    coalesce(n.charge_succeeded, 0) AS succeeded,
                    coalesce(n.charge_failed, 0) AS failed,
                    coalesce(n.charge_refunded, 0) AS refunded,
                    (SELECT count(*) FROM refunds r
                      WHERE r.charge_id = c.id AND r.status = 'succeeded') AS refunds
               FROM charges c LEFT JOIN n ON n.object_id = c.id),
         r AS (
             SELECT r.id, r.status,
                    coalesce(n.refund_created, 0) AS succeeded,
                    coalesce(n.refund_failed, 0) AS failed
               FROM refunds r LEFT JOIN n ON n.object_id = r.id),
         e AS (
             SELECT e.*, CASE WHEN e.type IN ('charge.failed', 'refund.failed')
                              THEN 'failed' ELSE 'succeeded' END AS says
               FROM events e)
         SELECT format('charge %s is %s, with %s charge.succeeded and %s charge.failed',
                       id, status, succeeded, failed)
           FROM c
          WHERE (succeeded, failed) <> (CASE WHEN status = 'succeeded' THEN 1 ELSE 0 END,
                                        CASE WHEN status = 'failed' THEN 1 ELSE 0 END)
         UNION ALL
         SELECT format('charge %s has %s charge.refunded for %s succeeded refunds',
                       id, refunded, refunds)
           FROM c WHERE refunded <> refunds
         UNION ALL
         SELECT format('refund %s is %s, with %s refund.created and %s refund.failed',
                       id, status, succeeded, failed)
           FROM r
          WHERE (succeeded, failed) <> (CASE WHEN status = 'succeeded' THEN 1 ELSE 0 END,
                                        CASE WHEN status = 'failed' THEN 1 ELSE 0 END)
         UNION ALL
         SELECT format('%s %s says %s %s is %s (its snapshot: %s %s %s), but it is %s',
                       e.type, e.id, split_part(e.type, '.', 1), e.object_id, e.says,
                       e.data->>'object', e.data->>'id', e.data->>'status',
                       coalesce(o.status, 'missing'))
           FROM e
           LEFT JOIN LATERAL (
                SELECT status, merchant_id FROM charges
                 WHERE id = e.object_id AND e.type LIKE 'charge.%'
                UNION ALL
                SELECT status, merchant_id FROM refunds
                 WHERE id = e.object_id AND e.type LIKE 'refund.%') o ON true
          WHERE NOT coalesce(o.status = e.says AND o.merchant_id = e.merchant_id
                             AND e.data->>'status' = e.says
                             AND e.data->>'id' = e.object_id
                             AND e.data->>'object' = split_part(e.type, '.', 1), false)",
    )
    .fetch_all(pool)
    .await
    .expect("read the events and their records")
}

/// Every way the database breaks the webhook property, described, read in
/// one statement:
///
/// - a succeeded charge has exactly one `charge.succeeded` event (the event
///   its webhooks carry);
/// - an inbox receiver ships exactly one order for each event it received,
///   however many times it received it, and none for an event it did not
///   receive or that is no event of this database;
/// - every delivery has ended `succeeded`. The chaos scenarios never delete
///   or disable an endpoint and every receiver answers in the end, so a
///   delivery still pending or `failed` once the scenario has waited for
///   them ([`wait_until_delivered`]) is one lost.
///
/// A database without webhook endpoints or receivers breaks only the first.
pub async fn webhook_violations(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar::<_, String>(
        "WITH paid AS (
             SELECT c.id,
                    (SELECT count(*) FROM events e
                      WHERE e.object_id = c.id AND e.type = 'charge.succeeded') AS events
               FROM charges c WHERE c.status = 'succeeded'),
         received AS (
             SELECT r.run, r.event_id, r.deliveries,
                    (SELECT count(*) FROM demo_shipments s
                      WHERE s.run = r.run AND s.mode = 'inbox' AND s.event_id = r.event_id) AS shipped
               FROM demo_receiver_deliveries r WHERE r.mode = 'inbox')
         SELECT format('charge %s succeeded with %s charge.succeeded events', id, events)
           FROM paid WHERE events <> 1
         UNION ALL
         SELECT format('the inbox of run %s received %s %s times and shipped %s orders for it',
                       run, event_id, deliveries, shipped)
           FROM received WHERE shipped <> 1
         UNION ALL
         SELECT format('the inbox of run %s received %s, which is no event of this database',
                       run, event_id)
           FROM received WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.id = received.event_id)
         UNION ALL
         SELECT format('the inbox of run %s shipped an order for %s, which it never received',
                       s.run, s.event_id)
           FROM demo_shipments s
          WHERE s.mode = 'inbox'
            AND NOT EXISTS (SELECT 1 FROM received r
                             WHERE r.run = s.run AND r.event_id = s.event_id)
         UNION ALL
         SELECT format('the delivery of %s to %s is %s after %s attempts (%s)',
                       e.id, d.endpoint_id, d.status, d.attempts,
                       coalesce(d.failure_reason, 'not ended'))
           FROM webhook_deliveries d JOIN events e ON e.seq = d.event_seq
          WHERE d.status <> 'succeeded'",
    )
    .fetch_all(pool)
    .await
    .expect("read the events, their deliveries and the receivers' shipments")
}

/// Waits until no webhook delivery is pending, or panics at `deadline`.
pub async fn wait_until_delivered(pool: &PgPool, deadline: Instant) {
    eventually(deadline, "no webhook delivery is pending", || async {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries WHERE status = 'pending'")
                .fetch_one(pool)
                .await
                .unwrap();
        (pending == 0).then_some(())
    })
    .await
}

/// Asserts that the database pairs every change with its event and every
/// event with its change ([`unpaired_events`]).
pub async fn assert_events_paired(pool: &PgPool) {
    let unpaired = unpaired_events(pool).await;
    assert!(
        unpaired.is_empty(),
        "every change has its event and every event its change: {unpaired:#?}"
    );
}
