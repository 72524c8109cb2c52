//! Reconciliation of oncepay's charges and refunds with the processor's
//! ledger: each kind of difference planted in the real databases and found
//! once, in-flight records left alone, the orphan payment's fix made once,
//! the command's JSON and exit status, and the periodic job on one instance
//! at a time.

use std::process::Command;
use std::time::Duration;

use chrono::Utc;
use oncepay::processor::LedgerClient;
use oncepay::reconcile::job::{JobRun, ReconcileJob};
use oncepay::reconcile::{Difference, Fix, Kind, Reconciler, Reconciliation, Window};
use serde_json::{Value, json};

use crate::capture::{authorized_charge, post_capture, reserve_capture_an_hour_ago};
use crate::helpers::{
    Answer, Settings, TestApp, spawn_app, spawn_app_beside, spawn_app_with, until,
};

/// A reconciler of the app's databases; `in_flight` is the age below which
/// a pair is left for later.
fn reconciler(app: &TestApp, in_flight: Duration) -> Reconciler {
    let ledger =
        LedgerClient::new(&app.config.processor_settings().unwrap()).expect("a ledger client");
    Reconciler::new(
        app.pool.clone(),
        ledger,
        app.working_processor.clone(),
        in_flight,
    )
}

/// Reconciles the last day, in-flight age `PROCESSING_TIMEOUT` (30 s).
async fn reconcile(app: &TestApp, fix: bool) -> Reconciliation {
    reconciler(app, app.config.keys.processing_timeout)
        .run(last_day(), fix)
        .await
        .expect("a reconciliation")
}

fn last_day() -> Window {
    Window::last(Duration::from_secs(86_400), Utc::now()).unwrap()
}

/// The one difference found, of `kind`, under `key`.
#[track_caller]
fn only_difference<'a>(r: &'a Reconciliation, kind: Kind, key: &str) -> &'a Difference {
    assert_eq!(r.differences.len(), 1, "{:#?}", r.differences);
    let d = &r.differences[0];
    assert_eq!((d.kind, d.key.as_str()), (kind, key), "{d:#?}");
    assert_eq!(r.remaining, 1);
    d
}

/// A payment at the processor, `ago` (an interval) old.
async fn plant_payment(app: &TestApp, key: &str, amount: i64, currency: &str, ago: &str) {
    sqlx::query(
        "INSERT INTO operations (account, key, kind, outcome, amount, currency, source, created)
         VALUES ($5, $1, 'authorization', 'succeeded', $2, $3, 'tok_visa', now() - $4::interval)",
    )
    .bind(key)
    .bind(amount)
    .bind(currency)
    .bind(ago)
    .bind(&app.processor_account)
    .execute(&app.processor_pool)
    .await
    .unwrap();
}

/// A refund at the processor of `payment`, `ago` old.
async fn plant_processor_refund(app: &TestApp, key: &str, payment: &str, amount: i64, ago: &str) {
    sqlx::query(
        "INSERT INTO operations (account, key, kind, outcome, amount, currency, payment_key, created)
         VALUES ($5, $1, 'refund', 'refunded', $2, 'usd', $3, now() - $4::interval)",
    )
    .bind(key)
    .bind(amount)
    .bind(payment)
    .bind(ago)
    .bind(&app.processor_account)
    .execute(&app.processor_pool)
    .await
    .unwrap();
}

/// A charge of oncepay's in `status`, `ago` old.
async fn plant_charge(app: &TestApp, id: &str, amount: i64, status: &str, ago: &str) {
    sqlx::query(
        "INSERT INTO charges (id, merchant_id, amount, currency, source, status, failure_code,
                              created_at)
         VALUES ($1, $2, $3, 'usd', 'tok_visa', $4,
                 CASE WHEN $4 = 'failed' THEN 'card_declined' END, now() - $5::interval)",
    )
    .bind(id)
    .bind(app.merchant_id)
    .bind(amount)
    .bind(status)
    .bind(ago)
    .execute(&app.pool)
    .await
    .unwrap();
}

