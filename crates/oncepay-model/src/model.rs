//! The model: the system's state, its actions, and the properties every
//! reachable state must keep.

use stateright::{Model, Property};

use crate::properties::{
    AGREE, CRASHES, LEAVES_PROCESSING, NOT_LOST, ONE_PAYMENT, REPLAYS, REUSE, SAME_ANSWER, SUCCEEDS,
};
use crate::variant::Variant;

/// Ids of requests, keys, charges: small numbers, in order of creation.
pub type Id = u8;

/// The model's bounds: how much of each thing may happen on one path.
#[derive(Clone, Debug)]
pub struct Bounds {
    /// Attempts of the client of the logical operation.
    pub attempts: u8,
    /// Whether a second client reuses the key with other parameters.
    pub reuser: bool,
    /// Crashes of an instance.
    pub crashes: u8,
    /// Messages the network loses or duplicates, and calls it cannot
    /// make (the gateway unreachable).
    pub faults: u8,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            attempts: 2,
            reuser: true,
            crashes: 1,
            faults: 2,
        }
    }
}

/// The model: a variant within bounds.
#[derive(Clone, Debug)]
pub struct Protocol {
    pub variant: Variant,
    pub bounds: Bounds,
}

/// The oncepay instances.
pub const INSTANCES: Id = 2;
/// The client of the logical operation, and the one that reuses its key.
pub const CLIENT: Id = 0;
pub const REUSER: Id = 1;

/// What the gateway holds for a processor key, and answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Authorized: money moved.
    Paid,
    /// Voided before any authorization: none can move money under it.
    Voided,
}

/// What oncepay answers a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// The charge, settled with the gateway's outcome (`201`, or `402`
    /// for a voided one).
    Charge { charge: Id, outcome: Outcome },
    /// `409`: the key is in use.
    InUse,
    /// `422`: the key was first used with other parameters.
    Reused,
    /// `503`: the gateway's answer did not come in time.
    Unknown,
    /// `503`: the gateway could not be reached; nothing was charged.
    Unavailable,
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reply::Charge {
                charge,
                outcome: Outcome::Paid,
            } => write!(f, "201 ch{charge}"),
            Reply::Charge { charge, .. } => write!(f, "402 ch{charge} (voided)"),
            Reply::InUse => f.write_str("409 key in use"),
            Reply::Reused => f.write_str("422 key reused"),
            Reply::Unknown => f.write_str("503 outcome unknown"),
            Reply::Unavailable => f.write_str("503 processor unavailable"),
        }
    }
}

/// A client: its key, its parameters, its attempts, what it was told.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    pub key: Id,
    pub params: Id,
    pub attempts: u8,
    pub max_attempts: u8,
    /// An attempt is out and the client is waiting for its answer.
    pub waiting: bool,
    /// Told something final: a charge, or `422`.
    pub done: bool,
    /// Every answer it got, and whether it was replayed.
    pub told: Vec<(Reply, bool)>,
}

/// Where a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    /// On the network, to an instance.
    OnWire,
    /// At its instance, before the claim.
    Arrived,
    /// Check-then-act only: read the key and found it free.
    FoundFree,
    /// Holds its key (or, without a claim, about to work): `charge` is
    /// the record it works on, and its processor key.
    Claimed { charge: Id },
    /// Its call to the gateway is out.
    Calling { charge: Id },
    /// Redis only: the charge committed in Postgres, the answer not yet
    /// written to Redis.
    Committed { charge: Id, outcome: Outcome },
}

/// A client's request, from the wire to its answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    pub id: Id,
    pub client: Id,
    pub attempt: u8,
    pub key: Id,
    pub params: Id,
    pub instance: Id,
    pub step: Step,
}

/// A key's row (`idempotency_keys`), or its Redis entry.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub key: Id,
    /// The first request's parameters: its fingerprint.
    pub params: Id,
    pub status: KeyStatus,
}

