//! Configuration, read once at start from the environment (and `.env`).
//!
//! Every variable is optional except `DATABASE_URL`. A value that does not
//! parse, or that contradicts another, stops the process with a message
//! naming the variables.
//!
//! The settings come in groups, one per heading of `oncepay --help`
//! ([`Server`], [`RateLimits`], [`Database`], [`Keys`], [`Reconcile`],
//! [`Processor`], [`Webhooks`], [`Workshop`]); [`Config`] is the same groups
//! once the checks across them have passed. A setting whose field is not
//! named after its variable gives its `id` (the variable, which `--help`
//! also shows as the value's name) and its `long` flag.

use std::net::IpAddr;
use std::ops::RangeInclusive;
use std::str::FromStr;
use std::time::Duration;

/// The clock skew allowed between an instance and Postgres (the core's).
pub use oncepay_core::settings::MAX_CLOCK_SKEW;

/// A configuration error; its message always names the variable at fault.
#[derive(Debug, thiserror::Error)]
#[error("invalid {name}={value:?}: {reason}")]
pub struct ConfigError {
    name: String,
    value: String,
    reason: String,
}

/// The settings as written: one command-line flag and one environment
/// variable each, parsed and checked one by one (`clap`), so that `--help`
/// lists every variable with its default. [`Config`] adds the checks across
/// settings.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    #[command(flatten)]
    pub server: Server,
    #[command(flatten)]
    pub rate_limits: RateLimits,
    #[command(flatten)]
    pub database: Database,
    #[command(flatten)]
    pub keys: Keys,
    #[command(flatten)]
    pub reconcile: Reconcile,
    #[command(flatten)]
    pub processor: Processor,
    #[command(flatten)]
    pub webhooks: Webhooks,
    #[command(flatten)]
    pub workshop: Workshop,
    #[command(flatten)]
    pub broker: Broker,
}

/// Where and how the HTTP server listens, and how long requests and
/// connections may take (see `crate::http::server`).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Server")]
pub struct Server {
    /// Address to listen on.
    #[arg(long, env = "BIND_ADDR", default_value = "127.0.0.1", value_parser = ip_addr, global = true)]
    pub bind_addr: IpAddr,
    /// HTTP port.
    #[arg(long, env = "PORT", default_value = "8080", value_parser = port, global = true)]
    pub port: u16,
    /// Largest request body in bytes; more is a 413.
    #[arg(long, env = "MAX_BODY_BYTES", default_value = "65536", value_parser = positive_usize, global = true)]
    pub max_body_bytes: usize,
    // As written; `Config::from_settings` moves it out to `Config::request_timeout`.
    /// Longest a request may take before a 503 [default: half of PROCESSING_TIMEOUT, at most 30s].
    #[arg(long, env = "REQUEST_TIMEOUT", value_parser = positive_duration, global = true)]
    request_timeout: Option<Duration>,
    /// How long shutdown waits for requests in flight to finish.
    #[arg(long, env = "SHUTDOWN_GRACE", default_value = "10s", value_parser = positive_duration, global = true)]
    pub shutdown_grace: Duration,
    /// How long a client has to send a whole request head, counted from when the server waits for it.
    #[arg(id = "HTTP_HEADER_READ_TIMEOUT", long = "http-header-read-timeout", env = "HTTP_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = positive_duration, global = true)]
    pub header_read_timeout: Duration,
    /// How long a connection may stay silent with no request in flight; at most HTTP_HEADER_READ_TIMEOUT.
    #[arg(id = "HTTP_KEEP_ALIVE_TIMEOUT", long = "http-keep-alive-timeout", env = "HTTP_KEEP_ALIVE_TIMEOUT", default_value = "5s", value_parser = positive_duration, global = true)]
    pub keep_alive_timeout: Duration,
    /// The most client connections open at once (lowered to fit the open-file limit).
    #[arg(id = "HTTP_MAX_CONNECTIONS", long = "http-max-connections", env = "HTTP_MAX_CONNECTIONS", default_value = "1024", value_parser = positive_usize, global = true)]
    pub max_connections: usize,
}

/// One merchant's writes and reads on this instance (see
/// [`crate::rate_limit`]).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Rate limits")]
pub struct RateLimits {
    /// Writes (POST, DELETE) one merchant may send this instance per second, replays included; 0: no limit.
    #[arg(id = "RATE_LIMIT_PER_SECOND", long = "rate-limit-per-second", env = "RATE_LIMIT_PER_SECOND", default_value = "500", value_parser = rate, global = true)]
    pub write_per_second: u32,
    /// Writes one merchant may send at once, before RATE_LIMIT_PER_SECOND applies.
    #[arg(id = "RATE_LIMIT_BURST", long = "rate-limit-burst", env = "RATE_LIMIT_BURST", default_value = "1000", value_parser = positive_u32, global = true)]
    pub write_burst: u32,
    /// Reads (GET) one merchant may send this instance per second; 0: no limit.
    #[arg(id = "RATE_LIMIT_READ_PER_SECOND", long = "rate-limit-read-per-second", env = "RATE_LIMIT_READ_PER_SECOND", default_value = "1000", value_parser = rate, global = true)]
    pub read_per_second: u32,
    /// Reads one merchant may send at once, before RATE_LIMIT_READ_PER_SECOND applies.
    #[arg(id = "RATE_LIMIT_READ_BURST", long = "rate-limit-read-burst", env = "RATE_LIMIT_READ_BURST", default_value = "2000", value_parser = positive_u32, global = true)]
    pub read_burst: u32,
}

/// oncepay's Postgres and its pool (see [`pg_follow::follow`] and
/// [`crate::speed::admission`]).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Database")]
pub struct Database {
    // As written; `Config::from_settings` moves it out to `Config::database_url`.
    /// Postgres URL (required).
    #[arg(
        id = "DATABASE_URL",
        long = "database-url",
        env = "DATABASE_URL",
        hide_env_values = true,
        value_parser = postgres_url,
        global = true
    )]
    url: Option<String>,
    /// Pool size per server (why 16: docs/performance.md, the pool trial).
    #[arg(id = "DATABASE_MAX_CONNECTIONS", long = "database-max-connections", env = "DATABASE_MAX_CONNECTIONS", default_value = "16", value_parser = positive_u32, global = true)]
    pub max_connections: u32,
    /// How long a request waits for a database connection before a 503.
    #[arg(id = "DATABASE_ACQUIRE_TIMEOUT", long = "database-acquire-timeout", env = "DATABASE_ACQUIRE_TIMEOUT", default_value = "5s", value_parser = positive_duration, global = true)]
    pub acquire_timeout: Duration,
    /// With several hosts in DATABASE_URL, how often the host in use is asked whether it is still the primary.
    #[arg(id = "DATABASE_PRIMARY_CHECK_INTERVAL", long = "database-primary-check-interval", env = "DATABASE_PRIMARY_CHECK_INTERVAL", default_value = "1s", value_parser = check_interval, global = true)]
    pub primary_check_interval: Duration,
    /// The longest a request queues for a database connection before its work begins, while the queue keeps emptying; then 503 overloaded (REQUEST_TIMEOUT or longer: never).
    #[arg(id = "DATABASE_QUEUE_TIMEOUT", long = "database-queue-timeout", env = "DATABASE_QUEUE_TIMEOUT", default_value = "100ms", value_parser = positive_duration, global = true)]
    pub queue_timeout: Duration,
    /// The same wait once the queue has not been empty for DATABASE_QUEUE_TIMEOUT (overload); at most DATABASE_QUEUE_TIMEOUT.
    #[arg(id = "DATABASE_QUEUE_OVERLOAD_TIMEOUT", long = "database-queue-overload-timeout", env = "DATABASE_QUEUE_OVERLOAD_TIMEOUT", default_value = "5ms", value_parser = positive_duration, global = true)]
    pub queue_overload_timeout: Duration,
    // The bound on a statement's wait, live server or silent host.
    /// The longest a database statement may go unanswered: the server cancels it then (statement_timeout), and every connection to a host silent that long is cut. At least DATABASE_PRIMARY_CHECK_INTERVAL plus the check's timeout (DATABASE_ACQUIRE_TIMEOUT, at most 2s).
    #[arg(id = "DATABASE_STATEMENT_TIMEOUT", long = "database-statement-timeout", env = "DATABASE_STATEMENT_TIMEOUT", default_value = "5s", value_parser = positive_duration, global = true)]
    pub statement_timeout: Duration,
}

