//! What every request passes through on its way in and out: a request id,
//! a tracing span, metrics, and the last word on error bodies (every error is
//! a problem, every fresh problem names its request id, and a reused key is
//! answered as a Stripe client expects it, as is a create, see
//! [`super::stripe`]).

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use metrics::{Label, SharedString};
use tracing::Span;

use crate::app::AppState;
use oncepay_core::problem::{CONTENT_TYPE, Problem, ProblemCode};

pub const REQUEST_ID: &str = "x-request-id";

/// When a request arrived, taken outside `REQUEST_TIMEOUT`'s layer: its
/// work may begin only before that timeout would have answered it.
#[derive(Clone, Copy, Debug)]
pub struct Arrived(pub Instant);

/// Makes each request's id: a UUID v4 from the thread's CSPRNG (`rand`),
/// rather than tower-http's `MakeRequestUuid`, whose `Uuid::new_v4` asks
/// the operating system for every id (a system call per request, seen in
/// the replay profile).
#[derive(Clone, Copy, Debug, Default)]
pub struct MakeRequestId;

impl tower_http::request_id::MakeRequestId for MakeRequestId {
    fn make_request_id<B>(
        &mut self,
        _: &axum::http::Request<B>,
    ) -> Option<tower_http::request_id::RequestId> {
        let id = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
        let mut text = [0; uuid::fmt::Hyphenated::LENGTH];
        let text = id.hyphenated().encode_lower(&mut text);
        HeaderValue::from_str(text)
            .ok()
            .map(tower_http::request_id::RequestId::new)
    }
}
/// The longest incoming `X-Request-Id` honoured; others are replaced.
const MAX_REQUEST_ID: usize = 128;

/// Marks a response whose bytes were saved for replay: sent untouched.
#[derive(Clone, Copy, Debug)]
pub struct SavedAnswer;

/// Drops an incoming `X-Request-Id` that is empty, too long or not visible
/// ASCII, so that the next layer makes a fresh one.
pub fn sanitize_request_id(mut request: Request) -> Request {
    let valid = request.headers().get(REQUEST_ID).is_some_and(|v| {
        let bytes = v.as_bytes();
        !bytes.is_empty() && bytes.len() <= MAX_REQUEST_ID && bytes.iter().all(u8::is_ascii_graphic)
    });
    if !valid {
        request.headers_mut().remove(REQUEST_ID);
    }
    request
}

fn request_id(request: &Request) -> &str {
    request
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// The route template (`/v1/charges/{id}`) a request matched, never the raw
/// path, so that logs and metrics do not explode with ids. The router
/// knows it only once it has matched the route, inside the layers that
/// measure the request: [`note_route`], on every route, writes it here for
/// [`finish`] to read on the way out. Empty for a path no route has
/// (`unmatched`). The templates are the router's own, a closed set.
#[derive(Clone, Default)]
struct NotedRoute(Arc<OnceLock<MatchedPath>>);

impl NotedRoute {
    fn label(&self) -> String {
        self.0
            .get()
            .map_or_else(|| UNMATCHED.to_owned(), |p| p.as_str().to_owned())
    }
}

const UNMATCHED: &str = "unmatched";

/// On every route and fallback of the router: notes the route the request
/// matched, if any, for [`finish`] and on the request's span.
pub fn note_route(request: Request) -> Request {
    if let Some(path) = request.extensions().get::<MatchedPath>() {
        Span::current().record("route", path.as_str());
        if let Some(noted) = request.extensions().get::<NotedRoute>() {
            let _ = noted.0.set(path.clone());
        }
    }
    request
}

/// The span every line of a request is logged in. `route`, `merchant` and
/// `idempotency_key` are filled in once known.
pub fn span(request: &Request) -> Span {
    tracing::info_span!(
        "request",
        request_id = %request_id(request),
        method = %method_label(request.method()),
        route = tracing::field::Empty,
        merchant = tracing::field::Empty,
        idempotency_key = tracing::field::Empty,
    )
}

/// The way out of every request, in one layer: the last word on error
/// bodies ([`finish_problem`]), Stripe's headers
/// and statuses ([`super::stripe::finish`]), then the request's metrics
/// ([`measure`]). One layer rather than three: each `from_fn` layer boxes
/// its inner service and its future for every request.
/// A `503` that says the database is unavailable (or a timeout) also wakes
/// the watch on the primary, when there is one, for a check now.
pub async fn finish(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    request.extensions_mut().insert(Arrived(started));
    let method = method_label(request.method());
    let noted = NotedRoute::default();
    request.extensions_mut().insert(noted.clone());
    let id = request.headers().get(REQUEST_ID).cloned();
    let client = super::stripe::Client::of(request.headers());
    let response = next.run(request).await;
    if response.status() == StatusCode::SERVICE_UNAVAILABLE {
        if let Some(primary) = &state.primary {
            let problem = response.extensions().get::<Problem>();
            if problem.is_none_or(|p| p.code == ProblemCode::ServiceUnavailable) {
                primary.wake();
            }
        }
    }
    let mut response = finish_problem(response, id.as_ref(), client.speaks_stripe);
    super::stripe::finish(&mut response, id, client);
    let route = noted.label();
    if route == UNMATCHED {
        Span::current().record("route", UNMATCHED);
    }
    measure(method, route, response.status(), started);
    response
}

/// A request's method as a metric label and log field: one of HTTP's
/// standard methods, or `other`. A client may send any token as a method
/// (hyper accepts kilobytes of it); as a label each would be a series kept
/// for the life of the process, so only this closed set is ever recorded.
fn method_label(method: &Method) -> SharedString {
    let label = match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => "other",
    };
    SharedString::const_str(label)
}

