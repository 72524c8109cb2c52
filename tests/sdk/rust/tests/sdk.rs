//! async-stripe, a strictly typed Stripe client, against a real oncepay:
//! every answer deserialized into the SDK's generated types (a field they
//! require that is missing, or of another type, fails the call), every
//! error as the SDK's typed error, and what it did counted in the database.
//!
//! Run by scripts/test; alone (from the repository's root):
//!   cargo build --bin oncepay &&
//!   CARGO_TARGET_DIR=$PWD/target cargo test --manifest-path tests/sdk/rust/Cargo.toml -- --test-threads=1
//!
//! The server is this binary's own (see src/lib.rs); its log is
//! target/sdk/rust-server.log.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::TryStreamExt;
use oncepay_sdk_rust::receiver::Receiver;
use oncepay_sdk_rust::{Oncepay, http, oncepay, psql, random_hex, root, tagged};
use stripe::{
    ApiErrors, ApiErrorsType, Client, IdempotencyKey, PaginationExt, RequestStrategy, StripeError,
    StripeRequest,
};
use stripe_core::balance::RetrieveForMyAccountBalance;
use stripe_core::charge::{CaptureCharge, CreateCharge, ListCharge, RetrieveCharge, UpdateCharge};
use stripe_core::event::{ListEvent, RetrieveEvent};
use stripe_core::refund::{CreateRefund, ListRefund, RetrieveRefund, UpdateRefund};
use stripe_misc::webhook_endpoint::{
    CreateWebhookEndpoint, CreateWebhookEndpointEnabledEvents, DeleteWebhookEndpoint,
    ListWebhookEndpoint, RetrieveWebhookEndpoint, UpdateWebhookEndpoint,
    UpdateWebhookEndpointEnabledEvents,
};
use stripe_shared::{Charge, ChargeStatus, Refund};
use stripe_types::{Currency, RangeQueryTs};
use stripe_webhook::{EventObject, Webhook, WebhookError};

// ---------------------------------------------------------------------------
// Helpers

/// A typed charge of AMOUNT usd from SOURCE, tagged: `(tag, request)`.
fn charge_request(amount: i64, source: &str) -> (String, CreateCharge) {
    let (tag, metadata) = tagged();
    let request = CreateCharge::new()
        .amount(amount)
        .currency(Currency::USD)
        .source(source)
        .metadata(metadata);
    (tag, request)
}

/// `GET /v1/charges/{id}` of the charge tagged TAG, for a failure message.
fn raw_charge_path(server: &Oncepay, tag: &str) -> String {
    let id = server.sql(&format!(
        "SELECT id FROM charges WHERE metadata->>'test' = '{tag}' LIMIT 1"
    ));
    format!("/v1/charges/{id}")
}

/// Creates a charge of AMOUNT from SOURCE that must succeed: `(tag, charge)`.
async fn paid_charge(client: &Client, amount: i64, source: &str) -> (String, Charge) {
    let server = oncepay();
    let (tag, request) = charge_request(amount, source);
    let result = request.send(client).await;
    let charge = server.typed("the created charge", &raw_charge_path(server, &tag), result);
    (tag, charge)
}

async fn retrieve_charge(client: &Client, id: &str) -> Charge {
    let result = RetrieveCharge::new(id).send(client).await;
    oncepay().typed("the retrieved charge", &format!("/v1/charges/{id}"), result)
}

/// The SDK's typed API error of RESULT, with its HTTP status; a panic if
/// the call succeeded or failed otherwise.
fn api_error<T: std::fmt::Debug>(result: Result<T, StripeError>) -> (ApiErrors, u16) {
    match result {
        Err(StripeError::Stripe(error, status)) => {
            eprintln!("the SDK's typed error: {status} {error:?}");
            (*error, status)
        }
        other => panic!("expected the SDK's typed API error, got {other:?}"),
    }
}

fn code(error: &ApiErrors) -> Option<&str> {
    error.code.as_ref().map(|c| c.as_str())
}

/// The same object twice: the SDK's types implement Debug, not PartialEq.
fn assert_same<T: std::fmt::Debug>(a: &T, b: &T, what: &str) {
    assert_eq!(format!("{a:?}"), format!("{b:?}"), "{what}");
}

fn idempotent(key: &str) -> RequestStrategy {
    RequestStrategy::Idempotent(IdempotencyKey::new(key).expect("a valid key"))
}

// ---------------------------------------------------------------------------
// One charge per test token

/// How a test token's charge is declined, as crates/test-cards/src/lib.rs and
/// docs/api.md say (Stripe's documented codes for the token).
#[derive(Clone, Copy, Debug)]
struct Decline {
    code: &'static str,
    /// `None` for the declines with a code of their own.
    decline_code: Option<&'static str>,
    /// The card's field at fault, where Stripe names one.
    param: Option<&'static str>,
    /// `outcome.type`: `issuer_declined`, or `blocked` for fraud.
    outcome: &'static str,
    /// `outcome.reason`: the issuer's reason, or `highest_risk_level`.
    reason: &'static str,
    risk_level: &'static str,
    last4: &'static str,
}

/// Declined by the issuer for `reason`: `card_declined`, with the reason as
/// its `decline_code`.
const fn declined(reason: &'static str, last4: &'static str) -> Expect {
    Expect::Declined(Decline {
        code: "card_declined",
        decline_code: Some(reason),
        param: None,
        outcome: "issuer_declined",
        reason,
        risk_level: "normal",
        last4,
    })
}

/// Declined with a code of its own: no `decline_code`, perhaps a `param`.
const fn declined_as(
    code: &'static str,
    param: Option<&'static str>,
    last4: &'static str,
) -> Expect {
    Expect::Declined(Decline {
        code,
        decline_code: None,
        param,
        outcome: "issuer_declined",
        reason: code,
        risk_level: "normal",
        last4,
    })
}