/// Idempotency keys: how long they live, when a `processing` one counts as
/// stale, how the sweeper settles them, and the replay cache of their
/// answers (see [`crate::speed::cache`]).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Idempotency")]
pub struct Keys {
    /// How long a key's saved answer is remembered; at least twice PROCESSING_TIMEOUT.
    #[arg(id = "IDEMPOTENCY_KEY_TTL", long = "idempotency-key-ttl", env = "IDEMPOTENCY_KEY_TTL", default_value = "24h", value_parser = positive_duration, global = true)]
    pub ttl: Duration,
    /// Refuse a POST without an Idempotency-Key.
    #[arg(id = "IDEMPOTENCY_KEY_REQUIRED", long = "idempotency-key-required", env = "IDEMPOTENCY_KEY_REQUIRED", default_value = "false", value_parser = boolean, action = clap::ArgAction::Set, num_args = 1, value_name = "BOOL", global = true)]
    pub required: bool,
    /// Age after which the sweeper settles a `processing` key.
    #[arg(long, env = "PROCESSING_TIMEOUT", default_value = "30s", value_parser = positive_duration, global = true)]
    pub processing_timeout: Duration,
    /// How often each server sweeps.
    #[arg(long, env = "SWEEP_INTERVAL", default_value = "5s", value_parser = positive_duration, global = true)]
    pub sweep_interval: Duration,
    /// How many rows one sweeper statement leases or deletes (1 to 10000).
    #[arg(long, env = "SWEEP_BATCH_SIZE", default_value = "500", value_parser = batch_size, global = true)]
    pub sweep_batch_size: i64,
    /// Memory for completed answers kept for replay, in bytes; 0 turns the cache off.
    #[arg(long, env = "REPLAY_CACHE_BYTES", default_value = "67108864", value_parser = cache_bytes, global = true)]
    pub replay_cache_bytes: u64,
}

/// The periodic reconciliation with the processor's ledger (see
/// [`crate::reconcile`]).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Reconciliation")]
pub struct Reconcile {
    /// Run the periodic reconciliation with the processor's ledger (one instance at a time).
    #[arg(id = "RECONCILE_ENABLED", long = "reconcile-enabled", env = "RECONCILE_ENABLED", default_value = "true", value_parser = boolean, action = clap::ArgAction::Set, num_args = 1, value_name = "BOOL", global = true)]
    pub enabled: bool,
    /// How often the fleet reconciles (each instance tries; one runs).
    #[arg(id = "RECONCILE_INTERVAL", long = "reconcile-interval", env = "RECONCILE_INTERVAL", default_value = "1h", value_parser = positive_duration, global = true)]
    pub interval: Duration,
    /// How far back each reconciliation looks; longer than RECONCILE_INTERVAL plus PROCESSING_TIMEOUT.
    #[arg(id = "RECONCILE_WINDOW", long = "reconcile-window", env = "RECONCILE_WINDOW", default_value = "24h", value_parser = positive_duration, global = true)]
    pub window: Duration,
}

/// The card gateway and how calls to it are made; `url` and `api_key` stay
/// `None` until `serve` starts its own gateway. Its `Debug` hides the key.
#[derive(Clone, clap::Args)]
#[command(next_help_heading = "Processor")]
pub struct Processor {
    /// The card gateway's base URL (unset: `serve` starts one of its own on a loopback port).
    #[arg(id = "PROCESSOR_URL", long = "processor-url", env = "PROCESSOR_URL", value_parser = http_url, global = true)]
    pub url: Option<String>,
    /// The secret key of oncepay's account at the card gateway (`oncepay processor accounts create` prints one); required with PROCESSOR_URL.
    #[arg(id = "PROCESSOR_API_KEY", long = "processor-api-key", env = "PROCESSOR_API_KEY", hide_env_values = true, value_parser = secret, global = true)]
    pub api_key: Option<String>,
    /// The longest a connection to the processor may take to open.
    #[arg(id = "PROCESSOR_CONNECT_TIMEOUT", long = "processor-connect-timeout", env = "PROCESSOR_CONNECT_TIMEOUT", default_value = "1s", value_parser = positive_duration, global = true)]
    pub connect_timeout: Duration,
    /// The longest one processor call may take, answer included.
    #[arg(id = "PROCESSOR_TIMEOUT", long = "processor-timeout", env = "PROCESSOR_TIMEOUT", default_value = "10s", value_parser = positive_duration, global = true)]
    pub timeout: Duration,
    /// Repeats of a processor call that failed transiently, under the same key (0 to 10).
    #[arg(id = "PROCESSOR_RETRIES", long = "processor-retries", env = "PROCESSOR_RETRIES", default_value = "2", value_parser = retries, global = true)]
    pub retries: u32,
    /// Delay of every authorization and refund at the embedded processor, in milliseconds; below REQUEST_TIMEOUT.
    #[arg(id = "PROCESSOR_LATENCY_MS", long = "processor-latency-ms", env = "PROCESSOR_LATENCY_MS", default_value = "0", value_parser = milliseconds, global = true)]
    pub latency: Duration,
    /// How long after its authorization a charge made with capture=false can still be captured (Stripe: 7 days).
    #[arg(id = "CAPTURE_WINDOW", long = "capture-window", env = "CAPTURE_WINDOW", default_value = "7d", value_parser = positive_duration, global = true)]
    pub capture_window: Duration,
}

/// The message broker events are relayed to (NATS JetStream), and how the
/// relay and the reference consumer use it (see [`crate::broker`]). Its
/// `Debug` hides any password in `NATS_URL`.
#[derive(Clone, clap::Args)]
#[command(next_help_heading = "Broker")]
pub struct Broker {
    /// NATS servers with JetStream, comma-separated, like nats://127.0.0.1:4222 (unset: no relay in `serve`; `oncepay relay` and `oncepay consume` need it).
    #[arg(id = "NATS_URL", long = "nats-url", env = "NATS_URL", value_parser = nats_urls, global = true)]
    pub nats_url: Option<NatsUrls>,
    /// Run the relay inside `serve` when NATS_URL is set (one process at a time publishes).
    #[arg(id = "RELAY_ENABLED", long = "relay-enabled", env = "RELAY_ENABLED", default_value = "true", value_parser = boolean, action = clap::ArgAction::Set, num_args = 1, value_name = "BOOL", global = true)]
    pub relay_enabled: bool,
    /// The JetStream stream the relay publishes events to (made when missing).
    #[arg(id = "NATS_STREAM", long = "nats-stream", env = "NATS_STREAM", default_value = "ONCEPAY_EVENTS", value_parser = stream_name, global = true)]
    pub stream: String,
    /// The subjects' prefix: an event goes to <prefix>.<merchant id>.<event type>.
    #[arg(id = "NATS_SUBJECT_PREFIX", long = "nats-subject-prefix", env = "NATS_SUBJECT_PREFIX", default_value = "oncepay.events", value_parser = subject_prefix, global = true)]
    pub subject_prefix: String,
    /// How long the stream remembers a message id, dropping a repeated publish of it.
    #[arg(id = "NATS_DUPLICATE_WINDOW", long = "nats-duplicate-window", env = "NATS_DUPLICATE_WINDOW", default_value = "2m", value_parser = positive_duration, global = true)]
    pub duplicate_window: Duration,
    /// Copies of the stream the broker keeps (1, or 3 on a three-node cluster).
    #[arg(id = "NATS_STREAM_REPLICAS", long = "nats-stream-replicas", env = "NATS_STREAM_REPLICAS", default_value = "1", value_parser = replicas, global = true)]
    pub replicas: usize,
    /// How often an idle relay looks for new events.
    #[arg(id = "RELAY_POLL_INTERVAL", long = "relay-poll-interval", env = "RELAY_POLL_INTERVAL", default_value = "200ms", value_parser = positive_duration, global = true)]
    pub poll_interval: Duration,
    /// Events the relay publishes before it records how far it got (1 to 10000; acks are awaited a thousand at a time).
    #[arg(id = "RELAY_BATCH", long = "relay-batch", env = "RELAY_BATCH", default_value = "100", value_parser = batch_size, global = true)]
    pub batch: i64,
    /// How long events may be held back by an older transaction before the relay warns, naming its session.
    #[arg(id = "RELAY_STALL_WARNING", long = "relay-stall-warning", env = "RELAY_STALL_WARNING", default_value = "10s", value_parser = positive_duration, global = true)]
    pub stall_warning: Duration,
    /// How long the broker waits for the consumer's ack before it delivers a message again.
    #[arg(id = "CONSUMER_ACK_WAIT", long = "consumer-ack-wait", env = "CONSUMER_ACK_WAIT", default_value = "30s", value_parser = positive_duration, global = true)]
    pub ack_wait: Duration,
    /// Deliveries of a message the consumer fails to apply before it parks it in consumer_dead_letters (1 to 100).
    #[arg(id = "CONSUMER_MAX_DELIVER", long = "consumer-max-deliver", env = "CONSUMER_MAX_DELIVER", default_value = "5", value_parser = max_deliver, global = true)]
    pub max_deliver: i64,
    /// A failure the relay or the consumer causes on purpose (chaos tests; needs FAULT_INJECTION=true).
    #[arg(
        id = "BROKER_FAULT",
        long = "broker-fault",
        env = "BROKER_FAULT",
        value_enum,
        global = true
    )]
    pub fault: Option<BrokerFault>,
}

