//! Workshop routes: the effect counter (`GET /demo/effects`), what a
//! workshop needs to know of the server (`GET /demo/settings`), the lab page
//! (`GET /lab`), and, only with `DEMO_UNSAFE_ENDPOINTS=true`, the
//! deliberately broken `POST /demo/naive/charges`, `POST /demo/naive/refunds`
//! and `POST /demo/redis/charges`, the webhook receivers (see
//! [`super::receiver`]), and `POST`/`GET /demo/processor/payments`, which
//! ask the card gateway for a payment with a new processor key per attempt
//! or the same one (block 10), and the lab's timelines: the middleware that
//! records a request sent with `Oncepay-Trace` and `GET /demo/trace`. The
//! broken ones share no code path with the real endpoints: each has its own
//! handler and its own key store.

use std::sync::Arc;

use axum::Json;
use axum::extract::{RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{Html, Response};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::app::AppState;
use crate::http::auth::Authenticated;
use crate::http::extract::{NoQuery, QueryParams, RawBody, decode};
use crate::http::idempotent::{self, REPLAYED};
use crate::http::input::FromParams;
use crate::http::problem::ApiError;
use crate::workshop;
use crate::workshop::broker_demo::{self, Handler};
use crate::workshop::processor_keys::{self, KeyPer};
use crate::workshop::trace::{self, Lane, RequestTrace, Trace, TraceEvent, Traces, timed};
use crate::workshop::{naive_refund, redis_keys};
use oncepay_core::charges::NewCharge;
use oncepay_core::error::Error;
use oncepay_core::faults::{self, CRASH_AFTER_COMMIT, Fault};
use oncepay_core::idempotency::SavedResponse;
use oncepay_core::objects::ChargeObject;
use oncepay_core::objects::RefundObject;
use oncepay_core::params::{ParamError, Params};
use oncepay_core::params::{required, string};
use oncepay_core::problem::{Problem, ProblemCode};
use oncepay_core::refunds::NewRefund;
use oncepay_core::retry_after;

/// The lab page: one self-contained file, no build step, nothing from the internet.
const LAB_PAGE: &str = include_str!("../../../static/lab.html");

/// When this process began serving, for `GET /demo/settings`: a workshop
/// that crashes the server on purpose tells the restarted process by it.
static STARTED: std::sync::LazyLock<std::time::SystemTime> =
    std::sync::LazyLock::new(std::time::SystemTime::now);

pub fn router(unsafe_endpoints: bool) -> OpenApiRouter<AppState> {
    std::sync::LazyLock::force(&STARTED);
    let router = OpenApiRouter::new()
        .routes(routes!(lab))
        .routes(routes!(effects))
        .routes(routes!(settings));
    if unsafe_endpoints {
        router
            .routes(routes!(naive_charge))
            .routes(routes!(naive_refund))
            .routes(routes!(redis_charge))
            .routes(routes!(processor_payment, processor_payments))
            .routes(routes!(trace))
            .routes(routes!(broker_deliveries))
            .routes(routes!(broker_window))
            .merge(super::receiver::router())
    } else {
        router
    }
}

/// Middleware (with `DEMO_UNSAFE_ENDPOINTS=true` only): records a request
/// that asks for it with `Oncepay-Trace`, its answer, or its answer lost.
pub async fn record_trace(
    State(traces): State<Arc<Traces>>,
    mut request: Request,
    next: Next,
) -> Response {
    let asked = format!("{} {}", request.method(), request.uri().path());
    let header = request.headers().get(trace::HEADER);
    let Some(trace) = RequestTrace::begin(&traces, header, asked) else {
        return next.run(request).await;
    };
    request.extensions_mut().insert(trace.clone());
    let response = next.run(request).await;
    let replayed = response.headers().contains_key(REPLAYED);
    trace.answered(response.status().as_u16(), replayed);
    response
}

/// The workshop's lab page (HTML, self-contained).
#[utoipa::path(get, path = "/lab", tag = "workshop", security(()),
    responses((status = 200, description = "The lab page", content_type = "text/html")))]
async fn lab() -> Html<&'static str> {
    Html(LAB_PAGE)
}

