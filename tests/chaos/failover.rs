//! A primary and its streaming standby on loopback, and oncepay given both
//! in one multi-host `DATABASE_URL` (the standby listed first, so that the
//! choice of the primary is oncepay's own): writes go to the primary; the
//! same running process serves again after the standby is promoted; while
//! no primary answers, requests get `503` with `Retry-After` within
//! `REQUEST_TIMEOUT` and `/readyz` is `503`; a URL that names only a
//! read-only server never writes; and the card gateway, given a multi-host
//! ledger URL, follows its own primary the same way.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::database::TestDb as Database;
use crate::harness::{
    API_KEY, ProcessorProcess, SLACK, START_BUDGET, Server, charge_body, client, eventually,
    free_port, is_root, log_end, log_since, metric, pg_binary, port_taken, post, refund_body,
    scratch_dir, send,
};

/// A primary and a standby streaming from it (synchronously: a commit is
/// acknowledged once the standby has its WAL, so a promotion keeps it).
struct ReplicatedPair {
    dir: PathBuf,
    root: bool,
    primary: u16,
    standby: u16,
}

impl ReplicatedPair {
    fn start() -> Self {
        let dir = scratch_dir("pair");
        let root = is_root();
        if root {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            assert!(status.success(), "chown the cluster folder");
        }
        let mut pair = ReplicatedPair {
            dir,
            root,
            primary: 0,
            standby: 0,
        };
        let primary = pair.data("primary");
        pair.run(
            &pg_binary("initdb"),
            &[
                "-D",
                primary.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
        );
        // Every commit waits for the standby's flush: what is acknowledged
        // survives the promotion.
        pair.primary = pair.start_server("primary", "-c synchronous_standby_names=*");
        let standby = pair.data("standby");
        let port = pair.primary.to_string();
        pair.run(
            &pg_binary("pg_basebackup"),
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                standby.to_str().unwrap(),
                "-R",
                "-X",
                "stream",
            ],
        );
        pair.standby = pair.start_server("standby", "");
        pair
    }

