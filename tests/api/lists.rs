//! The refunds lists (all of the merchant's, by charge, and a charge's
//! refunds sub-resource), and the `created` filter of the charges, refunds
//! and events lists.

use serde_json::{Value, json};

use crate::helpers::{Answer, TestApp, spawn_app};

/// A refund of `amount` of `charge`, made over HTTP; returns its id.
async fn refund(app: &TestApp, charge: &str, amount: i64) -> String {
    let refund = Answer::of(
        app.post_refund(None, &json!({"charge": charge, "amount": amount}))
            .await,
    )
    .await;
    assert_eq!(refund.status, 201, "{:?}", refund.body);
    refund.json()["id"].as_str().unwrap().to_owned()
}

/// `GET path` as the app's merchant, which must answer `200`: the body.
async fn list(app: &TestApp, path: &str) -> Value {
    let answer = Answer::of(app.get(path).await).await;
    assert_eq!(answer.status, 200, "{path}: {:?}", answer.body);
    answer.json()
}

/// `GET path` as the merchant whose key is `api_key`.
async fn get_as(app: &TestApp, api_key: &str, path: &str) -> Answer {
    Answer::of(
        app.client
            .get(app.url(path))
            .bearer_auth(api_key)
            .send()
            .await
            .unwrap(),
    )
    .await
}

/// The ids of a list object's page.
fn ids_of(page: &Value) -> Vec<String> {
    page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Asserts a `400` problem with `code` naming `param`.
#[track_caller]
fn assert_refused(answer: &Answer, code: &str, param: &str) {
    answer.assert_problem(400, code);
    assert_eq!(answer.json()["param"], param, "{}", answer.json());
    assert_eq!(answer.json()["error"]["param"], param);
}

/// Sets the `created_at` of the row `id` of `table` to `seconds` after the
/// Unix epoch (fractions kept), as if it had been created then.
async fn created_at(app: &TestApp, table: &str, id: &str, seconds: f64) {
    let sql = format!("UPDATE {table} SET created_at = to_timestamp($2) WHERE id = $1");
    let updated = sqlx::query(&sql)
        .bind(id)
        .bind(seconds)
        .execute(&app.pool)
        .await
        .unwrap();
    assert_eq!(updated.rows_affected(), 1, "{table} {id}");
}

#[tokio::test]
async fn the_refunds_list_is_newest_first_and_pages_both_ways() {
    let app = spawn_app().await;
    let mut ids = Vec::new();
    for amount in 1..=3 {
        let charge = app.paid_charge(1000).await;
        ids.push(refund(&app, &charge, amount).await);
        ids.push(refund(&app, &charge, amount).await);
    }
    ids.reverse(); // newest first, as listed

    let all = list(&app, "/v1/refunds").await;
    assert_eq!(
        (&all["object"], &all["url"], &all["has_more"]),
        (&json!("list"), &json!("/v1/refunds"), &json!(false))
    );
    assert_eq!(ids_of(&all), ids);
    let first = list(&app, "/v1/refunds?limit=4").await;
    assert_eq!(
        (ids_of(&first), &first["has_more"]),
        (ids[..4].to_vec(), &json!(true))
    );
    let next = list(
        &app,
        &format!("/v1/refunds?limit=4&starting_after={}", ids[3]),
    )
    .await;
    assert_eq!(
        (ids_of(&next), &next["has_more"]),
        (ids[4..].to_vec(), &json!(false))
    );
    let back = list(
        &app,
        &format!("/v1/refunds?limit=2&ending_before={}", ids[4]),
    )
    .await;
    assert_eq!(
        (ids_of(&back), &back["has_more"]),
        (ids[2..4].to_vec(), &json!(true))
    );
    // Each listed refund is the refund as it reads alone.
    let one = list(&app, &format!("/v1/refunds/{}", ids[0])).await;
    assert_eq!(all["data"][0], one);

    for (query, code, param) in [
        (
            "starting_after=re_nope",
            "resource_missing",
            "starting_after",
        ),
        ("ending_before=re_nope", "resource_missing", "ending_before"),
        ("limit=0", "parameter_invalid_integer", "limit"),
        ("payment_intent=pi_1", "parameter_unknown", "payment_intent"),
        ("charge[]=ch_1", "parameter_invalid_type", "charge"),
    ] {
        let answer = Answer::of(app.get(&format!("/v1/refunds?{query}")).await).await;
        assert_refused(&answer, code, param);
    }
}

#[tokio::test]
async fn the_refunds_list_filtered_by_charge_shows_that_charges_refunds_only() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    let other = app.paid_charge(1000).await;
    let older = refund(&app, &charge, 100).await;
    refund(&app, &other, 100).await;
    let newer = refund(&app, &charge, 200).await;

    let page = list(&app, &format!("/v1/refunds?charge={charge}")).await;
    assert_eq!(ids_of(&page), [newer.clone(), older.clone()]);
    assert_eq!(page["url"], "/v1/refunds");
    let paged = list(&app, &format!("/v1/refunds?charge={charge}&limit=1")).await;
    assert_eq!(
        (ids_of(&paged), &paged["has_more"]),
        (vec![newer.clone()], &json!(true))
    );
    let rest = list(
        &app,
        &format!("/v1/refunds?charge={charge}&limit=1&starting_after={newer}"),
    )
    .await;
    assert_eq!(
        (ids_of(&rest), &rest["has_more"]),
        (vec![older], &json!(false))
    );
    let unrefunded = app.paid_charge(1000).await;
    let none = list(&app, &format!("/v1/refunds?charge={unrefunded}")).await;
    assert_eq!(none["data"], json!([]));

    // An unknown charge, or another merchant's, names nothing: refused as
    // Stripe refuses a parameter naming no object.
    let unknown = Answer::of(app.get("/v1/refunds?charge=ch_nope").await).await;
    assert_refused(&unknown, "resource_missing", "charge");
    let other_merchant = app.other_merchant().await;
    let foreign = get_as(
        &app,
        &other_merchant,
        &format!("/v1/refunds?charge={charge}"),
    )
    .await;
    assert_refused(&foreign, "resource_missing", "charge");
    assert_eq!(
        foreign.json()["detail"],
        format!("No such charge: '{charge}'")
    );
}

