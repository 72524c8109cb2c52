//! Problems: what a request could not do, as `application/problem+json`
//! (RFC 9457) shows it, each with a stable `code`. The codes are one list,
//! [`ProblemCode`], which gives each its status, title and error type; the
//! handlers, the saved responses and the OpenAPI document all use it. How a
//! problem becomes an HTTP response is the HTTP layer's business.

use std::borrow::Cow;

use http::{HeaderName, HeaderValue, StatusCode, header};
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

pub const CONTENT_TYPE: &str = "application/problem+json";

/// The most characters of a client's name or value that an error echoes.
pub const MAX_ECHOED_CHARS: usize = 100;

/// `text` as an error may echo it: its first [`MAX_ECHOED_CHARS`]
/// characters, followed by `…` when it was longer. A problem names what the
/// client sent, but a 60 KiB parameter name must not make a 120 KiB answer.
pub fn shorten(text: &str) -> Cow<'_, str> {
    shorten_to(text, MAX_ECHOED_CHARS)
}

/// The longest `param` of any error: room for a shortened name inside a
/// shortened name (`metadata[…]`). Only a guard for a name nobody shortened.
pub const MAX_PARAM_CHARS: usize = 2 * MAX_ECHOED_CHARS + 20;

/// `text` cut to `max` characters, with `…` after a cut.
pub fn shorten_to(text: &str, max: usize) -> Cow<'_, str> {
    match text.char_indices().nth(max) {
        None => Cow::Borrowed(text),
        Some((cut, _)) => Cow::Owned(format!("{}…", &text[..cut])),
    }
}

