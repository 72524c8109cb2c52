//! The workshop's webhook receivers: a pretend order system on the far side
//! of the webhook boundary, which ships an order for each event about its
//! run's charges. Delivery is at least once, so the same event can arrive
//! more than once; two receivers show what that does:
//!
//! - [`Mode::Naive`] verifies the signature, then ships for every delivery
//!   it gets: a redelivered event ships again.
//! - [`Mode::Inbox`] verifies the signature, then, in one transaction,
//!   records the event id in its inbox (`ON CONFLICT DO NOTHING`) and ships
//!   only if that inserted a row: a redelivery ships nothing.
//!
//! Either can answer the first `fail_first` deliveries of each event with a
//! failure after its work committed, which is how an event comes to be
//! delivered again. Nothing of the real API uses this module.

use chrono::Utc;
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor, PgPool};
use uuid::Uuid;

use crate::webhooks::signature;
use oncepay_core::error::Error;
use oncepay_core::params::{Encoding, ParamError, Params, shorten};
use oncepay_core::params::{required, string};
use oncepay_core::problem::{Problem, ProblemCode};

/// The longest run tag a receiver takes.
pub const MAX_RUN_CHARS: usize = 200;
/// The most deliveries of one event a receiver fails on purpose.
pub const MAX_FAIL_FIRST: i32 = 10;
const MAX_SECRET_CHARS: usize = 100;
const MAX_EVENT_ID_CHARS: usize = 255;
/// `fault`'s one value, as the delivery worker reads it in `Oncepay-Fault`.
pub const CRASH_AFTER_DELIVERY: &str = "crash-after-delivery";

/// Which of the two receivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum Mode {
    /// Ships for every delivery.
    Naive,
    /// Ships once per event id, recorded in its inbox in the same transaction.
    Inbox,
}

impl Mode {
    pub const ALL: [Mode; 2] = [Mode::Naive, Mode::Inbox];

    pub fn parse(value: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.as_str() == value)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Naive => "naive",
            Mode::Inbox => "inbox",
        }
    }
}

/// What a receiver answers to the first `fail_first` deliveries of each
/// event, once its work has committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misbehaviour {
    /// `500`: the worker retries after its backoff.
    Fail,
    /// `200` with `Oncepay-Fault: crash-after-delivery`: a worker running
    /// with fault injection aborts before it records the attempt, so the
    /// event is sent again once the delivery's lease runs out.
    CrashAfterDelivery,
}

/// The validated parameters of `POST /demo/receivers`. The API's document
/// describes them under the name `CreateReceiver`.
#[derive(Clone, Debug, PartialEq, Eq, utoipa::ToSchema)]
#[schema(as = CreateReceiver, description = "The parameters of `POST /demo/receivers`.")]
pub struct NewReceiver {
    /// The run tag: 1 to 200 characters. The receiver acts only on events
    /// about charges with this `metadata[demo_run]`.
    #[schema(example = "demo-1")]
    pub run: String,
    /// `naive` (ships for every delivery) or `inbox` (ships once per event id).
    #[schema(value_type = String, example = "inbox")]
    pub mode: Mode,
    /// The signing secret of the webhook endpoint that sends to this
    /// receiver: `whsec_` and up to 100 letters or digits.
    #[schema(example = "whsec_1NbB3eCTYkz2mVgqA8rW0hXpq3RtY6Uz")]
    pub secret: String,
    /// Answer the first N deliveries of each event with a failure, after
    /// the work committed: 0 to 10, default 0.
    #[schema(value_type = Option<i32>, minimum = 0, maximum = 10, example = 0)]
    pub fail_first: i32,
    /// `crash-after-delivery`: on those first N, answer `200` with
    /// `Oncepay-Fault: crash-after-delivery` instead of `500` (needs
    /// `FAULT_INJECTION=true`).
    #[schema(rename = "fault", value_type = Option<String>, example = "crash-after-delivery")]
    pub misbehaviour: Misbehaviour,
}

