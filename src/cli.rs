//! The `oncepay` command line: `serve` (the default), `migrate`,
//! `merchants create`, `merchants roll-key`, `sweep`, `reconcile`, and `processor`, the card gateway, a system
//! of its own with its own settings ([`crate::gateway::config`]). Settings
//! come from the environment or `.env`, or from the flag of the same name
//! (see [`crate::config`]); `--help` lists them all with their defaults.
//!
//! This is the one place that sees both systems: it starts the gateway for
//! `oncepay processor`, or, when `PROCESSOR_URL` is unset, embeds one on a
//! loopback port for `serve` and `sweep`, which then reach it over HTTP
//! like any other.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Parser, Subcommand};

use anyhow::Context;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::broker;
use crate::config::{Config, ConfigError, Settings};
use crate::reconcile::Window;
use crate::startup::{Application, http_processor, reconciler, shutdown_signal};
use crate::{db, merchants};
use card_gateway::{self as gateway, Gateway};
use oncepay_core::sweeper::Sweeper;

#[derive(Debug, Parser)]
#[command(
    name = "oncepay",
    version,
    about = "A payments API that charges a card exactly once",
    after_help = "Every setting is also read from its environment variable, or from .env; \
                  a flag wins over both."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    settings: Settings,
    /// `oncepay processor`'s own command line, parsed by its own parser.
    #[arg(skip)]
    processor: Option<gateway::config::Cli>,
}

