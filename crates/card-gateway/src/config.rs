//! The gateway's own configuration: `PROCESSOR_*` variables (or the flag of
//! the same name), read by `oncepay processor`, and by `oncepay serve` for
//! the gateway it embeds when no `PROCESSOR_URL` is set.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context;

/// The settings as written: a flag and an environment variable each.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Postgres URL of the gateway's own ledger (required); created if missing.
    #[arg(long = "processor-database-url", env = "PROCESSOR_DATABASE_URL", hide_env_values = true, value_parser = postgres_url)]
    database_url: Option<String>,
    /// Address the gateway listens on.
    #[arg(long = "processor-bind-addr", env = "PROCESSOR_BIND_ADDR", default_value = "127.0.0.1", value_parser = ip_addr)]
    bind_addr: IpAddr,
    /// The gateway's HTTP port (0 picks a free one).
    #[arg(long = "processor-port", env = "PROCESSOR_PORT", default_value = "8090", value_parser = port)]
    port: u16,
    /// Connections in the gateway's pool.
    #[arg(long = "processor-database-max-connections", env = "PROCESSOR_DATABASE_MAX_CONNECTIONS", default_value = "10", value_parser = positive_u32)]
    database_max_connections: u32,
    /// Delay of every authorization and refund before it is recorded, in milliseconds.
    #[arg(long = "processor-latency-ms", env = "PROCESSOR_LATENCY_MS", default_value = "0", value_parser = milliseconds)]
    latency_ms: Duration,
    /// Honour the Processor-Fault request header (tests and workshops only).
    #[arg(long = "processor-fault-injection", env = "PROCESSOR_FAULT_INJECTION", default_value = "false", value_parser = boolean, action = clap::ArgAction::Set, num_args = 1, value_name = "BOOL")]
    fault_injection: bool,
    /// How long `Processor-Fault: slow` holds its answer after recording.
    #[arg(long = "processor-fault-delay", env = "PROCESSOR_FAULT_DELAY", default_value = "30s", value_parser = positive_duration)]
    fault_delay: Duration,
}

/// The gateway's settings, checked.
#[derive(Clone)]
pub struct Config {
    pub database_url: String,
    pub bind_addr: IpAddr,
    pub port: u16,
    pub database_max_connections: u32,
    /// Delay of every authorization and refund before it is recorded.
    pub latency: Duration,
    /// Honour `Processor-Fault`.
    pub fault_injection: bool,
    /// How long `Processor-Fault: slow` holds its answer.
    pub fault_delay: Duration,
}

/// `oncepay processor`'s command line: the settings only.
#[derive(Debug, clap::Parser)]
#[command(
    name = "oncepay processor",
    about = "Run the card gateway simulator: its own HTTP API and its own database",
    after_help = "Every setting is also read from its environment variable, or from .env; \
                  a flag wins over both."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub settings: Settings,
}

/// What `oncepay processor` does: serve (the default), or manage accounts.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Manage the accounts that may call the gateway.
    Accounts {
        #[command(subcommand)]
        command: AccountsCommand,
    },
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum AccountsCommand {
    /// Create an account; prints its secret key, and only it, on stdout,
    /// once (set it as the caller's PROCESSOR_API_KEY).
    Create {
        /// The account's name, 1 to 200 characters, unique.
        #[arg(long, value_parser = account_name)]
        name: String,
    },
}

impl Config {
    /// The configuration from checked settings; `PROCESSOR_DATABASE_URL`
    /// is required.
    pub fn from_settings(settings: Settings) -> anyhow::Result<Self> {
        let database_url = settings.database_url.context(
            "PROCESSOR_DATABASE_URL is required (for example \
             postgres://postgres@127.0.0.1:5432/oncepay_processor)",
        )?;
        Ok(Config {
            database_url,
            bind_addr: settings.bind_addr,
            port: settings.port,
            database_max_connections: settings.database_max_connections,
            latency: settings.latency_ms,
            fault_injection: settings.fault_injection,
            fault_delay: settings.fault_delay,
        })
    }