impl NewReceiver {
    pub fn from_params(mut params: Params) -> Result<Self, ParamError> {
        let encoding = params.encoding;
        let run = run_tag(string(required(&mut params, "run")?, "run")?)?;
        let mode = string(required(&mut params, "mode")?, "mode")?;
        let mode = Mode::parse(&mode).ok_or_else(|| {
            invalid(
                "mode",
                format!("Invalid mode: '{}'. Use naive or inbox", shorten(&mode)),
            )
        })?;
        let secret = string(required(&mut params, "secret")?, "secret")?;
        let well_formed = secret.strip_prefix("whsec_").is_some_and(|rest| {
            (1..=MAX_SECRET_CHARS).contains(&rest.len())
                && rest.bytes().all(|b| b.is_ascii_alphanumeric())
        });
        if !well_formed {
            // Never echoed: it is a secret.
            return Err(invalid(
                "secret",
                "secret must be a webhook endpoint's signing secret: whsec_ and letters or digits",
            ));
        }
        let fail_first = params
            .take("fail_first")
            .map(|v| fail_first(v, encoding))
            .transpose()?
            .unwrap_or(0);
        let misbehaviour = match params
            .take("fault")
            .map(|v| string(v, "fault"))
            .transpose()?
        {
            None => Misbehaviour::Fail,
            Some(fault) if fault == CRASH_AFTER_DELIVERY => Misbehaviour::CrashAfterDelivery,
            Some(other) => {
                return Err(invalid(
                    "fault",
                    format!(
                        "Invalid fault: '{}'. The one a receiver can ask for is {CRASH_AFTER_DELIVERY}",
                        shorten(&other)
                    ),
                ));
            }
        };
        params.refuse_expand()?;
        params.reject_unknown()?;
        Ok(NewReceiver {
            run,
            mode,
            secret,
            fail_first,
            misbehaviour,
        })
    }
}

fn invalid(param: &str, message: impl Into<String>) -> ParamError {
    ParamError::new(ProblemCode::ReceiverInvalid, param, message)
}

/// A run tag: 1 to [`MAX_RUN_CHARS`] characters.
pub fn run_tag(run: String) -> Result<String, ParamError> {
    match run.chars().count() {
        0 => Err(invalid("run", "run must not be empty")),
        n if n > MAX_RUN_CHARS => Err(ParamError::new(
            ProblemCode::ParameterTooLong,
            "run",
            format!("run must be at most {MAX_RUN_CHARS} characters"),
        )),
        _ => Ok(run),
    }
}

/// `fail_first`: a whole number from 0 to [`MAX_FAIL_FIRST`], a JSON
/// integer or a form's digits.
fn fail_first(value: Value, encoding: Encoding) -> Result<i32, ParamError> {
    let not_an_integer = || {
        ParamError::new(
            ProblemCode::ParameterInvalidInteger,
            "fail_first",
            format!("fail_first must be a whole number from 0 to {MAX_FAIL_FIRST}"),
        )
    };
    let n = match (value, encoding) {
        (Value::Number(n), Encoding::Json) => n.as_i64().ok_or_else(not_an_integer)?,
        (Value::String(s), Encoding::Form)
            if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) =>
        {
            s.parse::<i64>().unwrap_or(i64::MAX)
        }
        _ => return Err(not_an_integer()),
    };
    match i32::try_from(n) {
        Ok(n) if (0..=MAX_FAIL_FIRST).contains(&n) => Ok(n),
        _ => Err(invalid(
            "fail_first",
            format!("fail_first must be from 0 to {MAX_FAIL_FIRST}"),
        )),
    }
}

/// Sets up (or, for the same merchant, sets up anew) the receiver of
/// `receiver.run` in its mode. A run belongs to the merchant that set up its
/// first receiver, in either mode: another merchant's receiver of it, in
/// the same mode or the other, is refused, since the receivers' URLs name
/// only the run. One statement claims the run (or reads and locks whose it
/// is) and writes the receiver only if the run is this merchant's, so two
/// merchants setting up one new run at once cannot both have it.
pub async fn register(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    receiver: &NewReceiver,
) -> Result<(), Error> {
    let fault =
        (receiver.misbehaviour == Misbehaviour::CrashAfterDelivery).then_some(CRASH_AFTER_DELIVERY);
    let written = sqlx::query_scalar!(
        r#"WITH owner AS (
               INSERT INTO demo_receiver_runs (run, merchant_id) VALUES ($1, $3)
               ON CONFLICT (run) DO UPDATE SET run = EXCLUDED.run
               RETURNING merchant_id
           )
           INSERT INTO demo_receivers (run, mode, merchant_id, secret, fail_first, fault)
           SELECT $1, $2::text, $3, $4::text, $5::int4, $6::text
             FROM owner WHERE owner.merchant_id = $3
           ON CONFLICT (run, mode) DO UPDATE
              SET secret = EXCLUDED.secret, fail_first = EXCLUDED.fail_first,
                  fault = EXCLUDED.fault
            WHERE demo_receivers.merchant_id = EXCLUDED.merchant_id
           RETURNING 1 AS "written!""#,
        receiver.run,
        receiver.mode.as_str(),
        merchant_id,
        receiver.secret,
        receiver.fail_first,
        fault,
    )
    .fetch_optional(db)
    .await?;
    match written {
        Some(_) => Ok(()),
        None => Err(Error::from(invalid(
            "run",
            "This run's receivers are another merchant's; use a run tag of your own.",
        ))),
    }
}

