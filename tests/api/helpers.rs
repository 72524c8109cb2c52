//! Test helpers: a fresh, migrated database per test and the real server on
//! a free port, with request and database helpers; beside it, the card
//! gateway on a free port of its own, with its own fresh database, which
//! the server reaches over HTTP.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use card_gateway::{self as gateway, Gateway};
use oncepay::config::Config;
use oncepay::merchants;
use oncepay::processor::{HttpProcessor, HttpSettings, Processor};
use oncepay::startup::Application;
use oncepay_core::sweeper::{SweepReport, SweepSettings, Sweeper};
use reqwest::Response;
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::oneshot;
use uuid::Uuid;

pub use crate::database::TestDb;

/// Settings for a test server, on top of the defaults. The gateway reads
/// its own (`PROCESSOR_*`) among them, and [`Settings::processor`]'s on top.
#[derive(Clone, Debug)]
pub struct Settings {
    pub vars: Vec<(&'static str, String)>,
    pub processor_vars: Vec<(&'static str, String)>,
    /// Headers the server's processor client sends with every call.
    pub processor_headers: Vec<(&'static str, String)>,
}

impl Settings {
    pub fn new() -> Self {
        Settings {
            vars: Vec::new(),
            processor_vars: Vec::new(),
            processor_headers: Vec::new(),
        }
    }

    /// The workshop's settings, as `scripts/workshop` starts the server
    /// with them (`scripts/lib/workshop.env`).
    pub fn workshop() -> Self {
        let file = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/lib/workshop.env"
        ));
        let lines = file.lines().map(str::trim);
        let settings = lines.filter(|l| !l.is_empty() && !l.starts_with('#'));
        settings.fold(Settings::new(), |all, line| {
            let (name, value) = line.split_once('=').expect("NAME=value");
            all.set(name, value)
        })
    }

    /// A header the server's processor client sends with every call, such
    /// as `Processor-Fault` (the test gateway honours it).
    pub fn processor_header(mut self, name: &'static str, value: impl ToString) -> Self {
        self.processor_headers.push((name, value.to_string()));
        self
    }

    pub fn set(mut self, name: &'static str, value: impl ToString) -> Self {
        self.vars.push((name, value.to_string()));
        self
    }

    /// A setting of the gateway's only (such as a `PROCESSOR_LATENCY_MS`
    /// above `REQUEST_TIMEOUT`, which oncepay's own checks refuse).
    pub fn processor(mut self, name: &'static str, value: impl ToString) -> Self {
        self.processor_vars.push((name, value.to_string()));
        self
    }
}

/// A card gateway on a free port with a fresh database of its own.
pub struct TestGateway {
    pub url: String,
    pub pool: PgPool,
    /// The secret key of an account made at start, for the tests' calls.
    pub secret: String,
    shutdown: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    _db: TestDb,
}

impl TestGateway {
    /// Starts a gateway; `vars` are looked up for its settings.
    pub async fn start(vars: &[(&'static str, String)]) -> Self {
        let db = TestDb::create_empty().await;
        let (url, pool, shutdown, server) = start_gateway(&db.url, vars).await;
        let (_, secret) = new_account(&pool, "test caller").await;
        TestGateway {
            url,
            pool,
            secret,
            shutdown: Some(shutdown),
            server,
            _db: db,
        }
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.server.abort();
    }
}

/// A new account at the gateway whose ledger is `pool`: its id and secret.
pub async fn new_account(pool: &PgPool, name: &str) -> (String, String) {
    let (id, secret) = gateway::accounts::create(pool, name)
        .await
        .expect("an account at the gateway");
    (id, secret.expose().to_owned())
}

/// Starts a gateway on the database `url` (migrating it) and a free port,
/// fault injection on; `vars` win over those defaults.
async fn start_gateway(
    url: &str,
    vars: &[(&'static str, String)],
) -> (
    String,
    PgPool,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let mut all: Vec<(&str, String)> = vec![
        ("PROCESSOR_DATABASE_URL", url.to_owned()),
        ("PROCESSOR_PORT", "0".to_owned()),
        ("PROCESSOR_FAULT_INJECTION", "true".to_owned()),
    ];
    all.extend(vars.iter().cloned());
    let config = gateway::Config::from_lookup(|name| {
        all.iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    })
    .expect("a valid gateway configuration");
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect(url)
        .await
        .expect("connect to the gateway's test database");
    let gateway = Gateway::build_with_pool(config, pool.clone())
        .await
        .expect("build the gateway");
    let address = gateway.url();
    let (shutdown, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(gateway.run_until_stopped(async {
        let _ = stopped.await;
    }));
    (address, pool, shutdown, server)
}

/// An HTTP processor for `url` as `config` sets it, sending `headers`.
pub fn http_processor(
    config: &Config,
    url: &str,
    headers: reqwest::header::HeaderMap,
) -> Arc<dyn Processor> {
    Arc::new(
        HttpProcessor::with_headers(
            HttpSettings {
                url: url.to_owned(),
                api_key: config
                    .processor
                    .api_key
                    .clone()
                    .expect("a test app has a PROCESSOR_API_KEY"),
                connect_timeout: config.processor.connect_timeout,
                timeout: config.processor.timeout,
                retries: config.processor.retries,
                budget: config.keys.processing_timeout,
                retry_window: config.request_timeout,
            },
            headers,
        )
        .expect("an HTTP processor"),
    )
}

/// The real server on a free port, its database, and one merchant.
pub struct TestApp {
    pub address: String,
    pub pool: PgPool,
    pub client: reqwest::Client,
    pub api_key: String,
    pub merchant_id: Uuid,
    pub config: Config,
    /// The tests' own processor (for `sweep_once` and direct calls): the
    /// server's when a test gave one, else the same ledger as the server's
    /// through a second gateway on it that answers at once whatever
    /// `PROCESSOR_LATENCY_MS` says.
    pub processor: Arc<dyn Processor>,
    /// That second gateway, over HTTP, never wrapped: a processor that works.
    pub working_processor: Arc<dyn Processor>,
    /// The gateway's database: its ledger, `operations`.
    pub processor_pool: PgPool,
    /// The server's gateway, `http://127.0.0.1:port`.
    pub processor_url: String,
    /// The app's account at the gateway (every ledger row it makes is
    /// that account's) and its secret, the app's `PROCESSOR_API_KEY`.
    pub processor_account: String,
    pub processor_api_key: String,
    /// The tests' own gateway on the same ledger.
    own_processor_url: String,
    shutdown: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    gateways: Vec<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
    // Last, so the server and pool go before the databases are dropped.
    _db: TestDb,
    /// `None` for an app beside another, on that one's gateway.
    _processor_db: Option<TestDb>,
}

/// A fresh database with the schema as it stood before the migration
/// `version` (its file name's leading number): every migration before it
/// applied, none after. `oncepay::db::migrate` then applies the rest, as an
/// upgrade does.
pub async fn migrated_before(version: &str) -> (TestDb, PgPool) {
    let db = TestDb::create_empty().await;
    let pool = db.pool().await;
    let before = std::env::temp_dir().join(format!("oncepay-before-{version}-{}", Uuid::new_v4()));
    std::fs::create_dir(&before).unwrap();
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    for file in std::fs::read_dir(&source).unwrap() {
        let file = file.unwrap();
        if file.file_name().to_string_lossy().as_ref() < version {
            std::fs::copy(file.path(), before.join(file.file_name())).unwrap();
        }
    }
    let migrator = sqlx::migrate::Migrator::new(before.as_path())
        .await
        .unwrap();
    migrator.run(&pool).await.unwrap();
    std::fs::remove_dir_all(&before).unwrap();
    (db, pool)
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(Settings::new()).await
}

/// A second oncepay, with a database of its own and an account of its own,
/// on the gateway of `app` (as two deployments calling one processor).
/// Drop it before `app`.
pub async fn spawn_app_beside(app: &TestApp) -> TestApp {
    let beside = Beside {
        processor_url: app.processor_url.clone(),
        own_url: app.own_processor_url.clone(),
        pool: app.processor_pool.clone(),
    };
    spawn_on(Settings::new(), None, Some(beside)).await
}

/// The gateway of an app started earlier, for one started beside it.
struct Beside {
    processor_url: String,
    own_url: String,
    pool: PgPool,
}

/// Starts the server with `settings`. Its own sweeper is set to a long
/// interval so tests decide when a sweep happens (`sweep_once`).
pub async fn spawn_app_with(settings: Settings) -> TestApp {
    spawn(settings, None).await
}

/// Starts the server with the processor `processor` makes from the test
/// database's pool and the HTTP processor of the test's gateway (to wrap,
/// failing on purpose), used by the server and by `sweep_once`.
pub async fn spawn_app_with_processor(
    settings: Settings,
    processor: impl FnOnce(PgPool, Arc<dyn Processor>) -> Arc<dyn Processor> + 'static,
) -> TestApp {
    spawn(settings, Some(Box::new(processor))).await
}

type MakeProcessor = Box<dyn FnOnce(PgPool, Arc<dyn Processor>) -> Arc<dyn Processor>>;

async fn spawn(settings: Settings, make_processor: Option<MakeProcessor>) -> TestApp {
    spawn_on(settings, make_processor, None).await
}

async fn spawn_on(
    settings: Settings,
    make_processor: Option<MakeProcessor>,
    beside: Option<Beside>,
) -> TestApp {
    let db = TestDb::create().await;
    let (processor_db, processor_url, own_url, processor_pool, gateways) = match beside {
        Some(b) => (None, b.processor_url, b.own_url, b.pool, Vec::new()),
        None => {
            let processor_db = TestDb::create_empty().await;
            let mut gateway_vars = settings.vars.clone();
            gateway_vars.extend(settings.processor_vars.iter().cloned());
            let (processor_url, processor_pool, stop_gateway, gateway) =
                start_gateway(&processor_db.url, &gateway_vars).await;
            // The tests' own gateway on the same ledger, without the latency.
            gateway_vars.push(("PROCESSOR_LATENCY_MS", "0".to_owned()));
            let (own_url, _, stop_own, own) = start_gateway(&processor_db.url, &gateway_vars).await;
            let gateways = vec![(stop_gateway, gateway), (stop_own, own)];
            (
                Some(processor_db),
                processor_url,
                own_url,
                processor_pool,
                gateways,
            )
        }
    };
    let (processor_account, processor_api_key) =
        new_account(&processor_pool, &format!("oncepay {}", db.url)).await;
    let mut vars = vec![
        ("DATABASE_URL", db.url.clone()),
        ("PROCESSOR_URL", processor_url.clone()),
        ("PROCESSOR_API_KEY", processor_api_key.clone()),
        ("PORT", "0".to_owned()),
        ("SWEEP_INTERVAL", "1h".to_owned()),
        ("DATABASE_MAX_CONNECTIONS", "20".to_owned()),
        // Generous on a loaded machine; a test that needs the pool to run
        // dry sets its own.
        ("DATABASE_ACQUIRE_TIMEOUT", "10s".to_owned()),
        // No shedding either, for the same reason; a test of shedding sets
        // its own (tests/api/shedding.rs).
        ("DATABASE_QUEUE_TIMEOUT", "10s".to_owned()),
        ("DATABASE_QUEUE_OVERLOAD_TIMEOUT", "10s".to_owned()),
    ];
    vars.extend(settings.vars.iter().cloned());
    let config = Config::from_lookup(|name| {
        vars.iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    })
    .expect("a valid test configuration");
    // The server's own pool: what a test holds of it, requests lack.
    let pool = PgPoolOptions::new()
        .max_connections(config.database.max_connections)
        .acquire_timeout(config.database.acquire_timeout)
        .connect(&db.url)
        .await
        .expect("connect to the test database");
    let (merchant, key) = merchants::create(&pool, "test merchant").await.unwrap();
    // By default the server's gateway honours PROCESSOR_LATENCY_MS, and
    // the tests' own (for `sweep_once` and direct calls) answers at once.
    let working_processor = http_processor(&config, &own_url, Default::default());
    let (app, processor) = match make_processor {
        Some(make) => {
            let http = http_processor(&config, &processor_url, Default::default());
            let processor = make(pool.clone(), http);
            let app =
                Application::build_with_processor(config.clone(), pool.clone(), processor.clone())
                    .await;
            (app, processor)
        }
        None if !settings.processor_headers.is_empty() => {
            let mut headers = reqwest::header::HeaderMap::new();
            for (name, value) in &settings.processor_headers {
                headers.insert(*name, value.parse().expect("a header value"));
            }
            let server = http_processor(&config, &processor_url, headers);
            (
                Application::build_with_processor(config.clone(), pool.clone(), server).await,
                http_processor(&config, &own_url, Default::default()),
            )
        }
        None => (
            Application::build(config.clone(), pool.clone()).await,
            http_processor(&config, &own_url, Default::default()),
        ),
    };
    let app = app.expect("build the app");
    app.prepare_database().await.expect("prepare the database");
    let address = format!("http://127.0.0.1:{}", app.port());
    let (shutdown, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        app.run_until_stopped(async {
            let _ = stopped.await;
        })
        .await
        .expect("the server runs");
    });
    TestApp {
        address,
        pool,
        client: reqwest::Client::new(),
        api_key: key.expose().to_owned(),
        merchant_id: merchant.id,
        config,
        processor,
        working_processor,
        processor_pool,
        processor_url,
        processor_account,
        processor_api_key,
        own_processor_url: own_url,
        shutdown: Some(shutdown),
        server,
        gateways,
        _db: db,
        _processor_db: processor_db,
    }
}

/// Another server process on a test app's database, as a second instance
/// of the service would be: its own pool, sweeper and webhook worker.
pub struct Instance {
    shutdown: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl TestApp {
    /// Starts another instance on this app's database with `settings` on
    /// top of this app's configuration.
    pub async fn another_instance(&self, settings: Settings) -> Instance {
        let base = self.config.clone();
        let config = Config::from_lookup(|name| {
            settings
                .vars
                .iter()
                .rev()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
                .or_else(|| match name {
                    "DATABASE_URL" => Some(base.database_url.clone()),
                    "PROCESSOR_URL" => base.processor.url.clone(),
                    "PROCESSOR_API_KEY" => base.processor.api_key.clone(),
                    "PORT" => Some("0".to_owned()),
                    "SWEEP_INTERVAL" => Some("1h".to_owned()),
                    _ => None,
                })
        })
        .expect("a valid configuration for the second instance");
        let pool = PgPoolOptions::new()
            .max_connections(config.database.max_connections)
            .connect(&config.database_url)
            .await
            .expect("connect the second instance");
        let app = Application::build(config, pool)
            .await
            .expect("build the second instance");
        let (shutdown, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            app.run_until_stopped(async {
                let _ = stopped.await;
            })
            .await
            .expect("the second instance runs");
        });
        Instance {
            shutdown: Some(shutdown),
            server,
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.server.abort();
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.server.abort();
        for (stop, gateway) in self.gateways.drain(..) {
            let _ = stop.send(());
            gateway.abort();
        }
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    /// `POST /v1/charges` with a JSON body, as this app's merchant.
    pub async fn post_charge(&self, key: Option<&str>, body: &Value) -> Response {
        self.post_charge_as(&self.api_key, key, body).await
    }

    pub async fn post_charge_as(&self, api_key: &str, key: Option<&str>, body: &Value) -> Response {
        let mut request = self
            .client
            .post(self.url("/v1/charges"))
            .bearer_auth(api_key)
            .json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send().await.expect("send the request")
    }

    /// `POST /v1/refunds` with a JSON body, as this app's merchant.
    pub async fn post_refund(&self, key: Option<&str>, body: &Value) -> Response {
        self.post_refund_as(&self.api_key, key, body).await
    }

    pub async fn post_refund_as(&self, api_key: &str, key: Option<&str>, body: &Value) -> Response {
        let mut request = self
            .client
            .post(self.url("/v1/refunds"))
            .bearer_auth(api_key)
            .json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send().await.expect("send the request")
    }

    /// A succeeded `visa(amount)` charge, made over HTTP; returns its id.
    pub async fn paid_charge(&self, amount: i64) -> String {
        let charge = Answer::of(self.post_charge(None, &visa(amount)).await).await;
        assert_eq!(charge.status, 201, "{:?}", charge.body);
        charge.json()["id"].as_str().unwrap().to_owned()
    }

    /// `POST /v1/charges` with a raw body and content type.
    pub async fn post_raw(
        &self,
        key: Option<&str>,
        content_type: &str,
        body: impl Into<reqwest::Body>,
    ) -> Response {
        let mut request = self
            .client
            .post(self.url("/v1/charges"))
            .bearer_auth(&self.api_key)
            .header("Content-Type", content_type)
            .body(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send().await.expect("send the request")
    }

    pub async fn get(&self, path: &str) -> Response {
        self.client
            .get(self.url(path))
            .bearer_auth(&self.api_key)
            .send()
            .await
            .expect("send the request")
    }

    /// Another merchant in the same database; returns its key.
    pub async fn other_merchant(&self) -> String {
        let (_, key) = merchants::create(&self.pool, "other merchant")
            .await
            .unwrap();
        key.expose().to_owned()
    }

    pub async fn sweep_once(&self) -> SweepReport {
        self.sweep_once_with_timeout(self.config.keys.processing_timeout)
            .await
    }

    /// One sweeper pass that may spend `budget` deleting expired keys.
    pub async fn sweep_once_with_budget(&self, budget: Duration) -> SweepReport {
        self.sweeper(SweepSettings {
            delete_budget: budget,
            ..self.config.sweep_settings()
        })
        .sweep_once()
        .await
        .expect("a sweep pass")
    }

    /// One sweeper pass that treats rows older than `timeout` as stale.
    pub async fn sweep_once_with_timeout(&self, timeout: Duration) -> SweepReport {
        self.sweeper(SweepSettings {
            processing_timeout: timeout,
            ..self.config.sweep_settings()
        })
        .sweep_once()
        .await
        .expect("a sweep pass")
    }

    /// A sweeper on the test database with the test's processor.
    pub fn sweeper(&self, settings: SweepSettings) -> Sweeper {
        Sweeper::new(self.pool.clone(), self.processor.clone(), settings)
    }

    /// Whether the key `key` is claimed and its request still at work.
    pub async fn in_flight(&self, key: &str) -> bool {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE key = $1 AND status = 'processing')",
        )
        .bind(key)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Waits until a request with `key` has committed its claim and is
    /// still at work. A claim commits at the start of its request, so this
    /// takes at most one `REQUEST_TIMEOUT`: by then the request has been
    /// answered anyway.
    pub async fn until_in_flight(&self, key: &str) {
        until(
            self.config.request_timeout,
            &format!("{key} in flight"),
            || self.in_flight(key),
        )
        .await;
    }

    /// Waits until the events list shows every event of the app's
    /// merchant: it holds an event back while a transaction that began
    /// writing before it is still at work, in any database of the server,
    /// and other tests share the server.
    pub async fn until_listed(&self) {
        let stored = self
            .count(&format!(
                "SELECT count(*) FROM events WHERE merchant_id = '{}'",
                self.merchant_id
            ))
            .await;
        until(
            Duration::from_secs(20),
            "the list shows every event",
            || async {
                let list = Answer::of(self.get("/v1/events?limit=100").await).await;
                list.json()["data"].as_array().map_or(0, Vec::len) as i64 == stored
            },
        )
        .await;
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }

    pub async fn charges(&self) -> i64 {
        self.count("SELECT count(*) FROM charges").await
    }

    /// A count in the gateway's database.
    pub async fn processor_count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.processor_pool)
            .await
            .expect(sql)
    }

    /// Money moved: successful authorizations at the processor.
    pub async fn payments(&self) -> i64 {
        self.processor_count("SELECT count(*) FROM operations WHERE outcome = 'succeeded'")
            .await
    }

    /// Every row of the processor's ledger.
    pub async fn processor_operations(&self) -> i64 {
        self.processor_count("SELECT count(*) FROM operations")
            .await
    }

    pub async fn keys(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_keys").await
    }

    pub async fn refunds(&self) -> i64 {
        self.count("SELECT count(*) FROM refunds").await
    }

    /// Money given back: refunds recorded at the processor.
    pub async fn processor_refunds(&self) -> i64 {
        self.processor_count("SELECT count(*) FROM operations WHERE outcome = 'refunded'")
            .await
    }

    /// The types of the events about the charge or refund `object_id`, in
    /// the order they were written.
    pub async fn event_types_of(&self, object_id: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT type FROM events WHERE object_id = $1 ORDER BY seq")
            .bind(object_id)
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    pub async fn events(&self) -> i64 {
        self.count("SELECT count(*) FROM events").await
    }

    /// A charge's `amount_refunded`, as stored.
    pub async fn amount_refunded(&self, charge_id: &str) -> i64 {
        sqlx::query_scalar("SELECT amount_refunded FROM charges WHERE id = $1")
            .bind(charge_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// Polls `check` every 10 ms until it holds; fails the test, naming `what`,
/// if it does not within `within`.
pub async fn until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn visa(amount: i64) -> Value {
    serde_json::json!({"amount": amount, "currency": "usd", "source": "tok_visa"})
}

/// Reads a response: status, the named headers, the raw body.
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Answer {
    pub async fn of(response: Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("read the body");
        Answer {
            status,
            headers,
            body,
        }
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a problem response with this status and code.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(
            self.status,
            status,
            "status of {:?}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let body = self.json();
        assert_eq!(body["code"], code, "code of {body}");
        assert_eq!(body["status"], status);
        assert!(
            body["type"].is_string() && body["title"].is_string() && body["detail"].is_string()
        );
    }
}
