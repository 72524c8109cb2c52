//! The lab's timelines: what happened to each request of a workshop run, on
//! one clock, as this server saw it, for the lab page to draw.
//!
//! With `DEMO_UNSAFE_ENDPOINTS=true`, a request that sends `Oncepay-Trace:
//! <run>/<request>` is recorded (from [`RequestTrace::begin`]): its arrival and its answer, or
//! the answer lost on purpose; the phases of its guarded operation that
//! touch another system (the claim, the processor's call, the settle),
//! through the timing seam ([`Traced`]); and the steps of the workshop's
//! naive endpoints and receivers ([`timed`]). [`stored`] adds what the
//! database holds for the run: its charges, the money each moved, the keys
//! no request settled (the sweeper's), its refunds. Nothing is invented:
//! every event is a time this process or the database recorded. Events live
//! in memory (the last [`MAX_RUNS`] runs) and, with `DEMO_TRACE_FILE`, in a
//! journal that a crash leaves behind: the next process reads it back and
//! draws the crashed request to where it died ([`Traces::open`]).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use axum::extract::FromRequestParts;
use axum::http::HeaderValue;
use axum::http::request::Parts;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::processor::{self, Outcome, Processor};
use oncepay_core::operation::timing::{Clock, Phase};

/// The header that asks for a request to be recorded: `<run>/<request>`.
pub const HEADER: &str = "oncepay-trace";
/// How many runs are kept; the oldest goes first.
const MAX_RUNS: usize = 256;
/// How many events a run keeps.
const MAX_EVENTS: usize = 400;

/// A lane of the timeline: a client's request, or one of the systems.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    Request,
    Oncepay,
    Gateway,
    Database,
    Redis,
}

/// What an event means for the run, when it means more than a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Mark {
    /// An answer sent to the client.
    Answer,
    /// An answer that never reached the client.
    Lost,
    /// `409`: the key was in use.
    Conflict,
    /// A saved answer replayed.
    Replay,
    /// An effect: money moved, or an order shipped.
    Effect,
    /// A key the sweeper settled: no request did.
    Sweeper,
    /// The server started again.
    Restart,
}

/// One step of a run: a span (`until_us` set) or a moment.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct TraceEvent {
    /// When it began, or happened: Unix microseconds.
    #[schema(example = 1_764_892_800_000_000_i64)]
    pub at_us: i64,
    /// When it ended, for a span.
    pub until_us: Option<i64>,
    pub lane: Lane,
    /// The client request it belongs to (its `Oncepay-Trace` label).
    #[schema(example = "A")]
    pub request: Option<String>,
    #[schema(example = "claim (INSERT ... ON CONFLICT)")]
    pub what: String,
    pub mark: Option<Mark>,
}

impl TraceEvent {
    /// A moment on `lane`.
    pub fn at(at: SystemTime, lane: Lane, what: impl Into<String>, mark: Option<Mark>) -> Self {
        TraceEvent {
            at_us: micros(at),
            until_us: None,
            lane,
            request: None,
            what: what.into(),
            mark,
        }
    }

    /// A span on `lane`.
    pub fn span(from: SystemTime, until: SystemTime, lane: Lane, what: impl Into<String>) -> Self {
        TraceEvent {
            until_us: Some(micros(until)),
            ..TraceEvent::at(from, lane, what, None)
        }
    }
}

/// Unix microseconds.
fn micros(at: SystemTime) -> i64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The recorded events of the last runs, in memory and, with
/// `DEMO_TRACE_FILE`, in a journal: card 8 crashes the server on purpose,
/// and the crashed request's events must outlive the process.
#[derive(Default)]
pub struct Traces {
    runs: Mutex<VecDeque<(String, Vec<TraceEvent>)>>,
    journal: Option<Mutex<File>>,
}

/// A line of the journal: an event, or a request that began (its end is
/// its span on the request's lane, which a crash never writes).
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Line {
    Event { run: String, event: TraceEvent },
    Begun { run: String, event: TraceEvent },
}