/// A refund of oncepay's of the charge `charge`, in `status`, `ago` old.
async fn plant_refund(app: &TestApp, id: &str, charge: &str, amount: i64, status: &str) {
    sqlx::query(
        "INSERT INTO refunds (id, merchant_id, charge_id, amount, currency, status,
                              failure_reason, created_at)
         VALUES ($1, $2, $3, $4, 'usd', $5,
                 CASE WHEN $5 = 'failed' THEN 'declined' END, now() - interval '1 minute')",
    )
    .bind(id)
    .bind(app.merchant_id)
    .bind(charge)
    .bind(amount)
    .bind(status)
    .execute(&app.pool)
    .await
    .unwrap();
}

/// A succeeded charge with its payment, a minute old: no difference.
async fn paid(app: &TestApp, id: &str, amount: i64) {
    plant_charge(app, id, amount, "succeeded", "1 minute").await;
    plant_payment(app, &format!("auth:{id}"), amount, "usd", "1 minute").await;
}

#[tokio::test]
async fn charges_and_refunds_made_through_the_api_reconcile_with_no_difference() {
    let app = spawn_app().await;
    let charge = app.paid_charge(5000).await;
    let declined = app
        .post_charge(
            None,
            &json!({"amount": 700, "currency": "usd", "source": "tok_chargeDeclined"}),
        )
        .await;
    assert_eq!(declined.status(), 402);
    let refund = app
        .post_refund(None, &json!({"charge": charge, "amount": 1200}))
        .await;
    assert_eq!(refund.status(), 201);

    // Nothing is in flight once answered: compared at once.
    let r = reconciler(&app, Duration::ZERO)
        .run(last_day(), false)
        .await
        .unwrap();
    assert_eq!(r.differences, vec![], "{}", r.table());
    assert_eq!((r.checked.charges, r.checked.refunds), (2, 1));
    assert_eq!(r.checked.processor_operations, 3);
    assert_eq!((r.in_flight, r.remaining), (0, 0));
}

#[tokio::test]
async fn a_payment_with_no_charge_is_an_orphan_payment_found_once() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilepaid000000000001", 2500).await;
    plant_payment(
        &app,
        "auth:ch_reconcileorphan0000000001",
        5000,
        "usd",
        "1 minute",
    )
    .await;

    let r = reconcile(&app, false).await;
    let d = only_difference(&r, Kind::OrphanPayment, "auth:ch_reconcileorphan0000000001");
    assert_eq!(d.charge.as_deref(), Some("ch_reconcileorphan0000000001"));
    assert_eq!(d.oncepay, None);
    assert_eq!(d.processor.as_ref().unwrap().amount, Some(5000));
    assert_eq!(d.fix, None, "without --fix nothing is done");
    assert_eq!(app.processor_refunds().await, 0);
}

#[tokio::test]
async fn a_payment_behind_a_failed_charge_is_an_orphan_payment() {
    let app = spawn_app().await;
    plant_charge(
        &app,
        "ch_reconcilefailedbutpaid0001",
        900,
        "failed",
        "1 minute",
    )
    .await;
    plant_payment(
        &app,
        "auth:ch_reconcilefailedbutpaid0001",
        900,
        "usd",
        "1 minute",
    )
    .await;

    let r = reconcile(&app, false).await;
    let d = only_difference(
        &r,
        Kind::OrphanPayment,
        "auth:ch_reconcilefailedbutpaid0001",
    );
    assert_eq!(d.oncepay.as_ref().unwrap().status, "failed");
}

#[tokio::test]
async fn a_succeeded_charge_with_no_payment_is_found_once() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilepaid000000000002", 2500).await;
    plant_charge(
        &app,
        "ch_reconcilenopayment00000001",
        3000,
        "succeeded",
        "1 minute",
    )
    .await;

    let r = reconcile(&app, false).await;
    let d = only_difference(
        &r,
        Kind::MissingPayment,
        "auth:ch_reconcilenopayment00000001",
    );
    assert_eq!(d.processor, None);
}