/// Where a key stands: claimed and at work, or its answer saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyStatus {
    /// Claimed, its record `charge` pending (none when the charge is
    /// written later: two transactions, Redis); `stale` once its request
    /// has held it past `PROCESSING_TIMEOUT`.
    Processing { charge: Option<Id>, stale: bool },
    /// The answer saved.
    Completed(Reply),
}

/// A charge's row: pending, or settled with the gateway's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Charge {
    pub id: Id,
    pub client: Id,
    pub settled: Option<Outcome>,
}

/// What the gateway holds under a processor key: for whose payment, and
/// its outcome.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Payment {
    pub charge: Id,
    pub client: Id,
    pub outcome: Outcome,
}

/// A message on the wire between oncepay and the gateway: a call
/// (`reply: None`) for `client`'s payment under `charge`'s processor key,
/// or its answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GatewayMessage {
    pub request: Id,
    pub charge: Id,
    pub client: Id,
    pub reply: Option<Outcome>,
}

/// An answer on the wire to a client.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Answer {
    pub client: Id,
    pub attempt: u8,
    pub reply: Reply,
    pub replayed: bool,
}

/// The whole system at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub clients: Vec<Client>,
    pub requests: Vec<Request>,
    pub answers: Vec<Answer>,
    /// The database's key rows, or Redis's entries.
    pub keys: Vec<Key>,
    pub charges: Vec<Charge>,
    /// The gateway's ledger, by processor key (the charge's).
    pub gateway: Vec<Payment>,
    pub wire: Vec<GatewayMessage>,
    /// The sweeper's fenced charge and the outcome that stands, to settle.
    pub sweeping: Option<(Id, Outcome)>,
    pub next_id: Id,
    pub crashes: u8,
    pub faults: u8,
}

/// One step of the system.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The client sends an attempt (a retry after a timeout or a `409`).
    Send {
        client: Id,
    },
    /// The client stops waiting for its attempt's answer (its timeout).
    TimeOut {
        client: Id,
    },
    /// A request reaches an instance.
    Arrive {
        request: Id,
        instance: Id,
    },
    /// Check-then-act: `SELECT` the key, before writing it.
    Read {
        request: Id,
    },
    /// The claim: `claim::claim`, one `INSERT ... ON CONFLICT` that
    /// inserts the key as processing with the pending charge, or finds it.
    Claim {
        request: Id,
    },
    /// The gateway's call, under the processor key derived from the
    /// charge (`Operation::call_processor`).
    Call {
        request: Id,
    },
    /// The settle: `settle`, `UPDATE charges ... WHERE status =
    /// 'pending'` with the key's answer in one transaction; 0 rows: the
    /// record settled elsewhere is answered.
    Settle {
        request: Id,
    },
    /// Redis: the answer written back to the key's entry.
    SaveAnswer {
        request: Id,
    },
    /// The gateway cannot be reached, so nothing was sent: the release,
    /// `charges::store::release_pending`, deletes the pending charge and its
    /// key if still pending (`503 processor_unavailable`); if not, the
    /// charge settled elsewhere is the answer.
    Release {
        request: Id,
    },
    /// The gateway's answer did not come in time: `503`, the record left
    /// pending for recovery.
    GiveUp {
        request: Id,
    },
    /// The gateway takes a call: `authorize`, idempotent on the processor key.
    Authorize {
        message: GatewayMessage,
    },
    /// An answer reaches its client.
    Deliver {
        answer: Answer,
    },
    /// The network loses a request, an answer, a call or a reply.
    LoseRequest {
        request: Id,
    },
    LoseAnswer {
        answer: Answer,
    },
    LoseMessage {
        message: GatewayMessage,
    },
    /// The network delivers a call twice.
    Duplicate {
        message: GatewayMessage,
    },
    /// An instance dies, with every request it holds.
    Crash {
        instance: Id,
    },
    /// The clock: a key's request has held it past `PROCESSING_TIMEOUT`.
    Stale {
        key: Id,
    },
    /// The clock: a key's TTL passed (`expires_at`), and the sweeper
    /// deletes it (Redis: its entry's TTL).
    Expire {
        key: Id,
    },
    /// The sweeper leases a stale key and fences its charge:
    /// `lease_one`, then `Processor::void_unless_recorded` (with no void
    /// fence: assumes failed).
    Fence {
        key: Id,
    },
    /// The sweeper settles the fenced charge (`recovery::recover`'s
    /// conditional settle), or deletes a key with no record to settle.
    SweepSettle,
}

