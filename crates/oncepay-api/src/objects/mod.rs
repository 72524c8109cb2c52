//! The objects the API sends, in Stripe's shapes: the charge
//! ([`ChargeObject`]), the refund ([`RefundObject`]) and the event
//! ([`EventObject`]), with the parts they nest; [`card`] holds the card as a
//! charge shows it.
//!
//! Each is built from plain facts ([`ChargeFacts`], [`RefundFacts`]) that
//! the core's stored record hands over (`Charge::to_object` and the like):
//! the shapes are the API's vocabulary, and the core keeps what it stores.
//! Every field of Stripe's object is present, in Stripe's order (`id`,
//! `object`, then by name); what oncepay does not model is [`Unmodelled`]
//! (`null`) or [`Empty`] (`{}`). docs/decisions.md ("Stripe's object
//! shapes") says which fields and why.
//!
//! The statuses and the event types are the core's (sqlx reads them, and
//! they are stored under the names the API shows), so an object holds them
//! as those names, and its schema refers to the core's by name.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use test_cards::{TestToken, Verdict};

pub mod card;
pub mod details;
pub mod unmodelled;

use card::{PaymentMethodDetails, SourceCard};
use details::{FraudDetails, Shipping};
pub use unmodelled::{Empty, Unmodelled};

/// A reference to the core's schema `name` (`ChargeStatus`, `RefundStatus`,
/// `EventType`), which the server's document registers beside the objects.
#[cfg(feature = "openapi")]
fn core_schema(name: &str) -> utoipa::openapi::Ref {
    utoipa::openapi::Ref::from_schema_name(name)
}

/// What a charge's object is built from: the stored charge, in the API's terms.
#[derive(Clone, Copy, Debug)]
pub struct ChargeFacts<'a> {
    /// `ch_` and 24 letters or digits.
    pub id: &'a str,
    pub amount: i64,
    pub amount_refunded: i64,
    /// Unix seconds.
    pub created: i64,
    pub currency: &'a str,
    pub description: Option<&'a str>,
    pub failure_code: Option<&'a str>,
    pub failure_message: Option<&'a str>,
    pub metadata: &'a BTreeMap<String, String>,
    /// What was captured: all of a charge paid at once, what a capture
    /// took of one captured later, nothing before.
    pub amount_captured: i64,
    /// The charge succeeded: the card was charged, or authorized when it
    /// is captured later.
    pub paid: bool,
    /// `pending`, `succeeded` or `failed`.
    pub status: &'a str,
    /// The test token charged.
    pub token: Option<TestToken>,
    /// What the card network (or the fraud check) said; `None` while the
    /// charge is pending and for an abandoned one, which no network answered.
    pub verdict: Option<Verdict>,
    pub receipt_email: Option<&'a str>,
    pub statement_descriptor: Option<&'a str>,
    pub statement_descriptor_suffix: Option<&'a str>,
    pub shipping: Option<&'a Shipping>,
    pub transfer_group: Option<&'a str>,
    pub fraud_details: &'a FraudDetails,
}

