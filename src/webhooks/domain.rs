//! What a webhook endpoint is: its validated parameters, its row and its API
//! object; and what a delivery and its attempts look like.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::events::EventType;
use crate::webhooks::guard::AddressGuard;
use oncepay_core::params::{Encoding, MetadataUpdate, ParamError, Params, shorten};
use oncepay_core::params::{at_most, new_id, required, string};
use oncepay_core::problem::ProblemCode;

/// The most endpoints a merchant may have, as Stripe allows.
pub const MAX_ENDPOINTS: i64 = 16;
const MAX_URL_CHARS: usize = 2048;
const MAX_DESCRIPTION_CHARS: usize = 5000;
/// In `enabled_events`, every type, present and future.
pub const ALL_EVENTS: &str = "*";

/// The validated parameters of `POST /v1/webhook_endpoints`. The API's
/// document describes them under the name `CreateWebhookEndpoint`.
#[derive(Clone, Debug, PartialEq, Eq, ToSchema)]
#[schema(as = CreateWebhookEndpoint, description = "The parameters of a new webhook endpoint.")]
pub struct NewEndpoint {
    /// Where to send events: an absolute `http` or `https` URL, without
    /// credentials, at most 2048 characters.
    #[schema(example = "https://example.com/webhooks/oncepay")]
    pub url: String,
    /// The event types to send, or `["*"]` for all. A form sends
    /// `enabled_events[]=charge.succeeded` (or `enabled_events[0]=...`).
    // Validated: sorted and without repeats, `["*"]` or event type names.
    #[schema(example = json!(["charge.succeeded", "charge.refunded"]))]
    pub enabled_events: Vec<String>,
    /// At most 5000 characters.
    #[schema(example = "The order system")]
    pub description: Option<String>,
    /// Up to 50 keys of 1 to 40 characters; string values of up to 500.
    #[schema(example = json!({"team": "orders"}))]
    pub metadata: BTreeMap<String, String>,
}

impl NewEndpoint {
    pub fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let url = string(required(&mut params, "url")?, "url")?;
        let url = parse_url(&url)?;
        let enabled_events =
            enabled_events(required(&mut params, "enabled_events")?, params.encoding)?;
        let description = params.take("description").map(description).transpose()?;
        let metadata = params.take_metadata()?;
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(NewEndpoint {
            url,
            enabled_events,
            description,
            metadata,
        })
    }

    /// Refuses a URL whose host is, or resolves to, an address inside the
    /// network ([`check_address`]).
    pub async fn check_address(&self, guard: AddressGuard) -> Result<(), ParamError> {
        check_address(&self.url, guard).await
    }

    /// The parameters in a canonical form, for the key's fingerprint. The
    /// metadata is appended only when given, so an endpoint without any
    /// keeps the fingerprint it had before endpoints took metadata.
    pub fn canonical(&self) -> Vec<u8> {
        let mut canonical = vec![
            serde_json::json!(self.url),
            serde_json::json!(self.enabled_events),
            serde_json::json!(self.description),
        ];
        if !self.metadata.is_empty() {
            canonical.push(serde_json::json!(self.metadata));
        }
        serde_json::to_vec(&canonical).expect("plain JSON serialises")
    }
}

/// The validated parameters of `POST /v1/webhook_endpoints/{id}`: what to
/// change, each `None` when not given. The API's document describes them
/// under the name `UpdateWebhookEndpoint`.
#[derive(Clone, Debug, Default, PartialEq, Eq, ToSchema)]
#[schema(as = UpdateWebhookEndpoint, description = "The parameters of `POST /v1/webhook_endpoints/{id}`, as JSON or as a form. Each one given is changed.")]
pub struct EndpointUpdate {
    /// Checked as on create.
    #[schema(example = "https://example.com/webhooks/oncepay")]
    pub url: Option<String>,
    /// The event types to send, or `["*"]`, replacing the endpoint's.
    #[schema(example = json!(["charge.updated"]))]
    pub enabled_events: Option<Vec<String>>,
    /// `true` disables the endpoint (nothing more is sent to it, and its
    /// pending deliveries end `failed`); `false` enables it again.
    pub disabled: Option<bool>,
    /// At most 5000 characters; `""` removes it.
    #[schema(value_type = Option<String>, example = "The order system")]
    pub description: Option<Option<String>>,
    /// Merged into the endpoint's: a key given `""` is removed, and
    /// `metadata=""` removes every key.
    #[schema(value_type = Option<BTreeMap<String, String>>, example = json!({"team": "orders"}))]
    pub metadata: Option<MetadataUpdate>,
}

