//! Catching up on events: a client that pages forward through `GET
//! /v1/events` with `ending_before` (the newest event it has seen) sees every
//! later event exactly once, also those whose transactions commit out of
//! order. The races are made certain by holding a writer's transaction open.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::join_all;
use oncepay::events::{EventType, NewEvent, store};
use serde_json::json;
use sqlx::{Postgres, Transaction};

use crate::helpers::{Answer, TestApp, spawn_app, until};

/// How long a test waits for the list to catch up: the list holds an event
/// back while any older transaction of the database server is at work, and
/// other tests share the server.
const CATCH_UP: Duration = Duration::from_secs(20);

/// A client catching up on events: the newest event it has seen, and every
/// event it was shown, in the order it saw them.
struct Poller<'a> {
    app: &'a TestApp,
    cursor: String,
    seen: Vec<String>,
}

impl<'a> Poller<'a> {
    /// Starts from the newest event the list shows now (the app must have one).
    async fn start(app: &'a TestApp) -> Self {
        until(CATCH_UP, "the list shows an event", || async {
            !page(app, "limit=1").await.0.is_empty()
        })
        .await;
        let newest = page(app, "limit=1").await.0.remove(0);
        Poller {
            app,
            cursor: newest,
            seen: Vec::new(),
        }
    }

    /// Pages forward from the cursor until the list has nothing newer.
    async fn poll(&mut self) {
        loop {
            let (data, has_more) = page(
                self.app,
                &format!("limit=100&ending_before={}", self.cursor),
            )
            .await;
            // A page is newest first; the client sees it oldest first.
            self.seen.extend(data.iter().rev().cloned());
            if let Some(newest) = data.first() {
                self.cursor = newest.clone();
            }
            if !has_more {
                return;
            }
        }
    }

    /// Polls until it has seen at least `count` events, for at most
    /// [`CATCH_UP`], then once more; the test then checks what it saw.
    async fn catch_up(&mut self, count: usize) {
        let deadline = tokio::time::Instant::now() + CATCH_UP;
        self.poll().await;
        while self.seen.len() < count && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.poll().await;
        }
        self.poll().await;
    }
}

/// One page of the list: the event ids, newest first, and `has_more`.
async fn page(app: &TestApp, query: &str) -> (Vec<String>, bool) {
    let answer = Answer::of(app.get(&format!("/v1/events?{query}")).await).await;
    assert_eq!(answer.status, 200, "{query}: {:?}", answer.body);
    let body = answer.json();
    let ids = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    (ids, body["has_more"].as_bool().unwrap())
}

