//! The OpenAPI 3.1 description, generated from the handlers' `#[utoipa::path]`
//! annotations as the router is built (`utoipa_axum::OpenApiRouter`), so a
//! route cannot be served without being described. Served at
//! `GET /openapi.json`, and rendered by Swagger UI at `GET /docs` (see
//! [`swagger_ui`]).
//!
//! Every schema is derived from a type the server really uses (`ToSchema`,
//! `IntoParams`): the objects it serialises, the request bodies' validating
//! types, the problem's body (`oncepay_api::problem::Body`) and the
//! idempotency headers (`IdempotentPost`). What this module writes by hand
//! is the document's frame: its description, the security schemes and the
//! error responses; `scripts/contract` runs schemathesis against the served
//! document.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, Response, ResponseBuilder};
use utoipa::{IntoResponses, Modify, OpenApi, ToResponse, ToSchema};

use crate::events::EventType;
use oncepay_core::charges::ChargeStatus;
use oncepay_core::operation::claim;
use oncepay_core::problem::{self, Body as Problem, ProblemCode, StripeError};
use oncepay_core::refunds::RefundStatus;
use oncepay_core::retry_after;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "oncepay",
        description = "A payments API that charges a card exactly once, however often a client retries. \
Send an `Idempotency-Key` (one per logical operation) with every POST: a retry gets the saved answer \
(`Idempotent-Replayed: true`), a duplicate still in flight gets `409` with `Retry-After` (or waits, with \
`Prefer: wait=N`), and a key reused with other parameters gets `422` (`400` with a `Stripe-Version` header, \
as the Stripe SDKs expect). A create answers `201` (`200` with a `Stripe-Version` header, as Stripe does); \
every answer to a request with an `Idempotency-Key` repeats it, and a replay names the `Original-Request`. Every error is `application/problem+json` with a stable `code`, and the same error \
in Stripe's shape under `error`; see the `Problem` schema for the list. Every response carries `Request-Id` \
(the same as `X-Request-Id`); every error carries `Stripe-Should-Retry`: `true` on `409`, `429` and `5xx`, \
`false` on every other `4xx`. Each merchant's requests are rate limited, reads and writes apart: the excess \
gets `429 rate_limit` with `Retry-After`.",
        license(name = "MIT")
    ),
    modifiers(&Security),
    // Every operation takes the merchant's key, but those that say
    // `security(())`: health, metrics, this document and the workshop's
    // page and receivers.
    security(("bearer" = []), ("basic" = [])),
    // The statuses and event types are the core's; the objects refer to them
    // by name (see `oncepay_api::objects`).
    components(
        schemas(Problem, StripeError, ProblemCode, ChargeStatus, RefundStatus, EventType),
        responses(
            BadRequest, Unauthorized, Forbidden, PaymentFailed, NotFound, InFlight, TooLarge,
            UnsupportedMediaType, KeyReused, TooManyRequests, InternalError, Unavailable
        )
    ),
    tags(
        (name = "charges", description = "Charging a card, exactly once"),
        (name = "refunds", description = "Giving money back, never more than was charged"),
        (name = "events", description = "What happened to charges and refunds, one event per final state"),
        (name = "webhooks", description = "Events sent to the merchant's endpoints, signed, retried until answered 2xx: at least once, so receivers deduplicate by event id"),
        (name = "idempotency", description = "What the server remembers of a key"),
        (name = "operations", description = "Health, readiness, metrics, this document"),
        (name = "workshop", description = "The lab page, its effect counter, and the endpoints broken on purpose for teaching")
    )
)]
pub struct ApiDoc;

/// Bearer with the secret key, or Basic with the key as user name and an
/// empty password (`curl -u sk_test_...:`).
struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("sk_test_...")
                    .description(Some(
                        "The merchant's secret key: `Authorization: Bearer sk_test_...`",
                    ))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "basic",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Basic)
                    .description(Some("The secret key as user name, an empty password"))
                    .build(),
            ),
        );
    }
}

/// Swagger UI at `/docs/` (`/docs` redirects there), reading `/openapi.json`,
/// with "Try it out" open on every operation. Its files are compiled into
/// the binary (the crate's `vendored` feature), so neither the build nor the
/// page fetches anything from the internet; the online spec validator is off
/// for the same reason. The page is not part of the API, so the document does
/// not list it.
pub fn swagger_ui() -> utoipa_swagger_ui::SwaggerUi {
    utoipa_swagger_ui::SwaggerUi::new("/docs").config(
        utoipa_swagger_ui::Config::from("/openapi.json")
            .try_it_out_enabled(true)
            .persist_authorization(true)
            .validator_url("none"),
    )
}

/// Declares the error responses, one per status, all problems: for each, a
/// unit struct whose `ToResponse` is a `Problem` body with its description,
/// an example (a problem of that status, rendered by the code that sends
/// them) and the header it carries.
macro_rules! problem_responses {
    ($($name:ident: $description:expr, $example:expr $(, $header:literal = $explained:expr)?;)*) => {$(
        pub struct $name;

        impl<'s> ToResponse<'s> for $name {
            fn response() -> (&'s str, RefOr<Response>) {
                let headers: &[(&str, &str)] = &[$(($header, $explained))?];
                (stringify!($name), problem_response($description, $example, headers).into())
            }
        }
    )*};
}