impl EndpointUpdate {
    pub fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let url = params
            .take("url")
            .map(|v| parse_url(&string(v, "url")?))
            .transpose()?;
        let enabled_events = params
            .take("enabled_events")
            .map(|v| enabled_events(v, params.encoding))
            .transpose()?;
        let disabled = params
            .take("disabled")
            .map(|v| boolean(v, "disabled", params.encoding))
            .transpose()?;
        let description = params
            .take("description")
            .map(|v| match v {
                Value::String(s) if s.is_empty() => Ok(None),
                v => description(v).map(Some),
            })
            .transpose()?;
        let metadata = params.take_metadata_update()?;
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(EndpointUpdate {
            url,
            enabled_events,
            disabled,
            description,
            metadata,
        })
    }

    /// The parameters in a canonical form, for the key's fingerprint.
    pub fn canonical(&self) -> serde_json::Value {
        serde_json::json!([
            self.url,
            self.enabled_events,
            self.disabled,
            self.description,
            self.metadata.as_ref().map(MetadataUpdate::canonical),
        ])
    }
}

/// Refuses a URL whose host is, or resolves to, an address inside the
/// network, with the address guard on: `400 url_invalid`, saying why.
/// Every attempt checks again; this is the early answer.
pub async fn check_address(url: &str, guard: AddressGuard) -> Result<(), ParamError> {
    guard.check_url(url).await.map_err(|refused| {
        ParamError::new(
            ProblemCode::UrlInvalid,
            "url",
            format!(
                "Invalid URL: '{}': {refused}; webhooks are sent only to public addresses",
                shorten(url)
            ),
        )
    })
}

/// An endpoint's `description`: a string of at most 5000 characters.
fn description(value: Value) -> Result<String, ParamError> {
    at_most(
        string(value, "description")?,
        "description",
        MAX_DESCRIPTION_CHARS,
    )
}

/// A boolean: JSON's `true` or `false`, or a form's `true` or `false`.
fn boolean(value: Value, name: &str, encoding: Encoding) -> Result<bool, ParamError> {
    match (value, encoding) {
        (Value::Bool(b), Encoding::Json) => Ok(b),
        (Value::String(s), Encoding::Form) if s == "true" || s == "false" => Ok(s == "true"),
        _ => Err(ParamError::new(
            ProblemCode::ParameterInvalidType,
            name,
            format!("{name} must be a boolean: true or false"),
        )),
    }
}

