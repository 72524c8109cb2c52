//! Telemetry: structured logs (here) and Prometheus metrics ([`metrics`]);
//! the timing of guarded operations is `crate::speed::timing`.
//! The HTTP middleware that feeds both is `crate::http::observe`.
//!
//! Structured logs with `tracing`, to stderr so stdout stays for output
//! (`oncepay merchants create` prints only the key there). `LOG_FORMAT=json`
//! writes one JSON object a line for machines; the default is readable text,
//! coloured only on a terminal. Every line of a request carries its span:
//! request id, method, route, merchant and idempotency key. Headers are never
//! logged, so `Authorization` and API keys cannot appear.

pub mod metrics;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// The log filter without `RUST_LOG`.
const DEFAULT_FILTER: &str = "info,sqlx=warn";

/// Installs the subscriber. A `RUST_LOG` or `LOG_FORMAT` that does not parse
/// is an error naming it, like every other setting.
pub fn init() -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(value) if !value.trim().is_empty() => EnvFilter::builder()
            .parse(&value)
            .map_err(|e| anyhow::anyhow!("invalid RUST_LOG={value:?}: {e}"))?,
        _ => EnvFilter::new(DEFAULT_FILTER),
    };
    let json = json_format(std::env::var("LOG_FORMAT").ok().as_deref())?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .flatten_event(true)
            .init();
    } else {
        builder.with_ansi(std::io::stderr().is_terminal()).init();
    }
    Ok(())
}

/// Whether `LOG_FORMAT` asks for JSON lines; text when unset.
fn json_format(log_format: Option<&str>) -> anyhow::Result<bool> {
    match log_format.map(str::trim) {
        None | Some("") | Some("text") => Ok(false),
        Some("json") => Ok(true),
        Some(other) => anyhow::bail!("invalid LOG_FORMAT={other:?}: must be text or json"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_defaults_match_the_documented_values() {
        assert!(!json_format(None).unwrap(), "text by default");
        assert!(json_format(Some("json")).unwrap());
        let err = json_format(Some("yaml")).unwrap_err().to_string();
        assert!(err.contains("LOG_FORMAT"), "{err}");
        // As the configuration table in docs/operations.md and .env.example give them.
        let readme = include_str!("../../docs/operations.md");
        assert!(readme.contains(&format!("| `RUST_LOG` | `{DEFAULT_FILTER}` |")));
        assert!(readme.contains("| `LOG_FORMAT` | `text` |"));
        let example = include_str!("../../.env.example");
        assert!(example.contains(&format!("\nRUST_LOG={DEFAULT_FILTER}\n")));
        assert!(example.contains("\nLOG_FORMAT=text\n"));
        assert!(!json_format(Some("text")).unwrap());
    }
}
