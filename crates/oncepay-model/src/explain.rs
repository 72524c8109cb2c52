//! A path of the model told as a timeline, in the workshop's vocabulary:
//! one line per step, on the lane of the system that took it (the client,
//! oncepay, the card gateway, the database or Redis, the sweeper, the
//! clock, the network).

use std::fmt::Write as _;

use serde_json::json;
use stateright::Path;

use crate::check::Report;

use crate::model::{Action, Outcome, Protocol, REUSER, State, Step, payments};
use crate::variant::Variant;

/// `path` as numbered lines, then what it broke (`broken`).
pub fn timeline(model: &Protocol, path: &Path<State, Action>, broken: &str) -> String {
    let mut out = String::new();
    for (n, (lane, what)) in steps(model, path).into_iter().enumerate() {
        let _ = writeln!(out, "{:>3}  {lane:<12} {what}", n + 1);
    }
    let last = path.last_state();
    let _ = writeln!(out, "     broken: {broken}{}", consequence(last, broken));
    out
}

/// Each step of `path`: its lane and what happened.
pub fn steps(model: &Protocol, path: &Path<State, Action>) -> Vec<(String, String)> {
    let steps = path.clone().into_vec();
    let pairs = steps.windows(2);
    let told = pairs.filter_map(|pair| match (&pair[0], &pair[1]) {
        ((before, Some(action)), (after, _)) => Some(describe(model, before, action, after)),
        _ => None,
    });
    told.collect()
}

/// `report` as JSON: the variant, its states and seconds, and the property
/// it broke with the steps that broke it.
pub fn as_json(report: &Report) -> serde_json::Value {
    let broken = report.broken.first().map(|(name, path)| {
        let steps = steps(&report.model, path);
        let steps: Vec<_> = steps
            .iter()
            .map(|(lane, what)| json!({"lane": lane, "what": what}))
            .collect();
        let last = consequence(path.last_state(), name);
        json!({"property": name, "consequence": last.trim(), "steps": steps})
    });
    json!({
        "variant": report.model.variant.name(),
        "states": report.states,
        "seconds": report.took.as_secs_f64(),
        "broken": broken,
    })
}

/// What the last state shows of the broken property.
fn consequence(s: &State, broken: &str) -> String {
    use crate::model::CLIENT;
    use crate::properties::{AGREE, ONE_PAYMENT, REUSE};
    match broken {
        ONE_PAYMENT => {
            let paid = payments(s, CLIENT);
            format!(" ({paid} payments at the gateway for 1 operation)")
        }
        AGREE => {
            let failed = s
                .charges
                .iter()
                .filter(|c| c.settled == Some(Outcome::Voided));
            let paid = failed.map(|c| c.id).find(|&id| {
                s.gateway
                    .iter()
                    .any(|p| p.charge == id && p.outcome == Outcome::Paid)
            });
            paid.map_or(String::new(), |id| {
                format!(" (ch{id} recorded failed; the gateway moved its money)")
            })
        }
        REUSE => {
            let told = s.clients.get(REUSER as usize).and_then(|c| c.told.last());
            told.map_or(String::new(), |(r, _)| {
                format!(" (client 2, with other parameters, got {r})")
            })
        }
        _ => String::new(),
    }
}