/// Counts a request and its latency by method, route and status.
fn measure(method: SharedString, route: String, status: StatusCode, started: Instant) {
    let labels = [
        Label::new("method", method),
        Label::new("route", route),
        Label::new("status", status.as_u16().to_string()),
    ];
    metrics::counter!("http_requests_total", labels.iter()).increment(1);
    metrics::histogram!("http_request_duration_seconds", labels.iter())
        .record(started.elapsed().as_secs_f64());
}

/// Makes every error a problem with the request id: an error body from a
/// layer (timeout, body limit) becomes a problem; a fresh problem gets
/// `request_id`. Saved answers pass untouched, so replays stay byte for byte.
fn finish_problem(response: Response, id: Option<&HeaderValue>, stripe_client: bool) -> Response {
    let status = response.status();
    if status.as_u16() < 400 || response.extensions().get::<SavedAnswer>().is_some() {
        return response;
    }
    let id = id.and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(CONTENT_TYPE.as_bytes()));
    if !is_problem {
        let (code, detail) = match status {
            StatusCode::REQUEST_TIMEOUT | StatusCode::SERVICE_UNAVAILABLE => (
                ProblemCode::RequestTimeout,
                "The request took too long and was stopped. Retry (a POST with the same Idempotency-Key).",
            ),
            StatusCode::PAYLOAD_TOO_LARGE => (
                ProblemCode::PayloadTooLarge,
                "The request body is larger than this server accepts.",
            ),
            _ => (ProblemCode::HttpError, "The request failed."),
        };
        let mut problem = Problem::with_status(status, code, detail).with_extra("request_id", id);
        if code == ProblemCode::RequestTimeout {
            problem = problem.with_retry_after(oncepay_core::retry_after::SOON);
        }
        let mut fresh = super::problem::respond(problem);
        for (name, value) in response.headers() {
            if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
                fresh.headers_mut().append(name.clone(), value.clone());
            }
        }
        return fresh;
    }
    // A fresh problem carries itself (see `Problem::into_response`): its body
    // is rendered again with the request id, never read back from bytes, so
    // no size limit can leave it empty.
    let (mut parts, body) = response.into_parts();
    let Some(problem) = parts.extensions.remove::<Problem>() else {
        return Response::from_parts(parts, body);
    };
    let problem = super::stripe::for_client(problem, stripe_client);
    parts.status = problem.status;
    let body = problem.with_extra("request_id", id).body();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts
        .headers
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    Response::from_parts(parts, Body::from(body))
}
