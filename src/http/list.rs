//! Stripe's list object: one page of a resource's objects, and whether
//! there are more.

use serde::Serialize;
use utoipa::ToSchema;

/// A page of objects, in Stripe's list shape.
#[derive(Serialize, ToSchema)]
pub struct List<T> {
    #[schema(example = "list")]
    pub object: &'static str,
    /// The route the page was read from, e.g. `/v1/charges`.
    pub url: String,
    /// Whether objects beyond this page remain.
    pub has_more: bool,
    pub data: Vec<T>,
}

impl<T> List<T> {
    /// The page `data` of the list at `url`.
    pub fn new(url: impl Into<String>, has_more: bool, data: Vec<T>) -> Self {
        List {
            object: "list",
            url: url.into(),
            has_more,
            data,
        }
    }
}