/// Payments, refunds and charges in the database for a workshop run.
///
/// `GET /demo/effects?run=TAG`: what the database holds for the merchant's
/// charges tagged `metadata[demo_run]=TAG`: payments recorded by the
/// processor (money moved) and charges by status. `run` is required: a count
/// over all of a merchant's charges would read its whole history.
#[utoipa::path(
    get,
    path = "/demo/effects",
    tag = "workshop",
    params(("run" = String, Query, description = "The run tag, `metadata[demo_run]`")),
    responses(
        (status = 200, description = "The counts", body = Effects),
        crate::http::openapi::Errors
    )
)]
async fn effects(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Json<Effects>, ApiError> {
    let run = run_query(query)?;
    let counts = workshop::effects(&state.pool, state.processor.as_ref(), merchant.id, &run)
        .await
        .map_err(payments_uncounted)?;
    Ok(Json(Effects {
        object: "demo_effects",
        run,
        payments: counts.payments,
        charged: counts.charged,
        refunds: counts.refunds,
        refunded: counts.refunded,
        charges: counts.charges,
        succeeded: counts.succeeded,
        failed: counts.failed,
        pending: counts.pending,
    }))
}

/// The `run` of a workshop read (`?run=TAG`), its only parameter.
fn run_query(query: Option<String>) -> Result<String, ApiError> {
    let mut run = None;
    for pair in oncepay_core::params::form_pairs(query.as_deref().unwrap_or("").as_bytes()) {
        let (name, value) = pair?;
        match name.as_ref() {
            "run" if !value.contains('\0') => run = Some(value.into_owned()),
            other => return Err(ParamError::unknown(other).into()),
        }
    }
    Ok(run.ok_or_else(|| {
        ParamError::new(
            ProblemCode::ParameterMissing,
            "run",
            "Missing required param: run (the metadata[demo_run] tag of the charges to count)",
        )
    })?)
}

/// `503 processor_unavailable` for a count that needs the processor's
/// payments when the processor does not answer; any other error as it is.
fn payments_uncounted(e: anyhow::Error) -> Error {
    match e.downcast_ref::<crate::processor::ProcessorError>() {
        Some(_) => Problem::new(
            ProblemCode::ProcessorUnavailable,
            "The card processor did not answer; its payments cannot be counted now.",
        )
        .with_retry_after(retry_after::SOON)
        .into(),
        None => Error::from(e),
    }
}

/// A workshop run's timeline, for the lab page to draw.
///
/// `GET /demo/trace?run=TAG`: what this server recorded of each request
/// that sent `Oncepay-Trace: TAG/<request>` (its arrival and answer, the
/// claim, the card gateway's call, the settle; the steps of the naive
/// endpoints and the receivers), with what the database holds for the run
/// (its charges and the money each moved, keys the sweeper settled,
/// refunds), in time order. Only with `DEMO_UNSAFE_ENDPOINTS=true`.
#[utoipa::path(
    get,
    path = "/demo/trace",
    tag = "workshop",
    params(("run" = String, Query, description = "The run tag, `metadata[demo_run]`")),
    responses(
        (status = 200, description = "The run's events", body = RunTrace),
        crate::http::openapi::Errors
    )
)]
async fn trace(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    RawQuery(query): RawQuery,
) -> Result<Json<RunTrace>, ApiError> {
    let run = run_query(query)?;
    let mut events = state.traces.events(&run);
    let processor = state.processor.as_ref();
    let stored = trace::stored(&state.pool, processor, merchant.id, &run, &events, *STARTED)
        .await
        .map_err(payments_uncounted)?;
    events.extend(stored);
    events.sort_by_key(|e| e.at_us);
    Ok(Json(RunTrace {
        object: "demo_trace",
        run,
        events,
    }))
}

/// A workshop run's events, in time order.
#[derive(Serialize, ToSchema)]
struct RunTrace {
    #[schema(example = "demo_trace")]
    object: &'static str,
    #[schema(example = "lab-1a2b3c4d5e")]
    run: String,
    events: Vec<TraceEvent>,
}

