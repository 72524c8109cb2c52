//! Webhook endpoints and deliveries: the endpoints API, guarded by keys like
//! every POST; each event delivered, signed, to each endpoint that wants it;
//! retries, timeouts, refusals and disabling; several instances delivering
//! from one database. The receivers are real HTTP servers on free ports.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use oncepay::webhooks::signature;
use serde_json::{Value, json};

use crate::helpers::{Answer, Settings, TestApp, spawn_app_with, until, visa};

/// Fast retries, so that a test sees several attempts in a second; and the
/// address guard off, since the receivers listen on loopback (the guard's
/// own tests turn it back on).
fn fast() -> Settings {
    Settings::new()
        .set("WEBHOOK_ALLOW_PRIVATE", "true")
        .set("WEBHOOK_POLL_INTERVAL", "50ms")
        .set("WEBHOOK_RETRY_BASE", "100ms")
        .set("WEBHOOK_RETRY_MAX", "200ms")
}

/// How a test receiver answers one delivery.
#[derive(Clone, Copy, Debug)]
enum Reply {
    Status(u16),
    /// Answers 200 after this long.
    Slow(Duration),
    /// Answers 200 with a body that never ends.
    Endless,
}

/// A delivery a test receiver got.
#[derive(Clone, Debug)]
struct Got {
    signature: String,
    body: Bytes,
    at: Instant,
}

