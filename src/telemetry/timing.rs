//! Recording a guarded operation's timing: the whole, by route and outcome,
//! then each phase it went through, once its response is rendered. The core
//! measures the phases ([`crate::operation::timing`]); only the server
//! records them, so the core holds no metric of its own timing.

use std::time::{Duration, Instant};

use crate::error::Error;
use crate::operation::Answer;
use crate::operation::timing::{Phase, Phases, Ran};
use crate::problem::ProblemCode;

/// Renders the answer with `render`, then records the operation's duration
/// from the request's arrival and, unless it was answered from the cache
/// (a hot path with no phases worth the histograms), each phase's.
pub fn render<R>(ran: Ran, render: impl FnOnce(Result<Answer, Error>) -> R) -> R {
    let Ran { answer, mut timing } = ran;
    let outcome = outcome(&answer);
    let rendering = Instant::now();
    let rendered = render(answer);
    let done = timing.phases.since(Phase::Render, rendering);
    let took = done.saturating_duration_since(timing.arrived);
    let phases = (!timing.cached).then_some(&timing.phases);
    record(
        timing.route,
        outcome,
        took,
        phases.into_iter().flat_map(Phases::iter),
    );
    rendered
}

/// The outcome label of an operation's answer, one of a closed set:
/// `executed` (its work was done here), `replayed` (a saved answer),
/// `in_use` (`409`), `reused` (`422`), `shed` (`503 overloaded`, before any
/// work) or `error` (any other problem).
pub fn outcome(answer: &Result<Answer, Error>) -> &'static str {
    match answer {
        Ok(Answer::Fresh(_)) => "executed",
        Ok(Answer::Replayed { .. }) => "replayed",
        Err(Error::Problem(problem)) => match problem.code {
            ProblemCode::IdempotencyKeyInUse => "in_use",
            ProblemCode::IdempotencyKeyReused => "reused",
            ProblemCode::Overloaded => "shed",
            _ => "error",
        },
        Err(_) => "error",
    }
}

/// Records one guarded operation on `route` that ended with `outcome`: how
/// long it took, then how long each of `phases` took. The whole comes
/// first, so that a scrape never sees the phases of a request whose whole
/// it does not. Labels are static strings: nothing is allocated.
fn record(
    route: &'static str,
    outcome: &'static str,
    took: Duration,
    phases: impl Iterator<Item = (Phase, Duration)>,
) {
    metrics::histogram!("operation_duration_seconds", "route" => route, "outcome" => outcome)
        .record(took.as_secs_f64());
    for (phase, took) in phases {
        metrics::histogram!(
            "operation_phase_duration_seconds",
            "route" => route,
            "phase" => phase.as_str(),
            "outcome" => outcome
        )
        .record(took.as_secs_f64());
    }
}
