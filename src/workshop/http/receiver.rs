//! The workshop's webhook receivers, served only with
//! `DEMO_UNSAFE_ENDPOINTS=true` (see [`crate::workshop::receiver`]):
//! `POST /demo/receivers` sets one up for a run, `GET /demo/receivers`
//! counts what a run's receivers took in, and `POST /demo/receiver/naive`
//! and `POST /demo/receiver/inbox` take deliveries, as a merchant's order
//! system would.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::app::AppState;
use crate::http::auth::Authenticated;
use crate::http::extract::{QueryParams, RawBody, decode};
use crate::http::problem::ApiError;
use crate::webhooks::signature;
use crate::workshop::receiver::{
    self, CRASH_AFTER_DELIVERY, Misbehaviour, Mode, NewReceiver, Receipt, ReceiverCounts,
};
use crate::workshop::trace;
use oncepay_core::objects::EventObject;
use oncepay_core::params::{ParamError, Params};
use oncepay_core::params::{required, string};
use oncepay_core::problem::{Problem, ProblemCode};

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(register, counts))
        .routes(routes!(naive))
        .routes(routes!(inbox))
}

/// The path a run's receiver takes deliveries at.
fn path(mode: Mode, run: &str) -> String {
    let run: String = form_urlencoded::byte_serialize(run.as_bytes()).collect();
    format!("/demo/receiver/{}?run={run}", mode.as_str())
}

fn fault(misbehaviour: Misbehaviour) -> Option<&'static str> {
    (misbehaviour == Misbehaviour::CrashAfterDelivery).then_some(CRASH_AFTER_DELIVERY)
}

/// Sets up the receiver of a run in one mode.
///
/// It takes the signing secret of the webhook endpoint that will send to
/// it (the `whsec_` that endpoint's create answered) and how it fails on
/// purpose. Setting it up again replaces the secret and the behaviour; what
/// it took in stays counted.
#[utoipa::path(
    post,
    path = "/demo/receivers",
    tag = "workshop",
    request_body(content(
        (NewReceiver = "application/json"),
        (NewReceiver = "application/x-www-form-urlencoded")
    )),
    responses(
        (status = 200, description = "Set up", body = DemoReceiver),
        crate::http::openapi::BodyErrors
    )
)]
async fn register(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> Result<Json<DemoReceiver>, ApiError> {
    let new = NewReceiver::from_params(decode(&headers, &body)?)?;
    if new.misbehaviour == Misbehaviour::CrashAfterDelivery
        && !state.config.workshop.fault_injection
    {
        return Err(Problem::new(
            ProblemCode::FaultInjectionDisabled,
            "fault=crash-after-delivery is only honoured when the server runs with FAULT_INJECTION=true.",
        )
        .into());
    }
    receiver::register(&state.pool, merchant.id, &new).await?;
    Ok(Json(DemoReceiver {
        object: "demo_receiver",
        path: path(new.mode, &new.run),
        mode: new.mode.as_str(),
        fail_first: new.fail_first,
        fault: fault(new.misbehaviour),
        run: new.run,
    }))
}

/// `run`, the one query parameter of these routes.
fn run_param(mut params: Params) -> Result<String, ParamError> {
    let run = string(required(&mut params, "run")?, "run")?;
    params.reject_unknown()?;
    Ok(run)
}

/// What a run's receivers took in.
///
/// What a run's receivers took in, read from the database: per receiver,
/// the deliveries it received (signature verified), the distinct events
/// among them and the orders it shipped.
#[utoipa::path(
    get,
    path = "/demo/receivers",
    tag = "workshop",
    params(("run" = String, Query, description = "The run tag the receivers were set up for")),
    responses(
        (status = 200, description = "The counts", body = DemoReceivers),
        crate::http::openapi::Errors
    )
)]
async fn counts(
    State(state): State<AppState>,
    Authenticated(merchant): Authenticated,
    QueryParams(params): QueryParams,
) -> Result<Json<DemoReceivers>, ApiError> {
    let run = run_param(params)?;
    let counts = receiver::counts(&state.pool, merchant.id, &run).await?;
    let of = |mode: Mode| {
        let found = counts.receivers.iter().find(|r| r.mode == mode);
        let zero = ReceiverCounts {
            mode,
            fail_first: 0,
            misbehaviour: Misbehaviour::Fail,
            deliveries: 0,
            events: 0,
            shipments: 0,
        };
        let r = found.unwrap_or(&zero);
        DemoReceiverCounts {
            registered: found.is_some(),
            path: path(mode, &run),
            fail_first: r.fail_first,
            fault: found.and_then(|r| fault(r.misbehaviour)),
            deliveries: r.deliveries,
            events: r.events,
            shipments: r.shipments,
        }
    };
    let receivers = DemoReceiverModes {
        naive: of(Mode::Naive),
        inbox: of(Mode::Inbox),
    };
    Ok(Json(DemoReceivers {
        object: "demo_receivers",
        run,
        events: counts.events,
        receivers,
    }))
}