/// Why the command line was not parsed.
#[derive(Debug)]
pub enum CliError {
    /// A setting's value is bad.
    Config(ConfigError),
    /// Anything else, help and version included: clap prints it and exits.
    Usage(clap::Error),
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply migrations and serve the API (the default).
    Serve,
    /// Apply pending migrations and exit.
    Migrate,
    /// Manage merchants.
    Merchants {
        #[command(subcommand)]
        command: MerchantsCommand,
    },
    /// Run the card gateway simulator, with its own PROCESSOR_* settings, or
    /// manage the accounts that call it (see `oncepay processor --help`).
    Processor,
    /// Run the background sweeper.
    Sweep {
        /// Run one pass and exit (for cron and tests).
        #[arg(long)]
        once: bool,
    },
    /// Publish the events to the NATS JetStream stream (NATS_URL), in commit
    /// order, until stopped; one relay publishes at a time.
    Relay {
        /// Compare the stream with the events the relay has published
        /// instead, print what it lost, and exit 3 while an event is missing.
        #[arg(long, conflicts_with = "rewind_to")]
        check: bool,
        /// Move the relay's position back to just before this event, so
        /// it and every event after it are published again, and exit.
        #[arg(long, value_name = "EVENT_ID")]
        rewind_to: Option<String>,
    },
    /// Consume the stream as the reference merchant ledger, booking the
    /// money each event moved once and parking what it will not apply, until stopped.
    Consume {
        /// The durable consumer's name (processes with one name share its messages).
        #[arg(long, default_value = crate::broker::ledger::DEFAULT_NAME)]
        name: String,
        /// Compare the ledger with the money GET /v1/balance counts instead,
        /// print each difference, and exit 3 while one remains.
        #[arg(long)]
        check: bool,
    },
    /// Compare charges and refunds with the processor's ledger over a window
    /// and report each difference; exits 3 while a difference remains.
    Reconcile {
        /// The window's start: RFC 3339 (2026-12-07T10:00:00Z) or Unix seconds.
        #[arg(long, value_parser = instant, conflicts_with = "window")]
        since: Option<DateTime<Utc>>,
        /// The window's end, excluded [default: now].
        #[arg(long, value_parser = instant)]
        until: Option<DateTime<Utc>>,
        /// How far back from --until to look, like 24h [default: RECONCILE_WINDOW].
        #[arg(long, value_parser = window)]
        window: Option<Duration>,
        /// Refund each orphan payment at the processor, once, under
        /// reconcile-refund:<payment key>.
        #[arg(long)]
        fix: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// The exit status of `oncepay reconcile` when a difference remains.
pub const DIFFERENCES_REMAIN: u8 = 3;

#[derive(Debug, Subcommand)]
enum MerchantsCommand {
    /// Create a merchant; prints its secret API key, and only it, on stdout.
    Create {
        /// The merchant's name, 1 to 200 characters.
        #[arg(long, value_parser = merchant_name)]
        name: String,
    },
    /// Give a merchant a new secret API key; prints it, and only it, on
    /// stdout. The key it replaces keeps working until --expire-old-in has
    /// passed; a key older still, if live, stops at once (at most two live
    /// keys per merchant).
    RollKey {
        /// The merchant's id.
        id: uuid::Uuid,
        /// How long the key in use until now keeps working, like 1h or 24h;
        /// 0s (the default) stops it at once; at most 7 days.
        #[arg(long, value_parser = expire_old_in, default_value = "0s")]
        expire_old_in: Duration,
    },
}

impl Cli {
    /// Parses the command line and the environment (call after loading
    /// `.env`). A bad setting is told by its variable name.
    pub fn parse_env() -> Result<Self, CliError> {
        use clap::{CommandFactory, FromArgMatches};
        let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
        if args.get(1).is_some_and(|a| a == "processor") {
            // A system of its own: none of oncepay's settings apply.
            let command = Settings::blank_is_unset(gateway::config::Cli::command());
            let matches = command
                .try_get_matches_from(&args[1..])
                .map_err(CliError::Usage)?;
            let cli = gateway::config::Cli::from_arg_matches(&matches).map_err(CliError::Usage)?;
            return Ok(Cli {
                command: Some(Command::Processor),
                settings: Settings::parse_defaults(),
                processor: Some(cli),
            });
        }
        let command = Settings::blank_is_unset(Self::command());
        let names = Self::command();
        let bad_value = |e: clap::Error| match e.kind() {
            clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue => {
                CliError::Config(ConfigError::from_clap(&e, &names))
            }
            _ => CliError::Usage(e),
        };
        let matches = command.try_get_matches().map_err(bad_value)?;
        Self::from_arg_matches(&matches).map_err(bad_value)
    }

    /// Runs the command; its exit status (a failure is an `Err`).
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        if let Some(cli) = self.processor {
            let config = gateway::Config::from_settings(cli.settings)?;
            match cli.command {
                None => {
                    let gateway = Gateway::build(config).await?;
                    gateway.run_until_stopped(shutdown_signal()).await;
                }
                Some(gateway::config::Command::Accounts {
                    command: gateway::config::AccountsCommand::Create { name },
                }) => {
                    let secret = gateway::create_account(&config, &name).await?;
                    println!("{}", secret.expose());
                }
            }
            return Ok(ExitCode::SUCCESS);
        }
        let config = Config::from_settings(self.settings)?;
        let database = db::connect(&config)?;
        db::wait_until_reachable(&database, &config).await?;
        let pool = database.pool.clone();
        match self.command.unwrap_or(Command::Serve) {
            Command::Processor => unreachable!("parsed and run by the gateway's own parser"),
            Command::Serve => {
                let (config, embedded) = with_processor(config).await?;
                let app = Application::build(config, database).await?;
                app.prepare_database().await?;
                let served = app.run_until_stopped(shutdown_signal()).await;
                if let Some(embedded) = embedded {
                    embedded.stop().await;
                }
                served.map(|()| ExitCode::SUCCESS)
            }
            Command::Migrate => {
                db::migrate(&pool).await?;
                tracing::info!("migrations applied");
                Ok(ExitCode::SUCCESS)
            }
            Command::Merchants {
                command: MerchantsCommand::Create { name },
            } => {
                let (merchant, key) = merchants::create(&pool, &name).await.map_err(|e| {
                    let context = if db::undefined_table(&e) {
                        "creating the merchant: its table is missing (run `oncepay migrate` first)"
                    } else {
                        "creating the merchant"
                    };
                    anyhow::Error::new(e).context(context)
                })?;
                tracing::info!(merchant = %merchant.id, name = %merchant.name, "merchant created");
                println!("{}", key.expose());
                Ok(ExitCode::SUCCESS)
            }
            Command::Merchants {
                command: MerchantsCommand::RollKey { id, expire_old_in },
            } => {
                let rolled = merchants::roll_key(&pool, id, expire_old_in)
                    .await
                    .map_err(|e| {
                        let context = if db::undefined_column(&e) || db::undefined_table(&e) {
                            "rolling the key: the schema is behind (run `oncepay migrate` first)"
                        } else {
                            "rolling the key"
                        };
                        anyhow::Error::new(e).context(context)
                    })?
                    .with_context(|| format!("there is no merchant {id}"))?;
                if rolled.expired_older {
                    tracing::warn!(
                        merchant = %id,
                        "the merchant held two live keys: the older one stopped working now"
                    );
                }
                tracing::info!(
                    merchant = %id,
                    name = %rolled.merchant.name,
                    old_key_expires_at = %rolled.old_key_expires_at.to_rfc3339(),
                    "key rolled: the new key works now, the old one until old_key_expires_at"
                );
                println!("{}", rolled.key.expose());
                Ok(ExitCode::SUCCESS)
            }
            Command::Sweep { once } => {
                let (config, embedded) = with_processor(config).await?;
                let processor = Arc::new(http_processor(&config)?);
                let sweeper = Sweeper::new(pool, processor, config.sweep_settings());
                let _embedded = embedded;
                if once {
                    let report = sweeper.sweep_once().await?;
                    println!(
                        "settled_succeeded={} settled_failed={} refunds_settled={} refunds_failed={} keys_deleted={}",
                        report.settled_succeeded,
                        report.settled_failed,
                        report.refunds_settled,
                        report.refunds_failed,
                        report.keys_deleted
                    );
                    Ok(ExitCode::SUCCESS)
                } else {
                    sweeper
                        .run(config.keys.sweep_interval, shutdown_signal())
                        .await;
                    Ok(ExitCode::SUCCESS)
                }
            }
            Command::Relay { check: true, .. } => relay_check(&pool, &config.broker).await,
            Command::Relay {
                rewind_to: Some(event),
                ..
            } => {
                let mut conn = pool.acquire().await?;
                let at = broker::watch::rewind(&mut conn, &config.broker.stream, &event).await?;
                println!(
                    "rewound stream={} txid={} seq={}",
                    config.broker.stream, at.txid, at.seq
                );
                Ok(ExitCode::SUCCESS)
            }
            Command::Relay { .. } => {
                let stop = CancellationToken::new();
                let relay = tokio::spawn(broker::relay::run(pool, config.broker, stop.clone()));
                until_stopped(stop, relay).await?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Consume { name, check: true } => {
                let differences = broker::ledger::check(&pool, &name).await?;
                for d in &differences {
                    println!(
                        "{} merchant={} expected={} entries={} booked={}",
                        d.object_id,
                        d.merchant_id,
                        d.expected.map_or("none".into(), |a| a.to_string()),
                        d.entries,
                        d.booked.map_or("none".into(), |a| a.to_string()),
                    );
                }
                println!("differences={}", differences.len());
                Ok(if differences.is_empty() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(3)
                })
            }
            Command::Consume { name, check: false } => {
                let stop = CancellationToken::new();
                let consumer = broker::ledger::run(pool, config.broker, name, stop.clone());
                until_stopped(stop, tokio::spawn(consumer)).await??;
                Ok(ExitCode::SUCCESS)
            }
            Command::Reconcile {
                since,
                until,
                window,
                fix,
                json,
            } => {
                let until = until.unwrap_or_else(Utc::now);
                let window = match since {
                    Some(since) => Window::new(since, until)?,
                    None => {
                        let length = window.unwrap_or(config.reconcile.window);
                        let length =
                            chrono::Duration::from_std(length).context("--window is too long")?;
                        Window::new(until - length, until)?
                    }
                };
                // An embedded gateway would make an account of its own, which
                // holds no payment: every charge would be a difference.
                anyhow::ensure!(
                    config.processor.url.is_some(),
                    "oncepay reconcile compares oncepay with a card gateway's ledger: set \
                     PROCESSOR_URL and PROCESSOR_API_KEY to that gateway and oncepay's key there \
                     (beside scripts/run: set -a; . .run/env; set +a)"
                );
                let processor = Arc::new(http_processor(&config)?);
                let reconciliation = reconciler(&config, pool, processor)?
                    .run(window, fix)
                    .await?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&reconciliation)?);
                } else {
                    print!("{}", reconciliation.table());
                }
                Ok(if reconciliation.remaining > 0 {
                    ExitCode::from(DIFFERENCES_REMAIN)
                } else {
                    ExitCode::SUCCESS
                })
            }
        }
    }
}

