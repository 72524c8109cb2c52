//! The fleet of `scripts/cluster` under failure, every request through
//! HAProxy: three `oncepay serve` on a pg_auto_failover primary and its
//! synchronous standby, the card gateway on a Postgres of its own. The
//! primary killed under load (charges and refunds), one instance killed,
//! the standby lost and brought back. Each test brings a fleet up in a
//! folder of its own and takes it down when it ends, failed or not.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::{
    API_KEY, Ledger, OpOutcome, Report, SLACK, START_BUDGET, charge_body, client, drive_observed,
    eventually, port_taken, refund_body, wait_until_settled,
};

/// A fleet started by `scripts/cluster up` in a folder of its own; taken
/// down (and its folder removed) when dropped, a panic included.
pub struct Fleet {
    dir: PathBuf,
    port: u16,
    settings: Vec<(String, String)>,
    env: HashMap<String, String>,
}

/// A first port with the 40 after it free on 127.0.0.1.
pub(crate) fn free_port_range() -> u16 {
    for _ in 0..200 {
        let first = 20_000 + (Uuid::new_v4().as_u128() % 30_000) as u16;
        if (first..first + 40).all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok()) {
            return first;
        }
    }
    panic!("no 40 free ports in a row from 20000 to 50000");
}

/// The `CLUSTER_*` variables of `file` as `bash` sets them when it
/// `source`s the file (the way the docs tell a reader to use it).
fn sourced(file: &Path) -> HashMap<String, String> {
    let out = Command::new("bash")
        .args([
            "-c",
            r#"set -eu; source "$1"; for n in "${!CLUSTER_@}"; do printf '%s=%s\0' "$n" "${!n}"; done"#,
            "_",
        ])
        .arg(file)
        .output()
        .expect("run bash");
    assert!(
        out.status.success(),
        "source {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("the env file is UTF-8")
        .split_terminator('\0')
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

impl Fleet {
    /// Brings a fleet up with `settings` for its processes (every oncepay
    /// setting reaches the instances, `PROCESSOR_*` the gateway).
    ///
    /// The ports are a free range when chosen, but another process may take
    /// one before its part binds it: then the fleet is destroyed and brought
    /// up again in a new folder on a new range.
    pub async fn up(settings: &[(&str, &str)]) -> Fleet {
        let mut tries = 0;
        let mut fleet = loop {
            tries += 1;
            let fleet = Fleet {
                dir: std::env::temp_dir()
                    .join(format!("oncepay-fleet-{}", Uuid::new_v4().simple())),
                port: free_port_range(),
                settings: settings
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                env: HashMap::new(),
            };
            let out = fleet.cluster(&["up"]).await;
            if out.status.success() {
                break fleet;
            }
            let said = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stderr),
                fleet.log_tails()
            );
            assert!(
                port_taken(&said) && tries < 5,
                "scripts/cluster up failed: {said}"
            );
            eprintln!("a port of the fleet's was taken before its part bound it; a new range");
        };
        fleet.env = sourced(&fleet.dir.join("env"));
        // The formation's URL, `&` and all, survives `source`.
        let database = pg_follow::PgUrl::parse(&fleet.var("CLUSTER_DATABASE_URL"))
            .expect("CLUSTER_DATABASE_URL is a Postgres URL");
        assert_eq!(
            database.hosts().len(),
            2,
            "both nodes in CLUSTER_DATABASE_URL"
        );
        assert!(database.target_given(), "the formation's target in the URL");
        fleet
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster"));
        command
            .args(args)
            .env("CLUSTER_DIR", &self.dir)
            .env("CLUSTER_PORT", self.port.to_string())
            .env("CLUSTER_INSTANCES", "3")
            .env("ONCEPAY_BIN", env!("CARGO_BIN_EXE_oncepay"))
            .env("DEMO_API_KEY", API_KEY)
            .env("RUST_LOG", "info,sqlx=warn")
            .envs(self.settings.iter().cloned())
            .stdin(Stdio::null());
        command
    }

    /// Runs `scripts/cluster ARGS` off the runtime's threads.
    pub async fn cluster(&self, args: &[&str]) -> Output {
        let mut command = self.command(args);
        tokio::task::spawn_blocking(move || command.output().expect("run scripts/cluster"))
            .await
            .unwrap()
    }

    fn var(&self, name: &str) -> String {
        self.env
            .get(name)
            .unwrap_or_else(|| panic!("{name} in the fleet's env"))
            .clone()
    }

    /// The balancer.
    pub fn url(&self) -> String {
        self.var("CLUSTER_URL")
    }

    /// `scripts/cluster kill PART`: the part killed, its whole process group.
    pub async fn kill(&self, part: &str) -> String {
        let out = self.cluster(&["kill", part]).await;
        assert!(
            out.status.success(),
            "scripts/cluster kill {part}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `scripts/cluster up` again: starts what is not running, on its ports,
    /// trying again while another process holds one of them.
    pub async fn bring_back(&self) {
        let deadline = Instant::now() + START_BUDGET;
        loop {
            let out = self.cluster(&["up"]).await;
            if out.status.success() {
                return;
            }
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(
                port_taken(&said) && Instant::now() < deadline,
                "scripts/cluster up (again): {said}"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The node the monitor has as primary now, with its single-host URL.
    pub async fn primary(&self) -> Option<(String, String)> {
        let out = self.cluster(&["primary"]).await;
        let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let (name, url) = line.split_once(' ')?;
        Some((name.to_owned(), url.to_owned()))
    }

    /// A pool on the primary, once there is one (or at `deadline`).
    pub async fn primary_pool(&self, deadline: Instant) -> PgPool {
        let (_, url) = eventually(deadline, "the monitor names a primary", || self.primary()).await;
        PgPool::connect(&url).await.expect("connect to the primary")
    }

    /// A pool on the card gateway's ledger.
    pub async fn ledger_pool(&self) -> PgPool {
        PgPool::connect(&self.var("CLUSTER_PROCESSOR_DATABASE_URL"))
            .await
            .expect("connect to the gateway's ledger")
    }

    /// A pool on the monitor.
    pub async fn monitor_pool(&self) -> PgPool {
        PgPool::connect(&self.var("CLUSTER_MONITOR_URL"))
            .await
            .expect("connect to the monitor")
    }

    /// `oncepay reconcile` over the last hour, against the primary and the
    /// fleet's gateway: its exit status and output.
    pub async fn reconcile(&self, primary_url: &str) -> Output {
        let mut command = Command::new(env!("CARGO_BIN_EXE_oncepay"));
        command
            .args(["reconcile", "--window", "1h"])
            .env_clear()
            .env("DATABASE_URL", primary_url)
            .env("PROCESSOR_URL", self.var("CLUSTER_PROCESSOR_URL"))
            .env("PROCESSOR_API_KEY", self.var("CLUSTER_PROCESSOR_API_KEY"))
            .env("RUST_LOG", "warn")
            .current_dir("/")
            .stdin(Stdio::null());
        tokio::task::spawn_blocking(move || command.output().expect("run oncepay reconcile"))
            .await
            .unwrap()
    }

    /// Every part's log, its last lines.
    fn log_tails(&self) -> String {
        let mut tails = String::new();
        let Ok(entries) = std::fs::read_dir(self.dir.join("logs")) else {
            return tails;
        };
        for entry in entries.flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            tails += &format!("--- {}\n{tail}\n", entry.path().display());
        }
        tails
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the fleet's logs:\n{}", self.log_tails());
        }
        match self.command(&["destroy"]).output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "scripts/cluster destroy failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("scripts/cluster destroy: {e}"),
        }
    }
}

/// One request a client sent: its key, when, when it ended, and its status
/// (`None`: no answer).
#[derive(Debug, Clone)]
pub struct Attempt {
    pub key: String,
    pub sent: Instant,
    pub ended: Instant,
    pub status: Option<u16>,
}

/// The attempts of every client of a scenario.
pub type Attempts = Arc<Mutex<Vec<Attempt>>>;

/// A well-behaved client, as [`crate::harness::drive_to`], that logs every
/// attempt: retries one operation on `path` with the same key until a
/// definite answer (`201`, `402`, a `400` of the [`crate::harness::REFUSALS`]) or `deadline`.
async fn drive_logged(
    http: &reqwest::Client,
    url: &str,
    path: &str,
    key: &str,
    body: &Value,
    deadline: Instant,
    attempts: &Attempts,
) -> OpOutcome {
    let urls = [url.to_owned()];
    drive_observed(
        http,
        &urls,
        path,
        key,
        body,
        &[],
        deadline,
        |sent, status| {
            attempts.lock().unwrap().push(Attempt {
                key: key.to_owned(),
                sent,
                ended: Instant::now(),
                status,
            });
        },
    )
    .await
}

/// Clients that charge, one operation after another, each through the
/// balancer, and refund half of each charge they got a `201` for, until
/// stopped.
pub struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<(Vec<OpOutcome>, Vec<OpOutcome>)>>,
    pub attempts: Attempts,
}

impl Load {
    pub fn start(url: &str, name: &str, workers: usize, refunds: bool) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let attempts: Attempts = Arc::default();
        // Long enough for a failover and the sweep after it.
        let deadline = Instant::now() + Duration::from_secs(180);
        let workers = (0..workers)
            .map(|w| {
                let (stop, attempts) = (stop.clone(), attempts.clone());
                let (url, name) = (url.to_owned(), name.to_owned());
                tokio::spawn(async move {
                    let http = client(Duration::from_secs(15));
                    let (mut charges, mut refunded) = (Vec::new(), Vec::new());
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let op = format!("{name}-{w}-{n}");
                        let body = charge_body(&op, 2000, "tok_visa");
                        let charge = drive_logged(
                            &http,
                            &url,
                            "/v1/charges",
                            &op,
                            &body,
                            deadline,
                            &attempts,
                        )
                        .await;
                        let id = charge
                            .answers
                            .first()
                            .filter(|a| a.status == 201)
                            .and_then(|a| a.id.clone());
                        charges.push(charge);
                        if let (true, Some(id)) = (refunds, id) {
                            let op = format!("{op}-refund");
                            let body = refund_body(&op, &id, 1000);
                            refunded.push(
                                drive_logged(
                                    &http,
                                    &url,
                                    "/v1/refunds",
                                    &op,
                                    &body,
                                    deadline,
                                    &attempts,
                                )
                                .await,
                            );
                        }
                    }
                    (charges, refunded)
                })
            })
            .collect();
        Load {
            stop,
            workers,
            attempts,
        }
    }

    /// When the first `201` to a request sent after `since` came, if one has.
    pub fn first_acknowledged_after(&self, since: Instant) -> Option<Instant> {
        self.attempts
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.sent >= since && a.status == Some(201))
            .map(|a| a.ended)
            .min()
    }

    /// Waits for the first `201` to a request sent after `since`.
    pub async fn wait_acknowledged_after(&self, since: Instant, deadline: Instant) -> Instant {
        eventually(
            deadline,
            "a 201 to a request sent after the fault",
            || async { self.first_acknowledged_after(since) },
        )
        .await
    }

    /// Stops the clients once their operations end: the outcomes of the
    /// charges and of the refunds.
    pub async fn finish(self) -> (Vec<OpOutcome>, Vec<OpOutcome>, Vec<Attempt>) {
        self.stop.store(true, Ordering::Relaxed);
        let (mut charges, mut refunds) = (Vec::new(), Vec::new());
        for worker in self.workers {
            let (c, r) = worker.await.expect("a client panicked");
            charges.extend(c);
            refunds.extend(r);
        }
        let attempts = self.attempts.lock().unwrap().clone();
        (charges, refunds, attempts)
    }
}

