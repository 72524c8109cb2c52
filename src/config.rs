//! Configuration, read once at start from the environment (and `.env`).
//!
//! Every variable is optional except `DATABASE_URL`. A value that does not
//! parse, or that contradicts another, stops the process with a message
//! naming the variables.

use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

/// A configuration error; its message always names the variable at fault.
#[derive(Debug, thiserror::Error)]
#[error("invalid {name}={value:?}: {reason}")]
pub struct ConfigError {
    name: &'static str,
    value: String,
    reason: String,
}

/// The service's settings. See `.env.example` for what each one does.
/// Its `Debug` redacts the database password and the demo key.
#[derive(Clone)]
pub struct Config {
    pub database_url: String,
    pub database_max_connections: u32,
    /// How long a request waits for a database connection before it gets a
    /// `503` (also while the database is away).
    pub database_acquire_timeout: Duration,
    pub bind_addr: IpAddr,
    pub port: u16,
    /// The demo merchant's secret key, created at start when set.
    pub demo_api_key: Option<String>,
    pub idempotency_key_ttl: Duration,
    pub idempotency_key_required: bool,
    pub processing_timeout: Duration,
    pub sweep_interval: Duration,
    /// How many rows one sweeper statement leases or deletes.
    pub sweep_batch_size: i64,
    pub processor_latency: Duration,
    pub max_body_bytes: usize,
    /// The most bytes of completed answers held in memory for replay (0: no
    /// replay cache). See [`crate::cache`].
    pub replay_cache_bytes: u64,
    /// Honour the `Oncepay-Fault` request header (tests and workshops only).
    pub fault_injection: bool,
    /// Serve the deliberately broken `POST /demo/naive/charges` (workshops only).
    pub demo_unsafe_endpoints: bool,
    /// The longest a request may take before it is answered `503 request_timeout`.
    /// By default half of `processing_timeout`, at most 30 s; always below it.
    pub request_timeout: Duration,
    /// How long shutdown waits for requests in flight to finish.
    pub shutdown_grace: Duration,
}

