//! What a settle did, and the answer a created record's key saves: shared by
//! both records' settles, so neither imports the other's.

use http::StatusCode;
use serde::Serialize;

use crate::idempotency::SavedResponse;

/// What settling a record (a charge or a refund) did.
#[derive(Debug)]
pub enum Settled {
    /// This call settled the record; here is its response.
    Now(SavedResponse),
    /// The record had been settled already; nothing was written.
    Already,
}

/// The `201` of a created record: where it lives, and its API object.
pub fn created(location: String, object: &impl Serialize) -> SavedResponse {
    SavedResponse {
        status: StatusCode::CREATED.as_u16(),
        content_type: "application/json".into(),
        location: Some(location),
        body: serde_json::to_vec(object)
            .expect("an API object serialises")
            .into(),
    }
}

/// The `200` of an operation on a record that exists: its API object.
pub fn ok(object: &impl Serialize) -> SavedResponse {
    SavedResponse {
        status: StatusCode::OK.as_u16(),
        content_type: "application/json".into(),
        location: None,
        body: serde_json::to_vec(object)
            .expect("an API object serialises")
            .into(),
    }
}
