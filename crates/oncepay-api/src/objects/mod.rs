//! The objects the API sends, in Stripe's shapes: the refund
//! ([`RefundObject`]), with the parts it nests.
//!
//! Each is built from plain facts that the core's stored record hands over
//! (`Refund::to_object` and the like): the shapes are the API's vocabulary,
//! and the core keeps what it stores. Every field of Stripe's object is
//! present, in Stripe's order (`id`, `object`, then by name); what oncepay
//! does not model is [`Unmodelled`] (`null`). docs/decisions.md ("Stripe's
//! object shapes") says which fields and why.
//!
//! The statuses and the event types are the core's (sqlx reads them, and
//! they are stored under the names the API shows), so an object holds them
//! as those names, and its schema refers to the core's by name.

use std::collections::BTreeMap;

use serde::Serialize;

/// A field Stripe has and oncepay does not model: always `null` (serde
/// writes a unit struct as `null`).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Unmodelled;

/// Its schema: `null`, and nothing else.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for Unmodelled {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Null)
            .description(Some(
                "Always null: a field of Stripe's that oncepay does not model",
            ))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for Unmodelled {}

/// A reference to the core's schema `name` (`ChargeStatus`, `RefundStatus`,
/// `EventType`), which the server's document registers beside the objects.
#[cfg(feature = "openapi")]
fn core_schema(name: &str) -> utoipa::openapi::Ref {
    utoipa::openapi::Ref::from_schema_name(name)
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
    /// `duplicate`, `fraudulent` or `requested_by_customer`, as asked.
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