/// The lane and the words of one step, `before` it and `after`.
fn describe(model: &Protocol, before: &State, action: &Action, after: &State) -> (String, String) {
    let redis = model.variant == Variant::RedisSetNx;
    let request = |id| before.requests.iter().find(|r| r.id == id);
    let instance = |id| {
        let at = request(id).map_or(0, |r| r.instance);
        format!("oncepay {}", if at == 0 { 'A' } else { 'B' })
    };
    let client = |c| if c == REUSER { "client 2" } else { "client" }.to_owned();
    let store = if redis { "Redis" } else { "database" }.to_owned();
    match action {
        Action::Send { client: c } => {
            let sent = after.requests.last().map_or(0, |r| r.id);
            let r = after.requests.iter().find(|r| r.id == sent);
            let (key, attempt) = r.map_or((0, 0), |r| (r.key, r.attempt));
            let what = if *c == REUSER {
                format!("sends key k{key} with other parameters (request {sent})")
            } else {
                format!("sends attempt {attempt} with key k{key} (request {sent})")
            };
            (client(*c), what)
        }
        Action::TimeOut { client: c } => (client(*c), "times out waiting; will retry".into()),
        Action::Arrive {
            request,
            instance: i,
        } => {
            let name = format!("oncepay {}", if *i == 0 { 'A' } else { 'B' });
            (name, format!("request {request} arrives"))
        }
        Action::Read { request } => (
            "database".into(),
            format!("request {request}: SELECT the key: not there"),
        ),
        // Without a claim, nothing is written before the work.
        Action::Claim { request } if model.variant == Variant::KeyAfterWork => {
            (instance(*request), claimed(model, before, after, *request))
        }
        Action::Claim { request } => (store, claimed(model, before, after, *request)),
        Action::Call { request } => {
            let charge = match request_step(after, *request) {
                Some(Step::Calling { charge }) => charge,
                _ => 0,
            };
            let what = format!("request {request} asks the gateway to pay under auth:ch{charge}");
            (instance(*request), what)
        }
        Action::Authorize { message } => {
            let key = format!("auth:ch{}", message.charge);
            let what = match before.gateway.iter().find(|p| p.charge == message.charge) {
                None => format!("{key}: authorized, money moved"),
                Some(p) if p.outcome == Outcome::Paid => {
                    format!("{key}: paid already, answered again")
                }
                Some(_) => format!("{key}: voided, refused"),
            };
            ("card gateway".into(), what)
        }
        Action::Settle { request } => (store, settled(model, before, after, *request)),
        Action::SaveAnswer { request } => (
            "Redis".into(),
            format!("request {request}: SET the key to its answer"),
        ),
        Action::Release { request } => (
            store.clone(),
            format!(
                "request {request}: the gateway unreachable: DELETE the pending charge and its key"
            ),
        ),
        Action::GiveUp { request } => (
            instance(*request),
            format!("request {request}: no answer from the gateway in time: 503"),
        ),
        Action::Deliver { answer } => {
            let replayed = if answer.replayed { ", replayed" } else { "" };
            let what = format!("gets {}{replayed}", answer.reply);
            (client(answer.client), what)
        }
        Action::LoseRequest { request } => ("network".into(), format!("loses request {request}")),
        Action::LoseAnswer { answer } => (
            "network".into(),
            format!("loses the answer {}", answer.reply),
        ),
        Action::LoseMessage { message } => {
            let what = match message.reply {
                None => format!("loses the call for auth:ch{}", message.charge),
                Some(_) => format!("loses the gateway's answer for auth:ch{}", message.charge),
            };
            ("network".into(), what)
        }
        Action::Duplicate { message } => (
            "network".into(),
            format!("delivers the call for auth:ch{} twice", message.charge),
        ),
        Action::Crash { instance: i } => {
            let name = format!("oncepay {}", if *i == 0 { 'A' } else { 'B' });
            (name, "crashes, with every request it holds".into())
        }
        Action::Stale { key } => (
            "clock".into(),
            format!("key k{key} has been processing past PROCESSING_TIMEOUT: stale"),
        ),
        Action::Expire { key } => ("clock".into(), format!("key k{key}'s TTL passes: deleted")),
        Action::Fence { key } => ("sweeper".into(), fenced(model, before, after, *key)),
        Action::SweepSettle => {
            let Some((charge, outcome)) = before.sweeping else {
                return ("sweeper".into(), "nothing to settle".into());
            };
            let row = after.charges.iter().find(|c| c.id == charge);
            let changed = before.charges.iter().find(|c| c.id == charge) != row;
            let what = if changed {
                format!(
                    "UPDATE ch{charge} WHERE pending: settled {}",
                    outcome_word(outcome)
                )
            } else {
                format!("UPDATE ch{charge} WHERE pending: 0 rows, settled already")
            };
            ("sweeper".into(), what)
        }
    }
}

/// What a claim did, read from the state after it.
fn claimed(model: &Protocol, before: &State, after: &State, request: u8) -> String {
    let Some(Step::Claimed { charge }) = request_step(after, request) else {
        let answer = after.answers.iter().find(|a| !before.answers.contains(a));
        let what = answer.map_or("nothing".into(), |a| a.reply.to_string());
        return format!("request {request}: the key is taken: {what}");
    };
    match model.variant {
        Variant::KeyAfterWork => {
            format!("request {request}: no key yet: straight to the work (ch{charge})")
        }
        Variant::TwoTransactions => {
            format!(
                "request {request}: INSERT the key alone; ch{charge} to be written after the gateway"
            )
        }
        Variant::RedisSetNx => format!("request {request}: SET NX the key: won (ch{charge})"),
        Variant::CheckThenAct => {
            format!("request {request}: INSERT the key (checked before), ch{charge} pending")
        }
        _ => format!(
            "request {request}: INSERT ... ON CONFLICT: won; ch{charge} pending in the same statement"
        ),
    }
}

/// What a settle did.
fn settled(model: &Protocol, before: &State, after: &State, request: u8) -> String {
    let charge = match request_step(before, request) {
        Some(Step::Calling { charge }) => charge,
        _ => 0,
    };
    if let Some(Step::Committed { outcome, .. }) = request_step(after, request) {
        return format!(
            "request {request}: COMMIT ch{charge} {} in Postgres",
            outcome_word(outcome)
        );
    }
    if matches!(
        model.variant,
        Variant::TwoTransactions | Variant::KeyAfterWork
    ) {
        return format!("request {request}: INSERT ch{charge} and the key's answer");
    }
    let was = before.charges.iter().find(|c| c.id == charge);
    match was.and_then(|c| c.settled) {
        None => format!("request {request}: UPDATE ch{charge} WHERE pending: 1 row; key completed"),
        Some(o) => format!(
            "request {request}: UPDATE ch{charge} WHERE pending: 0 rows; answers it as settled ({})",
            outcome_word(o)
        ),
    }
}

/// What the sweeper's lease and fence did.
fn fenced(model: &Protocol, before: &State, after: &State, key: u8) -> String {
    let Some((charge, outcome)) = after.sweeping else {
        return format!("key k{key} has no charge to settle: deleted");
    };
    if model.variant == Variant::NoVoidFence {
        return format!("leases key k{key}; assumes ch{charge} failed, asking no one");
    }
    let held = before.gateway.iter().any(|p| p.charge == charge);
    let stands = if held {
        format!("{} already", outcome_word(outcome))
    } else {
        "nothing recorded: voided now".to_owned()
    };
    format!("leases key k{key}; void_unless_recorded(auth:ch{charge}): {stands}")
}

fn request_step(s: &State, request: u8) -> Option<Step> {
    s.requests.iter().find(|r| r.id == request).map(|r| r.step)
}

fn outcome_word(o: Outcome) -> &'static str {
    match o {
        Outcome::Paid => "succeeded",
        Outcome::Voided => "failed (voided)",
    }
}