/// `BROKER_FAULT`: where the relay or the consumer fails on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BrokerFault {
    // Plain comments, not doc comments: a value with help of its own would
    // turn `--help` into its long layout for every setting.
    // The relay aborts after the broker acknowledged a batch, before it
    // records its position.
    CrashAfterPublish,
    // The consumer aborts after committing a message, before its ack.
    CrashAfterCommit,
    // The consumer waits twice the ack wait after each commit before its
    // ack, so the broker delivers the message again meanwhile.
    AckLate,
}

/// `NATS_URL`: one or more server addresses, as written.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsUrls(pub Vec<String>);

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls = self
            .nats_url
            .as_ref()
            .map(|urls| urls.0.iter().map(|u| redact_url(u)).collect::<Vec<_>>());
        f.debug_struct("Broker")
            .field("nats_url", &urls)
            .field("relay_enabled", &self.relay_enabled)
            .field("stream", &self.stream)
            .field("subject_prefix", &self.subject_prefix)
            .field("duplicate_window", &self.duplicate_window)
            .field("replicas", &self.replicas)
            .field("poll_interval", &self.poll_interval)
            .field("batch", &self.batch)
            .field("stall_warning", &self.stall_warning)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("fault", &self.fault)
            .finish()
    }
}

/// Webhook delivery: its attempts, their spacing and concurrency, and the
/// address guard (see [`crate::webhooks::deliver`] and
/// [`crate::webhooks::guard`]).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Webhooks")]
pub struct Webhooks {
    /// The longest one webhook attempt may take, connecting and answering included.
    #[arg(id = "WEBHOOK_TIMEOUT", long = "webhook-timeout", env = "WEBHOOK_TIMEOUT", default_value = "10s", value_parser = positive_duration, global = true)]
    pub timeout: Duration,
    /// Attempts per webhook delivery, the first included (1 to 50).
    #[arg(id = "WEBHOOK_MAX_ATTEMPTS", long = "webhook-max-attempts", env = "WEBHOOK_MAX_ATTEMPTS", default_value = "16", value_parser = max_attempts, global = true)]
    pub max_attempts: i32,
    /// The wait after a webhook's first failed attempt; it doubles after each, with jitter.
    #[arg(id = "WEBHOOK_RETRY_BASE", long = "webhook-retry-base", env = "WEBHOOK_RETRY_BASE", default_value = "1m", value_parser = positive_duration, global = true)]
    pub retry_base: Duration,
    /// The longest wait between two attempts of a webhook.
    #[arg(id = "WEBHOOK_RETRY_MAX", long = "webhook-retry-max", env = "WEBHOOK_RETRY_MAX", default_value = "8h", value_parser = positive_duration, global = true)]
    pub retry_max: Duration,
    /// An endpoint that fails every delivery for this long is disabled.
    #[arg(id = "WEBHOOK_DISABLE_AFTER", long = "webhook-disable-after", env = "WEBHOOK_DISABLE_AFTER", default_value = "72h", value_parser = positive_duration, global = true)]
    pub disable_after: Duration,
    /// How often an idle delivery worker looks for due webhooks.
    #[arg(id = "WEBHOOK_POLL_INTERVAL", long = "webhook-poll-interval", env = "WEBHOOK_POLL_INTERVAL", default_value = "1s", value_parser = positive_duration, global = true)]
    pub poll_interval: Duration,
    /// Webhook attempts one process makes at once (1 to 1024).
    #[arg(id = "WEBHOOK_CONCURRENCY", long = "webhook-concurrency", env = "WEBHOOK_CONCURRENCY", default_value = "32", value_parser = concurrency, global = true)]
    pub concurrency: i64,
    /// Webhook attempts in flight to one endpoint at once, over every instance (1 to 1024).
    #[arg(id = "WEBHOOK_ENDPOINT_CONCURRENCY", long = "webhook-endpoint-concurrency", env = "WEBHOOK_ENDPOINT_CONCURRENCY", default_value = "4", value_parser = concurrency, global = true)]
    pub endpoint_concurrency: i64,
    /// Webhook attempts in flight to one merchant's endpoints at once, over every instance (1 to 1024).
    #[arg(id = "WEBHOOK_MERCHANT_CONCURRENCY", long = "webhook-merchant-concurrency", env = "WEBHOOK_MERCHANT_CONCURRENCY", default_value = "8", value_parser = concurrency, global = true)]
    pub merchant_concurrency: i64,
    /// Let webhook endpoints point at loopback, private, link-local and other internal addresses (a receiver beside the service: workshops, tests).
    #[arg(id = "WEBHOOK_ALLOW_PRIVATE", long = "webhook-allow-private", env = "WEBHOOK_ALLOW_PRIVATE", default_value = "false", value_parser = boolean, action = clap::ArgAction::Set, num_args = 1, value_name = "BOOL", global = true)]
    pub allow_private: bool,
}

/// What only workshops and tests turn on: the demo merchant, injected
/// faults, the deliberately broken endpoints and their Redis. Its `Debug`
/// hides the demo key and Redis password.
#[derive(Clone, clap::Args)]
#[command(next_help_heading = "Workshop")]
pub struct Workshop {
    /// If set, a merchant `demo` with this secret key is made sure to exist.
    #[arg(long, env = "DEMO_API_KEY", hide_env_values = true, value_parser = demo_api_key, global = true)]
    pub demo_api_key: Option<String>,
    /// Honour the Oncepay-Fault request header (tests and workshops only).
    #[arg(long, env = "FAULT_INJECTION", default_value = "false", value_parser = boolean, action = clap::ArgAction::Set, num_args = 1, value_name = "BOOL", global = true)]
    pub fault_injection: bool,
    /// Serve the deliberately broken /demo/naive/charges, /demo/naive/refunds, /demo/redis/charges and the webhook receivers (workshops only).
    #[arg(long, env = "DEMO_UNSAFE_ENDPOINTS", default_value = "false", value_parser = boolean, action = clap::ArgAction::Set, num_args = 1, value_name = "BOOL", global = true)]
    pub demo_unsafe_endpoints: bool,
    /// Redis for the workshop's key-outside-the-transaction variant, POST /demo/redis/charges (unset: none).
    #[arg(long, env = "REDIS_URL", hide_env_values = true, value_parser = redis_url, global = true)]
    pub redis_url: Option<String>,
    /// Where the lab's timelines are also written, so that a crash on purpose (card 8) does not take the crashed request's (unset: memory only).
    #[arg(long, env = "DEMO_TRACE_FILE", global = true)]
    pub trace_file: Option<std::path::PathBuf>,
    /// The model checker's explorer at a naive design's counterexample, which the lab links to (workshops only; unset: no link).
    #[arg(long, env = "DEMO_MODEL_URL", global = true)]
    pub model_url: Option<String>,
}

/// The service's settings, checked across groups. See `.env.example` for
/// what each one does. Its `Debug` redacts the database password and the
/// secret keys.
#[derive(Clone)]
pub struct Config {
    /// `DATABASE_URL`, which every command but `oncepay processor` needs.
    pub database_url: String,
    /// The longest a request may take before it is answered `503
    /// request_timeout`: `REQUEST_TIMEOUT`, by default half of
    /// `PROCESSING_TIMEOUT`, at most 30 s; always below it.
    pub request_timeout: Duration,
    pub server: Server,
    pub rate_limits: RateLimits,
    pub database: Database,
    pub keys: Keys,
    pub reconcile: Reconcile,
    pub processor: Processor,
    pub webhooks: Webhooks,
    pub workshop: Workshop,
    pub broker: Broker,
}

/// Reads just the settings, for [`Config::from_lookup`].
#[derive(Debug, clap::Parser)]
#[command(name = "oncepay", no_binary_name = true)]
struct SettingsOnly {
    #[command(flatten)]
    settings: Settings,
}

