//! The processor over HTTP: the card gateway's JSON API, reached with one
//! kept-alive `reqwest` client.
//!
//! Every failure is classified by what the gateway may have done:
//!
//! | what happened | classification |
//! | --- | --- |
//! | the connection was refused or not made in `PROCESSOR_CONNECT_TIMEOUT` | nothing was sent: `Unavailable` |
//! | `503` with `processor_unavailable` (the gateway's "nothing recorded") | `Unavailable` |
//! | `401` (no account for `PROCESSOR_API_KEY`: refused before anything is read) | `Unavailable` |
//! | a timeout (`PROCESSOR_TIMEOUT`), a dropped connection, a cut body | the request was sent: outcome unknown |
//! | `500` or any other `5xx` | outcome unknown |
//! | `4xx` (a refusal: unknown payment, a key reused) | outcome unknown, not repeated: a bug to look at |
//!
//! Transient failures are repeated under the same idempotency key, at most
//! `PROCESSOR_RETRIES` times with a short backoff, none begun later than
//! `REQUEST_TIMEOUT` after the call began (so the outcome can still reach
//! the client) and none running past `PROCESSING_TIMEOUT` (the time a
//! request's key is its own): the gateway records at most one outcome per
//! key, so a repeat can only find the first outcome, never add one. If any attempt may have
//! reached the gateway, the call's outcome is unknown, whatever came after.

use std::time::{Duration, Instant};

use anyhow::anyhow;
use async_trait::async_trait;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue};
use reqwest::{RequestBuilder, StatusCode};
use serde::Deserialize;
use serde_json::json;

use super::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
    TestToken, WireFault,
};

/// How to reach the gateway.
#[derive(Clone)]
pub struct HttpSettings {
    /// The gateway's base URL, `http://host:port`.
    pub url: String,
    /// oncepay's secret key at the gateway (`PROCESSOR_API_KEY`), sent as
    /// `Authorization: Bearer` on every call; `Debug` hides it.
    pub api_key: String,
    /// The longest a connection may take to open (`PROCESSOR_CONNECT_TIMEOUT`).
    pub connect_timeout: Duration,
    /// The longest one attempt may take, answer included (`PROCESSOR_TIMEOUT`).
    pub timeout: Duration,
    /// Repeats of a call that failed transiently (`PROCESSOR_RETRIES`).
    pub retries: u32,
    /// The longest a whole call may take, repeats included
    /// (`PROCESSING_TIMEOUT`: the time a request's key is its own).
    pub budget: Duration,
    /// No repeat begins later than this after the call began
    /// (`REQUEST_TIMEOUT`), so that its outcome can still reach the client.
    pub retry_window: Duration,
}

impl std::fmt::Debug for HttpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpSettings")
            .field("url", &self.url)
            .field("api_key", &"***")
            .field("connect_timeout", &self.connect_timeout)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .field("budget", &self.budget)
            .field("retry_window", &self.retry_window)
            .finish()
    }
}

impl HttpSettings {
    /// `Authorization: Bearer <api_key>`, marked sensitive (never logged).
    pub(super) fn authorization(&self) -> anyhow::Result<HeaderMap> {
        let mut value = HeaderValue::from_str(&format!("Bearer {}", self.api_key))
            .map_err(|_| anyhow!("PROCESSOR_API_KEY is not a valid header value"))?;
        value.set_sensitive(true);
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, value);
        Ok(headers)
    }
}

/// The first wait between two attempts; it doubles after each.
const BACKOFF: Duration = Duration::from_millis(50);

/// The card gateway, over HTTP.
#[derive(Clone, Debug)]
pub struct HttpProcessor {
    client: reqwest::Client,
    base: String,
    settings: HttpSettings,
}

impl HttpProcessor {
    pub fn new(settings: HttpSettings) -> anyhow::Result<Self> {
        Self::with_headers(settings, HeaderMap::new())
    }