/// What a test token does.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// The charge succeeds, on this card: (brand, last4, funding).
    Paid(&'static str, &'static str, &'static str),
    /// The charge succeeds at an elevated risk, placed in review, on the
    /// Visa card with these last four digits.
    PaidInReview(&'static str),
    /// A decline, on a Visa card.
    Declined(Decline),
    /// The processor takes the money and the call times out: the SDK's
    /// retries with one key end in the one succeeded charge.
    OutcomeUnknownThenPaid,
    /// The processor is unreachable: an API error, and no money moves.
    ProcessorUnavailable,
}

async fn charge_with_token(token: &str, expect: Expect) {
    let server = oncepay();
    let client = server.client();
    match expect {
        Expect::Paid(brand, last4, funding) => {
            let (tag, charge) = paid_charge(&client, 2000, token).await;
            assert!(charge.id.as_str().starts_with("ch_"), "{:?}", charge.id);
            assert_eq!(charge.status, ChargeStatus::Succeeded);
            assert!(charge.paid && charge.captured && !charge.refunded);
            assert_eq!(
                (
                    charge.amount,
                    charge.amount_captured,
                    charge.amount_refunded
                ),
                (2000, 2000, 0)
            );
            assert_eq!(charge.currency, Currency::USD);
            assert!(!charge.livemode);
            assert_eq!(charge.metadata.get("test"), Some(&tag));
            let outcome = charge.outcome.as_ref().expect("an outcome");
            assert_eq!(outcome.type_, "authorized");
            assert_eq!(outcome.risk_level.as_deref(), Some("normal"));
            assert_eq!(
                outcome.network_status.as_deref(),
                Some("approved_by_network")
            );
            let card = charge
                .payment_method_details
                .as_ref()
                .and_then(|d| d.card.as_ref())
                .expect("payment_method_details.card");
            assert_eq!(
                (
                    card.brand.as_deref(),
                    card.last4.as_deref(),
                    card.funding.as_deref()
                ),
                (Some(brand), Some(last4), Some(funding))
            );
            let again = retrieve_charge(&client, charge.id.as_str()).await;
            assert_same(&again, &charge, "retrieve gives the charge create gave");
            assert_eq!(server.charges_tagged(&tag), 1);
            assert_eq!(server.payments_tagged(&tag), 1);
        }
        Expect::PaidInReview(last4) => {
            let (tag, charge) = paid_charge(&client, 2000, token).await;
            assert_eq!(charge.status, ChargeStatus::Succeeded);
            let outcome = charge.outcome.as_ref().expect("an outcome");
            assert_eq!(
                (
                    outcome.type_.as_str(),
                    outcome.reason.as_deref(),
                    outcome.risk_level.as_deref()
                ),
                (
                    "manual_review",
                    Some("elevated_risk_level"),
                    Some("elevated")
                )
            );
            let card = charge
                .payment_method_details
                .as_ref()
                .and_then(|d| d.card.as_ref())
                .expect("payment_method_details.card");
            assert_eq!(card.last4.as_deref(), Some(last4));
            assert_eq!(server.payments_tagged(&tag), 1);
        }
        Expect::Declined(decline) => {
            let (tag, request) = charge_request(2000, token);
            let (error, status) = api_error(request.send(&client).await);
            assert_eq!(status, 402);
            assert_eq!(error.type_, ApiErrorsType::CardError);
            assert_eq!(code(&error), Some(decline.code));
            assert_eq!(error.decline_code.as_deref(), decline.decline_code);
            assert_eq!(error.param.as_deref(), decline.param);
            assert_eq!(
                error.doc_url.as_deref(),
                Some(
                    format!(
                        "https://stripe.com/docs/error-codes/{}",
                        decline.code.replace('_', "-")
                    )
                    .as_str()
                )
            );
            let id = error.charge.clone().expect("the declined charge's id");
            assert!(id.starts_with("ch_"), "{id}");
            let charge = retrieve_charge(&client, &id).await;
            assert_eq!(charge.status, ChargeStatus::Failed);
            assert!(!charge.paid);
            assert_eq!(charge.amount_captured, 0);
            assert_eq!(charge.failure_code.as_deref(), Some(decline.code));
            assert_eq!(charge.metadata.get("test"), Some(&tag));
            let outcome = charge.outcome.as_ref().expect("an outcome");
            assert_eq!(
                (
                    outcome.type_.as_str(),
                    outcome.reason.as_deref(),
                    outcome.risk_level.as_deref()
                ),
                (
                    decline.outcome,
                    Some(decline.reason),
                    Some(decline.risk_level)
                )
            );
            let card = charge
                .payment_method_details
                .as_ref()
                .and_then(|d| d.card.as_ref())
                .expect("payment_method_details.card");
            assert_eq!(
                (card.brand.as_deref(), card.last4.as_deref()),
                (Some("visa"), Some(decline.last4))
            );
            let cvc = card.checks.as_ref().and_then(|c| c.cvc_check.as_deref());
            let expected_cvc = if decline.code == "incorrect_cvc" {
                "fail"
            } else {
                "pass"
            };
            assert_eq!(cvc, Some(expected_cvc), "checks.cvc_check");
            assert_eq!(
                server.sql(&format!("SELECT status FROM charges WHERE id = '{id}'")),
                "failed"
            );
            assert_eq!(server.payments_tagged(&tag), 0, "no money moved");
        }
        Expect::OutcomeUnknownThenPaid => {
            // The first answer is 503 processing_outcome_unknown, then 409
            // while the key is claimed; once the claim is stale (2 s), a
            // retry settles the charge from the processor's record. The
            // SDK's backoff (1 s, 2 s, 4 s, ...) keeps one key throughout.
            let (tag, request) = charge_request(1400, token);
            let result = request
                .customize()
                .request_strategy(RequestStrategy::ExponentialBackoff(6))
                .send(&client)
                .await;
            let charge = server.typed(
                "the recovered charge",
                &raw_charge_path(server, &tag),
                result,
            );
            assert_eq!(charge.status, ChargeStatus::Succeeded);
            assert_eq!(charge.amount, 1400);
            assert_eq!(server.charges_tagged(&tag), 1);
            assert_eq!(server.payments_tagged(&tag), 1, "charged exactly once");
        }
        Expect::ProcessorUnavailable => {
            let (tag, request) = charge_request(900, token);
            let once = request
                .customize()
                .request_strategy(RequestStrategy::Once)
                .send(&client)
                .await;
            let (error, status) = api_error(once);
            assert_eq!(status, 503);
            assert_eq!(error.type_, ApiErrorsType::ApiError);
            assert_eq!(code(&error), Some("processor_unavailable"));
            assert_eq!(server.payments_tagged(&tag), 0, "no money moved");
        }
    }
}

macro_rules! token_tests {
    ($($name:ident: $token:literal => $expect:expr;)*) => {
        $(
            #[tokio::test]
            async fn $name() {
                charge_with_token($token, $expect).await;
            }
        )*
        /// Every token a test above charges.
        const TESTED_TOKENS: &[&str] = &[$($token),*];
    };
}

token_tests! {
    a_tok_visa_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_visa" => Expect::Paid("visa", "4242", "credit");
    a_tok_visa_debit_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_visa_debit" => Expect::Paid("visa", "5556", "debit");
    a_tok_mastercard_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_mastercard" => Expect::Paid("mastercard", "4444", "credit");
    a_tok_mastercard_debit_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_mastercard_debit" => Expect::Paid("mastercard", "8210", "debit");
    a_tok_amex_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_amex" => Expect::Paid("amex", "8431", "credit");
    a_tok_discover_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_discover" => Expect::Paid("discover", "1117", "credit");
    a_tok_mastercard_prepaid_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_mastercard_prepaid" => Expect::Paid("mastercard", "5100", "prepaid");
    a_tok_jcb_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_jcb" => Expect::Paid("jcb", "0505", "credit");
    a_tok_unionpay_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_unionpay" => Expect::Paid("unionpay", "0005", "credit");
    a_tok_diners_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_diners" => Expect::Paid("diners", "0004", "credit");
    a_pm_card_visa_charge_succeeds_on_the_card_of_tok_visa:
        "pm_card_visa" => Expect::Paid("visa", "4242", "credit");
    a_tok_risk_level_elevated_charge_succeeds_placed_in_review:
        "tok_riskLevelElevated" => Expect::PaidInReview("9235");
    a_tok_refund_fail_charge_succeeds_and_reads_back_as_the_typed_charge_created:
        "tok_refundFail" => Expect::Paid("visa", "4242", "credit");
    a_tok_charge_declined_charge_is_a_typed_card_error_and_reads_back_failed:
        "tok_chargeDeclined" => declined("generic_decline", "0002");
    a_tok_charge_declined_insufficient_funds_charge_is_a_typed_card_error_and_reads_back_failed:
        "tok_chargeDeclinedInsufficientFunds" => declined("insufficient_funds", "9995");
    a_tok_charge_declined_expired_card_charge_is_a_typed_card_error_and_reads_back_failed:
        "tok_chargeDeclinedExpiredCard" => declined_as("expired_card", Some("exp_month"), "0069");
    a_tok_charge_declined_incorrect_cvc_charge_is_a_typed_card_error_and_reads_back_failed_its_cvc_check:
        "tok_chargeDeclinedIncorrectCvc" => declined_as("incorrect_cvc", Some("cvc"), "0127");
    a_tok_charge_declined_processing_error_charge_is_a_typed_card_error_and_reads_back_failed:
        "tok_chargeDeclinedProcessingError" => declined_as("processing_error", None, "0119");
    a_tok_charge_declined_fraudulent_charge_is_a_typed_card_error_and_reads_back_blocked_at_highest_risk:
        "tok_chargeDeclinedFraudulent" => Expect::Declined(Decline {
            code: "card_declined",
            decline_code: Some("fraudulent"),
            param: None,
            outcome: "blocked",
            reason: "highest_risk_level",
            risk_level: "highest",
            last4: "0019",
        });
    a_tok_charge_declined_lost_card_charge_is_a_typed_card_error_and_reads_back_failed:
        "tok_chargeDeclinedLostCard" => declined("lost_card", "9987");
    a_tok_charge_declined_stolen_card_charge_is_a_typed_card_error_and_reads_back_failed:
        "tok_chargeDeclinedStolenCard" => declined("stolen_card", "9979");
    a_tok_processor_timeout_after_capture_charge_ends_in_one_succeeded_charge_through_the_sdks_retries:
        "tok_processorTimeoutAfterCapture" => Expect::OutcomeUnknownThenPaid;
    a_tok_processor_unavailable_charge_is_a_typed_api_error_and_moves_no_money:
        "tok_processorUnavailable" => Expect::ProcessorUnavailable;
}

#[test]
fn every_test_token_oncepay_accepts_has_a_charge_test_here() {
    let source = std::fs::read_to_string(root().join("crates/test-cards/src/lib.rs")).unwrap();
    // The table, not the module's own tests below it.
    let table = source.split("#[cfg(test)]").next().unwrap();
    let tokens: Vec<&str> = table
        .split('"')
        .filter(|s| {
            s.starts_with("tok_") && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
        .collect();
    assert!(
        tokens.contains(&"tok_visa"),
        "tokens read from crates/test-cards/src/lib.rs: {tokens:?}"
    );
    let untested: Vec<&&str> = tokens
        .iter()
        .filter(|t| !TESTED_TOKENS.contains(t))
        .collect();
    assert!(untested.is_empty(), "tokens without a test: {untested:?}");
}

// ---------------------------------------------------------------------------
// Lists, refunds, balance, events

#[tokio::test]
async fn the_sdks_paginator_walks_every_charge_newest_first_and_a_page_before_a_cursor_holds_the_next_newer()
 {
    let server = oncepay();
    let client = server.client();
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(paid_charge(&client, 100 + i, "tok_visa").await.1.id);
    }
    let listed: Vec<Charge> = ListCharge::new()
        .limit(2)
        .paginate()
        .stream(&client)
        .try_collect()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "listing the charges: {e}; page 1: {}",
                server.raw("/v1/charges?limit=2")
            )
        });
    let listed: Vec<String> = listed.iter().map(|c| c.id.to_string()).collect();
    let mine: Vec<&String> = listed
        .iter()
        .filter(|id| ids.iter().any(|m| m.as_str() == id.as_str()))
        .collect();
    let newest_first: Vec<String> = ids.iter().rev().map(|id| id.to_string()).collect();
    assert_eq!(
        mine,
        newest_first.iter().collect::<Vec<_>>(),
        "newest first"
    );
    let mut unique = listed.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), listed.len(), "no charge twice");
    assert!(listed.len() as i64 <= server.count("SELECT count(*) FROM charges"));

    // The page just newer than the oldest of the five: the two after it.
    let page = ListCharge::new()
        .limit(2)
        .ending_before(ids[0].as_str())
        .send(&client)
        .await
        .unwrap();
    let page: Vec<&str> = page.data.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(page, [ids[2].as_str(), ids[1].as_str()]);
}

