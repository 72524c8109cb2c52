//! Bad input: every case gets a 4xx problem with its stable code, never a
//! 500, and writes nothing (no charge, no key, no processor call).

use serde_json::{Value, json};

use crate::helpers::{Answer, Settings, TestApp, spawn_app, spawn_app_with, visa};

#[track_caller]
fn assert_nothing_written(counts: (i64, i64, i64), case: &str) {
    assert_eq!(counts, (0, 0, 0), "{case}: charges, keys, processor rows");
}

async fn counts(app: &TestApp) -> (i64, i64, i64) {
    (
        app.charges().await,
        app.keys().await,
        app.processor_operations().await,
    )
}

/// Sends each JSON body with a key and checks the problem it gets.
async fn check_json(app: &TestApp, cases: Vec<(Value, u16, &str, Option<&str>)>) {
    for (i, (body, status, code, param)) in cases.into_iter().enumerate() {
        let answer = Answer::of(app.post_charge(Some(&format!("bad-{i}")), &body).await).await;
        answer.assert_problem(status, code);
        if let Some(param) = param {
            assert_eq!(answer.json()["param"], param, "{body}");
        }
        assert_nothing_written(counts(app).await, &body.to_string());
    }
}

fn with(field: &str, value: Value) -> Value {
    let mut body = json!({"amount": 2000, "currency": "usd", "source": "tok_visa"});
    body[field] = value;
    body
}

fn without(field: &str) -> Value {
    let mut body = json!({"amount": 2000, "currency": "usd", "source": "tok_visa"});
    body.as_object_mut().unwrap().remove(field);
    body
}

#[tokio::test]
async fn malformed_json_is_400_invalid_json() {
    let app = spawn_app().await;
    for body in [
        "{",
        "{\"amount\": 2000,}",
        "[1, 2]",
        "\"amount\"",
        "",
        "null",
    ] {
        let answer = Answer::of(app.post_raw(Some("k"), "application/json", body).await).await;
        answer.assert_problem(400, "invalid_json");
        assert_nothing_written(counts(&app).await, body);
    }
}