impl Protocol {
    pub fn new(variant: Variant) -> Self {
        Protocol {
            variant,
            bounds: Bounds::default(),
        }
    }

    /// The key of `client`'s next attempt.
    fn key_for(&self, client: &Client) -> Id {
        match self.variant {
            Variant::NewKeyPerAttempt => client.key + 10 * client.attempts,
            _ => client.key,
        }
    }

    /// Whether the key's answer is saved in Redis rather than Postgres.
    fn redis(&self) -> bool {
        self.variant == Variant::RedisSetNx
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let client = |key, params, max_attempts| Client {
            key,
            params,
            attempts: 0,
            max_attempts,
            waiting: false,
            done: false,
            told: Vec::new(),
        };
        let mut clients = vec![client(1, 1, self.bounds.attempts)];
        if self.bounds.reuser {
            clients.push(client(1, 2, 1));
        }
        vec![State {
            clients,
            requests: Vec::new(),
            answers: Vec::new(),
            keys: Vec::new(),
            charges: Vec::new(),
            gateway: Vec::new(),
            wire: Vec::new(),
            sweeping: None,
            next_id: 1,
            crashes: 0,
            faults: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let fault = s.faults < self.bounds.faults;
        self.clients_act(s, actions);
        self.requests_act(s, fault, actions);
        self.network_acts(s, fault, actions);
        self.clock_and_sweeper_act(s, actions);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Send { client } => {
                let key = self.key_for(&s.clients[client as usize]);
                send(&mut s, key, client);
            }
            Action::TimeOut { client } => s.clients[client as usize].waiting = false,
            Action::Arrive { request, instance } => {
                let r = find(&mut s, request);
                (r.instance, r.step) = (instance, Step::Arrived);
            }
            Action::Read { request } => {
                let r = find(&mut s, request).clone();
                if let Some(answer) = self.answer_from_key(&s, &r) {
                    answer_and_end(&mut s, &r, answer);
                } else {
                    find(&mut s, request).step = Step::FoundFree;
                }
            }
            Action::Claim { request } => self.claim(&mut s, request),
            Action::Call { request } => call(&mut s, request)?,
            Action::Settle { request } => self.settle(&mut s, request),
            Action::SaveAnswer { request } => {
                let r = find(&mut s, request).clone();
                let Step::Committed { charge, outcome } = r.step else {
                    return None;
                };
                let reply = Reply::Charge { charge, outcome };
                set_key(&mut s, r.key, r.params, KeyStatus::Completed(reply));
                answer_and_end(&mut s, &r, (reply, false));
            }
            Action::GiveUp { request } => {
                let r = find(&mut s, request).clone();
                answer_and_end(&mut s, &r, (Reply::Unknown, false));
            }
            Action::Release { request } => {
                self.release(&mut s, request);
                s.faults += 1;
            }
            Action::Authorize { message } => authorize(&mut s, message)?,
            Action::Deliver { answer } => deliver(&mut s, answer)?,
            Action::LoseRequest { request } => {
                s.requests.retain(|r| r.id != request);
                s.faults += 1;
            }
            Action::LoseAnswer { answer } => {
                let at = s.answers.iter().position(|a| *a == answer)?;
                s.answers.remove(at);
                s.faults += 1;
            }
            Action::LoseMessage { message } => {
                let at = s.wire.iter().position(|m| *m == message)?;
                s.wire.remove(at);
                s.faults += 1;
            }
            Action::Duplicate { message } => {
                s.wire.push(message);
                s.faults += 1;
            }
            Action::Crash { instance } => {
                s.requests
                    .retain(|r| r.instance != instance || r.step == Step::OnWire);
                s.crashes += 1;
            }
            Action::Stale { key } => {
                let k = s.keys.iter_mut().find(|k| k.key == key)?;
                if let KeyStatus::Processing { stale, .. } = &mut k.status {
                    *stale = true;
                }
            }
            Action::Expire { key } => s.keys.retain(|k| k.key != key),
            Action::Fence { key } => self.fence(&mut s, key),
            Action::SweepSettle => self.sweep_settle(&mut s),
        }
        s.wire.sort();
        s.answers.sort();
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_PAYMENT, |_, s: &State| payments(s, CLIENT) <= 1),
            Property::always(SAME_ANSWER, |_, s: &State| {
                let mut charges = s.clients[CLIENT as usize].told.iter().filter_map(charge_of);
                let first = charges.next();
                charges.all(|c| Some(c) == first)
            }),
            Property::always(NOT_LOST, |_, s: &State| {
                let told = s.clients.iter().flat_map(|c| c.told.iter());
                told.filter_map(charge_of)
                    .filter(|&(_, outcome)| outcome == Outcome::Paid)
                    .all(|(charge, _)| {
                        let row = s.charges.iter().find(|c| c.id == charge);
                        row.is_some_and(|c| c.settled == Some(Outcome::Paid))
                            && held_at_gateway(s, charge) == Some(Outcome::Paid)
                    })
            }),
            Property::always(REUSE, |_, s: &State| {
                let Some(reuser) = s.clients.get(REUSER as usize) else {
                    return true;
                };
                let theirs = reuser.told.iter().filter_map(charge_of);
                theirs
                    .map(|(charge, _)| s.charges.iter().find(|c| c.id == charge))
                    .all(|c| c.is_none_or(|c| c.client == REUSER))
            }),
            Property::always(AGREE, |_, s: &State| {
                let failed = s
                    .charges
                    .iter()
                    .filter(|c| c.settled == Some(Outcome::Voided));
                failed
                    .clone()
                    .all(|c| held_at_gateway(s, c.id) != Some(Outcome::Paid))
            }),
            Property::eventually(LEAVES_PROCESSING, |_, s: &State| {
                let processing = |k: &Key| matches!(k.status, KeyStatus::Processing { .. });
                let quiet = s
                    .clients
                    .iter()
                    .all(|c| c.done || (!c.waiting && c.attempts == c.max_attempts));
                quiet && s.requests.is_empty() && !s.keys.iter().any(processing)
            }),
            Property::sometimes(SUCCEEDS, |_, s: &State| {
                let told = s.clients[CLIENT as usize].told.iter().filter_map(charge_of);
                told.clone().any(|(_, outcome)| outcome == Outcome::Paid)
            }),
            Property::sometimes(CRASHES, |_, s: &State| {
                s.crashes > 0 && !s.charges.is_empty()
            }),
            Property::sometimes(REPLAYS, |_, s: &State| {
                s.clients[CLIENT as usize]
                    .told
                    .iter()
                    .any(|(_, replayed)| *replayed)
            }),
        ]
    }

    /// An action in the explorer's list, in the timeline's words.
    fn format_action(&self, action: &Action) -> String {
        let who = |c: &Id| if *c == REUSER { "client 2" } else { "client" };
        let at = |i: &Id| if *i == 0 { 'A' } else { 'B' };
        match action {
            Action::Send { client } => format!("{} sends an attempt", who(client)),
            Action::TimeOut { client } => format!("{} times out", who(client)),
            Action::Arrive { request, instance } => {
                format!("request {request} arrives at oncepay {}", at(instance))
            }
            Action::Read { request } => format!("request {request}: SELECT the key"),
            Action::Claim { request } => format!("request {request}: the claim"),
            Action::Call { request } => format!("request {request} calls the gateway"),
            Action::Settle { request } => format!("request {request}: the settle"),
            Action::SaveAnswer { request } => format!("request {request}: the answer to Redis"),
            Action::GiveUp { request } => format!("request {request}: 503, no answer in time"),
            Action::Authorize { message } => {
                format!("gateway: authorize auth:ch{}", message.charge)
            }
            Action::Deliver { answer } => format!("{} gets {}", who(&answer.client), answer.reply),
            Action::LoseRequest { request } => format!("network loses request {request}"),
            Action::LoseAnswer { answer } => format!("network loses the answer {}", answer.reply),
            Action::LoseMessage { message } => match message.reply {
                None => format!("network loses the call for auth:ch{}", message.charge),
                Some(_) => format!("network loses the answer for auth:ch{}", message.charge),
            },
            Action::Duplicate { message } => {
                format!("network duplicates the call for auth:ch{}", message.charge)
            }
            Action::Crash { instance } => format!("oncepay {} crashes", at(instance)),
            Action::Stale { key } => format!("clock: key k{key} stale"),
            Action::Expire { key } => format!("clock: key k{key} expires"),
            Action::Fence { key } => format!("sweeper: lease key k{key} and fence its charge"),
            Action::Release { request } => {
                format!("request {request}: gateway unreachable, release")
            }
            Action::SweepSettle => "sweeper: settle the fenced charge".into(),
        }
    }
}

