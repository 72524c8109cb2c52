//! The gateway's HTTP API (JSON), the `Processor-Fault` hook and the
//! connection loop. Every `/v1/` call names its account with
//! `Authorization: Bearer <secret>` ([`Caller`]); handlers parse, call one
//! [`Ledger`] function on the caller's account and render its outcome;
//! every error is `{"error": {"type", "code", "message", "param"}}` with a
//! status that says whether anything was recorded:
//!
//! | status | meaning |
//! | --- | --- |
//! | `401` `api_key_missing`, `api_key_invalid` | no account named, nothing read or recorded |
//! | `200`, `201` | the outcome stands (`201`: this call recorded it; `200` with `Idempotent-Replayed: true`: an earlier one did) |
//! | `400`, `404`, `409`, `415`, `422` | refused, nothing recorded; repeating the same request gets the same refusal |
//! | `503` `processor_unavailable` | nothing recorded; the same request may be repeated |
//! | `500`, or no answer | unknown: the outcome may be recorded; repeat under the same key, or void it |

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, MatchedPath, Path, RawQuery, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tower::ServiceExt;

use super::accounts::Accounts;
use super::domain::{
    Authorize, CapturePayment, GatewayError, Ledger, Recorded, RefundPayment, decline_message,
};
use super::store::Operation;

/// Why a `tok_refundFail` card's issuer refused a refund.
const REFUND_REFUSED: &str = "declined";

/// The fault-injection request header.
pub const FAULT_HEADER: &str = "processor-fault";

/// A wire fault a request asks for with `Processor-Fault` (honoured only
/// with `PROCESSOR_FAULT_INJECTION=true`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer `503 processor_unavailable` and record nothing.
    FailBeforeRecord,
    /// Record, then close the connection without answering.
    DropAfterRecord,
    /// Record, then hold the answer for `PROCESSOR_FAULT_DELAY`.
    Slow,
    /// Record, then abort the process (as `kill -9` would).
    CrashAfterRecord,
}

impl Fault {
    pub fn parse(value: &str) -> Option<Fault> {
        match value {
            "fail-before-record" => Some(Fault::FailBeforeRecord),
            "drop-after-record" => Some(Fault::DropAfterRecord),
            "slow" => Some(Fault::Slow),
            "crash-after-record" => Some(Fault::CrashAfterRecord),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Fault::FailBeforeRecord => "fail-before-record",
            Fault::DropAfterRecord => "drop-after-record",
            Fault::Slow => "slow",
            Fault::CrashAfterRecord => "crash-after-record",
        }
    }
}

/// What every handler reaches.
#[derive(Clone)]
pub struct GatewayState {
    pub ledger: Ledger,
    /// Who the callers are.
    pub accounts: Accounts,
    pub fault_injection: bool,
    pub fault_delay: Duration,
    /// The gateway's own metrics: not the process's global recorder, which
    /// belongs to oncepay when the gateway is embedded in it.
    pub metrics: Arc<PrometheusRecorder>,
}

impl GatewayState {
    pub fn new(ledger: Ledger, fault_injection: bool, fault_delay: Duration) -> Self {
        GatewayState {
            accounts: Accounts::new(ledger.pool.clone()),
            ledger,
            fault_injection,
            fault_delay,
            metrics: Arc::new(PrometheusBuilder::new().build_recorder()),
        }
    }
}

/// Marks a response that must not be sent: the connection is closed instead.
#[derive(Clone, Copy, Debug)]
struct DropConnection;

/// The gateway's routes.
pub fn router(state: GatewayState) -> Router {
    Router::new()
        .route("/v1/authorizations", post(authorize))
        .route("/v1/authorizations/{key}/void", post(void))
        .route("/v1/refunds", post(refund))
        .route("/v1/captures", post(capture))
        .route("/v1/operations", get(list))
        .route("/v1/operations/{key}", get(lookup))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// A refusal or failure, rendered as the gateway's JSON error.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            param: None,
        }
    }
}

