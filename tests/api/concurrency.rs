//! Races on one key over real HTTP: one effect, whatever the interleaving.

use futures::future::join_all;
use oncepay::merchants::{self, ApiKey};

use crate::helpers::{Answer, Settings, spawn_app_with, visa};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_identical_requests_create_one_charge_and_one_payment() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 300)).await;
    let requests = (0..50)
        .map(|_| async { Answer::of(app.post_charge(Some("storm"), &visa(2000)).await).await });
    let answers = join_all(requests).await;

    let originals: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 201 && !a.replayed())
        .collect();
    assert_eq!(originals.len(), 1, "exactly one request did the work");
    for answer in &answers {
        match answer.status {
            201 => assert_eq!(answer.body, originals[0].body, "a replay of the one charge"),
            409 => {
                answer.assert_problem(409, "idempotency_key_in_use");
                assert_eq!(answer.header("retry-after"), Some("1"));
            }
            other => panic!("unexpected status {other}: {:?}", answer.body),
        }
    }
    assert!(
        answers.iter().any(|a| a.status == 409),
        "the race really overlapped"
    );
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
    assert_eq!(app.processor_operations().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_requests_with_distinct_keys_create_fifty_charges() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 50)).await;
    let requests = (0..50).map(|i| {
        let app = &app;
        async move {
            app.post_charge(Some(&format!("key-{i}")), &visa(100 + i))
                .await
                .status()
        }
    });
    let statuses = join_all(requests).await;
    assert!(statuses.iter().all(|s| s.as_u16() == 201), "{statuses:?}");
    assert_eq!(app.charges().await, 50);
    assert_eq!(app.payments().await, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_gets_409_with_retry_after() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 1000)).await;
    let body = visa(2000);
    let first = app.post_charge(Some("slow"), &body);
    let second = async {
        app.until_in_flight("slow").await;
        Answer::of(app.post_charge(Some("slow"), &visa(2000)).await).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status(), 201);
    second.assert_problem(409, "idempotency_key_in_use");
    assert_eq!(second.header("retry-after"), Some("1"));
    assert_eq!(app.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_request_in_flight_with_the_same_key_is_422() {
    // A changed request in flight is a misuse of the key, not a wait.
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 1000)).await;
    let body = visa(2000);
    let first = app.post_charge(Some("slow"), &body);
    let second = async {
        app.until_in_flight("slow").await;
        Answer::of(app.post_charge(Some("slow"), &visa(9999)).await).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status(), 201);
    second.assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_wait_replays_the_first_result_instead_of_409() {
    let app = spawn_app_with(Settings::new().set("PROCESSOR_LATENCY_MS", 1500)).await;
    let first = async { Answer::of(app.post_charge(Some("patient"), &visa(2000)).await).await };
    let second = async {
        // The first request has claimed the key and is at the processor
        // (for 1.5 s: time enough for this one to find it there).
        app.until_in_flight("patient").await;
        let response = app
            .client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header("Idempotency-Key", "patient")
            .header("Prefer", "wait=5")
            .json(&visa(2000))
            .send()
            .await
            .unwrap();
        Answer::of(response).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.status, 201);
    assert_eq!(second.status, 201);
    assert!(second.replayed());
    assert_eq!(
        second.header("preference-applied"),
        Some("wait"),
        "the answer came after a wait"
    );
    assert_eq!(second.body, first.body);
    assert_eq!(app.charges().await, 1);
    assert_eq!(app.payments().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensuring_the_demo_merchant_from_many_tasks_at_once_makes_one() {
    let app = spawn_app_with(Settings::new()).await;
    let key = ApiKey::generate();
    let tasks = (0..20).map(|_| merchants::ensure(&app.pool, "demo", &key));
    let merchants = join_all(tasks).await;
    let ids: std::collections::HashSet<_> = merchants
        .into_iter()
        .map(|m| m.unwrap().merchant().id)
        .collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(
        app.count("SELECT count(*) FROM merchants WHERE name = 'demo'")
            .await,
        1
    );
}

/// With no replay cache, every replay reads its key from the database; the
/// reads of concurrent requests go out together, several keys to one
/// statement. Each request must still get its own key's answer, and no
/// replay may charge again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replays_read_in_shared_batches_each_get_their_own_keys_answer() {
    let app = spawn_app_with(Settings::new().set("REPLAY_CACHE_BYTES", 0)).await;
    let keys: Vec<String> = (0..30).map(|i| format!("batch-{i}")).collect();
    let created = join_all(keys.iter().enumerate().map(|(i, key)| {
        let app = &app;
        async move { Answer::of(app.post_charge(Some(key), &visa(1000 + i as i64)).await).await }
    }))
    .await;
    for answer in &created {
        assert_eq!(answer.status, 201, "{:?}", answer.body);
        assert!(!answer.replayed());
    }
    // Every key three times over, all at once, in an order that mixes them.
    let replays = join_all((0..90).map(|n| {
        let (app, at) = (&app, (n * 7) % keys.len());
        let key = &keys[at];
        async move {
            let answer = Answer::of(app.post_charge(Some(key), &visa(1000 + at as i64)).await);
            (at, answer.await)
        }
    }))
    .await;
    for (at, replay) in &replays {
        assert_eq!(replay.status, 201, "{:?}", replay.body);
        assert!(replay.replayed(), "key {at} replayed");
        assert_eq!(
            replay.body, created[*at].body,
            "key {at} got its own answer"
        );
    }
    // A key reused with other parameters is still told so.
    Answer::of(app.post_charge(Some("batch-3"), &visa(9999)).await)
        .await
        .assert_problem(422, "idempotency_key_reused");
    assert_eq!(app.charges().await, 30);
}

/// One statement reads many keys: each found key comes back with its place
/// among those asked, a key asked twice comes back twice, and a key that
/// does not exist, or is another merchant's, does not come back.
#[tokio::test]
async fn a_batch_of_key_reads_answers_each_by_its_place_in_the_batch() {
    let app = spawn_app_with(Settings::new()).await;
    for key in ["a", "b"] {
        let answer = Answer::of(app.post_charge(Some(key), &visa(2000)).await).await;
        assert_eq!(answer.status, 201);
    }
    let other = uuid::Uuid::now_v7();
    let merchants = [
        app.merchant_id,
        app.merchant_id,
        other,
        app.merchant_id,
        app.merchant_id,
    ];
    let keys = ["b", "missing", "a", "a", "b"];
    let found = oncepay_core::idempotency::store::find_many(
        &app.pool,
        &merchants,
        &keys,
        std::time::Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut places: Vec<(usize, String)> = found.into_iter().map(|(at, k)| (at, k.key)).collect();
    places.sort();
    assert_eq!(
        places,
        vec![
            (0, "b".to_owned()),
            (3, "a".to_owned()),
            (4, "b".to_owned())
        ]
    );
}
