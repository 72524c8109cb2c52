//! Where a guarded operation's time goes: each phase measured with
//! `Instant::now()` at its boundaries, the durations kept in a small array
//! that travels with the request and come back with its answer ([`Ran`]).
//! Nothing is allocated per phase, and nothing here records anything: the
//! server records a request's timing once, as its response is ready.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Answer;
use crate::error::Error;

/// A phase of a guarded operation, in the order a request meets them. The
/// phases never overlap, so their durations add up to at most the whole
/// operation's; what they leave out is the code between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// From the request's arrival until the operation begins: reading the
    /// body, authenticating, decoding and checking the parameters.
    Extract,
    /// The parameters' canonical form and its SHA-256, the key's fingerprint.
    Fingerprint,
    /// Waiting for the scheduler: between spawning the operation's task and
    /// its start, and between its end and the handler's waking.
    TaskHandoff,
    /// Waiting for a pooled connection to claim on, in the admission queue
    /// (the server's `src/admission.rs`).
    PoolWait,
    /// Waiting for the same request in flight (`Prefer: wait=N`).
    KeyWait,
    /// Claiming the key with the pending record, or reading what the key
    /// holds (and settling it, when found stale), less the waits above.
    Claim,
    /// The processor's call.
    Processor,
    /// Waiting for a pooled connection to settle on, from the pool directly
    /// (claimed work is never turned away): behind every request queued
    /// for one, the admission queue's included.
    SettlePoolWait,
    /// Settling the record and saving its answer on the key; or, when the
    /// processor was unavailable or someone else settled the record, what
    /// follows from that.
    Settle,
    /// For an operation without a processor ([`super::write::Write`]): its
    /// record, its saved answer and the commit, in the claim's transaction.
    Write,
    /// Rendering the answer (or the problem) as an HTTP response.
    Render,
}

impl Phase {
    const COUNT: usize = 11;
    const ALL: [Phase; Phase::COUNT] = [
        Phase::Extract,
        Phase::Fingerprint,
        Phase::TaskHandoff,
        Phase::PoolWait,
        Phase::KeyWait,
        Phase::Claim,
        Phase::Processor,
        Phase::SettlePoolWait,
        Phase::Settle,
        Phase::Write,
        Phase::Render,
    ];

    /// The phase as a metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::Extract => "extract",
            Phase::Fingerprint => "fingerprint",
            Phase::TaskHandoff => "task_handoff",
            Phase::PoolWait => "pool_wait",
            Phase::KeyWait => "key_wait",
            Phase::Claim => "claim",
            Phase::Processor => "processor",
            Phase::SettlePoolWait => "settle_pool_wait",
            Phase::Settle => "settle",
            Phase::Write => "write",
            Phase::Render => "render",
        }
    }
}

/// How long a request spent in each phase; `None` for a phase it did not
/// go through (a replay calls no processor).
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases([Option<Duration>; Phase::COUNT]);

impl Phases {
    /// Adds `took` to `phase` (a request may wait for a connection twice).
    pub fn add(&mut self, phase: Phase, took: Duration) {
        let slot = &mut self.0[phase as usize];
        *slot = Some(slot.unwrap_or_default() + took);
    }

    /// Adds the time since `from` to `phase`, and returns now: where the
    /// next phase begins.
    pub fn since(&mut self, phase: Phase, from: Instant) -> Instant {
        let now = Instant::now();
        self.add(phase, now.saturating_duration_since(from));
        now
    }

    /// Step 2, begun at `from`: its waits, as `waits` counted them, and the
    /// rest of its time as the claim.
    pub fn claimed(&mut self, from: Instant, waits: &Waits) {
        let took = from.elapsed();
        let (pool, key) = waits.take();
        let mut waited = Duration::ZERO;
        for (phase, wait) in [(Phase::PoolWait, pool), (Phase::KeyWait, key)] {
            if let Some(wait) = wait {
                self.add(phase, wait);
                waited += wait;
            }
        }
        self.add(Phase::Claim, took.saturating_sub(waited));
    }

    pub(super) fn merge(&mut self, other: &Phases) {
        for (phase, took) in other.iter() {
            self.add(phase, took);
        }
    }

    /// The phases gone through, with their durations.
    pub fn iter(&self) -> impl Iterator<Item = (Phase, Duration)> + '_ {
        Phase::ALL
            .iter()
            .zip(&self.0)
            .filter_map(|(phase, took)| took.map(|took| (*phase, took)))
    }
}