impl Settings {
    /// Every setting at its default, the environment unread (for commands
    /// that do not use oncepay's settings, such as `oncepay processor`).
    pub fn parse_defaults() -> Self {
        use clap::{CommandFactory, FromArgMatches};
        let matches = SettingsOnly::command()
            .mut_args(|arg| arg.env(None))
            .get_matches_from(Vec::<String>::new());
        SettingsOnly::from_arg_matches(&matches)
            .expect("the defaults parse")
            .settings
    }

    /// `command` with every setting whose variable is set but blank treated
    /// as unset, as if the variable were absent (clap would parse "").
    pub fn blank_is_unset(command: clap::Command) -> clap::Command {
        command.mut_args(|arg| {
            let blank = arg
                .get_env()
                .and_then(std::env::var_os)
                .is_some_and(|v| v.to_string_lossy().trim().is_empty());
            if blank { arg.env(None) } else { arg }
        })
    }
}

impl Config {
    /// How oncepay's pool is made, from `DATABASE_*`.
    pub fn pool_settings(&self) -> pg_follow::Settings {
        pg_follow::Settings {
            name: "oncepay",
            max_connections: self.database.max_connections,
            acquire_timeout: self.database.acquire_timeout,
            check_interval: self.database.primary_check_interval,
            statement_timeout: self.database.statement_timeout,
        }
    }

    /// How the server's `HttpProcessor` (and the ledger client) reach the
    /// gateway at `PROCESSOR_URL`, from `PROCESSOR_*` and the request
    /// deadlines.
    pub fn processor_settings(&self) -> anyhow::Result<crate::processor::HttpSettings> {
        use anyhow::Context as _;
        let url = self.processor.url.clone().context(
            "PROCESSOR_URL is unset: set it to the card gateway's URL (oncepay processor), \
             or let oncepay serve start its own",
        )?;
        let api_key = self.processor.api_key.clone().context(
            "PROCESSOR_API_KEY is unset: set it to oncepay's secret key at the card gateway \
             at PROCESSOR_URL (`oncepay processor accounts create --name oncepay` prints one)",
        )?;
        Ok(crate::processor::HttpSettings {
            url,
            api_key,
            connect_timeout: self.processor.connect_timeout,
            timeout: self.processor.timeout,
            retries: self.processor.retries,
            budget: self.keys.processing_timeout,
            retry_window: self.request_timeout,
        })
    }

    /// The durations guarded operations run by, checked by the core when
    /// the configuration was read ([`Config::from_settings`]).
    pub fn timeouts(&self) -> oncepay_core::settings::Timeouts {
        oncepay_core::settings::Timeouts::new(
            self.keys.ttl,
            self.keys.processing_timeout,
            self.request_timeout,
            self.keys.sweep_interval,
        )
        .expect("checked when the configuration was read")
    }

    /// The sweeper's settings in a `serve` or `sweep` process.
    pub fn sweep_settings(&self) -> oncepay_core::sweeper::SweepSettings {
        oncepay_core::sweeper::SweepSettings {
            processing_timeout: self.keys.processing_timeout,
            key_ttl: self.keys.ttl,
            batch_size: self.keys.sweep_batch_size,
            delete_budget: oncepay_core::sweeper::DELETE_BUDGET,
            capture_window: self.processor.capture_window,
        }
    }

    /// Reads the configuration through `lookup`, so tests need not touch the
    /// process environment: each variable `lookup` knows is given to the same
    /// parser as the command line's (blank counts as unset).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        use clap::{CommandFactory, FromArgMatches};
        let mut args = Vec::new();
        let command = SettingsOnly::command().mut_args(|arg| {
            if let Some(name) = arg.get_env().and_then(|n| n.to_str()) {
                if let Some(value) = lookup(name).filter(|v| !v.trim().is_empty()) {
                    let long = arg.get_long().expect("every setting has a long flag");
                    args.push(format!("--{long}={value}"));
                }
            }
            // Only `lookup` is read: never the process environment.
            arg.env(None)
        });
        // The flags are named after the variables; errors are reported by
        // variable, so tell the parser which is which.
        let names = SettingsOnly::command();
        let matches = command
            .try_get_matches_from(&args)
            .map_err(|e| ConfigError::from_clap(&e, &names))?;
        let settings = SettingsOnly::from_arg_matches(&matches)
            .map_err(|e| ConfigError::from_clap(&e, &names))?
            .settings;
        Self::from_settings(settings)
    }

    /// Adds the checks across settings (and the one required setting) to
    /// what the parser checked.
    pub fn from_settings(settings: Settings) -> Result<Self, ConfigError> {
        let Settings {
            mut server,
            rate_limits,
            mut database,
            keys,
            reconcile,
            processor,
            webhooks,
            workshop,
            broker,
        } = settings;
        let database_url = database.url.take().ok_or_else(|| ConfigError {
            name: "DATABASE_URL".into(),
            value: String::new(),
            reason: "is required (for example postgres://postgres@127.0.0.1:5432/oncepay)".into(),
        })?;
        let request_timeout = server
            .request_timeout
            .take()
            .unwrap_or((keys.processing_timeout / 2).min(Duration::from_secs(30)));
        let config = Config {
            database_url,
            request_timeout,
            server,
            rate_limits,
            database,
            keys,
            reconcile,
            processor,
            webhooks,
            workshop,
            broker,
        };
        if config.broker.fault.is_some() && !config.workshop.fault_injection {
            return Err(ConfigError {
                name: "BROKER_FAULT".into(),
                value: format!("{:?}", config.broker.fault),
                reason:
                    "needs FAULT_INJECTION=true: it makes the relay or the consumer fail on purpose"
                        .into(),
            });
        }
        // A request (and the processor call in it) must be over before its
        // key counts as stale: past PROCESSING_TIMEOUT, a retry or the sweeper
        // settles the record, fencing off the processor, so a slower request
        // would be voided while still at work.
        for (name, value, written) in [(
            "PROCESSOR_LATENCY_MS",
            config.processor.latency,
            config.processor.latency.as_millis().to_string(),
        )] {
            if value >= config.keys.processing_timeout {
                return Err(ConfigError {
                    name: name.into(),
                    value: written,
                    reason: format!(
                        "must be below PROCESSING_TIMEOUT ({}): a request still at work then \
                         would have its record settled under it",
                        humantime::format_duration(config.keys.processing_timeout)
                    ),
                });
            }
        }
        // Every charge waits PROCESSOR_LATENCY_MS at the processor: at or
        // above REQUEST_TIMEOUT, every one would be answered 503.
        if config.processor.latency >= config.request_timeout {
            return Err(ConfigError {
                name: "PROCESSOR_LATENCY_MS".into(),
                value: config.processor.latency.as_millis().to_string(),
                reason: format!(
                    "must be below REQUEST_TIMEOUT ({}): every charge would wait that long at \
                     the processor and be answered 503 request_timeout",
                    humantime::format_duration(config.request_timeout)
                ),
            });
        }
        if config.database.queue_overload_timeout > config.database.queue_timeout {
            return Err(ConfigError {
                name: "DATABASE_QUEUE_OVERLOAD_TIMEOUT".into(),
                value: humantime::format_duration(config.database.queue_overload_timeout)
                    .to_string(),
                reason: format!(
                    "must be at most DATABASE_QUEUE_TIMEOUT ({}): it is the wait under overload",
                    humantime::format_duration(config.database.queue_timeout)
                ),
            });
        }
        // hyper's header timer also runs while a connection waits for its
        // next request, so a longer keep-alive would never be reached.
        if config.server.keep_alive_timeout > config.server.header_read_timeout {
            return Err(ConfigError {
                name: "HTTP_KEEP_ALIVE_TIMEOUT".into(),
                value: humantime::format_duration(config.server.keep_alive_timeout).to_string(),
                reason: format!(
                    "must be at most HTTP_HEADER_READ_TIMEOUT ({}), which also bounds how long \
                     a connection may wait for its next request",
                    humantime::format_duration(config.server.header_read_timeout)
                ),
            });
        }
        // The rules between the guarantee's own timeouts are the core's.
        if let Err(unsafe_) = oncepay_core::settings::Timeouts::new(
            config.keys.ttl,
            config.keys.processing_timeout,
            config.request_timeout,
            config.keys.sweep_interval,
        ) {
            let value = match unsafe_.setting {
                "REQUEST_TIMEOUT" => config.request_timeout,
                _ => config.keys.ttl,
            };
            return Err(ConfigError {
                name: unsafe_.setting.into(),
                value: humantime::format_duration(value).to_string(),
                reason: unsafe_.reason,
            });
        }
        // Each run must overlap the one before by more than the in-flight
        // age, or what was in flight at one run's end is never looked at.
        if config.reconcile.window <= config.reconcile.interval + config.keys.processing_timeout {
            return Err(ConfigError {
                name: "RECONCILE_WINDOW".into(),
                value: humantime::format_duration(config.reconcile.window).to_string(),
                reason: format!(
                    "must be longer than RECONCILE_INTERVAL ({}) plus PROCESSING_TIMEOUT ({}), \
                     so that each run overlaps the one before by more than what is in flight",
                    humantime::format_duration(config.reconcile.interval),
                    humantime::format_duration(config.keys.processing_timeout)
                ),
            });
        }
        if config.webhooks.retry_max < config.webhooks.retry_base {
            return Err(ConfigError {
                name: "WEBHOOK_RETRY_MAX".into(),
                value: humantime::format_duration(config.webhooks.retry_max).to_string(),
                reason: format!(
                    "must be at least WEBHOOK_RETRY_BASE ({})",
                    humantime::format_duration(config.webhooks.retry_base)
                ),
            });
        }
        check_statement_timeout(&config)?;
        Ok(config)
    }

    /// The database URL with any password replaced, fit for logs.
    pub fn redacted_database_url(&self) -> String {
        redact_url(&self.database_url)
    }
}

