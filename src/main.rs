//! The `oncepay` binary: parse the command line and hand over to the library.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = oncepay::cli::Cli::parse();
    // A missing .env is fine (the environment may hold everything); a
    // malformed one is not.
    if let Err(e) = dotenvy::dotenv() {
        if !e.not_found() {
            eprintln!("oncepay: reading .env: {e}");
            return std::process::ExitCode::FAILURE;
        }
    }
    if let Err(e) = oncepay::telemetry::init() {
        eprintln!("oncepay: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    match cli.run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oncepay: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
