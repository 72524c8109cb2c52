//! The `oncepay` binary: parse the command line and hand over to the library.

use oncepay::cli::{Cli, CliError};

/// mimalloc rather than the system allocator: see `docs/performance.md`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // A missing .env is fine (the environment may hold everything); a
    // malformed one is not. Read before the command line, whose settings
    // fall back to the environment.
    if let Err(e) = dotenvy::dotenv() {
        if !e.not_found() {
            eprintln!("oncepay: reading .env: {e}");
            return std::process::ExitCode::FAILURE;
        }
    }
    let cli = match Cli::parse_env() {
        Ok(cli) => cli,
        Err(CliError::Usage(e)) => e.exit(),
        Err(CliError::Config(e)) => {
            eprintln!("oncepay: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Err(e) = oncepay::telemetry::init() {
        eprintln!("oncepay: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    match cli.run().await {
        Ok(status) => status,
        Err(e) => {
            eprintln!("oncepay: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
