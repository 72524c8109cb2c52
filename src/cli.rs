//! The `oncepay` command line: `serve` (the default), `migrate`,
//! `merchants create`, `sweep`. Settings come from the environment or
//! `.env`, or from the flag of the same name (see [`crate::config`]);
//! `--help` lists them all with their defaults.

use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::config::{Config, ConfigError, Settings};
use crate::processor::SimulatedProcessor;
use crate::startup::{Application, shutdown_signal};
use crate::sweeper::{SweepSettings, Sweeper};
use crate::{db, merchants};

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
    /// Run the background sweeper.
    Sweep {
        /// Run one pass and exit (for cron and tests).
        #[arg(long)]
        once: bool,
    },
}

#[derive(Debug, Subcommand)]
enum MerchantsCommand {
    /// Create a merchant; prints its secret API key, and only it, on stdout.
    Create {
        /// The merchant's name, 1 to 200 characters.
        #[arg(long, value_parser = merchant_name)]
        name: String,
    },
}

impl Cli {
    /// Parses the command line and the environment (call after loading
    /// `.env`). A bad setting is told by its variable name.
    pub fn parse_env() -> Result<Self, CliError> {
        use clap::{CommandFactory, FromArgMatches};
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

    pub async fn run(self) -> anyhow::Result<()> {
        let config = Config::from_settings(self.settings)?;
        let pool = db::pool(&config)?;
        db::wait_until_reachable(&pool, &config).await?;
        match self.command.unwrap_or(Command::Serve) {
            Command::Serve => {
                let app = Application::build(config, pool).await?;
                app.prepare_database().await?;
                app.run_until_stopped(shutdown_signal()).await
            }
            Command::Migrate => {
                db::migrate(&pool).await?;
                tracing::info!("migrations applied");
                Ok(())
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
                Ok(())
            }
            Command::Sweep { once } => {
                let processor = Arc::new(SimulatedProcessor::new(
                    pool.clone(),
                    config.processor_latency,
                ));
                let sweeper = Sweeper::new(pool, processor, SweepSettings::from_config(&config));
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
                    Ok(())
                } else {
                    sweeper.run(config.sweep_interval, shutdown_signal()).await;
                    Ok(())
                }
            }
        }
    }
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