/// What a receiver did with one delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Receipt {
    /// An event about no charge of this run (another workshop participant's,
    /// say): acknowledged, nothing written.
    Ignored { event_id: String },
    /// Counted, and acted on as the receiver's mode says; committed.
    Received {
        event_id: String,
        /// This delivery's number among the deliveries of its event, from 1.
        delivery: i32,
        /// Whether this delivery shipped an order.
        shipped: bool,
        /// Set when this delivery is one the receiver fails on purpose.
        misbehaviour: Option<Misbehaviour>,
    },
}

/// Takes in one delivery to the receiver of `run` in `mode`: verifies
/// `signature_header` against the body's bytes exactly as received, then
/// counts the delivery and does the receiver's work, in one transaction.
/// A receiver that does not exist, a signature that does not verify, or a
/// body that is not an event is refused before anything is written.
pub async fn receive(
    pool: &PgPool,
    run: &str,
    mode: Mode,
    signature_header: Option<&str>,
    body: &[u8],
) -> Result<Receipt, Error> {
    let Some(receiver) = find(pool, run, mode).await? else {
        return Err(Problem::new(
            ProblemCode::ResourceMissing,
            format!(
                "No {} receiver for run '{}': set one up with POST /demo/receivers.",
                mode.as_str(),
                shorten(run)
            ),
        )
        .with_param("run")
        .into());
    };
    signature::verify(
        signature_header,
        body,
        &receiver.secret,
        Utc::now().timestamp(),
        signature::DEFAULT_TOLERANCE_SECS,
    )
    .map_err(|e| {
        Problem::new(
            ProblemCode::WebhookSignatureInvalid,
            format!("The delivery was refused: {e}. Nothing was written."),
        )
    })?;
    let event = Event::parse(body)?;
    if event.run.as_deref() != Some(run) {
        return Ok(Receipt::Ignored { event_id: event.id });
    }
    let mut tx = pool.begin().await?;
    let delivery = count_delivery(&mut tx, run, mode, &event.id).await?;
    let shipped = match mode {
        Mode::Naive => {
            ship(&mut tx, run, mode, &event.id).await?;
            true
        }
        Mode::Inbox => {
            // The rule: the event id goes into the inbox in the transaction
            // that ships, and only a new id ships.
            let new = into_inbox(&mut tx, run, &event.id).await?;
            if new {
                ship(&mut tx, run, mode, &event.id).await?;
            }
            new
        }
    };
    tx.commit().await?;
    Ok(Receipt::Received {
        event_id: event.id,
        delivery,
        shipped,
        misbehaviour: (delivery <= receiver.fail_first).then_some(receiver.misbehaviour),
    })
}

/// What a receiver reads of an event: its id, and the run tag of the object
/// it is about (`data.object.metadata.demo_run`).
#[derive(Debug)]
struct Event {
    id: String,
    run: Option<String>,
}

impl Event {
    fn parse(body: &[u8]) -> Result<Event, Error> {
        let not_an_event = || {
            Error::from(Problem::new(
                ProblemCode::InvalidJson,
                "The body is not an event: a JSON object with a string id.",
            ))
        };
        let value: Value = serde_json::from_slice(body).map_err(|_| not_an_event())?;
        let Some(Value::String(id)) = value.get("id") else {
            return Err(not_an_event());
        };
        if id.is_empty() || id.chars().count() > MAX_EVENT_ID_CHARS || id.contains('\0') {
            return Err(ParamError::new(
                ProblemCode::ParameterInvalidString,
                "id",
                format!(
                    "An event id is 1 to {MAX_EVENT_ID_CHARS} characters, without NUL: '{}'",
                    shorten(&id.replace('\0', "\\u0000"))
                ),
            )
            .into());
        }
        let run = value
            .pointer("/data/object/metadata/demo_run")
            .and_then(Value::as_str)
            .map(str::to_owned);
        Ok(Event {
            id: id.clone(),
            run,
        })
    }
}

