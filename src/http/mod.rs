//! The HTTP layer: the router, extractors, problem responses, and one module
//! per resource.

pub mod auth;
pub mod balance;
pub mod charges;
pub mod details;
pub mod events;
pub mod extract;
pub mod faults;
pub mod from_params;
pub mod health;
pub mod idempotency_keys;
pub mod idempotent;
pub mod input;
pub mod list;
pub mod observe;
pub mod openapi;
pub mod problem;
pub mod refunds;
pub mod server;
pub mod stripe;
pub mod webhook_endpoints;

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use futures::future::Either;
use tower::util::MapRequestLayer;
use tower::{Service, ServiceBuilder, ServiceExt as _};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::app::AppState;
use crate::config::Config;
use crate::workshop::broker_demo;
use oncepay_core::problem::{Problem, ProblemCode};

/// Every route, each described as it is registered (`routes!`), so the
/// OpenAPI document cannot miss one.
pub fn api(config: &Config) -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .merge(charges::router())
        .merge(refunds::router())
        .merge(events::router())
        .merge(webhook_endpoints::router())
        .merge(balance::router())
        .merge(idempotency_keys::router())
        .merge(health::router())
        .merge(crate::workshop::http::demo::router(
            config.workshop.demo_unsafe_endpoints,
        ))
        .routes(routes!(health::metrics_endpoint))
        .routes(routes!(openapi_json))
}

/// `404 route_not_found` for a request whose path no route has.
async fn unrecognized(method: Method, uri: Uri) -> axum::response::Response {
    problem::respond(unrecognized_url(ProblemCode::RouteNotFound, &method, &uri))
}

/// `405 method_not_allowed` for a method its path's route does not take;
/// the router adds `Allow`. A Stripe client gets Stripe's `404` for it
/// (see `stripe::for_client`).
async fn not_allowed(method: Method, uri: Uri) -> axum::response::Response {
    problem::respond(unrecognized_url(
        ProblemCode::MethodNotAllowed,
        &method,
        &uri,
    ))
}

/// A request URL no route takes, with Stripe's message for it, word for
/// word, which names the method and the path.
fn unrecognized_url(code: ProblemCode, method: &Method, uri: &Uri) -> Problem {
    Problem::new(
        code,
        format!(
            "Unrecognized request URL ({}: {}). Please see https://stripe.com/docs or we can help at https://support.stripe.com/.",
            oncepay_core::params::shorten(method.as_str()),
            oncepay_core::params::shorten(uri.path()),
        ),
    )
}

/// The whole API, and Swagger UI at `/docs`, each request answered within
/// `REQUEST_TIMEOUT`; with `DEMO_UNSAFE_ENDPOINTS=true`, the workshop's
/// broker card within a budget of its own (see [`layered`]).
pub fn router(state: AppState) -> Router {
    let (routes, _) = api(&state.config).split_for_parts();
    let routes = routes
        .merge(openapi::swagger_ui())
        .fallback(unrecognized)
        .method_not_allowed_fallback(not_allowed)
        // On every route and fallback, after the router has matched the
        // path (a method the route lacks included).
        .layer(MapRequestLayer::new(observe::note_route))
        .with_state(state.clone());
    let all = layered(&state, state.config.request_timeout, routes.clone());
    if !state.config.workshop.demo_unsafe_endpoints {
        return Router::new().fallback_service(all);
    }
    // The broker card waits on the broker's own timers (an ack wait, a
    // duplicate window), which the workshop's short REQUEST_TIMEOUT cannot
    // hold: those demonstrations are not requests under a key, and their
    // budget is theirs.
    let broker = layered(&state, broker_demo::BUDGET, routes);
    // By path, before any router: a route would note its own matched path.
    let by_path = tower::service_fn(move |request: Request| {
        if request.uri().path().starts_with("/demo/broker/") {
            Either::Left(broker.clone().oneshot(request))
        } else {
            Either::Right(all.clone().oneshot(request))
        }
    });
    Router::new().fallback_service(by_path)
}

/// The routes wrapped in every layer, answered within `budget`. From the
/// outside in: the workshop's recording of a traced request (with
/// `DEMO_UNSAFE_ENDPOINTS=true` only, see `workshop::trace`), fault
/// injection (with `FAULT_INJECTION=true` only, see `faults::drop_response`),
/// request id, tracing span, the way out (metrics, Stripe's headers, problem
/// bodies: `observe::finish`), panic catcher, timeout, body limit.
///
/// They wrap the router once, as one service, rather than each route:
/// `Router::layer` wraps every route in every layer, and each of those
/// boxed stacks is cloned for every request it serves. Only the note of
/// the matched route (`observe::note_route`) sits on the routes, where the
/// route is known.
fn layered(
    state: &AppState,
    budget: Duration,
    routes: Router,
) -> impl Service<Request, Response = Response, Error = Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ 'static {
    let max_body = state.config.server.max_body_bytes;
    // Outermost, outside the panic catcher, and only where faults are
    // injected at all: see `faults::drop_response`.
    let faults = state
        .config
        .workshop
        .fault_injection
        .then(|| axum::middleware::from_fn_with_state(state.clone(), faults::drop_response));
    // Outside the faults, so that a dropped answer is recorded as lost.
    let trace = state.config.workshop.demo_unsafe_endpoints.then(|| {
        axum::middleware::from_fn_with_state(
            state.traces.clone(),
            crate::workshop::http::demo::record_trace,
        )
    });
    ServiceBuilder::new()
        .option_layer(trace)
        .map_response(IntoResponse::into_response)
        .option_layer(faults)
        // One answer type, whether the fault layer is there or not.
        .map_response(IntoResponse::into_response)
        .map_request(observe::sanitize_request_id)
        .layer(SetRequestIdLayer::x_request_id(observe::MakeRequestId))
        .layer(PropagateRequestIdLayer::x_request_id())
        // Spans carry no headers: Authorization and API keys are never logged.
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|request: &axum::extract::Request| observe::span(request))
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            observe::finish,
        ))
        .layer(CatchPanicLayer::custom(|_| {
            tracing::error!("a handler panicked");
            problem::respond(Problem::new(
                ProblemCode::InternalError,
                "Something went wrong on our side.",
            ))
        }))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            budget,
        ))
        // The timeout's own answer needs a body type with a default.
        .map_response(IntoResponse::into_response)
        .layer(RequestBodyLimitLayer::new(max_body))
        .layer(DefaultBodyLimit::max(max_body))
        .service(routes)
}

/// This document.
///
/// `GET /openapi.json`: the OpenAPI 3.1 description of every route.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "The OpenAPI 3.1 document", content_type = "application/json"),
        (status = 400, response = openapi::BadRequest)
    )
)]
async fn openapi_json(
    State(state): State<AppState>,
    _: extract::NoQuery,
) -> Json<utoipa::openapi::OpenApi> {
    Json(api(&state.config).split_for_parts().1)
}
