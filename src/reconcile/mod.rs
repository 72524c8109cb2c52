//! Reconciliation: oncepay's charges and refunds compared with the
//! processor's ledger over a window of time, each difference reported by
//! kind (see [`Kind`]), and the one with a compensating action, an orphan
//! payment, refunded on request.
//!
//! The ledger read is oncepay's account's only (`PROCESSOR_API_KEY`): the
//! gateway shows no other caller's operations, so another deployment's
//! payments are never taken for orphans. Records are paired by processor
//! key (`auth:<charge id>`, `refund:<refund id>`); a refund under
//! `reconcile-refund:<payment key>` is reconciliation's own only when it
//! checks out against the orphan payment it claims to give back (see
//! [`compensates`]), and is reported like any other refund otherwise. Each
//! succeeded charge's refunds are also compared, as a sum, with what its
//! payment's refunds gave back at the processor.
//! A record in the window whose other half lies
//! outside it is looked up by key or id, so a window's edge never makes a
//! difference. Pending records, and pairs younger than `PROCESSING_TIMEOUT`,
//! are still in flight (a request or the sweeper settles them): they are
//! counted, not reported. `oncepay reconcile` runs this once; [`job`] runs
//! it periodically inside `serve`, on one instance at a time.

pub mod job;
pub mod store;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::processor::{
    LedgerClient, LedgerOperation, Processor, RECONCILE_REFUND_PREFIX, Refund, RefundOutcome,
    authorization_key, reconcile_refund_key, refund_key,
};
use oncepay_core::charges::ChargeStatus;
use oncepay_core::refunds::RefundStatus;
use store::{ChargeRow, Pick, RefundRow};

/// What kind of difference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// The processor took money, and no succeeded charge stands for it.
    OrphanPayment,
    /// A succeeded charge, and no payment at the processor.
    MissingPayment,
    /// A succeeded charge and its payment differ in amount or currency.
    PaymentMismatch,
    /// A succeeded refund, and no refund at the processor.
    MissingProcessorRefund,
    /// The processor gave money back, and no refund of oncepay's stands for it.
    OrphanRefund,
    /// A refund and the processor's differ: amount, currency, payment or outcome.
    RefundMismatch,
    /// A succeeded charge's refunds and its payment's at the processor gave
    /// back different sums (a refund at the processor oncepay does not know
    /// of, say, made under a key that is no refund's).
    RefundedAmountMismatch,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::OrphanPayment,
        Kind::MissingPayment,
        Kind::PaymentMismatch,
        Kind::MissingProcessorRefund,
        Kind::OrphanRefund,
        Kind::RefundMismatch,
        Kind::RefundedAmountMismatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::OrphanPayment => "orphan_payment",
            Kind::MissingPayment => "missing_payment",
            Kind::PaymentMismatch => "payment_mismatch",
            Kind::MissingProcessorRefund => "missing_processor_refund",
            Kind::OrphanRefund => "orphan_refund",
            Kind::RefundMismatch => "refund_mismatch",
            Kind::RefundedAmountMismatch => "refunded_amount_mismatch",
        }
    }
}

/// One side of a difference: a record as oncepay or the processor holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Side {
    /// oncepay's status (`succeeded`, `failed`), or the processor's outcome
    /// (`succeeded`, `declined`, `voided`, `refunded`, `refund_failed`).
    pub status: String,
    pub amount: Option<i64>,
    pub currency: Option<String>,
    pub created: DateTime<Utc>,
}

impl Side {
    /// oncepay's side of a charge.
    fn charge(c: &ChargeRow) -> Self {
        Self::oncepay(c.status.as_str(), c.amount, &c.currency, c.created_at)
    }

    /// oncepay's side of a refund.
    fn refund(r: &RefundRow) -> Self {
        Self::oncepay(r.status.as_str(), r.amount, &r.currency, r.created_at)
    }

    /// oncepay's side of a charge or refund: it always knows the amount and
    /// the currency.
    fn oncepay(status: &str, amount: i64, currency: &str, created: DateTime<Utc>) -> Self {
        Side {
            status: status.to_owned(),
            amount: Some(amount),
            currency: Some(currency.to_owned()),
            created,
        }
    }

