//! The `oncepay` binary: parse the command line and hand over to the library.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // A missing .env is fine; the environment may hold everything.
    let _ = dotenvy::dotenv();
    oncepay::telemetry::init();
    let cli = oncepay::cli::Cli::parse();
    match cli.run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oncepay: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