/// A silent host's connections are cut within a check interval and a
/// check's timeout ([`pg_follow::Settings::silence_bound`]): no
/// statement may be given less, or a wait on a silent host would outlast it.
fn check_statement_timeout(config: &Config) -> Result<(), ConfigError> {
    let pool = config.pool_settings();
    if pool.statement_timeout < pool.silence_bound() {
        return Err(ConfigError {
            name: "DATABASE_STATEMENT_TIMEOUT".into(),
            value: humantime::format_duration(pool.statement_timeout).to_string(),
            reason: format!(
                "must be at least DATABASE_PRIMARY_CHECK_INTERVAL ({}) plus the check's timeout \
                 (DATABASE_ACQUIRE_TIMEOUT, at most 2s: {}), within which the connections to a \
                 silent database host are cut",
                humantime::format_duration(pool.check_interval),
                humantime::format_duration(pool.connect_timeout())
            ),
        });
    }
    Ok(())
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &self.redacted_database_url())
            .field("request_timeout", &self.request_timeout)
            .field("server", &self.server)
            .field("rate_limits", &self.rate_limits)
            .field("database", &self.database)
            .field("keys", &self.keys)
            .field("reconcile", &self.reconcile)
            .field("processor", &self.processor)
            .field("webhooks", &self.webhooks)
            .field("workshop", &self.workshop)
            .finish()
    }
}

impl std::fmt::Debug for Processor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("api_key", &self.api_key.as_ref().map(|_| "***"))
            .field("connect_timeout", &self.connect_timeout)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .field("latency", &self.latency)
            .field("capture_window", &self.capture_window)
            .finish()
    }
}

impl std::fmt::Debug for Workshop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workshop")
            .field(
                "demo_api_key",
                &self.demo_api_key.as_ref().map(|_| "sk_test_***"),
            )
            .field("fault_injection", &self.fault_injection)
            .field("demo_unsafe_endpoints", &self.demo_unsafe_endpoints)
            .field("redis_url", &self.redis_url.as_deref().map(redact_url))
            .finish()
    }
}

impl RateLimits {
    /// One merchant's writes, from `RATE_LIMIT_PER_SECOND` and `RATE_LIMIT_BURST`.
    pub fn writes(&self) -> crate::rate_limit::Limit {
        crate::rate_limit::Limit {
            per_second: self.write_per_second,
            burst: self.write_burst,
        }
    }

    /// One merchant's reads, from `RATE_LIMIT_READ_*`.
    pub fn reads(&self) -> crate::rate_limit::Limit {
        crate::rate_limit::Limit {
            per_second: self.read_per_second,
            burst: self.read_burst,
        }
    }
}

/// Replaces the password of a `scheme://user:password@host/...?password=...`
/// URL (several hosts included, see [`pg_follow::redact`]).
pub fn redact_url(url: &str) -> String {
    pg_follow::redact(url)
}

impl ConfigError {
    /// The parser's error about a flag, told by the variable behind it; a
    /// secret's value is not repeated.
    pub fn from_clap(error: &clap::Error, command: &clap::Command) -> Self {
        use clap::error::{ContextKind, ContextValue};
        let context = |kind| match error.get(kind) {
            Some(ContextValue::String(s)) => Some(s.clone()),
            _ => None,
        };
        let flag = context(ContextKind::InvalidArg).unwrap_or_default();
        let arg = command.get_arguments().find(|a| {
            a.get_long()
                .is_some_and(|l| flag.starts_with(&format!("--{l} ")))
        });
        let name = arg
            .and_then(|a| a.get_env())
            .map_or_else(|| flag.clone(), |n| n.to_string_lossy().into_owned());
        let secret = arg.is_some_and(|a| a.is_hide_env_values_set());
        let value = if secret {
            "<redacted>".into()
        } else {
            context(ContextKind::InvalidValue).unwrap_or_default()
        };
        let reason = std::error::Error::source(error)
            .map_or_else(|| error.kind().to_string(), |e| e.to_string());
        ConfigError {
            name,
            value,
            reason,
        }
    }
}

fn positive<T: PartialEq + Default>(value: T) -> Result<T, String> {
    if value == T::default() {
        Err("must be greater than zero".into())
    } else {
        Ok(value)
    }
}

/// Durations are written like `500ms`, `30s`, `24h`.
fn positive_duration(value: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(value.trim())
        .map_err(|e| format!("{e} (write durations like 500ms, 30s or 24h)"))?;
    positive(duration)
}

fn boolean(value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("must be true or false".into()),
    }
}

fn positive_u32(value: &str) -> Result<u32, String> {
    positive(value.trim().parse::<u32>().map_err(|e| e.to_string())?)
}

/// Requests per second: a whole number, 0 for no limit.
fn rate(value: &str) -> Result<u32, String> {
    value.trim().parse::<u32>().map_err(|e| e.to_string())
}

fn positive_usize(value: &str) -> Result<usize, String> {
    positive(value.trim().parse::<usize>().map_err(|e| e.to_string())?)
}

fn ip_addr(value: &str) -> Result<IpAddr, String> {
    IpAddr::from_str(value.trim()).map_err(|e| e.to_string())
}

fn port(value: &str) -> Result<u16, String> {
    value.trim().parse().map_err(|e| format!("{e}"))
}

/// A Postgres URL: `postgres://` or `postgresql://`, one host or several
/// (see [`pg_follow::PgUrl`]).
fn postgres_url(value: &str) -> Result<String, String> {
    let value = value.trim();
    pg_follow::PgUrl::parse(value)
        .map(|_| value.to_owned())
        .map_err(|e| e.to_string())
}

/// The primary check's interval: 100ms to 1m. More often costs a query
/// each time; less often leaves requests on a lost primary for longer
/// (until one of them wakes the check).
fn check_interval(value: &str) -> Result<Duration, String> {
    let duration = positive_duration(value)?;
    if duration < Duration::from_millis(100) || duration > Duration::from_secs(60) {
        return Err("must be from 100ms to 1m".into());
    }
    Ok(duration)
}

/// A secret key to send as a header: 1 to 255 visible ASCII characters.
fn secret(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value.is_empty() || value.len() > 255 || !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be 1 to 255 visible ASCII characters".into());
    }
    Ok(value.to_owned())
}

fn demo_api_key(value: &str) -> Result<String, String> {
    let value = value.trim();
    match crate::merchants::ApiKey::parse(value) {
        Some(_) => Ok(value.to_owned()),
        None => Err("must be sk_test_ followed by at least 32 letters or digits".into()),
    }
}

/// A URL the Redis client accepts: `redis://`, `rediss://` needs TLS and is refused.
fn redis_url(value: &str) -> Result<String, String> {
    use redis::IntoConnectionInfo;
    let value = value.trim();
    if value.starts_with("rediss://") {
        return Err("rediss:// (TLS) is not supported; use redis://".into());
    }
    value
        .into_connection_info()
        .map(|_| value.to_owned())
        .map_err(|e| format!("{e} (write it like redis://127.0.0.1:6379)"))
}