impl Traces {
    /// The traces of the journal at `path` (made when missing): its runs,
    /// and each request a crash cut short, drawn to where it died. The
    /// journal is written again with what is kept, then appended to.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let read = std::fs::read_to_string(path);
        let text = match read {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            other => other.with_context(|| format!("reading {}", path.display()))?,
        };
        let traces = Traces::default();
        let mut begun = Vec::new();
        for line in text.lines().filter_map(|l| serde_json::from_str(l).ok()) {
            match line {
                Line::Event { run, event } => traces.push(&run, event),
                Line::Begun { run, event } => begun.push((run, event)),
            }
        }
        for (run, request) in begun {
            let died = traces.cut_short(&run, &request);
            died.into_iter().for_each(|event| traces.push(&run, event));
        }
        let mut file = File::create(path).with_context(|| format!("writing {}", path.display()))?;
        for (run, events) in traces.runs.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for event in events {
                let line = Line::Event {
                    run: run.clone(),
                    event: event.clone(),
                };
                file.write_all(format!("{}\n", serde_json::to_string(&line)?).as_bytes())?;
            }
        }
        Ok(Traces {
            journal: Some(Mutex::new(file)),
            ..traces
        })
    }

    /// What a request that began (`request`: its span from arrival, not
    /// yet ended) and never answered did: it died with the process after
    /// its last recorded step. Nothing when it was answered.
    fn cut_short(&self, run: &str, request: &TraceEvent) -> Vec<TraceEvent> {
        let events = self.events(run);
        let own = events.iter().filter(|e| e.request == request.request);
        let own = own.filter(|e| e.at_us >= request.at_us);
        let answered = |e: &&TraceEvent| e.lane == Lane::Request && e.mark.is_some();
        if own.clone().any(|e| answered(&e)) {
            return Vec::new();
        }
        let last = own.map(|e| e.until_us.unwrap_or(e.at_us)).max();
        let died = last.unwrap_or(request.at_us);
        let at = |lane, what: &str, mark| TraceEvent {
            at_us: died,
            until_us: None,
            lane,
            what: what.to_owned(),
            mark: Some(mark),
            ..request.clone()
        };
        vec![
            TraceEvent {
                until_us: Some(died),
                ..request.clone()
            },
            at(Lane::Oncepay, "oncepay died here", Mark::Lost),
            at(Lane::Request, "no answer: the server died", Mark::Lost),
        ]
    }

    /// Adds `event` to `run`'s, and to the journal.
    pub fn push(&self, run: &str, event: TraceEvent) {
        self.write(&Line::Event {
            run: run.to_owned(),
            event: event.clone(),
        });
        let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, events)) = runs.iter_mut().rev().find(|(name, _)| name == run) {
            if events.len() < MAX_EVENTS {
                events.push(event);
            }
            return;
        }
        if runs.len() == MAX_RUNS {
            runs.pop_front();
        }
        runs.push_back((run.to_owned(), vec![event]));
    }

    /// Appends `line` to the journal, if there is one: one write of a
    /// whole line, which a crash of this process cannot cut.
    fn write(&self, line: &Line) {
        let Some(journal) = &self.journal else { return };
        let Ok(text) = serde_json::to_string(line) else {
            return;
        };
        let mut file = journal.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = file.write_all(format!("{text}\n").as_bytes()) {
            tracing::warn!(error = %e, "the lab's trace journal could not be written");
        }
    }

    /// `run`'s events so far.
    pub fn events(&self, run: &str) -> Vec<TraceEvent> {
        let runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
        runs.iter()
            .find(|(name, _)| name == run)
            .map(|(_, events)| events.clone())
            .unwrap_or_default()
    }
}

/// One recorded request: its run, its label, when it arrived, what it asked.
pub struct RequestTrace {
    traces: Arc<Traces>,
    run: String,
    request: String,
    arrived: SystemTime,
    asked: String,
}

impl RequestTrace {
    /// The record of a request whose `Oncepay-Trace` header (`header`)
    /// names a valid run and label; `asked` is its method and path.
    pub fn begin(
        traces: &Arc<Traces>,
        header: Option<&HeaderValue>,
        asked: String,
    ) -> Option<Arc<Self>> {
        let (run, label) = header?.to_str().ok()?.split_once('/')?;
        valid(run, label).then(|| {
            let trace = RequestTrace {
                traces: traces.clone(),
                run: run.to_owned(),
                request: label.to_owned(),
                arrived: SystemTime::now(),
                asked,
            };
            let begun = TraceEvent {
                request: Some(trace.request.clone()),
                ..TraceEvent::at(trace.arrived, Lane::Request, &trace.asked, None)
            };
            let run = trace.run.clone();
            traces.write(&Line::Begun { run, event: begun });
            Arc::new(trace)
        })
    }

    /// Records `event` as this request's.
    pub fn push(&self, event: TraceEvent) {
        let event = TraceEvent {
            request: Some(self.request.clone()),
            ..event
        };
        self.traces.push(&self.run, event);
    }

