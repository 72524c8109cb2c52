//! Structured logs with `tracing`, to stderr so stdout stays for output
//! (`oncepay merchants create` prints only the key there). Colours only when
//! stderr is a terminal, so log files stay plain text.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}
