//! The card processor, behind a trait: the server's `HttpProcessor` speaks
//! to the card gateway over HTTP (`oncepay processor`, or the one `oncepay
//! serve` embeds), and tests wrap it to fail on purpose.
//!
//! Like a real gateway, a processor is idempotent on the *processor key*,
//! derived from the service's own ids (never the client's key): a repeat
//! under the same key returns the first outcome and moves no more money.

use async_trait::async_trait;

pub use test_cards::TestToken;

/// The processor key for authorizing a charge.
pub fn authorization_key(charge_id: &str) -> String {
    format!("auth:{charge_id}")
}

/// The processor key for capturing a charge authorized with
/// `capture=false`: derived from the charge, so every request that captures
/// it, and every recovery, asks the processor under one key, and the
/// processor captures once.
pub fn capture_key(charge_id: &str) -> String {
    format!("capture:{charge_id}")
}

/// The processor key for refunding money: derived from the refund id, so a
/// roll-forward after a crash repeats the same refund instead of adding one.
pub fn refund_key(refund_id: &str) -> String {
    format!("refund:{refund_id}")
}

/// The processor key of reconciliation's refund of an orphan payment:
/// derived from the payment's key, so a second run finds that refund.
pub fn reconcile_refund_key(payment_key: &str) -> String {
    format!("{RECONCILE_REFUND_PREFIX}{payment_key}")
}

/// How a key of [`reconcile_refund_key`] begins.
pub const RECONCILE_REFUND_PREFIX: &str = "reconcile-refund:";

/// A request to move money.
#[derive(Clone, Debug)]
pub struct Authorization<'a> {
    pub processor_key: &'a str,
    pub amount: i64,
    pub currency: &'a str,
    pub source: TestToken,
    /// `false`: only hold the amount, until a [`Capture`] takes it.
    pub capture: bool,
    /// A wire fault to ask of the gateway on this call (fault injection only).
    pub fault: Option<WireFault>,
}

/// A request to take all or part of an authorization made with
/// `capture: false`; what is not taken goes back to the card.
#[derive(Clone, Debug)]
pub struct Capture<'a> {
    pub processor_key: &'a str,
    /// The processor key of the authorization captured.
    pub payment_key: &'a str,
    pub amount: i64,
    pub currency: &'a str,
    /// A wire fault to ask of the gateway on this call (fault injection only).
    pub fault: Option<WireFault>,
}

/// A request to give money back from a payment.
#[derive(Clone, Debug)]
pub struct Refund<'a> {
    pub processor_key: &'a str,
    /// The processor key of the payment refunded (its authorization key).
    pub payment_key: &'a str,
    pub amount: i64,
    pub currency: &'a str,
    /// A wire fault to ask of the gateway on this call (fault injection only).
    pub fault: Option<WireFault>,
}

/// A failure the gateway makes on purpose, as real networks and providers
/// do now and then, when asked with `Processor-Fault` (and run with
/// `PROCESSOR_FAULT_INJECTION=true`): only on the attempt that records the
/// operation, so a repeat under the same key is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFault {
    /// `503`, nothing recorded.
    FailBeforeRecord,
    /// Records, then closes the connection unanswered: the money moved and
    /// the answer is lost.
    DropAfterRecord,
    /// Records, then answers only after `PROCESSOR_FAULT_DELAY`.
    Slow,
    /// Records, then the gateway process aborts.
    CrashAfterRecord,
}

impl WireFault {
    /// The `Processor-Fault` header.
    pub const HEADER: &'static str = "processor-fault";

    /// The fault a `Processor-Fault` value names.
    pub fn parse(value: &str) -> Option<WireFault> {
        use WireFault::*;
        [FailBeforeRecord, DropAfterRecord, Slow, CrashAfterRecord]
            .into_iter()
            .find(|fault| fault.as_str() == value)
    }

    /// Its `Processor-Fault` value.
    pub fn as_str(self) -> &'static str {
        match self {
            WireFault::FailBeforeRecord => "fail-before-record",
            WireFault::DropAfterRecord => "drop-after-record",
            WireFault::Slow => "slow",
            WireFault::CrashAfterRecord => "crash-after-record",
        }
    }
}

/// What the processor recorded for a processor key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The payment went through: money moved.
    Succeeded,
    /// The card was declined: no money moved.
    Declined { code: String, message: String },
    /// A void was recorded before any authorization: no money moved, and none
    /// ever can under this key.
    Voided,
}

/// What the processor recorded for a refund.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefundOutcome {
    /// The money went back to the card.
    Refunded,
    /// The card's issuer refused the refund for good (a closed account, say):
    /// no money moved, and repeating the call gets the same answer.
    Failed { reason: String },
}

/// What the processor holds for a payment's key (its status, for a sync).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Payment {
    /// The authorization's outcome, or `Voided` when a void came first.
    pub outcome: Outcome,
    /// What the payment took, in minor units (0 for a void).
    pub amount: i64,
    /// How many refunds of it went through, and what they gave back.
    pub refunds: i64,
    pub amount_refunded: i64,
}

/// A call that did not return an outcome.
#[derive(Debug, thiserror::Error)]
pub enum ProcessorError {
    /// The processor could not have recorded anything: safe to forget the attempt.
    #[error("the processor is unavailable; nothing was recorded")]
    Unavailable,
    /// The call failed in a way that leaves the outcome unknown: money may
    /// have moved, so the attempt must be resolved later, never forgotten.
    #[error("the processor's outcome is unknown")]
    OutcomeUnknown(#[source] anyhow::Error),
}

/// A card processor.
#[async_trait]
pub trait Processor: Send + Sync + 'static {
    /// Authorizes a payment, idempotently on `processor_key`.
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError>;

    /// Settles an attempt whose answer was lost: records a void for
    /// `processor_key` unless something is recorded already, and returns what
    /// stands. After this returns, no later authorization can move money
    /// under that key: it will find the void.
    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError>;

    /// Captures an authorization made with `capture: false`, idempotently
    /// on `processor_key`; `Ok` means the capture is recorded.
    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError>;

    /// Refunds part or all of a recorded payment, idempotently on
    /// `processor_key`; `Ok` means the outcome, refunded or failed, is recorded.
    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError>;

    /// Looks up what is recorded under a payment's key, moving nothing:
    /// `None` when nothing is.
    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError>;

    /// Whether the processor can be reached now (for `/readyz`).
    async fn ready(&self) -> anyhow::Result<()> {
        Ok(())
    }
}