impl Config {
    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the configuration through `lookup`, so tests need not touch the
    /// process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let get = |name: &'static str| lookup(name).filter(|v| !v.trim().is_empty());
        let database_url = get("DATABASE_URL").ok_or_else(|| ConfigError {
            name: "DATABASE_URL",
            value: String::new(),
            reason: "is required (for example postgres://postgres@127.0.0.1:5432/oncepay)".into(),
        })?;
        let demo_api_key = get("DEMO_API_KEY");
        if let Some(key) = &demo_api_key {
            if crate::merchants::ApiKey::parse(key).is_none() {
                return Err(ConfigError {
                    name: "DEMO_API_KEY",
                    value: "<redacted>".into(),
                    reason: "must be sk_test_ followed by at least 32 letters or digits".into(),
                });
            }
        }
        let mut config = Config {
            database_url,
            database_max_connections: parse(&get, "DATABASE_MAX_CONNECTIONS", 10, |v| {
                positive(v.parse::<u32>().map_err(|e| e.to_string())?)
            })?,
            database_acquire_timeout: parse(
                &get,
                "DATABASE_ACQUIRE_TIMEOUT",
                Duration::from_secs(5),
                positive_duration,
            )?,
            bind_addr: parse(&get, "BIND_ADDR", IpAddr::from([127, 0, 0, 1]), |v| {
                IpAddr::from_str(v).map_err(|e| e.to_string())
            })?,
            port: parse(&get, "PORT", 8080, |v| {
                v.parse().map_err(|e| format!("{e}"))
            })?,
            demo_api_key,
            idempotency_key_ttl: parse(
                &get,
                "IDEMPOTENCY_KEY_TTL",
                Duration::from_secs(24 * 3600),
                positive_duration,
            )?,
            idempotency_key_required: parse(&get, "IDEMPOTENCY_KEY_REQUIRED", false, boolean)?,
            processing_timeout: parse(
                &get,
                "PROCESSING_TIMEOUT",
                Duration::from_secs(30),
                positive_duration,
            )?,
            sweep_interval: parse(
                &get,
                "SWEEP_INTERVAL",
                Duration::from_secs(5),
                positive_duration,
            )?,
            sweep_batch_size: parse(&get, "SWEEP_BATCH_SIZE", 500, |v| {
                v.parse::<i64>()
                    .ok()
                    .filter(|n| (1..=10_000).contains(n))
                    .ok_or_else(|| "must be a whole number from 1 to 10000".to_owned())
            })?,
            processor_latency: parse(&get, "PROCESSOR_LATENCY_MS", Duration::ZERO, |v| {
                v.parse::<u64>()
                    .map(Duration::from_millis)
                    .map_err(|e| format!("{e} (a whole number of milliseconds)"))
            })?,
            max_body_bytes: parse(&get, "MAX_BODY_BYTES", 64 * 1024, |v| {
                positive(v.parse::<usize>().map_err(|e| e.to_string())?)
            })?,
            replay_cache_bytes: parse(&get, "REPLAY_CACHE_BYTES", 64 * 1024 * 1024, |v| {
                v.parse::<u64>()
                    .map_err(|e| format!("{e} (a whole number of bytes; 0 turns the cache off)"))
            })?,
            fault_injection: parse(&get, "FAULT_INJECTION", false, boolean)?,
            demo_unsafe_endpoints: parse(&get, "DEMO_UNSAFE_ENDPOINTS", false, boolean)?,
            // Set below, once PROCESSING_TIMEOUT is known.
            request_timeout: Duration::ZERO,
            shutdown_grace: parse(
                &get,
                "SHUTDOWN_GRACE",
                Duration::from_secs(10),
                positive_duration,
            )?,
        };
        config.request_timeout = parse(
            &get,
            "REQUEST_TIMEOUT",
            (config.processing_timeout / 2).min(Duration::from_secs(30)),
            positive_duration,
        )?;
        // A request (and the processor call in it) must be over before its
        // key counts as stale: past PROCESSING_TIMEOUT, a retry or the sweeper
        // settles the record, fencing off the processor, so a slower request
        // would be voided while still at work.
        for (name, value, written) in [
            (
                "PROCESSOR_LATENCY_MS",
                config.processor_latency,
                config.processor_latency.as_millis().to_string(),
            ),
            (
                "REQUEST_TIMEOUT",
                config.request_timeout,
                humantime::format_duration(config.request_timeout).to_string(),
            ),
        ] {
            if value >= config.processing_timeout {
                return Err(ConfigError {
                    name,
                    value: written,
                    reason: format!(
                        "must be below PROCESSING_TIMEOUT ({}): a request still at work then \
                         would have its record settled under it",
                        humantime::format_duration(config.processing_timeout)
                    ),
                });
            }
        }
        // A key must outlive any request holding it, or a retry could take
        // over a key whose first request is still at work.
        if config.idempotency_key_ttl < config.processing_timeout * 2 {
            return Err(ConfigError {
                name: "IDEMPOTENCY_KEY_TTL",
                value: humantime::format_duration(config.idempotency_key_ttl).to_string(),
                reason: format!(
                    "must be at least twice PROCESSING_TIMEOUT ({})",
                    humantime::format_duration(config.processing_timeout)
                ),
            });
        }
        Ok(config)
    }

    /// The database URL with any password replaced, fit for logs.
    pub fn redacted_database_url(&self) -> String {
        redact_url(&self.database_url)
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &self.redacted_database_url())
            .field("database_max_connections", &self.database_max_connections)
            .field("database_acquire_timeout", &self.database_acquire_timeout)
            .field("bind_addr", &self.bind_addr)
            .field("port", &self.port)
            .field(
                "demo_api_key",
                &self.demo_api_key.as_ref().map(|_| "sk_test_***"),
            )
            .field("idempotency_key_ttl", &self.idempotency_key_ttl)
            .field("idempotency_key_required", &self.idempotency_key_required)
            .field("processing_timeout", &self.processing_timeout)
            .field("sweep_interval", &self.sweep_interval)
            .field("sweep_batch_size", &self.sweep_batch_size)
            .field("processor_latency", &self.processor_latency)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("replay_cache_bytes", &self.replay_cache_bytes)
            .field("fault_injection", &self.fault_injection)
            .field("demo_unsafe_endpoints", &self.demo_unsafe_endpoints)
            .field("request_timeout", &self.request_timeout)
            .field("shutdown_grace", &self.shutdown_grace)
            .finish()
    }
}

