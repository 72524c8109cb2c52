//! The `oncepay` command line: `serve` (the default), `migrate`,
//! `merchants create`, `sweep`. Settings come from the environment (see
//! [`crate::config`]); the flags only choose what to do.

use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::processor::SimulatedProcessor;
use crate::startup::{Application, shutdown_signal};
use crate::sweeper::{SweepSettings, Sweeper};
use crate::{db, merchants};

#[derive(Debug, Parser)]
#[command(
    name = "oncepay",
    version,
    about = "A payments API that charges a card exactly once"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
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
        #[arg(long)]
        name: String,
    },
}

impl Cli {
    pub async fn run(self) -> anyhow::Result<()> {
        let config = Config::from_env()?;
        let pool = db::pool(&config)?;
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
                let (merchant, key) = merchants::create(&pool, &name).await.context(
                    "creating the merchant (have the migrations run? try `oncepay migrate`)",
                )?;
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