    fn processor(o: &LedgerOperation) -> Self {
        Side {
            status: o.outcome.clone(),
            amount: o.amount,
            currency: o.currency.clone(),
            created: o.created,
        }
    }

    fn describe(side: Option<&Side>) -> String {
        match side {
            None => "-".into(),
            Some(s) => match (s.amount, &s.currency) {
                (Some(a), Some(c)) => format!("{} {a} {c}", s.status),
                _ => s.status.clone(),
            },
        }
    }
}

/// What `--fix` did about a difference.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "action")]
pub enum Fix {
    /// The orphan payment was refunded at the processor under `key`.
    Refunded {
        key: String,
        amount: i64,
        currency: String,
    },
    /// The card's issuer refused that refund: a person must look.
    RefundRefused { key: String, reason: String },
    /// The refund's outcome is unknown or it was not made; running the
    /// fix again repeats it under the same key.
    Failed { key: String, error: String },
}

/// One difference between oncepay's records and the processor's ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Difference {
    pub kind: Kind,
    /// The processor key the two sides share (`auth:ch_...`, `refund:re_...`).
    pub key: String,
    pub charge: Option<String>,
    pub refund: Option<String>,
    /// oncepay's record, if there is one.
    pub oncepay: Option<Side>,
    /// The processor's operation, if there is one.
    pub processor: Option<Side>,
    /// What differs, in words.
    pub detail: String,
    /// What `--fix` did, when asked and when a fix exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<Fix>,
}

impl Difference {
    /// Whether the difference is settled by what `--fix` did.
    pub fn fixed(&self) -> bool {
        matches!(self.fix, Some(Fix::Refunded { .. }))
    }
}

/// How much was compared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Checked {
    pub charges: usize,
    pub refunds: usize,
    pub processor_operations: usize,
}

/// The outcome of one reconciliation.
#[derive(Clone, Debug, Serialize)]
pub struct Reconciliation {
    /// The window: records created in `[since, until)`.
    pub since: DateTime<Utc>,
    pub until: DateTime<Utc>,
    pub checked: Checked,
    /// Pairs left for a later run: a pending record, or one younger than
    /// the in-flight age.
    pub in_flight: usize,
    pub differences: Vec<Difference>,
    /// Differences `--fix` settled.
    pub fixed: usize,
    /// Differences that remain: for a person to look at.
    pub remaining: usize,
}

impl Reconciliation {
    /// The differences by kind, every kind present (0 when none).
    pub fn by_kind(&self) -> BTreeMap<Kind, usize> {
        let mut counts: BTreeMap<Kind, usize> = Kind::ALL.iter().map(|k| (*k, 0)).collect();
        for d in &self.differences {
            *counts.entry(d.kind).or_default() += 1;
        }
        counts
    }

    /// The report for people: one line per difference, then the totals.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "reconciled {} .. {}: {} charges, {} refunds, {} processor operations; {} in flight",
            self.since.to_rfc3339(),
            self.until.to_rfc3339(),
            self.checked.charges,
            self.checked.refunds,
            self.checked.processor_operations,
            self.in_flight,
        );
        if !self.differences.is_empty() {
            let rows: Vec<[String; 5]> = self
                .differences
                .iter()
                .map(|d| {
                    let fix = match &d.fix {
                        None => String::new(),
                        Some(Fix::Refunded {
                            key,
                            amount,
                            currency,
                        }) => format!("; fixed: refunded {amount} {currency} under {key}"),
                        Some(Fix::RefundRefused { key, reason }) => {
                            format!("; not fixed: the refund under {key} was refused ({reason})")
                        }
                        Some(Fix::Failed { key, error }) => {
                            format!("; not fixed: the refund under {key} failed ({error})")
                        }
                    };
                    [
                        d.kind.as_str().to_owned(),
                        d.key.clone(),
                        Side::describe(d.oncepay.as_ref()),
                        Side::describe(d.processor.as_ref()),
                        format!("{}{fix}", d.detail),
                    ]
                })
                .collect();
            let header = ["KIND", "KEY", "ONCEPAY", "PROCESSOR", "DETAIL"].map(str::to_owned);
            let mut widths = [0usize; 4];
            for row in std::iter::once(&header).chain(&rows) {
                for (w, cell) in widths.iter_mut().zip(row.iter()) {
                    *w = (*w).max(cell.chars().count());
                }
            }
            for row in std::iter::once(&header).chain(&rows) {
                let _ = writeln!(
                    out,
                    "{:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {}",
                    row[0],
                    row[1],
                    row[2],
                    row[3],
                    row[4],
                    w0 = widths[0],
                    w1 = widths[1],
                    w2 = widths[2],
                    w3 = widths[3],
                );
            }
        }
        let _ = writeln!(
            out,
            "{} differences, {} fixed, {} remaining",
            self.differences.len(),
            self.fixed,
            self.remaining
        );
        out
    }
}