/// Every problem code, with its status:
///
/// - `parameter_missing` (400): a required parameter is absent.
/// - `parameter_unknown` (400): a parameter is not accepted.
/// - `parameter_duplicate` (400): a form repeats a parameter.
/// - `parameter_invalid_type` (400): a parameter has the wrong type.
/// - `parameter_invalid_integer` (400): not a whole number (`amount`, `limit`), or an `amount` below 1.
/// - `parameter_invalid_string` (400): a string contains NUL, or a form's bytes are not UTF-8.
/// - `parameter_too_long` (400): over a length limit.
/// - `property_not_expandable` (400): `expand` names a property oncepay cannot expand.
/// - `parameters_exclusive` (400): two parameters that exclude each other.
/// - `amount_too_small` (400): a charge's `amount` below its currency's minimum (50 cents in `usd`).
/// - `amount_too_large` (400): `amount` above the maximum, or more than is left to refund.
/// - `invalid_currency` (400): unknown currency.
/// - `metadata_invalid` (400): metadata breaks its limits.
/// - `invalid_reason` (400): unknown refund reason.
/// - `invalid_event_type` (400): an unknown event type (an event list's filter, a webhook endpoint's `enabled_events`).
/// - `url_invalid` (400): a webhook endpoint's `url` is not an absolute `http` or `https` URL,
///   or its host is, or resolves to, an address inside the network (the address guard).
/// - `webhook_endpoint_limit` (400): the merchant has as many webhook endpoints as allowed.
/// - `email_invalid` (400): a malformed email address (a charge's `receipt_email`).
/// - `parameter_unsupported` (400): a parameter of Stripe's that needs what oncepay does not model (customers, connected accounts).
/// - `resource_missing` (400/404): no such token, charge, refund or key.
/// - `charge_not_refundable` (400): a refund of a pending or failed charge.
/// - `charge_already_refunded` (400): a refund of a charge refunded in full.
/// - `invalid_json` (400): the body is not a JSON object.
/// - `invalid_body` (400): the body cannot be read.
/// - `invalid_path` (400): the path cannot be read.
/// - `invalid_idempotency_key` (400): the `Idempotency-Key` header is malformed or repeated.
/// - `idempotency_key_missing` (400): no key while keys are required.
/// - `fault_injection_disabled` (400): `Oncepay-Fault` while fault injection is off.
/// - `invalid_fault` (400): an unknown `Oncepay-Fault`.
/// - `webhook_signature_invalid` (400): a workshop receiver got a delivery whose `Stripe-Signature` is missing or does not verify.
/// - `receiver_invalid` (400): a workshop receiver's `run`, `mode`, `secret`, `fail_first` or `fault` is not one it accepts.
/// - `authentication_required` (401): no API key.
/// - `invalid_api_key` (401): a wrong API key.
/// - `account_invalid` (403): a `Stripe-Account` header: the key has no access to another account (oncepay has none).
/// - `card_declined` (402): declined (saved and replayed); `decline_code` says why.
/// - `expired_card` (402): declined, card expired.
/// - `incorrect_cvc` (402): declined, the card's security code is wrong.
/// - `processing_error` (402): declined, the issuer could not process the card.
/// - `processing_abandoned` (402): abandoned before the network answered; no money moved.
/// - `route_not_found` (404): unknown route, or (to a Stripe client) a method the route does not take.
/// - `method_not_allowed` (405): a method the route does not take (`Allow` lists those it does).
/// - `idempotency_key_in_use` (409): the same request is still in flight (`Retry-After`).
/// - `payload_too_large` (413): the body is too large.
/// - `unsupported_media_type` (415): neither JSON nor a form.
/// - `idempotency_key_reused` (422): the key was used with other parameters.
/// - `rate_limit` (429): the merchant sent more requests than its limit on this instance (`Retry-After`).
/// - `internal_error` (500): a bug; details in the log only.
/// - `receiver_failed_on_purpose` (500): a workshop receiver did its work, then answered 500 as its `fail_first` asks.
/// - `processing_outcome_unknown` (503): the processor's outcome is unknown; retry with the same key after `Retry-After` (`PROCESSING_TIMEOUT` plus `SWEEP_INTERVAL`).
/// - `processor_unavailable` (503): for a charge, the processor recorded nothing and the key is free (`Retry-After: 1`); for a refund, it stays reserved until recovery rolls it forward (`Retry-After`: `PROCESSING_TIMEOUT` plus `SWEEP_INTERVAL`).
/// - `service_unavailable` (503): the database is unreachable (`Retry-After: 1`, or `PROCESSING_TIMEOUT` plus `SWEEP_INTERVAL` once the processor was called).
/// - `overloaded` (503): more requests than the database pool serves; this one waited its turn for a connection past `DATABASE_QUEUE_TIMEOUT` (or `DATABASE_QUEUE_OVERLOAD_TIMEOUT` under overload) and did nothing (`Retry-After: 1`).
/// - `request_timeout` (503): the request took longer than `REQUEST_TIMEOUT`.
/// - `redis_unavailable` (503): the workshop's Redis variant has no Redis (`REDIS_URL` unset, or Redis does not answer).
/// - `broker_unavailable` (503): the workshop's broker scenario has no NATS server with JetStream (`NATS_URL` unset, or it does not answer).
/// - `http_error`: An error status raised by a layer with no more specific code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(rename_all = "snake_case"))]
pub enum ProblemCode {
    /// 400: a required parameter is absent.
    ParameterMissing,
    /// 400: a parameter is not accepted.
    ParameterUnknown,
    /// 400: a form repeats a parameter.
    ParameterDuplicate,
    /// 400: a parameter has the wrong type.
    ParameterInvalidType,
    /// 400: not a whole number (`amount`, `limit`), or an `amount` below 1.
    ParameterInvalidInteger,
    /// 400: a string contains NUL, or a form's bytes are not UTF-8.
    ParameterInvalidString,
    /// 400: over a length limit.
    ParameterTooLong,
    /// 400: `expand` names a property oncepay cannot expand.
    PropertyNotExpandable,
    /// 400: two parameters that exclude each other.
    ParametersExclusive,
    /// 400: a charge's `amount` below its currency's minimum (50 cents in `usd`).
    AmountTooSmall,
    /// 400: `amount` above the maximum, or more than is left to refund.
    AmountTooLarge,
    /// 400: unknown currency.
    InvalidCurrency,
    /// 400: metadata breaks its limits.
    MetadataInvalid,
    /// 400: unknown refund reason.
    InvalidReason,
    /// 400: an unknown event type (an event list's filter, a webhook endpoint's `enabled_events`).
    InvalidEventType,
    /// 400: a webhook endpoint's `url` is not an absolute `http` or `https` URL.
    UrlInvalid,
    /// 400: the merchant has as many webhook endpoints as allowed.
    WebhookEndpointLimit,
    /// 400: a malformed email address (a charge's `receipt_email`).
    EmailInvalid,
    /// 400: a parameter of Stripe's that needs what oncepay does not model (customers, connected accounts).
    ParameterUnsupported,
    /// 400/404: no such token, charge, refund or key.
    ResourceMissing,
    /// 400: a refund of a pending or failed charge.
    ChargeNotRefundable,
    /// 400: a refund of a charge refunded in full, or a capture of a
    /// charge released by a refund.
    ChargeAlreadyRefunded,
    /// 400: a capture of a charge paid at once, or captured already.
    ChargeAlreadyCaptured,
    /// 400: a capture after the authorization window.
    ChargeExpiredForCapture,
    /// 400: a capture of a pending or failed charge.
    ChargeNotCapturable,
    /// 400: the body is not a JSON object.
    InvalidJson,
    /// 400: the body cannot be read.
    InvalidBody,
    /// 400: the path cannot be read.
    InvalidPath,
    /// 400: the `Idempotency-Key` header is malformed or repeated.
    InvalidIdempotencyKey,
    /// 400: no key while keys are required.
    IdempotencyKeyMissing,
    /// 400: `Oncepay-Fault` while fault injection is off.
    FaultInjectionDisabled,
    /// 400: an unknown `Oncepay-Fault`.
    InvalidFault,
    /// 400: a workshop receiver got a delivery whose `Stripe-Signature` is missing or does not verify.
    WebhookSignatureInvalid,
    /// 400: a workshop receiver's `run`, `mode`, `secret`, `fail_first` or `fault` is not one it accepts.
    ReceiverInvalid,
    /// 401: no API key.
    AuthenticationRequired,
    /// 401: a wrong API key.
    InvalidApiKey,
    /// 403: a `Stripe-Account` header: the key has no access to another account (oncepay has none).
    AccountInvalid,
    /// 402: declined (saved and replayed); `decline_code` says why.
    CardDeclined,
    /// 402: declined, card expired.
    ExpiredCard,
    /// 402: declined, the card's security code is wrong.
    IncorrectCvc,
    /// 402: declined, the issuer could not process the card.
    ProcessingError,
    /// 402: abandoned before the network answered; no money moved.
    ProcessingAbandoned,
    /// 404: unknown route, or (to a Stripe client) a method the route does not take.
    RouteNotFound,
    /// 405: a method the route does not take (`Allow` lists those it does).
    MethodNotAllowed,
    /// 409: the same request is still in flight (`Retry-After`).
    IdempotencyKeyInUse,
    /// 413: the body is too large.
    PayloadTooLarge,
    /// 415: neither JSON nor a form.
    UnsupportedMediaType,
    /// 422: the key was used with other parameters.
    IdempotencyKeyReused,
    /// 429: the merchant sent more requests than its limit on this instance (`Retry-After`).
    RateLimit,
    /// 500: a bug; details in the log only.
    InternalError,
    /// 500: a workshop receiver did its work, then answered 500 as its `fail_first` asks.
    ReceiverFailedOnPurpose,
    /// 503: the processor's outcome is unknown; retry with the same key after `Retry-After`.
    ProcessingOutcomeUnknown,
    /// 503: a charge: the processor recorded nothing, the key is free; a refund: reserved until rolled forward.
    ProcessorUnavailable,
    /// 503: the database is unreachable.
    ServiceUnavailable,
    /// 503: more requests than the database pool serves; this one waited its turn too long and did nothing.
    Overloaded,
    /// 503: the request took longer than `REQUEST_TIMEOUT`.
    RequestTimeout,
    /// 503: the workshop's Redis variant has no Redis (`REDIS_URL` unset, or Redis does not answer).
    RedisUnavailable,
    BrokerUnavailable,
    /// An error status raised by a layer with no more specific code.
    HttpError,
}