/// The charge object of the API: every field of Stripe's charge, in Stripe's
/// order (`id`, `object`, then by name). What oncepay does not model is
/// `null` or Stripe's empty form (see docs/decisions.md).
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Charge))]
pub struct ChargeObject<'a> {
    /// `ch_` and 24 letters or digits.
    #[cfg_attr(feature = "openapi", schema(example = "ch_FSqF13LohwPRt53icfinsfKa"))]
    pub id: &'a str,
    #[cfg_attr(feature = "openapi", schema(example = "charge"))]
    pub object: &'static str,
    /// Integer minor units (2000 = 20.00 USD).
    #[cfg_attr(feature = "openapi", schema(example = 2000))]
    pub amount: i64,
    /// The amount captured: all of it for a charge paid at once, what its
    /// capture took for one authorized first, nothing before that.
    #[cfg_attr(feature = "openapi", schema(example = 2000))]
    pub amount_captured: i64,
    /// What refunds gave back; never what a partial capture left
    /// uncaptured, which was released with no refund.
    #[cfg_attr(feature = "openapi", schema(example = 0))]
    pub amount_refunded: i64,
    pub application: Unmodelled,
    pub application_fee: Unmodelled,
    pub application_fee_amount: Unmodelled,
    /// `txn_...` for a captured charge, `null` otherwise.
    #[cfg_attr(feature = "openapi", schema(example = "txn_FSqF13LohwPRt53icfinsfKa"))]
    pub balance_transaction: Option<String>,
    pub billing_details: BillingDetails,
    /// What the statement shows, for a captured charge (`null` otherwise):
    /// `ONCEPAY* ` and its suffix, else its `statement_descriptor` (cut to 22
    /// characters), else `ONCEPAY`.
    #[cfg_attr(feature = "openapi", schema(example = "ONCEPAY"))]
    pub calculated_statement_descriptor: Option<String>,
    /// Whether money was taken: at once, or by a capture of an authorized
    /// charge (`capture=false`).
    pub captured: bool,
    /// Unix seconds.
    #[cfg_attr(feature = "openapi", schema(example = 1764892800))]
    pub created: i64,
    #[cfg_attr(feature = "openapi", schema(example = "usd"))]
    pub currency: &'a str,
    pub customer: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(example = "Order 6735"))]
    pub description: Option<&'a str>,
    /// Always false.
    pub disputed: bool,
    pub failure_balance_transaction: Unmodelled,
    /// The decline's code (`card_declined`, `expired_card`, `incorrect_cvc`,
    /// `processing_error`) or `processing_abandoned`.
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub failure_code: Option<&'a str>,
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub failure_message: Option<&'a str>,
    /// `{}`, or `{"user_report": "fraudulent" | "safe"}` once the merchant
    /// reported it with an update.
    pub fraud_details: &'a FraudDetails,
    pub livemode: bool,
    #[cfg_attr(feature = "openapi", schema(example = json!({"order_id": "6735"})))]
    pub metadata: &'a BTreeMap<String, String>,
    pub on_behalf_of: Unmodelled,
    /// What the card network (or the fraud check) said; `null` while the
    /// charge is pending and for an abandoned one, which no network answered.
    pub outcome: Option<ChargeOutcome>,
    /// The charge succeeded.
    pub paid: bool,
    pub payment_intent: Unmodelled,
    /// The card's id, `card_...` (the same as `source.id`).
    #[cfg_attr(feature = "openapi", schema(example = "card_FSqF13LohwPRt53icfinsfKa"))]
    pub payment_method: Option<String>,
    pub payment_method_details: Option<PaymentMethodDetails>,
    /// Where the receipt goes; oncepay sends none.
    #[cfg_attr(feature = "openapi", schema(example = "jenny.rosen@example.com"))]
    pub receipt_email: Option<&'a str>,
    pub receipt_number: Unmodelled,
    pub receipt_url: Unmodelled,
    pub refunded: bool,
    /// The charge's refunds, newest first, as a list object.
    pub refunds: RefundList<'a>,
    pub review: Unmodelled,
    pub shipping: Option<&'a Shipping>,
    /// The card charged, as a card object.
    pub source: Option<SourceCard>,
    pub source_transfer: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub statement_descriptor: Option<&'a str>,
    #[cfg_attr(feature = "openapi", schema(example = "ORDER 6735"))]
    pub statement_descriptor_suffix: Option<&'a str>,
    #[cfg_attr(feature = "openapi", schema(schema_with = charge_status))]
    pub status: &'a str,
    pub transfer_data: Unmodelled,
    #[cfg_attr(feature = "openapi", schema(example = "order-6735"))]
    pub transfer_group: Option<&'a str>,
}

/// The charge's statement descriptor when the merchant sets none.
pub const STATEMENT_DESCRIPTOR: &str = "ONCEPAY";

/// How many of a charge's refunds its object lists, as Stripe does.
pub const EMBEDDED_REFUNDS: usize = 10;

/// A charge's refunds as its object embeds them, newest first: the first
/// 10, with `has_more` for the rest.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RefundList<'a> {
    #[cfg_attr(feature = "openapi", schema(example = "list"))]
    pub object: &'static str,
    pub data: Vec<RefundObject<'a>>,
    pub has_more: bool,
    /// `/v1/charges/{id}/refunds`.
    pub url: String,
}

/// Billing details: oncepay takes none, so every member is null.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BillingDetails {
    pub address: Address,
    pub email: Unmodelled,
    pub name: Unmodelled,
    pub phone: Unmodelled,
    pub tax_id: Unmodelled,
}