/// A window of time, in whole seconds (the gateway lists by the second).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub since: DateTime<Utc>,
    pub until: DateTime<Utc>,
}

impl Window {
    /// `[since, until)`, each cut to the whole second; `until` after `since`.
    pub fn new(since: DateTime<Utc>, until: DateTime<Utc>) -> anyhow::Result<Self> {
        let second = |at: DateTime<Utc>| DateTime::from_timestamp(at.timestamp(), 0).unwrap_or(at);
        let (since, until) = (second(since), second(until));
        anyhow::ensure!(
            until > since,
            "the window is empty: --until ({}) must come after --since ({})",
            until.to_rfc3339(),
            since.to_rfc3339()
        );
        Ok(Window { since, until })
    }

    /// The `length` up to the next whole second after `now` (so what was
    /// created this second is in it).
    pub fn last(length: Duration, now: DateTime<Utc>) -> anyhow::Result<Self> {
        let until = DateTime::from_timestamp(now.timestamp() + 1, 0).unwrap_or(now);
        let length = chrono::Duration::from_std(length).context("the window is too long")?;
        Self::new(until - length, until)
    }
}

/// Compares oncepay's database with the processor's ledger.
#[derive(Clone)]
pub struct Reconciler {
    pool: PgPool,
    ledger: LedgerClient,
    processor: Arc<dyn Processor>,
    in_flight: Duration,
}

/// A payment that took money with no succeeded charge, before the fix.
struct Orphan {
    index: usize,
    key: String,
    amount: i64,
    currency: String,
}

/// What a run compares: the ledger's operations by key, oncepay's charges
/// and refunds by id, and how many of each the window held.
struct Records {
    operations: HashMap<String, LedgerOperation>,
    charges: HashMap<String, ChargeRow>,
    refunds: HashMap<String, RefundRow>,
    checked: Checked,
}

/// What a run has found so far.
#[derive(Default)]
struct Findings<'r> {
    differences: Vec<Difference>,
    /// The orphan payments `--fix` would refund, by their difference's index.
    orphans: Vec<Orphan>,
    /// Pairs left for a later run.
    in_flight: usize,
    /// Refunds of reconciliation's that an orphan accounts for.
    claimed: BTreeSet<String>,
    /// Succeeded charges and their payments, to compare refunded sums.
    settled: Vec<(&'r ChargeRow, &'r LedgerOperation)>,
}

impl Reconciler {
    /// `in_flight`: pairs younger than this are left for a later run
    /// (`PROCESSING_TIMEOUT`: until then a request may still be at work).
    pub fn new(
        pool: PgPool,
        ledger: LedgerClient,
        processor: Arc<dyn Processor>,
        in_flight: Duration,
    ) -> Self {
        Reconciler {
            pool,
            ledger,
            processor,
            in_flight,
        }
    }

    /// Compares the records of `window`; with `fix`, refunds each orphan
    /// payment under its [`reconcile_refund_key`].
    pub async fn run(&self, window: Window, fix: bool) -> anyhow::Result<Reconciliation> {
        let now = Utc::now();
        let in_flight_age = chrono::Duration::from_std(self.in_flight).unwrap_or_default();
        let young = |at: DateTime<Utc>| now - at < in_flight_age;

        let records = self.load(&window).await?;
        let mut found = Findings::default();
        self.pair_charges(&records, &young, &mut found).await?;
        self.unowned_payments(&records, &young, &mut found).await?;
        pair_refunds(&records, &young, &mut found);
        compare_refunded_sums(&mut found);

        let mut differences = found.differences;
        if fix {
            for orphan in found.orphans {
                let fixed = self.refund_orphan(&orphan).await;
                differences[orphan.index].fix = Some(fixed);
            }
        }
        let fixed = differences.iter().filter(|d| d.fixed()).count();
        let remaining = differences.len() - fixed;
        Ok(Reconciliation {
            since: window.since,
            until: window.until,
            checked: records.checked,
            in_flight: found.in_flight,
            differences,
            fixed,
            remaining,
        })
    }