impl ProblemCode {
    /// Every code, in the order they are declared; a unit test holds it
    /// against the enum itself (by way of its OpenAPI schema), and
    /// `tests/api/docs.rs` against the table of docs/api.md.
    pub const ALL: [ProblemCode; 59] = [
        ProblemCode::ParameterMissing,
        ProblemCode::ParameterUnknown,
        ProblemCode::ParameterDuplicate,
        ProblemCode::ParameterInvalidType,
        ProblemCode::ParameterInvalidInteger,
        ProblemCode::ParameterInvalidString,
        ProblemCode::ParameterTooLong,
        ProblemCode::PropertyNotExpandable,
        ProblemCode::ParametersExclusive,
        ProblemCode::AmountTooSmall,
        ProblemCode::AmountTooLarge,
        ProblemCode::InvalidCurrency,
        ProblemCode::MetadataInvalid,
        ProblemCode::InvalidReason,
        ProblemCode::InvalidEventType,
        ProblemCode::UrlInvalid,
        ProblemCode::WebhookEndpointLimit,
        ProblemCode::EmailInvalid,
        ProblemCode::ParameterUnsupported,
        ProblemCode::ResourceMissing,
        ProblemCode::ChargeNotRefundable,
        ProblemCode::ChargeAlreadyRefunded,
        ProblemCode::ChargeAlreadyCaptured,
        ProblemCode::ChargeExpiredForCapture,
        ProblemCode::ChargeNotCapturable,
        ProblemCode::InvalidJson,
        ProblemCode::InvalidBody,
        ProblemCode::InvalidPath,
        ProblemCode::InvalidIdempotencyKey,
        ProblemCode::IdempotencyKeyMissing,
        ProblemCode::FaultInjectionDisabled,
        ProblemCode::InvalidFault,
        ProblemCode::WebhookSignatureInvalid,
        ProblemCode::ReceiverInvalid,
        ProblemCode::AuthenticationRequired,
        ProblemCode::InvalidApiKey,
        ProblemCode::AccountInvalid,
        ProblemCode::CardDeclined,
        ProblemCode::ExpiredCard,
        ProblemCode::IncorrectCvc,
        ProblemCode::ProcessingError,
        ProblemCode::ProcessingAbandoned,
        ProblemCode::RouteNotFound,
        ProblemCode::MethodNotAllowed,
        ProblemCode::IdempotencyKeyInUse,
        ProblemCode::PayloadTooLarge,
        ProblemCode::UnsupportedMediaType,
        ProblemCode::IdempotencyKeyReused,
        ProblemCode::RateLimit,
        ProblemCode::InternalError,
        ProblemCode::ReceiverFailedOnPurpose,
        ProblemCode::ProcessingOutcomeUnknown,
        ProblemCode::ProcessorUnavailable,
        ProblemCode::ServiceUnavailable,
        ProblemCode::Overloaded,
        ProblemCode::RequestTimeout,
        ProblemCode::RedisUnavailable,
        ProblemCode::BrokerUnavailable,
        ProblemCode::HttpError,
    ];