/// The actions each part of the system may take next, by part.
impl Protocol {
    /// The clients: an attempt, or a timeout while waiting.
    fn clients_act(&self, s: &State, actions: &mut Vec<Action>) {
        for (id, c) in s.clients.iter().enumerate() {
            let client = id as Id;
            if !c.done && !c.waiting && c.attempts < c.max_attempts {
                actions.push(Action::Send { client });
            }
            if c.waiting {
                actions.push(Action::TimeOut { client });
            }
        }
    }

    /// Each request's next step at its instance, and the crash of an instance.
    fn requests_act(&self, s: &State, fault: bool, actions: &mut Vec<Action>) {
        for r in &s.requests {
            let request = r.id;
            match r.step {
                Step::OnWire => {
                    for instance in 0..INSTANCES {
                        actions.push(Action::Arrive { request, instance });
                    }
                    if fault {
                        actions.push(Action::LoseRequest { request });
                    }
                }
                Step::Arrived if self.variant == Variant::CheckThenAct => {
                    actions.push(Action::Read { request });
                }
                Step::Arrived | Step::FoundFree => actions.push(Action::Claim { request }),
                Step::Claimed { .. } => {
                    actions.push(Action::Call { request });
                    // An unreachable gateway is one of the network's faults.
                    if fault && !self.redis() && self.variant != Variant::KeyAfterWork {
                        actions.push(Action::Release { request });
                    }
                }
                Step::Calling { .. } => {
                    let replied = |m: &GatewayMessage| m.request == request && m.reply.is_some();
                    if s.wire.iter().any(replied) {
                        actions.push(Action::Settle { request });
                    }
                    actions.push(Action::GiveUp { request });
                }
                Step::Committed { .. } => actions.push(Action::SaveAnswer { request }),
            }
        }
        if s.crashes < self.bounds.crashes {
            for instance in 0..INSTANCES {
                if s.requests
                    .iter()
                    .any(|r| r.instance == instance && r.step != Step::OnWire)
                {
                    actions.push(Action::Crash { instance });
                }
            }
        }
    }