/// Declares the route of a receiver, `POST /demo/receiver/{mode}`: a
/// handler that passes the delivery to [`receive`] with its mode, and the
/// description the two receivers share but for what they do with it.
macro_rules! receiver_route {
    ($(#[doc = $doc:tt])* $name:ident, $path:tt, $mode:expr, $answered:tt) => {
        $(#[doc = $doc])*
        #[utoipa::path(
            post,
            path = $path,
            tag = "workshop",
            security(()),
            params(
                ("run" = String, Query, description = "The run whose receiver takes the delivery"),
                ("Stripe-Signature" = String, Header, description = "`t=<unix seconds>,v1=<hex HMAC-SHA256 of \"t.body\">`, keyed with the receiver's secret; at most five minutes old")
            ),
            request_body(content = EventObject, content_type = "application/json",
                description = "An event, as the delivery worker sends it; the signature covers these exact bytes"),
            responses(
                (status = 200, description = $answered, body = DemoReceipt,
                 headers(("Oncepay-Fault" = String, description = "`crash-after-delivery`, on the deliveries the receiver's `fault` asks a worker to crash after"))),
                (status = 400, response = crate::http::openapi::BadRequest),
                (status = 413, response = crate::http::openapi::TooLarge),
                (status = 500, description = "Failed on purpose after its work committed (`receiver_failed_on_purpose`, `fail_first`), or a bug",
                 body = oncepay_core::problem::Body, content_type = "application/problem+json"),
                (status = 503, response = crate::http::openapi::Unavailable)
            )
        )]
        async fn $name(
            State(state): State<AppState>,
            QueryParams(params): QueryParams,
            headers: HeaderMap,
            RawBody(body): RawBody,
        ) -> Result<Response, ApiError> {
            receive(&state, $mode, params, &headers, &body).await
        }
    };
}

receiver_route!(
    /// The naive receiver, wrong on purpose: ships every delivery.
    ///
    /// WRONG ON PURPOSE, for teaching: verifies the signature, then ships an
    /// order for every delivery, so an event delivered three times ships three.
    naive,
    "/demo/receiver/naive",
    Mode::Naive,
    "Received and acted on, or about another run and ignored"
);

receiver_route!(
    /// The inbox receiver: ships each event once.
    ///
    /// Verifies the signature, then records the event id in its inbox and ships
    /// in one transaction, only when the id is new: a redelivery ships nothing.
    inbox,
    "/demo/receiver/inbox",
    Mode::Inbox,
    "Received (and shipped if the event was new), or about another run and ignored"
);