/// The ids of the app's merchant's events, as stored.
async fn stored_events(app: &TestApp) -> HashSet<String> {
    sqlx::query_scalar("SELECT id FROM events WHERE merchant_id = $1")
        .bind(app.merchant_id)
        .fetch_all(&app.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// Writes a `charge.succeeded` event about `charge` in `tx`, as a settle
/// does, and returns its id; it is committed with `tx`.
async fn write_event(app: &TestApp, tx: &mut Transaction<'_, Postgres>, charge: &str) -> String {
    let event = NewEvent::new(
        EventType::ChargeSucceeded,
        charge,
        &json!({"id": charge, "object": "charge"}),
    );
    store::insert(
        tx,
        app.merchant_id,
        None,
        None,
        std::slice::from_ref(&event),
    )
    .await
    .unwrap();
    event.id
}

/// The id of the one event about `object_id`, as stored.
async fn event_about(app: &TestApp, object_id: &str) -> String {
    sqlx::query_scalar("SELECT id FROM events WHERE object_id = $1")
        .bind(object_id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_poller_does_not_skip_an_event_that_commits_after_a_newer_one() {
    let app = spawn_app().await;
    app.paid_charge(100).await;
    let mut poller = Poller::start(&app).await;

    // A settle has written its event and not yet committed, while a later
    // charge writes and commits its own.
    let mut held = app.pool.begin().await.unwrap();
    let early = write_event(&app, &mut held, "ch_heldopenwhileanotherlands").await;
    let later = app.paid_charge(200).await;
    let later = event_about(&app, &later).await;
    poller.poll().await;
    held.commit().await.unwrap();

    poller.catch_up(2).await;
    assert_eq!(
        poller.seen,
        [early, later],
        "each once, in the list's order"
    );
}

#[tokio::test]
async fn a_poller_sees_an_event_whose_transaction_began_writing_first_and_committed_last() {
    let app = spawn_app().await;
    app.paid_charge(100).await;
    let mut poller = Poller::start(&app).await;

    // `first` starts writing before `second` (it takes its transaction id),
    // `second` writes its event, then `first` writes its own and commits:
    // `first`'s event is the later in insertion order, and the first to
    // commit.
    let mut first = app.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *first)
        .await
        .unwrap();
    let mut second = app.pool.begin().await.unwrap();
    let second_event = write_event(&app, &mut second, "ch_secondbeganwritinglater0").await;
    let first_event = write_event(&app, &mut first, "ch_firstbeganwritingfirst00").await;
    first.commit().await.unwrap();
    poller.poll().await;
    second.commit().await.unwrap();

    poller.catch_up(2).await;
    assert_eq!(poller.seen, [first_event, second_event]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_poller_sees_every_event_of_concurrent_charges_and_refunds_exactly_once() {
    const WRITERS: usize = 16;
    const ROUNDS: usize = 8;
    let app = spawn_app().await;
    app.paid_charge(100).await;
    let mut poller = Poller::start(&app).await;
    let before = stored_events(&app).await;

    // Each writer charges, then refunds part of the charge: three events a
    // round (charge.succeeded, refund.created, charge.refunded).
    let done = AtomicBool::new(false);
    let writers = async {
        join_all((0..WRITERS).map(|_| async {
            for _ in 0..ROUNDS {
                let charge = app.paid_charge(1000).await;
                let refund = Answer::of(
                    app.post_refund(None, &json!({"charge": charge, "amount": 100}))
                        .await,
                )
                .await;
                assert_eq!(refund.status, 201, "{:?}", refund.body);
            }
        }))
        .await;
        done.store(true, Ordering::SeqCst);
    };
    let polling = async {
        while !done.load(Ordering::SeqCst) {
            poller.poll().await;
        }
    };
    tokio::join!(writers, polling);

    let written: HashSet<String> = stored_events(&app)
        .await
        .difference(&before)
        .cloned()
        .collect();
    assert_eq!(written.len(), WRITERS * ROUNDS * 3);
    poller.catch_up(written.len()).await;
    let seen: HashSet<String> = poller.seen.iter().cloned().collect();
    assert_eq!(seen.len(), poller.seen.len(), "an event was shown twice");
    let missed: Vec<&String> = written.difference(&seen).collect();
    assert!(missed.is_empty(), "never shown: {missed:?}");
    assert_eq!(seen, written);
}

/// How long the long-run poller test writes: `EVENT_POLLING_SECONDS`, 3 by
/// default (a few seconds in the suite; set it higher to hunt rare races).
fn polling_run() -> Duration {
    let seconds = std::env::var("EVENT_POLLING_SECONDS")
        .ok()
        .map(|s| {
            s.parse()
                .expect("EVENT_POLLING_SECONDS is a number of seconds")
        })
        .unwrap_or(3.0);
    Duration::from_secs_f64(seconds)
}

/// One writer's loop until `stop`: a charge, then a refund of part of it,
/// both with keys when `keyed` (three events a round). Returns the rounds.
async fn charge_and_refund(app: &TestApp, keyed: bool, stop: &AtomicBool) -> usize {
    let mut rounds = 0;
    while !stop.load(Ordering::SeqCst) {
        let key = |what: &str| keyed.then(|| format!("{what}-{}", uuid::Uuid::new_v4()));
        let charge = Answer::of(
            app.post_charge(key("charge").as_deref(), &crate::helpers::visa(1000))
                .await,
        )
        .await;
        assert_eq!(charge.status, 201, "{:?}", charge.body);
        let charge = charge.json()["id"].as_str().unwrap().to_owned();
        let refund = Answer::of(
            app.post_refund(
                key("refund").as_deref(),
                &json!({"charge": charge, "amount": 100}),
            )
            .await,
        )
        .await;
        assert_eq!(refund.status, 201, "{:?}", refund.body);
        rounds += 1;
    }
    rounds
}

/// Every event of the app's merchant the list shows, read back whole with
/// `starting_after` from the newest.
async fn whole_list(app: &TestApp) -> Vec<String> {
    let mut all = Vec::new();
    let mut query = "limit=100".to_owned();
    loop {
        let (data, has_more) = page(app, &query).await;
        all.extend(data.iter().cloned());
        match data.last() {
            Some(oldest) if has_more => query = format!("limit=100&starting_after={oldest}"),
            _ => return all,
        }
    }
}

/// What the database knows of the events in `ids`, to tell a missed one
/// apart: its position, type, request and key.
async fn described(app: &TestApp, ids: &[&String]) -> Vec<String> {
    let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    sqlx::query_as::<_, (i64, i64, String, Option<String>, Option<String>)>(
        "SELECT txid, seq, type, request_id, idempotency_key FROM events
          WHERE id = ANY($1) ORDER BY txid, seq",
    )
    .bind(&ids)
    .fetch_all(&app.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|e| format!("{e:?}"))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_poller_misses_no_event_of_keyless_and_keyed_writers_over_a_long_run() {
    const WRITERS: usize = 3;
    let app = spawn_app().await;
    app.paid_charge(100).await;
    let mut poller = Poller::start(&app).await;
    let before = stored_events(&app).await;

    // Half the writers charge and refund without keys, half with them,
    // for the run's length, while the poller pages forward without pause.
    let stop = AtomicBool::new(false);
    let done = AtomicBool::new(false);
    let writers = async {
        let keyless = (0..WRITERS).map(|_| charge_and_refund(&app, false, &stop));
        let keyed = (0..WRITERS).map(|_| charge_and_refund(&app, true, &stop));
        let rounds = join_all(keyless.chain(keyed)).await;
        done.store(true, Ordering::SeqCst);
        rounds.iter().sum::<usize>()
    };
    let timer = async {
        tokio::time::sleep(polling_run()).await;
        stop.store(true, Ordering::SeqCst);
    };
    let polling = async {
        while !done.load(Ordering::SeqCst) {
            poller.poll().await;
        }
    };
    let (rounds, _, _) = tokio::join!(writers, timer, polling);

    let written: HashSet<String> = stored_events(&app)
        .await
        .difference(&before)
        .cloned()
        .collect();
    assert_eq!(written.len(), rounds * 3);
    poller.catch_up(written.len()).await;
    eprintln!(
        "{} events written, {} seen",
        written.len(),
        poller.seen.len()
    );
    let listed: HashSet<String> = whole_list(&app).await.into_iter().collect();
    let seen: HashSet<String> = poller.seen.iter().cloned().collect();
    assert_eq!(seen.len(), poller.seen.len(), "an event was shown twice");
    let missed: Vec<&String> = written.difference(&seen).collect();
    assert!(
        missed.is_empty(),
        "of {} events, never shown to the poller: {:?}",
        written.len(),
        described(&app, &missed).await
    );
    assert!(written.is_subset(&listed), "the whole list lacks an event");
}
