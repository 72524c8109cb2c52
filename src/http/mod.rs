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
pub mod problem;
pub mod refunds;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use sqlx::PgPool;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::{DefaultMakeSpan, DefaultOnResponse, TraceLayer};
use tracing::Level;

use crate::config::Config;
use crate::processor::Processor;
use problem::Problem;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub pool: PgPool,
    pub config: Arc<Config>,
    pub processor: Arc<dyn Processor>,
}

/// The whole API.
pub fn router(state: AppState) -> Router {
    let max_body = state.config.max_body_bytes;
    Router::new()
        .merge(charges::router())
        .merge(refunds::router())
        .merge(balance::router())
        .merge(idempotency_keys::router())
        .merge(health::router())
        .merge(demo::router(state.config.demo_unsafe_endpoints))
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
        // Spans carry method and path only: headers (Authorization!) are never logged.
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(DefaultMakeSpan::new().level(Level::INFO))
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
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
        // Outermost, outside the panic catcher: see `faults::drop_response`.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            faults::drop_response,
        ))
        .with_state(state)
}