#[tokio::test]
async fn a_payment_of_another_amount_or_currency_is_a_mismatch_found_once_each() {
    let app = spawn_app().await;
    plant_charge(
        &app,
        "ch_reconcileamount0000000001",
        3000,
        "succeeded",
        "1 minute",
    )
    .await;
    plant_payment(
        &app,
        "auth:ch_reconcileamount0000000001",
        3100,
        "usd",
        "1 minute",
    )
    .await;
    plant_charge(
        &app,
        "ch_reconcilecurrency00000001",
        3000,
        "succeeded",
        "1 minute",
    )
    .await;
    plant_payment(
        &app,
        "auth:ch_reconcilecurrency00000001",
        3000,
        "eur",
        "1 minute",
    )
    .await;

    let r = reconcile(&app, false).await;
    let mut found: Vec<(Kind, &str)> = r
        .differences
        .iter()
        .map(|d| (d.kind, d.key.as_str()))
        .collect();
    found.sort();
    assert_eq!(
        found,
        vec![
            (Kind::PaymentMismatch, "auth:ch_reconcileamount0000000001"),
            (Kind::PaymentMismatch, "auth:ch_reconcilecurrency00000001"),
        ]
    );
}

#[tokio::test]
async fn a_succeeded_refund_with_no_processor_refund_is_found_once() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilerefunded00000001", 4000).await;
    plant_refund(
        &app,
        "re_reconcilenoprocessor0001",
        "ch_reconcilerefunded00000001",
        1000,
        "succeeded",
    )
    .await;
    // A failed refund with nothing at the processor moved no money.
    plant_refund(
        &app,
        "re_reconcilefailednothig001",
        "ch_reconcilerefunded00000001",
        1000,
        "failed",
    )
    .await;

    let r = reconcile(&app, false).await;
    let d = only_difference(
        &r,
        Kind::MissingProcessorRefund,
        "refund:re_reconcilenoprocessor0001",
    );
    assert_eq!(d.refund.as_deref(), Some("re_reconcilenoprocessor0001"));
    assert_eq!(d.charge.as_deref(), Some("ch_reconcilerefunded00000001"));
}

#[tokio::test]
async fn a_processor_refund_with_no_refund_is_an_orphan_refund_found_once() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilerefunded00000002", 4000).await;
    plant_processor_refund(
        &app,
        "refund:re_reconcileorphanrefund001",
        "auth:ch_reconcilerefunded00000002",
        1500,
        "1 minute",
    )
    .await;

    let r = reconcile(&app, false).await;
    only_difference(&r, Kind::OrphanRefund, "refund:re_reconcileorphanrefund001");
}

#[tokio::test]
async fn refunds_whose_amount_or_outcome_differ_are_a_mismatch_found_once_each() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilerefunded00000003", 4000).await;
    plant_refund(
        &app,
        "re_reconcileamountdiffes001",
        "ch_reconcilerefunded00000003",
        1000,
        "succeeded",
    )
    .await;
    plant_processor_refund(
        &app,
        "refund:re_reconcileamountdiffes001",
        "auth:ch_reconcilerefunded00000003",
        900,
        "1 minute",
    )
    .await;
    // oncepay says the issuer refused it; the processor gave the money back.
    plant_refund(
        &app,
        "re_reconcileoutcomediffrs01",
        "ch_reconcilerefunded00000003",
        500,
        "failed",
    )
    .await;
    plant_processor_refund(
        &app,
        "refund:re_reconcileoutcomediffrs01",
        "auth:ch_reconcilerefunded00000003",
        500,
        "1 minute",
    )
    .await;

    let r = reconcile(&app, false).await;
    let mut found: Vec<(Kind, &str, &str)> = r
        .differences
        .iter()
        .map(|d| (d.kind, d.key.as_str(), d.detail.as_str()))
        .collect();
    found.sort();
    assert_eq!(
        found,
        vec![
            (
                Kind::RefundMismatch,
                "refund:re_reconcileamountdiffes001",
                "amount 1000 here, 900 there"
            ),
            (
                Kind::RefundMismatch,
                "refund:re_reconcileoutcomediffrs01",
                "the refund failed, the processor's refunded"
            ),
        ]
    );
}