/// A receiver as set up.
struct Receiver {
    secret: String,
    fail_first: i32,
    misbehaviour: Misbehaviour,
}

async fn find(db: impl PgExecutor<'_>, run: &str, mode: Mode) -> sqlx::Result<Option<Receiver>> {
    let row = sqlx::query!(
        "SELECT secret, fail_first, fault FROM demo_receivers WHERE run = $1 AND mode = $2",
        run,
        mode.as_str(),
    )
    .fetch_optional(db)
    .await?;
    Ok(row.map(|row| Receiver {
        secret: row.secret,
        fail_first: row.fail_first,
        misbehaviour: match row.fault.as_deref() {
            Some(CRASH_AFTER_DELIVERY) => Misbehaviour::CrashAfterDelivery,
            _ => Misbehaviour::Fail,
        },
    }))
}

/// Counts one more delivery of `event_id`; returns its number, from 1. The
/// upsert locks the event's counter row, so two deliveries of one event at
/// once get two numbers.
async fn count_delivery(
    tx: &mut PgConnection,
    run: &str,
    mode: Mode,
    event_id: &str,
) -> sqlx::Result<i32> {
    sqlx::query_scalar!(
        "INSERT INTO demo_receiver_deliveries (run, mode, event_id, deliveries)
         VALUES ($1, $2, $3, 1)
         ON CONFLICT (run, mode, event_id) DO UPDATE
            SET deliveries = demo_receiver_deliveries.deliveries + 1, last_at = now()
         RETURNING deliveries",
        run,
        mode.as_str(),
        event_id,
    )
    .fetch_one(tx)
    .await
}

/// Records `event_id` in the inbox; `true` when it was not there yet.
async fn into_inbox(tx: &mut PgConnection, run: &str, event_id: &str) -> sqlx::Result<bool> {
    let inserted = sqlx::query!(
        "INSERT INTO demo_inbox (run, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        run,
        event_id,
    )
    .execute(tx)
    .await?;
    Ok(inserted.rows_affected() == 1)
}

/// The effect: one order shipped.
async fn ship(tx: &mut PgConnection, run: &str, mode: Mode, event_id: &str) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO demo_shipments (run, mode, event_id) VALUES ($1, $2, $3)",
        run,
        mode.as_str(),
        event_id,
    )
    .execute(tx)
    .await?;
    Ok(())
}

/// One receiver of a run, as set up, and what it took in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReceiverCounts {
    pub mode: Mode,
    pub fail_first: i32,
    pub misbehaviour: Misbehaviour,
    /// Deliveries received (signature verified, about this run).
    pub deliveries: i64,
    /// Distinct events among them.
    pub events: i64,
    /// Orders shipped.
    pub shipments: i64,
}

/// The receivers of a run and what they took in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunCounts {
    /// Registered receivers only, naive first.
    pub receivers: Vec<ReceiverCounts>,
    /// Distinct events received by any receiver of the run.
    pub events: i64,
}

