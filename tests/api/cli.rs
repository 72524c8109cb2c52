//! The `oncepay` binary's commands, run as a user would.

use std::process::Command;

use oncepay::merchants::{self, ApiKey};

use crate::helpers::TestDb;
use crate::sweeper::stale_claim_in;

fn oncepay(db: &TestDb, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(args)
        .env_clear()
        // Away from any .env a developer keeps in the checkout.
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", &db.url)
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .output()
        .expect("run oncepay")
}

#[tokio::test]
async fn merchants_create_prints_only_the_new_key_and_the_key_works() {
    let db = TestDb::create().await;
    let out = oncepay(&db, &["migrate"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = oncepay(&db, &["merchants", "create", "--name", "Ada's Tea"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let key = stdout.trim_end();
    assert_eq!(stdout.lines().count(), 1);
    assert!(key.starts_with("sk_test_") && key.len() >= 40, "{key}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains(key),
        "the key never reaches the log"
    );

    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let key = ApiKey::parse(key).expect("a well-formed key");
    let merchant = merchants::find_by_key(&pool, &key)
        .await
        .unwrap()
        .expect("the key finds its merchant");
    assert_eq!(merchant.name, "Ada's Tea");
    pool.close().await;
}

#[tokio::test]
async fn sweep_once_runs_one_pass_and_reports_it() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let (merchant, _) = merchants::create(&pool, "swept").await.unwrap();
    // Stale under the default PROCESSING_TIMEOUT (30 s).
    stale_claim_in(
        &pool,
        merchant.id,
        "crashed",
        "ch_crashedbeforethesweepcmd1",
        "1 minute",
    )
    .await;
    let out = oncepay(&db, &["sweep", "--once"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("sweep pass"),
        "a pass that did something logs its report"
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        "settled_succeeded=0 settled_failed=1 refunds_settled=0 refunds_failed=0 keys_deleted=0"
    );
    let settled: (String, String, i16) = sqlx::query_as(
        "SELECT c.status, k.status, k.response_status
           FROM charges c JOIN idempotency_keys k ON k.charge_id = c.id
          WHERE c.id = 'ch_crashedbeforethesweepcmd1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(settled, ("failed".into(), "completed".into(), 402));
    pool.close().await;
}

#[tokio::test]
async fn a_bad_setting_stops_the_binary_with_the_variable_named() {
    let db = TestDb::create().await;
    let out = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .arg("migrate")
        .env_clear()
        .env("DATABASE_URL", &db.url)
        .env("PROCESSING_TIMEOUT", "soon")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("PROCESSING_TIMEOUT"));
}

#[test]
fn serve_help_lists_every_setting_with_its_variable_and_hides_secrets() {
    let out = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(["serve", "--help"])
        .env_clear()
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", "postgres://app:hunter2@db/x")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for setting in [
        "[env: DATABASE_URL]",
        "[env: PORT=] [default: 8080]",
        "[env: PROCESSING_TIMEOUT=] [default: 30s]",
        "[env: FAULT_INJECTION=] [default: false]",
        "[env: REQUEST_TIMEOUT=]",
        "[env: SHUTDOWN_GRACE=] [default: 10s]",
    ] {
        assert!(help.contains(setting), "{setting} in {help}");
    }
    assert!(!help.contains("hunter2"), "{help}");
}

#[test]
fn a_flag_wins_over_its_variable_and_a_bad_flag_is_named_by_its_variable() {
    let out = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(["migrate", "--sweep-batch-size", "0"])
        .env_clear()
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", "postgres://127.0.0.1:1/x")
        .env("SWEEP_BATCH_SIZE", "100")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(r#"invalid SWEEP_BATCH_SIZE="0": must be a whole number from 1 to 10000"#),
        "{stderr}"
    );
}

#[test]
fn an_unreachable_database_is_announced_and_named_by_its_variable_without_the_password() {
    // Nothing listens on port 1: every connection is refused.
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .arg("serve")
        .env_clear()
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", "postgres://app:hunter2@127.0.0.1:1/oncepay")
        .env("DATABASE_ACQUIRE_TIMEOUT", "1s")
        .env("PORT", "0")
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "it gave up after DATABASE_ACQUIRE_TIMEOUT: {stderr}"
    );
    assert!(stderr.contains("waiting for the database"), "{stderr}");
    assert!(
        stderr.contains(
            "cannot reach the database at DATABASE_URL=postgres://app:***@127.0.0.1:1/oncepay"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("DATABASE_ACQUIRE_TIMEOUT"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[test]
fn a_database_url_that_is_not_postgres_is_refused_naming_the_variable() {
    for url in ["mysql://x", "not a url"] {
        let out = Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .arg("migrate")
            .env_clear()
            .current_dir(std::env::temp_dir())
            .env("DATABASE_URL", url)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("DATABASE_URL"), "{url}: {stderr}");
        assert!(
            stderr.contains("postgres://"),
            "{url}: says what is expected: {stderr}"
        );
    }
}

#[tokio::test]
async fn merchants_create_with_a_blank_name_says_so_and_creates_nothing() {
    let db = TestDb::create().await;
    for name in ["", "   ", &"x".repeat(201)] {
        let out = oncepay(&db, &["merchants", "create", "--name", name]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--name"), "{stderr}");
        assert!(stderr.contains("1 to 200 characters"), "{stderr}");
        assert!(
            !stderr.contains("migrat"),
            "not blamed on the migrations: {stderr}"
        );
        assert!(out.stdout.is_empty());
    }
    let pool = db.pool().await;
    let merchants: i64 = sqlx::query_scalar("SELECT count(*) FROM merchants")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(merchants, 0);
    pool.close().await;
}

#[tokio::test]
async fn without_a_processor_url_sweep_fences_at_an_embedded_gateway_with_its_own_ledger() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let (merchant, _) = merchants::create(&pool, "embedded").await.unwrap();
    stale_claim_in(
        &pool,
        merchant.id,
        "crashed",
        "ch_crashedbeforeembeddedsweep",
        "1 minute",
    )
    .await;
    let out = oncepay(&db, &["sweep", "--once"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The gateway it started kept its ledger in a database of its own.
    let ledger = sqlx::PgPool::connect(&format!("{}_processor", db.url))
        .await
        .expect("the embedded gateway's database");
    let voided: String = sqlx::query_scalar(
        "SELECT outcome FROM operations WHERE key = 'auth:ch_crashedbeforeembeddedsweep'",
    )
    .fetch_one(&ledger)
    .await
    .unwrap();
    assert_eq!(voided, "voided");
    ledger.close().await;
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE tablename IN ('processor_operations', 'operations')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(tables, 0, "oncepay's database holds no ledger");
}

#[test]
fn the_processor_command_has_settings_of_its_own_and_needs_its_database() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(args)
            .env_clear()
            .current_dir(std::env::temp_dir())
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            // oncepay's own settings do not apply to it.
            .env("DATABASE_URL", "postgres://127.0.0.1:1/oncepay")
            .output()
            .expect("run oncepay processor")
    };
    let help = run(&["processor", "--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    for name in [
        "PROCESSOR_DATABASE_URL",
        "PROCESSOR_PORT",
        "PROCESSOR_FAULT_INJECTION",
    ] {
        assert!(text.contains(name), "{name}: {text}");
    }
    assert!(!text.contains("IDEMPOTENCY_KEY_TTL"), "{text}");
    let missing = run(&["processor"]);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("PROCESSOR_DATABASE_URL"), "{stderr}");
    let listed = run(&["--help"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains("processor"));
}

/// `db`'s URL with its one host named twice, as a list: `read-write`.
fn twice(db: &TestDb) -> String {
    let url = url::Url::parse(&db.url).unwrap();
    let host = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5432));
    let user = match url.password() {
        Some(password) => format!("{}:{password}@", url.username()),
        None if url.username().is_empty() => String::new(),
        None => format!("{}@", url.username()),
    };
    format!(
        "postgres://{user}{host},{host}{}?target_session_attrs=read-write",
        url.path()
    )
}

fn oncepay_at(url: &str, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(args)
        .env_clear()
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", url)
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .output()
        .expect("run oncepay")
}

#[tokio::test]
async fn migrate_and_merchants_take_a_multi_host_url_and_serve_refuses_to_embed_the_ledger_beside_it()
 {
    let db = TestDb::create_empty().await;
    let url = twice(&db);
    let out = oncepay_at(&url, &["migrate"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("database host chosen"), "{stderr}");
    let out = oncepay_at(&url, &["merchants", "create", "--name", "Ada"], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pool = db.pool().await;
    let merchants: i64 = sqlx::query_scalar("SELECT count(*) FROM merchants")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(merchants, 1);
    // No PROCESSOR_URL, no PROCESSOR_DATABASE_URL: the embedded gateway's
    // ledger would be derived onto the same, failing-over servers.
    let out = oncepay_at(&url, &["serve"], &[("PORT", "0")]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("several hosts")
            && stderr.contains("PROCESSOR_URL")
            && stderr.contains("PROCESSOR_DATABASE_URL"),
        "{stderr}"
    );
    let ledgers: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1 || '_processor'")
            .bind(&db.name)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(ledgers, 0, "no ledger database was made");
    pool.close().await;
}

#[test]
fn a_multi_host_url_with_no_host_answering_stops_naming_it_without_the_password() {
    let started = std::time::Instant::now();
    let url =
        "postgres://app:hunter2@127.0.0.1:1,127.0.0.1:2/oncepay?target_session_attrs=read-write";
    let out = oncepay_at(url, &["migrate"], &[("DATABASE_ACQUIRE_TIMEOUT", "1s")]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "it gave up after DATABASE_ACQUIRE_TIMEOUT: {stderr}"
    );
    assert!(
        stderr
            .contains("no host of DATABASE_URL=postgres://app:***@127.0.0.1:1,127.0.0.1:2/oncepay"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[test]
fn a_target_session_attrs_oncepay_cannot_write_through_is_refused_by_name() {
    for value in ["standby", "read-only", "prefer-standby"] {
        let url = format!(
            "postgres://app:hunter2@127.0.0.1:1,127.0.0.1:2/oncepay?target_session_attrs={value}"
        );
        let out = oncepay_at(&url, &["migrate"], &[]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("DATABASE_URL")
                && stderr.contains(&format!("target_session_attrs={value}")),
            "{stderr}"
        );
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
}

#[tokio::test]
async fn merchants_roll_key_prints_only_the_new_key_and_the_old_one_lives_as_asked() {
    let db = TestDb::create().await;
    assert!(oncepay(&db, &["migrate"]).status.success());
    let out = oncepay(&db, &["merchants", "create", "--name", "Rolling"]);
    let old = ApiKey::parse(String::from_utf8(out.stdout).unwrap().trim_end()).unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM merchants")
        .fetch_one(&pool)
        .await
        .unwrap();

    let out = oncepay(
        &db,
        &[
            "merchants",
            "roll-key",
            &id.to_string(),
            "--expire-old-in",
            "1h",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1);
    let new = ApiKey::parse(stdout.trim_end()).expect("a well-formed key");
    assert_ne!(new.expose(), old.expose());
    assert!(
        !stderr.contains(new.expose()),
        "the key never reaches the log"
    );
    assert!(stderr.contains("old_key_expires_at"), "{stderr}");

    let by_old = merchants::authenticate(&pool, &old).await.unwrap().unwrap();
    let by_new = merchants::authenticate(&pool, &new).await.unwrap().unwrap();
    assert_eq!((by_old.merchant.id, by_new.merchant.id), (id, id));
    let left = by_old.expires_in.expect("the old key expires");
    assert!(left > std::time::Duration::from_secs(3500), "{left:?}");
    assert_eq!(by_new.expires_in, None);

    // Without --expire-old-in, the key replaced stops at once.
    let out = oncepay(&db, &["merchants", "roll-key", &id.to_string()]);
    assert!(out.status.success());
    let newest = ApiKey::parse(String::from_utf8(out.stdout).unwrap().trim_end()).unwrap();
    assert!(
        merchants::authenticate(&pool, &new)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        merchants::authenticate(&pool, &newest)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        merchants::authenticate(&pool, &old)
            .await
            .unwrap()
            .is_none(),
        "at most two live keys: the oldest stopped with the second roll"
    );

    let nobody = uuid::Uuid::now_v7().to_string();
    let out = oncepay(&db, &["merchants", "roll-key", &nobody]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("there is no merchant {nobody}")),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = oncepay(
        &db,
        &[
            "merchants",
            "roll-key",
            &id.to_string(),
            "--expire-old-in",
            "8d",
        ],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("expire-old-in") && stderr.contains("7 days"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    pool.close().await;
}

#[tokio::test]
async fn serve_with_a_demo_key_rolled_away_starts_and_warns_naming_the_merchant_never_the_key() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let (merchant, old) = merchants::create(&pool, "demo").await.unwrap();
    merchants::roll_key(&pool, merchant.id, std::time::Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    let log = std::env::temp_dir().join(format!("oncepay-rolled-demo-{}.log", db.name));
    let mut child = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .arg("serve")
        .env_clear()
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", &db.url)
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("BIND_ADDR", "127.0.0.1")
        .env("PORT", "0")
        .env("DEMO_API_KEY", old.expose())
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start oncepay serve");
    // The start goes on past the warning: to the line that says it serves.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let stderr = loop {
        let stderr = std::fs::read_to_string(&log).unwrap();
        if let Some(status) = child.try_wait().unwrap() {
            panic!("oncepay serve exited ({status}): {stderr}");
        }
        if stderr.contains("oncepay listening") || std::time::Instant::now() > deadline {
            break stderr;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&log);
    let warning = stderr
        .lines()
        .find(|line| line.contains("rolled away"))
        .unwrap_or_else(|| panic!("no warning: {stderr}"));
    assert!(
        warning.contains("WARN") && warning.contains(&merchant.id.to_string()),
        "{warning}"
    );
    assert!(stderr.contains("oncepay listening"), "it serves: {stderr}");
    assert!(
        !stderr.contains(&old.expose()[8..]),
        "the key never reaches the log"
    );
    let merchants: i64 = sqlx::query_scalar("SELECT count(*) FROM merchants")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(merchants, 1);
    let revived = merchants::authenticate(&pool, &old).await.unwrap();
    assert!(revived.is_none(), "the key stays revoked");
}

#[tokio::test]
async fn processor_accounts_create_prints_a_secret_once_that_the_gateway_accepts() {
    let db = TestDb::create_empty().await;
    let create = |name: &str| {
        Command::new(env!("CARGO_BIN_EXE_oncepay"))
            .args(["processor", "accounts", "create", "--name", name])
            .env_clear()
            .current_dir(std::env::temp_dir())
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("PROCESSOR_DATABASE_URL", &db.url)
            .env("RUST_LOG", "info")
            .output()
            .expect("run oncepay processor accounts create")
    };
    let out = create("shop one");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    let secret = stdout.trim_end();
    assert!(secret.starts_with("gwsk_"), "{secret}");
    assert!(
        !stderr.contains(secret),
        "the secret is never logged: {stderr}"
    );
    let again = create("shop one");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists already"));
    assert!(again.stdout.is_empty());

    let pool = db.pool().await;
    let (stored, plain): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE hash = sha256($1::bytea)),
                count(*) FILTER (WHERE position($2 in encode(hash, 'escape')) > 0)
           FROM api_keys",
    )
    .bind(secret.as_bytes())
    .bind(secret)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((stored, plain), (1, 0), "only the secret's hash is stored");
    let accounts = card_gateway::accounts::Accounts::new(pool.clone());
    let account = accounts.authenticate(secret).await.unwrap();
    let named: Option<String> =
        sqlx::query_scalar("SELECT id FROM accounts WHERE name = 'shop one'")
            .fetch_optional(&pool)
            .await
            .unwrap();
    assert_eq!(account, named);
    assert_eq!(accounts.authenticate("gwsk_nothing").await.unwrap(), None);
    pool.close().await;
}
