//! The seam for timing a guarded operation phase by phase: the core marks
//! how long each phase took on the request's [`Clock`], and the clock the
//! server plugs in adds them up and records them once the response is ready
//! (`src/speed/timing.rs`). The plain clock, [`Untimed`], keeps nothing.

use std::time::{Duration, Instant};

/// A phase of a guarded operation, in the order a request meets them. The
/// phases never overlap: their durations add up to at most the whole's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// From the request's arrival until the operation begins: reading the
    /// body, authenticating, decoding and checking the parameters.
    Extract,
    /// The parameters' canonical form and its SHA-256, the key's fingerprint.
    Fingerprint,
    /// Reading the key before the core is entered (the server's
    /// `src/speed/front.rs`), coalesced with other requests' reads.
    KeyRead,
    /// Waiting for the scheduler: between spawning the operation's task and
    /// its start, and between its end and the handler's waking.
    TaskHandoff,
    /// Waiting for a pooled connection to claim on, in the admission queue
    /// (the server's `src/speed/admission.rs`).
    PoolWait,
    /// Waiting for the same request in flight (`Prefer: wait=N`).
    KeyWait,
    /// Step 2: claiming the key with the pending record, or reading what it
    /// holds (settling it, when stale): marked whole, counted less the two
    /// waits above and a write's own work, which happen only within it.
    Claim,
    /// The processor's call.
    Processor,
    /// Waiting for a connection to settle on, from the pool directly
    /// (claimed work is never turned away), behind every queued request.
    SettlePoolWait,
    /// Settling the record and saving its answer on the key, or what follows
    /// when the processor was unavailable or another settle came first.
    Settle,
    /// For an operation without a processor ([`super::write::Write`]): its
    /// record, its saved answer and the commit, in the claim's transaction
    /// (within step 2).
    Write,
    /// Rendering the answer (or the problem) as an HTTP response.
    Render,
}

impl Phase {
    /// How many phases there are.
    pub const COUNT: usize = 12;
    /// Every phase, in the order a request meets them.
    pub const ALL: [Phase; Phase::COUNT] = [
        Phase::Extract,
        Phase::Fingerprint,
        Phase::KeyRead,
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
            Phase::KeyRead => "key_read",
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

/// What a request's phases are timed on, shared by its handler and the task
/// doing its work (which never mark at once).
pub trait Clock: Send + Sync {
    /// Adds `took` to `phase` (a request may wait for a connection twice).
    fn add(&self, phase: Phase, took: Duration);

    /// Notes that the request was answered from the replay cache, before
    /// any work: only the whole is worth recording.
    fn cached(&self) {}

    /// Adds the time since `from` to `phase`, and returns now: where the
    /// next phase begins.
    fn lap(&self, phase: Phase, from: Instant) -> Instant {
        let now = Instant::now();
        self.add(phase, now.saturating_duration_since(from));
        now
    }
}

/// The plain clock: times nothing.
pub struct Untimed;

impl Clock for Untimed {
    fn add(&self, _: Phase, _: Duration) {}
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