    /// The gateway takes a call; the network loses or duplicates.
    fn network_acts(&self, s: &State, fault: bool, actions: &mut Vec<Action>) {
        for m in &s.wire {
            if m.reply.is_none() {
                actions.push(Action::Authorize { message: m.clone() });
                if fault {
                    actions.push(Action::Duplicate { message: m.clone() });
                }
            }
            if fault {
                actions.push(Action::LoseMessage { message: m.clone() });
            }
        }
        for a in &s.answers {
            actions.push(Action::Deliver { answer: a.clone() });
            if fault {
                actions.push(Action::LoseAnswer { answer: a.clone() });
            }
        }
    }

    /// The clock on each key, and the sweeper.
    fn clock_and_sweeper_act(&self, s: &State, actions: &mut Vec<Action>) {
        for k in &s.keys {
            match k.status {
                KeyStatus::Processing { stale: false, .. } if !self.redis() => {
                    actions.push(Action::Stale { key: k.key });
                }
                KeyStatus::Processing { stale: true, .. } if s.sweeping.is_none() => {
                    actions.push(Action::Fence { key: k.key });
                }
                // Redis's TTL of a key whose holder is gone: no request
                // lives longer than it.
                KeyStatus::Processing { .. } if self.redis() && !held(s, k.key) => {
                    actions.push(Action::Expire { key: k.key });
                }
                KeyStatus::Completed(_) if self.expires(s, k.key) => {
                    actions.push(Action::Expire { key: k.key });
                }
                _ => {}
            }
        }
        if s.sweeping.is_some() {
            actions.push(Action::SweepSettle);
        }
    }
}

