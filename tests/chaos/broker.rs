//! The broker boundary under failure: real `oncepay relay` and `oncepay
//! consume` processes, killed at the points that make a hop repeat, and a
//! NATS server restarted under load. Each scenario ends with every event
//! applied exactly once by the inbox consumer (its ledger agrees with the
//! charges and refunds) and reports how many duplicates the broker
//! delivered (deliveries beyond one per event: redeliveries, and second
//! copies in the stream) to `CHAOS_BROKER_REPORT`.
//!
//! Needs NATS with JetStream at `NATS_URL` (default nats://127.0.0.1:4222)
//! and, for the restart, Debian's `nats-server` to start one of its own.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::database::TestDb as Database;
use crate::harness::{SLACK, Server, charge_body, drive, scale, scratch_dir};

/// The broker settings of one scenario: a stream and subjects of its own.
struct Broker {
    url: String,
    stream: String,
    prefix: String,
}

impl Broker {
    fn on(url: &str) -> Self {
        let tag = Uuid::new_v4().simple().to_string()[..12].to_owned();
        Broker {
            url: url.to_owned(),
            stream: format!("CHAOS_{tag}"),
            prefix: format!("chaos.{tag}"),
        }
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("NATS_URL", self.url.clone()),
            ("NATS_STREAM", self.stream.clone()),
            ("NATS_SUBJECT_PREFIX", self.prefix.clone()),
            ("RELAY_POLL_INTERVAL", "50ms".into()),
            ("RELAY_BATCH", "5".into()),
            ("CONSUMER_ACK_WAIT", "1s".into()),
        ]
    }

    /// Waits until the stream has a leader and every one of its `replicas`
    /// copies is current, and the ledger's durable consumer exists: a node
    /// killed before that leaves too few peers to place the stream on, and
    /// the scenario would test placement, not the loss of a copy.
    async fn replicated(&self, replicas: usize, within: Duration) {
        let js = self.js().await;
        let deadline = Instant::now() + within;
        loop {
            let mut seen = String::from("no stream yet");
            if let Ok(mut stream) = js.get_stream(&self.stream).await {
                let cluster = stream.info().await.ok().and_then(|i| i.cluster.clone());
                let current = cluster.as_ref().map_or(0, |c| {
                    usize::from(c.leader.is_some())
                        + c.replicas.iter().filter(|r| r.current).count()
                });
                let consumer = stream
                    .get_consumer::<jetstream::consumer::pull::Config>("ledger")
                    .await
                    .is_ok();
                if current == replicas && consumer {
                    return;
                }
                seen = format!("{current} current copies, ledger consumer: {consumer}");
            }
            assert!(
                Instant::now() < deadline,
                "the stream was not replicated {replicas} times: {seen}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the ledger's durable consumer has delivered a message
    /// not yet acknowledged.
    async fn ledger_holds_unacked(&self, within: Duration) {
        let js = self.js().await;
        let deadline = Instant::now() + within;
        loop {
            if let Ok(stream) = js.get_stream(&self.stream).await {
                if let Ok(mut consumer) = stream
                    .get_consumer::<jetstream::consumer::pull::Config>("ledger")
                    .await
                {
                    if consumer.info().await.is_ok_and(|i| i.num_ack_pending > 0) {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "the ledger consumer held no message in {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Deletes the scenario's stream, at its end.
    async fn delete_stream(&self) {
        self.js().await.delete_stream(&self.stream).await.unwrap();
    }

    async fn js(&self) -> jetstream::Context {
        let addrs: Vec<async_nats::ServerAddr> =
            self.url.split(',').map(|u| u.parse().unwrap()).collect();
        let client = async_nats::connect(addrs).await.unwrap();
        jetstream::new(client)
    }
}

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// `oncepay relay` or `oncepay consume` as a process of its own.
struct Worker {
    child: Option<Child>,
    log: PathBuf,
}

impl Worker {
    fn start(args: &[&str], database_url: &str, env: &[(&'static str, String)]) -> Self {
        let log = scratch_dir("broker").join(format!("{}.log", args[0]));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(args)
            .env_clear()
            .env("DATABASE_URL", database_url)
            .env("RUST_LOG", "info,sqlx=warn")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        Worker {
            child: Some(child),
            log,
        }
    }

    /// Waits for a process that aborts on purpose to be gone.
    async fn exited(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut().unwrap();
        while child.try_wait().unwrap().is_none() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            assert!(
                Instant::now() < deadline,
                "it did not abort; its log:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Worker {
    /// Stops the process; when the scenario failed, prints the end of its
    /// log, which the failure's output then carries.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- the end of {}:", self.log.display());
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// Paid charges through `server`, one logical operation each; a tenth are
/// refunded in part, so refunds travel too.
async fn charges(server: &Server, count: usize) {
    let http = reqwest::Client::new();
    let urls = [server.url()];
    for n in 0..count {
        let key = format!("broker-{}", Uuid::new_v4().simple());
        let deadline = Instant::now() + SLACK * 4;
        let outcome = drive(
            &http,
            &urls,
            &key,
            &charge_body(&key, 1000 + n as i64, "tok_visa"),
            &[],
            deadline,
        )
        .await;
        let charge = outcome.answers.first().and_then(|a| a.id.clone());
        if n % 10 == 0 {
            if let Some(charge) = charge {
                let body = json!({"charge": charge, "amount": 100});
                let refund = http
                    .post(format!("{}/v1/refunds", server.url()))
                    .bearer_auth(crate::harness::API_KEY)
                    .header("Idempotency-Key", format!("{key}-refund"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(refund.status(), 201);
            }
        }
    }
}

/// A scenario's row: events, duplicates delivered, effects applied, lost,
/// and messages parked (not oncepay's events, or not as oncepay wrote them).
#[derive(Debug)]
struct Row {
    scenario: &'static str,
    events: i64,
    in_stream: u64,
    duplicates_delivered: i64,
    applied: i64,
    lost: i64,
    parked: i64,
    ledger_differences: usize,
}

impl Row {
    /// Waits until the consumer named `ledger` has taken every event and
    /// the broker has nothing left for it, then measures.
    async fn settle(
        scenario: &'static str,
        pool: &PgPool,
        broker: &Broker,
        within: Duration,
    ) -> Self {
        let js = broker.js().await;
        let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
            .fetch_one(pool)
            .await
            .unwrap();
        let deadline = Instant::now() + within;
        loop {
            let applied: i64 =
                sqlx::query_scalar("SELECT count(*) FROM consumer_inbox WHERE consumer = 'ledger'")
                    .fetch_one(pool)
                    .await
                    .unwrap();
            let idle = match js.get_stream(&broker.stream).await {
                Ok(stream) => match stream
                    .get_consumer::<jetstream::consumer::pull::Config>("ledger")
                    .await
                {
                    Ok(mut c) => c
                        .info()
                        .await
                        .is_ok_and(|i| i.num_pending == 0 && i.num_ack_pending == 0),
                    Err(_) => false,
                },
                Err(_) => false,
            };
            if applied >= events && idle {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{scenario}: {applied} of {events} events applied"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut stream = js.get_stream(&broker.stream).await.unwrap();
        let in_stream = stream.info().await.unwrap().state.messages;
        let mut consumer = stream
            .get_consumer::<jetstream::consumer::pull::Config>("ledger")
            .await
            .unwrap();
        let deliveries = consumer.info().await.unwrap().delivered.consumer_sequence as i64;
        let applied: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM consumer_inbox i JOIN events e ON e.id = i.event_id WHERE i.consumer = 'ledger'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        let parked = parked_reasons(pool).await.values().sum::<i64>();
        let differences = oncepay::broker::ledger::check(pool, "ledger")
            .await
            .unwrap();
        Row {
            scenario,
            events,
            in_stream,
            // A parked message's first delivery is no duplicate either.
            duplicates_delivered: deliveries - events - parked,
            applied,
            lost: events - applied,
            parked,
            ledger_differences: differences.len(),
        }
    }

    fn publish(&self) {
        eprintln!("chaos broker report: {self:?}");
        if let Ok(path) = std::env::var("CHAOS_BROKER_REPORT") {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap();
            writeln!(
                file,
                "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                self.scenario,
                self.events,
                self.in_stream,
                self.duplicates_delivered,
                self.applied,
                self.lost,
                self.parked
            )
            .unwrap();
        }
    }

    /// Every event applied once: none lost, the ledger as the records say,
    /// and nothing parked (every message was one of oncepay's events).
    #[track_caller]
    fn assert_exactly_once(&self) {
        self.assert_exactly_once_and_parked(0);
    }

    /// Every event applied once, and `parked` other messages parked.
    #[track_caller]
    fn assert_exactly_once_and_parked(&self, parked: i64) {
        assert_eq!(self.applied, self.events, "{self:?}");
        assert_eq!(self.lost, 0, "{self:?}");
        assert_eq!(self.ledger_differences, 0, "{self:?}");
        assert_eq!(self.parked, parked, "{self:?}");
    }
}

/// The messages the consumer named `ledger` parked, by reason.
async fn parked_reasons(pool: &PgPool) -> std::collections::BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT reason, count(*) FROM consumer_dead_letters WHERE consumer = 'ledger' GROUP BY reason",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter().collect()
}

/// An API server whose relay is off (the scenario runs its own).
async fn api(db: &Database) -> Server {
    Server::start(&db.url, &[("RELAY_ENABLED", "false")]).await
}

fn with(
    mut env: Vec<(&'static str, String)>,
    more: &[(&'static str, &str)],
) -> Vec<(&'static str, String)> {
    env.extend(more.iter().map(|(k, v)| (*k, v.to_string())));
    env
}

#[tokio::test]
async fn a_relay_killed_between_publish_and_record_publishes_again_and_each_event_is_applied_once()
{
    let db = Database::create().await;
    let server = api(&db).await;
    charges(&server, 4 * scale()).await;
    let broker = Broker::on(&nats_url());
    let crash = with(
        broker.env(),
        &[
            ("FAULT_INJECTION", "true"),
            ("BROKER_FAULT", "crash-after-publish"),
        ],
    );
    let mut dying = Worker::start(&["relay"], &db.url, &crash);
    dying.exited(SLACK * 4).await;
    let _relay = Worker::start(&["relay"], &db.url, &broker.env());
    let _ledger = Worker::start(&["consume"], &db.url, &broker.env());
    let row = Row::settle(
        "relay killed between publish and record",
        &db.pool().await,
        &broker,
        SLACK * 10,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    assert_eq!(
        row.in_stream, row.events as u64,
        "inside the window the stream kept one copy"
    );
    broker.delete_stream().await;
}

#[tokio::test]
async fn a_relay_down_longer_than_the_window_leaves_two_copies_and_the_inbox_applies_one() {
    let db = Database::create().await;
    let server = api(&db).await;
    charges(&server, 4 * scale()).await;
    let broker = Broker::on(&nats_url());
    let window = with(broker.env(), &[("NATS_DUPLICATE_WINDOW", "1s")]);
    let crash = with(
        window.clone(),
        &[
            ("FAULT_INJECTION", "true"),
            ("BROKER_FAULT", "crash-after-publish"),
        ],
    );
    let mut dying = Worker::start(&["relay"], &db.url, &crash);
    dying.exited(SLACK * 4).await;
    // The broker forgets ids on a timer, so well past the window.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _relay = Worker::start(&["relay"], &db.url, &window);
    let _ledger = Worker::start(&["consume"], &db.url, &window);
    let row = Row::settle(
        "relay down longer than the window",
        &db.pool().await,
        &broker,
        SLACK * 10,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    assert!(
        row.in_stream > row.events as u64,
        "the first batch twice in the stream: {row:?}"
    );
    assert!(row.duplicates_delivered > 0, "{row:?}");
    broker.delete_stream().await;
}

#[tokio::test]
async fn a_consumer_killed_after_its_commit_before_its_ack_is_redelivered_and_applied_once() {
    let db = Database::create().await;
    let server = api(&db).await;
    charges(&server, 4 * scale()).await;
    let broker = Broker::on(&nats_url());
    let _relay = Worker::start(&["relay"], &db.url, &broker.env());
    let crash = with(
        broker.env(),
        &[
            ("FAULT_INJECTION", "true"),
            ("BROKER_FAULT", "crash-after-commit"),
        ],
    );
    for _ in 0..3 {
        let mut dying = Worker::start(&["consume"], &db.url, &crash);
        dying.exited(SLACK * 4).await;
    }
    let _ledger = Worker::start(&["consume"], &db.url, &broker.env());
    let row = Row::settle(
        "consumer killed after commit, before ack",
        &db.pool().await,
        &broker,
        SLACK * 10,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    assert!(
        row.duplicates_delivered >= 3,
        "each killed consumer's message came again: {row:?}"
    );
    broker.delete_stream().await;
}

#[tokio::test]
async fn two_consumers_with_a_short_ack_wait_share_redeliveries_and_apply_each_once() {
    let db = Database::create().await;
    let server = api(&db).await;
    charges(&server, 2 * scale()).await;
    let broker = Broker::on(&nats_url());
    let _relay = Worker::start(&["relay"], &db.url, &broker.env());
    // One acks each message after twice the ack wait: the broker gives
    // each to the other meanwhile, while the first may still be at it.
    let late = with(
        broker.env(),
        &[("FAULT_INJECTION", "true"), ("BROKER_FAULT", "ack-late")],
    );
    let _slow = Worker::start(&["consume"], &db.url, &late);
    // The other starts once the slow one holds messages, so that some are
    // given to it again: started together, it could take them all first.
    broker.ledger_holds_unacked(SLACK * 10).await;
    let _quick = Worker::start(&["consume"], &db.url, &broker.env());
    let row = Row::settle(
        "two consumers, short ack wait",
        &db.pool().await,
        &broker,
        SLACK * 20,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    assert!(row.duplicates_delivered > 0, "{row:?}");
    broker.delete_stream().await;
}

/// A NATS server of the scenario's own, restarted on the same port with
/// the same JetStream folder.
struct PrivateNats {
    child: Option<Child>,
    dir: PathBuf,
    port: u16,
}

impl PrivateNats {
    async fn start() -> Self {
        let dir = scratch_dir("nats");
        let mut nats = PrivateNats {
            child: None,
            dir,
            port: 0,
        };
        nats.spawn("-1").await;
        nats
    }

    async fn spawn(&mut self, port: &str) {
        let log = self.dir.join("nats-server.log");
        let _ = std::fs::remove_file(&log);
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", port, "-js", "-sd"])
            .arg(self.dir.join("store"))
            .arg("-l")
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server (apt-get install nats-server)");
        self.child = Some(child);
        // Ready is its own log saying so, however long that takes.
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("Server is ready") {
                let port = text
                    .split("Listening for client connections on 127.0.0.1:")
                    .nth(1)
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|p| p.parse().ok())
                    .expect("the port nats-server listens on");
                self.port = port;
                return;
            }
            let exited = self.child.as_mut().unwrap().try_wait().unwrap();
            assert!(exited.is_none(), "nats-server exited; its log:\n{text}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills it (`SIGKILL`) and starts it again on its port, from its files.
    async fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn(&self.port.to_string()).await;
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn a_broker_restarted_under_load_keeps_its_stream_and_each_event_is_applied_once() {
    let db = Database::create().await;
    let server = api(&db).await;
    let mut nats = PrivateNats::start().await;
    let broker = Broker::on(&nats.url());
    let _relay = Worker::start(&["relay"], &db.url, &broker.env());
    let _ledger = Worker::start(&["consume"], &db.url, &broker.env());
    charges(&server, 2 * scale()).await;
    // Killed and started again while charges are being made.
    tokio::join!(charges(&server, 2 * scale()), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        nats.restart().await;
    });
    let row = Row::settle(
        "broker restarted under load",
        &db.pool().await,
        &broker,
        SLACK * 20,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    assert_eq!(
        row.in_stream, row.events as u64,
        "the stream on disk survived the kill"
    );
}

/// A three-node JetStream cluster from `scripts/cluster nats up`, in a
/// folder of its own; brought down and removed when dropped.
struct NatsCluster {
    dir: PathBuf,
    port: u16,
    url: String,
}

impl NatsCluster {
    /// Its ports are a free range when chosen; when another process takes
    /// one first, a new folder on a new range.
    async fn up() -> Self {
        for _ in 0..5 {
            let mut cluster = NatsCluster {
                dir: scratch_dir("nats-cluster"),
                port: crate::fleet::free_port_range(),
                url: String::new(),
            };
            let out = cluster.run(&["nats", "up"]).await;
            let said = String::from_utf8_lossy(&out.stderr).to_string();
            if out.status.success() {
                let stdout = String::from_utf8(out.stdout).unwrap();
                cluster.url = stdout.lines().last().unwrap().to_owned();
                return cluster;
            }
            let taken =
                said.contains("is taken") || said.to_lowercase().contains("address already in use");
            assert!(taken, "scripts/cluster nats up failed: {said}");
        }
        panic!("no free range of ports for the NATS cluster in five tries");
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster"));
        command
            .args(args)
            .env("CLUSTER_DIR", &self.dir)
            .env("CLUSTER_PORT", self.port.to_string())
            .stdin(Stdio::null());
        command
    }

    async fn run(&self, args: &[&str]) -> std::process::Output {
        let mut command = self.command(args);
        tokio::task::spawn_blocking(move || command.output().expect("run scripts/cluster"))
            .await
            .unwrap()
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        let _ = self.command(&["nats", "down"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn a_three_node_cluster_losing_a_node_under_load_loses_no_event_and_applies_each_once() {
    let db = Database::create().await;
    let server = api(&db).await;
    let cluster = NatsCluster::up().await;
    let broker = Broker::on(&cluster.url);
    let env = with(broker.env(), &[("NATS_STREAM_REPLICAS", "3")]);
    let _relay = Worker::start(&["relay"], &db.url, &env);
    let _ledger = Worker::start(&["consume"], &db.url, &env);
    charges(&server, 2 * scale()).await;
    broker.replicated(3, SLACK * 20).await;
    // One node killed while charges are being made; the stream has two
    // copies left, a majority, and goes on.
    tokio::join!(charges(&server, 2 * scale()), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let out = cluster.run(&["kill", "nats1"]).await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
    let row = Row::settle(
        "a three-node cluster losing a node under load",
        &db.pool().await,
        &broker,
        SLACK * 20,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    assert_eq!(
        row.in_stream, row.events as u64,
        "every event in the replicated stream, once"
    );
}

/// Moves the server's transaction counter on by `count` ids, as a busy
/// server's is: a new cluster's counter starts far below it.
async fn burn_transaction_ids(pool: &PgPool, count: i32) {
    sqlx::query(&format!(
        "DO $$ BEGIN FOR i IN 1..{count} LOOP PERFORM pg_current_xact_id(); COMMIT; END LOOP; END $$"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// `pg_dump` of `from`, restored by `pg_restore` into `to`, as an operator
/// moves a database onto a new server.
fn dump_and_restore(from: &str, to: &str) {
    let dump = scratch_dir("restore").join("oncepay.dump");
    let out = Command::new(crate::harness::pg_binary("pg_dump"))
        .args(["--format=custom", "--file"])
        .arg(&dump)
        .arg(from)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(crate::harness::pg_binary("pg_restore"))
        .args(["--no-owner", "--exit-on-error", "--dbname", to])
        .arg(&dump)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pg_restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_database_restored_onto_a_new_server_publishes_every_new_event_and_applies_each_once() {
    let db = Database::create().await;
    // The old server has handed out many more transaction ids than the new
    // one will have when the restored database takes its first write.
    burn_transaction_ids(&db.pool().await, 5_000).await;
    let broker = Broker::on(&nats_url());
    {
        let server = api(&db).await;
        let _relay = Worker::start(&["relay"], &db.url, &broker.env());
        let _ledger = Worker::start(&["consume"], &db.url, &broker.env());
        charges(&server, 2 * scale()).await;
        Row::settle("before the restore", &db.pool().await, &broker, SLACK * 10)
            .await
            .assert_exactly_once();
    }
    let cluster = crate::harness::PrivateCluster::start();
    let restored = Database::create_empty_on(&cluster.admin_url()).await;
    dump_and_restore(&db.url, &restored.url);

    let server = api(&restored).await;
    let _relay = Worker::start(&["relay"], &restored.url, &broker.env());
    let _ledger = Worker::start(&["consume"], &restored.url, &broker.env());
    charges(&server, 2 * scale()).await;
    let row = Row::settle(
        "restored onto a new Postgres server",
        &restored.pool().await,
        &broker,
        SLACK * 10,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    broker.delete_stream().await;
}

#[tokio::test]
async fn a_backlog_past_the_clients_ack_limit_in_one_batch_is_published_and_applied_once() {
    let db = Database::create().await;
    let server = api(&db).await;
    charges(&server, scale()).await;
    // A backlog as a relay down for a while leaves, larger than the 5,000
    // publishes async-nats leaves unacknowledged by default.
    let merchant: Uuid = sqlx::query_scalar("SELECT merchant_id FROM events LIMIT 1")
        .fetch_one(&db.pool().await)
        .await
        .unwrap();
    crate::database::write_backlog(&db.pool().await, merchant, 6_000).await;
    charges(&server, scale()).await;
    let broker = Broker::on(&nats_url());
    let env = with(broker.env(), &[("RELAY_BATCH", "10000")]);
    let _relay = Worker::start(&["relay"], &db.url, &env);
    let _ledger = Worker::start(&["consume"], &db.url, &env);
    let row = Row::settle(
        "a backlog of 6,000 events in one batch of 10,000",
        &db.pool().await,
        &broker,
        SLACK * 30,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    assert_eq!(row.in_stream, row.events as u64, "{row:?}");
    broker.delete_stream().await;
}

#[tokio::test]
async fn a_stream_made_beforehand_with_a_short_age_is_brought_to_the_configuration_and_loses_nothing()
 {
    let db = Database::create().await;
    let server = api(&db).await;
    let broker = Broker::on(&nats_url());
    // Made by hand before oncepay ran: a 1 s duplicate window, and events
    // dropped after 3 s.
    broker
        .js()
        .await
        .create_stream(jetstream::stream::Config {
            name: broker.stream.clone(),
            subjects: vec![format!("{}.>", broker.prefix)],
            duplicate_window: Duration::from_secs(1),
            max_age: Duration::from_secs(3),
            ..Default::default()
        })
        .await
        .unwrap();
    let _relay = Worker::start(&["relay"], &db.url, &broker.env());
    charges(&server, 4 * scale()).await;
    // The consumer starts well past the age the stream was made with.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let _ledger = Worker::start(&["consume"], &db.url, &broker.env());
    let row = Row::settle(
        "a stream made beforehand with a 1 s window and a 3 s age",
        &db.pool().await,
        &broker,
        SLACK * 10,
    )
    .await;
    row.publish();
    row.assert_exactly_once();
    let mut stream = broker.js().await.get_stream(&broker.stream).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.duplicate_window, Duration::from_secs(120));
    assert_eq!(config.max_age, Duration::ZERO);
    broker.delete_stream().await;
}

/// Waits until the stream holds every event written so far.
async fn relayed(broker: &Broker, pool: &PgPool, within: Duration) {
    let js = broker.js().await;
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await
        .unwrap();
    let deadline = Instant::now() + within;
    loop {
        if let Ok(mut stream) = js.get_stream(&broker.stream).await {
            if stream
                .info()
                .await
                .is_ok_and(|i| i.state.messages >= events as u64)
            {
                return;
            }
        }
        assert!(Instant::now() < deadline, "the relay published too little");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every message of the stream so far: its subject and its body.
async fn stream_events(broker: &Broker) -> Vec<(String, serde_json::Value)> {
    let js = broker.js().await;
    let mut stream = js.get_stream(&broker.stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut found = Vec::new();
    for seq in 1..=last {
        let message = stream.get_raw_message(seq).await.unwrap();
        let event = serde_json::from_slice(&message.payload).unwrap();
        found.push((message.subject.to_string(), event));
    }
    found
}

/// Publishes `payload` to `subject` as something other than the relay
/// would, with `Nats-Msg-Id` = `id` when given.
async fn publish(js: &jetstream::Context, subject: &str, id: Option<&str>, payload: Vec<u8>) {
    let mut message = jetstream::message::PublishMessage::build().payload(payload.into());
    if let Some(id) = id {
        message = message.message_id(id);
    }
    let ack = js.send_publish(subject.to_owned(), message).await.unwrap();
    assert!(!ack.await.unwrap().duplicate, "stored, not dropped");
}

/// For each of `events`: the event republished under a new message id, on
/// `other`'s subject, with its object changed, and as a charge of an id
/// oncepay never wrote (four to park); and once more without a header (the
/// event itself: a duplicate).
async fn forge(js: &jetstream::Context, events: &[(String, serde_json::Value)], other: Uuid) {
    for (n, (subject, event)) in events.iter().enumerate() {
        let body = serde_json::to_vec(event).unwrap();
        let new_id = format!("evt_republished{n:013}");
        publish(js, subject, Some(&new_id), body.clone()).await;
        publish(js, subject, None, body.clone()).await;
        let mut segments: Vec<String> = subject.split('.').map(str::to_owned).collect();
        segments[2] = other.to_string();
        publish(js, &segments.join("."), None, body).await;
        let mut changed = event.clone();
        changed["data"]["object"]["amount"] = json!(1);
        publish(js, subject, None, serde_json::to_vec(&changed).unwrap()).await;
        let mut unknown = changed;
        let forged_id = format!("evt_forged{n:018}");
        unknown["id"] = json!(forged_id);
        let unknown = serde_json::to_vec(&unknown).unwrap();
        publish(js, subject, Some(&forged_id), unknown).await;
    }
}

#[tokio::test]
async fn messages_in_forged_envelopes_are_parked_and_each_real_event_is_booked_once() {
    let db = Database::create().await;
    let server = api(&db).await;
    let pool = db.pool().await;
    let broker = Broker::on(&nats_url());
    let _relay = Worker::start(&["relay"], &db.url, &broker.env());
    let _ledger = Worker::start(&["consume"], &db.url, &broker.env());
    charges(&server, 2 * scale()).await;
    relayed(&broker, &pool, SLACK * 10).await;
    let (other, _) = oncepay::merchants::create(&pool, "another merchant")
        .await
        .unwrap();
    let real = stream_events(&broker).await;
    // More charges while forgeries of every event so far come in.
    let js = broker.js().await;
    tokio::join!(charges(&server, 2 * scale()), forge(&js, &real, other.id));
    let row = Row::settle(
        "forged envelopes: a new id, no header, another merchant, a changed body, an unknown id",
        &pool,
        &broker,
        SLACK * 10,
    )
    .await;
    row.publish();
    let forged = real.len() as i64;
    row.assert_exactly_once_and_parked(4 * forged);
    let reasons = parked_reasons(&pool).await;
    let expected = [
        "body_mismatch",
        "id_mismatch",
        "subject_mismatch",
        "unknown_event",
    ];
    let expected = expected.map(|r| (r.to_owned(), forged)).into();
    assert_eq!(reasons, expected, "{row:?}");
    js.delete_stream(&broker.stream).await.unwrap();
}

/// `count` of each: an event whose id holds a NUL byte (every transaction
/// reading it fails), a message that is not JSON, one of a type oncepay does
/// not write, and 900 KB; `charge` (a `charge.succeeded` message) is the
/// model.
async fn poison(js: &jetstream::Context, charge: &(String, serde_json::Value), count: usize) {
    let (subject, event) = charge;
    for n in 0..count {
        let mut nul = event.clone();
        nul["id"] = json!(format!("evt_nul\u{0}{n}"));
        publish(js, subject, None, serde_json::to_vec(&nul).unwrap()).await;
        let malformed = format!("{{\"id\": \"evt_{n}");
        publish(js, subject, None, malformed.into_bytes()).await;
        let mut unknown = event.clone();
        unknown["type"] = json!("charge.disputed");
        let disputed = subject.replace("charge.succeeded", "charge.disputed");
        publish(js, &disputed, None, serde_json::to_vec(&unknown).unwrap()).await;
        let mut large = event.clone();
        large["data"]["object"]["description"] = json!("x".repeat(900 * 1024));
        publish(js, subject, None, serde_json::to_vec(&large).unwrap()).await;
    }
}

#[tokio::test]
async fn poison_messages_are_parked_after_their_deliveries_and_each_real_event_is_booked_once() {
    let db = Database::create().await;
    let server = api(&db).await;
    let pool = db.pool().await;
    let broker = Broker::on(&nats_url());
    let env = with(broker.env(), &[("CONSUMER_MAX_DELIVER", "3")]);
    let _relay = Worker::start(&["relay"], &db.url, &env);
    let _ledger = Worker::start(&["consume"], &db.url, &env);
    charges(&server, 2 * scale()).await;
    relayed(&broker, &pool, SLACK * 10).await;
    let real = stream_events(&broker).await;
    let charge = real
        .iter()
        .find(|(_, event)| event["type"] == "charge.succeeded")
        .unwrap();
    // More charges while the poison comes in.
    let js = broker.js().await;
    tokio::join!(charges(&server, 2 * scale()), poison(&js, charge, scale()));
    let row = Row::settle(
        "poison: a NUL byte in an id, not JSON, an unknown type, 900 KB",
        &pool,
        &broker,
        SLACK * 20,
    )
    .await;
    row.publish();
    let each = scale() as i64;
    row.assert_exactly_once_and_parked(4 * each);
    let reasons = parked_reasons(&pool).await;
    let expected = ["apply_failed", "malformed", "oversize", "unknown_type"];
    assert_eq!(reasons, expected.map(|r| (r.to_owned(), each)).into());
    // Those whose transaction failed were parked once they had come three
    // times, and came no more.
    let deliveries: Vec<i64> = sqlx::query_scalar(
        "SELECT deliveries FROM consumer_dead_letters WHERE reason = 'apply_failed'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(deliveries.iter().all(|&d| d >= 3), "{deliveries:?}");
    js.delete_stream(&broker.stream).await.unwrap();
}

#[tokio::test]
async fn an_old_transaction_holding_events_back_is_named_in_the_relays_log() {
    let db = Database::create().await;
    let server = api(&db).await;
    let broker = Broker::on(&nats_url());
    let env = with(broker.env(), &[("RELAY_STALL_WARNING", "1s")]);
    let relay = Worker::start(&["relay"], &db.url, &env);
    // A transaction that took an id and stays open, as a forgotten session
    // does; every event committed after it is held back.
    let pool = db.pool().await;
    let mut holder = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *holder)
        .await
        .unwrap();
    charges(&server, 1).await;
    let named = format!("pid={pid}");
    let deadline = Instant::now() + SLACK * 10;
    loop {
        let log = std::fs::read_to_string(&relay.log).unwrap_or_default();
        if log
            .lines()
            .any(|l| l.contains("events are held back") && l.contains(&named))
        {
            break;
        }
        assert!(Instant::now() < deadline, "no warning naming {named}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    holder.rollback().await.unwrap();
    broker.delete_stream().await;
}