/// An absolute `http` or `https` URL with a host and no credentials,
/// normalised as the delivery will use it.
fn parse_url(raw: &str) -> Result<String, ParamError> {
    let invalid = |why: &str| {
        ParamError::new(
            ProblemCode::UrlInvalid,
            "url",
            format!("Invalid URL: '{}': {why}", shorten(raw)),
        )
    };
    if raw.chars().count() > MAX_URL_CHARS {
        return Err(ParamError::new(
            ProblemCode::ParameterTooLong,
            "url",
            format!("url must be at most {MAX_URL_CHARS} characters"),
        ));
    }
    let url = url::Url::parse(raw).map_err(|_| invalid("not an absolute URL"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid("the scheme must be http or https"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid("it has no host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid("credentials do not belong in the URL"));
    }
    if url.fragment().is_some() {
        return Err(invalid("a fragment is never sent"));
    }
    let url = String::from(url);
    if url.len() > MAX_URL_CHARS {
        return Err(invalid("too long once normalised"));
    }
    Ok(url)
}

/// `enabled_events`: a list of event types, or `["*"]`. A form gives it as
/// `enabled_events[]=...` or `enabled_events[0]=...`; JSON as an array.
fn enabled_events(value: Value, encoding: Encoding) -> Result<Vec<String>, ParamError> {
    let invalid_type = || {
        ParamError::new(
            ProblemCode::ParameterInvalidType,
            "enabled_events",
            "enabled_events must be a list of event types, e.g. enabled_events[]=charge.succeeded",
        )
    };
    let items: Vec<Value> = match (value, encoding) {
        // JSON, or a form's `enabled_events[]=...`.
        (Value::Array(items), _) => items,
        (Value::Object(entries), Encoding::Form) => {
            if let Some(name) = entries
                .keys()
                .find(|k| k.is_empty() || !k.bytes().all(|b| b.is_ascii_digit()))
            {
                return Err(ParamError::unknown(&format!("enabled_events[{name}]")));
            }
            entries.into_iter().map(|(_, v)| v).collect()
        }
        _ => return Err(invalid_type()),
    };
    let mut names = Vec::with_capacity(items.len());
    for item in items {
        let Value::String(name) = item else {
            return Err(invalid_type());
        };
        if name != ALL_EVENTS && EventType::parse(&name).is_none() {
            return Err(ParamError::new(
                ProblemCode::InvalidEventType,
                "enabled_events",
                format!(
                    "Invalid event type: '{}'. Use '*' or one of: {}",
                    shorten(&name),
                    EventType::ALL.map(EventType::as_str).join(", ")
                ),
            ));
        }
        names.push(name);
    }
    names.sort();
    names.dedup();
    if names.is_empty() {
        return Err(ParamError::new(
            ProblemCode::ParameterMissing,
            "enabled_events",
            "enabled_events must name at least one event type, or '*'",
        ));
    }
    if names.len() > 1 && names.iter().any(|n| n == ALL_EVENTS) {
        return Err(ParamError::new(
            ProblemCode::InvalidEventType,
            "enabled_events",
            "'*' already enables every event type; send it alone",
        ));
    }
    Ok(names)
}

/// An endpoint's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum EndpointStatus {
    /// Receives the events it enabled.
    Enabled,
    /// Failed every delivery for `WEBHOOK_DISABLE_AFTER`; receives nothing.
    Disabled,
    /// Deleted by the merchant; not shown any more.
    Deleted,
}

impl EndpointStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointStatus::Enabled => "enabled",
            EndpointStatus::Disabled => "disabled",
            EndpointStatus::Deleted => "deleted",
        }
    }
}

/// An endpoint as stored. Its `Debug` leaves the secret out.
#[derive(Clone)]
pub struct Endpoint {
    pub id: String,
    pub url: String,
    pub enabled_events: Vec<String>,
    pub description: Option<String>,
    pub secret: String,
    pub status: EndpointStatus,
    pub disabled_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    pub metadata: sqlx::types::Json<BTreeMap<String, String>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("id", &self.id)
            .field("enabled_events", &self.enabled_events)
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

/// The webhook endpoint object of the API, in Stripe's shape: where the
/// merchant's events are sent. `secret` is there only in the answer to the
/// create.
#[derive(Serialize, ToSchema)]
#[schema(as = WebhookEndpoint)]
pub struct EndpointObject<'a> {
    /// `we_` and 24 letters or digits.
    #[schema(example = "we_1NbB3eCTYkz2mVgqA8rW0hXp")]
    pub id: &'a str,
    #[schema(example = "webhook_endpoint")]
    pub object: &'static str,
    #[schema(example = "https://example.com/webhooks/oncepay")]
    pub url: &'a str,
    #[schema(example = json!(["charge.succeeded", "charge.refunded"]))]
    pub enabled_events: &'a [String],
    #[schema(example = "The order system")]
    pub description: Option<&'a str>,
    /// `enabled`, or `disabled`: by an update, or once every delivery failed
    /// for `WEBHOOK_DISABLE_AFTER`.
    #[schema(example = "enabled")]
    pub status: &'static str,
    /// Why it was disabled, when it was (oncepay's addition).
    pub disabled_reason: Option<&'a str>,
    /// Always null.
    pub api_version: Option<&'static str>,
    /// Stripe's Connect application that made it: never one here, always null.
    pub application: Option<&'static str>,
    /// Unix seconds.
    #[schema(example = 1764892800)]
    pub created: i64,
    pub livemode: bool,
    #[schema(example = json!({"team": "orders"}))]
    pub metadata: &'a BTreeMap<String, String>,
    /// The signing secret, `whsec_...`: only in the answer to the create
    /// (and its replays). Verify each delivery's `Stripe-Signature` with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "whsec_1NbB3eCTYkz2mVgqA8rW0hXpq3RtY6Uz")]
    pub secret: Option<&'a str>,
}