/// Idempotency keys still `processing`.
async fn keys_processing(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE status = 'processing'")
        .fetch_one(pool)
        .await
        .expect("count the keys in flight")
}

/// Waits until nothing is pending and no key is processing: the sweep is
/// over.
async fn wait_until_swept(pool: &PgPool, deadline: Instant) {
    wait_until_settled(pool, deadline).await;
    eventually(deadline, "no key is left processing", || async {
        (keys_processing(pool).await == 0).then_some(())
    })
    .await;
}

/// Prints a scenario's figures and appends them to `CHAOS_FIGURES`.
fn publish_figures(figures: &str) {
    eprintln!("{figures}");
    if let Ok(path) = std::env::var("CHAOS_FIGURES") {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        writeln!(file, "{figures}").unwrap();
    }
}

/// The settings of a fleet whose faults end within a test: a key is stale
/// after 6 s and swept within half a second of that; a request waits 2 s at
/// most for a connection while the database is away.
const SETTINGS: [(&str, &str); 3] = [
    ("PROCESSING_TIMEOUT", "6s"),
    ("SWEEP_INTERVAL", "500ms"),
    ("DATABASE_ACQUIRE_TIMEOUT", "2s"),
];
const PROCESSING_TIMEOUT: Duration = Duration::from_secs(6);