/// Takes a delivery for the run's receiver in `mode`: the receipt, or the
/// failure its behaviour asks for.
async fn receive(
    state: &AppState,
    mode: Mode,
    params: Params,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let run = run_param(params)?;
    let arrived = std::time::SystemTime::now();
    // A header that is not visible ASCII is there, and malformed.
    let signed = headers
        .get(signature::HEADER)
        .map(|v| v.to_str().unwrap_or(""));
    let receipt = receiver::receive(&state.pool, &run, mode, signed, body).await?;
    let answer = |event: &str, delivery: Option<i32>, shipped: bool| DemoReceipt {
        object: "demo_receipt",
        run: run.clone(),
        receiver: mode.as_str(),
        event: event.to_owned(),
        ignored: delivery.is_none(),
        delivery,
        shipped,
    };
    match receipt {
        Receipt::Ignored { event_id } => Ok(Json(answer(&event_id, None, false)).into_response()),
        Receipt::Received {
            event_id,
            delivery,
            shipped,
            misbehaviour,
        } => {
            let failed = misbehaviour == Some(Misbehaviour::Fail);
            let delivered = trace::Delivery {
                receiver: mode.as_str(),
                number: delivery,
                shipped,
                status: if failed { 500 } else { 200 },
            };
            delivered.record(&state.traces, &run, arrived);
            let body = answer(&event_id, Some(delivery), shipped);
            match misbehaviour {
                None => Ok(Json(body).into_response()),
                Some(Misbehaviour::Fail) => Err(Problem::new(
                    ProblemCode::ReceiverFailedOnPurpose,
                    format!(
                        "Delivery {delivery} of {event_id} was received and committed (shipped: {shipped}); \
                         this receiver answers 500 anyway, as its fail_first asks, so the event is sent again."
                    ),
                )
                .with_extra("event", event_id)
                .with_extra("delivery", delivery)
                .with_extra("shipped", shipped)
                .into()),
                Some(Misbehaviour::CrashAfterDelivery) => {
                    let mut response = Json(body).into_response();
                    response.headers_mut().insert(
                        HeaderName::from_static(oncepay_core::faults::HEADER),
                        HeaderValue::from_static(CRASH_AFTER_DELIVERY),
                    );
                    Ok(response)
                }
            }
        }
    }
}

/// A receiver as set up.
#[derive(Serialize, ToSchema)]
struct DemoReceiver {
    #[schema(example = "demo_receiver")]
    object: &'static str,
    #[schema(example = "demo-1")]
    run: String,
    #[schema(example = "inbox")]
    mode: &'static str,
    /// Where it takes deliveries: the URL to give the webhook endpoint, on
    /// this server.
    #[schema(example = "/demo/receiver/inbox?run=demo-1")]
    path: String,
    #[schema(example = 0)]
    fail_first: i32,
    fault: Option<&'static str>,
}

/// The receivers of a run and what they took in.
#[derive(Serialize, ToSchema)]
struct DemoReceivers {
    #[schema(example = "demo_receivers")]
    object: &'static str,
    #[schema(example = "demo-1")]
    run: String,
    /// Distinct events received by either receiver.
    #[schema(example = 1)]
    events: i64,
    receivers: DemoReceiverModes,
}

/// The run's two receivers.
#[derive(Serialize, ToSchema)]
struct DemoReceiverModes {
    naive: DemoReceiverCounts,
    inbox: DemoReceiverCounts,
}

/// One receiver of a run; zeros when it was not set up.
#[derive(Serialize, ToSchema)]
struct DemoReceiverCounts {
    registered: bool,
    #[schema(example = "/demo/receiver/inbox?run=demo-1")]
    path: String,
    #[schema(example = 0)]
    fail_first: i32,
    fault: Option<&'static str>,
    /// Deliveries received: signature verified, about this run.
    #[schema(example = 3)]
    deliveries: i64,
    /// Distinct events among them.
    #[schema(example = 1)]
    events: i64,
    /// Orders shipped.
    #[schema(example = 1)]
    shipments: i64,
}

/// What a receiver did with a delivery.
#[derive(Serialize, ToSchema)]
struct DemoReceipt {
    #[schema(example = "demo_receipt")]
    object: &'static str,
    #[schema(example = "demo-1")]
    run: String,
    /// `naive` or `inbox`.
    #[schema(example = "inbox")]
    receiver: &'static str,
    /// The event's id.
    event: String,
    /// The event is about no charge of this run: nothing was written.
    ignored: bool,
    /// This delivery's number among the deliveries of its event, from 1;
    /// null when ignored.
    #[schema(example = 1)]
    delivery: Option<i32>,
    /// Whether this delivery shipped an order.
    shipped: bool,
}
