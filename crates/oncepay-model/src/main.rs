//! `oncepay-model`: checks the exactly-once protocol and the naive designs
//! (`check`), tells their counterexamples as timelines (`explain`), and
//! serves Stateright's explorer to step through one (`serve`).

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use oncepay_model::check::{Report, check};
use oncepay_model::explain::{self, timeline};
use oncepay_model::{Bounds, Protocol, Variant};
use stateright::Model;

#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Checks each variant (all by default): the protocol must break no
    /// property, each naive design the one it is known to break.
    Check(Chosen),
    /// Tells each variant's shortest counterexample as a timeline (the
    /// protocol: the states explored and none).
    Explain {
        #[command(flatten)]
        chosen: Chosen,
        /// One JSON document: each variant's states, seconds, property
        /// broken and steps (lane, what), for scripts/demo.
        #[arg(long)]
        json: bool,
    },
    /// Serves Stateright's explorer of one variant, and prints the address
    /// of its shortest counterexample there.
    Serve {
        variant: String,
        #[arg(long, default_value = "127.0.0.1:3000")]
        addr: String,
        #[command(flatten)]
        bounds: BoundsArgs,
    },
}

#[derive(Args)]
struct Chosen {
    /// Variants by name: real, check-then-act, key-after-work,
    /// two-transactions, short-ttl, new-key-per-attempt, no-fingerprint,
    /// no-void-fence, redis-set-nx.
    variants: Vec<String>,
    #[command(flatten)]
    bounds: BoundsArgs,
}

#[derive(Args)]
struct BoundsArgs {
    /// Attempts of the client of the logical operation.
    #[arg(long, default_value_t = Bounds::default().attempts)]
    attempts: u8,
    /// Crashes of an instance on one path.
    #[arg(long, default_value_t = Bounds::default().crashes)]
    crashes: u8,
    /// Messages the network loses or duplicates on one path.
    #[arg(long, default_value_t = Bounds::default().faults)]
    faults: u8,
}

impl BoundsArgs {
    fn model(&self, variant: Variant) -> Protocol {
        let bounds = Bounds {
            attempts: self.attempts,
            crashes: self.crashes,
            faults: self.faults,
            ..Bounds::default()
        };
        Protocol { variant, bounds }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(chosen) => variants(&chosen).map(|v| check_all(&chosen.bounds, &v)),
        Command::Explain { chosen, json } => {
            variants(&chosen).map(|v| explain_all(&chosen.bounds, &v, json))
        }
        Command::Serve {
            variant,
            addr,
            bounds,
        } => match Variant::parse(&variant) {
            Some(v) => serve(bounds.model(v), &addr),
            None => Err(format!("no variant {variant}")),
        },
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("oncepay-model: {e}");
            ExitCode::from(2)
        }
    }
}

/// The chosen variants, or all.
fn variants(chosen: &Chosen) -> Result<Vec<Variant>, String> {
    if chosen.variants.is_empty() {
        return Ok(Variant::ALL.to_vec());
    }
    let parse = |n: &String| Variant::parse(n).ok_or(format!("no variant {n}"));
    chosen.variants.iter().map(parse).collect()
}

/// Whether `report` is what its variant should give: nothing broken for
/// the protocol, its own property for a naive design.
fn as_expected(report: &Report) -> bool {
    match report.model.variant.breaks() {
        None => report.broken.is_empty(),
        Some(property) => report.counterexample(property).is_some(),
    }
}

/// One line per variant: states, time, and what broke in how many steps.
fn check_all(bounds: &BoundsArgs, variants: &[Variant]) -> bool {
    let mut all = true;
    println!(
        "{:<20} {:>10} {:>8}  result",
        "variant", "states", "seconds"
    );
    for &variant in variants {
        let report = check(bounds.model(variant));
        let result = match report.broken.first() {
            None => "no counterexample".to_owned(),
            Some((name, path)) => {
                format!(
                    "breaks \"{name}\" in {} steps",
                    path.clone().into_actions().len()
                )
            }
        };
        let ok = as_expected(&report);
        let mark = if ok { "" } else { "  UNEXPECTED" };
        let secs = report.took.as_secs_f64();
        println!(
            "{:<20} {:>10} {secs:>8.1}  {result}{mark}",
            variant.name(),
            report.states
        );
        all &= ok;
    }
    all
}

/// Each variant's counterexample as a timeline, or all of them as JSON.
fn explain_all(bounds: &BoundsArgs, variants: &[Variant], json: bool) -> bool {
    let reports: Vec<Report> = variants.iter().map(|&v| check(bounds.model(v))).collect();
    if json {
        let all: Vec<_> = reports.iter().map(explain::as_json).collect();
        println!("{}", serde_json::Value::Array(all));
    }
    for report in reports.iter().filter(|_| !json) {
        let (states, secs) = (report.states, report.took.as_secs_f64());
        println!(
            "{}: {states} states explored in {secs:.1} s",
            report.model.variant
        );
        match report.broken.first() {
            None => println!("     no counterexample: every property holds in every state\n"),
            Some((name, path)) => println!("{}", timeline(&report.model, path, name)),
        }
    }
    reports.iter().all(as_expected)
}

/// Serves the explorer of `model` at `addr` (port 0: any free one), after
/// printing its address and where its shortest counterexample starts
/// there; runs until stopped.
fn serve(model: Protocol, addr: &str) -> Result<bool, String> {
    let report = check(model.clone());
    // The explorer binds `addr` itself and never says which port it got.
    let bound = std::net::TcpListener::bind(addr).map_err(|e| format!("{addr}: {e}"))?;
    let addr = bound.local_addr().map_err(|e| e.to_string())?;
    drop(bound);
    println!("the explorer of {}: http://{addr}/", model.variant);
    if let Some((name, path)) = report.broken.first() {
        let steps = path.encode(&model);
        println!("its counterexample of \"{name}\": http://{addr}/#/steps/{steps}");
    }
    model.checker().serve(addr);
    Ok(true)
}
