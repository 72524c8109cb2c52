//! What a refund is: its parameters as the server's edge validated them
//! (`http/input.rs`), and its stored row, which hands its facts to the
//! API's refund object (`oncepay_api::objects`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::amount::Amount;
use crate::objects::{RefundFacts, RefundObject};
use crate::params::new_id;

/// Why a refund was asked for, with Stripe's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundReason {
    Duplicate,
    Fraudulent,
    RequestedByCustomer,
    /// The sweeper's release of an authorization left uncaptured past
    /// `CAPTURE_WINDOW`; no client may give it.
    ExpiredUncapturedCharge,
}

crate::stored_as_text!(RefundReason {
    Duplicate => "duplicate",
    Fraudulent => "fraudulent",
    RequestedByCustomer => "requested_by_customer",
    ExpiredUncapturedCharge => "expired_uncaptured_charge",
});

impl RefundReason {
    /// The reason a client's name names, if any: not the sweeper's own.
    pub fn parse(name: &str) -> Option<Self> {
        use RefundReason::*;
        [Duplicate, Fraudulent, RequestedByCustomer]
            .into_iter()
            .find(|reason| reason.as_str() == name)
    }
}

/// The parameters of `POST /v1/refunds`, validated. The API's document
/// describes them under the name `CreateRefund`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = CreateRefund, description = "The parameters of `POST /v1/refunds`, as JSON or as a form."))]
pub struct NewRefund {
    /// The id of a succeeded charge.
    // As given: whether it exists, is the merchant's and can be refunded is
    // decided by the reservation, not here.
    #[cfg_attr(feature = "openapi", schema(example = "ch_FSqF13LohwPRt53icfinsfKa"))]
    pub charge: String,
    /// Integer minor units; default: what is left to refund.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<i64>, minimum = 1, example = 500))]
    pub amount: Option<Amount>,
    /// `duplicate`, `fraudulent` or `requested_by_customer`.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, example = "requested_by_customer"))]
    pub reason: Option<RefundReason>,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<BTreeMap<String, String>>, example = json!({"order_id": "6735"})))]
    pub metadata: BTreeMap<String, String>,
}

impl NewRefund {
    /// The encoding the fingerprint hashes (see [`crate::charges::NewCharge::canonical`]):
    /// an absent amount and an explicit one equal to what is left are different requests.
    pub fn canonical(&self) -> Vec<u8> {
        let canonical = serde_json::json!([
            self.charge,
            self.amount.map(Amount::minor_units),
            self.reason.map(RefundReason::as_str),
            self.metadata,
        ]);
        serde_json::to_vec(&canonical).expect("serialising a JSON value cannot fail")
    }
}

/// A refund's lifecycle: `pending` from the reservation until the processor
/// answers; then `succeeded`, or `failed` when the card's issuer refused it
/// for good (its reservation is given back on the charge).
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type)]
// The API's objects name this schema (`oncepay_api::objects`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(rename_all = "lowercase"))]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum RefundStatus {
    Pending,
    Succeeded,
    Failed,
}

crate::stored_as_text!(RefundStatus {
    Pending => "pending",
    Succeeded => "succeeded",
    Failed => "failed",
});

/// A refund as stored.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct Refund {
    pub id: String,
    /// Who owns it; not part of the API object.
    pub merchant_id: Uuid,
    pub charge_id: String,
    pub amount: i64,
    pub currency: String,
    pub status: RefundStatus,
    pub reason: Option<String>,
    pub metadata: sqlx::types::Json<BTreeMap<String, String>>,
    pub created_at: DateTime<Utc>,
    /// Why the refund failed, when it did (Stripe's `failure_reason`).
    pub failure_reason: Option<String>,
}

impl Refund {
    /// The API object.
    pub fn to_object(&self) -> RefundObject<'_> {
        RefundObject::new(RefundFacts {
            id: &self.id,
            amount: self.amount,
            charge: &self.charge_id,
            created: self.created_at.timestamp(),
            currency: &self.currency,
            failure_reason: self.failure_reason.as_deref(),
            metadata: &self.metadata.0,
            reason: self.reason.as_deref(),
            status: self.status.as_str(),
            succeeded: self.status == RefundStatus::Succeeded,
        })
    }
}

/// A new refund id: `re_` and 24 random letters and digits.
pub fn new_refund_id() -> String {
    new_id("re")
}