/// An address oncepay does not know: every member null.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Address {
    pub city: Unmodelled,
    pub country: Unmodelled,
    pub line1: Unmodelled,
    pub line2: Unmodelled,
    pub postal_code: Unmodelled,
    pub state: Unmodelled,
}

const NO_BILLING_DETAILS: BillingDetails = BillingDetails {
    address: Address {
        city: Unmodelled,
        country: Unmodelled,
        line1: Unmodelled,
        line2: Unmodelled,
        postal_code: Unmodelled,
        state: Unmodelled,
    },
    email: Unmodelled,
    name: Unmodelled,
    phone: Unmodelled,
    tax_id: Unmodelled,
};

/// Stripe's outcome of the authorization.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ChargeOutcome {
    pub advice_code: Unmodelled,
    pub network_advice_code: Unmodelled,
    pub network_decline_code: Unmodelled,
    /// `approved_by_network`, `declined_by_network` or `not_sent_to_network`.
    #[cfg_attr(feature = "openapi", schema(example = "approved_by_network"))]
    pub network_status: &'static str,
    /// The decline code, or `highest_risk_level` for a charge blocked as fraud; null when authorized.
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub reason: Option<&'static str>,
    /// `normal`, or `highest` for a charge blocked as fraud.
    #[cfg_attr(feature = "openapi", schema(example = "normal"))]
    pub risk_level: &'static str,
    #[cfg_attr(feature = "openapi", schema(example = "Payment complete."))]
    pub seller_message: &'static str,
    /// `authorized`, `issuer_declined` or `blocked`.
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(example = "authorized"))]
    pub kind: &'static str,
}

impl<'a> ChargeObject<'a> {
    /// The object of the charge `facts` describe, with `refunds`, the
    /// charge's refunds, newest first (the first [`EMBEDDED_REFUNDS`] are
    /// shown). Ids derived from the charge's (`card_...`, `txn_...`) are the
    /// same at every render.
    pub fn new(
        facts: ChargeFacts<'a>,
        refunds: impl ExactSizeIterator<Item = RefundObject<'a>>,
    ) -> Self {
        let paid = facts.paid;
        let captured = facts.amount_captured > 0;
        // Refunded in full: all a capture took (a partial capture's rest was
        // released, not refunded), or all of an authorization never captured.
        let refundable = if captured {
            facts.amount_captured
        } else {
            facts.amount
        };
        let suffix = facts.id.strip_prefix("ch_").unwrap_or(facts.id);
        let source = facts
            .token
            .map(|token| SourceCard::new(token, format!("card_{suffix}")));
        ChargeObject {
            id: facts.id,
            object: "charge",
            amount: facts.amount,
            amount_captured: facts.amount_captured,
            amount_refunded: facts.amount_refunded,
            application: Unmodelled,
            application_fee: Unmodelled,
            application_fee_amount: Unmodelled,
            balance_transaction: captured.then(|| format!("txn_{suffix}")),
            billing_details: NO_BILLING_DETAILS,
            calculated_statement_descriptor: captured.then(|| {
                details::calculated_statement_descriptor(
                    STATEMENT_DESCRIPTOR,
                    facts.statement_descriptor,
                    facts.statement_descriptor_suffix,
                )
            }),
            captured,
            created: facts.created,
            currency: facts.currency,
            customer: Unmodelled,
            description: facts.description,
            disputed: false,
            failure_balance_transaction: Unmodelled,
            failure_code: facts.failure_code,
            failure_message: facts.failure_message,
            fraud_details: facts.fraud_details,
            livemode: false,
            metadata: facts.metadata,
            on_behalf_of: Unmodelled,
            outcome: facts.verdict.map(ChargeOutcome::from),
            paid,
            payment_intent: Unmodelled,
            payment_method: source.as_ref().map(|card| card.id.clone()),
            payment_method_details: facts
                .token
                .map(|token| PaymentMethodDetails::new(token, facts.amount, paid)),
            receipt_email: facts.receipt_email,
            receipt_number: Unmodelled,
            receipt_url: Unmodelled,
            refunded: facts.amount_refunded > 0 && facts.amount_refunded == refundable,
            refunds: RefundList::new(facts.id, refunds),
            review: Unmodelled,
            shipping: facts.shipping,
            source,
            source_transfer: Unmodelled,
            statement_descriptor: facts.statement_descriptor,
            statement_descriptor_suffix: facts.statement_descriptor_suffix,
            status: facts.status,
            transfer_data: Unmodelled,
            transfer_group: facts.transfer_group,
        }
    }
}