/// A response whose body is a `Problem`, with `example` as the body shown
/// and string headers.
fn problem_response(
    description: &str,
    example: problem::Problem,
    headers: &[(&str, &str)],
) -> Response {
    let example = example.with_extra("request_id", "7679969c-eecf-463f-92c7-1f5eaeeb7586");
    let body = ContentBuilder::new()
        .schema(Some(Ref::from_schema_name(Problem::name())))
        .example(serde_json::from_slice(&example.body()).ok())
        .build();
    let mut response = ResponseBuilder::new()
        .description(description)
        .content(oncepay_core::problem::CONTENT_TYPE, body);
    for (name, explained) in headers {
        let header = HeaderBuilder::new()
            .schema(ObjectBuilder::new().schema_type(Type::String))
            .description(Some(*explained))
            .build();
        response = response.header(*name, header);
    }
    response.build()
}

problem_responses! {
    BadRequest: "Bad input (see `code` and `param`); nothing was written",
        missing_amount();
    Unauthorized: "No or a wrong API key (`WWW-Authenticate`)",
        example(ProblemCode::InvalidApiKey, "The API key provided is not valid.");
    PaymentFailed: "Declined or abandoned; saved and replayed for the key",
        example(ProblemCode::CardDeclined, "Your card was declined.").with_extra("charge", EXAMPLE_CHARGE);
    Forbidden: "A `Stripe-Account` header: oncepay has no connected accounts; nothing was read or written",
        example(ProblemCode::AccountInvalid, "The provided key does not have access to account 'acct_1032D82eZvKYlo2C' (or that account does not exist): oncepay has no connected accounts.");
    NotFound: "No such resource for this merchant",
        no_such_charge();
    InFlight: "The same request is still in flight (`Retry-After: 1`)",
        claim::key_in_use(false),
        "Retry-After" = "Seconds to wait before retrying: 1";
    TooLarge: "The body is too large",
        example(ProblemCode::PayloadTooLarge, "The request body is larger than this server accepts.");
    UnsupportedMediaType: "Neither JSON nor a form",
        example(ProblemCode::UnsupportedMediaType, "Send the parameters as application/json or application/x-www-form-urlencoded.");
    KeyReused: "The key was used with other parameters, or on another endpoint",
        claim::key_reused("order-1", "POST /v1/charges", "POST /v1/charges");
    TooManyRequests: "Over the merchant's rate limit on this instance; nothing was read or written (`Retry-After`)",
        example(ProblemCode::RateLimit, "Too many writes from this merchant: slow down, and retry (with the same Idempotency-Key) after Retry-After."),
        "Retry-After" = "Whole seconds until the merchant's allowance has room for one more request, at least 1";
    InternalError: "A bug; details in the log",
        example(ProblemCode::InternalError, "Something went wrong on our side.");
    Unavailable: "Database unreachable, processor outcome unknown or unavailable, the request shed under overload, or the request timed out (`Retry-After`)",
        oncepay_core::error::service_unavailable(retry_after::SOON),
        "Retry-After" = "Seconds until a retry with the same key can get the answer: \
`PROCESSING_TIMEOUT` plus `SWEEP_INTERVAL`, rounded up (35 by default), when the record is left pending for recovery \
(`processing_outcome_unknown`, a refund's `processor_unavailable`, `service_unavailable` after the processor was called); \
1 otherwise (a charge's `processor_unavailable`, `overloaded`, `request_timeout`, `service_unavailable` before any work)";
}

/// The charge id the examples name.
const EXAMPLE_CHARGE: &str = "ch_FSqF13LohwPRt53icfinsfKa";

/// An example problem of `code`, with its status.
fn example(code: ProblemCode, detail: &str) -> problem::Problem {
    problem::Problem::new(code, detail)
}

/// The `400` of a charge without its amount, as the parameters' check makes it.
fn missing_amount() -> problem::Problem {
    example(
        ProblemCode::ParameterMissing,
        "Missing required param: amount",
    )
    .with_param("amount")
}

/// The `404` of an unknown charge id in a path.
fn no_such_charge() -> problem::Problem {
    let detail = format!("No such charge: '{EXAMPLE_CHARGE}'");
    problem::Problem::with_status(StatusCode::NOT_FOUND, ProblemCode::ResourceMissing, detail)
        .with_param("id")
}

/// Declares the sets of the error responses above that many operations
/// share; an operation lists a set in its `responses(...)` by name. For
/// each, a unit struct whose `IntoResponses` is the responses of the sets it
/// extends and its own, each a reference to the response declared above.
macro_rules! response_sets {
    ($($(#[$doc:meta])* $name:ident = $($base:ident +)* [$($status:literal $response:ident),+];)*) => {$(
        $(#[$doc])*
        pub struct $name;

        impl IntoResponses for $name {
            fn responses() -> BTreeMap<String, RefOr<Response>> {
                let mut responses = BTreeMap::new();
                $(responses.append(&mut $base::responses());)*
                $(responses.insert(
                    $status.to_string(),
                    Ref::from_response_name(<$response as ToResponse>::response().0).into(),
                );)+
                responses
            }
        }
    )*};
}

response_sets! {
    /// The errors of every authenticated request: bad input, no or a wrong
    /// key, the rate limit, a bug, and the service unavailable.
    Errors = [400 BadRequest, 401 Unauthorized, 403 Forbidden, 429 TooManyRequests, 500 InternalError, 503 Unavailable];
    /// The errors of a read of one resource by the id in its path: those of
    /// every request, and no such resource.
    ReadErrors = Errors + [404 NotFound];
    /// The errors of a request with a body: those of every request, and the
    /// body too large or of a type not taken.
    BodyErrors = Errors + [413 TooLarge, 415 UnsupportedMediaType];
    /// The errors of an idempotent POST: those of a request with a body, and
    /// its key in flight or reused with other parameters.
    PostErrors = BodyErrors + [409 InFlight, 422 KeyReused];
    /// The errors of an update of one resource by the id in its path: those
    /// of an idempotent POST, and no such resource.
    UpdateErrors = PostErrors + [404 NotFound];
}