#[tokio::test]
async fn records_in_flight_are_counted_but_not_reported() {
    let app = spawn_app().await;
    // Money just moved and its charge not written yet as far as a reader
    // can tell: younger than PROCESSING_TIMEOUT.
    plant_payment(
        &app,
        "auth:ch_reconcileyoungpayment001",
        5000,
        "usd",
        "1 second",
    )
    .await;
    // A pending charge whose payment went through: the sweeper settles it,
    // however old.
    plant_charge(
        &app,
        "ch_reconcilependingcharge001",
        800,
        "pending",
        "1 hour",
    )
    .await;
    plant_payment(
        &app,
        "auth:ch_reconcilependingcharge001",
        800,
        "usd",
        "1 hour",
    )
    .await;
    // A pending refund, nothing at the processor yet.
    paid(&app, "ch_reconcilerefunded00000004", 4000).await;
    plant_refund(
        &app,
        "re_reconcilependingrefud001",
        "ch_reconcilerefunded00000004",
        1000,
        "pending",
    )
    .await;
    // A charge answered a moment ago, through the API.
    app.paid_charge(1200).await;

    let r = reconcile(&app, false).await;
    assert_eq!(r.differences, vec![], "{}", r.table());
    assert_eq!(r.in_flight, 4, "{}", r.table());
}

#[tokio::test]
async fn a_record_whose_other_half_is_outside_the_window_is_paired_by_key() {
    let app = spawn_app().await;
    // The charge was written just before the window, its payment in it.
    plant_charge(
        &app,
        "ch_reconcileedgeofwindow0001",
        600,
        "succeeded",
        "10 minutes",
    )
    .await;
    plant_payment(
        &app,
        "auth:ch_reconcileedgeofwindow0001",
        600,
        "usd",
        "4 minutes",
    )
    .await;
    // And the other way round.
    plant_charge(
        &app,
        "ch_reconcileedgeofwindow0002",
        600,
        "succeeded",
        "4 minutes",
    )
    .await;
    plant_payment(
        &app,
        "auth:ch_reconcileedgeofwindow0002",
        600,
        "usd",
        "10 minutes",
    )
    .await;

    let window = Window::last(Duration::from_secs(300), Utc::now()).unwrap();
    let r = reconciler(&app, app.config.keys.processing_timeout)
        .run(window, false)
        .await
        .unwrap();
    assert_eq!(r.differences, vec![], "{}", r.table());
    assert_eq!((r.checked.charges, r.checked.processor_operations), (1, 1));
}

#[tokio::test]
async fn fixing_an_orphan_payment_refunds_it_once_across_two_runs() {
    let app = spawn_app().await;
    plant_payment(
        &app,
        "auth:ch_reconcilefixme000000001",
        5000,
        "usd",
        "1 minute",
    )
    .await;

    let first = reconcile(&app, true).await;
    let d = &first.differences[0];
    assert_eq!(d.kind, Kind::OrphanPayment);
    assert_eq!(
        d.fix,
        Some(Fix::Refunded {
            key: "reconcile-refund:auth:ch_reconcilefixme000000001".into(),
            amount: 5000,
            currency: "usd".into(),
        })
    );
    assert_eq!((first.fixed, first.remaining), (1, 0));

    let second = reconcile(&app, true).await;
    assert_eq!(second.differences, vec![], "{}", second.table());

    let refunds: Vec<(String, String, i64, String)> = sqlx::query_as(
        "SELECT key, outcome, amount, payment_key FROM operations WHERE kind = 'refund'",
    )
    .fetch_all(&app.processor_pool)
    .await
    .unwrap();
    assert_eq!(
        refunds,
        vec![(
            "reconcile-refund:auth:ch_reconcilefixme000000001".to_owned(),
            "refunded".to_owned(),
            5000,
            "auth:ch_reconcilefixme000000001".to_owned(),
        )]
    );
}

#[tokio::test]
async fn differences_without_a_fix_remain_after_fix() {
    let app = spawn_app().await;
    plant_charge(
        &app,
        "ch_reconcilenopayment00000002",
        3000,
        "succeeded",
        "1 minute",
    )
    .await;
    let r = reconcile(&app, true).await;
    let d = only_difference(
        &r,
        Kind::MissingPayment,
        "auth:ch_reconcilenopayment00000002",
    );
    assert_eq!(d.fix, None);
    assert_eq!(
        app.processor_operations().await,
        0,
        "nothing made at the processor"
    );
}