impl<'a> RefundList<'a> {
    /// The list that the charge `charge_id`'s object embeds of `refunds`
    /// (the charge's, newest first).
    fn new(charge_id: &str, refunds: impl ExactSizeIterator<Item = RefundObject<'a>>) -> Self {
        let has_more = refunds.len() > EMBEDDED_REFUNDS;
        RefundList {
            object: "list",
            data: refunds.take(EMBEDDED_REFUNDS).collect(),
            has_more,
            url: format!("/v1/charges/{charge_id}/refunds"),
        }
    }
}

impl From<Verdict> for ChargeOutcome {
    fn from(verdict: Verdict) -> Self {
        ChargeOutcome {
            advice_code: Unmodelled,
            network_advice_code: Unmodelled,
            network_decline_code: Unmodelled,
            network_status: verdict.network_status,
            reason: verdict.reason,
            risk_level: verdict.risk_level,
            seller_message: verdict.seller_message,
            kind: verdict.kind,
        }
    }
}

/// The schema of a charge's `status`: the core's `ChargeStatus`.
#[cfg(feature = "openapi")]
fn charge_status() -> utoipa::openapi::Ref {
    core_schema("ChargeStatus")
}

/// What a refund's object is built from: the stored refund, in the API's terms.
#[derive(Clone, Copy, Debug)]
pub struct RefundFacts<'a> {
    /// `re_` and 24 letters or digits.
    pub id: &'a str,
    pub amount: i64,
    /// The charge refunded.
    pub charge: &'a str,
    /// Unix seconds.
    pub created: i64,
    pub currency: &'a str,
    pub failure_reason: Option<&'a str>,
    pub metadata: &'a BTreeMap<String, String>,
    pub reason: Option<&'a str>,
    /// `pending`, `succeeded` or `failed`.
    pub status: &'a str,
    /// The refund succeeded: the money went back to the card.
    pub succeeded: bool,
}

/// The refund object of the API: every field of Stripe's refund, in
/// Stripe's order (`id`, `object`, then by name); what oncepay does not
/// model is `null` (see docs/decisions.md).
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Refund))]
pub struct RefundObject<'a> {
    /// `re_` and 24 letters or digits.
    #[cfg_attr(feature = "openapi", schema(example = "re_3Kq8ZtLbVn2WcXy7Hd0PfRsA"))]
    pub id: &'a str,
    #[cfg_attr(feature = "openapi", schema(example = "refund"))]
    pub object: &'static str,
    /// Integer minor units.
    #[cfg_attr(feature = "openapi", schema(example = 500))]
    pub amount: i64,
    /// `txn_...` once the refund succeeded, `null` otherwise.
    #[cfg_attr(feature = "openapi", schema(example = "txn_3Kq8ZtLbVn2WcXy7Hd0PfRsA"))]
    pub balance_transaction: Option<String>,
    /// The charge refunded.
    #[cfg_attr(feature = "openapi", schema(example = "ch_FSqF13LohwPRt53icfinsfKa"))]
    pub charge: &'a str,
    /// Unix seconds.
    #[cfg_attr(feature = "openapi", schema(example = 1764892800))]
    pub created: i64,
    #[cfg_attr(feature = "openapi", schema(example = "usd"))]
    pub currency: &'a str,
    pub customer: Unmodelled,
    pub customer_account: Unmodelled,
    /// Where the money goes back: the card charged.
    pub destination_details: DestinationDetails,
    /// Why the refund failed (`declined`), else null.
    #[cfg_attr(feature = "openapi", schema(example = json!(null)))]
    pub failure_reason: Option<&'a str>,
    #[cfg_attr(feature = "openapi", schema(example = json!({"order_id": "6735"})))]
    pub metadata: &'a BTreeMap<String, String>,
    pub payment_intent: Unmodelled,
    pub payment_method: Unmodelled,
    /// `duplicate`, `fraudulent` or `requested_by_customer`, as asked, or
    /// `expired_uncaptured_charge` for the sweeper's release of an expired
    /// authorization.
    #[cfg_attr(feature = "openapi", schema(example = "requested_by_customer"))]
    pub reason: Option<&'a str>,
    pub receipt_number: Unmodelled,
    pub source_transfer_reversal: Unmodelled,
    /// `failed` when the card's issuer refused the refund; its amount can be
    /// refunded again.
    #[cfg_attr(feature = "openapi", schema(schema_with = refund_status))]
    pub status: &'a str,
    pub transfer_reversal: Unmodelled,
}