/// Effects in the database for a workshop run.
#[derive(Serialize, ToSchema)]
struct Effects {
    #[schema(example = "demo_effects")]
    object: &'static str,
    #[schema(example = "demo-1")]
    run: String,
    /// Payments the processor recorded: money moved.
    #[schema(example = 1)]
    payments: i64,
    /// What those payments took, in minor units.
    #[schema(example = 2000)]
    charged: i64,
    /// Refunds the processor recorded from those payments: money given back.
    #[schema(example = 0)]
    refunds: i64,
    /// What those refunds gave back, in minor units.
    #[schema(example = 0)]
    refunded: i64,
    #[schema(example = 1)]
    charges: i64,
    #[schema(example = 1)]
    succeeded: i64,
    #[schema(example = 0)]
    failed: i64,
    #[schema(example = 0)]
    pending: i64,
}

/// THE CLASSIC BUG, ON PURPOSE.
///
/// Look the key up, do the work, then write the
/// key: two requests that both look before either writes both do the work.
/// The real endpoint claims the key first, atomically; see `charges.rs`.
/// WRONG ON PURPOSE, for teaching (only with `DEMO_UNSAFE_ENDPOINTS=true`):
/// looks the key up, does the work, then writes the key, so two requests at
/// once both charge.
#[utoipa::path(
    post,
    path = "/demo/naive/charges",
    tag = "workshop",
    params(("Idempotency-Key" = String, Header, description = "Required here")),
    request_body(content(
        (NewCharge = "application/json"),
        (NewCharge = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Charged, or looked up", body = ChargeObject),
        (status = 402, response = crate::http::openapi::PaymentFailed),
        crate::http::openapi::BodyErrors
    )
)]
async fn naive_charge(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    Trace(trace): Trace,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let key = required_key(&state, &headers)?;
    crate::http::faults::from_headers(&state, &headers)?;
    let charge = NewCharge::from_params(decode(&headers, &body)?)?;
    let trace = trace.as_deref();
    // 1. Look the key up. (Bug: nothing stops a second request from looking too.)
    let lookup = workshop::naive_lookup(&state.pool, merchant.id, &key);
    let found = timed(trace, Lane::Database, "look the key up", lookup).await?;
    if let Some(saved) = found {
        let mut response = idempotent::send(saved);
        response
            .headers_mut()
            .insert(REPLAYED, HeaderValue::from_static("true"));
        return Ok(response);
    }
    // 2. Do the work: the same charge and processor code as the real path.
    let request_id = headers
        .get(crate::http::observe::REQUEST_ID)
        .and_then(|v| v.to_str().ok());
    let (charge_id, saved) =
        workshop::naive_charge(&state, merchant.id, &charge, request_id, trace)
            .await
            .map_err(|e| oncepay_core::error::Error::from_recovery(e, &state.engine.timeouts))?;
    // 3. Write the key, after the work. (Bug: too late to stop a duplicate.)
    let remember = workshop::naive_remember(&state.pool, merchant.id, &key, &charge_id, &saved);
    timed(
        trace,
        Lane::Database,
        "write the key, after the work",
        remember,
    )
    .await?;
    Ok(idempotent::send(saved))
}

/// What the workshop's scenarios need to know of this server.
///
/// A script or the lab page reads it to say what to turn on before it starts. Moves
/// no money and reads no table of its own; like every workshop count it
/// needs the merchant's key (which reads the merchant, from the cache or
/// `merchants`).
#[utoipa::path(
    get,
    path = "/demo/settings",
    tag = "workshop",
    responses(
        (status = 200, description = "The settings", body = Settings),
        crate::http::openapi::Errors
    )
)]
async fn settings(
    State(state): State<AppState>,
    _merchant: Authenticated,
    _: NoQuery,
) -> Json<Settings> {
    let config = &state.config;
    let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    Json(Settings {
        object: "demo_settings",
        idempotency_key_ttl_ms: millis(config.keys.ttl),
        processing_timeout_ms: millis(config.keys.processing_timeout),
        sweep_interval_ms: millis(config.keys.sweep_interval),
        processor_latency_ms: millis(config.processor.latency),
        fault_injection: config.workshop.fault_injection,
        demo_unsafe_endpoints: config.workshop.demo_unsafe_endpoints,
        webhook_allow_private: config.webhooks.allow_private,
        redis: state.redis.is_some(),
        model_url: config.workshop.model_url.clone(),
        started_at_ms: STARTED
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, millis),
    })
}