#[tokio::test]
async fn a_partial_then_a_full_refund_read_back_typed_and_leave_the_charge_refunded() {
    let server = oncepay();
    let client = server.client();
    let (_, charge) = paid_charge(&client, 3000, "tok_visa").await;
    let id = charge.id.as_str();

    let result = CreateRefund::new()
        .charge(id)
        .amount(1000)
        .send(&client)
        .await;
    let partial: Refund = server.typed("the partial refund", &format!("/v1/charges/{id}"), result);
    assert!(partial.id.as_str().starts_with("re_"));
    assert_eq!(partial.status.as_deref(), Some("succeeded"));
    assert_eq!(partial.amount, 1000);
    assert_eq!(
        partial.charge.as_ref().map(|c| c.id().as_str().to_string()),
        Some(id.to_string())
    );
    let between = retrieve_charge(&client, id).await;
    assert_eq!((between.amount_refunded, between.refunded), (1000, false));

    let result = CreateRefund::new().charge(id).send(&client).await;
    let rest: Refund = server.typed("the full refund", &format!("/v1/charges/{id}"), result);
    assert_eq!(rest.amount, 2000, "what was left");
    let result = RetrieveRefund::new(rest.id.clone()).send(&client).await;
    let again = server.typed(
        "the retrieved refund",
        &format!("/v1/refunds/{}", rest.id),
        result,
    );
    assert_same(&again, &rest, "retrieve gives the refund create gave");

    let after = retrieve_charge(&client, id).await;
    assert_eq!((after.amount_refunded, after.refunded), (3000, true));
    if let Some(refunds) = &after.refunds {
        let listed: Vec<&str> = refunds.data.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(
            listed,
            [rest.id.as_str(), partial.id.as_str()],
            "the charge's refunds, newest first"
        );
    }
    assert_eq!(
        server.count(&format!(
            "SELECT amount_refunded FROM charges WHERE id = '{id}'"
        )),
        3000
    );
}