impl Endpoint {
    /// The object as `GET` shows it: without the secret.
    pub fn to_object(&self) -> EndpointObject<'_> {
        EndpointObject {
            id: &self.id,
            object: "webhook_endpoint",
            url: &self.url,
            enabled_events: &self.enabled_events,
            description: self.description.as_deref(),
            status: self.status.as_str(),
            disabled_reason: self.disabled_reason.as_deref(),
            api_version: None,
            application: None,
            created: self.created_at.timestamp(),
            livemode: false,
            metadata: &self.metadata.0,
            secret: None,
        }
    }

    /// The object as the create answers it, the one time the secret is shown.
    pub fn to_created_object(&self) -> EndpointObject<'_> {
        EndpointObject {
            secret: Some(&self.secret),
            ..self.to_object()
        }
    }
}

/// A new endpoint id: `we_` and 24 random letters and digits.
pub fn new_endpoint_id() -> String {
    new_id("we")
}

/// A new signing secret: `whsec_` and 32 random letters and digits, from
/// the operating system's generator by way of `rand`'s CSPRNG.
pub fn new_secret() -> String {
    use rand::Rng;
    let random: String = rand::rng()
        .sample_iter(&rand::distr::Alphanumeric)
        .take(32)
        .map(char::from)
        .collect();
    format!("whsec_{random}")
}

/// A delivery's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum DeliveryStatus {
    /// Not yet answered `2xx`; another attempt is due at `next_attempt_at`.
    Pending,
    /// An attempt was answered `2xx`.
    Succeeded,
    /// Every attempt failed, or the endpoint was disabled or deleted.
    Failed,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Succeeded => "succeeded",
            DeliveryStatus::Failed => "failed",
        }
    }
}

/// How a delivery ended: the `outcome` and `reason` labels of
/// `webhook_deliveries_total`, a closed set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryEnd {
    /// An attempt was answered `2xx`.
    Delivered,
    /// The last attempt allowed failed.
    AttemptsExhausted,
    /// The endpoint was disabled for failing.
    EndpointDisabled,
    /// The merchant deleted the endpoint.
    EndpointDeleted,
}

impl DeliveryEnd {
    /// `succeeded` or `failed`, as the delivery's status.
    pub fn outcome(self) -> &'static str {
        match self {
            DeliveryEnd::Delivered => "succeeded",
            _ => "failed",
        }
    }

    /// Why: `delivered`, or the delivery's `failure_reason`.
    pub fn reason(self) -> &'static str {
        match self {
            DeliveryEnd::Delivered => "delivered",
            DeliveryEnd::AttemptsExhausted => "attempts_exhausted",
            DeliveryEnd::EndpointDisabled => "endpoint_disabled",
            DeliveryEnd::EndpointDeleted => "endpoint_deleted",
        }
    }

    /// Counts `n` deliveries ended this way in `webhook_deliveries_total`.
    pub fn count(self, n: u64) {
        metrics::counter!(
            "webhook_deliveries_total",
            "outcome" => self.outcome(),
            "reason" => self.reason()
        )
        .increment(n);
    }
}