/// What the workshop's scenarios need to know of the server.
#[derive(Serialize, ToSchema)]
#[schema(as = DemoSettings)]
struct Settings {
    #[schema(example = "demo_settings")]
    object: &'static str,
    /// `IDEMPOTENCY_KEY_TTL`, in milliseconds: how long a saved answer is replayed.
    #[schema(example = 86_400_000)]
    idempotency_key_ttl_ms: u64,
    /// `PROCESSING_TIMEOUT`, in milliseconds: when the sweeper settles a key a crash left `processing`.
    #[schema(example = 30_000)]
    processing_timeout_ms: u64,
    /// `SWEEP_INTERVAL`, in milliseconds.
    #[schema(example = 5_000)]
    sweep_interval_ms: u64,
    /// `PROCESSOR_LATENCY_MS`.
    #[schema(example = 0)]
    processor_latency_ms: u64,
    /// `FAULT_INJECTION`: `Oncepay-Fault` is honoured.
    fault_injection: bool,
    /// `DEMO_UNSAFE_ENDPOINTS`: the deliberately broken endpoints are served.
    demo_unsafe_endpoints: bool,
    /// `WEBHOOK_ALLOW_PRIVATE`: webhook endpoints may point at this server's own receivers, on loopback.
    webhook_allow_private: bool,
    /// Whether `REDIS_URL` is set (not whether Redis answers).
    redis: bool,
    /// `DEMO_MODEL_URL`: the model checker's explorer, at a counterexample.
    #[schema(example = "http://127.0.0.1:3000/#/steps/0/0/1")]
    model_url: Option<String>,
    /// When this process started, Unix milliseconds: it changes when the server is restarted.
    #[schema(example = 1_764_892_800_000_u64)]
    started_at_ms: u64,
}

/// The `Idempotency-Key` the workshop's broken endpoints require.
fn required_key(state: &AppState, headers: &HeaderMap) -> Result<String, ApiError> {
    match idempotent::key_from_headers(state, headers)? {
        Some(key) => Ok(key.as_str().to_owned()),
        None => Err(Problem::new(
            ProblemCode::IdempotencyKeyMissing,
            "This workshop endpoint demonstrates keys; send an Idempotency-Key.",
        )
        .into()),
    }
}

/// IDEMPOTENCY IS NOT CONCURRENCY CONTROL, ON PURPOSE.
///
/// Claims its key first (right), then reads what is left to refund, checks it, refunds at
/// the processor and writes the new total: two statements, so two refunds
/// with different keys at once both pass the check. The real endpoint
/// reserves the amount with one conditional update; see `refunds.rs`.
/// WRONG ON PURPOSE, for teaching (only with `DEMO_UNSAFE_ENDPOINTS=true`):
/// checks what is left to refund and writes the new total in two
/// statements, so two refunds at once can refund more than was charged.
#[utoipa::path(
    post,
    path = "/demo/naive/refunds",
    tag = "workshop",
    params(("Idempotency-Key" = String, Header, description = "Required here")),
    request_body(content(
        (NewRefund = "application/json"),
        (NewRefund = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Refunded (or the saved answer, with `Idempotent-Replayed: true`)", body = RefundObject),
        (status = 409, response = crate::http::openapi::InFlight),
        crate::http::openapi::BodyErrors
    )
)]
async fn naive_refund(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    Trace(trace): Trace,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let key = required_key(&state, &headers)?;
    crate::http::faults::from_headers(&state, &headers)?;
    let refund = NewRefund::from_params(decode(&headers, &body)?)?;
    // The key, claimed before the work: this part is right.
    let claim = naive_refund::claim(&state.pool, merchant.id, &key);
    match timed(
        trace.as_deref(),
        Lane::Database,
        "claim (INSERT ... ON CONFLICT)",
        claim,
    )
    .await?
    {
        naive_refund::Claim::Claimed => {}
        naive_refund::Claim::Replay(saved) => return Ok(idempotent::replay(saved, None, false)),
        naive_refund::Claim::InUse => {
            return Err(Problem::new(
                ProblemCode::IdempotencyKeyInUse,
                "A request with this key is still at work. Retry later.",
            )
            .with_retry_after(retry_after::SOON)
            .into());
        }
    }
    let refunded = match naive_refund::refund(&state, merchant.id, &refund, trace.as_deref()).await
    {
        Ok(refunded) => refunded,
        Err(Error::Problem(problem)) if problem.status.is_client_error() => {
            // Refused by the check, before any money moved: the key is free.
            naive_refund::release(&state.pool, merchant.id, &key).await?;
            return Err(Error::Problem(problem).into());
        }
        Err(e) => return Err(e.into()),
    };
    let saved = SavedResponse {
        status: 201,
        content_type: "application/json".to_owned(),
        location: None,
        body: serde_json::to_vec(&refunded.to_object())
            .map_err(|e| ApiError::internal(e.into()))?
            .into(),
    };
    naive_refund::complete(&state.pool, merchant.id, &key, &saved).await?;
    Ok(idempotent::send(saved))
}