    /// Records the answer sent: the request's span and its answer; on
    /// oncepay's lane, what it decided when that was not to do the work.
    pub fn answered(&self, status: u16, replayed: bool) {
        let now = SystemTime::now();
        let decided = match status {
            409 => Some((Mark::Conflict, "the key is in use: 409, retry later")),
            _ if replayed => Some((Mark::Replay, "the saved answer, replayed")),
            _ => None,
        };
        self.push(TraceEvent::span(
            self.arrived,
            now,
            Lane::Request,
            &self.asked,
        ));
        let said = if replayed {
            format!("{status}, replayed")
        } else {
            status.to_string()
        };
        let mark = decided.map_or(Mark::Answer, |(mark, _)| mark);
        self.push(TraceEvent::at(now, Lane::Request, said, Some(mark)));
        if let Some((mark, what)) = decided {
            self.push(TraceEvent::at(now, Lane::Oncepay, what, Some(mark)));
        }
    }

    /// Records the answer lost: the work was done and committed, oncepay
    /// dropped the answer, the client gets nothing.
    pub fn lost(&self, status: u16) {
        let now = SystemTime::now();
        self.push(TraceEvent::span(
            self.arrived,
            now,
            Lane::Request,
            &self.asked,
        ));
        let what = format!("answer {status} dropped (Oncepay-Fault: drop-response)");
        self.push(TraceEvent::at(now, Lane::Oncepay, what, Some(Mark::Lost)));
        let what = "no answer: the connection closed";
        self.push(TraceEvent::at(now, Lane::Request, what, Some(Mark::Lost)));
    }
}

/// A run tag: 1 to 100 letters, digits, `-` or `_` (it is part of keys).
pub fn valid_run(run: &str) -> bool {
    (1..=100).contains(&run.len())
        && run
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A run tag and a request label the lab sends: short and printable.
fn valid(run: &str, label: &str) -> bool {
    valid_run(run)
        && !label.is_empty()
        && label.len() <= 40
        && label.chars().all(|c| c.is_ascii_graphic() || c == ' ')
}

/// The recorded request a handler serves, if it is one.
pub struct Trace(pub Option<Arc<RequestTrace>>);

impl<S: Send + Sync> FromRequestParts<S> for Trace {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Trace(parts.extensions.get::<Arc<RequestTrace>>().cloned()))
    }
}

/// Runs `work`, recorded as a span of `what` on `lane` when traced.
pub async fn timed<T>(
    trace: Option<&RequestTrace>,
    lane: Lane,
    what: &str,
    work: impl Future<Output = T>,
) -> T {
    let from = SystemTime::now();
    let out = work.await;
    if let Some(trace) = trace {
        trace.push(TraceEvent::span(from, SystemTime::now(), lane, what));
    }
    out
}

/// A webhook delivery one of the workshop's receivers took: drawn in its
/// receiver's lane, the order it shipped on the database's.
pub struct Delivery {
    pub receiver: &'static str,
    pub number: i32,
    pub shipped: bool,
    /// What the receiver answers.
    pub status: u16,
}

impl Delivery {
    /// Records the delivery, taken from `arrived` until now, in `run`'s.
    pub fn record(&self, traces: &Traces, run: &str, arrived: SystemTime) {
        let now = SystemTime::now();
        let lane = Some(format!("{} receiver", self.receiver));
        let what = format!("delivery {}", self.number);
        let mark = if self.status == 200 {
            Mark::Answer
        } else {
            Mark::Lost
        };
        let said = format!("answers {}", self.status);
        for event in [
            TraceEvent::span(arrived, now, Lane::Request, what),
            TraceEvent::at(now, Lane::Request, said, Some(mark)),
        ] {
            traces.push(
                run,
                TraceEvent {
                    request: lane.clone(),
                    ..event
                },
            );
        }
        if self.shipped {
            let what = format!("{} receiver: an order shipped", self.receiver);
            traces.push(
                run,
                TraceEvent::at(now, Lane::Database, what, Some(Mark::Effect)),
            );
        }
    }
}

/// A recorded request's clock: the server's, plus a span for each phase
/// that touches another system.
pub struct Traced {
    pub inner: Arc<dyn Clock>,
    pub trace: Arc<RequestTrace>,
}

impl Clock for Traced {
    fn add(&self, phase: Phase, took: Duration) {
        self.inner.add(phase, took);
        if let Some((lane, what)) = drawn(phase, took) {
            let now = SystemTime::now();
            let from = now.checked_sub(took).unwrap_or(now);
            self.trace.push(TraceEvent::span(from, now, lane, what));
        }
    }