/// Counts what the merchant's receivers of `run` took in, read in one
/// statement (one snapshot), from that run's rows only.
pub async fn counts(
    db: impl PgExecutor<'_>,
    merchant_id: Uuid,
    run: &str,
) -> sqlx::Result<RunCounts> {
    let rows = sqlx::query!(
        r#"WITH r AS (
               SELECT run, mode, fail_first, fault FROM demo_receivers
                WHERE run = $1 AND merchant_id = $2
           )
           SELECT r.mode AS "mode: Mode", r.fail_first, r.fault,
                  (SELECT coalesce(sum(d.deliveries), 0) FROM demo_receiver_deliveries d
                    WHERE d.run = r.run AND d.mode = r.mode)::int8 AS "deliveries!",
                  (SELECT count(*) FROM demo_receiver_deliveries d
                    WHERE d.run = r.run AND d.mode = r.mode) AS "events!",
                  (SELECT count(*) FROM demo_shipments s
                    WHERE s.run = r.run AND s.mode = r.mode) AS "shipments!",
                  (SELECT count(DISTINCT d.event_id) FROM demo_receiver_deliveries d
                     JOIN r AS mine ON mine.run = d.run AND mine.mode = d.mode) AS "all_events!"
             FROM r
            ORDER BY r.mode = 'inbox', r.mode"#,
        run,
        merchant_id,
    )
    .fetch_all(db)
    .await?;
    let events = rows.first().map_or(0, |r| r.all_events);
    let receivers = rows
        .into_iter()
        .map(|row| ReceiverCounts {
            mode: row.mode,
            fail_first: row.fail_first,
            misbehaviour: match row.fault.as_deref() {
                Some(CRASH_AFTER_DELIVERY) => Misbehaviour::CrashAfterDelivery,
                _ => Misbehaviour::Fail,
            },
            deliveries: row.deliveries,
            events: row.events,
            shipments: row.shipments,
        })
        .collect();
    Ok(RunCounts { receivers, events })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn from_json(body: Value) -> Result<NewReceiver, ParamError> {
        NewReceiver::from_params(Params::from_json(body.to_string().as_bytes()).unwrap())
    }

    fn code(body: Value) -> (&'static str, String) {
        let e = from_json(body).unwrap_err();
        (e.code.as_str(), e.param)
    }

    const SECRET: &str = "whsec_abc123";

    #[test]
    fn a_receiver_is_a_run_a_mode_a_secret_and_how_it_misbehaves() {
        let r = from_json(json!({"run": "r1", "mode": "inbox", "secret": SECRET})).unwrap();
        assert_eq!(
            r,
            NewReceiver {
                run: "r1".into(),
                mode: Mode::Inbox,
                secret: SECRET.into(),
                fail_first: 0,
                misbehaviour: Misbehaviour::Fail,
            }
        );
        let form = NewReceiver::from_params(
            Params::from_form(
                b"run=r1&mode=naive&secret=whsec_abc123&fail_first=2&fault=crash-after-delivery",
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (form.mode, form.fail_first, form.misbehaviour),
            (Mode::Naive, 2, Misbehaviour::CrashAfterDelivery)
        );
    }

    #[test]
    fn bad_parameters_are_refused_with_the_parameter_named() {
        let ok = json!({"run": "r", "mode": "naive", "secret": SECRET});
        let with = |name: &str, value: Value| {
            let mut body = ok.clone();
            body[name] = value;
            body
        };
        // Each parameter set to a bad value, and the code it is refused with.
        for (name, value, refused) in [
            ("mode", json!("eager"), "receiver_invalid"),
            ("secret", json!("sk_test_x"), "receiver_invalid"),
            ("secret", json!("whsec_"), "receiver_invalid"),
            ("secret", json!("whsec_a-b"), "receiver_invalid"),
            ("run", json!(""), "receiver_invalid"),
            ("run", json!("r".repeat(201)), "parameter_too_long"),
            ("fail_first", json!(11), "receiver_invalid"),
            ("fail_first", json!(-1), "receiver_invalid"),
            ("fail_first", json!(1.5), "parameter_invalid_integer"),
            ("fail_first", json!("2"), "parameter_invalid_integer"),
            ("fault", json!("drop-response"), "receiver_invalid"),
            ("extra", json!(1), "parameter_unknown"),
        ] {
            assert_eq!(
                code(with(name, value.clone())),
                (refused, name.into()),
                "{name}: {value}"
            );
        }
        assert_eq!(
            code(json!({"mode": "naive", "secret": SECRET})),
            ("parameter_missing", "run".into())
        );
        let form = |body: &str| {
            NewReceiver::from_params(Params::from_form(body.as_bytes()).unwrap())
                .unwrap_err()
                .code
        };
        assert_eq!(
            form("run=r&mode=naive&secret=whsec_a&fail_first=-1"),
            ProblemCode::ParameterInvalidInteger
        );
        assert_eq!(
            form("run=r&mode=naive&secret=whsec_a&fail_first=99999999999999999999"),
            ProblemCode::ReceiverInvalid
        );
    }

    #[test]
    fn an_event_is_read_for_its_id_and_its_run() {
        let body = json!({"id": "evt_1", "data": {"object": {"metadata": {"demo_run": "r"}}}});
        let event = Event::parse(body.to_string().as_bytes()).unwrap();
        assert_eq!(
            (event.id.as_str(), event.run.as_deref()),
            ("evt_1", Some("r"))
        );
        let untagged =
            Event::parse(br#"{"id":"evt_2","data":{"object":{"metadata":{}}}}"#).unwrap();
        assert_eq!(untagged.run, None);
        for bad in [&b"[]"[..], b"{}", b"{\"id\":1}", b"not json", b""] {
            assert!(Event::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Event::parse(br#"{"id":"evt\u0000"}"#).is_err());
        assert!(Event::parse(br#"{"id":""}"#).is_err());
    }
}
