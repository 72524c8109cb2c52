//! What answers a completed key before the core is entered: the replay
//! cache, and, while retries are common, a read of the key coalesced with
//! other requests' reads. A completed key's answer cannot change until it
//! expires, so answering it here is answering what the core's claim would
//! have found; whatever else a key holds (nothing, or a request in flight)
//! goes to the core, whose claim decides. The check of a saved answer against
//! the request (the same parameters, or `422`) is the core's own
//! ([`claim::replay`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use oncepay_core::error::{Error, overloaded};
use oncepay_core::operation::claim;
use oncepay_core::operation::engine::{Answer, Engine, Request};
use oncepay_core::operation::timing::{Phase, count_outcome, count_shed};
use oncepay_core::operation::workflow::{self, Operation};
use oncepay_core::operation::write::{self, Write};
use oncepay_core::problem::ProblemCode;

use super::cache::Caches;
use super::reads::{Reads, Shed};

/// The answers given before the core: the cache and the coalesced reads.
pub struct Front {
    pub caches: Arc<Caches>,
    pub reads: Reads,
}

impl Front {
    /// Answers `request` for a guarded `operation` ([`Front::answer`]).
    pub async fn run<O: Operation>(
        &self,
        engine: &Engine,
        request: Request,
        operation: O,
    ) -> Result<Answer, Error> {
        let core = |request| workflow::run(engine, request, operation);
        self.answer(request, core).await
    }

    /// Answers `request` for a `write` done whole in the claim's
    /// transaction ([`Front::answer`]).
    pub async fn write<W: Write>(
        &self,
        engine: &Engine,
        request: Request,
        write: W,
    ) -> Result<Answer, Error> {
        let core = |request| write::run(engine, request, write);
        self.answer(request, core).await
    }

    /// Answers `request` from what its key is known to hold, or else runs
    /// `core` for it (`workflow::run` or `write::run`), and learns from the
    /// answer: a replay is remembered, and whether its key was taken tells
    /// whether the next keys are worth reading first.
    pub async fn answer<F, W>(&self, request: Request, core: F) -> Result<Answer, Error>
    where
        F: FnOnce(Request) -> W,
        W: Future<Output = Result<Answer, Error>>,
    {
        let mut in_front = InFront { armed: true };
        let (read, known) = self.known(&request).await;
        in_front.armed = false;
        if let Some(answer) = known {
            return answer;
        }
        let merchant_id = request.merchant_id;
        let key = request.key.clone();
        let answer = core(request).await;
        if let Some(key) = key {
            if let Ok(Answer::Replayed { saved, .. }) = &answer {
                self.caches
                    .remember_answer(merchant_id, key.as_str(), saved.clone());
            }
            if !read {
                self.reads.learn(taken(&answer));
            }
        }
        answer
    }

    /// The answer the request's completed key gives it, if known here (and
    /// whether its key was read to find out).
    async fn known(&self, request: &Request) -> (bool, Option<Result<Answer, Error>>) {
        let Some(key) = &request.key else {
            return (false, None);
        };
        if let Some(saved) = self.caches.answer(request.merchant_id, key.as_str()) {
            request.clock.cached();
            return (false, Some(claim::replay(saved, request, false)));
        }
        if !self.reads.worth_reading() {
            return (false, None);
        }
        let reading = Instant::now();
        let deadline = request.deadline.into();
        let found = self.reads.find(request.merchant_id, key, deadline).await;
        request.clock.add(Phase::KeyRead, reading.elapsed());
        let stored = match found {
            Ok(stored) => stored,
            Err(Shed) => {
                tracing::debug!("the queue of key reads is full; shed before any work");
                count_shed(request.route);
                return (true, Some(Err(overloaded().into())));
            }
        };
        self.reads.learn(stored.is_some());
        let Some(saved) = stored.and_then(|stored| stored.into_answer()) else {
            return (true, None);
        };
        let saved = Arc::new(saved);
        self.caches
            .remember_answer(request.merchant_id, key.as_str(), saved.clone());
        (true, Some(claim::replay(saved, request, false)))
    }
}

/// A request still in front of the core. Dropped armed (its client was
/// answered by `REQUEST_TIMEOUT`, or hung up, while its key was being read),
/// it says that nothing was claimed, as the core's own task says it of a
/// request answered before its claim.
struct InFront {
    armed: bool,
}

impl Drop for InFront {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!("answered while its key was read, before any work; nothing claimed");
            count_outcome("answered_before_claim");
        }
    }
}

/// Whether an answer of the core says its key was taken: a replay, or the
/// same key in flight or reused.
fn taken(answer: &Result<Answer, Error>) -> bool {
    match answer {
        Ok(Answer::Fresh(_)) => false,
        Ok(Answer::Replayed { .. }) => true,
        Err(Error::Problem(problem)) => matches!(
            problem.code,
            ProblemCode::IdempotencyKeyInUse | ProblemCode::IdempotencyKeyReused
        ),
        Err(_) => false,
    }
}