    /// Reads the settings through `lookup` (a variable name to its value;
    /// blank counts as unset), never the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        use clap::{CommandFactory, FromArgMatches};
        let mut args = vec!["oncepay-processor".to_owned()];
        let command = Cli::command().mut_args(|arg| {
            if let Some(name) = arg.get_env().and_then(|n| n.to_str()) {
                if let Some(value) = lookup(name).filter(|v| !v.trim().is_empty()) {
                    let long = arg.get_long().expect("every setting has a long flag");
                    args.push(format!("--{long}={value}"));
                }
            }
            arg.env(None)
        });
        let matches = command
            .try_get_matches_from(&args)
            .map_err(|e| anyhow::anyhow!("{}", e.render().to_string().trim()))?;
        let cli = Cli::from_arg_matches(&matches).map_err(|e| anyhow::anyhow!("{e}"))?;
        Self::from_settings(cli.settings)
    }

    /// The database URL with its password hidden, for logs.
    pub fn redacted_database_url(&self) -> String {
        pg_follow::redact(&self.database_url)
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &self.redacted_database_url())
            .field("bind_addr", &self.bind_addr)
            .field("port", &self.port)
            .field("database_max_connections", &self.database_max_connections)
            .field("latency", &self.latency)
            .field("fault_injection", &self.fault_injection)
            .field("fault_delay", &self.fault_delay)
            .finish()
    }
}

/// A Postgres URL with one host or several (see [`pg_follow::PgUrl`]).
fn postgres_url(value: &str) -> Result<String, String> {
    let value = value.trim();
    pg_follow::PgUrl::parse(value)
        .map(|_| value.to_owned())
        .map_err(|e| e.to_string())
}

/// An account's name as the `accounts` table takes it.
fn account_name(value: &str) -> Result<String, String> {
    let name = value.trim();
    if name.is_empty() || name.chars().count() > 200 {
        return Err("an account's name must be 1 to 200 characters, not blank".into());
    }
    Ok(name.to_owned())
}

fn ip_addr(value: &str) -> Result<IpAddr, String> {
    value.trim().parse().map_err(|e| format!("{e}"))
}

fn port(value: &str) -> Result<u16, String> {
    value.trim().parse().map_err(|e| format!("{e}"))
}

fn positive_u32(value: &str) -> Result<u32, String> {
    match value.trim().parse::<u32>() {
        Ok(0) => Err("must be greater than zero".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn milliseconds(value: &str) -> Result<Duration, String> {
    value
        .trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|e| format!("{e} (a whole number of milliseconds)"))
}

fn positive_duration(value: &str) -> Result<Duration, String> {
    match humantime::parse_duration(value.trim()) {
        Ok(d) if d.is_zero() => Err("must be greater than zero".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(format!("{e} (write durations like 500ms, 30s or 24h)")),
    }
}

fn boolean(value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("must be true or false".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_reads_only_its_own_variables_with_documented_defaults() {
        let c = Config::from_lookup(|name| {
            (name == "PROCESSOR_DATABASE_URL").then(|| "postgres://localhost/p".to_owned())
        })
        .unwrap();
        assert_eq!(c.port, 8090);
        assert_eq!(c.bind_addr.to_string(), "127.0.0.1");
        assert_eq!(c.latency, Duration::ZERO);
        assert!(!c.fault_injection);
        assert_eq!(c.fault_delay, Duration::from_secs(30));
        let err = Config::from_lookup(|_| None).unwrap_err().to_string();
        assert!(err.contains("PROCESSOR_DATABASE_URL"), "{err}");
        let err = Config::from_lookup(|name| match name {
            "PROCESSOR_DATABASE_URL" => Some("postgres://localhost/p".into()),
            "PROCESSOR_PORT" => Some("eighty".into()),
            _ => None,
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("processor-port"), "{err}");
    }
}