/// Where a refund's money goes: back to the card.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DestinationDetails {
    pub card: CardRefund,
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(example = "card"))]
    pub kind: &'static str,
}

/// A refund to a card: oncepay's card gateway refunds a settled payment
/// (`refund`), never reverses an authorization.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CardRefund {
    /// Always `refund`.
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(example = "refund"))]
    pub kind: &'static str,
}

impl<'a> RefundObject<'a> {
    /// The object of the refund `facts` describe.
    pub fn new(facts: RefundFacts<'a>) -> Self {
        let suffix = facts.id.strip_prefix("re_").unwrap_or(facts.id);
        RefundObject {
            id: facts.id,
            object: "refund",
            amount: facts.amount,
            balance_transaction: facts.succeeded.then(|| format!("txn_{suffix}")),
            charge: facts.charge,
            created: facts.created,
            currency: facts.currency,
            customer: Unmodelled,
            customer_account: Unmodelled,
            destination_details: DestinationDetails {
                card: CardRefund { kind: "refund" },
                kind: "card",
            },
            failure_reason: facts.failure_reason,
            metadata: facts.metadata,
            payment_intent: Unmodelled,
            payment_method: Unmodelled,
            reason: facts.reason,
            receipt_number: Unmodelled,
            source_transfer_reversal: Unmodelled,
            status: facts.status,
            transfer_reversal: Unmodelled,
        }
    }
}

/// The schema of a refund's `status`: the core's `RefundStatus`, described
/// by the field's own words (`schema_with` does not read its comment).
#[cfg(feature = "openapi")]
fn refund_status() -> utoipa::openapi::Ref {
    let mut status = core_schema("RefundStatus");
    status.description =
        "`failed` when the card's issuer refused the refund; its amount can be\nrefunded again."
            .to_owned();
    status
}

/// The event object of the API, in Stripe's shape: what happened to a
/// charge or a refund, one event per final state change, written in the
/// same transaction as the change, never changed afterwards.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Event))]
pub struct EventObject<'a> {
    /// `evt_` and 24 letters or digits.
    #[cfg_attr(feature = "openapi", schema(example = "evt_1NbB3eCTYkz2mVgqA8rW0hXp"))]
    pub id: &'a str,
    #[cfg_attr(feature = "openapi", schema(example = "event"))]
    pub object: &'static str,
    /// Always null: oncepay renders its objects one way only, so no version is named.
    pub api_version: Option<&'static str>,
    /// Unix seconds: when the change was made.
    #[cfg_attr(feature = "openapi", schema(example = 1764892800))]
    pub created: i64,
    pub data: EventData<'a>,
    pub livemode: bool,
    /// Webhook deliveries the event was given when it was written, one per
    /// endpoint that enabled its type then; fixed, like the rest of the
    /// event (where each stands: `/v1/events/{id}/deliveries`).
    #[cfg_attr(feature = "openapi", schema(minimum = 0, example = 1))]
    pub pending_webhooks: i32,
    pub request: EventRequest<'a>,
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(schema_with = event_type))]
    pub kind: &'static str,
}

/// The object the event is about, as the API rendered it at that moment.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventData<'a> {
    #[cfg_attr(feature = "openapi", schema(schema_with = charge_or_refund))]
    pub object: &'a Value,
}

/// The schema of an event's `data.object`: a charge or a refund.
#[cfg(feature = "openapi")]
fn charge_or_refund() -> utoipa::openapi::schema::Schema {
    use utoipa::ToSchema;
    use utoipa::openapi::Ref;
    utoipa::openapi::schema::OneOfBuilder::new()
        .item(Ref::from_schema_name(ChargeObject::name()))
        .item(Ref::from_schema_name(RefundObject::name()))
        .description(Some(
            "A charge for `charge.*` events, a refund for `refund.*` events",
        ))
        .build()
        .into()
}

