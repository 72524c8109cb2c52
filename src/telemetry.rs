//! Structured logs with `tracing`, to stderr so stdout stays for output
//! (`oncepay merchants create` prints only the key there). Colours only when
//! stderr is a terminal, so log files stay plain text.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the subscriber. A `RUST_LOG` that does not parse is an error
/// naming it, like every other setting.
pub fn init() -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(value) if !value.trim().is_empty() => EnvFilter::builder()
            .parse(&value)
            .map_err(|e| anyhow::anyhow!("invalid RUST_LOG={value:?}: {e}"))?,
        _ => EnvFilter::new("info,sqlx=warn"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    Ok(())
}