/// The processor's base URL: `http://` or `https://`, a host, no query.
fn http_url(value: &str) -> Result<String, String> {
    let value = value.trim();
    let url =
        url::Url::parse(value).map_err(|e| format!("{e} (write it like http://127.0.0.1:8090)"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(
            "must be an http:// or https:// URL with a host, like http://127.0.0.1:8090".into(),
        );
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must have no query or fragment".into());
    }
    Ok(value.trim_end_matches('/').to_owned())
}

/// A whole number within `range`.
fn whole_number<T>(value: &str, range: RangeInclusive<T>) -> Result<T, String>
where
    T: FromStr + PartialOrd + std::fmt::Display,
{
    value
        .trim()
        .parse::<T>()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| {
            format!(
                "must be a whole number from {} to {}",
                range.start(),
                range.end()
            )
        })
}

fn retries(value: &str) -> Result<u32, String> {
    whole_number(value, 0..=10)
}

fn max_attempts(value: &str) -> Result<i32, String> {
    whole_number(value, 1..=50)
}

fn concurrency(value: &str) -> Result<i64, String> {
    whole_number(value, 1..=1024)
}

/// `NATS_URL`: comma-separated addresses, each `nats://host:port`,
/// `tls://host:port` or `host:port`.
fn nats_urls(value: &str) -> Result<NatsUrls, String> {
    let urls: Vec<String> = value.split(',').map(|u| u.trim().to_owned()).collect();
    for url in &urls {
        url.parse::<async_nats::ServerAddr>()
            .map_err(|e| format!("{e} (write it like nats://127.0.0.1:4222)"))?;
    }
    Ok(NatsUrls(urls))
}

/// A JetStream stream's name: letters, digits, `-` and `_`, at most 64.
fn stream_name(value: &str) -> Result<String, String> {
    let value = value.trim();
    let ok = (1..=64).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    ok.then(|| value.to_owned())
        .ok_or_else(|| "must be 1 to 64 letters, digits, - or _".into())
}

/// Subject tokens of letters, digits, `-` and `_`, joined by dots.
fn subject_prefix(value: &str) -> Result<String, String> {
    let value = value.trim();
    let token = |t: &str| {
        !t.is_empty()
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    (value.len() <= 128 && value.split('.').all(token))
        .then(|| value.to_owned())
        .ok_or_else(|| "must be dot-separated tokens of letters, digits, - or _".into())
}

fn replicas(value: &str) -> Result<usize, String> {
    whole_number(value, 1..=5)
}

fn batch_size(value: &str) -> Result<i64, String> {
    whole_number(value, 1..=10_000)
}

fn max_deliver(value: &str) -> Result<i64, String> {
    whole_number(value, 1..=100)
}

fn milliseconds(value: &str) -> Result<Duration, String> {
    value
        .trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|e| format!("{e} (a whole number of milliseconds)"))
}