impl From<GatewayError> for ApiError {
    fn from(error: GatewayError) -> Self {
        let message = error.to_string();
        let (status, code, param) = match &error {
            GatewayError::Invalid { code, param, .. } => (StatusCode::BAD_REQUEST, *code, *param),
            GatewayError::KeyReused(_) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                Some("Idempotency-Key"),
            ),
            GatewayError::NotFound {
                what: "payment", ..
            } => (StatusCode::NOT_FOUND, "payment_not_found", Some("payment")),
            GatewayError::NotFound { .. } => (StatusCode::NOT_FOUND, "operation_not_found", None),
            GatewayError::NotRefundable(_) => (
                StatusCode::CONFLICT,
                "payment_not_refundable",
                Some("payment"),
            ),
            GatewayError::NotCapturable { .. } => (
                StatusCode::CONFLICT,
                "payment_not_capturable",
                Some("payment"),
            ),
            GatewayError::AmountTooLarge { .. } => {
                (StatusCode::BAD_REQUEST, "amount_too_large", Some("amount"))
            }
            GatewayError::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "processor_unavailable",
                None,
            ),
            GatewayError::Database(e) => {
                tracing::error!(error = %e, "ledger error; the outcome is unknown");
                (StatusCode::INTERNAL_SERVER_ERROR, "outcome_unknown", None)
            }
        };
        let message = match &error {
            GatewayError::Database(_) => {
                "The ledger failed mid-call: the outcome is unknown. Repeat under the same key, or void it.".to_owned()
            }
            _ => message,
        };
        ApiError {
            status,
            code,
            message,
            param,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable_error",
            StatusCode::INTERNAL_SERVER_ERROR => "api_error",
            StatusCode::UNPROCESSABLE_ENTITY => "idempotency_error",
            _ => "invalid_request_error",
        };
        let body = json!({"error": {
            "type": kind,
            "code": self.code,
            "message": self.message,
            "param": self.param,
        }});
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"oncepay processor\""),
            );
        }
        response
    }
}

/// The account a call is made for, from its `Authorization: Bearer
/// <secret>`; a call without a secret of a key is refused `401` before
/// anything is read or recorded.
pub struct Caller(pub String);

impl FromRequestParts<GatewayState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &GatewayState,
    ) -> Result<Self, Self::Rejection> {
        let presented = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|v| !v.is_empty());
        let Some(presented) = presented else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "api_key_missing",
                "Send your account's secret key as Authorization: Bearer <secret> \
                 (oncepay processor accounts create makes one).",
            ));
        };
        match state.accounts.authenticate(presented).await {
            Ok(Some(account)) => Ok(Caller(account)),
            Ok(None) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "api_key_invalid",
                "The secret key is not one of any account's.",
            )),
            Err(e) => Err(GatewayError::Database(e).into()),
        }
    }
}

