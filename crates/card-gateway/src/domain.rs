//! What the gateway does with an account's money: authorize, void, refund,
//! look up and list, each idempotent on its key within the account, each
//! seeing that account's operations only, and each deciding its outcome
//! from the card's test token ([`test_cards`]). No HTTP here: the
//! handlers in [`super::http`] authenticate the caller ([`super::accounts`]),
//! parse, call one of these and render.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::store::{self, NewAuthorization, NewCapture, NewRefund, Operation};
use test_cards::TestToken;

/// The most a list page holds.
pub const MAX_PAGE: i64 = 1000;

/// Why the gateway refused a request. Every refusal records nothing.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// A parameter is missing or malformed.
    #[error("{message}")]
    Invalid {
        code: &'static str,
        param: Option<&'static str>,
        message: String,
    },
    /// The key holds an operation made with other parameters.
    #[error("the key {0:?} was used with other parameters")]
    KeyReused(String),
    /// No operation (or no payment to refund) under that key.
    #[error("no {what} under the key {key:?}")]
    NotFound { what: &'static str, key: String },
    /// The payment did not move money (declined or voided), or is no payment.
    #[error("the operation under {0:?} is not a payment that went through")]
    NotRefundable(String),
    /// The payment cannot be captured: it was captured already (at once,
    /// or under another key), or released.
    #[error("the payment under {key:?} cannot be captured: {why}")]
    NotCapturable { key: String, why: &'static str },
    /// The refund would give back more than the payment took.
    #[error("the refund of {amount} is more than the payment's {paid}")]
    AmountTooLarge { amount: i64, paid: i64 },
    /// The card network cannot be reached: nothing was recorded.
    #[error("the card network is unavailable; nothing was recorded")]
    Unavailable,
    /// The ledger failed mid-call: whether anything was recorded is unknown.
    #[error("the ledger failed")]
    Database(#[from] sqlx::Error),
}

/// An operation as the ledger holds it after a call, and whether this call
/// wrote it (`fresh`) or found it (a repeat, or a void that came first).
#[derive(Debug)]
pub struct Recorded {
    pub operation: Operation,
    pub fresh: bool,
    /// The card's answers never arrive (`tok_processorTimeoutAfterCapture`):
    /// the outcome is recorded, and the caller must not be told.
    pub answer_lost: bool,
}

/// A request to authorize a payment, as received.
#[derive(Debug, Clone)]
pub struct Authorize {
    pub key: String,
    pub amount: i64,
    pub currency: String,
    pub source: String,
    /// `false`: hold the amount until a capture takes it.
    pub capture: bool,
}

/// A request to capture an authorization made with `capture: false`.
#[derive(Debug, Clone)]
pub struct CapturePayment {
    pub key: String,
    pub payment: String,
    pub amount: i64,
    pub currency: String,
}

/// A request to refund part or all of a payment, as received.
#[derive(Debug, Clone)]
pub struct RefundPayment {
    pub key: String,
    pub payment: String,
    pub amount: i64,
    pub currency: String,
}

/// The ledger, and how slow the card network is.
#[derive(Clone, Debug)]
pub struct Ledger {
    pub pool: PgPool,
    pub latency: Duration,
}

impl Ledger {
    /// Authorizes a payment under `request.key`, once: a repeat with the
    /// same parameters returns the first outcome and moves no more money; a
    /// void recorded first stands (no money can move under the key any
    /// more); other parameters under the key are refused.
    pub async fn authorize(
        &self,
        account: &str,
        request: &Authorize,
    ) -> Result<Recorded, GatewayError> {
        check_request(&request.key, request.amount, &request.currency)?;
        let token = TestToken::parse(&request.source).ok_or_else(|| GatewayError::Invalid {
            code: "invalid_source",
            param: Some("source"),
            message: format!("No such card token: {:?}.", request.source),
        })?;
        if token == TestToken::ProcessorUnavailable {
            return Err(GatewayError::Unavailable);
        }
        self.wait().await;
        let (outcome, decline_code) = match token.decline() {
            None => ("succeeded", None),
            Some(decline) => ("declined", Some(decline.code)),
        };
        let inserted = store::insert_authorization(
            &self.pool,
            account,
            &NewAuthorization {
                key: &request.key,
                outcome,
                amount: request.amount,
                currency: &request.currency,
                source: token.as_str(),
                decline_code,
                capture_later: !request.capture,
            },
        )
        .await?;
        // A new key costs one statement; a repeat reads what stands.
        let fresh = inserted.is_some();
        let operation = match inserted {
            Some(operation) => operation,
            None => self.recorded(account, &request.key).await?,
        };
        let same = operation.kind == "void"
            || (operation.kind == "authorization"
                && operation.amount == Some(request.amount)
                && operation.currency.as_deref() == Some(request.currency.as_str())
                && operation.source.as_deref() == Some(token.as_str())
                && operation.capture_later != request.capture);
        if !same {
            return Err(GatewayError::KeyReused(request.key.clone()));
        }
        if fresh {
            tracing::info!(account, key = %operation.key, outcome = %operation.outcome, amount = request.amount, "authorization recorded");
        }
        Ok(Recorded {
            answer_lost: token == TestToken::ProcessorTimeoutAfterCapture,
            operation,
            fresh,
        })
    }

    /// Cancels whatever was asked under `key` when its answer was lost (a
    /// technical cancel): records a void unless the key already holds an
    /// outcome, and returns what stands. After it, no authorization under
    /// the key can move money.
    pub async fn void(&self, account: &str, key: &str) -> Result<Recorded, GatewayError> {
        check_key(key)?;
        let fresh = store::insert_void(&self.pool, account, key).await?;
        let operation = self.recorded(account, key).await?;
        if fresh {
            tracing::info!(account, key = %key, "void recorded");
        }
        Ok(Recorded {
            operation,
            fresh,
            answer_lost: false,
        })
    }

    /// Refunds part or all of the account's payment `request.payment`, once
    /// under `request.key`; a refund larger than the payment is refused, and
    /// another account's payment is not found. A `tok_refundFail` card's
    /// issuer refuses the first refund of a payment, for good: that refusal
    /// is recorded, and a repeat gets it again.
    pub async fn refund(
        &self,
        account: &str,
        request: &RefundPayment,
    ) -> Result<Recorded, GatewayError> {
        check_request(&request.key, request.amount, &request.currency)?;
        if request.payment.is_empty() {
            return Err(GatewayError::Invalid {
                code: "parameter_missing",
                param: Some("payment"),
                message: "Missing required param: payment.".into(),
            });
        }
        self.wait().await;
        if let Some(existing) = store::find(&self.pool, account, &request.key).await? {
            return repeated_refund(request, existing);
        }
        let mut tx = self.pool.begin().await?;
        let payment = locked_payment(&mut tx, account, &request.payment).await?;
        if payment.kind != "authorization" || payment.outcome != "succeeded" {
            return Err(GatewayError::NotRefundable(request.payment.clone()));
        }
        if payment.currency.as_deref() != Some(request.currency.as_str()) {
            return Err(GatewayError::Invalid {
                code: "currency_mismatch",
                param: Some("currency"),
                message: format!(
                    "The payment is in {}, not {}.",
                    payment.currency.unwrap_or_default(),
                    request.currency
                ),
            });
        }
        // Each refund is checked against the payment, not against the sum
        // of its refunds: keeping that sum is the merchant's books (see
        // docs/decisions.md), which the workshop's naive refund gets wrong.
        // A payment captured later paid what its capture took; one not
        // captured yet is released by a refund of all it holds.
        let paid = match (payment.capture_later, payment.amount_captured) {
            (true, Some(captured)) => captured,
            (true, None) if request.amount != payment.amount.unwrap_or(0) => {
                return Err(GatewayError::Invalid {
                    code: "partial_release",
                    param: Some("amount"),
                    message: "An uncaptured payment is released whole: refund all it holds.".into(),
                });
            }
            _ => payment.amount.unwrap_or(0),
        };
        if request.amount > paid {
            return Err(GatewayError::AmountTooLarge {
                amount: request.amount,
                paid,
            });
        }
        let refused = payment.source.as_deref() == Some(TestToken::RefundFail.as_str())
            && store::refund_attempts(&mut tx, account, &request.payment).await? == 0;
        let outcome = if refused { "refund_failed" } else { "refunded" };
        let fresh = store::insert_refund(
            &mut tx,
            account,
            &NewRefund {
                key: &request.key,
                payment_key: &request.payment,
                outcome,
                amount: request.amount,
                currency: &request.currency,
            },
        )
        .await?;
        tx.commit().await?;
        let operation = self.recorded(account, &request.key).await?;
        if !fresh {
            // A racing request under the same key wrote first.
            return repeated_refund(request, operation);
        }
        tracing::info!(account, key = %request.key, payment = %request.payment, outcome, amount = request.amount, "refund recorded");
        Ok(Recorded {
            operation,
            fresh,
            answer_lost: false,
        })
    }

    /// Captures all or part of the account's payment `request.payment`,
    /// authorized with `capture: false`, once under `request.key`: a repeat
    /// returns the first capture. A payment is captured at most once,
    /// whatever the key, and not after a refund released it; the part not
    /// captured goes back to the card.
    pub async fn capture(
        &self,
        account: &str,
        request: &CapturePayment,
    ) -> Result<Recorded, GatewayError> {
        check_request(&request.key, request.amount, &request.currency)?;
        self.wait().await;
        if let Some(existing) = store::find(&self.pool, account, &request.key).await? {
            return repeated_capture(request, existing);
        }
        let mut tx = self.pool.begin().await?;
        let payment = locked_payment(&mut tx, account, &request.payment).await?;
        check_capturable(&payment, request)?;
        let fresh = store::insert_capture(
            &mut tx,
            account,
            &NewCapture {
                key: &request.key,
                payment_key: &request.payment,
                amount: request.amount,
                currency: &request.currency,
            },
        )
        .await?;
        tx.commit().await?;
        let operation = self.recorded(account, &request.key).await?;
        if !fresh {
            // A racing request under the same key wrote first.
            return repeated_capture(request, operation);
        }
        tracing::info!(account, key = %request.key, payment = %request.payment, amount = request.amount, "capture recorded");
        Ok(Recorded {
            operation,
            fresh,
            answer_lost: false,
        })
    }

    /// The account's operation under `key`.
    pub async fn lookup(&self, account: &str, key: &str) -> Result<Operation, GatewayError> {
        store::find(&self.pool, account, key)
            .await?
            .ok_or_else(|| GatewayError::NotFound {
                what: "operation",
                key: key.to_owned(),
            })
    }

    /// A page of the account's ledger: its operations created in `[from, until)`, oldest
    /// first, after the operation `after` (the last key of the previous
    /// page); whether more follow.
    pub async fn list(
        &self,
        account: &str,
        from: Option<DateTime<Utc>>,
        until: Option<DateTime<Utc>>,
        after: Option<&str>,
        limit: i64,
    ) -> Result<(Vec<Operation>, bool), GatewayError> {
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(GatewayError::Invalid {
                code: "parameter_invalid_integer",
                param: Some("limit"),
                message: format!("limit must be from 1 to {MAX_PAGE}."),
            });
        }
        let after =
            match after {
                Some(key) => Some(store::find(&self.pool, account, key).await?.ok_or_else(
                    || GatewayError::Invalid {
                        code: "resource_missing",
                        param: Some("starting_after"),
                        message: format!("No operation under the key {key:?} to start after."),
                    },
                )?),
                None => None,
            };
        let mut page =
            store::list(&self.pool, account, from, until, after.as_ref(), limit + 1).await?;
        let more = page.len() as i64 > limit;
        page.truncate(limit as usize);
        Ok((page, more))
    }

    async fn recorded(&self, account: &str, key: &str) -> Result<Operation, GatewayError> {
        // Written by this call or an earlier one; it never goes away.
        store::find(&self.pool, account, key)
            .await?
            .ok_or_else(|| GatewayError::Database(sqlx::Error::RowNotFound))
    }

    async fn wait(&self) {
        if !self.latency.is_zero() {
            tokio::time::sleep(self.latency).await;
        }
    }
}

/// Whether `payment`, locked, can be captured as `request` asks.
/// The account's payment `key`, locked until the transaction ends (see
/// [`store::lock_payment`]); not found when the account has none.
async fn locked_payment(
    tx: &mut sqlx::PgConnection,
    account: &str,
    key: &str,
) -> Result<Operation, GatewayError> {
    store::lock_payment(tx, account, key)
        .await?
        .ok_or_else(|| GatewayError::NotFound {
            what: "payment",
            key: key.to_owned(),
        })
}

fn check_capturable(payment: &Operation, request: &CapturePayment) -> Result<(), GatewayError> {
    let not = |why| GatewayError::NotCapturable {
        key: request.payment.clone(),
        why,
    };
    if payment.kind != "authorization" || payment.outcome != "succeeded" {
        return Err(GatewayError::NotRefundable(request.payment.clone()));
    }
    if !payment.capture_later || payment.amount_captured.is_some() {
        return Err(not("it was captured already"));
    }
    if payment.amount_refunded > 0 {
        return Err(not("it was released"));
    }
    let held = payment.amount.unwrap_or(0);
    if request.amount > held {
        return Err(GatewayError::AmountTooLarge {
            amount: request.amount,
            paid: held,
        });
    }
    Ok(())
}

/// A refund or a capture (`kind`) of `payment` asked again under `key`: the
/// operation recorded first, if it is the same one; another is a reused key.
fn repeated(
    kind: &str,
    key: &str,
    payment: &str,
    amount: i64,
    currency: &str,
    existing: Operation,
) -> Result<Recorded, GatewayError> {
    let same = existing.kind == kind
        && existing.payment_key.as_deref() == Some(payment)
        && existing.amount == Some(amount)
        && existing.currency.as_deref() == Some(currency);
    if !same {
        return Err(GatewayError::KeyReused(key.to_owned()));
    }
    Ok(Recorded {
        operation: existing,
        fresh: false,
        answer_lost: false,
    })
}

/// A refund asked again under its key ([`repeated`]).
fn repeated_refund(request: &RefundPayment, existing: Operation) -> Result<Recorded, GatewayError> {
    let RefundPayment {
        key,
        payment,
        amount,
        currency,
    } = request;
    repeated("refund", key, payment, *amount, currency, existing)
}

/// A capture asked again under its key ([`repeated`]).
fn repeated_capture(
    request: &CapturePayment,
    existing: Operation,
) -> Result<Recorded, GatewayError> {
    let CapturePayment {
        key,
        payment,
        amount,
        currency,
    } = request;
    repeated("capture", key, payment, *amount, currency, existing)
}

/// The decline message of a recorded decline `code`: the message of the
/// card's own decline, from its token (`source`), since several cards share
/// a code (`card_declined`); by the code alone when the token is unknown.
pub fn decline_message(source: Option<&str>, code: &str) -> &'static str {
    source
        .and_then(TestToken::parse)
        .and_then(TestToken::decline)
        .map_or_else(|| TestToken::decline_message(code), |d| d.message)
}

/// The checks every keyed request passes first: its key, its amount and
/// its currency, in that order.
fn check_request(key: &str, amount: i64, currency: &str) -> Result<(), GatewayError> {
    check_key(key)?;
    check_amount(amount)?;
    check_currency(currency)
}

fn check_key(key: &str) -> Result<(), GatewayError> {
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(GatewayError::Invalid {
            code: "idempotency_key_invalid",
            param: Some("Idempotency-Key"),
            message: "A key is 1 to 255 visible ASCII characters.".into(),
        });
    }
    Ok(())
}

fn check_amount(amount: i64) -> Result<(), GatewayError> {
    if !(1..=99_999_999).contains(&amount) {
        return Err(GatewayError::Invalid {
            code: "amount_invalid",
            param: Some("amount"),
            message: "amount must be a whole number of minor units from 1 to 99999999.".into(),
        });
    }
    Ok(())
}

fn check_currency(currency: &str) -> Result<(), GatewayError> {
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_lowercase()) {
        return Err(GatewayError::Invalid {
            code: "currency_invalid",
            param: Some("currency"),
            message: "currency must be three lowercase letters, like usd.".into(),
        });
    }
    Ok(())
}
