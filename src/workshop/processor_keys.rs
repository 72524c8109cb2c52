//! Block 10, the same key to the provider: one payment asked of the card
//! gateway, whose first answer is lost after the money moved
//! (`Processor-Fault: drop-after-record`), then asked again, as oncepay's
//! own client does. Right, every attempt carries the one processor key
//! derived from the operation, and the gateway finds its payment; wrong on
//! purpose, each attempt derives a new key, and the gateway, which cannot
//! tell a repeat from a new payment, takes the money again. The payments are
//! counted from the gateway's ledger, over its lookup API.

use std::fmt;
use std::time::SystemTime;

use crate::config::Config;
use crate::processor::{
    Authorization, HttpProcessor, Outcome, Processor, ProcessorError, TestToken, WireFault,
};
use crate::workshop::trace::{Lane, Mark, RequestTrace, TraceEvent, timed};

/// The most attempts one payment gets.
pub const MAX_ATTEMPTS: u32 = 3;

/// Which processor key each attempt carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyPer {
    /// One key for the operation, `demo:{run}`, on every attempt (right).
    Operation,
    /// A new key for each attempt, `demo:{run}:attempt-{n}` (wrong on purpose).
    Attempt,
}

impl KeyPer {
    /// `same` or `new_per_attempt`, as the endpoint's `keys` parameter.
    pub fn parse(value: &str) -> Option<KeyPer> {
        match value {
            "same" => Some(KeyPer::Operation),
            "new_per_attempt" => Some(KeyPer::Attempt),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KeyPer::Operation => "same",
            KeyPer::Attempt => "new_per_attempt",
        }
    }

    /// The processor key of attempt `n` (from 1) of `run`.
    pub fn key(self, run: &str, n: u32) -> String {
        match self {
            KeyPer::Operation => format!("demo:{run}"),
            KeyPer::Attempt => format!("demo:{run}:attempt-{n}"),
        }
    }
}

/// What one attempt sent and got.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub processor_key: String,
    /// Whether the gateway was asked to drop its answer.
    pub dropped: bool,
    pub answer: Answer,
}

impl Attempt {
    /// Marks what the attempt did at the gateway, as the gateway's rules
    /// say: a new key that was recorded moved money; the same key again
    /// found the first payment; a dropped answer never came back.
    fn draw(&self, trace: &RequestTrace, new_key: bool) {
        let now = SystemTime::now();
        let recorded = self.dropped || self.answer == Answer::Outcome(Outcome::Succeeded);
        if recorded && new_key {
            let what = "the payment recorded: money moved";
            trace.push(TraceEvent::at(now, Lane::Gateway, what, Some(Mark::Effect)));
        } else if recorded {
            let what = "the same key: the first payment found, nothing moved";
            trace.push(TraceEvent::at(now, Lane::Gateway, what, Some(Mark::Replay)));
        }
        if self.dropped {
            let what = "the gateway's answer lost";
            trace.push(TraceEvent::at(now, Lane::Oncepay, what, Some(Mark::Lost)));
        }
    }
}

/// What an attempt got back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The gateway's outcome.
    Outcome(Outcome),
    /// No answer: the outcome is unknown (the money may have moved).
    Lost,
    /// Refused before anything was recorded.
    Unavailable,
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Outcome(Outcome::Succeeded) => f.write_str("succeeded"),
            Answer::Outcome(Outcome::Declined { code, .. }) => write!(f, "declined ({code})"),
            Answer::Outcome(Outcome::Voided) => f.write_str("voided"),
            Answer::Lost => f.write_str("no answer"),
            Answer::Unavailable => f.write_str("unavailable"),
        }
    }
}

/// Asks the gateway for one payment of `amount` for `run`, attempt after
/// attempt until one is answered (at most [`MAX_ATTEMPTS`]), the first
/// asking the gateway to drop its answer after recording. Each attempt is
/// one HTTP call (a client of its own that never repeats a call), so the
/// attempts are this loop's and the key of each is `keys`'.
/// A recorded request gets each attempt drawn on the gateway's lane.
pub async fn pay(
    config: &Config,
    keys: KeyPer,
    run: &str,
    amount: i64,
    trace: Option<&RequestTrace>,
) -> anyhow::Result<Vec<Attempt>> {
    let mut settings = config.processor_settings()?;
    settings.retries = 0;
    let processor = HttpProcessor::new(settings)?;
    let mut attempts = Vec::new();
    for n in 1..=MAX_ATTEMPTS {
        let processor_key = keys.key(run, n);
        let dropped = n == 1;
        let asked = processor.authorize(Authorization {
            capture: true,
            processor_key: &processor_key,
            amount,
            currency: "usd",
            source: TestToken::Visa,
            fault: dropped.then_some(WireFault::DropAfterRecord),
        });
        let what = format!("attempt {n}, key {processor_key}");
        let answer = match timed(trace, Lane::Gateway, &what, asked).await {
            Ok(outcome) => Answer::Outcome(outcome),
            Err(ProcessorError::OutcomeUnknown(e)) => {
                tracing::info!(key = %processor_key, error = %format!("{e:#}"), "workshop: the gateway's answer was lost");
                Answer::Lost
            }
            Err(ProcessorError::Unavailable) => Answer::Unavailable,
        };
        let answered = matches!(answer, Answer::Outcome(_));
        let attempt = Attempt {
            processor_key,
            dropped,
            answer,
        };
        if let Some(trace) = trace {
            let new_key = attempts
                .iter()
                .all(|a: &Attempt| a.processor_key != attempt.processor_key);
            attempt.draw(trace, new_key);
        }
        attempts.push(attempt);
        if answered {
            break;
        }
    }
    Ok(attempts)
}

/// What the gateway's ledger holds for a run, both kinds of key.
#[derive(Debug, Clone, Default)]
pub struct Payments {
    /// Payments that went through: money moved.
    pub payments: i64,
    /// What they took, in minor units.
    pub charged: i64,
    /// The keys that hold one.
    pub keys: Vec<String>,
}

/// Looks up every key a run can have used at the gateway (over its API,
/// moving nothing) and counts the payments that went through.
pub async fn payments(processor: &dyn Processor, run: &str) -> anyhow::Result<Payments> {
    let mut keys = vec![KeyPer::Operation.key(run, 1)];
    keys.extend((1..=MAX_ATTEMPTS).map(|n| KeyPer::Attempt.key(run, n)));
    let mut found = Payments::default();
    for key in keys {
        if let Some(payment) = processor.payment(&key).await? {
            if payment.outcome == Outcome::Succeeded {
                found.payments += 1;
                found.charged += payment.amount;
                found.keys.push(key);
            }
        }
    }
    Ok(found)
}
