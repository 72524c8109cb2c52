//! Structured logs with `tracing`, to stderr so stdout stays for output
//! (`oncepay merchants create` prints only the key there). `LOG_FORMAT=json`
//! writes one JSON object a line for machines; the default is readable text,
//! coloured only on a terminal. Every line of a request carries its span:
//! request id, method, route, merchant and idempotency key. Headers are never
//! logged, so `Authorization` and API keys cannot appear.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the subscriber. A `RUST_LOG` or `LOG_FORMAT` that does not parse
/// is an error naming it, like every other setting.
pub fn init() -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(value) if !value.trim().is_empty() => EnvFilter::builder()
            .parse(&value)
            .map_err(|e| anyhow::anyhow!("invalid RUST_LOG={value:?}: {e}"))?,
        _ => EnvFilter::new("info,sqlx=warn"),
    };
    let json = match std::env::var("LOG_FORMAT").ok().as_deref().map(str::trim) {
        None | Some("") | Some("text") => false,
        Some("json") => true,
        Some(other) => anyhow::bail!("invalid LOG_FORMAT={other:?}: must be text or json"),
    };
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
