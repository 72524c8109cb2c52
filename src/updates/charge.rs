//! `POST /v1/charges/{id}`: a charge's description, metadata, receipt
//! email, shipping and fraud report, changed in the claim's transaction,
//! with a `charge.updated` event when anything changed.

use sqlx::PgConnection;
use uuid::Uuid;

use super::{Asker, answer, no_such};
use crate::events::{EventType, NewEvent, store as events};
use oncepay_core::charges::{Charge, store};
use oncepay_core::error::Error;
use oncepay_core::idempotency::SavedResponse;
use oncepay_core::objects::details::{FraudDetails, Shipping, UserReport};
use oncepay_core::operation::write::Write;
use oncepay_core::params::MetadataUpdate;
use oncepay_core::refunds::store as refunds;

/// The validated parameters of `POST /v1/charges/{id}`: what to change, each
/// `None` when not given. `Some(None)` removes a value (it was given `""`).
/// The API's document describes them under the name `UpdateCharge`.
#[derive(Clone, Debug, Default, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = UpdateCharge, description = "The parameters of `POST /v1/charges/{id}`, as JSON or as a form. Each one given is changed; `\"\"` removes a value.")]
pub struct ChargeUpdate {
    /// Up to 1000 characters; `""` removes it.
    #[schema(value_type = Option<String>, max_length = 1000, example = "Order 6735, gift-wrapped")]
    pub description: Option<Option<String>>,
    /// Merged into the charge's: a key given `""` is removed, and
    /// `metadata=""` removes every key. At most 50 keys once merged.
    #[schema(value_type = Option<BTreeMap<String, String>>, example = json!({"order_id": "6735", "coupon": ""}))]
    pub metadata: Option<MetadataUpdate>,
    /// An email address; `""` removes it.
    #[schema(value_type = Option<String>, max_length = 512, example = "jenny.rosen@example.com")]
    pub receipt_email: Option<Option<String>>,
    /// Where the goods ship, replacing what the charge had; `""` removes it.
    #[schema(value_type = Option<Shipping>)]
    pub shipping: Option<Option<Shipping>>,
    /// `{"user_report": "fraudulent" | "safe"}`: the merchant's report.
    #[schema(value_type = Option<FraudDetails>)]
    pub fraud_details: Option<UserReport>,
}

impl ChargeUpdate {
    /// The parameters in a canonical form, for the key's fingerprint.
    fn canonical(&self) -> serde_json::Value {
        serde_json::json!([
            self.description,
            self.metadata.as_ref().map(MetadataUpdate::canonical),
            self.receipt_email,
            self.shipping,
            self.fraud_details,
        ])
    }

    /// `charge` once this update applies; `metadata_invalid` if its
    /// metadata would break the limits.
    fn apply(&self, charge: &Charge) -> Result<Charge, Error> {
        let mut updated = charge.clone();
        if let Some(description) = &self.description {
            updated.description = description.clone();
        }
        if let Some(metadata) = &self.metadata {
            updated.metadata.0 = metadata.apply(&charge.metadata.0)?;
        }
        if let Some(email) = &self.receipt_email {
            updated.receipt_email = email.clone();
        }
        if let Some(shipping) = &self.shipping {
            updated.shipping = shipping.clone().map(sqlx::types::Json);
        }
        if let Some(report) = self.fraud_details {
            updated.fraud_details.0.user_report = Some(report);
        }
        Ok(updated)
    }
}

/// An update of one of a merchant's charges.
#[derive(Debug)]
pub struct UpdateCharge {
    pub merchant_id: Uuid,
    pub id: String,
    pub update: ChargeUpdate,
    pub asker: Asker,
}

impl Write for UpdateCharge {
    const ROUTE: &'static str = "/v1/charges/{id}";

    fn canonical(&self) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!([self.id, self.update.canonical()]))
            .expect("plain JSON serialises")
    }

    async fn write(&self, tx: &mut PgConnection) -> Result<SavedResponse, Error> {
        let Some(charge) = lock(tx, self.merchant_id, &self.id).await? else {
            return Err(no_such("charge", &self.id).into());
        };
        let updated = self.update.apply(&charge)?;
        let refunds = refunds::of_charges(&mut *tx, std::slice::from_ref(&charge.id)).await?;
        let object = updated.to_object(&refunds);
        // An update that changes nothing writes nothing, and no event.
        if serde_json::to_value(&object).ok()
            != serde_json::to_value(charge.to_object(&refunds)).ok()
        {
            save(tx, &updated).await?;
            let event = NewEvent::new(EventType::ChargeUpdated, &updated.id, &object);
            let (request_id, key) = (self.asker.request_id.as_deref(), self.asker.key.as_deref());
            events::insert(tx, self.merchant_id, request_id, key, &[event]).await?;
        }
        Ok(answer(&object))
    }
}

/// The merchant's charge `id`, its row locked for the rest of the
/// transaction, so that two updates at once apply one after the other.
async fn lock(tx: &mut PgConnection, merchant_id: Uuid, id: &str) -> sqlx::Result<Option<Charge>> {
    let locked = sqlx::query_scalar!(
        "SELECT id FROM charges WHERE merchant_id = $1 AND id = $2 FOR NO KEY UPDATE",
        merchant_id,
        id,
    )
    .fetch_optional(&mut *tx)
    .await?;
    match locked {
        Some(_) => store::find(&mut *tx, merchant_id, id).await,
        None => Ok(None),
    }
}

/// Writes what an update may change of `charge`.
async fn save(tx: &mut PgConnection, charge: &Charge) -> sqlx::Result<()> {
    sqlx::query!(
        r#"UPDATE charges
              SET description = $2, metadata = $3, receipt_email = $4, shipping = $5,
                  fraud_details = $6
            WHERE id = $1"#,
        charge.id,
        charge.description,
        &charge.metadata as _,
        charge.receipt_email,
        charge.shipping.as_ref() as _,
        &charge.fraud_details as _,
    )
    .execute(tx)
    .await?;
    Ok(())
}