    /// The code as sent, `snake_case`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ProblemCode::ParameterMissing => "parameter_missing",
            ProblemCode::ParameterUnknown => "parameter_unknown",
            ProblemCode::ParameterDuplicate => "parameter_duplicate",
            ProblemCode::ParameterInvalidType => "parameter_invalid_type",
            ProblemCode::ParameterInvalidInteger => "parameter_invalid_integer",
            ProblemCode::ParameterInvalidString => "parameter_invalid_string",
            ProblemCode::ParameterTooLong => "parameter_too_long",
            ProblemCode::PropertyNotExpandable => "property_not_expandable",
            ProblemCode::ParametersExclusive => "parameters_exclusive",
            ProblemCode::AmountTooSmall => "amount_too_small",
            ProblemCode::AmountTooLarge => "amount_too_large",
            ProblemCode::InvalidCurrency => "invalid_currency",
            ProblemCode::MetadataInvalid => "metadata_invalid",
            ProblemCode::InvalidReason => "invalid_reason",
            ProblemCode::InvalidEventType => "invalid_event_type",
            ProblemCode::UrlInvalid => "url_invalid",
            ProblemCode::WebhookEndpointLimit => "webhook_endpoint_limit",
            ProblemCode::EmailInvalid => "email_invalid",
            ProblemCode::ParameterUnsupported => "parameter_unsupported",
            ProblemCode::ResourceMissing => "resource_missing",
            ProblemCode::ChargeNotRefundable => "charge_not_refundable",
            ProblemCode::ChargeAlreadyRefunded => "charge_already_refunded",
            ProblemCode::ChargeAlreadyCaptured => "charge_already_captured",
            ProblemCode::ChargeExpiredForCapture => "charge_expired_for_capture",
            ProblemCode::ChargeNotCapturable => "charge_not_capturable",
            ProblemCode::InvalidJson => "invalid_json",
            ProblemCode::InvalidBody => "invalid_body",
            ProblemCode::InvalidPath => "invalid_path",
            ProblemCode::InvalidIdempotencyKey => "invalid_idempotency_key",
            ProblemCode::IdempotencyKeyMissing => "idempotency_key_missing",
            ProblemCode::FaultInjectionDisabled => "fault_injection_disabled",
            ProblemCode::InvalidFault => "invalid_fault",
            ProblemCode::WebhookSignatureInvalid => "webhook_signature_invalid",
            ProblemCode::ReceiverInvalid => "receiver_invalid",
            ProblemCode::AuthenticationRequired => "authentication_required",
            ProblemCode::InvalidApiKey => "invalid_api_key",
            ProblemCode::AccountInvalid => "account_invalid",
            ProblemCode::CardDeclined => "card_declined",
            ProblemCode::ExpiredCard => "expired_card",
            ProblemCode::IncorrectCvc => "incorrect_cvc",
            ProblemCode::ProcessingError => "processing_error",
            ProblemCode::ProcessingAbandoned => "processing_abandoned",
            ProblemCode::RouteNotFound => "route_not_found",
            ProblemCode::MethodNotAllowed => "method_not_allowed",
            ProblemCode::IdempotencyKeyInUse => "idempotency_key_in_use",
            ProblemCode::PayloadTooLarge => "payload_too_large",
            ProblemCode::UnsupportedMediaType => "unsupported_media_type",
            ProblemCode::IdempotencyKeyReused => "idempotency_key_reused",
            ProblemCode::RateLimit => "rate_limit",
            ProblemCode::InternalError => "internal_error",
            ProblemCode::ReceiverFailedOnPurpose => "receiver_failed_on_purpose",
            ProblemCode::ProcessingOutcomeUnknown => "processing_outcome_unknown",
            ProblemCode::ProcessorUnavailable => "processor_unavailable",
            ProblemCode::ServiceUnavailable => "service_unavailable",
            ProblemCode::Overloaded => "overloaded",
            ProblemCode::RequestTimeout => "request_timeout",
            ProblemCode::RedisUnavailable => "redis_unavailable",
            ProblemCode::BrokerUnavailable => "broker_unavailable",
            ProblemCode::HttpError => "http_error",
        }
    }

    /// The status a problem with this code has, unless it says otherwise
    /// (`resource_missing` is `400` for a parameter naming nothing, `404` for
    /// a path and for the charge a refund is made on, as at Stripe; a layer's
    /// `http_error` keeps the layer's status).
    pub fn status(self) -> StatusCode {
        match self {
            ProblemCode::ParameterMissing
            | ProblemCode::ParameterUnknown
            | ProblemCode::ParameterDuplicate
            | ProblemCode::ParameterInvalidType
            | ProblemCode::ParameterInvalidInteger
            | ProblemCode::ParameterInvalidString
            | ProblemCode::ParameterTooLong
            | ProblemCode::PropertyNotExpandable
            | ProblemCode::ParametersExclusive
            | ProblemCode::AmountTooSmall
            | ProblemCode::AmountTooLarge
            | ProblemCode::InvalidCurrency
            | ProblemCode::MetadataInvalid
            | ProblemCode::InvalidReason
            | ProblemCode::InvalidEventType
            | ProblemCode::UrlInvalid
            | ProblemCode::WebhookEndpointLimit
            | ProblemCode::EmailInvalid
            | ProblemCode::ParameterUnsupported
            | ProblemCode::ResourceMissing
            | ProblemCode::ChargeNotRefundable
            | ProblemCode::ChargeAlreadyRefunded
            | ProblemCode::ChargeAlreadyCaptured
            | ProblemCode::ChargeExpiredForCapture
            | ProblemCode::ChargeNotCapturable
            | ProblemCode::InvalidJson
            | ProblemCode::InvalidBody
            | ProblemCode::InvalidPath
            | ProblemCode::InvalidIdempotencyKey
            | ProblemCode::IdempotencyKeyMissing
            | ProblemCode::FaultInjectionDisabled
            | ProblemCode::InvalidFault
            | ProblemCode::WebhookSignatureInvalid
            | ProblemCode::ReceiverInvalid => StatusCode::BAD_REQUEST,
            ProblemCode::AuthenticationRequired | ProblemCode::InvalidApiKey => {
                StatusCode::UNAUTHORIZED
            }
            ProblemCode::AccountInvalid => StatusCode::FORBIDDEN,
            ProblemCode::CardDeclined
            | ProblemCode::ExpiredCard
            | ProblemCode::IncorrectCvc
            | ProblemCode::ProcessingError
            | ProblemCode::ProcessingAbandoned => StatusCode::PAYMENT_REQUIRED,
            ProblemCode::RouteNotFound => StatusCode::NOT_FOUND,
            ProblemCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ProblemCode::IdempotencyKeyInUse => StatusCode::CONFLICT,
            ProblemCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ProblemCode::IdempotencyKeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemCode::RateLimit => StatusCode::TOO_MANY_REQUESTS,
            ProblemCode::InternalError
            | ProblemCode::ReceiverFailedOnPurpose
            | ProblemCode::HttpError => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemCode::ProcessingOutcomeUnknown
            | ProblemCode::ProcessorUnavailable
            | ProblemCode::ServiceUnavailable
            | ProblemCode::Overloaded
            | ProblemCode::RequestTimeout
            | ProblemCode::RedisUnavailable
            | ProblemCode::BrokerUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The title of a problem with this code at its own status.
    pub fn title(self) -> &'static str {
        title_of(self.status())
    }

    /// The kind of error, in the terms of Stripe's `error.type`, which
    /// follows from the status: a declined card (`402`) is a card error, a
    /// reused key an idempotency error, anything on the server's side (`5xx`)
    /// an API error, and every other refusal an invalid request.
    pub fn error_type(self) -> ErrorType {
        match self {
            ProblemCode::IdempotencyKeyReused => ErrorType::Idempotency,
            _ if self.status() == StatusCode::PAYMENT_REQUIRED => ErrorType::Card,
            _ if self.status().is_server_error() => ErrorType::Api,
            _ => ErrorType::InvalidRequest,
        }
    }

    /// Stripe's `error.decline_code` for a declined card whose problem
    /// names none of its own ([`Problem::with_decline_code`]):
    /// `generic_decline` under `card_declined`; `None` for every other code.
    /// Stripe gives none for `expired_card`, `incorrect_cvc` and
    /// `processing_error`, which say why themselves, nor for an abandoned
    /// payment (no card network refused it).
    pub fn decline_code(self) -> Option<&'static str> {
        match self {
            ProblemCode::CardDeclined => Some("generic_decline"),
            _ => None,
        }
    }

    /// Stripe's `error.doc_url`: the page of Stripe's error codes that
    /// documents this code, `https://stripe.com/docs/error-codes/` and the
    /// code with `-` for `_`. Only for the codes Stripe's API has, with the
    /// meaning it gives them; oncepay's own codes (and `authentication_required`,
    /// which is another thing at Stripe) have none.
    pub fn doc_url(self) -> Option<String> {
        let stripes = matches!(
            self,
            ProblemCode::ParameterMissing
                | ProblemCode::ParameterUnknown
                | ProblemCode::ParameterInvalidInteger
                | ProblemCode::ParametersExclusive
                | ProblemCode::AmountTooSmall
                | ProblemCode::AmountTooLarge
                | ProblemCode::UrlInvalid
                | ProblemCode::ResourceMissing
                | ProblemCode::ChargeNotRefundable
                | ProblemCode::ChargeAlreadyRefunded
                | ProblemCode::ChargeAlreadyCaptured
                | ProblemCode::ChargeExpiredForCapture
                | ProblemCode::CardDeclined
                | ProblemCode::ExpiredCard
                | ProblemCode::IncorrectCvc
                | ProblemCode::ProcessingError
                | ProblemCode::IdempotencyKeyInUse
                | ProblemCode::RateLimit
        );
        stripes.then(|| {
            format!(
                "https://stripe.com/docs/error-codes/{}",
                self.as_str().replace('_', "-")
            )
        })
    }
}