    fn cached(&self) {
        self.inner.cached();
        self.trace.push(TraceEvent::at(
            SystemTime::now(),
            Lane::Oncepay,
            "the saved answer, from the replay cache",
            None,
        ));
    }
}

/// Where and as what a phase is drawn; `None` for the server's own steps.
fn drawn(phase: Phase, took: Duration) -> Option<(Lane, &'static str)> {
    Some(match phase {
        Phase::KeyRead => (Lane::Database, "read the key (SELECT)"),
        Phase::Claim => (Lane::Database, "claim (INSERT ... ON CONFLICT)"),
        Phase::KeyWait => (Lane::Oncepay, "wait for the request in flight"),
        Phase::Processor => (Lane::Gateway, "the card gateway's call"),
        Phase::Settle => (Lane::Database, "settle (UPDATE ... WHERE pending)"),
        Phase::Write => (Lane::Database, "the write and its answer, with the claim"),
        Phase::PoolWait | Phase::SettlePoolWait if took >= Duration::from_millis(1) => {
            (Lane::Oncepay, "wait for a connection")
        }
        _ => return None,
    })
}

/// What the database holds for `run`: each charge's row (an effect when
/// the processor holds its payment), each charge the sweeper settled (its
/// event names no request), each refund; and `started` when this process
/// started after the run began.
pub async fn stored(
    pool: &PgPool,
    processor: &dyn Processor,
    merchant_id: Uuid,
    run: &str,
    recorded: &[TraceEvent],
    started: SystemTime,
) -> anyhow::Result<Vec<TraceEvent>> {
    let rows = sqlx::query!(
        r#"SELECT c.id AS "id!", c.created_at AS "at!", NULL::bigint AS amount, 'charge' AS "kind!",
                  (SELECT e.created_at FROM events e
                    WHERE e.object_id = c.id AND e.type IN ('charge.succeeded', 'charge.failed')
                      AND e.request_id IS NULL) AS swept_at
             FROM charges c
            WHERE c.merchant_id = $1 AND c.metadata->>'demo_run' = $2
           UNION ALL
           SELECT r.id, r.created_at, r.amount, 'refund', NULL
             FROM refunds r JOIN charges c ON c.id = r.charge_id
            WHERE c.merchant_id = $1 AND c.metadata->>'demo_run' = $2 AND r.status = 'succeeded'
           UNION ALL
           SELECT r.id, r.created_at, r.amount, 'naive refund', NULL
             FROM demo_naive_refunds r JOIN charges c ON c.id = r.charge_id
            WHERE c.merchant_id = $1 AND c.metadata->>'demo_run' = $2
           ORDER BY 2"#,
        merchant_id,
        run,
    )
    .fetch_all(pool)
    .await?;
    let mut events = Vec::new();
    for row in rows {
        let at = SystemTime::from(row.at);
        if row.kind != "charge" {
            let what = format!("{} of {} written", row.kind, row.amount.unwrap_or(0));
            events.push(TraceEvent::at(at, Lane::Database, what, Some(Mark::Effect)));
            continue;
        }
        let payment = processor
            .payment(&processor::authorization_key(&row.id))
            .await?;
        if payment.is_some_and(|p| p.outcome == Outcome::Succeeded) {
            events.push(money_moved(recorded, &row.id, at));
        }
        if let Some(swept) = row.swept_at.map(SystemTime::from) {
            let what = "the sweeper settled the charge and its key";
            events.push(TraceEvent::at(
                swept,
                Lane::Database,
                what,
                Some(Mark::Sweeper),
            ));
        }
    }
    let began = recorded.iter().chain(&events).map(|e| e.at_us).min();
    if began.is_some_and(|began| began < micros(started)) {
        let what = "oncepay started again";
        events.push(TraceEvent::at(
            started,
            Lane::Oncepay,
            what,
            Some(Mark::Restart),
        ));
    }
    Ok(events)
}

