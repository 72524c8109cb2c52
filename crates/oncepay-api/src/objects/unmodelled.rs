//! What oncepay does not model of Stripe's objects: `null` fields and
//! empty objects.

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

/// Stripe's empty form of an object oncepay does not model: `{}`.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Empty {}