/// `amount` refunded of the charge `id`: the refund's id.
async fn refund(client: &Client, id: &str, amount: i64) -> String {
    let refund = CreateRefund::new()
        .charge(id)
        .amount(amount)
        .send(client)
        .await;
    refund.expect("a refund").id.to_string()
}

/// The ids of `refunds`.
fn refund_ids(refunds: &[Refund]) -> Vec<String> {
    refunds.iter().map(|r| r.id.to_string()).collect()
}

#[tokio::test]
async fn refunds_are_listed_typed_all_by_charge_and_through_the_charges_refunds_url() {
    let server = oncepay();
    let client = server.client();
    let (_, charge) = paid_charge(&client, 3000, "tok_visa").await;
    let id = charge.id.as_str();
    let mut ids = Vec::new();
    for amount in 1..=12 {
        ids.push(refund(&client, id, amount).await);
    }
    ids.reverse(); // newest first
    let (_, other) = paid_charge(&client, 3000, "tok_visa").await;
    let elsewhere = refund(&client, other.id.as_str(), 100).await;

    let result = ListRefund::new().charge(id).limit(5).send(&client).await;
    let page = server.typed(
        "a charge's refunds",
        &format!("/v1/refunds?charge={id}&limit=5"),
        result,
    );
    assert_eq!(
        (refund_ids(&page.data), page.has_more),
        (ids[..5].to_vec(), true)
    );
    let all: Vec<Refund> = ListRefund::new()
        .limit(4)
        .paginate()
        .stream(&client)
        .try_collect()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "listing the refunds: {e}; {}",
                server.raw("/v1/refunds?limit=4")
            )
        });
    let all = refund_ids(&all);
    assert_eq!(all[0], elsewhere, "newest first");
    assert_eq!(all[1..13], ids[..]);
    assert_eq!(
        all.len() as i64,
        server.count("SELECT count(*) FROM refunds")
    );

    // The charge carries its first 10 refunds; its paginator reads the rest
    // from the list's URL, /v1/charges/{id}/refunds.
    let refunds = retrieve_charge(&client, id)
        .await
        .refunds
        .expect("the charge's refunds");
    assert_eq!(
        (refunds.url.as_str(), refunds.data.len()),
        (format!("/v1/charges/{id}/refunds").as_str(), 10)
    );
    let through_charge: Vec<Refund> = refunds
        .into_paginator()
        .stream(&client)
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("paging the charge's refunds: {e}"));
    assert_eq!(refund_ids(&through_charge), ids);
}

#[tokio::test]
async fn a_created_gte_filter_lists_typed_what_was_created_in_its_seconds() {
    let server = oncepay();
    let client = server.client();
    let (_, old) = paid_charge(&client, 1000, "tok_visa").await;
    let (_, recent) = paid_charge(&client, 1000, "tok_visa").await;
    let refunded = refund(&client, old.id.as_str(), 100).await;
    // Created in 2001, as far as the lists know.
    let moved = server.count(&format!(
        "WITH c AS (UPDATE charges SET created_at = to_timestamp(1000000000.5) \
         WHERE id = '{}' RETURNING 1) SELECT count(*) FROM c",
        old.id
    ));
    assert_eq!(moved, 1);
    let since: Vec<Charge> = ListCharge::new()
        .created(RangeQueryTs::gte(recent.created))
        .paginate()
        .stream(&client)
        .try_collect()
        .await
        .unwrap();
    let since: Vec<&str> = since.iter().map(|c| c.id.as_str()).collect();
    assert!(since.contains(&recent.id.as_str()) && !since.contains(&old.id.as_str()));
    let until = ListCharge::new()
        .created(RangeQueryTs::lte(1_000_000_000))
        .send(&client)
        .await
        .unwrap();
    let until: Vec<&str> = until.data.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(until, [old.id.as_str()]);
    let refunds = ListRefund::new()
        .charge(old.id.as_str())
        .created(RangeQueryTs::gte(recent.created))
        .send(&client)
        .await
        .unwrap();
    assert_eq!(refund_ids(&refunds.data), [refunded]);
}

/// The gateway's captures of the charge ID: its payment is captured under
/// `capture:<charge id>`, one row at most.
fn captures_at_gateway(server: &Oncepay, id: &str) -> i64 {
    psql(
        &server.processor_url,
        &format!("SELECT count(*) FROM operations WHERE kind = 'capture' AND key = 'capture:{id}'"),
    )
    .parse()
    .unwrap()
}

/// A `tok_visa` charge of AMOUNT made with `capture=false`.
async fn authorized_charge(client: &Client, amount: i64) -> Charge {
    let server = oncepay();
    let (tag, request) = charge_request(amount, "tok_visa");
    let result = request.capture(false).send(client).await;
    server.typed(
        "the authorized charge",
        &raw_charge_path(server, &tag),
        result,
    )
}