impl Serialize for ProblemCode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl std::fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The kinds of error Stripe's API names in `error.type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorType {
    /// Bad parameters, authentication, an unknown route or resource, a key
    /// still in flight.
    InvalidRequest,
    /// The card was declined (or the payment abandoned).
    Card,
    /// A key reused with other parameters.
    Idempotency,
    /// Something on the server's side: a bug, the database, the processor.
    Api,
}

impl ErrorType {
    /// As Stripe spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorType::InvalidRequest => "invalid_request_error",
            ErrorType::Card => "card_error",
            ErrorType::Idempotency => "idempotency_error",
            ErrorType::Api => "api_error",
        }
    }
}

/// A status's reason phrase, the `title` of a problem with it.
fn title_of(status: StatusCode) -> &'static str {
    status.canonical_reason().unwrap_or("Error")
}

/// A problem to show the client: status, stable code, human detail.
#[derive(Debug, Clone)]
pub struct Problem {
    pub status: StatusCode,
    pub code: ProblemCode,
    pub detail: String,
    pub param: Option<String>,
    /// Extra members of the body, such as the failed charge's id.
    pub extra: Map<String, Value>,
    /// Stripe's `error.decline_code` when the card's decline says more than
    /// the code's own ([`ProblemCode::decline_code`]): `lost_card`, say,
    /// under `card_declined`.
    pub decline_code: Option<&'static str>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl Problem {
    /// A problem with `code` at the code's own status.
    pub fn new(code: ProblemCode, detail: impl Into<String>) -> Self {
        Problem::with_status(code.status(), code, detail)
    }

