//! `Prefer: wait` when the key in flight does not simply complete: it goes
//! stale under its waiters, or it is given back after a failure.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::join_all;
use oncepay::processor::{
    Authorization, Capture, Outcome, Payment, Processor, ProcessorError, Refund, RefundOutcome,
};
use tokio::sync::watch;

use crate::helpers::{Answer, Settings, TestApp, spawn_app_with_processor, visa};
use crate::sweeper::stale_claim;

async fn post_waiting(app: &TestApp, key: &str) -> Answer {
    let response = app
        .client
        .post(app.url("/v1/charges"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", key)
        .header("Prefer", "wait=5")
        .json(&visa(2000))
        .send()
        .await
        .unwrap();
    Answer::of(response).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_waiters_on_a_key_that_goes_stale_settle_it_once_and_all_get_its_answer() {
    let voids = Arc::new(AtomicUsize::new(0));
    let processor = {
        let voids = voids.clone();
        move |_, http| -> Arc<dyn Processor> {
            Arc::new(Counting {
                inner: http,
                voids,
                unavailable_first: None,
                authorizations: AtomicUsize::new(0),
            })
        }
    };
    let settings = Settings::new()
        .set("PROCESSING_TIMEOUT", "2s")
        .set("REQUEST_TIMEOUT", "1900ms");
    let app = spawn_app_with_processor(settings, processor).await;
    // A request claimed the key 1.5 s ago and crashed: its waiters see it go
    // stale half a second later, well within their request's time.
    stale_claim(
        &app,
        "crashed",
        "ch_crashedwhilewaitedon00001",
        "1500 milliseconds",
    )
    .await;

    let answers = join_all((0..20).map(|_| post_waiting(&app, "crashed"))).await;

    for answer in &answers {
        answer.assert_problem(402, "processing_abandoned");
        assert!(answer.replayed());
        assert_eq!(answer.header("preference-applied"), Some("wait"));
        assert_eq!(answer.body, answers[0].body, "one answer for all");
    }
    assert_eq!(
        voids.load(Ordering::SeqCst),
        1,
        "one waiter won the lease and settled the key; the others waited for it"
    );
    assert_eq!(
        app.count("SELECT count(*) FROM charges WHERE status = 'failed'")
            .await,
        1
    );
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_claims_a_key_given_back_after_the_processor_was_unavailable() {
    let processor = |_, http| -> Arc<dyn Processor> {
        Arc::new(Counting {
            inner: http,
            voids: Arc::default(),
            unavailable_first: Some(Duration::from_millis(600)),
            authorizations: AtomicUsize::new(0),
        })
    };
    let app = spawn_app_with_processor(Settings::new(), processor).await;
    let first = async { Answer::of(app.post_charge(Some("flaky"), &visa(2000)).await).await };
    let waiter = async {
        app.until_in_flight("flaky").await;
        post_waiting(&app, "flaky").await
    };
    let (first, waiter) = tokio::join!(first, waiter);

    first.assert_problem(503, "processor_unavailable");
    assert_eq!(first.header("retry-after"), Some("1"));
    assert_eq!(waiter.status, 201, "{:?}", waiter.body);
    assert!(!waiter.replayed(), "the waiter did the work itself");
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_asked_for_longer_than_ten_seconds_ends_after_ten() {
    let (release, released) = watch::channel(false);
    let processor = move |_, http| -> Arc<dyn Processor> {
        Arc::new(Held {
            inner: http,
            released,
        })
    };
    // Room for a minute's wait: only the cap can end it before the request
    // timeout does.
    let settings = Settings::new()
        .set("PROCESSING_TIMEOUT", "1m")
        .set("REQUEST_TIMEOUT", "30s");
    let app = spawn_app_with_processor(settings, processor).await;
    let first = async { Answer::of(app.post_charge(Some("held"), &visa(2000)).await).await };
    let waiter = async {
        app.until_in_flight("held").await;
        let sent = Instant::now();
        let response = app
            .client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "held")
            .header("Prefer", "wait=60")
            .json(&visa(2000))
            .send()
            .await
            .unwrap();
        let answer = Answer::of(response).await;
        let waited = sent.elapsed();
        release.send_replace(true);
        (answer, waited)
    };
    let (first, (waiter, waited)) = tokio::join!(first, waiter);

    waiter.assert_problem(409, "idempotency_key_in_use");
    assert_eq!(waiter.header("retry-after"), Some("1"));
    assert!(
        waited >= Duration::from_secs(10) && waited < app.config.request_timeout,
        "waited {waited:?}"
    );
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
}

/// The simulated processor, except that authorizing waits until `released`.
struct Held {
    inner: Arc<dyn Processor>,
    released: watch::Receiver<bool>,
}

#[async_trait]
impl Processor for Held {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        let mut released = self.released.clone();
        let _ = released.wait_for(|released| *released).await;
        self.inner.authorize(request).await
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        self.inner.void_unless_recorded(processor_key).await
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        self.inner.capture(request).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        self.inner.refund(request).await
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        self.inner.payment(processor_key).await
    }
}

/// The simulated processor, counting voids, and optionally unavailable (after
/// a delay) on its first authorization.
struct Counting {
    inner: Arc<dyn Processor>,
    voids: Arc<AtomicUsize>,
    unavailable_first: Option<Duration>,
    authorizations: AtomicUsize,
}

#[async_trait]
impl Processor for Counting {
    async fn authorize(&self, request: Authorization<'_>) -> Result<Outcome, ProcessorError> {
        if let Some(delay) = self.unavailable_first {
            if self.authorizations.fetch_add(1, Ordering::SeqCst) == 0 {
                tokio::time::sleep(delay).await;
                return Err(ProcessorError::Unavailable);
            }
        }
        self.inner.authorize(request).await
    }

    async fn void_unless_recorded(&self, processor_key: &str) -> Result<Outcome, ProcessorError> {
        self.voids.fetch_add(1, Ordering::SeqCst);
        self.inner.void_unless_recorded(processor_key).await
    }

    async fn capture(&self, request: Capture<'_>) -> Result<(), ProcessorError> {
        self.inner.capture(request).await
    }

    async fn refund(&self, request: Refund<'_>) -> Result<RefundOutcome, ProcessorError> {
        self.inner.refund(request).await
    }

    async fn payment(&self, processor_key: &str) -> Result<Option<Payment>, ProcessorError> {
        self.inner.payment(processor_key).await
    }
}
