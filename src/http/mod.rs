//! The HTTP layer: the router, extractors, problem responses, and one module
//! per resource.

pub mod auth;
pub mod balance;
pub mod charges;
pub mod demo;
pub mod extract;
pub mod faults;
pub mod health;
pub mod idempotency_keys;
pub mod idempotent;
pub mod observe;
pub mod openapi;
pub mod problem;
pub mod refunds;
pub mod retry_after;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::Config;
use crate::idempotency::wait::Waits;
use crate::processor::Processor;
use problem::Problem;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<Config>,
    pub processor: Arc<dyn Processor>,
    pub metrics: observe::Metrics,
    /// The work a request hands to its own task (steps 2 to 4); shutdown
    /// waits for it, within `SHUTDOWN_GRACE`.
    pub tasks: TaskTracker,
    /// Completed answers and merchants, see [`crate::cache`].
    pub caches: Arc<crate::cache::Caches>,
    /// Requests waiting on keys in flight, see [`crate::idempotency::wait`].
    pub waits: Waits,
}

/// The whole API. Layers, from the outside in: fault injection (outside
/// everything, see `faults::drop_response`), request id, tracing span,
/// metrics, problem bodies, panic catcher, timeout, body limit.
/// Every route, each described as it is registered (`routes!`), so the
/// OpenAPI document cannot miss one.
pub fn api(config: &Config) -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .merge(charges::router())
        .merge(refunds::router())
        .merge(balance::router())
        .merge(idempotency_keys::router())
        .merge(health::router())
        .merge(demo::router(config.demo_unsafe_endpoints))
        .routes(routes!(observe::metrics_endpoint))
        .routes(routes!(openapi::openapi_json))
        .routes(routes!(openapi::docs))
}

pub fn router(state: AppState) -> Router {
    let max_body = state.config.max_body_bytes;
    let timeout = state.config.request_timeout;
    let (routes, _) = api(&state.config).split_for_parts();
    routes
        .fallback(|| async {
            Problem::new(
                StatusCode::NOT_FOUND,
                "route_not_found",
                "There is no such route.",
            )
        })
        .method_not_allowed_fallback(|| async {
            Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "This route does not accept that method.",
            )
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(RequestBodyLimitLayer::new(max_body))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            timeout,
        ))
        .layer(CatchPanicLayer::custom(|_| {
            use axum::response::IntoResponse;
            tracing::error!("a handler panicked");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "Something went wrong on our side.",
            )
            .into_response()
        }))
        .layer(axum::middleware::from_fn(observe::finish_problems))
        .layer(axum::middleware::from_fn(observe::measure))
        // Spans carry no headers: Authorization and API keys are never logged.
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|request: &axum::extract::Request| observe::span(request))
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(axum::middleware::from_fn(observe::sanitize_request_id))
        // Outermost, outside the panic catcher: see `faults::drop_response`.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            faults::drop_response,
        ))
        .with_state(state)
}