/// One event's delivery to one endpoint, with its attempts.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub endpoint_id: String,
    pub url: String,
    pub status: DeliveryStatus,
    pub attempts: i32,
    pub next_attempt_at: DateTime<Utc>,
    pub failure_reason: Option<String>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// One attempt that ran to its end.
#[derive(Clone, Debug)]
pub struct Attempt {
    pub endpoint_id: String,
    pub attempt: i32,
    pub started_at: DateTime<Utc>,
    pub duration_ms: i32,
    pub response_status: Option<i16>,
    pub error: Option<String>,
}

/// One event's delivery to one endpoint, as the API shows it.
#[derive(Serialize, ToSchema)]
#[schema(as = WebhookDelivery)]
pub struct DeliveryObject<'a> {
    #[schema(example = "webhook_delivery")]
    pub object: &'static str,
    /// The event's id.
    #[schema(example = "evt_1NbB3eCTYkz2mVgqA8rW0hXp")]
    pub event: &'a str,
    #[schema(example = "we_1NbB3eCTYkz2mVgqA8rW0hXp")]
    pub webhook_endpoint: &'a str,
    #[schema(example = "https://example.com/webhooks/oncepay")]
    pub url: &'a str,
    /// `pending` (another attempt is due), `succeeded` (answered 2xx) or
    /// `failed` (attempts exhausted, or the endpoint disabled or deleted).
    #[schema(example = "succeeded")]
    pub status: &'static str,
    /// Attempts begun, including one cut short by a crash (which has no record).
    #[schema(example = 1)]
    pub attempt_count: i32,
    /// Unix seconds: when the next attempt is due, while pending.
    #[schema(example = json!(null))]
    pub next_attempt: Option<i64>,
    /// Unix seconds: when it succeeded or failed for good.
    #[schema(example = 1764892801)]
    pub finished: Option<i64>,
    /// `attempts_exhausted`, `endpoint_disabled` or `endpoint_deleted`, when failed.
    pub failure_reason: Option<&'a str>,
    pub attempts: Vec<AttemptObject<'a>>,
}

/// One attempt that ran to its end, as the API shows it.
#[derive(Serialize, ToSchema)]
#[schema(as = WebhookAttempt)]
pub struct AttemptObject<'a> {
    #[schema(example = 1)]
    pub attempt: i32,
    /// Unix seconds: when it began.
    #[schema(example = 1764892800)]
    pub created: i64,
    #[schema(example = 87)]
    pub duration_ms: i32,
    /// The receiver's status code; null when none came.
    #[schema(example = 200)]
    pub response_status: Option<i16>,
    /// What went wrong (`HTTP 500`, `timeout`, `connect: ...`); null for a 2xx.
    pub error: Option<&'a str>,
}