    /// A problem with `code` at another status than the code's own.
    pub fn with_status(status: StatusCode, code: ProblemCode, detail: impl Into<String>) -> Self {
        Problem {
            status,
            code,
            detail: detail.into(),
            param: None,
            extra: Map::new(),
            decline_code: None,
            headers: Vec::new(),
        }
    }

    /// Names the parameter at fault, cut to
    /// [`MAX_PARAM_CHARS`] should a caller have passed a client's long name
    /// unshortened.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        let param = param.into();
        let param = shorten_to(&param, MAX_PARAM_CHARS);
        self.param = Some(param.into_owned());
        self
    }

    /// A decline code that says more than the code's own.
    pub fn with_decline_code(mut self, decline_code: &'static str) -> Self {
        self.decline_code = Some(decline_code);
        self
    }

    pub fn with_extra(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(name.to_owned(), value.into());
        self
    }

    pub fn with_header(mut self, name: HeaderName, value: &'static str) -> Self {
        self.headers.push((name, HeaderValue::from_static(value)));
        self
    }

    /// `Retry-After: seconds`, a value from the server's `retry_after`.
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.headers
            .push((header::RETRY_AFTER, HeaderValue::from(seconds)));
        self
    }

    /// The body, as saved for replay and as sent: the RFC 9457 members,
    /// the extras, and `error` in Stripe's shape.
    pub fn body(&self) -> Vec<u8> {
        let named = |name: &str| self.extra.get(name);
        let body = Body {
            kind: format!("/problems/{}", self.code),
            title: title_of(self.status),
            status: self.status.as_u16(),
            detail: &self.detail,
            code: self.code,
            param: self.param.as_deref(),
            charge: named("charge"),
            refund: named("refund"),
            more: self
                .extra
                .iter()
                .filter(|(name, _)| !Body::NAMED.contains(&name.as_str()))
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect(),
            request_id: named("request_id"),
            error: StripeError {
                kind: self.code.error_type().as_str(),
                code: self.code,
                decline_code: self.decline_code.or(self.code.decline_code()),
                doc_url: self.code.doc_url(),
                message: &self.detail,
                param: self.param.as_deref(),
                charge: named("charge"),
            },
        };
        serde_json::to_vec(&body).expect("a problem's body serialises")
    }
}