#[tokio::test]
async fn the_refunds_url_a_charge_gives_answers_that_charges_refunds() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    let mut ids = Vec::new();
    for amount in 1..=12 {
        ids.push(refund(&app, &charge, amount).await);
    }
    ids.reverse();
    refund(&app, &app.paid_charge(1000).await, 100).await;

    let object = list(&app, &format!("/v1/charges/{charge}")).await;
    let url = object["refunds"]["url"].as_str().unwrap();
    assert_eq!(url, format!("/v1/charges/{charge}/refunds"));
    let page = list(&app, url).await;
    // The first page is the one the charge carries, and the same refunds
    // as the refunds list filtered by the charge.
    assert_eq!(page, object["refunds"]);
    assert_eq!(ids_of(&page), ids[..10]);
    assert_eq!(page["has_more"], true);
    let filtered = list(&app, &format!("/v1/refunds?charge={charge}")).await;
    assert_eq!(page["data"], filtered["data"]);
    let rest = list(&app, &format!("{url}?starting_after={}", ids[9])).await;
    assert_eq!(
        (ids_of(&rest), &rest["has_more"]),
        (ids[10..].to_vec(), &json!(false))
    );
    let back = list(&app, &format!("{url}?limit=3&ending_before={}", ids[3])).await;
    assert_eq!(ids_of(&back), ids[..3]);

    let unknown = Answer::of(app.get("/v1/charges/ch_nope/refunds").await).await;
    unknown.assert_problem(404, "resource_missing");
    assert_eq!(unknown.json()["param"], "id");
    let other_merchant = app.other_merchant().await;
    get_as(&app, &other_merchant, url)
        .await
        .assert_problem(404, "resource_missing");
    for (query, code, param) in [
        ("created=1", "parameter_unknown", "created"),
        ("charge=ch_1", "parameter_unknown", "charge"),
        (
            "starting_after=re_nope",
            "resource_missing",
            "starting_after",
        ),
    ] {
        let answer = Answer::of(app.get(&format!("{url}?{query}")).await).await;
        assert_refused(&answer, code, param);
    }
}

#[tokio::test]
async fn a_refund_is_read_through_its_own_charge_and_through_no_other() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    let other = app.paid_charge(1000).await;
    let id = refund(&app, &charge, 100).await;

    let through_charge = list(&app, &format!("/v1/charges/{charge}/refunds/{id}")).await;
    assert_eq!(
        through_charge,
        list(&app, &format!("/v1/refunds/{id}")).await
    );
    let other_merchant = app.other_merchant().await;
    for (api_key, path) in [
        (&app.api_key, format!("/v1/charges/{other}/refunds/{id}")),
        (&app.api_key, format!("/v1/charges/ch_nope/refunds/{id}")),
        (
            &app.api_key,
            format!("/v1/charges/{charge}/refunds/re_nope"),
        ),
        (
            &other_merchant,
            format!("/v1/charges/{charge}/refunds/{id}"),
        ),
    ] {
        let answer = get_as(&app, api_key, &path).await;
        answer.assert_problem(404, "resource_missing");
        assert_eq!(answer.json()["param"], "id", "{path}");
    }
    let with_a_query = Answer::of(
        app.get(&format!("/v1/charges/{charge}/refunds/{id}?limit=1"))
            .await,
    )
    .await;
    assert_refused(&with_a_query, "parameter_unknown", "limit");
}

/// Three objects created at 1000.25, 2000.5 and 3000.75 seconds, newest
/// first, and the ids each `created` filter leaves of them, newest first.
fn created_cases() -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("created=2000", vec![1]),
        ("created=2001", vec![]),
        ("created[gt]=2000", vec![0]),
        ("created[gte]=2000", vec![0, 1]),
        ("created[lt]=2000", vec![2]),
        ("created[lte]=2000", vec![1, 2]),
        ("created[gt]=1000&created[lt]=3000", vec![1]),
        ("created[gte]=1000&created[lte]=3000", vec![0, 1, 2]),
        ("created[gt]=3000", vec![]),
        ("created[lt]=-5", vec![]),
    ]
}