/// `503 redis_unavailable`, saying why.
fn redis_unavailable(detail: impl Into<String>) -> ApiError {
    Problem::new(ProblemCode::RedisUnavailable, detail)
        .with_retry_after(retry_after::SOON)
        .into()
}

fn redis_failed(error: redis::RedisError) -> ApiError {
    tracing::warn!(%error, "the workshop's Redis failed");
    redis_unavailable(format!("Redis did not answer: {error}"))
}

/// The fault this endpoint honours: `crash-after-commit` (and the
/// middleware's `drop-response`).
fn redis_fault(state: &AppState, headers: &HeaderMap) -> Result<Option<Fault>, ApiError> {
    match crate::http::faults::requested(state, headers)? {
        None | Some("drop-response") => Ok(None),
        Some(CRASH_AFTER_COMMIT) => Ok(Some(Fault::CrashAfterCommit)),
        Some(_) => Err(Problem::new(
            ProblemCode::InvalidFault,
            "POST /demo/redis/charges takes Oncepay-Fault: crash-after-commit or drop-response.",
        )
        .into()),
    }
}

/// THE KEY KEPT OUTSIDE THE BUSINESS TRANSACTION, ON PURPOSE.
///
/// Claims the key in Redis (`SET NX`), commits the charge in Postgres, then writes the
/// answer back to Redis: a crash between the two commits leaves the key
/// `processing` in Redis until its TTL, and the retry after that charges
/// again. The real endpoint claims the key in the charge's transaction.
/// WRONG ON PURPOSE, for teaching (only with `DEMO_UNSAFE_ENDPOINTS=true`
/// and `REDIS_URL`): keeps its keys in Redis, outside the charge's
/// transaction, so a crash between the two leaves a key no one settles.
#[utoipa::path(
    post,
    path = "/demo/redis/charges",
    tag = "workshop",
    params(
        ("Idempotency-Key" = String, Header, description = "Required here"),
        ("Oncepay-Fault" = Option<String>, Header, nullable = false, description = "`crash-after-commit` (with `FAULT_INJECTION=true`): abort the process after the charge committed, before the answer is written to Redis")
    ),
    request_body(content(
        (NewCharge = "application/json"),
        (NewCharge = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 201, description = "Charged (or the answer saved in Redis, with `Idempotent-Replayed: true`)", body = ChargeObject),
        (status = 402, response = crate::http::openapi::PaymentFailed),
        (status = 409, response = crate::http::openapi::InFlight),
        crate::http::openapi::BodyErrors
    )
)]
async fn redis_charge(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    Trace(trace): Trace,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let Some(client) = state.redis.clone() else {
        return Err(redis_unavailable(
            "This server has no Redis: start it with REDIS_URL (for example redis://127.0.0.1:6379).",
        ));
    };
    let key = required_key(&state, &headers)?;
    let fault = redis_fault(&state, &headers)?;
    let charge = NewCharge::from_params(decode(&headers, &body)?)?;
    let ttl = state.config.keys.ttl;
    let mut redis = redis_keys::connect(&client).await.map_err(redis_failed)?;
    let trace = trace.as_deref();
    // 1. Claim the key in Redis: SET key processing NX PX ttl.
    let claim = redis_keys::claim(&mut redis, merchant.id, &key, ttl);
    match timed(trace, Lane::Redis, "claim the key: SET NX", claim)
        .await
        .map_err(redis_failed)?
    {
        redis_keys::Claim::Claimed => {}
        redis_keys::Claim::Replay(saved) => return Ok(idempotent::replay(saved, None, false)),
        redis_keys::Claim::InUse { ttl } => {
            let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
            return Err(Problem::new(
                ProblemCode::IdempotencyKeyInUse,
                format!(
                    "Redis holds this key as processing for {ms} ms more. Nothing else can settle it:                      the key and the charge are in two systems."
                ),
            )
            .with_extra("redis_ttl_ms", ms)
            .with_retry_after(retry_after::SOON)
            .into());
        }
    }
    // 2. The charge, committed in Postgres.
    let request_id = headers
        .get(crate::http::observe::REQUEST_ID)
        .and_then(|v| v.to_str().ok());
    let saved = match workshop::naive_charge(&state, merchant.id, &charge, request_id, trace).await
    {
        Ok((_, saved)) => saved,
        Err(e) => {
            let _ = redis_keys::release(&mut redis, merchant.id, &key).await;
            return Err(Error::from_recovery(e, &state.engine.timeouts).into());
        }
    };
    // 3. Committed in Postgres, not yet in Redis: a crash here is the bug.
    faults::crash_if(fault, Fault::CrashAfterCommit);
    // 4. The answer, written back to Redis.
    let complete = redis_keys::complete(&mut redis, merchant.id, &key, &saved, ttl);
    timed(trace, Lane::Redis, "the answer written to Redis", complete)
        .await
        .map_err(redis_failed)?;
    Ok(idempotent::send(saved))
}