impl Delivery {
    /// The delivery of `event` as the API shows it, with those of `attempts`
    /// made to its endpoint.
    pub fn to_object<'a>(&'a self, event: &'a str, attempts: &'a [Attempt]) -> DeliveryObject<'a> {
        DeliveryObject {
            object: "webhook_delivery",
            event,
            webhook_endpoint: &self.endpoint_id,
            url: &self.url,
            status: self.status.as_str(),
            attempt_count: self.attempts,
            next_attempt: (self.status == DeliveryStatus::Pending)
                .then(|| self.next_attempt_at.timestamp()),
            finished: self.finished_at.map(|t| t.timestamp()),
            failure_reason: self.failure_reason.as_deref(),
            attempts: attempts
                .iter()
                .filter(|a| a.endpoint_id == self.endpoint_id)
                .map(|a| AttemptObject {
                    attempt: a.attempt,
                    created: a.started_at.timestamp(),
                    duration_ms: a.duration_ms,
                    response_status: a.response_status,
                    error: a.error.as_deref(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn from_json(body: Value) -> Result<NewEndpoint, ParamError> {
        NewEndpoint::from_params(Params::from_json(body.to_string().as_bytes()).unwrap())
    }

    fn from_form(body: &str) -> Result<NewEndpoint, ParamError> {
        NewEndpoint::from_params(Params::from_form(body.as_bytes()).unwrap())
    }

    #[test]
    fn a_form_and_json_give_the_same_endpoint_and_the_same_fingerprint() {
        let json = from_json(json!({
            "url": "https://example.com/hooks",
            "enabled_events": ["refund.failed", "charge.succeeded", "charge.succeeded"],
        }))
        .unwrap();
        let form = from_form(
            "url=https://example.com/hooks&enabled_events[0]=charge.succeeded&enabled_events[1]=refund.failed",
        )
        .unwrap();
        assert_eq!(json, form);
        let appended = from_form(
            "url=https://example.com/hooks&enabled_events[]=refund.failed&enabled_events[]=charge.succeeded",
        )
        .unwrap();
        assert_eq!(appended, form);
        assert_eq!(json.enabled_events, ["charge.succeeded", "refund.failed"]);
        assert_eq!(json.canonical(), form.canonical());
        let wildcard = from_form("url=http://127.0.0.1:9/x&enabled_events[]=*").unwrap();
        assert_eq!(wildcard.enabled_events, ["*"]);
    }

    #[test]
    fn only_absolute_http_and_https_urls_without_credentials_are_accepted() {
        for bad in [
            "ftp://example.com/x",
            "file:///etc/passwd",
            "/relative",
            "https://user:pw@example.com/",
            "http://example.com/#frag",
            "javascript:alert(1)",
        ] {
            let err = from_json(json!({"url": bad, "enabled_events": ["*"]})).unwrap_err();
            assert_eq!(err.code, ProblemCode::UrlInvalid, "{bad}");
            assert_eq!(err.param, "url");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_CHARS));
        let err = from_json(json!({"url": long, "enabled_events": ["*"]})).unwrap_err();
        assert_eq!(err.code, ProblemCode::ParameterTooLong);
    }

    #[test]
    fn enabled_events_must_name_known_types_or_the_wildcard_alone() {
        let err =
            from_json(json!({"url": "https://e.com", "enabled_events": ["charge.*"]})).unwrap_err();
        assert_eq!(err.code, ProblemCode::InvalidEventType);
        let err =
            from_json(json!({"url": "https://e.com", "enabled_events": ["*", "charge.failed"]}))
                .unwrap_err();
        assert_eq!(err.code, ProblemCode::InvalidEventType);
        let err = from_json(json!({"url": "https://e.com", "enabled_events": []})).unwrap_err();
        assert_eq!(err.code, ProblemCode::ParameterMissing);
        let err = from_json(json!({"url": "https://e.com", "enabled_events": "*"})).unwrap_err();
        assert_eq!(err.code, ProblemCode::ParameterInvalidType);
        let err = from_json(json!({"url": "https://e.com"})).unwrap_err();
        assert_eq!(err.code, ProblemCode::ParameterMissing);
        let err = from_form("url=https://e.com&enabled_events[x]=*").unwrap_err();
        assert_eq!(err.code, ProblemCode::ParameterUnknown);
    }

    #[test]
    fn the_secret_is_shown_only_by_the_create() {
        let endpoint = Endpoint {
            id: new_endpoint_id(),
            url: "https://e.com/".into(),
            enabled_events: vec!["*".into()],
            description: None,
            secret: new_secret(),
            status: EndpointStatus::Enabled,
            disabled_reason: None,
            created_at: Utc::now(),
            metadata: Default::default(),
        };
        let shown = serde_json::to_value(endpoint.to_object()).unwrap();
        assert!(shown.get("secret").is_none());
        let created = serde_json::to_value(endpoint.to_created_object()).unwrap();
        assert_eq!(created["secret"], endpoint.secret.as_str());
        assert!(endpoint.secret.starts_with("whsec_") && endpoint.secret.len() == 38);
    }
}