/// The reports of a scenario's charges and refunds, published and asserted;
/// `oncepay reconcile` finds no difference.
async fn report_and_reconcile(
    fleet: &Fleet,
    scenario: (&'static str, Option<&'static str>),
    charges: &[OpOutcome],
    refunds: &[OpOutcome],
) {
    let deadline = Instant::now() + PROCESSING_TIMEOUT * 3 + SLACK * 4;
    let pool = fleet.primary_pool(deadline).await;
    wait_until_swept(&pool, deadline).await;
    // A pool each: the reconciliation's gateway closes its pool as it stops.
    // The instances' account at the gateway, which scripts/cluster made.
    let account_key = fleet.var("CLUSTER_PROCESSOR_API_KEY");
    let gateway = |ledger| (ledger, Some(account_key.as_str()));
    let ledger = fleet.ledger_pool().await;
    let report = Report::measure_with(
        Ledger::Charges,
        scenario.0,
        &pool,
        gateway(&ledger),
        charges,
    )
    .await;
    report.publish();
    report.assert_exactly_once();
    assert!(report.succeeded > 0, "charges succeeded: {report:?}");
    if let Some(name) = scenario.1 {
        let ledger = fleet.ledger_pool().await;
        let report =
            Report::measure_with(Ledger::Refunds, name, &pool, gateway(&ledger), refunds).await;
        report.publish();
        report.assert_exactly_once();
        assert!(report.succeeded > 0, "refunds succeeded: {report:?}");
    }
    let (_, primary_url) = fleet.primary().await.expect("a primary");
    let reconciled = fleet.reconcile(&primary_url).await;
    assert!(
        reconciled.status.success(),
        "oncepay reconcile finds no difference: {}{}",
        String::from_utf8_lossy(&reconciled.stdout),
        String::from_utf8_lossy(&reconciled.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_killed_under_load_loses_no_acknowledged_write_and_doubles_none() {
    let fleet = Fleet::up(&SETTINGS).await;
    let (old, _) = fleet.primary().await.expect("a primary");
    let load = Load::start(&fleet.url(), "failover", 6, true);
    tokio::time::sleep(Duration::from_secs(3)).await;

    let killed = fleet.kill("primary").await;
    let killed_at = Instant::now();
    assert_eq!(killed, old, "the primary was killed");
    let recovered_at = load
        .wait_acknowledged_after(killed_at, killed_at + Duration::from_secs(90))
        .await;
    let promoted_at = eventually(
        killed_at + Duration::from_secs(60),
        "the standby is the primary",
        || async {
            fleet
                .primary()
                .await
                .filter(|(name, _)| *name != old)
                .map(|_| Instant::now())
        },
    )
    .await;
    // Writes go on for a while on the promoted node.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (charges, refunds, attempts) = load.finish().await;
    let (before, after) = {
        let acks = attempts.iter().filter(|a| a.status == Some(201));
        (
            acks.clone().filter(|a| a.ended < killed_at).count(),
            acks.filter(|a| a.sent >= killed_at).count(),
        )
    };
    assert!(
        before > 0 && after > 0,
        "201s before ({before}) and after ({after}) the kill"
    );

    report_and_reconcile(
        &fleet,
        (
            "fleet: primary killed, charges",
            Some("fleet: primary killed, refunds"),
        ),
        &charges,
        &refunds,
    )
    .await;
    publish_figures(&format!(
        "fleet, primary killed under load (6 clients, charges and refunds): {old} killed; \
         the monitor named the standby primary within {:.1} s; the first 201 after the kill \
         came {:.1} s after it; {before} 201s before the kill, {after} after, every one found",
        (promoted_at - killed_at).as_secs_f64(),
        (recovered_at - killed_at).as_secs_f64(),
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a fleet of its own, a minute; scripts/chaos runs it"]
async fn an_instance_killed_behind_the_balancer_fails_only_its_requests_in_flight() {
    let mut settings = SETTINGS.to_vec();
    // Each charge spends half a second at the gateway: the killed instance
    // has requests in flight.
    settings.push(("PROCESSOR_LATENCY_MS", "500"));
    let fleet = Fleet::up(&settings).await;
    let load = Load::start(&fleet.url(), "instance", 9, false);
    tokio::time::sleep(Duration::from_secs(3)).await;

    let kill_sent = Instant::now();
    fleet.kill("instance2").await;
    let killed_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (charges, refunds, attempts) = load.finish().await;
    let failed: Vec<&Attempt> = attempts
        .iter()
        .filter(|a| a.status.is_none_or(|s| s >= 500))
        .collect();
    // The operations with a request in flight when the instance died: the
    // requests it was serving failed; their retries may wait for the key
    // (claimed by the dead instance) until it is stale and swept, and get
    // `503 request_timeout` meanwhile. Every other operation went through.
    let in_flight: std::collections::BTreeSet<&str> = attempts
        .iter()
        .filter(|a| a.sent < killed_at && a.ended >= kill_sent)
        .map(|a| a.key.as_str())
        .collect();
    // Cut: no answer, or HAProxy's 502 for a server gone mid-request.
    let cut = failed
        .iter()
        .filter(|a| a.sent < killed_at && a.ended >= kill_sent)
        .count();
    assert!(
        cut > 0,
        "the killed instance had requests in flight, which failed: {failed:?}"
    );
    let others: Vec<&&Attempt> = failed
        .iter()
        .filter(|a| !in_flight.contains(a.key.as_str()))
        .collect();
    assert!(
        others.is_empty(),
        "only the operations in flight at the kill saw a failure: {others:?}"
    );
    let ops_failed: std::collections::BTreeSet<&str> =
        failed.iter().map(|a| a.key.as_str()).collect();
    let answered_after = attempts
        .iter()
        .filter(|a| a.sent >= killed_at && a.status == Some(201))
        .count();
    assert!(answered_after > 0, "the two others went on");

    report_and_reconcile(
        &fleet,
        ("fleet: one instance killed", None),
        &charges,
        &refunds,
    )
    .await;
    publish_figures(&format!(
        "fleet, one of three instances killed under load (9 clients): {cut} requests cut at \
         the kill, {} failed attempts in all, every one of the {} operations in flight at the \
         kill, each retried to one charge; {answered_after} 201s to requests sent after the kill",
        failed.len(),
        ops_failed.len(),
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a fleet of its own, a minute; scripts/chaos runs it"]
async fn the_standby_lost_then_back_lets_writes_go_on_and_doubles_none() {
    let fleet = Fleet::up(&SETTINGS).await;
    let monitor = fleet.monitor_pool().await;
    let (primary, _) = fleet.primary().await.expect("a primary");
    let load = Load::start(&fleet.url(), "standby", 6, false);
    tokio::time::sleep(Duration::from_secs(3)).await;

    let standby = fleet.kill("standby").await;
    let killed_at = Instant::now();
    assert_ne!(standby, primary);
    // The monitor lets the primary take writes alone: wait_primary, no
    // synchronous standby.
    let alone_at = eventually(
        killed_at + Duration::from_secs(60),
        "the primary is wait_primary",
        || async {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT reportedstate::text FROM pgautofailover.node WHERE nodename = $1",
            )
            .bind(&primary)
            .fetch_optional(&monitor)
            .await
            .unwrap();
            (state.as_deref() == Some("wait_primary")).then(Instant::now)
        },
    )
    .await;
    let recovered_at = load
        .wait_acknowledged_after(alone_at, killed_at + Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Back: `up` waits until the standby is a synchronous secondary again.
    let back_from = Instant::now();
    fleet.bring_back().await;
    let back_in = back_from.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (charges, refunds, attempts) = load.finish().await;
    let after = attempts
        .iter()
        .filter(|a| a.sent >= alone_at && a.status == Some(201))
        .count();
    assert!(after > 0, "writes went on with the standby away");

    report_and_reconcile(
        &fleet,
        ("fleet: standby lost, then back", None),
        &charges,
        &refunds,
    )
    .await;
    publish_figures(&format!(
        "fleet, synchronous standby killed under load (6 clients): the primary ran alone \
         (wait_primary) {:.1} s after the kill; the first 201 after that came {:.1} s after \
         the kill; back as a synchronous secondary in {:.1} s",
        (alone_at - killed_at).as_secs_f64(),
        (recovered_at - killed_at).as_secs_f64(),
        back_in.as_secs_f64(),
    ));
}
