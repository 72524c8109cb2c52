//! Updating a webhook endpoint, as a guarded [`Write`]: its URL, event
//! types, description, metadata, and whether it is disabled, changed in the
//! claim's transaction and answered with the endpoint (without its secret).

use sqlx::PgConnection;
use uuid::Uuid;

use crate::webhooks::domain::{DeliveryEnd, Endpoint, EndpointStatus, EndpointUpdate};
use crate::webhooks::store;
use oncepay_core::error::Error;
use oncepay_core::idempotency::SavedResponse;
use oncepay_core::operation::write::Write;
use oncepay_core::problem::{Problem, ProblemCode};

/// Why an endpoint is disabled when its merchant disabled it (the failing
/// endpoints the worker disables say why in their own words).
pub const DISABLED_BY_MERCHANT: &str = "disabled by the merchant";

/// An update of one of a merchant's endpoints.
#[derive(Debug)]
pub struct UpdateEndpoint {
    pub merchant_id: Uuid,
    pub id: String,
    pub update: EndpointUpdate,
}

impl Write for UpdateEndpoint {
    const ROUTE: &'static str = "/v1/webhook_endpoints/{id}";

    fn canonical(&self) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!([self.id, self.update.canonical()]))
            .expect("plain JSON serialises")
    }

    async fn write(&self, tx: &mut PgConnection) -> Result<SavedResponse, Error> {
        // Deliveries first, then the endpoint: the order recording an
        // attempt locks them in (see `store::delete`), so the two never
        // deadlock.
        let ended = if self.update.disabled == Some(true) {
            store::end_pending_of(
                tx,
                self.merchant_id,
                &self.id,
                DeliveryEnd::EndpointDisabled,
            )
            .await?
        } else {
            0
        };
        let Some(endpoint) = store::lock(tx, self.merchant_id, &self.id).await? else {
            return Err(no_such_endpoint(&self.id));
        };
        let updated = self.apply(endpoint)?;
        store::save(tx, &updated).await?;
        DeliveryEnd::EndpointDisabled.count(ended);
        Ok(SavedResponse {
            status: 200,
            content_type: "application/json".into(),
            location: None,
            body: serde_json::to_vec(&updated.to_object())
                .expect("an endpoint serialises")
                .into(),
        })
    }
}

impl UpdateEndpoint {
    /// `endpoint` once the update applies. Enabling an endpoint starts its
    /// run of failures afresh; disabling one says who did.
    fn apply(&self, mut endpoint: Endpoint) -> Result<Endpoint, Error> {
        let update = &self.update;
        if let Some(url) = &update.url {
            endpoint.url = url.clone();
        }
        if let Some(events) = &update.enabled_events {
            endpoint.enabled_events = events.clone();
        }
        if let Some(description) = &update.description {
            endpoint.description = description.clone();
        }
        if let Some(metadata) = &update.metadata {
            endpoint.metadata.0 = metadata.apply(&endpoint.metadata.0)?;
        }
        match update.disabled {
            Some(true) if endpoint.status != EndpointStatus::Disabled => {
                endpoint.status = EndpointStatus::Disabled;
                endpoint.disabled_reason = Some(DISABLED_BY_MERCHANT.into());
            }
            Some(false) => {
                endpoint.status = EndpointStatus::Enabled;
                endpoint.disabled_reason = None;
            }
            _ => {}
        }
        Ok(endpoint)
    }
}

fn no_such_endpoint(id: &str) -> Error {
    Problem::with_status(
        http::StatusCode::NOT_FOUND,
        ProblemCode::ResourceMissing,
        format!(
            "No such webhook endpoint: '{}'",
            oncepay_core::params::shorten(id)
        ),
    )
    .with_param("id")
    .into()
}