#[tokio::test]
async fn an_authorized_charge_is_captured_once_by_typed_captures_racing_with_one_key_and_many() {
    let server = oncepay();
    let client = server.client();
    let authorized = authorized_charge(&client, 2000).await;
    assert_eq!(
        (
            authorized.paid,
            authorized.captured,
            authorized.amount_captured
        ),
        (true, false, 0)
    );
    let id = authorized.id.to_string();
    // Eight captures at once: four share a key, four have one each.
    let shared = uuid::Uuid::new_v4().to_string();
    let keys: Vec<String> = (0..8)
        .map(|n| {
            if n < 4 {
                shared.clone()
            } else {
                uuid::Uuid::new_v4().to_string()
            }
        })
        .collect();
    let captures = keys.iter().map(|key| {
        CaptureCharge::new(id.as_str())
            .amount(1500)
            .customize()
            .request_strategy(idempotent(key))
            .send(&client)
    });
    let mut captured = 0;
    for result in futures_util::future::join_all(captures).await {
        match result {
            Ok(charge) => {
                assert_eq!((charge.captured, charge.amount_captured), (true, 1500));
                captured += 1;
            }
            Err(StripeError::Stripe(error, status)) => assert!(
                matches!(
                    (status, code(&error)),
                    (400, Some("charge_already_captured")) | (409, Some("idempotency_key_in_use"))
                ),
                "{status} {error:?}"
            ),
            Err(e) => panic!("{e}"),
        }
    }
    assert!(captured >= 1, "at least one capture is answered the charge");
    let after = retrieve_charge(&client, &id).await;
    assert_eq!(
        (after.captured, after.amount_captured, after.amount_refunded),
        (true, 1500, 0),
        "captured once, the rest released with no refund, as at Stripe since 2025-03-31.basil"
    );
    assert_eq!(
        captures_at_gateway(server, &id),
        1,
        "one capture at the gateway"
    );
    assert_eq!(
        server.count(&format!(
            "SELECT count(*) FROM events WHERE object_id = '{id}' AND type = 'charge.captured'"
        )),
        1
    );
}

#[tokio::test]
async fn a_capture_with_no_body_and_no_content_type_captures_the_whole_amount() {
    let server = oncepay();
    let client = server.client();
    let id = authorized_charge(&client, 7200).await.id.to_string();
    // As `curl -X POST .../v1/charges/{id}/capture` sends it: no body, no
    // Content-Type.
    let path = format!("/v1/charges/{id}/capture");
    let (status, body) = http("POST", &server.base, &path, Some(&server.api_key)).unwrap();
    assert_eq!(status, 200, "{body}");
    let captured: Charge = miniserde::json::from_str(&body)
        .unwrap_or_else(|_| panic!("async-stripe could not read the answer as a Charge: {body}"));
    assert_eq!((captured.captured, captured.amount_captured), (true, 7200));
    let after = retrieve_charge(&client, &id).await;
    assert_eq!(
        (after.captured, after.amount_captured, after.amount_refunded),
        (true, 7200, 0)
    );
    assert_eq!(captures_at_gateway(server, &id), 1);
}

#[tokio::test]
async fn a_capture_of_more_than_was_authorized_is_a_typed_invalid_request_error_and_captures_nothing()
 {
    let server = oncepay();
    let client = server.client();
    let authorized = authorized_charge(&client, 2000).await;
    let id = authorized.id.to_string();
    let (error, status) = api_error(
        CaptureCharge::new(id.as_str())
            .amount(2001)
            .send(&client)
            .await,
    );
    assert_eq!(status, 400);
    assert_eq!(error.type_, ApiErrorsType::InvalidRequestError);
    assert_eq!(code(&error), Some("amount_too_large"));
    assert_eq!(error.param.as_deref(), Some("amount"));
    assert!(!retrieve_charge(&client, &id).await.captured);
    assert_eq!(captures_at_gateway(server, &id), 0);
}

#[tokio::test]
async fn updates_read_back_typed_merge_and_unset_metadata_and_write_one_event_per_key() {
    let server = oncepay();
    let client = server.client();
    let (tag, charge) = paid_charge(&client, 2000, "tok_visa").await;
    let id = charge.id.to_string();
    let metadata = HashMap::from([
        ("note".to_owned(), "gift".to_owned()),
        ("test".to_owned(), String::new()),
    ]);
    let key = uuid::Uuid::new_v4().to_string();
    let update = || {
        UpdateCharge::new(id.as_str())
            .description("Order 1")
            .receipt_email("jenny.rosen@example.com")
            .metadata(metadata.clone())
            .customize()
            .request_strategy(idempotent(&key))
            .send(&client)
    };
    let path = format!("/v1/charges/{id}");
    let updated = server.typed("the updated charge", &path, update().await);
    let again = server.typed("the update sent again", &path, update().await);
    assert_same(&updated, &again, "the update's answer, replayed");
    assert_eq!(updated.description.as_deref(), Some("Order 1"));
    assert_eq!(
        updated.receipt_email.as_deref(),
        Some("jenny.rosen@example.com")
    );
    assert_eq!(
        updated.metadata,
        HashMap::from([("note".to_owned(), "gift".to_owned())]),
        "`test` unset by an empty value, `note` added"
    );
    assert_same(&retrieve_charge(&client, &id).await, &updated, "read back");
    assert_eq!(
        server.charges_tagged(&tag),
        0,
        "the tag is gone from the charge"
    );
    assert_eq!(
        server.count(&format!(
            "SELECT count(*) FROM events WHERE object_id = '{id}' AND type = 'charge.updated'"
        )),
        1,
        "one event for one update sent twice"
    );

    let refund_id = refund(&client, &id, 500).await;
    let result = UpdateRefund::new(refund_id.as_str())
        .metadata(HashMap::from([("reason".to_owned(), "damaged".to_owned())]))
        .send(&client)
        .await;
    let refund = server.typed(
        "the updated refund",
        &format!("/v1/refunds/{refund_id}"),
        result,
    );
    assert_eq!(
        refund.metadata,
        Some(HashMap::from([("reason".to_owned(), "damaged".to_owned())]))
    );
}

#[tokio::test]
async fn an_endpoint_is_updated_typed_disabled_and_enabled_again() {
    let server = oncepay();
    let client = server.client();
    let (_receiver, _secret, id) = endpoint(&client).await;
    let path = format!("/v1/webhook_endpoints/{id}");
    let result = UpdateWebhookEndpoint::new(id.as_str())
        .enabled_events(vec![
            UpdateWebhookEndpointEnabledEvents::ChargeFailed,
            UpdateWebhookEndpointEnabledEvents::ChargeRefunded,
        ])
        .disabled(true)
        .send(&client)
        .await;
    let disabled = server.typed("the disabled endpoint", &path, result);
    assert_eq!(
        disabled.enabled_events,
        ["charge.failed", "charge.refunded"]
    );
    assert_eq!(disabled.status, "disabled");
    assert_eq!(
        disabled.secret, None,
        "the secret is shown only when created"
    );
    let result = UpdateWebhookEndpoint::new(id.as_str())
        .disabled(false)
        .send(&client)
        .await;
    assert_eq!(
        server.typed("the enabled endpoint", &path, result).status,
        "enabled"
    );
    let result = DeleteWebhookEndpoint::new(id.as_str()).send(&client).await;
    server.typed("the deleted endpoint", &path, result);
}