    /// The ledger's operations and oncepay's charges and refunds of
    /// `window`, each completed with the other half of its pairs (and the
    /// payments reconciliation's refunds name) where those fell outside it.
    async fn load(&self, window: &Window) -> anyhow::Result<Records> {
        let listed = self.ledger.list(window.since, window.until).await?;
        let checked_operations = listed.len();
        let mut operations: HashMap<String, LedgerOperation> =
            listed.into_iter().map(|o| (o.key.clone(), o)).collect();
        let (charges, refunds) =
            store::records(&self.pool, Pick::CreatedIn(window.since, window.until)).await?;
        let mut charges: HashMap<String, ChargeRow> =
            charges.into_iter().map(|c| (c.id.clone(), c)).collect();
        let mut refunds: HashMap<String, RefundRow> =
            refunds.into_iter().map(|r| (r.id.clone(), r)).collect();
        let checked = Checked {
            charges: charges.len(),
            refunds: refunds.len(),
            processor_operations: checked_operations,
        };

        // The payment a refund of reconciliation's names, and the one it
        // claims to give back, when they fell outside the window.
        let claimed_payments: BTreeSet<String> = operations
            .values()
            .filter(|o| o.kind == "refund")
            .filter_map(|o| {
                let named = o.key.strip_prefix(RECONCILE_REFUND_PREFIX)?;
                Some([Some(named.to_owned()), o.payment.clone()])
            })
            .flatten()
            .flatten()
            .filter(|key| !operations.contains_key(key))
            .collect();
        for key in claimed_payments {
            if let Some(operation) = self.ledger.find(&key).await? {
                operations.insert(key, operation);
            }
        }

        // The other half of each pair, when it fell outside the window.
        let outside = |prefix: &str, known: &dyn Fn(&str) -> bool| -> Vec<String> {
            operations
                .keys()
                .filter_map(|k| k.strip_prefix(prefix))
                .filter(|id| !known(id))
                .map(str::to_owned)
                .collect()
        };
        let charge_ids = outside("auth:", &|id| charges.contains_key(id));
        let refund_ids = outside("refund:", &|id| refunds.contains_key(id));
        let (more_charges, more_refunds) =
            store::records(&self.pool, Pick::Ids(&charge_ids, &refund_ids)).await?;
        for c in more_charges {
            charges.insert(c.id.clone(), c);
        }
        for r in more_refunds {
            refunds.insert(r.id.clone(), r);
        }
        let unlisted: Vec<String> = charges
            .keys()
            .map(|id| authorization_key(id))
            .chain(refunds.keys().map(|id| refund_key(id)))
            .filter(|key| !operations.contains_key(key))
            .collect();
        for key in unlisted {
            if let Some(operation) = self.ledger.find(&key).await? {
                operations.insert(key, operation);
            }
        }
        Ok(Records {
            operations,
            charges,
            refunds,
            checked,
        })
    }