/// An error (RFC 9457). `code` is stable and machine-readable; `param`
/// names the parameter at fault; `charge` names the failed charge of a
/// decline; `request_id` is the request's `X-Request-Id` (a saved decline
/// names the request that first got it, and its replays, sent exactly as
/// first saved, name that one too; it is absent when recovery settled the
/// charge); `error` is the same problem in Stripe's shape, for the Stripe
/// SDKs, with Stripe's `doc_url` for the codes Stripe has. The problem
/// itself has no `doc_url`: its `type` names its documentation.
#[derive(Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Problem))]
pub struct Body<'a> {
    /// A relative URI, `/problems/{code}`.
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(example = "/problems/card_declined"))]
    kind: String,
    #[cfg_attr(feature = "openapi", schema(example = "Payment Required"))]
    title: &'static str,
    #[cfg_attr(feature = "openapi", schema(example = 402))]
    status: u16,
    #[cfg_attr(feature = "openapi", schema(example = "Your card was declined."))]
    detail: &'a str,
    code: ProblemCode,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(value_type = Option<String>, example = "ch_FSqF13LohwPRt53icfinsfKa")
    )]
    charge: Option<&'a Value>,
    /// The refund a `processor_unavailable` or `processing_outcome_unknown` refund answer is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    refund: Option<&'a Value>,
    /// The extras no schema names (the workshop's), in the order given.
    #[serde(flatten)]
    #[cfg_attr(feature = "openapi", schema(ignore))]
    more: Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    request_id: Option<&'a Value>,
    error: StripeError<'a>,
}

impl Body<'_> {
    /// The extras the schema names.
    const NAMED: [&'static str; 3] = ["charge", "refund", "request_id"];
}