fn oncepay_reconcile(app: &TestApp, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .arg("reconcile")
        .args(args)
        .env_clear()
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", &app.config.database_url)
        .env("PROCESSOR_URL", &app.processor_url)
        .env("PROCESSOR_API_KEY", &app.processor_api_key)
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "warn")
        .output()
        .expect("run oncepay reconcile")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_prints_json_and_exits_3_until_fix_refunds_the_orphan() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilepaid000000000003", 2500).await;
    plant_payment(
        &app,
        "auth:ch_reconcilecliorphan000001",
        5000,
        "usd",
        "1 minute",
    )
    .await;

    let out = oncepay_reconcile(&app, &["--json"]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let keys: Vec<&str> = report
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "since",
            "until",
            "checked",
            "in_flight",
            "differences",
            "fixed",
            "remaining"
        ]
    );
    assert_eq!(
        report["checked"],
        json!({"charges": 1, "refunds": 0, "processor_operations": 2})
    );
    assert_eq!(
        (report["fixed"].as_u64(), report["remaining"].as_u64()),
        (Some(0), Some(1))
    );
    let d = &report["differences"][0];
    assert_eq!(d["kind"], "orphan_payment");
    assert_eq!(d["key"], "auth:ch_reconcilecliorphan000001");
    assert_eq!(d["charge"], "ch_reconcilecliorphan000001");
    assert_eq!(d["refund"], Value::Null);
    assert_eq!(d["oncepay"], Value::Null);
    assert_eq!(d["processor"]["status"], "succeeded");
    assert_eq!(d["processor"]["amount"], 5000);
    assert_eq!(d["processor"]["currency"], "usd");
    assert!(d["detail"].is_string() && d.get("fix").is_none(), "{d}");

    let out = oncepay_reconcile(&app, &["--fix", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["differences"][0]["fix"],
        json!({"action": "refunded", "key": "reconcile-refund:auth:ch_reconcilecliorphan000001",
               "amount": 5000, "currency": "usd"})
    );

    let out = oncepay_reconcile(&app, &["--fix"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("0 differences, 0 fixed, 0 remaining"),
        "{table}"
    );
    assert_eq!(
        app.processor_refunds().await,
        1,
        "refunded once over two fixes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_prints_a_table_of_the_differences_for_a_window_given_by_since() {
    let app = spawn_app().await;
    plant_charge(
        &app,
        "ch_reconcilenopayment00000003",
        3000,
        "succeeded",
        "1 minute",
    )
    .await;
    let since = (Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
    let out = oncepay_reconcile(&app, &["--since", &since]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("reconciled "), "{table}");
    assert!(
        lines[1].starts_with("KIND") && lines[1].contains("PROCESSOR"),
        "{table}"
    );
    assert!(
        lines[2].starts_with("missing_payment")
            && lines[2].contains("auth:ch_reconcilenopayment00000003"),
        "{table}"
    );
    assert_eq!(lines[3], "1 differences, 0 fixed, 1 remaining");

    // A window before the charge holds nothing.
    let out = oncepay_reconcile(&app, &["--since", "0", "--until", "60"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn the_periodic_job_runs_on_one_instance_at_a_time() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilepaid000000000004", 2500).await;
    let job = |interval| {
        ReconcileJob::new(
            app.pool.clone(),
            reconciler(&app, app.config.keys.processing_timeout),
            interval,
            Duration::from_secs(86_400),
        )
    };
    let (a, b) = (
        job(Duration::from_secs(3600)),
        job(Duration::from_secs(3600)),
    );

    // Two instances at once: one runs, the other is locked out or finds
    // the run done.
    let (ra, rb) = tokio::join!(a.run_if_due(), b.run_if_due());
    let ran = [ra.unwrap(), rb.unwrap()]
        .into_iter()
        .filter(|r| matches!(r, JobRun::Ran(_)))
        .count();
    assert_eq!(ran, 1);
    assert_eq!(app.count("SELECT count(*) FROM reconcile_runs").await, 1);

    // Within the interval, no instance runs again.
    assert!(matches!(a.run_if_due().await.unwrap(), JobRun::NotDue));

    // While another session holds the lock, this instance does not run.
    let c = job(Duration::from_millis(1));
    let mut other = app.pool.acquire().await.unwrap();
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(oncepay::reconcile::store::LOCK)
        .fetch_one(&mut *other)
        .await
        .unwrap();
    assert!(locked);
    assert!(matches!(c.run_if_due().await.unwrap(), JobRun::Busy));
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(oncepay::reconcile::store::LOCK)
        .execute(&mut *other)
        .await
        .unwrap();
    assert!(matches!(c.run_if_due().await.unwrap(), JobRun::Ran(_)));
    assert_eq!(app.count("SELECT count(*) FROM reconcile_runs").await, 2);
}

#[tokio::test]
async fn two_serving_instances_share_the_periodic_reconciliation() {
    let settings = Settings::new().set("RECONCILE_INTERVAL", "200ms");
    let app = spawn_app_with(settings.clone()).await;
    let _second = app.another_instance(settings).await;
    paid(&app, "ch_reconcilepaid000000000005", 2500).await;
    plant_charge(
        &app,
        "ch_reconcilenopayment00000004",
        3000,
        "succeeded",
        "1 minute",
    )
    .await;

    let started = std::time::Instant::now();
    until(
        Duration::from_secs(10),
        "five reconciliation runs",
        || async { app.count("SELECT count(*) FROM reconcile_runs").await >= 5 },
    )
    .await;
    let elapsed = started.elapsed();
    let runs: Vec<(chrono::DateTime<Utc>, chrono::DateTime<Utc>, i32, Value)> = sqlx::query_as(
        "SELECT started_at, finished_at, differences, by_kind::text::json
           FROM reconcile_runs ORDER BY started_at",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    for pair in runs.windows(2) {
        assert!(pair[1].0 >= pair[0].1, "runs overlap: {pair:?}");
    }
    // Two instances each running every tick would make twice as many.
    let ticks = (elapsed.as_millis() / 180) as usize + 2;
    assert!(runs.len() <= ticks, "{} runs in {elapsed:?}", runs.len());
    for run in &runs {
        assert_eq!((run.2, &run.3), (1, &json!({"missing_payment": 1})));
    }
    let metrics = Answer::of(app.get("/metrics").await).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("reconcile_runs_total{result=\"differences\"}"),
        "{text}"
    );
    // The recorder is the test process's, shared with the other tests that
    // reconcile at the same time, so the gauge's value may be theirs; each
    // run's own count is checked in reconcile_runs above.
    assert!(
        text.contains("reconcile_differences{kind=\"missing_payment\"}"),
        "{text}"
    );
    assert!(
        text.contains("reconcile_last_run_timestamp_seconds"),
        "{text}"
    );
}

#[tokio::test]
async fn a_refund_under_reconciliations_key_of_a_succeeded_charge_is_reported() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcileprefix00000000001", 5000).await;
    plant_processor_refund(
        &app,
        "reconcile-refund:auth:ch_reconcileprefix00000000001",
        "auth:ch_reconcileprefix00000000001",
        5000,
        "1 minute",
    )
    .await;

    let r = reconcile(&app, true).await;
    let d = only_difference(
        &r,
        Kind::OrphanRefund,
        "reconcile-refund:auth:ch_reconcileprefix00000000001",
    );
    assert_eq!(d.charge.as_deref(), Some("ch_reconcileprefix00000000001"));
    assert_eq!(d.processor.as_ref().unwrap().amount, Some(5000));
    assert_eq!(d.fix, None);
    assert_eq!(app.processor_refunds().await, 1, "--fix added no refund");
}

#[tokio::test]
async fn a_compensating_refund_is_checked_against_the_orphan_it_claims_to_give_back() {
    let app = spawn_app().await;
    // Under the orphan's key, but giving back 1000 of its 5000.
    plant_payment(
        &app,
        "auth:ch_reconcileshort00000001",
        5000,
        "usd",
        "2 minutes",
    )
    .await;
    plant_processor_refund(
        &app,
        "reconcile-refund:auth:ch_reconcileshort00000001",
        "auth:ch_reconcileshort00000001",
        1000,
        "1 minute",
    )
    .await;
    // Under another orphan's key, but refunding a good charge's payment.
    plant_payment(
        &app,
        "auth:ch_reconcileaimed00000001",
        3000,
        "usd",
        "2 minutes",
    )
    .await;
    paid(&app, "ch_reconcilegood0000000000001", 3000).await;
    plant_processor_refund(
        &app,
        "reconcile-refund:auth:ch_reconcileaimed00000001",
        "auth:ch_reconcilegood0000000000001",
        3000,
        "1 minute",
    )
    .await;

    let r = reconcile(&app, false).await;
    let mut found: Vec<(&str, &str)> = r
        .differences
        .iter()
        .map(|d| (d.kind.as_str(), d.key.as_str()))
        .collect();
    found.sort();
    assert_eq!(
        found,
        [
            ("orphan_payment", "auth:ch_reconcileaimed00000001"),
            ("orphan_payment", "auth:ch_reconcileshort00000001"),
            (
                "refunded_amount_mismatch",
                "auth:ch_reconcilegood0000000000001"
            ),
        ],
        "{}",
        r.table()
    );
    assert_eq!(r.remaining, 3);
    let short = r
        .differences
        .iter()
        .find(|d| d.key == "auth:ch_reconcileshort00000001")
        .unwrap();
    assert!(short.detail.contains("1000 of 5000"), "{}", short.detail);
}

#[tokio::test]
async fn refunded_amounts_are_compared_on_both_sides_even_for_a_refund_outside_the_window() {
    let app = spawn_app().await;
    plant_charge(
        &app,
        "ch_reconcilesums0000000000001",
        5000,
        "succeeded",
        "2 hours",
    )
    .await;
    plant_payment(
        &app,
        "auth:ch_reconcilesums0000000000001",
        5000,
        "usd",
        "2 hours",
    )
    .await;
    // A refund oncepay knows nothing of, made after the window.
    plant_processor_refund(
        &app,
        "refund:re_reconcilelate00000000001",
        "auth:ch_reconcilesums0000000000001",
        2000,
        "30 minutes",
    )
    .await;

    let now = Utc::now();
    let window = Window::new(
        now - chrono::Duration::hours(3),
        now - chrono::Duration::hours(1),
    )
    .unwrap();
    let r = reconciler(&app, app.config.keys.processing_timeout)
        .run(window, false)
        .await
        .unwrap();
    assert_eq!(r.differences.len(), 1, "{}", r.table());
    let d = &r.differences[0];
    assert_eq!(
        (d.kind.as_str(), d.key.as_str(), d.charge.as_deref()),
        (
            "refunded_amount_mismatch",
            "auth:ch_reconcilesums0000000000001",
            Some("ch_reconcilesums0000000000001")
        )
    );
    assert!(
        d.detail.contains("0 here, 2000 at the processor"),
        "{}",
        d.detail
    );
}

#[tokio::test]
async fn two_oncepay_databases_on_one_gateway_never_touch_each_others_payments() {
    let a = spawn_app().await;
    let b = spawn_app_beside(&a).await;
    for amount in [5000, 3000, 2000] {
        b.paid_charge(amount).await;
    }
    let mine = a.paid_charge(1500).await;

    // Nothing is in flight: every payment is compared at once.
    let fixed = reconciler(&a, Duration::ZERO)
        .run(last_day(), true)
        .await
        .unwrap();
    assert_eq!(fixed.differences, vec![], "{}", fixed.table());
    assert_eq!(
        fixed.checked.processor_operations, 1,
        "A sees its own payment only"
    );
    let refunds: i64 = sqlx::query_scalar("SELECT count(*) FROM operations WHERE kind = 'refund'")
        .fetch_one(&a.processor_pool)
        .await
        .unwrap();
    assert_eq!(refunds, 0, "A's --fix refunded nothing of B's");
    let theirs = reconciler(&b, Duration::ZERO)
        .run(last_day(), true)
        .await
        .unwrap();
    assert_eq!(theirs.differences, vec![], "{}", theirs.table());
    assert_eq!(theirs.checked.processor_operations, 3);

    // A refund of B's payment under A's account is refused at the gateway.
    let b_payment: String = sqlx::query_scalar(
        "SELECT key FROM operations WHERE account = $1 ORDER BY created LIMIT 1",
    )
    .bind(&b.processor_account)
    .fetch_one(&b.processor_pool)
    .await
    .unwrap();
    let refused = a
        .working_processor
        .refund(oncepay::processor::Refund {
            processor_key: &format!("reconcile-refund:{b_payment}"),
            payment_key: &b_payment,
            amount: 5000,
            currency: "usd",
            fault: None,
        })
        .await;
    assert!(refused.is_err(), "{refused:?}");
    assert!(!mine.is_empty());
    drop(b);
}

/// Captures `amount` (all of it when `None`) of the charge `id`.
async fn capture(app: &TestApp, id: &str, amount: Option<i64>) {
    let body = amount.map_or(json!({}), |a| json!({"amount": a}));
    assert_eq!(post_capture(app, id, None, &body).await.status(), 200);
}

#[tokio::test]
async fn captured_partly_captured_released_and_uncaptured_charges_reconcile_with_no_difference() {
    let app = spawn_app().await;
    let whole = authorized_charge(&app, 2000).await;
    capture(&app, &whole, None).await;
    let part = authorized_charge(&app, 2000).await;
    capture(&app, &part, Some(1500)).await;
    let part_refunded = authorized_charge(&app, 3000).await;
    capture(&app, &part_refunded, Some(1000)).await;
    let refund = app
        .post_refund(None, &json!({"charge": part_refunded, "amount": 400}))
        .await;
    assert_eq!(refund.status(), 201);
    let released = authorized_charge(&app, 2500).await;
    let release = app.post_refund(None, &json!({"charge": released})).await;
    assert_eq!(release.status(), 201);
    authorized_charge(&app, 900).await;

    let r = reconciler(&app, Duration::ZERO)
        .run(last_day(), false)
        .await
        .unwrap();
    assert_eq!(r.differences, vec![], "{}", r.table());
    assert_eq!((r.checked.charges, r.checked.refunds), (5, 2));
    assert_eq!((r.in_flight, r.remaining), (0, 0));
}

#[tokio::test]
async fn a_partial_capture_the_processor_made_and_oncepay_has_not_settled_is_in_flight() {
    let app = spawn_app().await;
    let id = authorized_charge(&app, 2000).await;
    // The capture's claim reserved it an hour ago, the processor captured
    // 1500 (giving 500 back), and the settle has not run yet: the sweeper
    // rolls it forward.
    reserve_capture_an_hour_ago(&app, &id, 1500).await;
    sqlx::query(
        "INSERT INTO operations (account, key, kind, outcome, amount, currency, payment_key, created)
         VALUES ($1, $2, 'capture', 'captured', 1500, 'usd', $3, now() - interval '1 hour')",
    )
    .bind(&app.processor_account)
    .bind(format!("capture:{id}"))
    .bind(format!("auth:{id}"))
    .execute(&app.processor_pool)
    .await
    .unwrap();

    let r = reconciler(&app, Duration::ZERO)
        .run(last_day(), false)
        .await
        .unwrap();
    assert_eq!(r.differences, vec![], "{}", r.table());
    assert_eq!(r.in_flight, 1, "{}", r.table());
}

#[tokio::test]
async fn the_command_without_a_gateway_names_the_settings_and_makes_no_account() {
    let app = spawn_app().await;
    paid(&app, "ch_reconcilenogateway0000001", 2500).await;
    let out = Command::new(env!("CARGO_BIN_EXE_oncepay"))
        .args(["reconcile", "--window", "1h"])
        .env_clear()
        .current_dir(std::env::temp_dir())
        .env("DATABASE_URL", &app.config.database_url)
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "warn")
        .output()
        .expect("run oncepay reconcile");
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("PROCESSOR_URL") && said.contains(".run/env"),
        "{said}"
    );
    // No embedded gateway, and so no ledger database made for one.
    let name = app
        .config
        .database_url
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned();
    let ledgers: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(format!("{name}_processor"))
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(ledgers, 0);
}