impl Protocol {
    /// The claim (`claim::claim`), and the naive designs' versions of it.
    fn claim(&self, s: &mut State, request: Id) {
        let r = find(s, request).clone();
        // What the key already holds decides, unless it is free; check
        // then act has read it already, and writes whatever it finds now.
        if r.step != Step::FoundFree {
            if let Some(answer) = self.answer_from_key(s, &r) {
                return answer_and_end(s, &r, answer);
            }
        }
        let charge = fresh(s);
        let pending = Charge {
            id: charge,
            client: r.client,
            settled: None,
        };
        let record = match self.variant {
            // The key alone, the charge later; or no key before the work.
            Variant::TwoTransactions | Variant::RedisSetNx => None,
            Variant::KeyAfterWork => {
                find(s, request).step = Step::Claimed { charge };
                return;
            }
            _ => Some(charge),
        };
        if record.is_some() {
            s.charges.push(pending);
        }
        let status = KeyStatus::Processing {
            charge: record,
            stale: false,
        };
        set_key(s, r.key, r.params, status);
        find(s, request).step = Step::Claimed { charge };
    }

    /// The answer the key gives a request before any work: a replay, `422`
    /// (other parameters) or `409` (in flight); `None` when the key is free.
    fn answer_from_key(&self, s: &State, r: &Request) -> Option<(Reply, bool)> {
        let key = s.keys.iter().find(|k| k.key == r.key)?;
        let other = key.params != r.params && self.variant != Variant::NoFingerprint;
        Some(match key.status {
            _ if other => (Reply::Reused, false),
            KeyStatus::Processing { .. } => (Reply::InUse, false),
            KeyStatus::Completed(reply) => (reply, true),
        })
    }

    /// The settle with the gateway's reply: `UPDATE ... WHERE status =
    /// 'pending'` and the key's answer in one transaction (Redis: the
    /// charge committed, its answer still to save).
    fn settle(&self, s: &mut State, request: Id) {
        let r = find(s, request).clone();
        let Step::Calling { charge } = r.step else {
            return;
        };
        let at = s
            .wire
            .iter()
            .position(|m| m.request == request && m.reply.is_some());
        let Some(at) = at else { return };
        let outcome = s.wire.remove(at).reply.unwrap_or(Outcome::Voided);
        if matches!(
            self.variant,
            Variant::TwoTransactions | Variant::KeyAfterWork | Variant::RedisSetNx
        ) {
            // The charge is written now, in the settle's transaction.
            s.charges.push(Charge {
                id: charge,
                client: r.client,
                settled: Some(outcome),
            });
            if self.redis() {
                find(s, request).step = Step::Committed { charge, outcome };
                return;
            }
            let reply = Reply::Charge { charge, outcome };
            set_key(s, r.key, r.params, KeyStatus::Completed(reply));
            return answer_and_end(s, &r, (reply, false));
        }
        let row = s.charges.iter_mut().find(|c| c.id == charge);
        let Some(row) = row else { return };
        // 0 rows: settled elsewhere (the sweeper); its outcome is the answer.
        let outcome = *row.settled.get_or_insert(outcome);
        let reply = Reply::Charge { charge, outcome };
        if row_is_pending_key(s, r.key, charge) {
            set_key(s, r.key, r.params, KeyStatus::Completed(reply));
        }
        answer_and_end(s, &r, (reply, false));
    }