/// A problem as Stripe's API shows it, read by the Stripe SDKs to raise
/// their typed errors (`CardError`, `InvalidRequestError`, ...).
#[derive(Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StripeError<'a> {
    /// `card_error` (a decline or an abandoned payment), `idempotency_error`
    /// (a key reused with other parameters), `invalid_request_error` (bad
    /// parameters, an unknown resource, authentication, a key in flight) or
    /// `api_error` (a `5xx`).
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(example = "card_error"))]
    kind: &'static str,
    /// The problem's `code`.
    code: ProblemCode,
    /// For a card declined as `card_declined`, the issuer's reason:
    /// `generic_decline`, `insufficient_funds`, `fraudulent`, `lost_card` or
    /// `stolen_card`. (`expired_card`, `incorrect_cvc` and `processing_error`
    /// have none, as at Stripe.)
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = "generic_decline"))]
    decline_code: Option<&'static str>,
    /// Stripe's page for the code, for the codes Stripe's API has
    /// ([`ProblemCode::doc_url`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(example = "https://stripe.com/docs/error-codes/card-declined")
    )]
    doc_url: Option<String>,
    /// The problem's `detail`.
    #[cfg_attr(feature = "openapi", schema(example = "Your card was declined."))]
    message: &'a str,
    /// The parameter at fault (for a declined card, the card's field at
    /// fault: `exp_month` for an expired card, `cvc` for a wrong security code).
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'a str>,
    /// The failed charge.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    charge: Option<&'a Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_code_has_the_status_its_documentation_gives() {
        assert_eq!(
            ProblemCode::ParameterMissing.status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            ProblemCode::InvalidApiKey.status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            ProblemCode::CardDeclined.status(),
            StatusCode::PAYMENT_REQUIRED
        );
        assert_eq!(
            ProblemCode::IdempotencyKeyInUse.status(),
            StatusCode::CONFLICT
        );
        assert_eq!(
            ProblemCode::IdempotencyKeyReused.status(),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            ProblemCode::ProcessorUnavailable.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ProblemCode::IdempotencyKeyReused.as_str(),
            "idempotency_key_reused"
        );
        assert_eq!(ProblemCode::CardDeclined.title(), "Payment Required");
        assert_eq!(
            ProblemCode::CardDeclined.error_type().as_str(),
            "card_error"
        );
    }

    #[cfg(feature = "openapi")]
    #[test]
    fn all_lists_every_code_once_in_the_order_of_the_enum() {
        // The derived schema lists every variant, so a code missing from
        // `ALL` (or spelt otherwise by `as_str`) shows here.
        let schema = serde_json::to_value(<ProblemCode as utoipa::PartialSchema>::schema())
            .expect("the schema serialises");
        let variants: Vec<&str> = schema["enum"]
            .as_array()
            .expect("an enum schema")
            .iter()
            .map(|v| v.as_str().expect("a string"))
            .collect();
        let listed: Vec<&str> = ProblemCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(listed, variants);
    }

    #[test]
    fn the_body_carries_the_problem_in_stripes_shape_too() {
        let body = Problem::new(ProblemCode::CardDeclined, "Declined.")
            .with_decline_code("insufficient_funds")
            .with_extra("charge", "ch_1")
            .body();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["code"], "card_declined");
        assert_eq!(
            body["error"],
            json!({
                "type": "card_error",
                "code": "card_declined",
                "decline_code": "insufficient_funds",
                "doc_url": "https://stripe.com/docs/error-codes/card-declined",
                "message": "Declined.",
                "charge": "ch_1",
            })
        );
        let body = Problem::new(ProblemCode::ExpiredCard, "Your card has expired.")
            .with_param("exp_month")
            .body();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body["error"],
            json!({
                "type": "card_error",
                "code": "expired_card",
                "doc_url": "https://stripe.com/docs/error-codes/expired-card",
                "message": "Your card has expired.",
                "param": "exp_month",
            })
        );
        let body = Problem::new(ProblemCode::ParameterMissing, "amount is required")
            .with_param("amount")
            .body();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body["error"],
            json!({
                "type": "invalid_request_error",
                "code": "parameter_missing",
                "doc_url": "https://stripe.com/docs/error-codes/parameter-missing",
                "message": "amount is required",
                "param": "amount",
            })
        );
        let body = Problem::new(ProblemCode::InvalidFault, "no such fault").body();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"].get("doc_url"), None, "oncepay's own code");
        assert_eq!(
            ProblemCode::IdempotencyKeyInUse.error_type(),
            ErrorType::InvalidRequest
        );
        assert_eq!(
            ProblemCode::IdempotencyKeyReused.error_type(),
            ErrorType::Idempotency
        );
        assert_eq!(ProblemCode::ProcessingAbandoned.decline_code(), None);
    }
}