#[tokio::test]
async fn a_wrong_or_missing_content_type_is_415() {
    let app = spawn_app().await;
    let body = json!({"amount": 2000, "currency": "usd", "source": "tok_visa"}).to_string();
    for content_type in [
        "text/plain",
        "application/xml",
        "multipart/form-data; boundary=x",
    ] {
        let answer = Answer::of(app.post_raw(Some("k"), content_type, body.clone()).await).await;
        answer.assert_problem(415, "unsupported_media_type");
    }
    let no_type = app
        .client
        .post(app.url("/v1/charges"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "k")
        .body(body)
        .send()
        .await
        .unwrap();
    Answer::of(no_type)
        .await
        .assert_problem(415, "unsupported_media_type");
    assert_nothing_written(counts(&app).await, "content types");
}

#[tokio::test]
async fn missing_and_unknown_parameters_are_named() {
    let app = spawn_app().await;
    check_json(
        &app,
        vec![
            (without("amount"), 400, "parameter_missing", Some("amount")),
            (
                without("currency"),
                400,
                "parameter_missing",
                Some("currency"),
            ),
            (without("source"), 400, "parameter_missing", Some("source")),
            (
                with("amount", Value::Null),
                400,
                "parameter_missing",
                Some("amount"),
            ),
            (
                with("capture", json!("maybe")),
                400,
                "parameter_invalid_type",
                Some("capture"),
            ),
            (
                with("customr", json!("cus_1")),
                400,
                "parameter_unknown",
                Some("customr"),
            ),
            (json!({}), 400, "parameter_missing", Some("amount")),
        ],
    )
    .await;
}

#[tokio::test]
async fn wrong_types_are_refused() {
    let app = spawn_app().await;
    check_json(
        &app,
        vec![
            (
                with("currency", json!(840)),
                400,
                "parameter_invalid_type",
                Some("currency"),
            ),
            (
                with("source", json!({"number": "4242"})),
                400,
                "parameter_invalid_type",
                Some("source"),
            ),
            (
                with("description", json!(42)),
                400,
                "parameter_invalid_type",
                Some("description"),
            ),
            (
                with("metadata", json!("order=1")),
                400,
                "metadata_invalid",
                Some("metadata"),
            ),
            (
                with("metadata", json!({"n": 1})),
                400,
                "metadata_invalid",
                Some("metadata[n]"),
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn bad_amounts_are_refused() {
    let app = spawn_app().await;
    check_json(
        &app,
        vec![
            (
                with("amount", json!(0)),
                400,
                "parameter_invalid_integer",
                Some("amount"),
            ),
            (
                with("amount", json!(-2000)),
                400,
                "parameter_invalid_integer",
                Some("amount"),
            ),
            (
                with("amount", json!(49)),
                400,
                "amount_too_small",
                Some("amount"),
            ),
            (
                with("amount", json!(20.5)),
                400,
                "parameter_invalid_integer",
                Some("amount"),
            ),
            (
                with("amount", json!(1e3)),
                400,
                "parameter_invalid_integer",
                Some("amount"),
            ),
            (
                with("amount", json!("2000")),
                400,
                "parameter_invalid_integer",
                Some("amount"),
            ),
            (
                with("amount", json!(100_000_000)),
                400,
                "amount_too_large",
                Some("amount"),
            ),
            (
                with("amount", json!(u64::MAX)),
                400,
                "amount_too_large",
                Some("amount"),
            ),
            (
                with("amount", json!(1e300)),
                400,
                "parameter_invalid_integer",
                Some("amount"),
            ),
        ],
    )
    .await;
    // In a form, the amount must be digits.
    for (form, code) in [
        (
            "amount=20.50&currency=usd&source=tok_visa",
            "parameter_invalid_integer",
        ),
        (
            "amount=twenty&currency=usd&source=tok_visa",
            "parameter_invalid_integer",
        ),
        (
            "amount=-1&currency=usd&source=tok_visa",
            "parameter_invalid_integer",
        ),
        ("amount=5&currency=usd&source=tok_visa", "amount_too_small"),
        (
            "amount=100000000&currency=usd&source=tok_visa",
            "amount_too_large",
        ),
        (
            "amount=1&amount=2&currency=usd&source=tok_visa",
            "parameter_duplicate",
        ),
    ] {
        let answer = Answer::of(
            app.post_raw(Some("f"), "application/x-www-form-urlencoded", form)
                .await,
        )
        .await;
        answer.assert_problem(400, code);
    }
    assert_nothing_written(counts(&app).await, "form amounts");
}

#[tokio::test]
async fn unknown_currencies_and_sources_are_refused() {
    let app = spawn_app().await;
    check_json(
        &app,
        vec![
            (
                with("currency", json!("usx")),
                400,
                "invalid_currency",
                Some("currency"),
            ),
            (
                with("currency", json!("dollars")),
                400,
                "invalid_currency",
                Some("currency"),
            ),
            (
                with("currency", json!("")),
                400,
                "invalid_currency",
                Some("currency"),
            ),
            (
                with("source", json!("tok_unknown")),
                400,
                "resource_missing",
                Some("source"),
            ),
            (
                with("source", json!("4242424242424242")),
                400,
                "resource_missing",
                Some("source"),
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn oversized_strings_and_metadata_are_refused() {
    let app = spawn_app().await;
    let many: serde_json::Map<String, Value> =
        (0..51).map(|i| (format!("k{i}"), json!("v"))).collect();
    check_json(
        &app,
        vec![
            (
                with("description", json!("d".repeat(1001))),
                400,
                "parameter_too_long",
                Some("description"),
            ),
            (
                with("metadata", Value::Object(many)),
                400,
                "metadata_invalid",
                Some("metadata"),
            ),
            (
                with("metadata", json!({"k".repeat(41): "v"})),
                400,
                "metadata_invalid",
                None,
            ),
            (
                with("metadata", json!({"": "v"})),
                400,
                "metadata_invalid",
                Some("metadata[]"),
            ),
            (
                with("metadata", json!({"k": "v".repeat(501)})),
                400,
                "metadata_invalid",
                Some("metadata[k]"),
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn an_over_long_body_is_413() {
    let app = spawn_app_with(Settings::new().set("MAX_BODY_BYTES", 1024)).await;
    let body = with("description", json!("d".repeat(2000))).to_string();
    let answer = Answer::of(app.post_raw(Some("k"), "application/json", body).await).await;
    answer.assert_problem(413, "payload_too_large");
    assert_nothing_written(counts(&app).await, "413");
}

#[tokio::test]
async fn bad_idempotency_keys_are_400() {
    let app = spawn_app().await;
    let body = json!({"amount": 2000, "currency": "usd", "source": "tok_visa"});
    let long = "k".repeat(256);
    let bad: Vec<&[u8]> = vec![
        b"",
        b"has space",
        long.as_bytes(),
        b"caf\xc3\xa9",
        b"\"open",
        b"\"\"",
    ];
    for key in bad {
        let response = app
            .client
            .post(app.url("/v1/charges"))
            .bearer_auth(&app.api_key)
            .header(
                "Idempotency-Key",
                reqwest::header::HeaderValue::from_bytes(key).unwrap(),
            )
            .json(&body)
            .send()
            .await
            .unwrap();
        let answer = Answer::of(response).await;
        answer.assert_problem(400, "invalid_idempotency_key");
    }
    let twice = app
        .client
        .post(app.url("/v1/charges"))
        .bearer_auth(&app.api_key)
        .header("Idempotency-Key", "a")
        .header("Idempotency-Key", "b")
        .json(&body)
        .send()
        .await
        .unwrap();
    Answer::of(twice)
        .await
        .assert_problem(400, "invalid_idempotency_key");
    assert_nothing_written(counts(&app).await, "bad keys");
}

#[tokio::test]
async fn nul_characters_are_400_and_write_nothing() {
    let app = spawn_app().await;
    check_json(
        &app,
        vec![
            (
                with("description", json!("a\u{0}b")),
                400,
                "parameter_invalid_string",
                Some("description"),
            ),
            (
                with("metadata", json!({"k": "v\u{0}"})),
                400,
                "parameter_invalid_string",
                Some("metadata[k]"),
            ),
            (
                with("metadata", json!({"k\u{0}": "v"})),
                400,
                "parameter_invalid_string",
                None,
            ),
        ],
    )
    .await;
    let form = "amount=1&currency=usd&source=tok_visa&description=a%00b";
    let answer = Answer::of(
        app.post_raw(Some("f"), "application/x-www-form-urlencoded", form)
            .await,
    )
    .await;
    answer.assert_problem(400, "parameter_invalid_string");
    Answer::of(app.get("/v1/charges/ch_%00").await)
        .await
        .assert_problem(404, "resource_missing");
    Answer::of(app.get("/v1/charges?starting_after=%00").await)
        .await
        .assert_problem(400, "parameter_invalid_string");
    assert_nothing_written(counts(&app).await, "NUL");
}

/// A problem that names a long client-given string: never empty, and the
/// name cut to 100 characters and a `…` in both `param` and `detail`.
#[track_caller]
fn assert_shortened(answer: &Answer, status: u16, code: &str, param: &str) {
    assert!(!answer.body.is_empty(), "{code}: an empty problem body");
    answer.assert_problem(status, code);
    let body = answer.json();
    assert_eq!(body["param"], param, "{code}");
    let detail = body["detail"].as_str().unwrap();
    let name = param.trim_start_matches("metadata[").trim_end_matches(']');
    assert!(detail.contains(name) && detail.len() < 300, "{detail}");
    assert!(body["request_id"].is_string(), "{body}");
}

#[tokio::test]
async fn a_huge_parameter_name_gets_a_problem_naming_it_shortened() {
    let app = spawn_app().await;
    let name = "a".repeat(60 * 1024);
    let short = format!("{}…", "a".repeat(100));

    let json = format!(r#"{{"amount":1,"currency":"usd","source":"tok_visa","{name}": 1}}"#);
    let answer = Answer::of(app.post_raw(Some("j"), "application/json", json).await).await;
    assert_shortened(&answer, 400, "parameter_unknown", &short);

    let form = format!("amount=1&currency=usd&source=tok_visa&{name}=1");
    let answer = Answer::of(
        app.post_raw(Some("f"), "application/x-www-form-urlencoded", form)
            .await,
    )
    .await;
    assert_shortened(&answer, 400, "parameter_unknown", &short);

    let nested = format!("amount=1&currency=usd&source=tok_visa&{name}[a][b]=1");
    let answer = Answer::of(
        app.post_raw(Some("n"), "application/x-www-form-urlencoded", nested)
            .await,
    )
    .await;
    assert_eq!(
        answer.json()["param"].as_str().unwrap().chars().count(),
        101
    );

    let half = &name[..30 * 1024];
    let repeated = format!("{half}=1&{half}=2");
    let answer = Answer::of(
        app.post_raw(Some("r"), "application/x-www-form-urlencoded", repeated)
            .await,
    )
    .await;
    assert_shortened(&answer, 400, "parameter_duplicate", &short);

    let metadata = format!(
        r#"{{"amount":1,"currency":"usd","source":"tok_visa","metadata":{{"{name}":"v"}}}}"#
    );
    let answer = Answer::of(app.post_raw(Some("m"), "application/json", metadata).await).await;
    assert_eq!(answer.json()["param"], format!("metadata[{short}]"));

    let answer = Answer::of(app.get(&format!("/v1/charges?{name}=1")).await).await;
    assert_shortened(&answer, 400, "parameter_unknown", &short);
    assert_nothing_written(counts(&app).await, "huge names");
}

#[tokio::test]
async fn a_json_body_that_repeats_a_key_is_refused_at_any_depth() {
    let app = spawn_app().await;
    for (i, (body, param)) in [
        (
            r#"{"amount":100,"currency":"usd","source":"tok_visa","amount":100000}"#,
            "amount",
        ),
        (
            r#"{"amount":100,"currency":"usd","source":"tok_visa","metadata":{"order":"1","order":"2"}}"#,
            "metadata[order]",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let answer = Answer::of(
            app.post_raw(Some(&format!("dup-{i}")), "application/json", body)
                .await,
        )
        .await;
        answer.assert_problem(400, "parameter_duplicate");
        assert_eq!(answer.json()["param"], param, "{body}");
        assert_nothing_written(counts(&app).await, body);
    }
    // The same body without the repeat is a charge.
    let answer = Answer::of(
        app.post_raw(
            Some("ok"),
            "application/json",
            r#"{"amount":100,"currency":"usd","source":"tok_visa","metadata":{"order":"1"}}"#,
        )
        .await,
    )
    .await;
    assert_eq!(answer.status, 201);
}

/// Sends `request`, raw bytes, on a connection of its own, and reads the
/// answer (the request asks the server to close the connection after it).
async fn raw_exchange(app: &TestApp, request: String) -> Answer {
    let address = app.address.trim_start_matches("http://").to_owned();
    let raw = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer: {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let mut headers = reqwest::header::HeaderMap::new();
    for line in lines {
        let (name, value) = line.split_once(':').unwrap();
        headers.append(
            reqwest::header::HeaderName::from_bytes(name.trim().as_bytes()).unwrap(),
            value.trim().parse().unwrap(),
        );
    }
    Answer {
        status,
        headers,
        body: bytes::Bytes::copy_from_slice(&raw[split + 4..]),
    }
}

#[tokio::test]
async fn a_body_that_cannot_be_read_is_400_invalid_body_and_leaves_the_key_free() {
    let app = spawn_app().await;
    for route in ["/v1/charges", "/v1/refunds"] {
        // A chunked body whose second chunk size is not a number.
        let request = format!(
            "POST {route} HTTP/1.1\r\nHost: oncepay\r\nAuthorization: Bearer {}\r\n\
             Idempotency-Key: torn\r\nContent-Type: application/json\r\n\
             Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
             5\r\n{{\"amo\r\nzz\r\n",
            app.api_key
        );
        let answer = raw_exchange(&app, request).await;
        answer.assert_problem(400, "invalid_body");
        assert_nothing_written(counts(&app).await, route);
    }
    let retry = Answer::of(app.post_charge(Some("torn"), &visa(2000)).await).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
}

#[tokio::test]
async fn a_path_that_cannot_be_read_is_400_invalid_path() {
    let app = spawn_app().await;
    app.paid_charge(2000).await;
    for path in [
        "/v1/charges/ch_%FF",
        "/v1/refunds/re_%FF",
        "/v1/idempotency_keys/%C3%28",
    ] {
        let answer = Answer::of(app.get(path).await).await;
        answer.assert_problem(400, "invalid_path");
        assert!(answer.json()["request_id"].is_string(), "{path}");
    }
    assert_eq!((app.charges().await, app.keys().await), (1, 0));
}

/// `POST /v1/charges` with a form body.
async fn post_form(app: &TestApp, key: &str, form: &str) -> Answer {
    Answer::of(
        app.post_raw(
            Some(key),
            "application/x-www-form-urlencoded",
            form.to_owned(),
        )
        .await,
    )
    .await
}

#[tokio::test]
async fn form_bytes_that_are_not_utf8_are_refused_naming_the_parameter_so_two_bodies_never_share_a_fingerprint()
 {
    let app = spawn_app().await;
    let base = "amount=2000&currency=usd&source=tok_visa";
    // A literal U+FFFD is text like any other: a charge.
    let first = post_form(&app, "k", &format!("{base}&description=%EF%BF%BD")).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // %FF and %FE are other bodies, not that one: never its replay.
    for (form, param) in [
        (format!("{base}&description=%FF"), "description"),
        (format!("{base}&description=%FE"), "description"),
        (format!("{base}&metadata[k]=caf%E9"), "metadata[k]"),
        (format!("{base}&description%FF=x"), "description\u{FFFD}"),
    ] {
        let answer = post_form(&app, "k", &form).await;
        answer.assert_problem(400, "parameter_invalid_string");
        assert!(!answer.replayed(), "{form}");
        assert_eq!(answer.json()["param"], param, "{form}");
        assert!(answer.json()["request_id"].is_string(), "{form}");
        // With a fresh key too: refused before anything is written.
        post_form(&app, "fresh", &form)
            .await
            .assert_problem(400, "parameter_invalid_string");
    }
    // A query string is read the same way.
    Answer::of(app.get("/v1/charges?starting_after=ch_%FF").await)
        .await
        .assert_problem(400, "parameter_invalid_string");
    Answer::of(app.get("/v1/events?type=%FF").await)
        .await
        .assert_problem(400, "parameter_invalid_string");
    assert_eq!((app.charges().await, app.keys().await), (1, 1));
    assert_eq!(app.payments().await, 1);
}
