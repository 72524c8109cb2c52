//! Per-merchant rate limits: the excess is `429 rate_limit` before anything
//! is written, and one merchant's excess leaves another untouched.

use std::time::{Duration, Instant};

use futures::future::join_all;

use crate::helpers::{Answer, Settings, TestApp, spawn_app_with, visa};

/// Asserts a `429 rate_limit` with its headers; returns its `Retry-After`.
#[track_caller]
fn assert_rate_limited(answer: &Answer) -> u64 {
    answer.assert_problem(429, "rate_limit");
    assert_eq!(answer.header("stripe-should-retry"), Some("true"));
    assert_eq!(answer.json()["error"]["code"], "rate_limit");
    let retry_after: u64 = answer
        .header("retry-after")
        .expect("a Retry-After")
        .parse()
        .expect("whole seconds");
    assert!(retry_after >= 1, "{retry_after}");
    retry_after
}

async fn charges_of(app: &TestApp, api_key: &str) -> i64 {
    app.count(&format!(
        "SELECT count(*) FROM charges c JOIN merchants m ON m.id = c.merchant_id \
         WHERE m.api_key_hash = sha256('{api_key}'::bytea)"
    ))
    .await
}

#[tokio::test]
async fn a_merchant_over_its_limit_gets_429s_writes_nothing_for_them_and_leaves_another_untouched()
{
    // Ten at once, then two a second: sixty racing charges from A are far
    // over it, eight from B are within B's own allowance.
    let app = spawn_app_with(
        Settings::new()
            .set("RATE_LIMIT_PER_SECOND", 2)
            .set("RATE_LIMIT_BURST", 10),
    )
    .await;
    let b = app.other_merchant().await;
    let app = &app;
    let started = Instant::now();
    let from_a = join_all((0..60).map(|i| {
        let key = format!("a-{i}");
        async move {
            let answer = Answer::of(app.post_charge(Some(&key), &visa(1000 + i)).await).await;
            (key, answer)
        }
    }));
    let from_b = join_all((0..8).map(|i| {
        let b = &b;
        async move {
            Answer::of(
                app.post_charge_as(b, Some(&format!("b-{i}")), &visa(500 + i))
                    .await,
            )
            .await
        }
    }));
    let (from_a, from_b) = tokio::join!(from_a, from_b);
    let elapsed = started.elapsed();

    let mut refused = Vec::new();
    let mut charged = 0;
    for (key, answer) in &from_a {
        match answer.status {
            201 => charged += 1,
            429 => {
                assert_rate_limited(answer);
                refused.push(key.clone());
            }
            other => panic!("{key}: {other} {:?}", answer.body),
        }
    }
    // The burst, plus what came back at two a second while they ran.
    let allowed = 10 + 2 * elapsed.as_secs() as usize + 2;
    assert!(
        charged >= 10 && charged <= allowed,
        "{charged} charged in {elapsed:?}"
    );
    assert_eq!(charged + refused.len(), 60);
    // Nothing written for a refused request: no charge, no key, no payment.
    assert_eq!(charges_of(app, &app.api_key).await, charged as i64);
    let refused_keys_stored = app
        .count(&format!(
            "SELECT count(*) FROM idempotency_keys WHERE key = ANY(ARRAY['{}'])",
            refused.join("','")
        ))
        .await;
    assert_eq!(refused_keys_stored, 0);
    assert_eq!(app.payments().await, charged as i64 + 8);

    for answer in &from_b {
        assert_eq!(answer.status, 201, "B: {:?}", answer.body);
    }
    assert_eq!(charges_of(app, &b).await, 8);

    // Reads draw on their own allowance.
    let list = Answer::of(app.get("/v1/charges").await).await;
    assert_eq!(list.status, 200, "{:?}", list.body);

    let metrics = Answer::of(app.client.get(app.url("/metrics")).send().await.unwrap()).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("rate_limited_total{kind=\"write\"}") && !l.ends_with(" 0")),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_replay_counts_like_any_request_and_a_retry_after_retry_after_succeeds() {
    let app = spawn_app_with(
        Settings::new()
            .set("RATE_LIMIT_PER_SECOND", 1)
            .set("RATE_LIMIT_BURST", 2),
    )
    .await;
    let first = Answer::of(app.post_charge(Some("k"), &visa(2000)).await).await;
    assert_eq!(first.status, 201);
    // Replays until one is refused: the burst is two, and a token comes
    // back each second (more than one may, on a slow machine).
    let mut refused = None;
    for _ in 0..20 {
        let answer = Answer::of(app.post_charge(Some("k"), &visa(2000)).await).await;
        if answer.status == 429 {
            refused = Some(answer);
            break;
        }
        assert_eq!(answer.status, 201);
        assert!(answer.replayed());
    }
    let refused = refused.expect("a replay over the limit is refused");
    let retry_after = assert_rate_limited(&refused);
    assert_eq!(retry_after, 1, "one a second: a token within the second");
    assert!(!refused.replayed(), "a refusal is not the saved answer");

    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let retried = Answer::of(app.post_charge(Some("k"), &visa(2000)).await).await;
    assert_eq!(retried.status, 201, "{:?}", retried.body);
    assert!(retried.replayed());
    assert_eq!(retried.body, first.body);
    assert_eq!((app.charges().await, app.payments().await), (1, 1));
}

#[tokio::test]
async fn reads_have_their_own_limit_and_zero_turns_writes_off() {
    let app = spawn_app_with(
        Settings::new()
            .set("RATE_LIMIT_PER_SECOND", 0)
            .set("RATE_LIMIT_READ_PER_SECOND", 1)
            .set("RATE_LIMIT_READ_BURST", 3),
    )
    .await;
    let started = Instant::now();
    let reads =
        join_all((0..10).map(|_| async { Answer::of(app.get("/v1/charges").await).await })).await;
    let ok = reads.iter().filter(|a| a.status == 200).count();
    for answer in reads.iter().filter(|a| a.status != 200) {
        assert_rate_limited(answer);
    }
    // The burst, plus one a second while they ran.
    let allowed = 3 + started.elapsed().as_secs() as usize + 1;
    assert!(ok >= 3 && ok <= allowed, "{ok} reads answered");
    assert!(ok < 10, "some reads were refused");

    // Writes are off: forty at once all go through.
    let app = &app;
    let writes = join_all((0..40).map(|i| {
        let key = format!("w-{i}");
        async move { Answer::of(app.post_charge(Some(&key), &visa(100 + i)).await).await }
    }))
    .await;
    for answer in &writes {
        assert_eq!(answer.status, 201, "{:?}", answer.body);
    }
    assert_eq!(app.charges().await, 40);
}