#[tokio::test]
async fn a_refund_the_issuer_refuses_reads_back_typed_as_failed_and_refunds_nothing() {
    let server = oncepay();
    let client = server.client();
    let (_, charge) = paid_charge(&client, 1500, "tok_refundFail").await;
    let id = charge.id.as_str();
    let result = CreateRefund::new()
        .charge(id)
        .amount(500)
        .send(&client)
        .await;
    let refund: Refund = server.typed("the failed refund", &format!("/v1/charges/{id}"), result);
    assert_eq!(refund.status.as_deref(), Some("failed"));
    assert!(refund.failure_reason.is_some(), "{refund:?}");
    let after = retrieve_charge(&client, id).await;
    assert_eq!((after.amount_refunded, after.refunded), (0, false));
    assert_eq!(
        server.count(&format!(
            "SELECT amount_refunded FROM charges WHERE id = '{id}'"
        )),
        0
    );
}

#[tokio::test]
async fn an_over_refund_is_a_typed_invalid_request_error_and_refunds_nothing() {
    let server = oncepay();
    let client = server.client();
    let (_, charge) = paid_charge(&client, 1000, "tok_visa").await;
    let id = charge.id.as_str();
    let (error, status) = api_error(
        CreateRefund::new()
            .charge(id)
            .amount(1001)
            .send(&client)
            .await,
    );
    assert_eq!(status, 400);
    assert_eq!(error.type_, ApiErrorsType::InvalidRequestError);
    assert_eq!(code(&error), Some("amount_too_large"));
    assert_eq!(error.param.as_deref(), Some("amount"));
    assert_eq!(
        server.count(&format!(
            "SELECT count(*) FROM refunds WHERE charge_id = '{id}'"
        )),
        0
    );
}

async fn balance(client: &Client) -> stripe_core::Balance {
    let result = RetrieveForMyAccountBalance::new().send(client).await;
    oncepay().typed("the balance", "/v1/balance", result)
}

#[tokio::test]
async fn the_balance_reads_back_typed_and_moves_by_what_was_charged_less_what_was_refunded() {
    let server = oncepay();
    let client = server.client();
    let usd = |b: &stripe_core::Balance| -> i64 {
        b.available
            .iter()
            .chain(&b.pending)
            .filter(|a| a.currency == Currency::USD)
            .map(|a| a.amount)
            .sum()
    };
    let before = balance(&client).await;
    assert!(!before.livemode);
    let (_, charge) = paid_charge(&client, 2500, "tok_visa").await;
    let result = CreateRefund::new()
        .charge(charge.id.as_str())
        .amount(500)
        .send(&client)
        .await;
    server.typed("the refund", "/v1/balance", result);
    let after = balance(&client).await;
    // Other tests may charge at the same time: at least this test's 2000.
    assert!(
        usd(&after) - usd(&before) >= 2000,
        "{before:?} then {after:?}"
    );
}

#[tokio::test]
async fn a_charges_event_reads_back_typed_by_id_and_in_the_list_holding_the_charge() {
    let server = oncepay();
    let client = server.client();
    let (_, charge) = paid_charge(&client, 2000, "tok_visa").await;
    let id = server.sql(&format!(
        "SELECT id FROM events WHERE type = 'charge.succeeded' AND object_id = '{}'",
        charge.id
    ));
    assert!(id.starts_with("evt_"), "the charge's event: {id:?}");
    let result = RetrieveEvent::new(id.as_str()).send(&client).await;
    let event = server.typed("the event", &format!("/v1/events/{id}"), result);
    assert_eq!(event.type_.as_str(), "charge.succeeded");
    assert!(!event.livemode);
    let object = miniserde::json::to_string(&event.data.object);
    let inside: Charge = miniserde::json::from_str(&object).unwrap_or_else(|_| {
        panic!("async-stripe could not read the event's data.object as a Charge: {object}")
    });
    assert_same(&inside, &charge, "the event holds the charge as created");

    // A list shows an event once no earlier one can still commit: wait.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let result = ListEvent::new().limit(100).send(&client).await;
        let listed = server.typed("the list of events", "/v1/events?limit=100", result);
        if listed.data.iter().any(|e| e.id.as_str() == id) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id} not in the latest events within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------
// Errors

#[tokio::test]
async fn a_missing_amount_is_a_typed_invalid_request_error_naming_it_and_writes_nothing() {
    let server = oncepay();
    let client = server.client();
    let (tag, metadata) = tagged();
    let request = CreateCharge::new()
        .currency(Currency::USD)
        .source("tok_visa")
        .metadata(metadata);
    let (error, status) = api_error(request.send(&client).await);
    assert_eq!(status, 400);
    assert_eq!(error.type_, ApiErrorsType::InvalidRequestError);
    assert_eq!(code(&error), Some("parameter_missing"));
    assert_eq!(error.param.as_deref(), Some("amount"));
    assert_eq!(server.charges_tagged(&tag), 0, "nothing written");
}

#[tokio::test]
async fn an_unknown_token_is_a_typed_invalid_request_error_naming_the_source() {
    let server = oncepay();
    let (tag, request) = charge_request(100, "tok_nope");
    let (error, status) = api_error(request.send(&server.client()).await);
    assert_eq!(
        (status, &error.type_),
        (400, &ApiErrorsType::InvalidRequestError)
    );
    assert_eq!(code(&error), Some("resource_missing"));
    assert_eq!(error.param.as_deref(), Some("source"));
    assert_eq!(server.charges_tagged(&tag), 0);
}

#[tokio::test]
async fn an_unknown_charge_is_a_typed_invalid_request_error_404() {
    let server = oncepay();
    let result = RetrieveCharge::new("ch_doesnotexist")
        .send(&server.client())
        .await;
    let (error, status) = api_error(result);
    assert_eq!(
        (status, &error.type_),
        (404, &ApiErrorsType::InvalidRequestError)
    );
    assert_eq!(code(&error), Some("resource_missing"));
}

#[tokio::test]
async fn a_wrong_api_key_is_a_typed_authentication_error_401() {
    let server = oncepay();
    let client = server.client_with_key(&format!("sk_test_{}", "0".repeat(40)));
    let (error, status) = api_error(ListCharge::new().send(&client).await);
    assert_eq!(status, 401);
    assert_eq!(code(&error), Some("invalid_api_key"));
}