    /// Each charge with the payment under its key: a succeeded charge
    /// without its payment, a payment that differs, and money moved for a
    /// charge that did not succeed (an orphan payment).
    async fn pair_charges<'r>(
        &self,
        records: &'r Records,
        young: &impl Fn(DateTime<Utc>) -> bool,
        found: &mut Findings<'r>,
    ) -> anyhow::Result<()> {
        let Records {
            operations,
            charges,
            ..
        } = records;
        let mut paired: BTreeSet<String> = charges.keys().cloned().collect();
        paired.extend(
            operations
                .values()
                .filter(|o| o.kind != "refund")
                .filter_map(|o| o.key.strip_prefix("auth:"))
                .map(str::to_owned),
        );
        for id in &paired {
            let key = authorization_key(id);
            let charge = charges.get(id);
            let operation = operations.get(&key).filter(|o| o.kind != "refund");
            if charge.is_some_and(|c| c.status == ChargeStatus::Pending || young(c.created_at))
                || operation.is_some_and(|o| young(o.created))
            {
                found.in_flight += 1;
                continue;
            }
            let payment = operation.filter(|o| o.moved_money());
            let oncepay = charge.map(Side::charge);
            let processor = operation.map(Side::processor);
            let difference = |kind, detail: String| Difference {
                kind,
                key: key.clone(),
                charge: Some(id.clone()),
                refund: None,
                oncepay: oncepay.clone(),
                processor: processor.clone(),
                detail,
                fix: None,
            };
            match (charge, payment) {
                (Some(c), Some(p))
                    if c.status == ChargeStatus::Succeeded
                        && (p.amount != Some(c.amount)
                            || p.currency.as_deref() != Some(&c.currency)) =>
                {
                    found.settled.push((c, p));
                    found.differences.push(difference(
                        Kind::PaymentMismatch,
                        format!(
                            "the charge is {} {}, the payment {}",
                            c.amount,
                            c.currency,
                            Side::describe(processor.as_ref())
                        ),
                    ));
                }
                (Some(c), Some(p)) if c.status == ChargeStatus::Succeeded => {
                    found.settled.push((c, p))
                }
                (Some(c), None) if c.status == ChargeStatus::Succeeded => {
                    found.differences.push(difference(
                        Kind::MissingPayment,
                        match operation {
                            None => "the charge succeeded; the processor has nothing under its key"
                                .to_owned(),
                            Some(o) => format!(
                                "the charge succeeded; the processor's record is {}",
                                o.outcome
                            ),
                        },
                    ));
                }
                (charge, Some(p)) => {
                    if let Some(orphan) = self
                        .orphan(
                            p,
                            operations,
                            &mut found.claimed,
                            found.differences.len(),
                            || {
                                difference(
                                    Kind::OrphanPayment,
                                    match charge {
                                        None => {
                                            "money moved; oncepay has no such charge".to_owned()
                                        }
                                        Some(c) => {
                                            format!("money moved; the charge {}", c.status.as_str())
                                        }
                                    },
                                )
                            },
                        )
                        .await?
                    {
                        found.differences.push(orphan.0);
                        found.orphans.extend(orphan.1);
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Payments under keys that name no charge of oncepay's: orphans.
    async fn unowned_payments(
        &self,
        records: &Records,
        young: &impl Fn(DateTime<Utc>) -> bool,
        found: &mut Findings<'_>,
    ) -> anyhow::Result<()> {
        let unowned = records
            .operations
            .values()
            .filter(|o| o.kind != "refund" && !o.key.starts_with("auth:") && o.moved_money());
        for o in unowned {
            if young(o.created) {
                found.in_flight += 1;
                continue;
            }
            let difference = || Difference {
                kind: Kind::OrphanPayment,
                key: o.key.clone(),
                charge: None,
                refund: None,
                oncepay: None,
                processor: Some(Side::processor(o)),
                detail: "money moved under a key that names no charge".to_owned(),
                fix: None,
            };
            if let Some(orphan) = self
                .orphan(
                    o,
                    &records.operations,
                    &mut found.claimed,
                    found.differences.len(),
                    difference,
                )
                .await?
            {
                found.differences.push(orphan.0);
                found.orphans.extend(orphan.1);
            }
        }
        Ok(())
    }

    /// An orphan payment's difference (made by `difference`), and the fix
    /// it can take; `None` when a refund of reconciliation's already gave
    /// it back, or refunds gave all of it back.
    async fn orphan(
        &self,
        payment: &LedgerOperation,
        operations: &HashMap<String, LedgerOperation>,
        claimed: &mut BTreeSet<String>,
        index: usize,
        difference: impl FnOnce() -> Difference,
    ) -> anyhow::Result<Option<(Difference, Option<Orphan>)>> {
        let key = reconcile_refund_key(&payment.key);
        let compensation = match operations.get(&key) {
            Some(o) => Some(o.clone()),
            None => self.ledger.find(&key).await?,
        };
        let left = payment.amount.unwrap_or(0) - payment.amount_refunded;
        let mut difference = difference();
        if compensation.is_some() {
            claimed.insert(key.clone());
        }
        match compensation {
            Some(o) if o.refunded() => match compensates(&o, payment) {
                Ok(()) => Ok(None),
                Err(why) => {
                    difference.detail = format!(
                        "{}; reconciliation's refund under {key} does not give it back: {why}",
                        difference.detail
                    );
                    Ok(Some((difference, None)))
                }
            },
            Some(o) => {
                difference.detail = format!(
                    "{}; reconciliation's refund under {key} was {}",
                    difference.detail, o.outcome
                );
                difference.fix = Some(Fix::RefundRefused {
                    key,
                    reason: o.outcome,
                });
                Ok(Some((difference, None)))
            }
            None if left <= 0 => Ok(None),
            None => Ok(Some((
                difference,
                Some(Orphan {
                    index,
                    key: payment.key.clone(),
                    amount: left,
                    currency: payment.currency.clone().unwrap_or_default(),
                }),
            ))),
        }
    }

    /// Refunds what is left of an orphan payment, under the key derived
    /// from it: repeated, it finds the first refund and moves nothing more.
    async fn refund_orphan(&self, orphan: &Orphan) -> Fix {
        let key = reconcile_refund_key(&orphan.key);
        let outcome = self
            .processor
            .refund(Refund {
                processor_key: &key,
                payment_key: &orphan.key,
                amount: orphan.amount,
                currency: &orphan.currency,
                fault: None,
            })
            .await;
        match outcome {
            Ok(RefundOutcome::Refunded) => {
                tracing::warn!(payment = %orphan.key, refund = %key, amount = orphan.amount, currency = %orphan.currency, "reconciliation refunded an orphan payment");
                Fix::Refunded {
                    key,
                    amount: orphan.amount,
                    currency: orphan.currency.clone(),
                }
            }
            Ok(RefundOutcome::Failed { reason }) => {
                tracing::warn!(payment = %orphan.key, refund = %key, %reason, "the refund of an orphan payment was refused");
                Fix::RefundRefused { key, reason }
            }
            Err(e) => {
                let error = format!("{:#}", anyhow::Error::new(e));
                tracing::warn!(payment = %orphan.key, refund = %key, %error, "the refund of an orphan payment failed");
                Fix::Failed { key, error }
            }
        }
    }
}

/// Each refund with the processor's refund under its key, and money given
/// back under a key that names no refund (unless it is reconciliation's
/// own, told with the orphan it gave back).
fn pair_refunds(
    records: &Records,
    young: &impl Fn(DateTime<Utc>) -> bool,
    found: &mut Findings<'_>,
) {
    let Records {
        operations,
        refunds,
        ..
    } = records;
    let mut paired: BTreeSet<String> = refunds.keys().cloned().collect();
    for o in operations.values().filter(|o| o.kind == "refund") {
        if let Some(id) = o.key.strip_prefix("refund:") {
            paired.insert(id.to_owned());
        } else if found.claimed.contains(&o.key) {
            // Reconciliation's own, told with the orphan it gave back.
        } else if o.refunded() {
            if young(o.created) {
                found.in_flight += 1;
                continue;
            }
            let detail = if o.key.starts_with(RECONCILE_REFUND_PREFIX) {
                "money given back under reconciliation's key, for no orphan payment"
            } else {
                "money given back under a key that names no refund"
            };
            found.differences.push(Difference {
                kind: Kind::OrphanRefund,
                key: o.key.clone(),
                charge: charge_of(o),
                refund: None,
                oncepay: None,
                processor: Some(Side::processor(o)),
                detail: detail.to_owned(),
                fix: None,
            });
        }
    }
    for id in &paired {
        let key = refund_key(id);
        let refund = refunds.get(id);
        let operation = operations.get(&key).filter(|o| o.kind == "refund");
        if refund.is_some_and(|r| r.status == RefundStatus::Pending || young(r.created_at))
            || operation.is_some_and(|o| young(o.created))
        {
            found.in_flight += 1;
            continue;
        }
        let kind_detail = match (refund, operation) {
            (Some(r), None) if r.status == RefundStatus::Succeeded => Some((
                Kind::MissingProcessorRefund,
                "the refund succeeded; the processor has nothing under its key".to_owned(),
            )),
            (None, Some(o)) if o.refunded() => Some((
                Kind::OrphanRefund,
                "money given back; oncepay has no such refund".to_owned(),
            )),
            (Some(r), Some(o)) => {
                let mut what = Vec::new();
                if (r.status == RefundStatus::Succeeded) != o.refunded() {
                    what.push(format!(
                        "the refund {}, the processor's {}",
                        r.status.as_str(),
                        o.outcome
                    ));
                }
                if o.amount != Some(r.amount) {
                    what.push(format!(
                        "amount {} here, {} there",
                        r.amount,
                        o.amount.unwrap_or(0)
                    ));
                }
                if o.currency.as_deref() != Some(&r.currency) {
                    what.push(format!(
                        "currency {} here, {} there",
                        r.currency,
                        o.currency.as_deref().unwrap_or("none")
                    ));
                }
                let payment = authorization_key(&r.charge_id);
                if o.payment.as_deref() != Some(&payment) {
                    what.push(format!(
                        "payment {payment} here, {} there",
                        o.payment.as_deref().unwrap_or("none")
                    ));
                }
                (!what.is_empty()).then(|| (Kind::RefundMismatch, what.join("; ")))
            }
            _ => None,
        };
        if let Some((kind, detail)) = kind_detail {
            found.differences.push(Difference {
                kind,
                key,
                charge: refund
                    .map(|r| r.charge_id.clone())
                    .or_else(|| operation.and_then(charge_of)),
                refund: Some(id.clone()),
                oncepay: refund.map(Side::refund),
                processor: operation.map(Side::processor),
                detail,
                fix: None,
            });
        }
    }
}

/// Refunded sums, for the charges no refund's difference names already:
/// what is left is a refund the pairs did not show. A charge whose refund
/// is pending (counted in flight with the refund) or whose capture is (the
/// processor may have given the uncaptured part back already) is left for
/// a later run.
fn compare_refunded_sums(found: &mut Findings<'_>) {
    let named: BTreeSet<String> = found
        .differences
        .iter()
        .filter_map(|d| d.charge.clone())
        .collect();
    for (c, p) in std::mem::take(&mut found.settled) {
        if c.capturing {
            found.in_flight += 1;
            continue;
        }
        if c.refund_pending || c.amount_refunded == p.amount_refunded || named.contains(&c.id) {
            continue;
        }
        found.differences.push(Difference {
            kind: Kind::RefundedAmountMismatch,
            key: p.key.clone(),
            charge: Some(c.id.clone()),
            refund: None,
            oncepay: Some(Side::charge(c)),
            processor: Some(Side::processor(p)),
            detail: format!(
                "refunds gave back {} here, {} at the processor",
                c.amount_refunded, p.amount_refunded
            ),
            fix: None,
        });
    }
}

/// Whether the refund `refund` made under `payment`'s
/// [`reconcile_refund_key`] gives that orphan back, and nothing else: it
/// refunds that payment, in its currency, and the payment's refunds (it
/// among them) gave back exactly what it took. Why not, otherwise.
pub fn compensates(refund: &LedgerOperation, payment: &LedgerOperation) -> Result<(), String> {
    if refund.payment.as_deref() != Some(payment.key.as_str()) {
        return Err(format!(
            "it refunds {}",
            refund.payment.as_deref().unwrap_or("no payment")
        ));
    }
    if refund.currency != payment.currency {
        return Err(format!(
            "it is in {}",
            refund.currency.as_deref().unwrap_or("no currency")
        ));
    }
    let paid = payment.amount.unwrap_or(0);
    if payment.amount_refunded != paid {
        return Err(format!(
            "the payment's refunds gave back {} of {paid}",
            payment.amount_refunded
        ));
    }
    Ok(())
}

/// The charge a processor refund's payment key names, if it names one.
fn charge_of(refund: &LedgerOperation) -> Option<String> {
    refund
        .payment
        .as_deref()
        .and_then(|p| p.strip_prefix("auth:"))
        .map(str::to_owned)
}