/// Asserts that the list at `route` (whose objects are `ids`, newest
/// first, created as [`created_cases`] says) keeps what each filter leaves,
/// pages within it, and refuses bad bounds by name.
async fn assert_created_filters(app: &TestApp, route: &str, ids: &[String]) {
    for (query, kept) in created_cases() {
        let page = list(app, &format!("{route}?{query}")).await;
        let expected: Vec<String> = kept.iter().map(|&i| ids[i].clone()).collect();
        assert_eq!(ids_of(&page), expected, "{route}?{query}");
    }
    // Combined with the cursors and `limit`: the filter bounds each page.
    let range = "created[gte]=1000&created[lt]=3000";
    let first = list(app, &format!("{route}?{range}&limit=1")).await;
    assert_eq!(
        (ids_of(&first), &first["has_more"]),
        (vec![ids[1].clone()], &json!(true))
    );
    let next = list(
        app,
        &format!("{route}?{range}&limit=1&starting_after={}", ids[1]),
    )
    .await;
    assert_eq!(
        (ids_of(&next), &next["has_more"]),
        (vec![ids[2].clone()], &json!(false))
    );
    let back = list(app, &format!("{route}?{range}&ending_before={}", ids[2])).await;
    assert_eq!(
        (ids_of(&back), &back["has_more"]),
        (vec![ids[1].clone()], &json!(false))
    );

    for (query, code, param) in [
        ("created=yesterday", "parameter_invalid_integer", "created"),
        (
            "created[gte]=1.5",
            "parameter_invalid_integer",
            "created[gte]",
        ),
        ("created[lt]=", "parameter_invalid_integer", "created[lt]"),
        ("created[after]=1", "parameter_unknown", "created[after]"),
        ("created=1&created[gt]=1", "parameter_duplicate", "created"),
    ] {
        let answer = Answer::of(app.get(&format!("{route}?{query}")).await).await;
        assert_refused(&answer, code, param);
    }
    let message = Answer::of(app.get(&format!("{route}?created[gt]=soon")).await).await;
    assert_eq!(message.json()["error"]["message"], "Invalid integer: soon");
}

#[tokio::test]
async fn the_charges_list_keeps_the_charges_created_in_the_seconds_the_filter_names() {
    let app = spawn_app().await;
    let mut ids = Vec::new();
    for (seconds, amount) in [(3000.75, 1000), (2000.5, 2000), (1000.25, 3000)] {
        let charge = app.paid_charge(amount).await;
        created_at(&app, "charges", &charge, seconds).await;
        ids.push(charge);
    }
    assert_created_filters(&app, "/v1/charges", &ids).await;
}

#[tokio::test]
async fn the_refunds_list_keeps_the_refunds_created_in_the_seconds_the_filter_names() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    let mut ids = Vec::new();
    for (seconds, amount) in [(3000.75, 1), (2000.5, 2), (1000.25, 3)] {
        let refund = refund(&app, &charge, amount).await;
        created_at(&app, "refunds", &refund, seconds).await;
        ids.push(refund);
    }
    assert_created_filters(&app, "/v1/refunds", &ids).await;
    let by_charge = list(&app, &format!("/v1/refunds?charge={charge}&created=2000")).await;
    assert_eq!(ids_of(&by_charge), [ids[1].clone()]);
}

#[tokio::test]
async fn the_events_list_keeps_the_events_created_in_the_seconds_the_filter_names() {
    let app = spawn_app().await;
    for amount in [1000, 2000, 3000] {
        app.paid_charge(amount).await;
    }
    app.until_listed().await;
    let ids = ids_of(&list(&app, "/v1/events").await);
    for (id, seconds) in ids.iter().zip([3000.75, 2000.5, 1000.25]) {
        created_at(&app, "events", id, seconds).await;
    }
    assert_created_filters(&app, "/v1/events", &ids).await;
    let typed = list(&app, "/v1/events?type=charge.*&created[lte]=2000").await;
    assert_eq!(ids_of(&typed), ids[1..]);
}

#[tokio::test]
async fn the_events_list_filters_by_a_type_pattern_with_a_wildcard() {
    let app = spawn_app().await;
    let charge = app.paid_charge(1000).await;
    refund(&app, &charge, 100).await;
    app.until_listed().await;
    let types = |page: Value| -> Vec<String> {
        page["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["type"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        types(list(&app, "/v1/events?type=charge.*").await),
        ["charge.refunded", "charge.succeeded"]
    );
    assert_eq!(
        types(list(&app, "/v1/events?type=*.created").await),
        ["refund.created"]
    );
    assert_eq!(types(list(&app, "/v1/events?type=*").await).len(), 3);
    for query in ["type=dispute.*", "types[]=charge.*"] {
        let answer = Answer::of(app.get(&format!("/v1/events?{query}")).await).await;
        answer.assert_problem(400, "invalid_event_type");
    }
}
