//! Creating a webhook endpoint, as a guarded [`Write`]: the endpoint and its
//! new signing secret are written in the claim's transaction, and the
//! answer (the one that shows the secret) is saved on the key with them.

use sqlx::PgConnection;
use uuid::Uuid;

use crate::webhooks::domain::{MAX_ENDPOINTS, NewEndpoint, new_endpoint_id, new_secret};
use crate::webhooks::store;
use oncepay_core::error::Error;
use oncepay_core::idempotency::SavedResponse;
use oncepay_core::operation::write::Write;
use oncepay_core::problem::{Problem, ProblemCode};

/// An endpoint to create for a merchant.
#[derive(Debug)]
pub struct CreateEndpoint {
    merchant_id: Uuid,
    endpoint: NewEndpoint,
}

impl CreateEndpoint {
    pub fn new(merchant_id: Uuid, endpoint: NewEndpoint) -> Self {
        CreateEndpoint {
            merchant_id,
            endpoint,
        }
    }
}

impl Write for CreateEndpoint {
    const ROUTE: &'static str = "/v1/webhook_endpoints";

    fn canonical(&self) -> Vec<u8> {
        self.endpoint.canonical()
    }

    async fn write(&self, tx: &mut PgConnection) -> Result<SavedResponse, Error> {
        // The id and the secret are made here, in the attempt that commits:
        // a replay answers with the saved ones, never with new ones.
        let id = new_endpoint_id();
        let secret = new_secret();
        let Some(endpoint) =
            store::insert(tx, self.merchant_id, &id, &secret, &self.endpoint).await?
        else {
            return Err(Problem::new(
                ProblemCode::WebhookEndpointLimit,
                format!(
                    "You have {MAX_ENDPOINTS} webhook endpoints, the most allowed; delete one first."
                ),
            )
            .into());
        };
        Ok(SavedResponse {
            status: 201,
            content_type: "application/json".into(),
            location: Some(format!("{}/{}", Self::ROUTE, endpoint.id)),
            body: serde_json::to_vec(&endpoint.to_created_object())
                .expect("an endpoint serialises")
                .into(),
        })
    }
}