/// The operation's JSON.
pub fn operation_json(operation: &Operation) -> Value {
    json!({
        "object": "operation",
        "key": operation.key,
        "kind": operation.kind,
        "outcome": operation.outcome,
        "amount": operation.amount,
        "currency": operation.currency,
        "source": operation.source,
        "decline_code": operation.decline_code,
        "decline_message": operation
            .decline_code
            .as_deref()
            .map(|code| decline_message(operation.source.as_deref(), code)),
        "failure_reason": (operation.outcome == "refund_failed").then_some(REFUND_REFUSED),
        "payment": operation.payment_key,
        "capture_later": operation.capture_later,
        "amount_captured": operation.amount_captured,
        "refunds": operation.refunds,
        "amount_refunded": operation.amount_refunded,
        "created": operation.created.timestamp(),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuthorizeBody {
    amount: i64,
    currency: String,
    source: String,
    /// `false` holds the amount until a capture takes it.
    #[serde(default = "at_once")]
    capture: bool,
}

fn at_once() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CaptureBody {
    payment: String,
    amount: i64,
    currency: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RefundBody {
    payment: String,
    amount: i64,
    currency: String,
}

async fn authorize(
    State(state): State<GatewayState>,
    Caller(account): Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (fault, key, body) = keyed::<AuthorizeBody>(&state, &headers, &body)?;
    let authorize = Authorize {
        key,
        amount: body.amount,
        currency: body.currency,
        source: body.source,
        capture: body.capture,
    };
    let recorded = state.ledger.authorize(&account, &authorize).await?;
    Ok(answer(&state, recorded, fault).await)
}

async fn capture(
    State(state): State<GatewayState>,
    Caller(account): Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (fault, key, body) = keyed::<CaptureBody>(&state, &headers, &body)?;
    let capture = CapturePayment {
        key,
        payment: body.payment,
        amount: body.amount,
        currency: body.currency,
    };
    let recorded = state.ledger.capture(&account, &capture).await?;
    Ok(answer(&state, recorded, fault).await)
}

async fn void(
    State(state): State<GatewayState>,
    Caller(account): Caller,
    Path(key): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let fault = fault(&state, &headers)?;
    if !body.is_empty() {
        let _: serde_json::Map<String, Value> = json_body(&headers, &body)?;
    }
    fail_before_record(fault)?;
    let recorded = state.ledger.void(&account, &key).await?;
    Ok(answer(&state, recorded, fault).await)
}

async fn refund(
    State(state): State<GatewayState>,
    Caller(account): Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (fault, key, body) = keyed::<RefundBody>(&state, &headers, &body)?;
    let refund = RefundPayment {
        key,
        payment: body.payment,
        amount: body.amount,
        currency: body.currency,
    };
    let recorded = state.ledger.refund(&account, &refund).await?;
    Ok(answer(&state, recorded, fault).await)
}

/// What a keyed `POST` brings, checked in the order the gateway checks it:
/// the fault asked for, the `Idempotency-Key`, the body; then the fault
/// that fails before anything is recorded.
fn keyed<B: serde::de::DeserializeOwned>(
    state: &GatewayState,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(Option<Fault>, String, B), ApiError> {
    let fault = fault(state, headers)?;
    let key = idempotency_key(headers)?;
    let body: B = json_body(headers, body)?;
    fail_before_record(fault)?;
    Ok((fault, key, body))
}

async fn lookup(
    State(state): State<GatewayState>,
    Caller(account): Caller,
    Path(key): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    no_query(query.as_deref())?;
    let operation = state.ledger.lookup(&account, &key).await?;
    Ok(axum::Json(operation_json(&operation)).into_response())
}

/// `GET /v1/operations?created[gte]=&created[lt]=&starting_after=&limit=`:
/// the caller's ledger oldest first, a page at a time, for reconciliation.
async fn list(
    State(state): State<GatewayState>,
    Caller(account): Caller,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let (mut from, mut until, mut after, mut limit) = (None, None, None, 100);
    for (name, value) in form_urlencoded::parse(query.as_deref().unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "created[gte]" => from = Some(timestamp("created[gte]", &value)?),
            "created[lt]" => until = Some(timestamp("created[lt]", &value)?),
            "starting_after" => after = Some(value.into_owned()),
            "limit" => {
                limit = value.parse().map_err(|_| ApiError {
                    param: Some("limit"),
                    ..ApiError::new(
                        StatusCode::BAD_REQUEST,
                        "parameter_invalid_integer",
                        "limit must be a whole number.",
                    )
                })?;
            }
            other => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "parameter_unknown",
                    format!("Received unknown parameter: {other}"),
                ));
            }
        }
    }
    let (page, has_more) = state
        .ledger
        .list(&account, from, until, after.as_deref(), limit)
        .await?;
    let next = page
        .last()
        .filter(|_| has_more)
        .map(|operation| operation.key.clone());
    Ok(axum::Json(json!({
        "object": "list",
        "data": page.iter().map(operation_json).collect::<Vec<_>>(),
        "has_more": has_more,
        "next_starting_after": next,
    }))
    .into_response())
}

async fn healthz() -> axum::Json<Value> {
    axum::Json(json!({"status": "ok"}))
}

async fn readyz(State(state): State<GatewayState>) -> Result<axum::Json<Value>, ApiError> {
    let ping = sqlx::query_scalar!("SELECT 1").fetch_one(&state.ledger.pool);
    match tokio::time::timeout(Duration::from_secs(2), ping).await {
        Ok(Ok(_)) => Ok(axum::Json(json!({"status": "ok", "database": "ok"}))),
        _ => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            "The gateway's database does not answer.",
        )),
    }
}

async fn render_metrics(State(state): State<GatewayState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        state.metrics.handle().render(),
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "route_not_found", "No such route.")
}