    fn data(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn command(&self, binary: &Path, args: &[&str]) -> Command {
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

    fn run(&self, binary: &Path, args: &[&str]) {
        let out = self.command(binary, args).output().unwrap();
        assert!(
            out.status.success(),
            "{} {args:?}: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the server `name` on a free port, and returns the port: a new
    /// one when another process took the first before Postgres bound it.
    fn start_server(&self, name: &str, extra: &str) -> u16 {
        let data = self.data(name);
        let log = self.dir.join(format!("{name}.log"));
        let timeout = START_BUDGET.as_secs().to_string();
        for _ in 0..5 {
            let port = free_port();
            let options = format!(
                "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off {extra}",
                self.dir.display()
            );
            let from = log_end(&log);
            let args = [
                "start",
                "-D",
                data.to_str().unwrap(),
                "-w",
                "-t",
                &timeout,
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
            ];
            let out = self.command(&pg_binary("pg_ctl"), &args).output().unwrap();
            if out.status.success() {
                return port;
            }
            let said = log_since(&log, from);
            assert!(
                port_taken(&said),
                "pg_ctl start {name}: {}{said}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        panic!("pg_ctl start {name}: five ports in a row were taken before Postgres bound them");
    }

    fn url(port: u16, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/{database}")
    }

    /// Both hosts, the standby first, as `pg_autoctl show uri` writes them.
    fn multi_host_url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write&sslmode=prefer",
            self.standby, self.primary
        )
    }

    /// Waits until the standby streams synchronously from the primary.
    async fn wait_streaming(&self) {
        let url = Self::url(self.primary, "postgres");
        eventually(
            Instant::now() + Duration::from_secs(20),
            "the standby streams synchronously",
            || async {
                let mut conn = PgConnection::connect(&url).await.ok()?;
                let sync: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                )
                .fetch_one(&mut conn)
                .await
                .ok()?;
                (sync == 1).then_some(())
            },
        )
        .await;
    }

    /// Waits until the standby has replayed everything the primary wrote.
    async fn wait_replayed(&self) {
        let mut primary = PgConnection::connect(&Self::url(self.primary, "postgres"))
            .await
            .unwrap();
        let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&mut primary)
            .await
            .unwrap();
        let standby = Self::url(self.standby, "postgres");
        eventually(
            Instant::now() + Duration::from_secs(10),
            "the standby replays the primary's WAL",
            || async {
                let mut conn = PgConnection::connect(&standby).await.ok()?;
                let caught_up: bool =
                    sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn")
                        .bind(&written)
                        .fetch_one(&mut conn)
                        .await
                        .ok()?;
                caught_up.then_some(())
            },
        )
        .await;
    }

    /// Stops the primary as a crash would (`-m immediate`).
    fn crash_primary(&self) {
        let data = self.data("primary");
        self.run(
            &pg_binary("pg_ctl"),
            &[
                "stop",
                "-D",
                data.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
            ],
        );
    }

    /// Promotes the standby and waits until it takes writes.
    fn promote_standby(&self) {
        let data = self.data("standby");
        self.run(
            &pg_binary("pg_ctl"),
            &["promote", "-D", data.to_str().unwrap(), "-w", "-t", "30"],
        );
    }
}

impl Drop for ReplicatedPair {
    fn drop(&mut self) {
        for name in ["standby", "primary"] {
            let data = self.data(name);
            let _ = self
                .command(
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
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A database on the pair's primary (so, streamed to the standby too).
async fn create_database(pair: &ReplicatedPair) -> String {
    let name = format!("oncepay_failover_{}", Uuid::new_v4().simple());
    let mut admin = PgConnection::connect(&ReplicatedPair::url(pair.primary, "postgres"))
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .unwrap();
    name
}

async fn count(url: &str, sql: &str) -> i64 {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::query_scalar(sql).fetch_one(&mut conn).await.unwrap()
}

async fn readyz(http: &reqwest::Client, url: &str) -> u16 {
    http.get(format!("{url}/readyz"))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oncepay_follows_the_primary_through_a_failover_without_a_restart() {
    let pair = ReplicatedPair::start();
    pair.wait_streaming().await;
    let name = create_database(&pair).await;
    // The card gateway's ledger is a system of its own, on another server.
    let ledger = Database::create_empty().await;
    let processor = ProcessorProcess::start(&ledger.url, &[] as &[(&str, &str)]).await;
    let request_timeout = Duration::from_secs(2);
    let server = Server::start(
        &pair.multi_host_url(&name),
        &[
            ("PROCESSOR_URL", processor.url()),
            ("PROCESSOR_API_KEY", processor.api_key.clone()),
            ("PROCESSING_TIMEOUT", "5s".to_owned()),
            ("REQUEST_TIMEOUT", "2s".to_owned()),
            ("DATABASE_ACQUIRE_TIMEOUT", "1s".to_owned()),
            ("DATABASE_PRIMARY_CHECK_INTERVAL", "200ms".to_owned()),
        ],
    )
    .await;
    let http = client(Duration::from_secs(15));
    let primary_url = ReplicatedPair::url(pair.primary, &name);
    let standby_url = ReplicatedPair::url(pair.standby, &name);

    // (a) The standby is listed first; the charge is written on the primary.
    let (status, _, before) = send(
        &http,
        &server.url(),
        "before",
        &charge_body("before", 1200, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 201, "{before}");
    assert_eq!(
        count(&primary_url, "SELECT count(*) FROM charges").await,
        1,
        "the charge is on the primary"
    );
    let oncepay_on_standby = count(
        &ReplicatedPair::url(pair.standby, "postgres"),
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'oncepay'",
    )
    .await;
    assert_eq!(
        oncepay_on_standby, 0,
        "no connection of oncepay's stays on the standby"
    );
    assert_eq!(readyz(&http, &server.url()).await, 200);
    // Synchronous replication: the acknowledged charge is on the standby.
    pair.wait_replayed().await;
    assert_eq!(count(&standby_url, "SELECT count(*) FROM charges").await, 1);

    // (c) The primary crashes; the standby is not promoted yet.
    tokio::task::block_in_place(|| pair.crash_primary());
    let started = Instant::now();
    let (status, headers, body) = send(
        &http,
        &server.url(),
        "during",
        &charge_body("during", 700, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    let took = started.elapsed();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "service_unavailable", "{body}");
    assert!(headers.contains_key("retry-after"), "{headers:?}");
    assert!(
        took <= request_timeout + SLACK,
        "answered in {took:?}, REQUEST_TIMEOUT is {request_timeout:?}"
    );
    eventually(
        Instant::now() + Duration::from_secs(5),
        "/readyz says not ready",
        || async { (readyz(&http, &server.url()).await == 503).then_some(()) },
    )
    .await;

    // (b) The standby is promoted: the same process serves again.
    tokio::task::block_in_place(|| pair.promote_standby());
    let served_again = Instant::now();
    let after = eventually(
        Instant::now() + Duration::from_secs(15),
        "a charge succeeds on the promoted standby",
        || async {
            let (status, _, body) = send(
                &http,
                &server.url(),
                "during",
                &charge_body("during", 700, "tok_visa"),
                &[],
            )
            .await
            .ok()?;
            assert!(status == 201 || status == 503, "{status} {body}");
            (status == 201).then_some(body)
        },
    )
    .await;
    eprintln!(
        "served again {:?} after the promotion",
        served_again.elapsed()
    );
    assert_eq!(readyz(&http, &server.url()).await, 200);
    // The charge acknowledged before the failover is replayed, not redone.
    let (status, headers, replay) = send(
        &http,
        &server.url(),
        "before",
        &charge_body("before", 1200, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 201, "{replay}");
    assert_eq!(replay["id"], before["id"], "{replay}");
    assert_eq!(
        headers.get("idempotent-replayed").map(String::as_str),
        Some("true"),
        "{headers:?}"
    );
    let charges: Vec<(String, i64)> = {
        let mut conn = PgConnection::connect(&standby_url).await.unwrap();
        sqlx::query_as("SELECT id::text, amount FROM charges ORDER BY amount")
            .fetch_all(&mut conn)
            .await
            .unwrap()
    };
    assert_eq!(charges.len(), 2, "one charge each: {charges:?}");
    assert_eq!(Value::String(charges[1].0.clone()), before["id"]);
    assert_eq!(Value::String(charges[0].0.clone()), after["id"]);
    assert!(
        metric(
            &http,
            &server.url(),
            "db_primary_retargets_total{pool=\"oncepay\"}"
        )
        .await
            >= 1.0
    );
    assert!(server.log_text().contains("re-targeted"));
    assert!(!server.log_text().contains("panicked"));
    drop(server);
    drop(processor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_without_a_target_starts_and_writes_on_the_primary_listed_second() {
    let pair = ReplicatedPair::start();
    pair.wait_streaming().await;
    let name = create_database(&pair).await;
    let ledger = Database::create_empty().await;
    let processor = ProcessorProcess::start(&ledger.url, &[] as &[(&str, &str)]).await;
    // The standby first, and no target_session_attrs: `serve` migrates at
    // start, so taking the standby would stop it there.
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{name}",
        pair.standby, pair.primary
    );
    let server = Server::start(
        &url,
        &[
            ("PROCESSOR_URL", processor.url()),
            ("PROCESSOR_API_KEY", processor.api_key.clone()),
            ("DATABASE_PRIMARY_CHECK_INTERVAL", "200ms".to_owned()),
        ],
    )
    .await;
    let http = client(Duration::from_secs(15));
    let (status, _, body) = send(
        &http,
        &server.url(),
        "no-target",
        &charge_body("no-target", 700, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 201, "{body}");
    let primary_url = ReplicatedPair::url(pair.primary, &name);
    assert_eq!(count(&primary_url, "SELECT count(*) FROM charges").await, 1);
    assert_eq!(readyz(&http, &server.url()).await, 200);
    drop(server);
    drop(processor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_naming_only_a_read_only_server_never_writes_and_answers_503() {
    let pair = ReplicatedPair::start();
    pair.wait_streaming().await;
    let name = create_database(&pair).await;
    let primary_url = ReplicatedPair::url(pair.primary, &name);
    {
        let pool = sqlx::PgPool::connect(&primary_url).await.unwrap();
        oncepay::db::migrate(&pool).await.unwrap();
        let key = oncepay::merchants::ApiKey::parse(API_KEY).unwrap();
        oncepay::merchants::ensure(&pool, "demo", &key)
            .await
            .unwrap();
        pool.close().await;
    }
    pair.wait_replayed().await;
    let ledger = Database::create_empty().await;
    let processor = ProcessorProcess::start(&ledger.url, &[] as &[(&str, &str)]).await;
    let standby = pair.standby;
    let http = client(Duration::from_secs(15));
    for url in [
        // Refused at connect time: the server is read-only.
        format!("postgres://postgres@127.0.0.1:{standby}/{name}?target_session_attrs=read-write"),
        format!(
            "postgres://postgres@127.0.0.1:{standby},127.0.0.1:{standby}/{name}?target_session_attrs=read-write"
        ),
        // No target: the write itself is refused (25006).
        format!("postgres://postgres@127.0.0.1:{standby}/{name}"),
    ] {
        let config = oncepay::config::Config::from_lookup(|variable| match variable {
            "DATABASE_URL" => Some(url.clone()),
            "PROCESSOR_URL" => Some(processor.url()),
            "PROCESSOR_API_KEY" => Some(processor.api_key.clone()),
            "PORT" => Some("0".to_owned()),
            "PROCESSING_TIMEOUT" => Some("4s".to_owned()),
            "DATABASE_ACQUIRE_TIMEOUT" => Some("500ms".to_owned()),
            "DATABASE_PRIMARY_CHECK_INTERVAL" => Some("200ms".to_owned()),
            "RECONCILE_ENABLED" => Some("false".to_owned()),
            _ => None,
        })
        .unwrap();
        let database = oncepay::db::connect(&config).unwrap();
        let app = oncepay::startup::Application::build(config, database)
            .await
            .unwrap();
        let base = format!("http://127.0.0.1:{}", app.port());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(app.run_until_stopped(async {
            let _ = stopped.await;
        }));
        for attempt in 0..3 {
            let key = format!("standby-{attempt}");
            let (status, headers, body) =
                send(&http, &base, &key, &charge_body(&key, 500, "tok_visa"), &[])
                    .await
                    .unwrap();
            assert_eq!(status, 503, "{url}: {body}");
            assert_eq!(body["code"], "service_unavailable", "{url}: {body}");
            assert!(headers.contains_key("retry-after"), "{headers:?}");
        }
        assert_eq!(readyz(&http, &base).await, 503, "{url}");
        let _ = stop.send(());
        running.await.unwrap().unwrap();
    }
    for url in [&primary_url, &ReplicatedPair::url(standby, &name)] {
        assert_eq!(count(url, "SELECT count(*) FROM idempotency_keys").await, 0);
        assert_eq!(count(url, "SELECT count(*) FROM charges").await, 0);
    }
    drop(processor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_card_gateway_follows_its_ledgers_primary_through_a_failover_too() {
    let pair = ReplicatedPair::start();
    pair.wait_streaming().await;
    let name = create_database(&pair).await;
    let url = pair.multi_host_url(&name);
    // Its ledger, `<name>_processor`, is created on the primary (the
    // second host listed) and followed like oncepay's own database.
    let processor = ProcessorProcess::start(&url, &[] as &[(&str, &str)]).await;
    let server = Server::start(
        &url,
        &[
            ("PROCESSOR_URL", processor.url()),
            ("PROCESSOR_API_KEY", processor.api_key.clone()),
            ("PROCESSING_TIMEOUT", "4s".to_owned()),
            ("SWEEP_INTERVAL", "500ms".to_owned()),
            ("DATABASE_ACQUIRE_TIMEOUT", "1s".to_owned()),
            ("DATABASE_PRIMARY_CHECK_INTERVAL", "200ms".to_owned()),
        ],
    )
    .await;
    let http = client(Duration::from_secs(15));
    let (status, _, body) = send(
        &http,
        &server.url(),
        "before",
        &charge_body("before", 900, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 201, "{body}");
    let ledger_on_primary = ReplicatedPair::url(pair.primary, &format!("{name}_processor"));
    assert_eq!(
        count(
            &ledger_on_primary,
            "SELECT count(*) FROM operations WHERE kind = 'authorization'"
        )
        .await,
        1
    );
    pair.wait_replayed().await;

    tokio::task::block_in_place(|| {
        pair.crash_primary();
        pair.promote_standby();
    });
    // A charge succeeds again: both oncepay and its gateway found the new
    // primary, with neither process restarted.
    eventually(
        Instant::now() + Duration::from_secs(20),
        "a charge succeeds after the failover",
        || async {
            let (status, _, body) = send(
                &http,
                &server.url(),
                "after",
                &charge_body("after", 400, "tok_visa"),
                &[],
            )
            .await
            .ok()?;
            assert!(status != 500, "{body}");
            (status == 201).then_some(())
        },
    )
    .await;
    let ledger_on_standby = ReplicatedPair::url(pair.standby, &format!("{name}_processor"));
    let authorized: Vec<i64> = {
        let mut conn = PgConnection::connect(&ledger_on_standby).await.unwrap();
        sqlx::query_scalar(
            "SELECT amount FROM operations WHERE kind = 'authorization' ORDER BY amount",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap()
    };
    assert_eq!(authorized, [400, 900], "one authorization each");
    assert!(
        processor.log_text().contains("re-targeted"),
        "{}",
        processor.log_text()
    );
    drop(server);
    drop(processor);
}

/// The processes of the pair's primary, stopped with `SIGSTOP` as a hung
/// host looks (its kernel still accepts and acknowledges every packet);
/// continued on drop, so that the pair can be stopped.
struct Frozen(Vec<String>);

impl ReplicatedPair {
    /// Freezes the primary: its postmaster first (so that it forks no new
    /// backend), then every process it started.
    fn freeze_primary(&self) -> Frozen {
        let pid_file =
            std::fs::read_to_string(self.data("primary").join("postmaster.pid")).unwrap();
        let postmaster = pid_file.lines().next().unwrap().trim().to_owned();
        signal("STOP", std::slice::from_ref(&postmaster));
        let children = Command::new("ps")
            .args(["-o", "pid=", "--ppid", &postmaster])
            .output()
            .unwrap();
        let mut pids: Vec<String> = String::from_utf8_lossy(&children.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        assert!(!pids.is_empty(), "the primary has backends");
        signal("STOP", &pids);
        pids.push(postmaster);
        Frozen(pids)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal("CONT", &self.0);
    }
}

fn signal(name: &str, pids: &[String]) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .args(pids)
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pids:?}");
}

/// A charge left `processing` by a request whose answer was lost, long
/// enough ago to be stale; its key.
async fn plant_stale_charge(url: &str) -> String {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::query(
        "WITH m AS (SELECT id FROM merchants WHERE name = 'demo'),
              c AS (INSERT INTO charges (id, merchant_id, amount, currency, source, metadata, status, created_at)
                    SELECT 'ch_silent0000000000000000', m.id, 300, 'usd', 'tok_visa',
                           jsonb_build_object('op', 'stale'), 'pending', now() - interval '1 minute'
                      FROM m
                    RETURNING id, merchant_id)
         INSERT INTO idempotency_keys (merchant_id, key, status, request_method, request_path, fingerprint,
                                       charge_id, created_at, locked_at, expires_at)
         SELECT merchant_id, 'stale-silent', 'processing', 'POST', '/v1/charges', sha256(id::bytea), id,
                now() - interval '1 minute', now() - interval '1 minute', now() + interval '1 day'
           FROM c",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    "stale-silent".to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_primary_stalls_keyed_requests_and_the_sweeper_no_longer_than_the_statement_timeout()
 {
    let pair = ReplicatedPair::start();
    pair.wait_streaming().await;
    let name = create_database(&pair).await;
    let ledger = Database::create_empty().await;
    let processor = ProcessorProcess::start(&ledger.url, &[] as &[(&str, &str)]).await;
    let request_timeout = Duration::from_secs(2);
    let statement_timeout = Duration::from_millis(1500);
    let server = Server::start(
        &pair.multi_host_url(&name),
        &[
            ("PROCESSOR_URL", processor.url()),
            ("PROCESSOR_API_KEY", processor.api_key.clone()),
            ("PROCESSING_TIMEOUT", "4s".to_owned()),
            ("REQUEST_TIMEOUT", "2s".to_owned()),
            ("SWEEP_INTERVAL", "300ms".to_owned()),
            ("DATABASE_ACQUIRE_TIMEOUT", "1s".to_owned()),
            ("DATABASE_PRIMARY_CHECK_INTERVAL", "200ms".to_owned()),
            ("DATABASE_STATEMENT_TIMEOUT", "1500ms".to_owned()),
        ],
    )
    .await;
    let http = client(Duration::from_secs(30));
    let base = server.url();
    let (status, _, charged) = send(
        &http,
        &base,
        "to-refund",
        &charge_body("to-refund", 5000, "tok_visa"),
        &[],
    )
    .await
    .unwrap();
    assert_eq!(status, 201, "{charged}");
    let charge = charged["id"].as_str().unwrap().to_owned();
    pair.wait_replayed().await;

    // The primary hangs under load: keyed charges, refunds and the
    // sweeper's passes have statements out to it when it stops answering.
    let frozen = tokio::task::block_in_place(|| pair.freeze_primary());
    let during = (0..4).map(|i| {
        let (http, base, charge) = (&http, &base, &charge);
        async move {
            let key = format!("during-{i}");
            let (status, _, body) =
                send(http, base, &key, &charge_body(&key, 100, "tok_visa"), &[])
                    .await
                    .unwrap();
            assert_ne!(status, 500, "{body}");
            let key = format!("during-refund-{i}");
            let (status, _, body) = post(
                http,
                base,
                "/v1/refunds",
                &key,
                &refund_body(&key, charge, 10),
                &[],
            )
            .await
            .unwrap();
            assert_ne!(status, 500, "{body}");
        }
    });
    futures::future::join_all(during).await;

    // The standby is promoted; oncepay re-targets to it.
    tokio::task::block_in_place(|| pair.promote_standby());
    eventually(
        Instant::now() + Duration::from_secs(15),
        "oncepay re-targets to the promoted standby",
        || async {
            let retargets =
                metric(&http, &base, "db_primary_retargets_total{pool=\"oncepay\"}").await;
            (retargets >= 1.0).then_some(())
        },
    )
    .await;
    let retargeted = Instant::now();
    let standby_url = ReplicatedPair::url(pair.standby, &name);
    let stale = plant_stale_charge(&standby_url).await;

    // Within the bound after the re-target, keyed charges and refunds are
    // served again, every one of them.
    let bound = statement_timeout + request_timeout;
    eventually(
        retargeted + bound + SLACK,
        "a keyed charge succeeds after the re-target",
        || async {
            let (status, _, body) = send(
                &http,
                &base,
                "after-0",
                &charge_body("after-0", 100, "tok_visa"),
                &[],
            )
            .await
            .ok()?;
            assert!(status == 201 || status == 503, "{status} {body}");
            (status == 201).then_some(())
        },
    )
    .await;
    for i in 1..=4 {
        let key = format!("after-{i}");
        let started = Instant::now();
        let (status, _, body) = send(&http, &base, &key, &charge_body(&key, 100, "tok_visa"), &[])
            .await
            .unwrap();
        assert_eq!(status, 201, "keyed charge {i}: {body}");
        assert!(
            started.elapsed() < request_timeout,
            "answered in {:?}",
            started.elapsed()
        );
        let key = format!("after-refund-{i}");
        let (status, _, body) = post(
            &http,
            &base,
            "/v1/refunds",
            &key,
            &refund_body(&key, &charge, 10),
            &[],
        )
        .await
        .unwrap();
        assert_eq!(status, 201, "keyed refund {i}: {body}");
    }
    eprintln!(
        "served again {:?} after the re-target",
        retargeted.elapsed()
    );

    // The sweeper makes passes again: the stale key is settled.
    eventually(
        retargeted + bound + Duration::from_millis(300) + SLACK,
        "the sweeper settles the stale key",
        || async {
            let mut conn = PgConnection::connect(&standby_url).await.ok()?;
            let status: String =
                sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE key = $1")
                    .bind(&stale)
                    .fetch_one(&mut conn)
                    .await
                    .ok()?;
            (status == "completed").then_some(())
        },
    )
    .await;
    assert!(!server.log_text().contains("panicked"));
    drop(server);
    drop(processor);
    drop(frozen);
}