/// A card gateway running in this process, on a loopback port.
pub struct EmbeddedProcessor {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl EmbeddedProcessor {
    /// Stops it once its requests in flight are answered.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// `config` with a processor to call: `PROCESSOR_URL` when set; otherwise
/// a gateway started here on `127.0.0.1` and a free port, every call still
/// crossing HTTP, with its ledger in `PROCESSOR_DATABASE_URL` or, unset, in
/// the database `<oncepay's database>_processor` on the same server
/// (created if missing), and called under an account named after oncepay's
/// database with a key made now (`PROCESSOR_API_KEY` is for a gateway of
/// one's own). With several hosts in `DATABASE_URL` and neither
/// `PROCESSOR_URL` nor `PROCESSOR_DATABASE_URL`, it refuses: the card
/// gateway's ledger would fail over with oncepay's own database, and the
/// two are meant to be two systems that fail apart.
pub async fn with_processor(
    mut config: Config,
) -> anyhow::Result<(Config, Option<EmbeddedProcessor>)> {
    if config.processor.url.is_some() {
        return Ok((config, None));
    }
    let processor_database = std::env::var("PROCESSOR_DATABASE_URL")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let multi_host =
        pg_follow::PgUrl::parse(&config.database_url).is_ok_and(|url| url.is_multi_host());
    if multi_host && processor_database.is_none() {
        anyhow::bail!(
            "DATABASE_URL names several hosts, and neither PROCESSOR_URL nor \
             PROCESSOR_DATABASE_URL is set: the embedded card gateway would keep its ledger \
             beside oncepay's database and fail over with it. Set PROCESSOR_URL to a gateway \
             of its own (oncepay processor), or PROCESSOR_DATABASE_URL to its ledger's database"
        );
    }
    let ledger_url = match processor_database {
        Some(url) => url,
        None => processor_database_url(&config.database_url)?,
    };
    let latency = config.processor.latency.as_millis().to_string();
    let gateway_config = gateway::Config::from_lookup(|name| match name {
        "PROCESSOR_BIND_ADDR" => Some("127.0.0.1".to_owned()),
        "PROCESSOR_PORT" => Some("0".to_owned()),
        "PROCESSOR_LATENCY_MS" => Some(latency.clone()),
        // oncepay's FAULT_INJECTION turns on its own gateway's too, so that
        // `Oncepay-Fault: processor-...` reaches a gateway that honours it.
        "PROCESSOR_FAULT_INJECTION" => std::env::var(name)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .or_else(|| config.workshop.fault_injection.then(|| "true".to_owned())),
        "PROCESSOR_DATABASE_URL" => Some(ledger_url.clone()),
        other => std::env::var(other).ok(),
    })?;
    let gateway = Gateway::build(gateway_config)
        .await
        .context("starting the embedded processor (set PROCESSOR_URL to use one of your own)")?;
    let secret = gateway
        .own_account(&embedded_account_name(&config.database_url))
        .await?;
    let url = gateway.url();
    tracing::info!(processor = %url, "no PROCESSOR_URL: started an embedded processor");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(gateway.run_until_stopped(async {
        let _ = stopped.await;
    }));
    config.processor.url = Some(url);
    config.processor.api_key = Some(secret.expose().to_owned());
    Ok((config, Some(EmbeddedProcessor { stop, task })))
}

/// The embedded gateway's account of the oncepay on `database_url`: one
/// per oncepay database, so that two sharing a ledger never meet in it.
fn embedded_account_name(database_url: &str) -> String {
    let name = url::Url::parse(database_url)
        .ok()
        .map(|url| url.path().trim_start_matches('/').to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "oncepay".to_owned());
    format!("oncepay embedded ({name})")
}

/// `database_url` with its database name suffixed `_processor`.
pub fn processor_database_url(database_url: &str) -> anyhow::Result<String> {
    let mut url = url::Url::parse(database_url).context("DATABASE_URL")?;
    let name = url.path().trim_start_matches('/');
    let name = if name.is_empty() { "oncepay" } else { name };
    let processor = format!("/{name}_processor");
    url.set_path(&processor);
    Ok(url.to_string())
}

/// An instant on the command line: RFC 3339, or whole Unix seconds.
fn instant(value: &str) -> Result<DateTime<Utc>, String> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<i64>() {
        return DateTime::from_timestamp(seconds, 0).ok_or_else(|| "out of range".to_owned());
    }
    DateTime::parse_from_rfc3339(value)
        .map(|at| at.with_timezone(&Utc))
        .map_err(|e| format!("{e} (write it like 2026-12-07T10:00:00Z, or Unix seconds)"))
}

/// A window's length, like `24h`.
fn window(value: &str) -> Result<Duration, String> {
    match humantime::parse_duration(value.trim()) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("must be greater than zero".into()),
        Err(e) => Err(format!("{e} (write it like 30m or 24h)")),
    }
}