/// The waits of step 2, added up by code that holds the request only by
/// reference ([`super::claim::Request`]), from the operation's task alone.
#[derive(Debug, Default)]
pub struct Waits {
    /// Nanoseconds waited for a connection, plus one per wait; 0: none.
    pool: AtomicU64,
    /// The same, for the request in flight.
    key: AtomicU64,
}

impl Waits {
    /// Counts a wait for a pooled connection.
    pub fn pool(&self, took: Duration) {
        Self::count(&self.pool, took);
    }

    /// Counts a wait for the request in flight.
    pub fn key(&self, took: Duration) {
        Self::count(&self.key, took);
    }

    fn count(counter: &AtomicU64, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX / 2);
        counter.fetch_add(nanos + 1, Ordering::Relaxed);
    }

    /// The waits counted so far (connection, request in flight), each
    /// `None` if there was none; the counts start again from nothing.
    fn take(&self) -> (Option<Duration>, Option<Duration>) {
        let take = |counter: &AtomicU64| match counter.swap(0, Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n)),
        };
        (take(&self.pool), take(&self.key))
    }
}

/// A guarded operation's timing so far, from the request's arrival.
#[derive(Debug)]
pub struct Timing {
    pub route: &'static str,
    pub arrived: Instant,
    pub phases: Phases,
    /// Answered from the replay cache: only the whole is worth recording.
    pub cached: bool,
}

impl Timing {
    /// The timing of an operation on `route` for a request that arrived
    /// at `arrived`; the time until now is its [`Phase::Extract`].
    pub(super) fn begin(route: &'static str, arrived: Instant) -> (Self, Instant) {
        let mut phases = Phases::default();
        let now = phases.since(Phase::Extract, arrived);
        let timing = Timing {
            route,
            arrived,
            phases,
            cached: false,
        };
        (timing, now)
    }
}

/// What a guarded operation ended with, and how long it took to get there:
/// the server renders the answer and records the timing.
#[derive(Debug)]
pub struct Ran {
    pub answer: Result<Answer, Error>,
    pub timing: Timing,
}

/// Counts one outcome of the idempotency check.
pub fn count_outcome(outcome: &'static str) {
    metrics::counter!("idempotency_outcomes_total", "outcome" => outcome).increment(1);
}

/// Counts a request shed before its work began, by the route template of
/// its operation (a closed set).
pub fn count_shed(route: &'static str) {
    metrics::counter!("requests_shed_total", "route" => route).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_what_was_gone_through_and_leave_out_the_rest() {
        let mut phases = Phases::default();
        let ms = Duration::from_millis;
        phases.add(Phase::PoolWait, ms(2));
        phases.add(Phase::Processor, ms(5));
        phases.add(Phase::PoolWait, ms(3));
        let listed: Vec<_> = phases.iter().collect();
        assert_eq!(
            listed,
            [(Phase::PoolWait, ms(5)), (Phase::Processor, ms(5))]
        );
        let mut all = Phases::default();
        all.add(Phase::Extract, ms(1));
        all.merge(&phases);
        assert_eq!(all.iter().count(), 3);
    }

    #[test]
    fn the_claim_is_step_two_less_its_waits_and_a_wait_counts_even_when_short() {
        let waits = Waits::default();
        let from = Instant::now();
        waits.pool(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(20));
        waits.key(Duration::from_millis(15));
        let mut phases = Phases::default();
        phases.claimed(from, &waits);
        let got: Vec<_> = phases.iter().map(|(phase, _)| phase).collect();
        assert_eq!(got, [Phase::PoolWait, Phase::KeyWait, Phase::Claim]);
        let total: Duration = phases.iter().map(|(_, took)| took).sum();
        assert!(total >= Duration::from_millis(20), "{phases:?}");
        assert!(total <= from.elapsed(), "{phases:?}");
        // Taken: a second step 2 starts from nothing.
        let mut again = Phases::default();
        again.claimed(Instant::now(), &waits);
        let got: Vec<_> = again.iter().map(|(phase, _)| phase).collect();
        assert_eq!(got, [Phase::Claim]);
    }

    #[test]
    fn every_phase_has_its_own_label() {
        let mut labels: Vec<_> = Phase::ALL.iter().map(|p| p.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Phase::COUNT);
        for (i, phase) in Phase::ALL.iter().enumerate() {
            assert_eq!(*phase as usize, i, "ALL is in declaration order");
        }
    }
}