    /// [`HttpProcessor::new`], sending `headers` too with every call
    /// (`Processor-Fault` in tests).
    pub fn with_headers(settings: HttpSettings, extra: HeaderMap) -> anyhow::Result<Self> {
        let mut headers = settings.authorization()?;
        headers.extend(extra);
        let client = reqwest::Client::builder()
            .connect_timeout(settings.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
            // Connections are kept alive between calls; one idle this long
            // is closed by us rather than found closed by the gateway.
            .pool_idle_timeout(Duration::from_secs(30))
            .default_headers(headers)
            .build()?;
        Ok(HttpProcessor {
            client,
            base: settings.url.trim_end_matches('/').to_owned(),
            settings,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends the request `build` makes, repeating it while it fails
    /// transiently, within the attempts and the budget; the gateway's
    /// answer (a `2xx`, or a `404` when `not_found_is_none`) or the
    /// classified failure.
    async fn call(
        &self,
        what: &str,
        not_found_is_none: bool,
        build: impl Fn() -> RequestBuilder,
    ) -> Result<Option<WireOperation>, ProcessorError> {
        let started = Instant::now();
        let deadline = started + self.settings.budget;
        // The first failure that may have reached the gateway, if any.
        let mut unknown: Option<anyhow::Error> = None;
        let mut unavailable: Option<anyhow::Error> = None;
        let mut attempt = 0;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            let timeout = self.settings.timeout.min(remaining);
            match self
                .attempt(build().timeout(timeout), not_found_is_none)
                .await
            {
                Attempt::Answer(answer) => return Ok(answer),
                Attempt::Refused(e) => {
                    return Err(ProcessorError::OutcomeUnknown(
                        e.context(format!("the processor refused the {what}")),
                    ));
                }
                Attempt::NothingRecorded(e) => {
                    tracing::warn!(call = what, attempt, error = %format!("{e:#}"), "processor call failed; nothing recorded");
                    unavailable.get_or_insert(e);
                }
                Attempt::MaybeRecorded(e) => {
                    tracing::warn!(call = what, attempt, error = %format!("{e:#}"), "processor call failed; outcome unknown");
                    unknown.get_or_insert(e);
                }
            }
            if attempt >= self.settings.retries {
                break;
            }
            let backoff = (BACKOFF * 2u32.saturating_pow(attempt)).min(Duration::from_secs(1));
            let remaining = deadline.saturating_duration_since(Instant::now());
            if backoff >= remaining || started.elapsed() + backoff >= self.settings.retry_window {
                break;
            }
            tokio::time::sleep(backoff).await;
            attempt += 1;
        }
        match (unknown, unavailable) {
            (Some(e), _) => Err(ProcessorError::OutcomeUnknown(
                e.context(format!("{what}: {} attempt(s)", attempt + 1)),
            )),
            (None, Some(e)) => {
                tracing::warn!(call = what, error = %format!("{e:#}"), "processor unavailable");
                Err(ProcessorError::Unavailable)
            }
            (None, None) => Err(ProcessorError::OutcomeUnknown(anyhow!(
                "{what}: no attempt fit in the budget"
            ))),
        }
    }

    /// Posts `body` as JSON to the gateway's `path` under the processor key
    /// `key`, asking for `fault` if any, repeated as [`HttpProcessor::call`]
    /// repeats: the operation the gateway answered with.
    async fn post_json(
        &self,
        what: &str,
        path: &str,
        key: &str,
        body: &serde_json::Value,
        fault: Option<WireFault>,
    ) -> Result<WireOperation, ProcessorError> {
        let body = body.to_string();
        let url = self.url(path);
        let operation = self
            .call(what, false, || {
                with_fault(
                    self.client
                        .post(&url)
                        .header("Idempotency-Key", key)
                        .header(CONTENT_TYPE, "application/json")
                        .body(body.clone()),
                    fault,
                )
            })
            .await?;
        answered(operation)
    }

    async fn attempt(&self, request: RequestBuilder, not_found_is_none: bool) -> Attempt {
        let response = match request.send().await {
            Ok(response) => response,
            // Refused, or not connected in time: nothing was sent.
            Err(e) if e.is_connect() => return Attempt::NothingRecorded(e.into()),
            // A timeout or a lost connection after sending.
            Err(e) => return Attempt::MaybeRecorded(e.into()),
        };
        let status = response.status();
        let body = match response.bytes().await {
            Ok(body) => body,
            Err(e) => return Attempt::MaybeRecorded(e.into()),
        };
        if status.is_success() {
            return match serde_json::from_slice::<WireOperation>(&body) {
                Ok(operation) => Attempt::Answer(Some(operation)),
                Err(e) => Attempt::MaybeRecorded(anyhow!("{status} with an unreadable body: {e}")),
            };
        }
        let error = serde_json::from_slice::<WireError>(&body)
            .ok()
            .map(|e| e.error);
        let code = error.as_ref().map_or("", |e| e.code.as_str());
        let described = anyhow!(
            "{status} {code}: {}",
            error.as_ref().map_or("", |e| e.message.as_str())
        );
        match status {
            StatusCode::NOT_FOUND if not_found_is_none && code == "operation_not_found" => {
                Attempt::Answer(None)
            }
            // The gateway refuses a call it cannot name an account for
            // before reading or recording anything.
            StatusCode::UNAUTHORIZED => Attempt::NothingRecorded(
                described.context("the processor refused PROCESSOR_API_KEY"),
            ),
            // The gateway's contract: 503 processor_unavailable recorded nothing.
            StatusCode::SERVICE_UNAVAILABLE if code == "processor_unavailable" => {
                Attempt::NothingRecorded(described)
            }
            s if s.is_server_error() => Attempt::MaybeRecorded(described),
            _ => Attempt::Refused(described),
        }
    }
}

/// One attempt's result.
enum Attempt {
    Answer(Option<WireOperation>),
    /// A `4xx`: the gateway refused the request as sent; repeating it
    /// gets the same refusal.
    Refused(anyhow::Error),
    NothingRecorded(anyhow::Error),
    MaybeRecorded(anyhow::Error),
}

/// An operation as the gateway renders it.
#[derive(Debug, Deserialize)]
struct WireOperation {
    kind: String,
    outcome: String,
    amount: Option<i64>,
    decline_code: Option<String>,
    decline_message: Option<String>,
    failure_reason: Option<String>,
    #[serde(default)]
    refunds: i64,
    #[serde(default)]
    amount_refunded: i64,
}

#[derive(Debug, Deserialize)]
struct WireError {
    error: WireErrorBody,
}

#[derive(Debug, Deserialize)]
struct WireErrorBody {
    code: String,
    #[serde(default)]
    message: String,
}

impl WireOperation {
    fn payment_outcome(&self) -> Result<Outcome, ProcessorError> {
        match (self.kind.as_str(), self.outcome.as_str()) {
            ("authorization", "succeeded") => Ok(Outcome::Succeeded),
            ("authorization", "declined") => {
                let code = self
                    .decline_code
                    .clone()
                    .unwrap_or_else(|| "card_declined".into());
                let message = self
                    .decline_message
                    .clone()
                    .unwrap_or_else(|| TestToken::decline_message(&code).to_owned());
                Ok(Outcome::Declined { code, message })
            }
            ("void", "voided") => Ok(Outcome::Voided),
            (kind, outcome) => Err(ProcessorError::OutcomeUnknown(anyhow!(
                "the processor answered a {kind} {outcome} where a payment was expected"
            ))),
        }
    }

    fn refund_outcome(&self) -> Result<RefundOutcome, ProcessorError> {
        match (self.kind.as_str(), self.outcome.as_str()) {
            ("refund", "refunded") => Ok(RefundOutcome::Refunded),
            ("refund", "refund_failed") => Ok(RefundOutcome::Failed {
                reason: self
                    .failure_reason
                    .clone()
                    .unwrap_or_else(|| "declined".into()),
            }),
            (kind, outcome) => Err(ProcessorError::OutcomeUnknown(anyhow!(
                "the processor answered a {kind} {outcome} where a refund was expected"
            ))),
        }
    }
}

fn answered(operation: Option<WireOperation>) -> Result<WireOperation, ProcessorError> {
    operation.ok_or_else(|| ProcessorError::OutcomeUnknown(anyhow!("the processor answered 404")))
}

/// `request`, asking the gateway for `fault` (`Processor-Fault`) if any.
fn with_fault(request: RequestBuilder, fault: Option<WireFault>) -> RequestBuilder {
    match fault {
        Some(fault) => request.header(WireFault::HEADER, fault.as_str()),
        None => request,
    }
}

/// A key as one path segment.
fn segment(key: &str) -> String {
    percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[async_trait]
impl Processor for HttpProcessor {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        let body = json!({
            "amount": request.amount,
            "currency": request.currency,
            "source": request.source.as_str(),
            "capture": request.capture,
        });
        self.post_json(
            "authorization",
            "/v1/authorizations",
            request.processor_key,
            &body,
            request.fault,
        )
        .await?
        .payment_outcome()
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        let url = self.url(&format!(
            "/v1/authorizations/{}/void",
            segment(processor_key)
        ));
        let operation = self.call("void", false, || self.client.post(&url)).await?;
        answered(operation)?.payment_outcome()
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        let body = json!({
            "payment": request.payment_key,
            "amount": request.amount,
            "currency": request.currency,
        });
        let operation = self
            .post_json(
                "capture",
                "/v1/captures",
                request.processor_key,
                &body,
                request.fault,
            )
            .await?;
        match (operation.kind.as_str(), operation.outcome.as_str()) {
            ("capture", "captured") => Ok(()),
            (kind, outcome) => Err(ProcessorError::OutcomeUnknown(anyhow!(
                "the processor answered a {kind} {outcome} where a capture was expected"
            ))),
        }
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        let body = json!({
            "payment": request.payment_key,
            "amount": request.amount,
            "currency": request.currency,
        });
        self.post_json(
            "refund",
            "/v1/refunds",
            request.processor_key,
            &body,
            request.fault,
        )
        .await?
        .refund_outcome()
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        let url = self.url(&format!("/v1/operations/{}", segment(processor_key)));
        let Some(operation) = self.call("lookup", true, || self.client.get(&url)).await? else {
            return Ok(None);
        };
        Ok(Some(Payment {
            outcome: operation.payment_outcome()?,
            amount: operation.amount.unwrap_or(0),
            refunds: operation.refunds,
            amount_refunded: operation.amount_refunded,
        }))
    }

    async fn ready(&self) -> anyhow::Result<()> {
        let answer = self
            .client
            .get(self.url("/readyz"))
            .timeout(self.settings.timeout.min(Duration::from_secs(2)))
            .send()
            .await;
        match answer {
            Ok(response) if response.status().is_success() => Ok(()),
            Ok(response) => Err(anyhow!(
                "the processor at {} is not ready: {}",
                self.base,
                response.status()
            )),
            Err(e) => Err(anyhow::Error::new(e)
                .context(format!("the processor at {} is unreachable", self.base))),
        }
    }
}