/// Where the money of charge `id`, written at `written`, moved: at the end
/// of the gateway's call of the request that wrote it. That request's
/// database span names the charge (the naive write) or holds the write in
/// time (the claim commits the charge; of overlapping claims only the
/// winner calls the gateway). On the database's lane at the write when no
/// recorded request holds it (a crash lost that request's events).
fn money_moved(recorded: &[TraceEvent], id: &str, written: SystemTime) -> TraceEvent {
    let at = micros(written);
    let names = |e: &&TraceEvent| e.lane == Lane::Database && e.what.contains(id);
    let holds = |e: &&TraceEvent| {
        e.lane == Lane::Database
            && e.until_us
                .is_some_and(|until| e.at_us - 1000 <= at && at <= until + 1000)
    };
    let call_after = |write: &TraceEvent| {
        recorded.iter().find(|e| {
            e.lane == Lane::Gateway
                && e.request == write.request
                && e.at_us >= write.at_us
                && e.until_us.is_some()
        })
    };
    let writes = recorded
        .iter()
        .filter(names)
        .chain(recorded.iter().filter(holds));
    let call = writes.filter_map(call_after).next();
    let what = format!("charge {id}: money moved");
    match call {
        Some(call) => TraceEvent {
            at_us: call.until_us.unwrap_or(call.at_us),
            until_us: None,
            lane: Lane::Gateway,
            request: call.request.clone(),
            what,
            mark: Some(Mark::Effect),
        },
        None => TraceEvent::at(
            written,
            Lane::Database,
            format!("charge {id} written: money moved"),
            Some(Mark::Effect),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: i64) -> TraceEvent {
        TraceEvent {
            at_us: n,
            until_us: None,
            lane: Lane::Oncepay,
            request: None,
            what: n.to_string(),
            mark: None,
        }
    }

    #[test]
    fn a_run_keeps_its_events_in_order_and_the_oldest_run_goes_first() {
        let traces = Traces::default();
        traces.push("first", event(1));
        for n in 0..MAX_RUNS {
            traces.push(&format!("run-{n}"), event(2));
        }
        traces.push("run-3", event(3));
        assert!(traces.events("first").is_empty(), "the oldest run went");
        let kept: Vec<_> = traces.events("run-3").iter().map(|e| e.at_us).collect();
        assert_eq!(kept, [2, 3]);
    }

    #[test]
    fn a_request_a_crash_cut_short_is_read_back_to_where_it_died_and_an_answered_one_as_it_was() {
        let path = std::env::temp_dir().join(format!("oncepay-trace-{}.jsonl", Uuid::new_v4()));
        let traces = Arc::new(Traces::open(&path).unwrap());
        let t0 = SystemTime::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let header = HeaderValue::from_static("run-1/first try");
        let first = RequestTrace::begin(&traces, Some(&header), "POST /v1/charges".into());
        let first = first.unwrap();
        first.push(TraceEvent::span(at(10), at(20), Lane::Database, "claim"));
        first.push(TraceEvent::span(at(20), at(50), Lane::Gateway, "call"));
        let header = HeaderValue::from_static("run-1/retry");
        let retry = RequestTrace::begin(&traces, Some(&header), "POST /v1/charges".into());
        retry.unwrap().answered(201, true);
        drop((first, traces));

        // The next process: the first try died after its call; the retry
        // was answered, and is read back as it was.
        let events = Traces::open(&path).unwrap().events("run-1");
        let of = |label: &str| {
            let own = events
                .iter()
                .filter(|e| e.request.as_deref() == Some(label));
            own.map(|e| (e.lane, e.mark, e.until_us.map(|_| e.what.as_str())))
                .collect::<Vec<_>>()
        };
        let died = events.iter().filter(|e| e.mark == Some(Mark::Lost));
        assert!(
            died.clone().all(|e| e.at_us == micros(at(50))),
            "{events:?}"
        );
        assert_eq!(
            of("first try"),
            [
                (Lane::Database, None, Some("claim")),
                (Lane::Gateway, None, Some("call")),
                (Lane::Request, None, Some("POST /v1/charges")),
                (Lane::Oncepay, Some(Mark::Lost), None),
                (Lane::Request, Some(Mark::Lost), None),
            ]
        );
        let retry = of("retry");
        assert_eq!(retry.len(), 3, "span, answer, replay: {retry:?}");
        assert!(!retry.iter().any(|(_, mark, _)| *mark == Some(Mark::Lost)));
        // Written again as events: a third start adds nothing.
        let again = Traces::open(&path).unwrap().events("run-1");
        assert_eq!(again.len(), events.len());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn only_a_printable_label_of_a_valid_run_is_recorded() {
        assert!(valid("lab-1a2b", "try 1"));
        assert!(!valid("lab 1", "A"), "a run tag has no space");
        assert!(!valid("lab-1", ""));
        assert!(!valid("lab-1", "a\nb"));
    }
}