#[tokio::test]
async fn a_reused_idempotency_key_is_a_typed_idempotency_error_and_charges_once() {
    let server = oncepay();
    let client = server.client();
    let key = uuid::Uuid::new_v4().to_string();
    let (tag, request) = charge_request(700, "tok_visa");
    let result = request
        .customize()
        .request_strategy(idempotent(&key))
        .send(&client)
        .await;
    server.typed("the first charge", &raw_charge_path(server, &tag), result);
    let changed = request.amount(701);
    let result = changed
        .customize()
        .request_strategy(idempotent(&key))
        .send(&client)
        .await;
    let (error, status) = api_error(result);
    assert_eq!(status, 400);
    assert_eq!(error.type_, ApiErrorsType::IdempotencyError);
    assert_eq!(code(&error), Some("idempotency_key_reused"));
    assert_eq!(server.charges_tagged(&tag), 1);
    assert_eq!(server.payments_tagged(&tag), 1);
}

// ---------------------------------------------------------------------------
// Idempotency

#[tokio::test]
async fn the_same_idempotency_key_gives_the_same_charge_once() {
    let server = oncepay();
    let client = server.client();
    let key = uuid::Uuid::new_v4().to_string();
    let (tag, request) = charge_request(1500, "tok_visa");
    let mut answers = Vec::new();
    for _ in 0..2 {
        let result = request
            .customize()
            .request_strategy(idempotent(&key))
            .send(&client)
            .await;
        answers.push(server.typed("the keyed charge", &raw_charge_path(server, &tag), result));
    }
    assert_same(
        &answers[1],
        &answers[0],
        "the replay is the charge first answered",
    );
    assert_eq!(server.charges_tagged(&tag), 1);
    assert_eq!(server.payments_tagged(&tag), 1);
    assert_eq!(
        server.sql(&format!(
            "SELECT key FROM idempotency_keys WHERE charge_id = '{}'",
            answers[0].id
        )),
        key,
        "the SDK's key, as given"
    );
}