/// How long a rolled key keeps working: `0s` to 7 days.
fn expire_old_in(value: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(value.trim())
        .map_err(|e| format!("{e} (write it like 0s, 1h or 24h)"))?;
    if duration > merchants::MAX_EXPIRE_OLD_IN {
        return Err("at most 7 days (7d)".into());
    }
    Ok(duration)
}

/// A merchant's name as the `merchants` table takes it: 1 to 200
/// characters, not only spaces.
fn merchant_name(value: &str) -> Result<String, String> {
    let name = value.trim();
    if name.is_empty() || name.chars().count() > 200 {
        return Err("a merchant's name must be 1 to 200 characters, not blank".into());
    }
    Ok(name.to_owned())
}

/// Waits for `task` to end, or for a stop signal, then cancels `stop` and
/// waits for the task to wind down.
async fn until_stopped<T>(
    stop: CancellationToken,
    mut task: tokio::task::JoinHandle<T>,
) -> Result<T, tokio::task::JoinError> {
    tokio::select! {
        ended = &mut task => return ended,
        () = shutdown_signal() => {}
    }
    stop.cancel();
    task.await
}

/// `oncepay relay --check`: the events the stream lost, and how to publish
/// them again.
async fn relay_check(
    pool: &sqlx::PgPool,
    config: &crate::config::Broker,
) -> anyhow::Result<ExitCode> {
    let js = broker::connect(config).await?;
    let mut conn = pool.acquire().await?;
    let missing = broker::watch::missing(&mut conn, &js, config).await?;
    println!(
        "stream={} messages={} missing={}",
        config.stream, missing.stream_messages, missing.count
    );
    let Some(first) = missing.first else {
        return Ok(ExitCode::SUCCESS);
    };
    println!("first_missing={first}");
    println!("to publish them again: oncepay relay --rewind-to {first}");
    Ok(ExitCode::from(3))
}
