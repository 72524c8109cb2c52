//! A guarded operation's clock: the core marks how long each phase took
//! ([`oncepay_core::operation::timing::Clock`]); this clock adds them up, and
//! records the whole, by route and outcome, then each phase, once the
//! response is rendered. Nothing is allocated per phase.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use oncepay_core::error::Error;
use oncepay_core::operation::engine::Answer;
use oncepay_core::operation::timing::{Clock, Phase};
use oncepay_core::problem::ProblemCode;

/// One request's clock: the time of each phase so far.
pub struct Stopwatch {
    route: &'static str,
    arrived: Instant,
    /// Nanoseconds per phase, plus one per mark; 0: not gone through.
    phases: [AtomicU64; Phase::COUNT],
    /// Answered from the replay cache: only the whole is worth recording.
    cached: AtomicBool,
}

impl Clock for Stopwatch {
    fn add(&self, phase: Phase, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX / 2);
        self.phases[phase as usize].fetch_add(nanos + 1, Ordering::Relaxed);
    }

    fn cached(&self) {
        self.cached.store(true, Ordering::Relaxed);
    }
}

impl Stopwatch {
    /// The clock of a request on `route` that arrived at `arrived`.
    pub fn start(route: &'static str, arrived: Instant) -> Arc<Self> {
        Arc::new(Stopwatch {
            route,
            arrived,
            phases: Default::default(),
            cached: AtomicBool::new(false),
        })
    }

    /// The phases gone through, with their durations: step 2's
    /// ([`Phase::Claim`]) less the waits and the write marked within it.
    fn phases(&self) -> impl Iterator<Item = (Phase, Duration)> + '_ {
        let took = |phase: Phase| match self.phases[phase as usize].load(Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        };
        let within = [Phase::PoolWait, Phase::KeyWait, Phase::Write]
            .into_iter()
            .filter_map(took)
            .sum::<Duration>();
        Phase::ALL.into_iter().filter_map(move |phase| {
            let took = took(phase)?;
            Some(match phase {
                Phase::Claim => (phase, took.saturating_sub(within)),
                _ => (phase, took),
            })
        })
    }

    /// Renders the answer with `render`, then records the operation's
    /// duration from the request's arrival and, unless it was answered from
    /// the cache (a hot path with no phases worth the histograms), each
    /// phase's.
    pub fn render<R>(
        &self,
        answer: Result<Answer, Error>,
        render: impl FnOnce(Result<Answer, Error>) -> R,
    ) -> R {
        let outcome = outcome(&answer);
        let rendering = Instant::now();
        let rendered = render(answer);
        let done = self.lap(Phase::Render, rendering);
        let took = done.saturating_duration_since(self.arrived);
        let cached = self.cached.load(Ordering::Relaxed);
        let phases = (!cached).then(|| self.phases());
        record(self.route, outcome, took, phases.into_iter().flatten());
        rendered
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_what_was_gone_through_and_leave_out_the_rest() {
        let clock = Stopwatch::start("/v1/charges", Instant::now());
        let ms = Duration::from_millis;
        clock.add(Phase::Processor, ms(5));
        clock.add(Phase::Extract, ms(1));
        clock.add(Phase::Processor, ms(2));
        let listed: Vec<_> = clock.phases().collect();
        let near = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_micros(1);
        assert_eq!(listed.len(), 2, "{listed:?}");
        assert_eq!(listed[0].0, Phase::Extract);
        assert!(near(listed[0].1, ms(1)), "{listed:?}");
        assert_eq!(listed[1].0, Phase::Processor);
        assert!(near(listed[1].1, ms(7)), "{listed:?}");
    }

    #[test]
    fn the_claim_is_step_two_less_its_waits_and_a_wait_counts_even_when_zero() {
        let clock = Stopwatch::start("/v1/charges", Instant::now());
        let ms = Duration::from_millis;
        clock.add(Phase::PoolWait, Duration::ZERO);
        clock.add(Phase::KeyWait, ms(15));
        clock.add(Phase::Claim, ms(20));
        let listed: Vec<_> = clock.phases().map(|(phase, _)| phase).collect();
        assert_eq!(listed, [Phase::PoolWait, Phase::KeyWait, Phase::Claim]);
        let total: Duration = clock.phases().map(|(_, took)| took).sum();
        assert!(
            total.abs_diff(ms(20)) < Duration::from_micros(1),
            "{total:?}"
        );
    }
}