/// The run tag of block 10's routes: part of the processor keys.
fn processor_run(params: &mut Params) -> Result<String, ApiError> {
    let run = string(required(params, "run")?, "run")?;
    if !trace::valid_run(&run) {
        return Err(ParamError::new(
            ProblemCode::ParameterInvalidString,
            "run",
            "run must be 1 to 100 letters, digits, - or _ (it is part of the processor keys).",
        )
        .into());
    }
    Ok(run)
}

/// A NEW PROCESSOR KEY PER ATTEMPT, ON PURPOSE (with keys=new_per_attempt).
///
/// Asks the card gateway for one payment of `amount` (default 500), its
/// first answer dropped after the money moved (`Processor-Fault:
/// drop-after-record`), then again until answered, at most three attempts:
/// with `keys=same` every attempt carries the key `demo:{run}` and the
/// gateway finds its payment; with `keys=new_per_attempt` each carries
/// `demo:{run}:attempt-{n}` and the gateway takes the money again. Only with
/// `DEMO_UNSAFE_ENDPOINTS=true` and `FAULT_INJECTION=true` (and a gateway
/// that honours `Processor-Fault`).
#[utoipa::path(
    post,
    path = "/demo/processor/payments",
    tag = "workshop",
    responses(
        (status = 200, description = "The attempts and what each got", body = ProcessorPayment),
        (status = 415, response = crate::http::openapi::UnsupportedMediaType),
        crate::http::openapi::Errors
    )
)]
async fn processor_payment(
    State(state): State<AppState>,
    _merchant: Authenticated,
    Trace(trace): Trace,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<ProcessorPayment>, ApiError> {
    let mut params = decode(&headers, &body)?;
    let run = processor_run(&mut params)?;
    let keys = string(required(&mut params, "keys")?, "keys")?;
    let keys = KeyPer::parse(&keys).ok_or_else(|| {
        ParamError::new(
            ProblemCode::ParameterInvalidString,
            "keys",
            "keys must be same or new_per_attempt.",
        )
    })?;
    let amount = match params.take("amount") {
        None => 500,
        Some(value) => value
            .as_i64()
            .or_else(|| value.as_str().and_then(|s| s.parse().ok()))
            .filter(|a| (1..=99_999_999).contains(a))
            .ok_or_else(|| {
                ParamError::new(
                    ProblemCode::ParameterInvalidInteger,
                    "amount",
                    "amount must be a whole number of minor units, 1 to 99999999.",
                )
            })?,
    };
    params.reject_unknown()?;
    if !state.config.workshop.fault_injection {
        return Err(Problem::new(
            ProblemCode::FaultInjectionDisabled,
            "This scenario loses the gateway's answer on purpose: run the server with FAULT_INJECTION=true.",
        )
        .into());
    }
    let attempts = processor_keys::pay(&state.config, keys, &run, amount, trace.as_deref())
        .await
        .map_err(ApiError::internal)?;
    Ok(Json(ProcessorPayment {
        object: "demo_processor_payment",
        run,
        keys: keys.as_str(),
        amount,
        attempts: attempts
            .iter()
            .map(|a| ProcessorAttempt {
                processor_key: a.processor_key.clone(),
                answer_dropped: a.dropped,
                answer: a.answer.to_string(),
            })
            .collect(),
    }))
}

/// One payment asked of the card gateway, attempt after attempt (block 10).
#[derive(Serialize, ToSchema)]
#[schema(as = DemoProcessorPayment)]
struct ProcessorPayment {
    #[schema(example = "demo_processor_payment")]
    object: &'static str,
    #[schema(example = "demo-10")]
    run: String,
    /// `same` (one processor key for every attempt) or `new_per_attempt`.
    #[schema(example = "same")]
    keys: &'static str,
    #[schema(example = 500)]
    amount: i64,
    attempts: Vec<ProcessorAttempt>,
}

/// One attempt of a block-10 payment.
#[derive(Serialize, ToSchema)]
#[schema(as = DemoProcessorAttempt)]
struct ProcessorAttempt {
    /// The `Idempotency-Key` the gateway got.
    #[schema(example = "demo:demo-10")]
    processor_key: String,
    /// Whether the gateway was asked to drop its answer after recording.
    answer_dropped: bool,
    /// `succeeded`, `no answer`, `unavailable`, `declined (code)` or `voided`.
    #[schema(example = "succeeded")]
    answer: String,
}

/// The gateway's payments for a block-10 run.
///
/// The payments the card gateway's ledger holds for a block-10 run, looked
/// up over its API under every key the run can have used.
#[utoipa::path(
    get,
    path = "/demo/processor/payments",
    tag = "workshop",
    params(("run" = String, Query, description = "The run tag of the payments")),
    responses(
        (status = 200, description = "The counts", body = ProcessorPayments),
        crate::http::openapi::Errors
    )
)]
async fn processor_payments(
    State(state): State<AppState>,
    _merchant: Authenticated,
    QueryParams(mut params): QueryParams,
) -> Result<Json<ProcessorPayments>, ApiError> {
    let run = processor_run(&mut params)?;
    params.reject_unknown()?;
    let found = processor_keys::payments(state.processor.as_ref(), &run)
        .await
        .map_err(payments_uncounted)?;
    Ok(Json(ProcessorPayments {
        object: "demo_processor_payments",
        run,
        payments: found.payments,
        charged: found.charged,
        keys: found.keys,
    }))
}