    /// The release of a claim whose gateway call could not be sent: the
    /// pending charge and its key deleted, if the charge is still pending.
    fn release(&self, s: &mut State, request: Id) {
        let r = find(s, request).clone();
        let Step::Claimed { charge } = r.step else {
            return;
        };
        let row = s.charges.iter().find(|c| c.id == charge);
        let reply = match row.map(|c| c.settled) {
            // Settled meanwhile (the sweeper): that is the answer.
            Some(Some(outcome)) => Reply::Charge { charge, outcome },
            _ => {
                s.charges.retain(|c| c.id != charge);
                let ours = |k: &Key| match k.status {
                    KeyStatus::Processing { charge: c, .. } => c.is_none_or(|c| c == charge),
                    KeyStatus::Completed(_) => false,
                };
                s.keys.retain(|k| k.key != r.key || !ours(k));
                Reply::Unavailable
            }
        };
        answer_and_end(s, &r, (reply, false));
    }

    /// The sweeper's lease and fence of a stale key's charge: what stands
    /// at the gateway, a void if nothing was recorded.
    fn fence(&self, s: &mut State, key: Id) {
        let Some(k) = s.keys.iter_mut().find(|k| k.key == key) else {
            return;
        };
        let KeyStatus::Processing { charge, stale } = &mut k.status else {
            return;
        };
        // Leased: not stale again until its lease would lapse.
        *stale = false;
        let Some(charge) = *charge else {
            // A key without its record: nothing to recover, so given back.
            s.keys.retain(|k| k.key != key);
            return;
        };
        let client = s
            .charges
            .iter()
            .find(|c| c.id == charge)
            .map_or(CLIENT, |c| c.client);
        let outcome = if self.variant == Variant::NoVoidFence {
            Outcome::Voided
        } else {
            held_at_gateway(s, charge).unwrap_or_else(|| {
                let outcome = Outcome::Voided;
                s.gateway.push(Payment {
                    charge,
                    client,
                    outcome,
                });
                outcome
            })
        };
        s.sweeping = Some((charge, outcome));
    }

    /// The sweeper's conditional settle of the fenced charge.
    fn sweep_settle(&self, s: &mut State) {
        let Some((charge, outcome)) = s.sweeping.take() else {
            return;
        };
        let Some(row) = s.charges.iter_mut().find(|c| c.id == charge) else {
            return;
        };
        if row.settled.is_some() {
            return;
        }
        row.settled = Some(outcome);
        let key = s.keys.iter_mut().find(
            |k| matches!(k.status, KeyStatus::Processing { charge: Some(c), .. } if c == charge),
        );
        if let Some(k) = key {
            k.status = KeyStatus::Completed(Reply::Charge { charge, outcome });
        }
    }

    /// Whether the clock may expire `key`'s saved answer: past every retry
    /// of every client that uses it (with a short TTL: at any time).
    fn expires(&self, s: &State, key: Id) -> bool {
        if self.variant == Variant::ShortTtl {
            return true;
        }
        s.clients
            .iter()
            .all(|c| c.key != key || c.done || (c.attempts == c.max_attempts && !c.waiting))
            && !s.requests.iter().any(|r| r.key == key)
    }
}

/// The client sends its next attempt under `key`: a request on the wire.
fn send(s: &mut State, key: Id, client: Id) {
    let c = &mut s.clients[client as usize];
    let (params, attempt) = (c.params, c.attempts + 1);
    (c.attempts, c.waiting) = (attempt, true);
    let id = fresh(s);
    let step = Step::OnWire;
    let instance = 0;
    s.requests.push(Request {
        id,
        client,
        attempt,
        key,
        params,
        instance,
        step,
    });
}