/// Replaces the password of a `scheme://user:password@host/...?password=...` URL.
pub fn redact_url(url: &str) -> String {
    let (url, query) = url
        .split_once('?')
        .map_or((url, None), |(u, q)| (u, Some(q)));
    let redacted = match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => url.to_owned(),
            },
            None => url.to_owned(),
        },
        None => url.to_owned(),
    };
    match query {
        None => redacted,
        Some(query) => {
            let params: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if name.eq_ignore_ascii_case("password") => {
                        format!("{name}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{redacted}?{}", params.join("&"))
        }
    }
}

fn parse<T>(
    get: &impl Fn(&'static str) -> Option<String>,
    name: &'static str,
    default: T,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<T, ConfigError> {
    match get(name) {
        None => Ok(default),
        Some(value) => parse(value.trim()).map_err(|reason| ConfigError {
            name,
            value,
            reason,
        }),
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
    let duration = humantime::parse_duration(value)
        .map_err(|e| format!("{e} (write durations like 500ms, 30s or 24h)"))?;
    positive(duration)
}

fn boolean(value: &str) -> Result<bool, String> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err("must be true or false".into()),
    }
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
        assert_eq!(c.database_max_connections, 10);
        assert_eq!(c.database_acquire_timeout, Duration::from_secs(5));
        assert_eq!(c.bind_addr.to_string(), "127.0.0.1");
        assert_eq!(c.port, 8080);
        assert_eq!(c.demo_api_key, None);
        assert_eq!(c.idempotency_key_ttl, Duration::from_secs(86_400));
        assert!(!c.idempotency_key_required);
        assert_eq!(c.processing_timeout, Duration::from_secs(30));
        assert_eq!(c.sweep_interval, Duration::from_secs(5));
        assert_eq!(c.sweep_batch_size, 500);
        assert_eq!(c.processor_latency, Duration::ZERO);
        assert_eq!(c.max_body_bytes, 65_536);
        assert_eq!(c.replay_cache_bytes, 67_108_864);
        assert!(!c.fault_injection);
        assert!(!c.demo_unsafe_endpoints);
        assert_eq!(c.request_timeout, Duration::from_secs(15));
        assert_eq!(c.shutdown_grace, Duration::from_secs(10));
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
                    assert!(config(&[]).unwrap().demo_api_key.is_none());
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
    fn the_replay_cache_is_sized_in_bytes_and_zero_turns_it_off() {
        let c = config(&[("REPLAY_CACHE_BYTES", "1048576")]).unwrap();
        assert_eq!(c.replay_cache_bytes, 1 << 20);
        let c = config(&[("REPLAY_CACHE_BYTES", "0")]).unwrap();
        assert_eq!(c.replay_cache_bytes, 0);
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
                ("PROCESSOR_LATENCY_MS", "1999"),
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
    fn durations_are_written_with_units() {
        let c = config(&[
            ("PROCESSING_TIMEOUT", "500ms"),
            ("IDEMPOTENCY_KEY_TTL", "2h"),
        ])
        .unwrap();
        assert_eq!(c.processing_timeout, Duration::from_millis(500));
        assert_eq!(c.idempotency_key_ttl, Duration::from_secs(7200));
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
    fn a_key_ttl_shorter_than_twice_the_processing_timeout_is_refused() {
        let err = config(&[("IDEMPOTENCY_KEY_TTL", "1m"), ("PROCESSING_TIMEOUT", "45s")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("IDEMPOTENCY_KEY_TTL"), "{err}");
        assert!(config(&[("IDEMPOTENCY_KEY_TTL", "1m"), ("PROCESSING_TIMEOUT", "30s")]).is_ok());
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
