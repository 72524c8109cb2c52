//! What a settle did, for both records that settle (charges and refunds):
//! the one type their settles return and recovery reads, so neither imports
//! the other's settle for it.

use crate::idempotency::SavedResponse;

/// What settling a record (a charge or a refund) did.
#[derive(Debug)]
pub enum Settled {
    /// This call settled the record; here is its response.
    Now(SavedResponse),
    /// The record had been settled already; nothing was written.
    Already,
}