/// The payments the card gateway's ledger holds for a block-10 run.
#[derive(Serialize, ToSchema)]
#[schema(as = DemoProcessorPayments)]
struct ProcessorPayments {
    #[schema(example = "demo_processor_payments")]
    object: &'static str,
    #[schema(example = "demo-10")]
    run: String,
    /// Payments that went through: money moved.
    #[schema(example = 1)]
    payments: i64,
    /// What they took, in minor units.
    #[schema(example = 500)]
    charged: i64,
    /// The processor keys that hold them.
    #[schema(example = json!(["demo:demo-10"]))]
    keys: Vec<String>,
}

/// Block 12: one event delivered twice, its first ack lost.
///
/// `POST /demo/broker/deliveries`: the event goes to the naive handler or
/// the inbox handler; the answer is what each delivery did and the effects
/// booked.
#[utoipa::path(
    post,
    path = "/demo/broker/deliveries",
    tag = "workshop",
    responses(
        (status = 200, description = "What each delivery did, and the effects", body = BrokerDeliveries),
        (status = 415, response = crate::http::openapi::UnsupportedMediaType),
        crate::http::openapi::Errors
    )
)]
async fn broker_deliveries(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<BrokerDeliveries>, ApiError> {
    let mut params = decode(&headers, &body)?;
    let run = processor_run(&mut params)?;
    let handler = string(required(&mut params, "handler")?, "handler")?;
    let handler = Handler::parse(&handler).ok_or_else(|| {
        ParamError::new(
            ProblemCode::ParameterInvalidString,
            "handler",
            "handler must be naive or inbox.",
        )
    })?;
    params.reject_unknown()?;
    let broker = &state.config.broker;
    let done = broker_demo::deliver_twice(&state.pool, broker, merchant.id, &run, handler).await;
    let done = done.map_err(broker_unavailable)?;
    Ok(Json(BrokerDeliveries {
        object: "demo_broker_deliveries",
        run,
        handler: handler.as_str(),
        handled: done.handled,
        effects_before: done.effects_before,
        effects: done.effects,
    }))
}

/// Block 12: one message id published twice inside the duplicate window.
///
/// `POST /demo/broker/window`: published twice within the workshop
/// stream's duplicate window, then once after it.
#[utoipa::path(
    post,
    path = "/demo/broker/window",
    tag = "workshop",
    responses(
        (status = 200, description = "The copies the stream kept", body = BrokerWindow),
        (status = 415, response = crate::http::openapi::UnsupportedMediaType),
        crate::http::openapi::Errors
    )
)]
async fn broker_window(
    State(state): State<AppState>,
    _merchant: Authenticated,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<BrokerWindow>, ApiError> {
    let mut params = decode(&headers, &body)?;
    let run = processor_run(&mut params)?;
    params.reject_unknown()?;
    let seen = broker_demo::window(&state.config.broker, &run)
        .await
        .map_err(broker_unavailable)?;
    Ok(Json(BrokerWindow {
        object: "demo_broker_window",
        run,
        window_ms: broker_demo::WINDOW.as_millis() as u64,
        duplicate: seen.duplicate.to_vec(),
        inside: seen.inside,
        after: seen.after,
    }))
}

/// `503 broker_unavailable`, saying what went wrong: a workshop's
/// presenter needs the reason on the page, not only in the log.
fn broker_unavailable(e: anyhow::Error) -> ApiError {
    let reason = format!("{e:#}");
    tracing::warn!(error = reason, "the workshop's broker scenario failed");
    Problem::new(
        ProblemCode::BrokerUnavailable,
        format!(
            "This scenario failed: {reason}. It needs a NATS server with JetStream: run the server \
             with NATS_URL (scripts/workshop finds or starts one)."
        ),
    )
    .into()
}

/// What block 12's handler did with each delivery of one event.
#[derive(Serialize, ToSchema)]
#[schema(as = DemoBrokerDeliveries)]
struct BrokerDeliveries {
    #[schema(example = "demo_broker_deliveries")]
    object: &'static str,
    #[schema(example = "demo-12")]
    run: String,
    /// `naive` (books every delivery) or `inbox` (books an event id once).
    #[schema(example = "inbox")]
    handler: &'static str,
    /// What each delivery did, in order.
    #[schema(example = json!(["booked", "in the inbox already: skipped"]))]
    handled: Vec<&'static str>,
    /// Ledger entries of the run's handler before the event was published.
    #[schema(example = 0)]
    effects_before: i64,
    /// Ledger entries of the run's handler after its second delivery.
    #[schema(example = 1)]
    effects: i64,
}

/// Block 12's duplicate window: three publishes of one message id.
#[derive(Serialize, ToSchema)]
#[schema(as = DemoBrokerWindow)]
struct BrokerWindow {
    #[schema(example = "demo_broker_window")]
    object: &'static str,
    #[schema(example = "demo-12")]
    run: String,
    #[schema(example = 1000)]
    window_ms: u64,
    /// Whether the broker called each publish a duplicate.
    #[schema(example = json!([false, true, false]))]
    duplicate: Vec<bool>,
    /// Copies in the stream after the two publishes inside the window.
    #[schema(example = 1)]
    inside: u64,
    /// Copies after the third, past the window.
    #[schema(example = 2)]
    after: u64,
}