/// The API request that settled the object.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventRequest<'a> {
    /// Its `X-Request-Id`; null when the sweeper settled the object.
    #[cfg_attr(
        feature = "openapi",
        schema(example = "0b6f3a52-5d1e-4c8a-9a57-2f1d8e4b7c90")
    )]
    pub id: Option<&'a str>,
    /// The key that guards the object, if it has one.
    #[cfg_attr(feature = "openapi", schema(example = "order-6735-charge"))]
    pub idempotency_key: Option<&'a str>,
}

impl<'a> EventObject<'a> {
    /// The object of the event `id` of type `kind`, made at `created` (Unix
    /// seconds) about `object` (a charge's or refund's object, as rendered
    /// then) by `request`, with the `pending_webhooks` it was given.
    pub fn new(
        id: &'a str,
        kind: &'static str,
        created: i64,
        object: &'a Value,
        pending_webhooks: i32,
        request: EventRequest<'a>,
    ) -> Self {
        EventObject {
            id,
            object: "event",
            api_version: None,
            created,
            data: EventData { object },
            livemode: false,
            pending_webhooks,
            request,
            kind,
        }
    }
}

/// The schema of an event's `type`: the core's `EventType`.
#[cfg(feature = "openapi")]
fn event_type() -> utoipa::openapi::Ref {
    core_schema("EventType")
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_FRAUD_DETAILS: FraudDetails = FraudDetails { user_report: None };

    fn visa_charge(metadata: &BTreeMap<String, String>, paid: bool) -> ChargeFacts<'_> {
        ChargeFacts {
            id: "ch_abc",
            amount: 2000,
            amount_refunded: 0,
            created: 1_764_892_800,
            currency: "usd",
            description: None,
            failure_code: None,
            failure_message: None,
            metadata,
            amount_captured: if paid { 2000 } else { 0 },
            paid,
            status: if paid { "succeeded" } else { "pending" },
            token: Some(TestToken::Visa),
            verdict: paid.then(|| TestToken::Visa.verdict()),
            receipt_email: None,
            statement_descriptor: None,
            statement_descriptor_suffix: None,
            shipping: None,
            transfer_group: None,
            fraud_details: &NO_FRAUD_DETAILS,
        }
    }

    fn refund<'a>(metadata: &'a BTreeMap<String, String>, id: &'a str) -> RefundObject<'a> {
        RefundObject::new(RefundFacts {
            id,
            amount: 10,
            charge: "ch_abc",
            created: 1_764_892_800,
            currency: "usd",
            failure_reason: None,
            metadata,
            reason: None,
            status: "succeeded",
            succeeded: true,
        })
    }

    #[test]
    fn a_paid_charge_shows_the_ids_derived_from_its_own_and_a_pending_one_none() {
        let metadata = BTreeMap::new();
        let paid = ChargeObject::new(visa_charge(&metadata, true), std::iter::empty());
        let paid = serde_json::to_value(paid).unwrap();
        assert_eq!(paid["payment_method"], "card_abc");
        assert_eq!(paid["source"]["id"], "card_abc");
        assert_eq!(paid["balance_transaction"], "txn_abc");
        assert_eq!(paid["outcome"]["type"], "authorized");
        let pending = ChargeObject::new(visa_charge(&metadata, false), std::iter::empty());
        let pending = serde_json::to_value(pending).unwrap();
        assert_eq!(pending["payment_method"], "card_abc");
        assert_eq!(pending["balance_transaction"], serde_json::Value::Null);
        assert_eq!(pending["outcome"], serde_json::Value::Null);
        assert_eq!(pending["amount_captured"], 0);
    }

    #[test]
    fn a_charge_embeds_its_first_ten_refunds_and_says_there_are_more() {
        let metadata = BTreeMap::new();
        let ids: Vec<String> = (0..11).map(|n| format!("re_{n}")).collect();
        let refunds = ids.iter().map(|id| refund(&metadata, id));
        let charge = ChargeObject::new(visa_charge(&metadata, true), refunds);
        assert_eq!(charge.refunds.data.len(), EMBEDDED_REFUNDS);
        assert_eq!(
            charge.refunds.data[0].balance_transaction.as_deref(),
            Some("txn_0")
        );
        assert!(charge.refunds.has_more);
        assert_eq!(charge.refunds.url, "/v1/charges/ch_abc/refunds");
    }
}
