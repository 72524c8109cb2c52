//! The guarantee with the plain seams only ([`crate::speed::Plain`]): many
//! requests race on one key against a real database and a processor that
//! counts its authorizations, and one charge is made, once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::charge::CreateCharge;
use super::engine::{Answer, Engine, METHOD, Request};
use super::timing::Untimed;
use super::workflow::{Operation, run};
use crate::charges::{Amount, Currency, NewCharge};
use crate::idempotency::{Fingerprint, IdempotencyKey};
use crate::processor::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
    TestToken,
};
use crate::settings::Timeouts;
use crate::speed::Plain;

/// A processor idempotent on its key, as a real one is, that counts the
/// authorizations that moved money.
#[derive(Default)]
struct CountingProcessor {
    payments: Mutex<HashMap<String, Outcome>>,
}

#[async_trait]
impl Processor for CountingProcessor {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        // Slow enough that the racing requests find the key in flight.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut payments = self.payments.lock().unwrap();
        let outcome = payments
            .entry(request.processor_key.to_owned())
            .or_insert(Outcome::Succeeded);
        Ok(outcome.clone())
    }

    async fn void_unless_recorded(&self, key: &str) -> Result<Outcome, ProcessorError> {
        let payments = self.payments.lock().unwrap();
        Ok(payments.get(key).cloned().unwrap_or(Outcome::Voided))
    }

    async fn capture(&self, _: Capture<'_>) -> Result<(), ProcessorError> {
        Err(ProcessorError::Unavailable)
    }

    async fn refund(&self, _: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        Err(ProcessorError::Unavailable)
    }

    async fn payment(&self, _: &str) -> Result<Option<Payment>, ProcessorError> {
        Err(ProcessorError::Unavailable)
    }
}

fn engine(pool: PgPool, processor: Arc<CountingProcessor>) -> Engine {
    Engine {
        pool,
        processor,
        timeouts: Timeouts {
            key_ttl: Duration::from_secs(86_400),
            processing: Duration::from_secs(30),
            request: Duration::from_secs(10),
            sweep_interval: Duration::from_secs(5),
        },
        tasks: TaskTracker::new(),
        admission: Arc::new(Plain),
        waits: Arc::new(Plain),
    }
}

fn charge() -> NewCharge {
    NewCharge {
        amount: Amount::new(2000).unwrap(),
        currency: Currency::parse("usd").unwrap(),
        source: TestToken::parse("tok_visa").unwrap(),
        description: None,
        metadata: Default::default(),
        capture: true,
        receipt_email: None,
        statement_descriptor: None,
        statement_descriptor_suffix: None,
        shipping: None,
        transfer_group: None,
    }
}

#[sqlx::test(migrations = "../../migrations")]
async fn sixteen_requests_racing_on_one_key_make_one_charge_with_plain_paths(pool: PgPool) {
    let merchant_id = Uuid::new_v4();
    sqlx::query("INSERT INTO merchants (id, name, api_key_hash) VALUES ($1, 'plain', $2)")
        .bind(merchant_id)
        .bind(vec![7u8; 32])
        .execute(&pool)
        .await
        .unwrap();
    let processor = Arc::new(CountingProcessor::default());
    let engine = engine(pool.clone(), processor.clone());
    let key = IdempotencyKey::parse(b"plain-race-1").unwrap();

    let racers = (0..16).map(|_| {
        let engine = engine.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let charge = CreateCharge::new(merchant_id, charge());
            let route = CreateCharge::ROUTE;
            let arrived = Instant::now();
            let request = Request {
                route,
                merchant_id,
                request_id: None,
                key: Some(key),
                fingerprint: Fingerprint::of(METHOD, route, &charge.canonical()),
                wait: Duration::from_secs(5),
                fault: None,
                arrived,
                deadline: arrived + Duration::from_secs(10),
                client_gone: Default::default(),
                has_written: Default::default(),
                clock: Arc::new(Untimed),
            };
            run(&engine, request, charge).await
        })
    });
    let mut fresh = 0;
    let mut bodies = Vec::new();
    for racer in racers.collect::<Vec<_>>() {
        match racer.await.unwrap().unwrap() {
            Answer::Fresh(saved) => {
                fresh += 1;
                bodies.push(saved.body);
            }
            Answer::Replayed { saved, .. } => bodies.push(saved.response.body.clone()),
        }
    }

    assert_eq!(fresh, 1, "one request did the work, the others replayed it");
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "one answer for all"
    );
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges WHERE merchant_id = $1")
        .bind(merchant_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(charges, 1, "one charge row");
    assert_eq!(processor.payments.lock().unwrap().len(), 1, "one payment");
}