/// The answer to a call that recorded (or found) an operation, with the
/// wire fault asked for applied when this call recorded it.
async fn answer(state: &GatewayState, recorded: Recorded, fault: Option<Fault>) -> Response {
    let Recorded {
        operation,
        fresh,
        answer_lost,
    } = recorded;
    count(state, || {
        metrics::counter!(
            "gateway_operations_total",
            "kind" => operation.kind.clone(),
            "outcome" => operation.outcome.clone(),
            "recorded" => if fresh { "now" } else { "before" },
        )
        .increment(1);
    });
    let fault = fault.filter(|_| fresh);
    if let Some(fault) = fault {
        tracing::warn!(key = %operation.key, fault = fault.as_str(), "fault injection after recording");
        count(state, || {
            metrics::counter!("gateway_faults_total", "fault" => fault.as_str()).increment(1);
        });
    }
    match fault {
        Some(Fault::CrashAfterRecord) => {
            tracing::error!(key = %operation.key, "fault injection: aborting the process");
            std::process::abort();
        }
        Some(Fault::Slow) => tokio::time::sleep(state.fault_delay).await,
        _ => {}
    }
    if answer_lost || fault == Some(Fault::DropAfterRecord) {
        let mut response = StatusCode::NO_CONTENT.into_response();
        response.extensions_mut().insert(DropConnection);
        return response;
    }
    let status = if fresh {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut response = (status, axum::Json(operation_json(&operation))).into_response();
    if !fresh {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

fn fault(state: &GatewayState, headers: &HeaderMap) -> Result<Option<Fault>, ApiError> {
    let Some(value) = headers.get(FAULT_HEADER) else {
        return Ok(None);
    };
    if !state.fault_injection {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "fault_injection_disabled",
            "Processor-Fault is only honoured when the gateway runs with PROCESSOR_FAULT_INJECTION=true.",
        ));
    }
    Fault::parse(value.to_str().unwrap_or("")).map(Some).ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_fault",
            "Processor-Fault must be fail-before-record, drop-after-record, slow or crash-after-record.",
        )
    })
}

fn fail_before_record(fault: Option<Fault>) -> Result<(), ApiError> {
    if fault == Some(Fault::FailBeforeRecord) {
        tracing::warn!("fault injection: unavailable before recording");
        return Err(GatewayError::Unavailable.into());
    }
    Ok(())
}

fn idempotency_key(headers: &HeaderMap) -> Result<String, ApiError> {
    match headers.get("idempotency-key").map(|v| v.to_str()) {
        Some(Ok(key)) => Ok(key.to_owned()),
        Some(Err(_)) => Err(GatewayError::Invalid {
            code: "idempotency_key_invalid",
            param: Some("Idempotency-Key"),
            message: "A key is 1 to 255 visible ASCII characters.".into(),
        }
        .into()),
        None => Err(GatewayError::Invalid {
            code: "idempotency_key_missing",
            param: Some("Idempotency-Key"),
            message: "Every call that moves money needs an Idempotency-Key header.".into(),
        }
        .into()),
    }
}

fn json_body<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, ApiError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Send the body as application/json.",
        ));
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_body",
            format!("The body is not the JSON expected: {e}."),
        )
    })
}

fn no_query(query: Option<&str>) -> Result<(), ApiError> {
    match query.filter(|q| !q.is_empty()) {
        None => Ok(()),
        Some(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "parameter_unknown",
            "This route takes no query parameters.",
        )),
    }
}

fn timestamp(param: &'static str, value: &str) -> Result<DateTime<Utc>, ApiError> {
    value
        .parse::<i64>()
        .ok()
        .and_then(|s| DateTime::from_timestamp(s, 0))
        .ok_or_else(|| ApiError {
            param: Some(param),
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "parameter_invalid_integer",
                format!("{param} must be a Unix timestamp in seconds."),
            )
        })
}

fn count(state: &GatewayState, record: impl FnOnce()) {
    metrics::with_local_recorder(state.metrics.as_ref(), record);
}

/// Counts and logs every request by route and status.
async fn observe(State(state): State<GatewayState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let response = next.run(request).await;
    let status = response.status().as_u16();
    let dropped = response.extensions().get::<DropConnection>().is_some();
    let route_label = route.clone();
    count(&state, || {
        metrics::counter!(
            "gateway_requests_total",
            "route" => route_label,
            "status" => if dropped { "dropped".to_owned() } else { status.to_string() },
        )
        .increment(1);
    });
    if route.starts_with("/v1/") {
        tracing::info!(
            target: "oncepay::gateway",
            %method,
            %route,
            key = key.as_deref(),
            status,
            dropped,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "processor request"
        );
    }
    response
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets each
/// connection finish its request in flight. A response marked to be
/// dropped closes its connection unanswered.
pub async fn serve(listener: TcpListener, router: Router, shutdown: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "processor accept error");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            let answer = router.clone().oneshot(request);
            async move {
                let response: Response = match answer.await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                if response.extensions().get::<DropConnection>().is_some() {
                    return Err(std::io::Error::other("fault injection: answer dropped"));
                }
                Ok::<_, std::io::Error>(response)
            }
        });
        let served = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::debug!(error = %e, "processor connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
}