/// A real HTTP server that records every delivery and answers each with
/// the next of its replies (the last one again once they run out).
struct Receiver {
    url: String,
    got: Arc<Mutex<Vec<Got>>>,
    /// Bytes of an endless answer the server was made to produce.
    produced: Arc<AtomicUsize>,
    server: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start(replies: &[Reply]) -> Self {
        let got = Arc::new(Mutex::new(Vec::new()));
        let produced = Arc::new(AtomicUsize::new(0));
        let replies = Arc::new(replies.to_vec());
        let (got_in, produced_in) = (got.clone(), produced.clone());
        let handler = move |headers: HeaderMap, body: Bytes| {
            let (got, produced, replies) = (got_in.clone(), produced_in.clone(), replies.clone());
            async move {
                let n = {
                    let mut got = got.lock().unwrap();
                    got.push(Got {
                        signature: headers
                            .get("stripe-signature")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_owned(),
                        body,
                        at: Instant::now(),
                    });
                    got.len()
                };
                match replies[(n - 1).min(replies.len() - 1)] {
                    Reply::Status(status) => StatusCode::from_u16(status).unwrap().into_response(),
                    Reply::Slow(delay) => {
                        tokio::time::sleep(delay).await;
                        StatusCode::OK.into_response()
                    }
                    Reply::Endless => {
                        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                        let stream = futures::stream::unfold((), move |()| {
                            let chunk = chunk.clone();
                            let produced = produced.clone();
                            async move {
                                produced.fetch_add(chunk.len(), Ordering::Relaxed);
                                Some((Ok::<_, std::io::Error>(chunk), ()))
                            }
                        });
                        Response::new(Body::from_stream(stream))
                    }
                }
            }
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hooks", listener.local_addr().unwrap());
        let router = axum::Router::new().route("/hooks", axum::routing::post(handler));
        let server = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        Receiver {
            url,
            got,
            produced,
            server,
        }
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    /// The event ids received, in order.
    fn event_ids(&self) -> Vec<String> {
        self.got()
            .iter()
            .map(|g| {
                serde_json::from_slice::<Value>(&g.body).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    async fn until_got(&self, n: usize, within: Duration) {
        until(within, &format!("{n} deliveries received"), || async {
            self.got().len() >= n
        })
        .await;
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl TestApp {
    async fn create_endpoint(&self, key: Option<&str>, body: &Value) -> Answer {
        let mut request = self
            .client
            .post(self.url("/v1/webhook_endpoints"))
            .bearer_auth(&self.api_key)
            .json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        Answer::of(request.send().await.unwrap()).await
    }

    /// A new endpoint at `url` for `events`; returns its id and secret.
    async fn endpoint(&self, url: &str, events: &[&str]) -> (String, String) {
        let created = self
            .create_endpoint(None, &json!({"url": url, "enabled_events": events}))
            .await;
        assert_eq!(created.status, 201, "{:?}", created.body);
        let body = created.json();
        (
            body["id"].as_str().unwrap().to_owned(),
            body["secret"].as_str().unwrap().to_owned(),
        )
    }

    async fn endpoints(&self) -> i64 {
        self.count("SELECT count(*) FROM webhook_endpoints").await
    }

    /// The statuses of every delivery, oldest first.
    async fn delivery_statuses(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT status FROM webhook_deliveries ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    async fn event_of(&self, object_id: &str, kind: &str) -> String {
        sqlx::query_scalar("SELECT id FROM events WHERE object_id = $1 AND type = $2")
            .bind(object_id)
            .bind(kind)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn deliveries_of(&self, event_id: &str) -> Value {
        let answer = Answer::of(self.get(&format!("/v1/events/{event_id}/deliveries")).await).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        answer.json()
    }
}

#[tokio::test]
async fn creating_an_endpoint_shows_its_secret_once_and_a_retry_replays_the_same_endpoint() {
    let app = spawn_app_with(fast()).await;
    let body = json!({"url": "https://example.com/hooks", "enabled_events": ["charge.succeeded"], "description": "orders"});
    let first = app.create_endpoint(Some("we-1"), &body).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let created = first.json();
    let id = created["id"].as_str().unwrap();
    assert!(id.starts_with("we_") && id.len() == 27, "{id}");
    assert!(created["secret"].as_str().unwrap().starts_with("whsec_"));
    assert_eq!(created["object"], "webhook_endpoint");
    assert_eq!(created["status"], "enabled");
    assert_eq!(
        first.header("location"),
        Some(&*format!("/v1/webhook_endpoints/{id}"))
    );

    let again = app.create_endpoint(Some("we-1"), &body).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "the same bytes, the same secret");
    assert_eq!(app.endpoints().await, 1);

    let shown = Answer::of(app.get(&format!("/v1/webhook_endpoints/{id}")).await).await;
    assert_eq!(shown.status, 200);
    let shown = shown.json();
    assert!(shown.get("secret").is_none(), "{shown}");
    assert_eq!(shown["url"], "https://example.com/hooks");
    assert_eq!(shown["description"], "orders");
    let list = Answer::of(app.get("/v1/webhook_endpoints").await)
        .await
        .json();
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    assert!(list["data"][0].get("secret").is_none());

    let reused = app
        .create_endpoint(
            Some("we-1"),
            &json!({"url": "https://example.com/other", "enabled_events": ["*"]}),
        )
        .await;
    reused.assert_problem(422, "idempotency_key_reused");

    let other = app.other_merchant().await;
    let foreign = Answer::of(
        app.client
            .get(app.url(&format!("/v1/webhook_endpoints/{id}")))
            .bearer_auth(&other)
            .send()
            .await
            .unwrap(),
    )
    .await;
    foreign.assert_problem(404, "resource_missing");
}

#[tokio::test]
async fn fifty_concurrent_creates_with_one_key_make_one_endpoint() {
    let app = Arc::new(spawn_app_with(fast()).await);
    let body = json!({"url": "https://example.com/hooks", "enabled_events": ["*"]});
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (app, body) = (app.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            app.create_endpoint(Some("one-key"), &body).await
        }));
    }
    // The claim, the endpoint and the answer commit together, so a racing
    // request waits for that commit and replays it: never a 409.
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert!(
        answers.iter().all(|a| a.status == 201),
        "every answer a 201"
    );
    assert_eq!(answers.iter().filter(|a| a.replayed()).count(), 49);
    assert!(
        answers.iter().all(|a| a.body == answers[0].body),
        "the same endpoint, the same secret"
    );
    assert_eq!(app.endpoints().await, 1);
}

#[tokio::test]
async fn bad_endpoint_parameters_are_refused_and_write_nothing() {
    let app = spawn_app_with(fast()).await;
    for (body, code, param) in [
        (
            json!({"url": "ftp://example.com/x", "enabled_events": ["*"]}),
            "url_invalid",
            "url",
        ),
        (
            json!({"url": "not a url", "enabled_events": ["*"]}),
            "url_invalid",
            "url",
        ),
        (
            json!({"url": "https://example.com", "enabled_events": ["charge.nope"]}),
            "invalid_event_type",
            "enabled_events",
        ),
        (
            json!({"url": "https://example.com"}),
            "parameter_missing",
            "enabled_events",
        ),
        (json!({"enabled_events": ["*"]}), "parameter_missing", "url"),
        (
            json!({"url": "https://example.com", "enabled_events": ["*"], "colour": "red"}),
            "parameter_unknown",
            "colour",
        ),
        (
            json!({"url": 7, "enabled_events": ["*"]}),
            "parameter_invalid_type",
            "url",
        ),
    ] {
        let answer = app.create_endpoint(Some("bad"), &body).await;
        answer.assert_problem(400, code);
        assert_eq!(answer.json()["param"], param, "{body}");
    }
    assert_eq!(app.endpoints().await, 0);
    assert_eq!(app.keys().await, 0, "a refused request leaves its key free");
    // A form, with the list spelled as curl users write it.
    let form = app
        .client
        .post(app.url("/v1/webhook_endpoints"))
        .bearer_auth(&app.api_key)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("url=https://example.com/h&enabled_events[]=charge.succeeded&enabled_events[]=charge.failed")
        .send()
        .await
        .unwrap();
    let form = Answer::of(form).await;
    assert_eq!(form.status, 201, "{:?}", form.body);
    assert_eq!(
        form.json()["enabled_events"],
        json!(["charge.failed", "charge.succeeded"])
    );
}

#[tokio::test]
async fn an_endpoint_enables_stripes_refund_types_and_refuses_refund_succeeded() {
    let app = spawn_app_with(fast()).await;
    let stripes = [
        "charge.refund.updated",
        "refund.created",
        "refund.failed",
        "refund.updated",
    ];
    let body = json!({"url": "https://example.com/r", "enabled_events": stripes});
    let created = app.create_endpoint(None, &body).await;
    assert_eq!(created.status, 201, "{:?}", created.body);
    assert_eq!(created.json()["enabled_events"], json!(stripes));
    let old = json!({"url": "https://example.com/r", "enabled_events": ["refund.succeeded"]});
    let refused = app.create_endpoint(None, &old).await;
    refused.assert_problem(400, "invalid_event_type");
    assert_eq!(refused.json()["param"], "enabled_events");
    assert_eq!(app.endpoints().await, 1);
}

#[tokio::test]
async fn a_merchant_has_at_most_sixteen_endpoints_even_when_twenty_are_created_at_once() {
    let app = Arc::new(spawn_app_with(fast()).await);
    let mut tasks = Vec::new();
    for n in 0..20 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({"url": format!("https://example.com/{n}"), "enabled_events": ["*"]});
            app.create_endpoint(Some(&format!("key-{n}")), &body).await
        }));
    }
    let (mut created, mut refused) = (0, 0);
    for task in tasks {
        let answer = task.await.unwrap();
        if answer.status == 201 {
            created += 1;
        } else {
            answer.assert_problem(400, "webhook_endpoint_limit");
            refused += 1;
        }
    }
    assert_eq!((created, refused), (16, 4));
    assert_eq!(app.endpoints().await, 16);
}

#[tokio::test]
async fn each_event_is_delivered_signed_to_each_endpoint_that_enabled_its_type() {
    let app = spawn_app_with(fast()).await;
    let charges = Receiver::start(&[Reply::Status(200)]).await;
    let refunds = Receiver::start(&[Reply::Status(204)]).await;
    let (_, charge_secret) = app.endpoint(&charges.url, &["charge.succeeded"]).await;
    let (_, refund_secret) = app.endpoint(&refunds.url, &["refund.created"]).await;
    let charge = app.paid_charge(1000).await;
    let refund = Answer::of(
        app.post_refund(None, &json!({"charge": charge, "amount": 400}))
            .await,
    )
    .await;
    assert_eq!(refund.status, 201);
    let refund_id = refund.json()["id"].as_str().unwrap().to_owned();
    charges.until_got(1, Duration::from_secs(10)).await;
    refunds.until_got(1, Duration::from_secs(10)).await;
    until(
        Duration::from_secs(10),
        "both deliveries recorded",
        || async { app.delivery_statuses().await == ["succeeded", "succeeded"] },
    )
    .await;

    let now = chrono::Utc::now().timestamp();
    let got = &charges.got()[0];
    signature::verify(Some(&got.signature), &got.body, &charge_secret, now, 300)
        .expect("signed with the endpoint's secret");
    assert!(
        signature::verify(Some(&got.signature), &got.body, &refund_secret, now, 300).is_err(),
        "and with no other"
    );
    let delivered: Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(delivered["type"], "charge.succeeded");
    assert_eq!(delivered["data"]["object"]["id"], charge);
    let event = app.event_of(&charge, "charge.succeeded").await;
    let stored = Answer::of(app.get(&format!("/v1/events/{event}")).await)
        .await
        .json();
    assert_eq!(delivered["id"], stored["id"]);
    assert_eq!(delivered["data"], stored["data"]);
    assert_eq!(stored["pending_webhooks"], 1, "one delivery, as written");

    let got = &refunds.got()[0];
    signature::verify(Some(&got.signature), &got.body, &refund_secret, now, 300).unwrap();
    let delivered: Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(delivered["type"], "refund.created");
    assert_eq!(delivered["data"]["object"]["id"], refund_id);
    // Nothing else: charge.refunded went to no endpoint.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!((charges.got().len(), refunds.got().len()), (1, 1));
    assert_eq!(
        app.count("SELECT count(*) FROM webhook_deliveries").await,
        2
    );
}

#[tokio::test]
async fn a_failing_receiver_is_retried_with_backoff_until_it_answers_2xx() {
    let app = spawn_app_with(fast()).await;
    let receiver =
        Receiver::start(&[Reply::Status(500), Reply::Status(503), Reply::Status(200)]).await;
    app.endpoint(&receiver.url, &["*"]).await;
    let charge = app.paid_charge(500).await;
    receiver.until_got(3, Duration::from_secs(10)).await;
    let event = app.event_of(&charge, "charge.succeeded").await;
    assert_eq!(
        receiver.event_ids(),
        [event.clone(), event.clone(), event.clone()]
    );
    let got = receiver.got();
    // 100 ms doubled, jittered to at least half: >= 50 ms, then >= 100 ms.
    assert!(got[1].at - got[0].at >= Duration::from_millis(50));
    assert!(got[2].at - got[1].at >= Duration::from_millis(100));
    until(
        Duration::from_secs(10),
        "the delivery is recorded",
        || async { app.delivery_statuses().await == ["succeeded"] },
    )
    .await;
    let deliveries = app.deliveries_of(&event).await;
    let delivery = &deliveries["data"][0];
    assert_eq!(delivery["status"], "succeeded");
    assert_eq!(delivery["attempt_count"], 3);
    assert_eq!(delivery["next_attempt"], Value::Null);
    let statuses: Vec<_> = delivery["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["response_status"].clone(), a["error"].clone()))
        .collect();
    assert_eq!(
        statuses,
        [
            (json!(500), json!("HTTP 500")),
            (json!(503), json!("HTTP 503")),
            (json!(200), Value::Null)
        ]
    );
}

#[tokio::test]
async fn a_delivery_that_never_succeeds_ends_failed_after_the_last_attempt() {
    let app = spawn_app_with(fast().set("WEBHOOK_MAX_ATTEMPTS", "3")).await;
    let receiver = Receiver::start(&[Reply::Status(503)]).await;
    app.endpoint(&receiver.url, &["charge.succeeded"]).await;
    let charge = app.paid_charge(500).await;
    until(Duration::from_secs(10), "the delivery ends", || async {
        app.delivery_statuses().await == ["failed"]
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(receiver.got().len(), 3, "three attempts, no fourth");
    let event = app.event_of(&charge, "charge.succeeded").await;
    let delivery = app.deliveries_of(&event).await["data"][0].clone();
    assert_eq!(delivery["failure_reason"], "attempts_exhausted");
    assert_eq!(delivery["attempts"].as_array().unwrap().len(), 3);
    let stored = Answer::of(app.get(&format!("/v1/events/{event}")).await)
        .await
        .json();
    assert_eq!(stored["pending_webhooks"], 1, "as written, ended or not");
}

#[tokio::test]
async fn a_slow_receiver_is_cut_off_at_the_timeout_and_an_endless_answer_is_not_read() {
    let app = spawn_app_with(fast().set("WEBHOOK_TIMEOUT", "500ms")).await;
    let slow = Receiver::start(&[Reply::Slow(Duration::from_secs(30))]).await;
    let endless = Receiver::start(&[Reply::Endless]).await;
    app.endpoint(&slow.url, &["charge.succeeded"]).await;
    app.endpoint(&endless.url, &["charge.succeeded"]).await;
    let charge = app.paid_charge(500).await;
    let event = app.event_of(&charge, "charge.succeeded").await;
    until(
        Duration::from_secs(10),
        "both first attempts recorded",
        || async {
            app.count("SELECT count(DISTINCT delivery_id) FROM webhook_attempts")
                .await
                == 2
        },
    )
    .await;
    let deliveries = app.deliveries_of(&event).await;
    for delivery in deliveries["data"].as_array().unwrap() {
        let first = &delivery["attempts"][0];
        assert!(first["duration_ms"].as_i64().unwrap() < 2_000, "{first}");
        if delivery["url"] == slow.url.as_str() {
            assert_eq!(first["error"], "timeout");
            assert_eq!(first["response_status"], Value::Null);
        } else {
            // Its status is the answer; the endless body is left unread.
            assert_eq!(delivery["status"], "succeeded", "{delivery}");
            assert_eq!(first["response_status"], 200);
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let produced = endless.produced.load(Ordering::Relaxed);
    assert!(
        produced < 16 * 1024 * 1024,
        "the worker stopped reading: {produced} bytes produced"
    );
}

#[tokio::test]
async fn a_refused_connection_is_recorded_and_retried() {
    let app = spawn_app_with(
        fast()
            .set("WEBHOOK_RETRY_BASE", "1h")
            .set("WEBHOOK_RETRY_MAX", "1h"),
    )
    .await;
    // A port that was free a moment ago and has no listener now.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    app.endpoint(&format!("http://{closed}/hooks"), &["*"])
        .await;
    let charge = app.paid_charge(500).await;
    let event = app.event_of(&charge, "charge.succeeded").await;
    until(Duration::from_secs(10), "the attempt recorded", || async {
        app.count("SELECT count(*) FROM webhook_attempts").await == 1
    })
    .await;
    let delivery = app.deliveries_of(&event).await["data"][0].clone();
    assert_eq!(delivery["status"], "pending");
    let error = delivery["attempts"][0]["error"].as_str().unwrap();
    assert!(error.starts_with("connect"), "{error}");
    let next = delivery["next_attempt"].as_i64().unwrap();
    assert!(
        next >= chrono::Utc::now().timestamp() + 25 * 60,
        "retried after backoff: {next}"
    );
}

#[tokio::test]
async fn an_endpoint_failing_every_delivery_for_the_disable_period_is_disabled() {
    let app = spawn_app_with(fast().set("WEBHOOK_DISABLE_AFTER", "1s")).await;
    let receiver = Receiver::start(&[Reply::Status(500)]).await;
    let (id, _) = app.endpoint(&receiver.url, &["*"]).await;
    app.paid_charge(500).await;
    until(
        Duration::from_secs(15),
        "the endpoint is disabled",
        || async {
            app.count("SELECT count(*) FROM webhook_endpoints WHERE status = 'disabled'")
                .await
                == 1
        },
    )
    .await;
    let shown = Answer::of(app.get(&format!("/v1/webhook_endpoints/{id}")).await)
        .await
        .json();
    assert_eq!(shown["status"], "disabled");
    assert!(
        shown["disabled_reason"]
            .as_str()
            .unwrap()
            .contains("every delivery failed")
    );
    until(Duration::from_secs(5), "its delivery ended", || async {
        app.count("SELECT count(*) FROM webhook_deliveries WHERE status = 'failed' AND failure_reason = 'endpoint_disabled'").await == 1
    })
    .await;
    let sent = receiver.got().len();
    app.paid_charge(700).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(receiver.got().len(), sent, "nothing more is sent to it");
    assert_eq!(
        app.count("SELECT count(*) FROM webhook_deliveries").await,
        1
    );
}

#[tokio::test]
async fn deleting_an_endpoint_ends_its_pending_deliveries_and_stops_new_ones() {
    let app = spawn_app_with(
        fast()
            .set("WEBHOOK_RETRY_BASE", "1h")
            .set("WEBHOOK_RETRY_MAX", "1h"),
    )
    .await;
    let receiver = Receiver::start(&[Reply::Status(500)]).await;
    let (id, _) = app.endpoint(&receiver.url, &["*"]).await;
    app.paid_charge(500).await;
    receiver.until_got(1, Duration::from_secs(10)).await;
    let deleted = Answer::of(
        app.client
            .delete(app.url(&format!("/v1/webhook_endpoints/{id}")))
            .bearer_auth(&app.api_key)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(deleted.status, 200);
    assert_eq!(
        deleted.json(),
        json!({"id": id, "object": "webhook_endpoint", "deleted": true})
    );
    until(Duration::from_secs(5), "the delivery ended", || async {
        app.delivery_statuses().await == ["failed"]
    })
    .await;
    let reason: String = sqlx::query_scalar("SELECT failure_reason FROM webhook_deliveries")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(reason, "endpoint_deleted");
    Answer::of(app.get(&format!("/v1/webhook_endpoints/{id}")).await)
        .await
        .assert_problem(404, "resource_missing");
    app.paid_charge(600).await;
    assert_eq!(
        app.count("SELECT count(*) FROM webhook_deliveries").await,
        1
    );
    let list = Answer::of(app.get("/v1/webhook_endpoints").await)
        .await
        .json();
    assert_eq!(list["data"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_on_one_database_send_each_event_once() {
    let settings = || {
        fast()
            .set("WEBHOOK_POLL_INTERVAL", "20ms")
            .set("WEBHOOK_RETRY_BASE", "1h")
            .set("WEBHOOK_RETRY_MAX", "1h")
    };
    let app = spawn_app_with(settings()).await;
    let _second = app.another_instance(settings()).await;
    let _third = app.another_instance(settings()).await;
    // A slow receiver keeps attempts in flight while the others poll.
    let receiver = Receiver::start(&[Reply::Slow(Duration::from_millis(100))]).await;
    app.endpoint(&receiver.url, &["charge.succeeded"]).await;
    let charges = 60;
    let mut tasks = Vec::new();
    let app = Arc::new(app);
    for n in 0..charges {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let answer = Answer::of(
                app.post_charge(Some(&format!("c{n}")), &visa(100 + n))
                    .await,
            )
            .await;
            assert_eq!(answer.status, 201);
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    until(Duration::from_secs(30), "every delivery ended", || async {
        app.count("SELECT count(*) FROM webhook_deliveries WHERE status = 'succeeded'")
            .await
            == charges
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut ids = receiver.event_ids();
    assert_eq!(ids.len() as i64, charges, "one request per event");
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len() as i64, charges, "no event sent twice");
    assert_eq!(
        app.count("SELECT count(*) FROM webhook_attempts").await,
        charges,
        "one attempt each"
    );
    assert_eq!(
        app.count("SELECT max(attempts)::bigint FROM webhook_deliveries")
            .await,
        1
    );
}

/// A settle that read the endpoint as enabled just before a delete
/// committed writes a delivery for a deleted endpoint; so does one racing a
/// disable. The worker sends nothing to it and ends it.
#[tokio::test]
async fn a_delivery_written_for_an_endpoint_deleted_or_disabled_meanwhile_is_never_sent() {
    let app = spawn_app_with(fast()).await;
    let receiver = Receiver::start(&[Reply::Status(200)]).await;
    let (deleted, _) = app.endpoint(&receiver.url, &["*"]).await;
    let (disabled, _) = app.endpoint(&receiver.url, &["*"]).await;
    app.paid_charge(500).await;
    receiver.until_got(2, Duration::from_secs(10)).await;
    until(Duration::from_secs(5), "both delivered", || async {
        app.delivery_statuses().await == ["succeeded", "succeeded"]
    })
    .await;
    // What the races leave behind, written directly: the endpoints gone,
    // a delivery to each still pending.
    sqlx::query("UPDATE webhook_endpoints SET status = 'deleted' WHERE id = $1")
        .bind(&deleted)
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE webhook_endpoints SET status = 'disabled', disabled_reason = 'test' WHERE id = $1",
    )
    .bind(&disabled)
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE webhook_deliveries SET status = 'pending', finished_at = NULL, next_attempt_at = now()",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    until(Duration::from_secs(5), "both ended", || async {
        app.count("SELECT count(*) FROM webhook_deliveries WHERE status = 'pending'")
            .await
            == 0
    })
    .await;
    let mut reasons: Vec<(String, String)> =
        sqlx::query_as("SELECT endpoint_id, failure_reason FROM webhook_deliveries")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    reasons.sort();
    let mut expected = vec![
        (deleted, "endpoint_deleted".to_owned()),
        (disabled, "endpoint_disabled".to_owned()),
    ];
    expected.sort();
    assert_eq!(reasons, expected);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        receiver.got().len(),
        2,
        "nothing sent after the endpoints went"
    );
}

#[tokio::test]
async fn attempts_cut_short_by_crashes_count_and_end_the_delivery_at_the_last() {
    let app = spawn_app_with(
        fast()
            .set("WEBHOOK_MAX_ATTEMPTS", "4")
            .set("WEBHOOK_POLL_INTERVAL", "1h"),
    )
    .await;
    let receiver = Receiver::start(&[Reply::Status(200)]).await;
    app.endpoint(&receiver.url, &["*"]).await;
    app.paid_charge(500).await;
    // Four attempts begun and never recorded (each sender died), and due.
    sqlx::query("UPDATE webhook_deliveries SET attempts = 4, next_attempt_at = now()")
        .execute(&app.pool)
        .await
        .unwrap();
    let worker = oncepay::webhooks::deliver::Worker::new(
        app.pool.clone(),
        oncepay::webhooks::deliver::DeliverySettings::from_config(&app.config),
    )
    .unwrap();
    assert_eq!(worker.pass().await.unwrap(), 1);
    let ended: (String, String, i32) =
        sqlx::query_as("SELECT status, failure_reason, attempts FROM webhook_deliveries")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        ended,
        ("failed".to_owned(), "attempts_exhausted".to_owned(), 4)
    );
    assert!(receiver.got().is_empty(), "no fifth attempt");
}

#[tokio::test]
async fn an_endpoint_quiet_for_days_is_not_disabled_by_its_next_single_failure() {
    let app = spawn_app_with(fast()).await;
    let receiver = Receiver::start(&[Reply::Status(500), Reply::Status(200)]).await;
    let (id, _) = app.endpoint(&receiver.url, &["*"]).await;
    // Its last run of failures ended four days ago, longer ago than
    // WEBHOOK_DISABLE_AFTER (72 h), with nothing sent since.
    sqlx::query(
        "UPDATE webhook_endpoints
            SET failing_since = now() - interval '5 days', last_failed_at = now() - interval '4 days'
          WHERE id = $1",
    )
    .bind(&id)
    .execute(&app.pool)
    .await
    .unwrap();
    app.paid_charge(500).await;
    receiver.until_got(2, Duration::from_secs(10)).await;
    until(Duration::from_secs(5), "delivered on the retry", || async {
        app.delivery_statuses().await == ["succeeded"]
    })
    .await;
    let status: String = sqlx::query_scalar("SELECT status FROM webhook_endpoints WHERE id = $1")
        .bind(&id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(status, "enabled");
}

/// A raw HTTP receiver on a free port, for answers no well-behaved server
/// gives: it reads each request whole, then does what `answer` says with
/// the connection. It counts the requests it took in.
struct RawReceiver {
    address: std::net::SocketAddr,
    requests: Arc<AtomicUsize>,
    server: tokio::task::JoinHandle<()>,
}

/// What a [`RawReceiver`] does after reading a request.
#[derive(Clone, Copy, Debug)]
enum Raw {
    /// Never answers, and holds the connection open.
    Hang,
    /// `200 OK` with `Content-Length: 100`, then nothing, the connection held.
    StalledBody,
    /// `200 OK` with `Content-Length: 100`, ten bytes, then closes.
    TruncatedBody,
    /// `200 OK`, chunked, with a chunk size that is no hex number.
    MalformedChunks,
}

impl RawReceiver {
    async fn start(answer: Raw) -> Self {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let requests = Arc::new(AtomicUsize::new(0));
        let counted = requests.clone();
        let server = tokio::spawn(async move {
            // Connections held open live as long as the receiver.
            let mut held = Vec::new();
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                if !read_request(&mut stream).await {
                    continue;
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n";
                match answer {
                    Raw::Hang => held.push(stream),
                    Raw::StalledBody => {
                        let _ = stream
                            .write_all(format!("{head}Content-Length: 100\r\n\r\n").as_bytes())
                            .await;
                        held.push(stream);
                    }
                    Raw::TruncatedBody => {
                        let _ = stream
                            .write_all(
                                format!("{head}Content-Length: 100\r\n\r\n0123456789").as_bytes(),
                            )
                            .await;
                        let _ = stream.shutdown().await;
                    }
                    Raw::MalformedChunks => {
                        let _ = stream
                            .write_all(
                                format!("{head}Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n")
                                    .as_bytes(),
                            )
                            .await;
                        let _ = stream.shutdown().await;
                    }
                }
            }
        });
        RawReceiver {
            address,
            requests,
            server,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for RawReceiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Reads one request, headers and `Content-Length` body; `false` if the
/// connection ended first.
async fn read_request(stream: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                return true;
            }
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

impl TestApp {
    /// A new endpoint for every event type at `url`, as the merchant whose
    /// key is `api_key`.
    async fn endpoint_as(&self, api_key: &str, url: &str) {
        let created = Answer::of(
            self.client
                .post(self.url("/v1/webhook_endpoints"))
                .bearer_auth(api_key)
                .json(&json!({"url": url, "enabled_events": ["*"]}))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(created.status, 201, "{:?}", created.body);
    }

    /// Attempts recorded (ended) of the deliveries to endpoints whose URL
    /// starts with `prefix`.
    async fn attempts_ended_to(&self, prefix: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM webhook_attempts a
               JOIN webhook_deliveries d ON d.id = a.delivery_id
               JOIN webhook_endpoints w ON w.id = d.endpoint_id
              WHERE starts_with(w.url, $1)",
        )
        .bind(prefix)
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

/// The hanging sends last `WEBHOOK_TIMEOUT` (10 s here); another merchant's
/// webhook must arrive while every one of them is still hanging, and the
/// merchant whose endpoints hang holds no more than its bound of senders.
#[tokio::test]
async fn one_merchants_hanging_endpoints_leave_room_for_another_merchants_webhooks() {
    let app = spawn_app_with(fast().set("WEBHOOK_TIMEOUT", "10s")).await;
    let hanging = RawReceiver::start(Raw::Hang).await;
    for n in 0..16 {
        app.endpoint(&hanging.url(&format!("/hooks/{n}")), &["*"])
            .await;
    }
    for n in 0..6 {
        app.paid_charge(100 + n).await;
    }
    until(
        Duration::from_secs(8),
        "the hanging endpoints took in as many sends as their merchant's bound",
        || async { hanging.requests() >= 8 },
    )
    .await;

    let other = app.other_merchant().await;
    let receiver = Receiver::start(&[Reply::Status(200)]).await;
    app.endpoint_as(&other, &receiver.url).await;
    let charge = Answer::of(app.post_charge_as(&other, None, &visa(700)).await).await;
    assert_eq!(charge.status, 201);
    receiver.until_got(1, Duration::from_secs(8)).await;
    assert_eq!(
        app.attempts_ended_to(&hanging.url("/")).await,
        0,
        "delivered while every hanging send was still hanging"
    );
    assert_eq!(
        hanging.requests(),
        8,
        "the merchant held WEBHOOK_MERCHANT_CONCURRENCY senders, no more"
    );
}

#[tokio::test]
async fn a_hanging_endpoint_holds_at_most_its_bound_and_its_merchants_other_endpoint_still_receives()
 {
    let app = spawn_app_with(
        fast()
            .set("WEBHOOK_TIMEOUT", "10s")
            .set("WEBHOOK_ENDPOINT_CONCURRENCY", "2"),
    )
    .await;
    let hanging = RawReceiver::start(Raw::Hang).await;
    let receiver = Receiver::start(&[Reply::Status(200)]).await;
    app.endpoint(&hanging.url("/hooks"), &["*"]).await;
    app.endpoint(&receiver.url, &["*"]).await;
    for n in 0..5 {
        app.paid_charge(100 + n).await;
    }
    receiver.until_got(5, Duration::from_secs(8)).await;
    assert_eq!(app.attempts_ended_to(&hanging.url("/")).await, 0);
    assert_eq!(
        hanging.requests(),
        2,
        "WEBHOOK_ENDPOINT_CONCURRENCY sends to the hanging endpoint, no more"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_bounds_hold_over_several_instances_sharing_one_database() {
    let settings = || {
        fast()
            .set("WEBHOOK_POLL_INTERVAL", "20ms")
            .set("WEBHOOK_TIMEOUT", "10s")
            .set("WEBHOOK_MERCHANT_CONCURRENCY", "3")
    };
    let app = spawn_app_with(settings()).await;
    let _second = app.another_instance(settings()).await;
    let _third = app.another_instance(settings()).await;
    let hanging = RawReceiver::start(Raw::Hang).await;
    for n in 0..4 {
        app.endpoint(&hanging.url(&format!("/hooks/{n}")), &["*"])
            .await;
    }
    for n in 0..4 {
        app.paid_charge(100 + n).await;
    }
    until(Duration::from_secs(8), "three sends hang", || async {
        hanging.requests() >= 3
    })
    .await;
    // Three workers polling every 20 ms: fifty polls each, and sixteen
    // deliveries due.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(app.attempts_ended_to(&hanging.url("/")).await, 0);
    assert_eq!(
        hanging.requests(),
        3,
        "three instances together held WEBHOOK_MERCHANT_CONCURRENCY sends"
    );
}

#[tokio::test]
async fn a_2xx_whose_body_stalls_ends_short_or_breaks_its_chunks_is_delivered_at_the_first_attempt()
{
    let app = spawn_app_with(
        fast()
            .set("WEBHOOK_TIMEOUT", "5s")
            .set("WEBHOOK_MAX_ATTEMPTS", "2"),
    )
    .await;
    let stalled = RawReceiver::start(Raw::StalledBody).await;
    let truncated = RawReceiver::start(Raw::TruncatedBody).await;
    let malformed = RawReceiver::start(Raw::MalformedChunks).await;
    for receiver in [&stalled, &truncated, &malformed] {
        app.endpoint(&receiver.url("/hooks"), &["charge.succeeded"])
            .await;
    }
    let charge = app.paid_charge(500).await;
    let event = app.event_of(&charge, "charge.succeeded").await;
    until(
        Duration::from_secs(15),
        "the three deliveries end",
        || async {
            app.count("SELECT count(*) FROM webhook_deliveries WHERE status <> 'pending'")
                .await
                == 3
        },
    )
    .await;
    let deliveries = app.deliveries_of(&event).await;
    for delivery in deliveries["data"].as_array().unwrap() {
        assert_eq!(delivery["status"], "succeeded", "{delivery}");
        assert_eq!(delivery["attempt_count"], 1, "{delivery}");
        let attempt = &delivery["attempts"][0];
        assert_eq!(attempt["response_status"], 200, "{delivery}");
        assert_eq!(attempt["error"], Value::Null, "{delivery}");
        // The stalled body is waited for briefly, never for the timeout.
        assert!(
            attempt["duration_ms"].as_i64().unwrap() < 4_000,
            "{delivery}"
        );
    }
    for receiver in [&stalled, &truncated, &malformed] {
        assert_eq!(receiver.requests(), 1, "sent once");
    }
}

/// One series of `/metrics`, summed over the lines whose labels include
/// every one of `labels`.
async fn metric(app: &TestApp, name: &str, labels: &[&str]) -> f64 {
    let text = app
        .client
        .get(app.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The recorder is shared by the tests of this binary, so the count is
/// read as a rise of at least this test's own deliveries.
#[tokio::test]
async fn deleting_an_endpoint_counts_the_deliveries_it_ends_in_the_metrics() {
    let app = spawn_app_with(
        fast()
            .set("WEBHOOK_RETRY_BASE", "1h")
            .set("WEBHOOK_RETRY_MAX", "1h"),
    )
    .await;
    let receiver = Receiver::start(&[Reply::Status(500)]).await;
    let (id, _) = app.endpoint(&receiver.url, &["charge.succeeded"]).await;
    for n in 0..5 {
        app.paid_charge(100 + n).await;
    }
    receiver.until_got(5, Duration::from_secs(10)).await;
    until(Duration::from_secs(5), "five attempts recorded", || async {
        app.count("SELECT count(*) FROM webhook_attempts").await == 5
    })
    .await;
    let series = ["outcome=\"failed\"", "reason=\"endpoint_deleted\""];
    let before = metric(&app, "webhook_deliveries_total", &series).await;
    let deleted = app
        .client
        .delete(app.url(&format!("/v1/webhook_endpoints/{id}")))
        .bearer_auth(&app.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    assert_eq!(app.delivery_statuses().await, ["failed"; 5]);
    let after = metric(&app, "webhook_deliveries_total", &series).await;
    assert!(
        after - before >= 5.0,
        "five deliveries ended by the delete: {before} then {after}"
    );
}

#[tokio::test]
async fn every_copy_of_an_event_sent_is_byte_for_byte_what_get_shows() {
    let app = spawn_app_with(fast()).await;
    let flaky = Receiver::start(&[Reply::Status(500), Reply::Status(200)]).await;
    let steady = Receiver::start(&[Reply::Status(200)]).await;
    app.endpoint(&flaky.url, &["charge.succeeded"]).await;
    app.endpoint(&steady.url, &["charge.succeeded"]).await;
    let charge = app.paid_charge(500).await;
    flaky.until_got(2, Duration::from_secs(10)).await;
    steady.until_got(1, Duration::from_secs(10)).await;
    until(Duration::from_secs(10), "both delivered", || async {
        app.delivery_statuses().await == ["succeeded", "succeeded"]
    })
    .await;
    let event = app.event_of(&charge, "charge.succeeded").await;
    let shown = Answer::of(app.get(&format!("/v1/events/{event}")).await).await;
    assert_eq!(shown.status, 200);
    let copies: Vec<Bytes> = flaky
        .got()
        .into_iter()
        .chain(steady.got())
        .map(|g| g.body)
        .collect();
    assert_eq!(copies.len(), 3);
    for copy in &copies {
        assert_eq!(
            copy,
            &shown.body,
            "a copy sent, then what GET shows:\n{}\n{}",
            String::from_utf8_lossy(copy),
            String::from_utf8_lossy(&shown.body)
        );
    }
    assert_eq!(shown.json()["pending_webhooks"], 2);
    app.until_listed().await;
    let listed = Answer::of(app.get("/v1/events?limit=1").await).await.json();
    assert_eq!(
        listed["data"][0],
        shown.json(),
        "and the list shows it so too"
    );
}

// The address guard. Every receiver here listens on loopback; the other
// ranges are judged by the classifying function's own unit tests, with no
// connection (`src/webhooks/guard.rs`).

/// The guard on (the default), with fast retries.
fn guarded() -> Settings {
    fast().set("WEBHOOK_ALLOW_PRIVATE", "false")
}

/// `url` with its host replaced by `host`, port and path kept.
fn on_host(url: &str, host: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_host(Some(host)).unwrap();
    url.to_string()
}

impl TestApp {
    /// Stores an endpoint at `url` for `charge.succeeded` directly, as one
    /// created while the guard was off would be; returns its id.
    async fn stored_endpoint(&self, url: &str) -> String {
        let id = oncepay::webhooks::domain::new_endpoint_id();
        sqlx::query(
            "INSERT INTO webhook_endpoints (id, merchant_id, url, enabled_events, secret)
             VALUES ($1, $2, $3, ARRAY['charge.succeeded'], $4)",
        )
        .bind(&id)
        .bind(self.merchant_id)
        .bind(url)
        .bind(oncepay::webhooks::domain::new_secret())
        .execute(&self.pool)
        .await
        .unwrap();
        id
    }
}

#[tokio::test]
async fn with_the_guard_on_an_endpoint_on_loopback_or_a_name_resolving_to_it_is_refused_at_creation()
 {
    let app = spawn_app_with(guarded()).await;
    let receiver = Receiver::start(&[Reply::Status(200)]).await;
    let port = url::Url::parse(&receiver.url).unwrap().port().unwrap();
    for (url, says) in [
        (receiver.url.clone(), "the host is a loopback address"),
        (
            on_host(&receiver.url, "localhost"),
            "the host resolves to a loopback address",
        ),
        (
            format!("http://[::1]:{port}/hooks"),
            "the host is a loopback address",
        ),
        (
            format!("http://[::ffff:127.0.0.1]:{port}/hooks"),
            "the host is a loopback address",
        ),
        // 127.0.0.1 written as one number, as a URL parser reads it.
        (
            format!("http://2130706433:{port}/hooks"),
            "the host is a loopback address",
        ),
        (
            format!("http://0.0.0.0:{port}/hooks"),
            "the host is the unspecified address",
        ),
    ] {
        let answer = app
            .create_endpoint(
                Some(&format!("guard-{url}")),
                &json!({"url": url, "enabled_events": ["charge.succeeded"]}),
            )
            .await;
        answer.assert_problem(400, "url_invalid");
        let body = answer.json();
        assert_eq!(body["param"], "url", "{body}");
        let message = body["detail"].as_str().unwrap();
        assert!(message.contains(says), "{url}: {message}");
    }
    assert_eq!(app.endpoints().await, 0, "nothing written");
    assert_eq!(app.keys().await, 0, "no key claimed for a refused create");
    // A public address is accepted (written as an address, it is not looked
    // up, and no event is made, so nothing is sent to it).
    let public = app
        .create_endpoint(
            None,
            &json!({"url": "https://93.184.215.14/hooks", "enabled_events": ["charge.succeeded"]}),
        )
        .await;
    assert_eq!(public.status, 201, "{:?}", public.body);
    assert_eq!(app.endpoints().await, 1);
    assert!(receiver.got().is_empty());
}

#[tokio::test]
async fn with_the_guard_on_a_stored_loopback_endpoint_gets_nothing_and_each_attempt_is_recorded_refused()
 {
    let app = spawn_app_with(guarded().set("WEBHOOK_MAX_ATTEMPTS", "3")).await;
    let receiver = Receiver::start(&[Reply::Status(200)]).await;
    // One address that is never looked up, one name the resolver refuses.
    let literal = app.stored_endpoint(&receiver.url).await;
    let named = app
        .stored_endpoint(&on_host(&receiver.url, "localhost"))
        .await;
    let before = metric(&app, "webhook_attempts_total", &["result=\"refused\""]).await;
    let charge = app.paid_charge(500).await;
    let event = app.event_of(&charge, "charge.succeeded").await;
    until(Duration::from_secs(15), "both deliveries end", || async {
        app.delivery_statuses().await == ["failed", "failed"]
    })
    .await;
    assert!(receiver.got().is_empty(), "nothing reached the receiver");
    let deliveries = app.deliveries_of(&event).await;
    for delivery in deliveries["data"].as_array().unwrap() {
        let says = if delivery["webhook_endpoint"] == literal.as_str() {
            "address not allowed: the host is a loopback address"
        } else {
            assert_eq!(delivery["webhook_endpoint"], named.as_str());
            "address not allowed: the host resolves to a loopback address"
        };
        assert_eq!(
            delivery["failure_reason"], "attempts_exhausted",
            "{delivery}"
        );
        let attempts = delivery["attempts"].as_array().unwrap();
        assert_eq!(attempts.len(), 3, "retried like any failure: {delivery}");
        for attempt in attempts {
            assert_eq!(attempt["response_status"], Value::Null, "{attempt}");
            assert_eq!(attempt["error"], says, "{attempt}");
        }
    }
    // The stored errors carry neither the URL nor its port.
    let port = url::Url::parse(&receiver.url).unwrap().port().unwrap();
    assert_eq!(
        app.count(&format!(
            "SELECT count(*) FROM webhook_attempts WHERE error LIKE '%{port}%' OR error LIKE '%/hooks%'"
        ))
        .await,
        0
    );
    let after = metric(&app, "webhook_attempts_total", &["result=\"refused\""]).await;
    assert!(after - before >= 6.0, "{before} -> {after}");
}

#[tokio::test]
async fn with_the_guard_off_the_same_loopback_endpoints_are_created_and_delivered() {
    let app = spawn_app_with(fast()).await;
    let receiver = Receiver::start(&[Reply::Status(200)]).await;
    app.endpoint(&receiver.url, &["charge.succeeded"]).await;
    app.endpoint(&on_host(&receiver.url, "localhost"), &["charge.succeeded"])
        .await;
    app.paid_charge(500).await;
    receiver.until_got(2, Duration::from_secs(10)).await;
    until(
        Duration::from_secs(10),
        "both deliveries succeed",
        || async { app.delivery_statuses().await == ["succeeded", "succeeded"] },
    )
    .await;
    assert_eq!(
        app.count("SELECT count(*) FROM webhook_attempts WHERE error IS NOT NULL")
            .await,
        0
    );
}