/// The request's call to the gateway, under its charge's processor key.
fn call(s: &mut State, request: Id) -> Option<()> {
    let r = find(s, request);
    let Step::Claimed { charge } = r.step else {
        return None;
    };
    r.step = Step::Calling { charge };
    let (client, reply) = (r.client, None);
    s.wire.push(GatewayMessage {
        request,
        charge,
        client,
        reply,
    });
    Some(())
}

/// The gateway takes a call: what it holds under the processor key, or a
/// payment made now; its answer goes back on the wire.
fn authorize(s: &mut State, message: GatewayMessage) -> Option<()> {
    let at = s.wire.iter().position(|m| *m == message)?;
    s.wire.remove(at);
    let outcome = held_at_gateway(s, message.charge).unwrap_or_else(|| {
        let (charge, client, outcome) = (message.charge, message.client, Outcome::Paid);
        s.gateway.push(Payment {
            charge,
            client,
            outcome,
        });
        outcome
    });
    let reply = Some(outcome);
    s.wire.push(GatewayMessage { reply, ..message });
    Some(())
}

/// An answer reaches its client, which hears it only if it still waits
/// for that attempt.
fn deliver(s: &mut State, answer: Answer) -> Option<()> {
    let at = s.answers.iter().position(|a| *a == answer)?;
    s.answers.remove(at);
    let c = &mut s.clients[answer.client as usize];
    if c.waiting && c.attempts == answer.attempt {
        c.waiting = false;
        c.done = matches!(answer.reply, Reply::Charge { .. } | Reply::Reused);
        c.told.push((answer.reply, answer.replayed));
    }
    Some(())
}

/// Whether a live request holds `key` (Redis: between its `SET NX` and its
/// answer).
fn held(s: &State, key: Id) -> bool {
    s.requests.iter().any(|r| {
        r.key == key
            && matches!(
                r.step,
                Step::Claimed { .. } | Step::Calling { .. } | Step::Committed { .. }
            )
    })
}

/// Whether `key`'s row is still processing for `charge`.
fn row_is_pending_key(s: &State, key: Id, charge: Id) -> bool {
    s.keys.iter().any(|k| {
        k.key == key
            && matches!(k.status, KeyStatus::Processing { charge: Some(c), .. } if c == charge)
    })
}

/// Writes `key`'s row: inserted, or its old one replaced.
fn set_key(s: &mut State, key: Id, params: Id, status: KeyStatus) {
    s.keys.retain(|k| k.key != key);
    s.keys.push(Key {
        key,
        params,
        status,
    });
}

/// Ends request `r` with `answer` on the wire to its client.
fn answer_and_end(s: &mut State, r: &Request, (reply, replayed): (Reply, bool)) {
    s.requests.retain(|x| x.id != r.id);
    s.answers.push(Answer {
        client: r.client,
        attempt: r.attempt,
        reply,
        replayed,
    });
}

fn find(s: &mut State, request: Id) -> &mut Request {
    let found = s.requests.iter_mut().find(|r| r.id == request);
    found.expect("an action names a live request")
}

fn fresh(s: &mut State) -> Id {
    let id = s.next_id;
    s.next_id += 1;
    id
}

/// The charge and outcome of a reply that is one.
fn charge_of(told: &(Reply, bool)) -> Option<(Id, Outcome)> {
    match told.0 {
        Reply::Charge { charge, outcome } => Some((charge, outcome)),
        _ => None,
    }
}

/// Payments at the gateway (money moved, not voided) for `client`'s charges.
pub fn payments(s: &State, client: Id) -> usize {
    let paid = |p: &&Payment| p.client == client && p.outcome == Outcome::Paid;
    s.gateway.iter().filter(paid).count()
}

/// What the gateway holds for `charge`'s processor key.
fn held_at_gateway(s: &State, charge: Id) -> Option<Outcome> {
    s.gateway
        .iter()
        .find(|p| p.charge == charge)
        .map(|p| p.outcome)
}
