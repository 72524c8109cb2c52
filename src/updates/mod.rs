//! Updates of what the API already made: a charge's details, a refund's
//! metadata (a webhook endpoint's update is with the webhooks,
//! [`crate::webhooks::update_endpoint`]). Each is a guarded [`Write`]
//! (`oncepay_core::operation::write`): the key's claim, the locked row's change,
//! its event and the saved answer commit together, so a retry with the same
//! key replays the answer and never applies the change twice.
//!
//! [`Write`]: oncepay_core::operation::write::Write

pub mod charge;
pub mod refund;

use oncepay_core::idempotency::SavedResponse;
use oncepay_core::problem::{Problem, ProblemCode};

/// Who asked for an update, as its event names them: the request's
/// `X-Request-Id` and its `Idempotency-Key`.
#[derive(Clone, Debug, Default)]
pub struct Asker {
    pub request_id: Option<String>,
    pub key: Option<String>,
}

/// The `404 resource_missing` of an update whose `noun` `id` the merchant
/// does not have.
fn no_such(noun: &str, id: &str) -> Problem {
    Problem::with_status(
        http::StatusCode::NOT_FOUND,
        ProblemCode::ResourceMissing,
        format!("No such {noun}: '{}'", oncepay_core::params::shorten(id)),
    )
    .with_param("id")
}

/// The `200` an update answers with: the object as it is now.
fn answer(object: &impl serde::Serialize) -> SavedResponse {
    SavedResponse {
        status: 200,
        content_type: "application/json".into(),
        location: None,
        body: serde_json::to_vec(object)
            .expect("an API object serialises")
            .into(),
    }
}