#[tokio::test]
async fn one_key_sent_twice_at_once_makes_one_charge() {
    // The two race for the key: the loser is answered 409 while the winner
    // holds it (the Idempotent strategy sends once), or the replay after.
    let server = oncepay();
    let client = server.client();
    let key = uuid::Uuid::new_v4().to_string();
    let (tag, request) = charge_request(1600, "tok_visa");
    let send = || {
        request
            .customize()
            .request_strategy(idempotent(&key))
            .send(&client)
    };
    let (a, b) = tokio::join!(send(), send());
    let mut ids = Vec::new();
    for result in [a, b] {
        match result {
            Ok(charge) => ids.push(charge.id.to_string()),
            Err(StripeError::Stripe(error, 409)) => {
                assert_eq!(code(&error), Some("idempotency_key_in_use"));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(!ids.is_empty(), "one of the two is answered the charge");
    ids.dedup();
    assert_eq!(ids.len(), 1, "one charge id");
    assert_eq!(server.charges_tagged(&tag), 1);
    assert_eq!(server.payments_tagged(&tag), 1);
}

#[tokio::test]
async fn the_sdks_retry_strategy_sends_a_key_of_its_own() {
    let server = oncepay();
    let client = server.client();
    let (tag, request) = charge_request(1700, "tok_visa");
    let result = request
        .customize()
        .request_strategy(RequestStrategy::Retry(3))
        .send(&client)
        .await;
    let charge = server.typed("the retried charge", &raw_charge_path(server, &tag), result);
    let made_up = server.sql(&format!(
        "SELECT key FROM idempotency_keys WHERE charge_id = '{}'",
        charge.id
    ));
    assert!(
        uuid::Uuid::parse_str(&made_up).is_ok(),
        "the SDK's own key, a UUID: {made_up:?}"
    );
}

// ---------------------------------------------------------------------------
// Webhook endpoints and deliveries

#[tokio::test]
async fn an_endpoint_reads_back_typed_shows_its_secret_only_when_created_and_is_listed_and_deleted()
{
    let server = oncepay();
    let client = server.client();
    let receiver = Receiver::start().await;
    let result = CreateWebhookEndpoint::new(
        vec![CreateWebhookEndpointEnabledEvents::ChargeSucceeded],
        receiver.url.as_str(),
    )
    .description("the Rust SDK's receiver")
    .send(&client)
    .await;
    let created = server.typed("the created endpoint", "/v1/webhook_endpoints", result);
    assert!(created.id.as_str().starts_with("we_"));
    assert!(
        created
            .secret
            .as_deref()
            .is_some_and(|s| s.starts_with("whsec_"))
    );
    assert_eq!(created.url, receiver.url);
    assert_eq!(created.enabled_events, ["charge.succeeded"]);
    assert_eq!(created.status, "enabled");
    assert_eq!(
        created.description.as_deref(),
        Some("the Rust SDK's receiver")
    );

    let path = format!("/v1/webhook_endpoints/{}", created.id);
    let result = RetrieveWebhookEndpoint::new(created.id.clone())
        .send(&client)
        .await;
    let retrieved = server.typed("the retrieved endpoint", &path, result);
    assert_eq!(
        retrieved.secret, None,
        "the secret only in the answer to the create"
    );
    let mut shown = created.clone();
    shown.secret = None;
    assert_same(
        &retrieved,
        &shown,
        "the endpoint as created, less its secret",
    );

    let result = ListWebhookEndpoint::new()
        .paginate()
        .stream(&client)
        .try_collect::<Vec<_>>()
        .await;
    let listed = server.typed("the endpoints", "/v1/webhook_endpoints", result);
    assert!(listed.iter().any(|e| e.id == created.id));
    assert!(listed.iter().all(|e| e.secret.is_none()));

    let result = DeleteWebhookEndpoint::new(created.id.clone())
        .send(&client)
        .await;
    let deleted = server.typed("the deleted endpoint", &path, result);
    assert_eq!(deleted.id, created.id);
    let (error, status) = api_error(
        RetrieveWebhookEndpoint::new(created.id.clone())
            .send(&client)
            .await,
    );
    assert_eq!((status, code(&error)), (404, Some("resource_missing")));
}

/// Runs with a receiver and an endpoint for `charge.succeeded` at it:
/// `(receiver, secret, endpoint id)`; the caller deletes the endpoint.
async fn endpoint(client: &Client) -> (Receiver, String, String) {
    let receiver = Receiver::start().await;
    let result = CreateWebhookEndpoint::new(
        vec![CreateWebhookEndpointEnabledEvents::ChargeSucceeded],
        receiver.url.as_str(),
    )
    .send(client)
    .await;
    let created = oncepay().typed("the created endpoint", "/v1/webhook_endpoints", result);
    let secret = created
        .secret
        .expect("the secret in the answer to the create");
    (receiver, secret, created.id.to_string())
}

#[tokio::test]
async fn a_charge_is_delivered_signed_and_the_sdks_webhook_helper_verifies_it_into_the_typed_charge()
 {
    let server = oncepay();
    let client = server.client();
    let (receiver, secret, endpoint_id) = endpoint(&client).await;
    let (_, charge) = paid_charge(&client, 2000, "tok_visa").await;
    let [delivery] = receiver
        .of_object(charge.id.as_str(), 1)
        .await
        .try_into()
        .unwrap();
    assert!(
        delivery.content_type.starts_with("application/json"),
        "{delivery:?}"
    );

    let event = Webhook::construct_event(&delivery.body, &delivery.signature, &secret)
        .unwrap_or_else(|e| {
            panic!(
                "the SDK refused oncepay's delivery ({e}): {}",
                delivery.body
            )
        });
    assert_eq!(event.type_.as_str(), "charge.succeeded");
    let EventObject::ChargeSucceeded(delivered) = &event.data.object else {
        panic!("not a charge.succeeded object: {:?}", event.data.object);
    };
    assert_same(
        delivered.as_ref(),
        &charge,
        "the charge as the API answered it",
    );

    let result = RetrieveEvent::new(event.id.as_str()).send(&client).await;
    let retrieved = server.typed(
        "the delivered event",
        &format!("/v1/events/{}", event.id),
        result,
    );
    assert_eq!(retrieved.id, event.id);
    assert_eq!(retrieved.type_, event.type_);

    // What the helper refuses: another body, another secret, a stale `t=`.
    let tampered = delivery.body.replacen("\"amount\":2000", "\"amount\":1", 1);
    assert_ne!(tampered, delivery.body);
    assert!(matches!(
        Webhook::construct_event(&tampered, &delivery.signature, &secret),
        Err(WebhookError::BadSignature)
    ));
    let other = format!("whsec_{}", random_hex(16));
    assert!(matches!(
        Webhook::construct_event(&delivery.body, &delivery.signature, &other),
        Err(WebhookError::BadSignature)
    ));
    let t = delivery.timestamp();
    Webhook::construct_event_with_timestamp(&delivery.body, &delivery.signature, &secret, t + 300)
        .expect("still within the 300 s tolerance");
    assert!(matches!(
        Webhook::construct_event_with_timestamp(
            &delivery.body,
            &delivery.signature,
            &secret,
            t + 301
        ),
        Err(WebhookError::BadTimestamp(_))
    ));

    DeleteWebhookEndpoint::new(endpoint_id.as_str())
        .send(&client)
        .await
        .unwrap();
}

// The receiver holds the first answer back with a blocking sleep: two
// worker threads, so that the test goes on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_answered_500_is_sent_again_signed_anew_and_each_attempt_verifies() {
    let server = oncepay();
    let client = server.client();
    let (receiver, secret, endpoint_id) = endpoint(&client).await;
    let failed_once = std::sync::Mutex::new(std::collections::HashSet::new());
    receiver.answer_with(move |d| {
        if failed_once.lock().unwrap().insert(d.body.clone()) {
            // Not before the signature's second has passed, so that the
            // retry is signed at a later `t=`.
            let due = std::time::UNIX_EPOCH + Duration::from_secs(d.timestamp() as u64 + 1);
            if let Ok(wait) = due.duration_since(std::time::SystemTime::now()) {
                std::thread::sleep(wait);
            }
            500
        } else {
            200
        }
    });
    let (_, charge) = paid_charge(&client, 2000, "tok_visa").await;
    let [first, second] = receiver
        .of_object(charge.id.as_str(), 2)
        .await
        .try_into()
        .unwrap();
    let events: Vec<_> = [&first, &second]
        .iter()
        .map(|d| {
            Webhook::construct_event(&d.body, &d.signature, &secret).expect("each attempt verifies")
        })
        .collect();
    assert_eq!(events[1].id, events[0].id, "the same event, sent again");
    assert!(
        second.timestamp() > first.timestamp(),
        "each attempt signed when sent"
    );
    DeleteWebhookEndpoint::new(endpoint_id.as_str())
        .send(&client)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_refund_is_delivered_as_stripes_refund_created_and_the_events_list_by_that_type() {
    let server = oncepay();
    let client = server.client();
    let receiver = Receiver::start().await;
    let result = CreateWebhookEndpoint::new(
        vec![
            CreateWebhookEndpointEnabledEvents::RefundCreated,
            CreateWebhookEndpointEnabledEvents::ChargeRefundUpdated,
        ],
        receiver.url.as_str(),
    )
    .send(&client)
    .await;
    let created = server.typed("the created endpoint", "/v1/webhook_endpoints", result);
    assert_eq!(
        created.enabled_events,
        ["charge.refund.updated", "refund.created"]
    );
    let secret = created
        .secret
        .expect("the secret in the answer to the create");
    let (_, charge) = paid_charge(&client, 2000, "tok_visa").await;
    let result = CreateRefund::new()
        .charge(charge.id.as_str())
        .amount(500)
        .send(&client)
        .await;
    let refund = server.typed("the refund", "/v1/refunds", result);
    let [delivery] = receiver
        .of_object(refund.id.as_str(), 1)
        .await
        .try_into()
        .unwrap();
    let event = Webhook::construct_event(&delivery.body, &delivery.signature, &secret)
        .unwrap_or_else(|e| panic!("the SDK refused the delivery ({e}): {}", delivery.body));
    assert_eq!(event.type_.as_str(), "refund.created");
    let EventObject::RefundCreated(delivered) = &event.data.object else {
        panic!("not a refund.created object: {:?}", event.data.object);
    };
    assert_same(
        delivered.as_ref(),
        &refund,
        "the refund as the API answered it",
    );

    let result = ListEvent::new().type_("refund.created").send(&client).await;
    let listed = server.typed(
        "the refund.created events",
        "/v1/events?type=refund.created",
        result,
    );
    assert!(
        listed
            .data
            .iter()
            .all(|e| e.type_.as_str() == "refund.created")
    );
    assert!(listed.data.iter().any(|e| e.id == event.id), "{listed:?}");
    let (error, status) = api_error(
        ListEvent::new()
            .type_("refund.succeeded")
            .send(&client)
            .await,
    );
    assert_eq!((status, code(&error)), (400, Some("invalid_event_type")));
    assert_eq!(error.param.as_deref(), Some("type"));

    DeleteWebhookEndpoint::new(created.id.as_str())
        .send(&client)
        .await
        .unwrap();
}
