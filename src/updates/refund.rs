//! `POST /v1/refunds/{id}`: a refund's metadata, changed in the claim's
//! transaction, with a `refund.updated` event when it changed.

use sqlx::PgConnection;
use uuid::Uuid;

use super::{Asker, answer, no_such};
use crate::events::{EventType, NewEvent, store as events};
use oncepay_core::error::Error;
use oncepay_core::idempotency::SavedResponse;
use oncepay_core::operation::write::Write;
use oncepay_core::params::MetadataUpdate;
use oncepay_core::refunds::{Refund, store};

/// The validated parameters of `POST /v1/refunds/{id}`. The API's document
/// describes them under the name `UpdateRefund`.
#[derive(Clone, Debug, Default, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = UpdateRefund, description = "The parameters of `POST /v1/refunds/{id}`, as JSON or as a form.")]
pub struct RefundUpdate {
    /// Merged into the refund's: a key given `""` is removed, and
    /// `metadata=""` removes every key. At most 50 keys once merged.
    #[schema(value_type = Option<BTreeMap<String, String>>, example = json!({"ticket": "T-1042"}))]
    pub metadata: Option<MetadataUpdate>,
}

/// An update of one of a merchant's refunds.
#[derive(Debug)]
pub struct UpdateRefund {
    pub merchant_id: Uuid,
    pub id: String,
    pub update: RefundUpdate,
    pub asker: Asker,
}

impl Write for UpdateRefund {
    const ROUTE: &'static str = "/v1/refunds/{id}";

    fn canonical(&self) -> Vec<u8> {
        let metadata = self.update.metadata.as_ref().map(MetadataUpdate::canonical);
        serde_json::to_vec(&serde_json::json!([self.id, metadata])).expect("plain JSON serialises")
    }

    async fn write(&self, tx: &mut PgConnection) -> Result<SavedResponse, Error> {
        let Some(refund) = lock(tx, self.merchant_id, &self.id).await? else {
            return Err(no_such("refund", &self.id).into());
        };
        let mut updated = refund.clone();
        if let Some(metadata) = &self.update.metadata {
            updated.metadata.0 = metadata.apply(&refund.metadata.0)?;
        }
        let object = updated.to_object();
        // An update that changes nothing writes nothing, and no event.
        if updated.metadata != refund.metadata {
            save_metadata(tx, &updated).await?;
            let event = NewEvent::new(EventType::RefundUpdated, &updated.id, &object);
            let (request_id, key) = (self.asker.request_id.as_deref(), self.asker.key.as_deref());
            events::insert(tx, self.merchant_id, request_id, key, &[event]).await?;
        }
        Ok(answer(&object))
    }
}

/// The merchant's refund `id`, its row locked for the rest of the
/// transaction, so that two updates at once apply one after the other.
async fn lock(tx: &mut PgConnection, merchant_id: Uuid, id: &str) -> sqlx::Result<Option<Refund>> {
    let locked = sqlx::query_scalar!(
        "SELECT id FROM refunds WHERE merchant_id = $1 AND id = $2 FOR NO KEY UPDATE",
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

async fn save_metadata(tx: &mut PgConnection, refund: &Refund) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE refunds SET metadata = $2 WHERE id = $1",
        refund.id,
        &refund.metadata as _,
    )
    .execute(tx)
    .await?;
    Ok(())
}