fn cache_bytes(value: &str) -> Result<u64, String> {
    value
        .trim()
        .parse::<u64>()
        .map_err(|e| format!("{e} (a whole number of bytes; 0 turns the cache off)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let mut map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        map.entry("DATABASE_URL".into())
            .or_insert_with(|| "postgres://localhost/x".into());
        Config::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn defaults_match_the_documented_values() {
        let c = config(&[]).unwrap();
        assert_eq!(c.database.max_connections, 16);
        assert_eq!(c.database.acquire_timeout, Duration::from_secs(5));
        assert_eq!(c.database.primary_check_interval, Duration::from_secs(1));
        assert_eq!(c.database.queue_timeout, Duration::from_millis(100));
        assert_eq!(c.database.queue_overload_timeout, Duration::from_millis(5));
        assert_eq!(c.server.bind_addr.to_string(), "127.0.0.1");
        assert_eq!(c.server.port, 8080);
        assert_eq!(c.workshop.demo_api_key, None);
        assert_eq!(c.keys.ttl, Duration::from_secs(86_400));
        assert!(!c.keys.required);
        assert_eq!(c.keys.processing_timeout, Duration::from_secs(30));
        assert_eq!(c.keys.sweep_interval, Duration::from_secs(5));
        assert_eq!(c.keys.sweep_batch_size, 500);
        assert_eq!(c.processor.latency, Duration::ZERO);
        assert_eq!(c.processor.url, None);
        assert_eq!(c.processor.connect_timeout, Duration::from_secs(1));
        assert_eq!(c.processor.timeout, Duration::from_secs(10));
        assert_eq!(c.processor.retries, 2);
        assert_eq!(c.server.max_body_bytes, 65_536);
        assert_eq!(c.keys.replay_cache_bytes, 67_108_864);
        assert!(!c.workshop.fault_injection);
        assert!(!c.workshop.demo_unsafe_endpoints);
        assert_eq!(c.request_timeout, Duration::from_secs(15));
        assert_eq!(c.server.shutdown_grace, Duration::from_secs(10));
        assert_eq!(c.server.header_read_timeout, Duration::from_secs(10));
        assert_eq!(c.server.keep_alive_timeout, Duration::from_secs(5));
        assert_eq!(c.server.max_connections, 1024);
        assert_eq!(
            (c.rate_limits.write_per_second, c.rate_limits.write_burst),
            (500, 1000)
        );
        assert_eq!(
            (c.rate_limits.read_per_second, c.rate_limits.read_burst),
            (1000, 2000)
        );
        assert_eq!(c.webhooks.timeout, Duration::from_secs(10));
        assert_eq!(c.webhooks.max_attempts, 16);
        assert_eq!(c.webhooks.retry_base, Duration::from_secs(60));
        assert_eq!(c.webhooks.retry_max, Duration::from_secs(8 * 3600));
        assert_eq!(c.webhooks.disable_after, Duration::from_secs(72 * 3600));
        assert_eq!(c.webhooks.poll_interval, Duration::from_secs(1));
        assert_eq!(c.webhooks.concurrency, 32);
        assert_eq!(c.webhooks.endpoint_concurrency, 4);
        assert_eq!(c.webhooks.merchant_concurrency, 8);
        assert!(!c.webhooks.allow_private);
    }

    #[test]
    fn the_webhook_address_guard_is_on_unless_allow_private_is_true() {
        assert!(!config(&[]).unwrap().webhooks.allow_private);
        let c = config(&[("WEBHOOK_ALLOW_PRIVATE", "true")]).unwrap();
        assert!(c.webhooks.allow_private);
        let c = config(&[("WEBHOOK_ALLOW_PRIVATE", "false")]).unwrap();
        assert!(!c.webhooks.allow_private);
        let err = config(&[("WEBHOOK_ALLOW_PRIVATE", "sometimes")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("WEBHOOK_ALLOW_PRIVATE"), "{err}");
    }

    /// The rows of the README's configuration table: name and default cell.
    fn readme_defaults() -> HashMap<&'static str, &'static str> {
        let readme = include_str!("../docs/operations.md");
        let section = readme
            .split("\n## Configuration\n")
            .nth(1)
            .expect("a Configuration section in the README");
        let section = section.split("\n## ").next().unwrap();
        section
            .lines()
            .filter_map(|line| {
                let mut cells = line.strip_prefix("| `")?.split(" | ");
                let name = cells.next()?.strip_suffix('`')?;
                Some((name, cells.next()?))
            })
            .collect()
    }

    /// The value `.env.example` gives `name` (set, or commented out).
    fn env_example_value(name: &str) -> Option<&'static str> {
        include_str!("../.env.example").lines().find_map(|line| {
            line.trim_start_matches("# ")
                .strip_prefix(name)?
                .strip_prefix('=')
        })
    }

    #[test]
    fn the_processor_api_key_is_read_and_never_shown() {
        let secret = "gwsk_abcdefghijklmnop_ABCDEFGHIJKLMNOPQRSTUVWXYZ012345";
        let c = config(&[("PROCESSOR_API_KEY", secret)]).unwrap();
        assert_eq!(c.processor.api_key.as_deref(), Some(secret));
        assert!(!format!("{c:?}").contains(secret));
        let err = config(&[("PROCESSOR_API_KEY", "two words")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("PROCESSOR_API_KEY") && !err.contains("two words"),
            "{err}"
        );
    }

    #[test]
    fn the_readme_and_env_example_give_every_setting_its_actual_default() {
        // Every variable the configuration reads, in the order it reads them.
        let read = std::sync::Mutex::new(Vec::new());
        Config::from_lookup(|name| {
            read.lock().unwrap().push(name.to_owned());
            (name == "DATABASE_URL").then(|| "postgres://localhost/x".to_owned())
        })
        .unwrap();
        let read = read.into_inner().unwrap();
        let readme = readme_defaults();
        let defaults = format!("{:?}", config(&[]).unwrap());
        for name in &read {
            let cell = readme
                .get(name.as_str())
                .unwrap_or_else(|| panic!("{name} is missing from the README's table"));
            let example = env_example_value(name)
                .unwrap_or_else(|| panic!("{name} is missing from .env.example"));
            match name.as_str() {
                "DATABASE_URL" => assert_eq!(*cell, "(required)"),
                "DEMO_API_KEY" => {
                    assert_eq!(*cell, "unset");
                    assert!(config(&[]).unwrap().workshop.demo_api_key.is_none());
                }
                "REDIS_URL" => {
                    assert_eq!(*cell, "unset");
                    assert!(config(&[]).unwrap().workshop.redis_url.is_none());
                }
                "DEMO_TRACE_FILE" => {
                    assert_eq!(*cell, "unset");
                    assert!(config(&[]).unwrap().workshop.trace_file.is_none());
                }
                "DEMO_MODEL_URL" => {
                    assert_eq!(*cell, "unset");
                    assert!(config(&[]).unwrap().workshop.model_url.is_none());
                }
                "BROKER_FAULT" => {
                    assert_eq!(*cell, "unset");
                    assert!(config(&[]).unwrap().broker.fault.is_none());
                }
                "NATS_URL" => {
                    assert_eq!(*cell, "unset");
                    assert!(config(&[]).unwrap().broker.nats_url.is_none());
                }
                "PROCESSOR_URL" => {
                    assert!(cell.starts_with("unset"), "{cell}");
                    assert!(config(&[]).unwrap().processor.url.is_none());
                }
                "PROCESSOR_API_KEY" => {
                    assert!(cell.starts_with("unset"), "{cell}");
                    assert!(config(&[]).unwrap().processor.api_key.is_none());
                }
                _ => {
                    // The last value in backquotes: `REQUEST_TIMEOUT`'s cell
                    // gives its rule, then the value it comes to.
                    let documented = cell
                        .rsplit('`')
                        .nth(1)
                        .unwrap_or_else(|| panic!("{name}: no default in {cell:?}"));
                    for (source, value) in [("README", documented), (".env.example", example)] {
                        let set = config(&[(name.as_str(), value)])
                            .unwrap_or_else(|e| panic!("{name}={value} from the {source}: {e}"));
                        assert_eq!(
                            format!("{set:?}"),
                            defaults,
                            "{name}={value}, as the {source} gives it, is not the default"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_help_lists_every_variable_with_its_default() {
        use clap::CommandFactory;
        let help = SettingsOnly::command().render_long_help().to_string();
        let defaults = readme_defaults();
        for arg in SettingsOnly::command().get_arguments() {
            let Some(name) = arg.get_env().and_then(|n| n.to_str()) else {
                continue;
            };
            assert!(help.contains(&format!("[env: {name}")), "{name}: {help}");
            if let Some(default) = arg.get_default_values().first() {
                let default = default.to_str().unwrap();
                assert!(help.contains(&format!("[default: {default}]")), "{help}");
                assert!(
                    defaults[name].contains(&format!("`{default}`")),
                    "{name}: the help's {default} is not the README's {}",
                    defaults[name]
                );
            }
        }
    }

    #[test]
    fn a_processor_url_must_be_http_with_a_host() {
        let c = config(&[("PROCESSOR_URL", "http://127.0.0.1:8090/")]).unwrap();
        assert_eq!(c.processor.url.as_deref(), Some("http://127.0.0.1:8090"));
        for bad in [
            "127.0.0.1:8090",
            "ftp://x",
            "http://x/?a=1",
            "postgres://db/x",
        ] {
            let err = config(&[("PROCESSOR_URL", bad)]).unwrap_err().to_string();
            assert!(err.contains("PROCESSOR_URL"), "{err}");
        }
        let err = config(&[("PROCESSOR_RETRIES", "11")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("PROCESSOR_RETRIES"), "{err}");
    }

    #[test]
    fn a_blank_variable_counts_as_unset() {
        let c = config(&[("PORT", " "), ("FAULT_INJECTION", "")]).unwrap();
        assert_eq!(c.server.port, 8080);
        assert!(!c.workshop.fault_injection);
    }

    #[test]
    fn the_replay_cache_is_sized_in_bytes_and_zero_turns_it_off() {
        let c = config(&[("REPLAY_CACHE_BYTES", "1048576")]).unwrap();
        assert_eq!(c.keys.replay_cache_bytes, 1 << 20);
        let c = config(&[("REPLAY_CACHE_BYTES", "0")]).unwrap();
        assert_eq!(c.keys.replay_cache_bytes, 0);
    }

    #[test]
    fn the_request_timeout_defaults_to_half_the_processing_timeout_at_most_30s() {
        let c = config(&[("PROCESSING_TIMEOUT", "1s")]).unwrap();
        assert_eq!(c.request_timeout, Duration::from_millis(500));
        let c = config(&[("PROCESSING_TIMEOUT", "5m"), ("IDEMPOTENCY_KEY_TTL", "1h")]).unwrap();
        assert_eq!(c.request_timeout, Duration::from_secs(30));
        let c = config(&[("REQUEST_TIMEOUT", "29s")]).unwrap();
        assert_eq!(c.request_timeout, Duration::from_secs(29));
    }

    #[test]
    fn a_latency_or_request_timeout_at_or_above_the_processing_timeout_is_refused() {
        for (name, value) in [
            ("PROCESSOR_LATENCY_MS", "2000"),
            ("PROCESSOR_LATENCY_MS", "3000"),
            ("REQUEST_TIMEOUT", "2s"),
            ("REQUEST_TIMEOUT", "1m"),
        ] {
            let err = config(&[("PROCESSING_TIMEOUT", "2s"), (name, value)])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(name) && err.contains("PROCESSING_TIMEOUT"),
                "{err} should name {name} and PROCESSING_TIMEOUT"
            );
        }
        assert!(
            config(&[
                ("PROCESSING_TIMEOUT", "2s"),
                ("PROCESSOR_LATENCY_MS", "1998"),
                ("REQUEST_TIMEOUT", "1999ms"),
            ])
            .is_ok()
        );
        // The old default pair, both 30 s, is refused when written out.
        let err = config(&[("REQUEST_TIMEOUT", "30s")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("REQUEST_TIMEOUT"), "{err}");
    }

    #[test]
    fn a_latency_at_or_above_the_request_timeout_is_refused_naming_both() {
        for (latency, timeout) in [("1000", "1s"), ("1500", "1s"), ("20000", "")] {
            let mut vars = vec![("PROCESSOR_LATENCY_MS", latency)];
            if !timeout.is_empty() {
                vars.push(("REQUEST_TIMEOUT", timeout));
            }
            let err = config(&vars).unwrap_err().to_string();
            assert!(
                err.contains("PROCESSOR_LATENCY_MS") && err.contains("REQUEST_TIMEOUT"),
                "{err} should name PROCESSOR_LATENCY_MS and REQUEST_TIMEOUT"
            );
        }
        assert!(config(&[("PROCESSOR_LATENCY_MS", "999"), ("REQUEST_TIMEOUT", "1s")]).is_ok());
    }

    #[test]
    fn a_database_url_that_is_not_postgres_is_refused_naming_the_variable() {
        for url in ["mysql://x", "x", "http://db/x", "postgres://db:port/x"] {
            let err = config(&[("DATABASE_URL", url)]).unwrap_err().to_string();
            assert!(err.contains("DATABASE_URL"), "{err}");
            assert!(
                err.contains("postgres://"),
                "{err} should say what is expected"
            );
        }
        let err = config(&[("DATABASE_URL", "mysql://app:hunter2@db/x")])
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
        for url in [
            "postgres://db/x",
            "postgresql://app:pw@db:5433/x?sslmode=disable",
        ] {
            assert_eq!(config(&[("DATABASE_URL", url)]).unwrap().database_url, url);
        }
    }

    #[test]
    fn a_database_url_with_several_hosts_is_taken_and_a_bad_target_refused_by_name() {
        let url = "postgres://app:hunter2@127.0.0.1:6001,127.0.0.1:6002/oncepay?target_session_attrs=read-write&sslmode=prefer";
        let c = config(&[("DATABASE_URL", url)]).unwrap();
        assert_eq!(c.database_url, url);
        assert_eq!(
            c.redacted_database_url(),
            "postgres://app:***@127.0.0.1:6001,127.0.0.1:6002/oncepay?target_session_attrs=read-write&sslmode=prefer"
        );
        assert!(!format!("{c:?}").contains("hunter2"));
        let err = config(&[(
            "DATABASE_URL",
            "postgres://app:hunter2@a,b/x?target_session_attrs=standby",
        )])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("DATABASE_URL") && err.contains("target_session_attrs=standby"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn the_primary_check_interval_is_bounded() {
        let c = config(&[("DATABASE_PRIMARY_CHECK_INTERVAL", "250ms")]).unwrap();
        assert_eq!(
            c.database.primary_check_interval,
            Duration::from_millis(250)
        );
        for bad in ["0s", "10ms", "2m", "1"] {
            let err = config(&[("DATABASE_PRIMARY_CHECK_INTERVAL", bad)])
                .unwrap_err()
                .to_string();
            assert!(err.contains("DATABASE_PRIMARY_CHECK_INTERVAL"), "{err}");
        }
    }

    #[test]
    fn an_overload_wait_longer_than_the_queue_wait_is_refused() {
        let err = config(&[("DATABASE_QUEUE_OVERLOAD_TIMEOUT", "200ms")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("DATABASE_QUEUE_OVERLOAD_TIMEOUT") && err.contains("100ms"),
            "{err}"
        );
        // Both longer than the request timeout: no request is ever shed.
        let off = config(&[
            ("DATABASE_QUEUE_TIMEOUT", "1h"),
            ("DATABASE_QUEUE_OVERLOAD_TIMEOUT", "1h"),
        ])
        .unwrap();
        assert!(off.database.queue_overload_timeout > off.request_timeout);
        assert!(config(&[("DATABASE_QUEUE_TIMEOUT", "0s")]).is_err());
    }

    #[test]
    fn a_statement_timeout_shorter_than_the_check_interval_plus_its_timeout_is_refused() {
        // The defaults: a 1 s interval plus a 2 s check, within 5 s.
        assert_eq!(
            config(&[]).unwrap().database.statement_timeout,
            Duration::from_secs(5)
        );
        let err = config(&[("DATABASE_STATEMENT_TIMEOUT", "2900ms")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("DATABASE_STATEMENT_TIMEOUT")
                && err.contains("DATABASE_PRIMARY_CHECK_INTERVAL (1s)")
                && err.contains("2s"),
            "{err}"
        );
        // The check's timeout is DATABASE_ACQUIRE_TIMEOUT below 2 s.
        let short = config(&[
            ("DATABASE_STATEMENT_TIMEOUT", "1500ms"),
            ("DATABASE_PRIMARY_CHECK_INTERVAL", "200ms"),
            ("DATABASE_ACQUIRE_TIMEOUT", "1s"),
        ]);
        assert!(short.is_ok(), "{:?}", short.err().map(|e| e.to_string()));
        assert!(config(&[("DATABASE_STATEMENT_TIMEOUT", "3s")]).is_ok());
        assert!(config(&[("DATABASE_STATEMENT_TIMEOUT", "0s")]).is_err());
    }

    #[test]
    fn a_keep_alive_longer_than_the_header_read_timeout_is_refused() {
        let err = config(&[
            ("HTTP_HEADER_READ_TIMEOUT", "2s"),
            ("HTTP_KEEP_ALIVE_TIMEOUT", "3s"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("HTTP_KEEP_ALIVE_TIMEOUT") && err.contains("HTTP_HEADER_READ_TIMEOUT"),
            "{err}"
        );
        let c = config(&[
            ("HTTP_HEADER_READ_TIMEOUT", "2s"),
            ("HTTP_KEEP_ALIVE_TIMEOUT", "2s"),
            ("HTTP_MAX_CONNECTIONS", "64"),
        ])
        .unwrap();
        assert_eq!(c.server.max_connections, 64);
        let err = config(&[("HTTP_MAX_CONNECTIONS", "0")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("HTTP_MAX_CONNECTIONS"), "{err}");
    }

    #[test]
    fn durations_are_written_with_units() {
        let c = config(&[
            ("PROCESSING_TIMEOUT", "500ms"),
            ("IDEMPOTENCY_KEY_TTL", "2h"),
        ])
        .unwrap();
        assert_eq!(c.keys.processing_timeout, Duration::from_millis(500));
        assert_eq!(c.keys.ttl, Duration::from_secs(7200));
    }

    #[test]
    fn a_bad_value_is_reported_with_the_variable_name() {
        for (name, value) in [
            ("PORT", "eighty"),
            ("SWEEP_INTERVAL", "5"),
            ("PROCESSING_TIMEOUT", "0s"),
            ("IDEMPOTENCY_KEY_REQUIRED", "maybe"),
            ("MAX_BODY_BYTES", "-1"),
            ("REPLAY_CACHE_BYTES", "64MiB"),
            ("REPLAY_CACHE_BYTES", "-1"),
            ("BIND_ADDR", "localhost:1"),
        ] {
            let err = config(&[(name, value)]).unwrap_err().to_string();
            assert!(err.contains(name), "{err} should name {name}");
        }
    }

    #[test]
    fn reconciliation_runs_hourly_over_a_day_and_its_window_overlaps_its_interval() {
        let c = config(&[]).unwrap();
        assert!(c.reconcile.enabled);
        assert_eq!(c.reconcile.interval, Duration::from_secs(3600));
        assert_eq!(c.reconcile.window, Duration::from_secs(86400));
        let c = config(&[("RECONCILE_ENABLED", "false")]).unwrap();
        assert!(!c.reconcile.enabled);
        let err = config(&[("RECONCILE_INTERVAL", "1h"), ("RECONCILE_WINDOW", "1h")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("RECONCILE_WINDOW"), "{err}");
        assert!(config(&[("RECONCILE_INTERVAL", "1h"), ("RECONCILE_WINDOW", "2h")]).is_ok());
    }

    #[test]
    fn a_key_ttl_shorter_than_twice_the_processing_timeout_is_refused() {
        let err = config(&[("IDEMPOTENCY_KEY_TTL", "1m"), ("PROCESSING_TIMEOUT", "45s")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("IDEMPOTENCY_KEY_TTL"), "{err}");
        assert!(config(&[("IDEMPOTENCY_KEY_TTL", "1m"), ("PROCESSING_TIMEOUT", "30s")]).is_ok());
    }

    #[test]
    fn a_key_ttl_within_the_request_timeout_plus_the_clock_skew_is_refused() {
        let short = [
            ("IDEMPOTENCY_KEY_TTL", "1200ms"),
            ("PROCESSING_TIMEOUT", "600ms"),
            ("REQUEST_TIMEOUT", "300ms"),
        ];
        let err = config(&short).unwrap_err().to_string();
        assert!(err.contains("IDEMPOTENCY_KEY_TTL"), "{err}");
        assert!(err.contains("REQUEST_TIMEOUT"), "{err}");
        let long = [
            ("IDEMPOTENCY_KEY_TTL", "1400ms"),
            ("PROCESSING_TIMEOUT", "600ms"),
            ("REQUEST_TIMEOUT", "300ms"),
        ];
        assert!(config(&long).is_ok());
    }

    #[test]
    fn a_redis_url_is_checked_at_start_and_its_password_never_shown() {
        let c = config(&[("REDIS_URL", "redis://:hunter2@127.0.0.1:6379/0")]).unwrap();
        assert_eq!(
            c.workshop.redis_url.as_deref(),
            Some("redis://:hunter2@127.0.0.1:6379/0")
        );
        assert!(!format!("{c:?}").contains("hunter2"));
        for bad in [
            "http://127.0.0.1",
            "rediss://127.0.0.1:6379",
            "redis://:x@/",
        ] {
            let err = config(&[("REDIS_URL", bad)]).unwrap_err().to_string();
            assert!(err.contains("REDIS_URL"), "{err}");
        }
    }

    #[test]
    fn debug_output_hides_secrets() {
        let c = config(&[
            ("DATABASE_URL", "postgres://app:hunter2@db/x"),
            (
                "DEMO_API_KEY",
                "sk_test_abcdefghijklmnopqrstuvwxyz0123456789",
            ),
        ])
        .unwrap();
        let debug = format!("{c:?}");
        assert!(
            !debug.contains("hunter2") && !debug.contains("abcdefghij"),
            "{debug}"
        );
    }

    #[test]
    fn a_bad_demo_key_is_refused_without_echoing_it() {
        let err = config(&[("DEMO_API_KEY", "sk_live_secret")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("DEMO_API_KEY"));
        assert!(!err.contains("sk_live_secret"));
    }

    #[test]
    fn passwords_are_redacted_from_database_urls() {
        assert_eq!(
            redact_url("postgres://app:hunter2@db:5432/oncepay"),
            "postgres://app:***@db:5432/oncepay"
        );
        assert_eq!(
            redact_url("postgres://app@db/x?sslmode=require&password=hunter2"),
            "postgres://app@db/x?sslmode=require&password=***"
        );
        assert_eq!(
            redact_url("postgres://postgres@db/x"),
            "postgres://postgres@db/x"
        );
    }
}
