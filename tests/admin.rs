//! The admin and ingest HTTP API through `router(state).oneshot(request)`: every route and
//! its documented error statuses, the IETF Idempotency-Key matrix (including a request for
//! a key still in flight), auth, body limits, odd bytes in path parameters, forgetting a
//! claim, replaying a dead letter through the current handler, handler upload/rollback,
//! maintenance and metrics. Handler components come from `plugins/` (built by
//! `plugins/build.sh`, which `scripts/test` runs first); a missing one fails the test.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;
#[path = "common/schema.rs"]
mod schema;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use dedupd::admin::{openapi, router, AdminState};
use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::Ledger;
use serde_json::{json, Value};
use tower::ServiceExt;

use common::component;

const TOKEN: &str = "test-token-0123456789";

struct Api {
    _dir: tempfile::TempDir,
    state: AdminState,
    router: Router,
    token: Option<&'static str>,
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
    text: String,
}

impl Api {
    fn new(toml: &str, token: Option<&'static str>) -> Api {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::parse(toml).unwrap();
        let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
        let state = AdminState::new(ledger, &config, token.map(str::to_string)).unwrap();
        Api {
            _dir: dir,
            router: router(state.clone()),
            state,
            token,
        }
    }

    fn open() -> Api {
        Api::new("[ledger]\nshards = 2\n", None)
    }

    /// Sends `req`; every answer is checked against what `/openapi.json` documents for it.
    async fn send(&self, req: Request<Body>) -> Reply {
        let (method, path) = (req.method().clone(), req.uri().path().to_string());
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        schema::check_answer(method.as_str(), &path, status, &headers, &bytes);
        let text = String::from_utf8_lossy(&bytes).to_string();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
            text,
        }
    }

    /// A request carrying the configured token (if any).
    fn req(&self, method: &str, uri: &str) -> axum::http::request::Builder {
        let b = Request::builder().method(method).uri(uri);
        match self.token {
            Some(t) => b.header("authorization", format!("Bearer {t}")),
            None => b,
        }
    }

    async fn call(&self, method: &str, uri: &str, body: Option<Value>) -> Reply {
        let b = self.req(method, uri);
        let req = match body {
            Some(v) => b
                .header("content-type", "application/json")
                .body(Body::from(v.to_string()))
                .unwrap(),
            None => b.body(Body::empty()).unwrap(),
        };
        self.send(req).await
    }

    async fn ingest(&self, sub: &str, key: Option<&str>, payload: &str) -> Reply {
        let mut b = self
            .req("POST", &format!("/v1/subscribers/{sub}/messages"))
            .header("content-type", "application/json");
        if let Some(k) = key {
            b = b.header("idempotency-key", k);
        }
        self.send(b.body(Body::from(payload.to_string())).unwrap())
            .await
    }

    async fn upload(&self, sub: &str, name: &str) -> Reply {
        let bytes = std::fs::read(component(name)).unwrap();
        let req = self
            .req("PUT", &format!("/v1/subscribers/{sub}/handler"))
            .header("content-type", "application/wasm")
            .body(Body::from(bytes))
            .unwrap();
        self.send(req).await
    }

    /// Waits (with a deadline) until `n` requests wait for an outcome.
    async fn wait_for_waiting(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.state.waiting() < n {
            assert!(Instant::now() < deadline, "no request became in flight");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn assert_error(r: &Reply, status: StatusCode, code: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    assert_eq!(r.body["error"], code, "{}", r.text);
    assert!(r.body["message"].as_str().is_some_and(|m| !m.is_empty()));
}

// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn health_and_readiness_answer_ok() {
    let api = Api::open();
    let r = api.call("GET", "/healthz", None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body["status"], "ok");
    let r = api.call("GET", "/readyz", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["shards"], 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_is_503_after_a_storage_error_and_5xx_bodies_hide_internals() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::parse("[ledger]\nshards = 1\n").unwrap();
    let (ledger, switch) =
        Ledger::open_with_fault_switch(dir.path(), &config, Arc::new(SystemClock)).unwrap();
    let state = AdminState::new(Arc::new(ledger), &config, None).unwrap();
    let app = router(state);
    switch.fail_after_fsyncs(0);
    let req = Request::builder()
        .method("POST")
        .uri("/v1/subscribers/s/messages")
        .header("content-type", "application/json")
        .header("idempotency-key", "k1")
        .body(Body::from("{}"))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains(dir.path().to_str().unwrap()) && !text.contains("redb"),
        "a 5xx body must not carry internals: {text}"
    );
    let resp = app
        .oneshot(Request::get("/readyz").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(flavor = "multi_thread")]
async fn ingest_follows_the_idempotency_key_matrix() {
    let api = Api::open();
    // First request: processed, 201, no replay header.
    let first = api
        .ingest("orders", Some("order-1"), r#"{"total": 5}"#)
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text);
    assert_eq!(first.body["outcome"], "processed");
    assert!(first.headers.get("idempotent-replayed").is_none());
    // Retry with the same key and payload (re-encoded): the stored response, replayed.
    let again = api
        .ingest("orders", Some("order-1"), r#"{ "total" : 5 }"#)
        .await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.text);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.body, first.body);
    // Same key, another payload: 422, and the message is quarantined (G4).
    let other = api
        .ingest("orders", Some("order-1"), r#"{"total": 6}"#)
        .await;
    assert_error(&other, StatusCode::UNPROCESSABLE_ENTITY, "payload_mismatch");
    let q = api
        .call("GET", "/v1/subscribers/orders/quarantine", None)
        .await;
    assert_eq!(q.body["records"].as_array().unwrap().len(), 1, "{}", q.text);
    // No key at all: 400 naming the header.
    let none = api.ingest("orders", None, r#"{"total": 5}"#).await;
    assert_error(&none, StatusCode::BAD_REQUEST, "bad_request");
    assert_eq!(none.body["field"], "idempotency-key");
    let empty = api.ingest("orders", Some("  "), r#"{"total": 5}"#).await;
    assert_error(&empty, StatusCode::BAD_REQUEST, "bad_request");
    // The subscriber's key source may find the key in the body instead.
    let by_id = api.ingest("orders", None, r#"{"id": "order-2"}"#).await;
    assert_eq!(by_id.status, StatusCode::CREATED, "{}", by_id.text);
    assert_eq!(by_id.body["key"], "order-2");
    // Keys are scoped by subscriber (G5).
    let other_sub = api
        .ingest("billing", Some("order-1"), r#"{"total": 5}"#)
        .await;
    assert_eq!(other_sub.status, StatusCode::CREATED);
    assert!(other_sub.headers.get("idempotent-replayed").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn same_key_in_flight_is_409_then_replayed() {
    // fixture-errors fails "retry" payloads retryably; with a long backoff the first
    // request stays in flight until its second attempt, deterministically.
    let api = Api::new(
        "[ledger]\nshards = 1\n[[subscriber]]\nname = \"slow\"\nmax_attempts = 2\nretry_backoff = \"1500ms\"\n",
        None,
    );
    assert_eq!(
        api.upload("slow", "fixture_errors").await.status,
        StatusCode::OK
    );
    let app = api.router.clone();
    let first = tokio::spawn(async move {
        let req = Request::post("/v1/subscribers/slow/messages")
            .header("content-type", "application/json")
            .header("idempotency-key", "k-inflight")
            .body(Body::from(r#"{"please": "retry"}"#))
            .unwrap();
        app.oneshot(req).await.unwrap().status()
    });
    api.wait_for_waiting(1).await;
    let second = api
        .ingest("slow", Some("k-inflight"), r#"{"please": "retry"}"#)
        .await;
    assert_error(&second, StatusCode::CONFLICT, "in_flight");
    assert_eq!(second.headers["retry-after"], "1");
    // Another key is not blocked by it.
    let other = api.ingest("slow", Some("k-other"), r#"{"ok": 1}"#).await;
    assert_eq!(other.status, StatusCode::CREATED, "{}", other.text);
    // The first one fails for good after its second attempt: dead-lettered, a 500 that
    // says so without internals.
    assert_eq!(first.await.unwrap(), StatusCode::INTERNAL_SERVER_ERROR);
    let dl = api
        .call("GET", "/v1/subscribers/slow/deadletters", None)
        .await;
    assert_eq!(
        dl.body["records"].as_array().unwrap().len(),
        1,
        "{}",
        dl.text
    );
    // Once decided, the key is free again.
    assert_eq!(api.state.waiting(), 0);
}

/// `Prefer: wait=N` (RFC 7240): a retry that arrives while the first request with its key
/// is in flight waits for it and gets the answer a retry gets (the stored response,
/// replayed) instead of 409; the wait is bounded, then it is 409 after all.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_preferring_to_wait_gets_the_first_requests_answer() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[[subscriber]]\nname = \"sleepy\"\nhandler_cpu_budget = \"10s\"\n",
        None,
    );
    assert_eq!(
        api.upload("sleepy", "fixture_sleep").await.status,
        StatusCode::OK
    );
    let first_request = |key: &'static str, ms: &'static str| {
        let app = api.router.clone();
        tokio::spawn(async move {
            let req = Request::post("/v1/subscribers/sleepy/messages")
                .header("content-type", "application/json")
                .header("idempotency-key", key)
                .header("sleep-ms", ms)
                .body(Body::from(r#"{"n": 1}"#))
                .unwrap();
            app.oneshot(req).await.unwrap().status()
        })
    };
    let retry = |key: &'static str, prefer: &'static str| {
        let req = api
            .req("POST", "/v1/subscribers/sleepy/messages")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .header("prefer", prefer)
            .body(Body::from(r#"{"n": 1}"#))
            .unwrap();
        api.send(req)
    };

    let first = first_request("k-wait", "1500");
    api.wait_for_waiting(1).await;
    let waited = retry("k-wait", "respond-async, wait=20").await;
    assert_eq!(waited.status, StatusCode::CREATED, "{}", waited.text);
    assert_eq!(waited.headers["idempotent-replayed"], "true");
    assert_eq!(waited.headers["preference-applied"], "wait=20");
    assert_eq!(waited.body["outcome"], "processed");
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);

    // Bounded: a wait shorter than the first request's work ends in 409.
    let first = first_request("k-short", "3000");
    api.wait_for_waiting(1).await;
    let started = Instant::now();
    let short = retry("k-short", "wait=1").await;
    assert_error(&short, StatusCode::CONFLICT, "in_flight");
    let waited_for = started.elapsed();
    assert!(
        waited_for >= Duration::from_millis(900) && waited_for < Duration::from_millis(2900),
        "{waited_for:?}"
    );
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);
}

/// Retries that wait for a key in flight (`Prefer: wait`) and give up leave nothing
/// behind: whatever waited, the key holds one entry until it is released.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_retries_that_give_up_leave_nothing_behind() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[[subscriber]]\nname = \"sleepy\"\nhandler_cpu_budget = \"10s\"\n",
        None,
    );
    assert_eq!(
        api.upload("sleepy", "fixture_sleep").await.status,
        StatusCode::OK
    );
    let post = |prefer: Option<&'static str>, ms: &'static str| {
        let app = api.router.clone();
        tokio::spawn(async move {
            let mut req = Request::post("/v1/subscribers/sleepy/messages")
                .header("content-type", "application/json")
                .header("idempotency-key", "k-held")
                .header("sleep-ms", ms);
            if let Some(p) = prefer {
                req = req.header("prefer", p);
            }
            app.oneshot(req.body(Body::from(r#"{"n": 1}"#)).unwrap())
                .await
                .unwrap()
                .status()
        })
    };
    let first = post(None, "4000");
    api.wait_for_waiting(1).await;
    let retries: Vec<_> = (0..32).map(|_| post(Some("wait=1"), "0")).collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while api.state.in_flight().1 < 32 {
        assert!(Instant::now() < deadline, "{:?}", api.state.in_flight());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for r in retries {
        assert_eq!(r.await.unwrap(), StatusCode::CONFLICT);
    }
    assert_eq!(api.state.in_flight(), (1, 0), "waiters left behind");
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);
    assert_eq!(api.state.in_flight(), (0, 0));
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_bodies_are_413() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[http]\nmax_body_bytes = 1024\nmax_handler_bytes = 2048\n",
        None,
    );
    let big = format!(r#"{{"x": "{}"}}"#, "a".repeat(4096));
    let r = api.ingest("s", Some("k"), &big).await;
    assert_error(&r, StatusCode::PAYLOAD_TOO_LARGE, "too_large");
    assert!(
        r.body["message"].as_str().unwrap().contains("1024"),
        "{}",
        r.text
    );
    let r = api
        .call(
            "PUT",
            "/v1/subscribers/s/config",
            Some(json!({"x": "a".repeat(4096)})),
        )
        .await;
    assert_error(&r, StatusCode::PAYLOAD_TOO_LARGE, "too_large");
    assert!(
        r.body["message"].as_str().unwrap().contains("1024"),
        "{}",
        r.text
    );
    let r = api.upload("s", "noop").await;
    assert_error(&r, StatusCode::PAYLOAD_TOO_LARGE, "too_large");
    assert!(
        r.body["message"].as_str().unwrap().contains("2048"),
        "{}",
        r.text
    );
    let small = api.ingest("s", Some("k"), r#"{"x": 1}"#).await;
    assert_eq!(small.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread")]
async fn auth_is_required_denied_and_accepted() {
    let api = Api::new("[ledger]\nshards = 1\n", Some(TOKEN));
    let anon = |method: &str, uri: &str| {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::empty())
            .unwrap()
    };
    // Mutating routes and payload reads need the token.
    for (method, uri) in [
        ("POST", "/v1/subscribers/s/messages"),
        ("DELETE", "/v1/subscribers/s/messages/k"),
        ("PUT", "/v1/subscribers/s/config"),
        ("GET", "/v1/subscribers/s/deadletters/0-1"),
        ("GET", "/v1/subscribers/s/quarantine/0-1"),
        ("POST", "/v1/subscribers/s/deadletters/0-1/replay"),
        ("PUT", "/v1/subscribers/s/handler"),
        ("POST", "/v1/maintenance/compact"),
        ("POST", "/v1/maintenance/backup"),
        ("GET", "/v1/audit"),
    ] {
        let r = api.send(anon(method, uri)).await;
        assert_error(&r, StatusCode::UNAUTHORIZED, "unauthorized");
        assert_eq!(r.headers["www-authenticate"], "Bearer", "{method} {uri}");
        let wrong = Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", "Bearer not-the-token-at-all")
            .body(Body::empty())
            .unwrap();
        assert_error(&api.send(wrong).await, StatusCode::FORBIDDEN, "forbidden");
    }
    // Reads without payloads stay open (the dashboard needs no token).
    for uri in [
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/subscribers",
        "/openapi.json",
    ] {
        assert_eq!(
            api.send(anon("GET", uri)).await.status,
            StatusCode::OK,
            "{uri}"
        );
    }
    // The right token is accepted.
    let ok = api.ingest("s", Some("k"), "{}").await;
    assert_eq!(ok.status, StatusCode::CREATED, "{}", ok.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn odd_bytes_in_path_parameters() {
    let api = Api::open();
    // Not UTF-8 after percent-decoding: 400, not a panic or a 500.
    let r = api.call("GET", "/v1/subscribers/%FF%FE/stats", None).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    // A subscriber name outside the safe alphabet (it becomes part of table names).
    let r = api
        .call("GET", "/v1/subscribers/a%2F..%2Fb/config", None)
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    assert_eq!(r.body["field"], "subscriber");
    let r = api.ingest("bad%20name", Some("k"), "{}").await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    // Dot-only names would be directories on disk: refused everywhere.
    for name in ["%2E%2E", "%2E", ".."] {
        let r = api.ingest(name, Some("k"), "{}").await;
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
        let r = api.upload(name, "noop").await;
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    }
    assert!(!api.state.ledger().data_dir().join("current").exists());
    // Message ids may hold anything printable: slashes, spaces, unicode.
    let id = "order/1 ✓ %";
    let r = api.ingest("s", Some("order/1 x"), "{}").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = api
        .call("GET", "/v1/subscribers/s/messages/order%2F1%20x", None)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["id"], "order/1 x");
    let encoded = "order%2F1%20%E2%9C%93%20%25";
    let r = api
        .call(
            "GET",
            &format!("/v1/subscribers/s/messages/{encoded}"),
            None,
        )
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    assert!(
        r.body["message"].as_str().unwrap().contains("order/1"),
        "{id}"
    );
    let r = api
        .call("GET", "/v1/subscribers/s/messages/%C3%28", None)
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    // A header value that is not visible ASCII.
    let req = Request::post("/v1/subscribers/s/messages")
        .header("content-type", "application/json")
        .header(
            "idempotency-key",
            axum::http::HeaderValue::from_bytes(b"k\xff").unwrap(),
        )
        .body(Body::from("{}"))
        .unwrap();
    assert_error(&api.send(req).await, StatusCode::BAD_REQUEST, "bad_request");
}

#[tokio::test(flavor = "multi_thread")]
async fn forgetting_a_key_makes_the_next_delivery_processed_again() {
    let api = Api::open();
    assert_eq!(
        api.ingest("s", Some("k1"), r#"{"a":1}"#).await.status,
        StatusCode::CREATED
    );
    let claim = api.call("GET", "/v1/subscribers/s/messages/k1", None).await;
    assert_eq!(claim.status, StatusCode::OK, "{}", claim.text);
    for field in [
        "processed_at_ms",
        "expires_at_ms",
        "fingerprint",
        "handler_version",
    ] {
        assert!(!claim.body[field].is_null(), "{field}: {}", claim.text);
    }
    assert!(claim.body["expires_at_ms"].as_u64() > claim.body["processed_at_ms"].as_u64());
    let dup = api.ingest("s", Some("k1"), r#"{"a":1}"#).await;
    assert_eq!(dup.headers["idempotent-replayed"], "true");

    let r = api
        .call("DELETE", "/v1/subscribers/s/messages/k1", None)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["forgotten"], true);
    let gone = api.call("GET", "/v1/subscribers/s/messages/k1", None).await;
    assert_error(&gone, StatusCode::NOT_FOUND, "not_found");
    let r = api
        .call("DELETE", "/v1/subscribers/s/messages/k1", None)
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");

    let again = api.ingest("s", Some("k1"), r#"{"a":1}"#).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(
        again.headers.get("idempotent-replayed").is_none(),
        "after forget the delivery is processed again"
    );
    let audit = api.call("GET", "/v1/audit", None).await;
    let entries = audit.body["entries"].as_array().unwrap();
    assert!(
        entries
            .iter()
            .any(|e| e["action"] == "claim.forget" && e["id"] == "k1" && e["subscriber"] == "s"),
        "{}",
        audit.text
    );
    // Unknown subscribers are 404 on reads.
    let r = api
        .call("GET", "/v1/subscribers/nobody/messages/k1", None)
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
}

#[tokio::test(flavor = "multi_thread")]
async fn replaying_a_dead_letter_runs_the_current_handler() {
    let api = Api::new(
        "[ledger]\nshards = 2\n[[subscriber]]\nname = \"labels\"\nmax_attempts = 1\n",
        None,
    );
    let up = api.upload("labels", "fixture_errors").await;
    assert_eq!(up.status, StatusCode::OK, "{}", up.text);
    let errors_version = up.body["current"].as_str().unwrap().to_string();
    let req = Request::post("/v1/subscribers/labels/messages")
        .header("content-type", "application/json")
        .header("idempotency-key", "m1")
        .header("authorization", "Bearer secret-credential-xyz")
        .header("x-trace", "trace-7")
        .body(Body::from(r#"{"order_id": "o1", "mode": "permanent"}"#))
        .unwrap();
    let r = api.send(req).await;
    assert_error(&r, StatusCode::INTERNAL_SERVER_ERROR, "dead_lettered");
    let list = api
        .call("GET", "/v1/subscribers/labels/deadletters", None)
        .await;
    let records = list.body["records"].as_array().unwrap().clone();
    assert_eq!(records.len(), 1, "{}", list.text);
    assert!(
        records[0].get("payload").is_none(),
        "lists carry no payloads"
    );
    let rid = records[0]["id"].as_str().unwrap().to_string();
    let one = api
        .call(
            "GET",
            &format!("/v1/subscribers/labels/deadletters/{rid}"),
            None,
        )
        .await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.text);
    assert!(one.text.contains("permanent"), "{}", one.text);
    assert_eq!(one.body["message_id"], "m1", "{}", one.text);
    assert!(
        one.text.contains("trace-7"),
        "message headers are kept: {}",
        one.text
    );
    assert!(
        !one.text.contains("secret-credential"),
        "credentials are not message headers: {}",
        one.text
    );

    // Install a handler that accepts it, then replay: processed by the new version.
    let noop = api.upload("labels", "noop").await;
    assert_eq!(noop.status, StatusCode::OK, "{}", noop.text);
    assert_eq!(noop.body["previous"], errors_version.as_str());
    let noop_version = noop.body["current"].as_str().unwrap().to_string();
    let r = api
        .call(
            "POST",
            &format!("/v1/subscribers/labels/deadletters/{rid}/replay"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["outcome"], "processed");
    let claim = api
        .call("GET", "/v1/subscribers/labels/messages/m1", None)
        .await;
    assert_eq!(claim.status, StatusCode::OK, "{}", claim.text);
    assert_eq!(claim.body["handler_version"], noop_version.as_str());
    let list = api
        .call("GET", "/v1/subscribers/labels/deadletters", None)
        .await;
    assert_eq!(
        list.body["records"].as_array().unwrap().len(),
        0,
        "{}",
        list.text
    );
    let r = api
        .call(
            "POST",
            &format!("/v1/subscribers/labels/deadletters/{rid}/replay"),
            None,
        )
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    // The retry of the original request is now a replay.
    let retry = api
        .ingest(
            "labels",
            Some("m1"),
            r#"{"order_id": "o1", "mode": "permanent"}"#,
        )
        .await;
    assert_eq!(
        retry.headers["idempotent-replayed"], "true",
        "{}",
        retry.text
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn quarantine_can_be_listed_inspected_and_discarded() {
    let api = Api::open();
    api.ingest("s", Some("q1"), r#"{"v":1}"#).await;
    let r = api.ingest("s", Some("q1"), r#"{"v":2}"#).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    // The same mismatch again: counted on the record already kept, not stored twice.
    let r = api.ingest("s", Some("q1"), r#"{"v":2}"#).await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    let list = api
        .call("GET", "/v1/subscribers/s/quarantine?limit=10", None)
        .await;
    assert_eq!(
        list.body["records"].as_array().unwrap().len(),
        1,
        "{}",
        list.text
    );
    assert_eq!(list.body["records"][0]["count"], 2, "{}", list.text);
    assert!(list.body["records"][0]["last_seen_ms"].as_u64().is_some());
    let stats = api.call("GET", "/v1/subscribers/s/stats", None).await;
    assert_eq!(stats.body["quarantined"], 2, "{}", stats.text);
    assert_eq!(stats.body["quarantine_stored"], 1, "{}", stats.text);
    let rid = list.body["records"][0]["id"].as_str().unwrap().to_string();
    let one = api
        .call("GET", &format!("/v1/subscribers/s/quarantine/{rid}"), None)
        .await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.text);
    assert!(
        one.text.contains("\\\"v\\\":2") || one.text.contains("\"v\":2"),
        "{}",
        one.text
    );
    let r = api
        .call(
            "DELETE",
            &format!("/v1/subscribers/s/quarantine/{rid}"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = api
        .call(
            "DELETE",
            &format!("/v1/subscribers/s/quarantine/{rid}"),
            None,
        )
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    let r = api
        .call("GET", &format!("/v1/subscribers/s/quarantine/{rid}"), None)
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    let r = api
        .call(
            "POST",
            &format!("/v1/subscribers/s/quarantine/{rid}/replay"),
            None,
        )
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    let r = api
        .call("GET", "/v1/subscribers/s/quarantine?limit=0", None)
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    let r = api
        .call("GET", "/v1/subscribers/s/quarantine?limit=x", None)
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
}

#[tokio::test(flavor = "multi_thread")]
async fn records_are_paged() {
    let api = Api::open();
    for i in 0..5 {
        let k = format!("p{i}");
        api.ingest("s", Some(&k), r#"{"v":1}"#).await;
        api.ingest("s", Some(&k), r#"{"v":2}"#).await;
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let uri = match &after {
            Some(a) => format!("/v1/subscribers/s/quarantine?limit=2&after={a}"),
            None => "/v1/subscribers/s/quarantine?limit=2".to_string(),
        };
        let page = api.call("GET", &uri, None).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.text);
        for r in page.body["records"].as_array().unwrap() {
            seen.push(r["id"].as_str().unwrap().to_string());
        }
        match page.body["next"].as_str() {
            Some(n) => after = Some(n.to_string()),
            None => break,
        }
    }
    assert_eq!(seen.len(), 5, "{seen:?}");
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn config_is_read_validated_and_changed() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[[subscriber]]\nname = \"billing\"\nttl = \"24h\"\n",
        None,
    );
    let r = api
        .call("GET", "/v1/subscribers/billing/config", None)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["config"]["ttl"], "1day");
    for (body, field) in [
        (json!({"ttl": "10ms"}), "ttl"),
        (json!({"ttll": "1h"}), "ttll"),
        (json!({"sliding_ttl": "yes"}), "sliding_ttl"),
        (json!({"max_attempts": 0}), "max_attempts"),
        (
            json!({"key": {"source": "json_pointer", "pointer": "no-slash"}}),
            "key.pointer",
        ),
        (
            json!({"partition_key": {"source": "envelope_key"}}),
            "partition_key",
        ),
        (json!({"handler": "/etc/passwd"}), "handler"),
    ] {
        let r = api
            .call("PUT", "/v1/subscribers/billing/config", Some(body.clone()))
            .await;
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
        assert_eq!(r.body["field"], field, "{body}: {}", r.text);
    }
    let r = api
        .call("PUT", "/v1/subscribers/billing/config", Some(json!([1, 2])))
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    let r = api
        .call(
            "PUT",
            "/v1/subscribers/billing/config",
            Some(
                json!({"ttl": "2h", "sliding_ttl": true, "max_attempts": 5, "retry_backoff": "1s"}),
            ),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = api
        .call("GET", "/v1/subscribers/billing/config", None)
        .await;
    assert_eq!(r.body["config"]["ttl"], "2h");
    assert_eq!(r.body["config"]["sliding_ttl"], true);
    assert_eq!(r.body["config"]["max_attempts"], 5);
    // A new claim expires by the new TTL.
    api.ingest("billing", Some("b1"), "{}").await;
    let c = api
        .call("GET", "/v1/subscribers/billing/messages/b1", None)
        .await;
    let ttl_ms =
        c.body["expires_at_ms"].as_u64().unwrap() - c.body["processed_at_ms"].as_u64().unwrap();
    assert_eq!(ttl_ms, 2 * 3600 * 1000, "{}", c.text);
    let audit = api.call("GET", "/v1/audit?limit=5", None).await;
    assert!(audit.text.contains("config.update"), "{}", audit.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn subscribers_and_stats_show_counts() {
    let api = Api::new(
        "[ledger]\nshards = 2\n[[subscriber]]\nname = \"idle\"\n",
        None,
    );
    api.ingest("s", Some("a"), "{}").await;
    api.ingest("s", Some("a"), "{}").await;
    api.ingest("s", Some("b"), "{}").await;
    let list = api.call("GET", "/v1/subscribers", None).await;
    assert_eq!(list.status, StatusCode::OK);
    let names: Vec<&str> = list.body["subscribers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["subscriber"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["idle", "s"],
        "configured subscribers are listed before traffic"
    );
    let stats = api.call("GET", "/v1/subscribers/s/stats", None).await;
    assert_eq!(stats.body["processed"], 2, "{}", stats.text);
    assert_eq!(stats.body["duplicates"], 1);
    assert_eq!(stats.body["claims_stored"], 2);
    assert!(stats.body["data_dir_bytes"].as_u64().unwrap() > 0);
    assert!(stats.body["filter_false_positive_rate"].as_f64().is_some());
    let one = api.call("GET", "/v1/subscribers/s", None).await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.text);
    assert_eq!(one.body["stats"]["processed"], 2);
    assert!(one.body["config"]["ttl"].is_string());
    for uri in [
        "/v1/subscribers/nobody",
        "/v1/subscribers/nobody/stats",
        "/v1/subscribers/nobody/config",
        "/v1/subscribers/nobody/handler",
        "/v1/subscribers/nobody/deadletters",
    ] {
        assert_error(
            &api.call("GET", uri, None).await,
            StatusCode::NOT_FOUND,
            "not_found",
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_subscribers_are_refused_when_the_config_says_so() {
    let api = Api::new(
        "allow_unknown_subscribers = false\n[ledger]\nshards = 1\n",
        None,
    );
    let r = api.ingest("stranger", Some("k"), "{}").await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
}

#[tokio::test(flavor = "multi_thread")]
async fn handler_upload_is_validated_and_can_roll_back() {
    let api = Api::open();
    // Not a component: 400, nothing installed.
    let req = api
        .req("PUT", "/v1/subscribers/s/handler")
        .header("content-type", "application/wasm")
        .body(Body::from("definitely not wasm"))
        .unwrap();
    let r = api.send(req).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    let req = api
        .req("PUT", "/v1/subscribers/s/handler")
        .body(Body::empty())
        .unwrap();
    assert_error(&api.send(req).await, StatusCode::BAD_REQUEST, "bad_request");
    // A component that asks for a capability dedupd does not grant is refused by name.
    let req = api
        .req("PUT", "/v1/subscribers/s/handler")
        .header("content-type", "application/wasm")
        .body(Body::from(common::component_importing(
            "wasi:http/outgoing-handler@0.2.0",
        )))
        .unwrap();
    let r = api.send(req).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    assert!(r.text.contains("wasi:http/outgoing-handler"), "{}", r.text);
    // Refused uploads register no subscriber (they use up no implicit subscriber).
    let r = api.call("GET", "/v1/subscribers/s/handler", None).await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    let r = api
        .call("POST", "/v1/subscribers/s/handler/rollback", None)
        .await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");

    let a = api.upload("s", "noop").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    let b = api.upload("s", "fixture_errors").await;
    assert_eq!(b.status, StatusCode::OK, "{}", b.text);
    assert_eq!(b.body["active_version"], b.body["current"]);
    assert_eq!(b.body["previous"], a.body["current"]);
    let r = api
        .call("POST", "/v1/subscribers/s/handler/rollback", None)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["current"], a.body["current"]);
    assert_eq!(r.body["active_version"], a.body["current"]);
    assert_eq!(r.body["previous"], b.body["current"]);
    // Files live only under the data directory.
    let data = api.state.ledger().data_dir().join("handlers/s");
    let stored = std::fs::read_dir(&data).unwrap().count();
    assert!(
        stored >= 4,
        "two components and two pointers in {}",
        data.display()
    );
    let audit = api.call("GET", "/v1/audit", None).await;
    assert!(audit.text.contains("handler.upload") && audit.text.contains("handler.rollback"));
}

#[tokio::test(flavor = "multi_thread")]
async fn handler_upload_is_documented_and_accepted_as_octet_stream() {
    // The document offers a type generic clients and fuzzers can send bytes as (they have
    // no serializer for application/wasm), and the route takes it.
    let doc = &openapi()["paths"]["/v1/subscribers/{s}/handler"]["put"]["requestBody"];
    assert_eq!(doc["required"], true, "{doc}");
    let types: Vec<&String> = doc["content"].as_object().unwrap().keys().collect();
    assert_eq!(
        types,
        ["application/octet-stream", "application/wasm"],
        "{doc}"
    );
    for t in types {
        assert_eq!(
            doc["content"][t]["schema"],
            json!({"type": "string", "format": "binary"}),
            "{t}: the body is the component's bytes, not a JSON array of numbers"
        );
    }
    let api = Api::open();
    let req = api
        .req("PUT", "/v1/subscribers/s/handler")
        .header("content-type", "application/octet-stream")
        .body(Body::from(std::fs::read(component("noop")).unwrap()))
        .unwrap();
    let r = api.send(req).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["active_version"], r.body["current"]);
    // Without a token a form type is still refused, and the answer says what to send.
    let req = api
        .req("PUT", "/v1/subscribers/s/handler")
        .header("content-type", "text/plain")
        .body(Body::from(std::fs::read(component("noop")).unwrap()))
        .unwrap();
    let r = api.send(req).await;
    assert_error(
        &r,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    );
    assert!(r.text.contains("application/octet-stream"), "{}", r.text);
}

/// The ingest route takes opaque payloads under their own type, and with a token even the
/// form types; the document listed only `application/json`, so generated clients and
/// fuzzers never sent anything else. Each documented type is taken, and the document says
/// which types are refused without a token.
#[tokio::test(flavor = "multi_thread")]
async fn ingest_documents_the_content_types_it_takes() {
    let doc = &openapi()["paths"]["/v1/subscribers/{s}/messages"]["post"]["requestBody"];
    let types: Vec<&String> = doc["content"].as_object().unwrap().keys().collect();
    assert_eq!(
        types,
        ["application/json", "application/octet-stream", "text/plain"],
        "{doc}"
    );
    assert_eq!(
        doc["content"]["application/octet-stream"]["schema"],
        json!({"type": "string", "format": "binary"}),
        "{doc}"
    );
    assert_eq!(doc["content"]["text/plain"]["schema"]["type"], "string");
    let text = doc["description"].as_str().unwrap();
    for refused in ["text/plain", "multipart/form-data", "415", "http.token"] {
        assert!(text.contains(refused), "{refused}: {text}");
    }
    let api = Api::new("[ledger]\nshards = 1\n", Some(TOKEN));
    for (i, (t, body)) in [
        ("application/json", "{\"a\": 1}"),
        ("application/octet-stream", "\u{0}\u{1}not json"),
        ("text/plain", "hello"),
    ]
    .into_iter()
    .enumerate()
    {
        let req = api
            .req("POST", "/v1/subscribers/s/messages")
            .header("content-type", t)
            .header("idempotency-key", format!("typed-{i}"))
            .body(Body::from(body))
            .unwrap();
        let r = api.send(req).await;
        assert_eq!(r.status, StatusCode::CREATED, "{t}: {}", r.text);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn config_request_schema_lists_only_the_settable_fields() {
    let body = &openapi()["paths"]["/v1/subscribers/{s}/config"]["put"]["requestBody"];
    let schema = schema::resolved(&body["content"]["application/json"]["schema"]);
    let mut fields: Vec<&String> = schema["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("no properties: {schema}"))
        .keys()
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        [
            "fingerprint",
            "handler_breaker_cooldown",
            "handler_breaker_failures",
            "handler_cpu_budget",
            "handler_max_write_mib",
            "handler_max_writes",
            "handler_memory_mib",
            "key",
            "max_attempts",
            "max_backoff",
            "max_key_bytes",
            "retry_backoff",
            "sliding_ttl",
            "ttl",
        ],
        "{schema}"
    );
    // What the route refuses for its shape the schema refuses; what it takes, it admits.
    let api = Api::open();
    for refused in [
        json!({"name": "s"}),
        json!({"handler": "/etc/passwd"}),
        json!({"partition_key": {"source": "envelope_key"}}),
        json!({"ttll": "1h"}),
    ] {
        assert!(
            !schema::validates(schema, &refused),
            "the documented schema admits {refused}"
        );
        let r = api
            .call("PUT", "/v1/subscribers/s/config", Some(refused.clone()))
            .await;
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    }
    for taken in [
        json!({}),
        json!({"ttl": "2h", "sliding_ttl": true, "max_attempts": 5, "retry_backoff": "1s"}),
        json!({"key": {"source": "json_pointer", "pointer": "/id"}, "fingerprint": {"ignore": ["/at"]}}),
    ] {
        assert!(
            schema::validates(schema, &taken),
            "the documented schema refuses {taken}"
        );
        let r = api
            .call("PUT", "/v1/subscribers/s/config", Some(taken.clone()))
            .await;
        assert_eq!(r.status, StatusCode::OK, "{taken}: {}", r.text);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn maintenance_compacts_and_backs_up() {
    let api = Api::open();
    for i in 0..20 {
        api.ingest("s", Some(&format!("m{i}")), "{}").await;
    }
    let r = api
        .call("POST", "/v1/maintenance/compact?seal_all=true", None)
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = api
        .call("POST", "/v1/maintenance/compact?seal_all=maybe", None)
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    let r = api
        .call(
            "POST",
            "/v1/maintenance/backup",
            Some(json!({"name": "b1"})),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert!(r.body["bytes"].as_u64().unwrap() > 0);
    assert!(
        r.body["longest_writer_pause_ms"].as_f64().is_some(),
        "{}",
        r.text
    );
    let dir = api.state.ledger().data_dir().join("backups/b1");
    assert!(dir.join("dedupd.manifest.json").exists());
    // The offline layout: checksums in backup.json, which verifies.
    let manifest = dedupd::backup::verify(&dir).unwrap();
    assert!(manifest.online);
    assert_eq!(
        manifest.files.len(),
        r.body["files"].as_u64().unwrap() as usize
    );
    let r = api
        .call(
            "POST",
            "/v1/maintenance/backup",
            Some(json!({"name": "b1"})),
        )
        .await;
    assert_error(&r, StatusCode::CONFLICT, "exists");
    for name in ["..", "../escape", "a/b", ""] {
        let r = api
            .call(
                "POST",
                "/v1/maintenance/backup",
                Some(json!({"name": name})),
            )
            .await;
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    }
    let r = api
        .call("POST", "/v1/maintenance/backup", Some(json!({"nom": "x"})))
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    let audit = api.call("GET", "/v1/audit", None).await;
    assert!(
        audit.text.contains("maintenance.backup") && audit.text.contains("maintenance.compact")
    );
}

/// Without Kafka, what handlers emit is pulled over HTTP and acknowledged: rows stay until
/// acknowledged (a second pull returns them again), acks delete exactly the named rows,
/// `pending` and `dedupd_outbox_rows` count what is left, bad input names its field, a
/// token is needed when one is configured, and a running Kafka relay makes both routes
/// refuse, so no row goes to two consumers.
#[tokio::test(flavor = "multi_thread")]
async fn the_outbox_is_pulled_and_acknowledged_over_http() {
    let api = Api::new("[ledger]\nshards = 2\n", Some(TOKEN));
    assert_eq!(
        api.upload("counts", "fixture_counter").await.status,
        StatusCode::OK
    );
    for (key, order) in [("a", "o1"), ("b", "o2"), ("c", "o1"), ("a", "o1")] {
        let payload = format!("{{\"order_id\":\"{order}\"}}");
        let r = api.ingest("counts", Some(key), &payload).await;
        assert!(r.status.is_success(), "{}", r.text);
    }
    let r = api.call("GET", "/v1/outbox?limit=10", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["pending"], 3, "three new messages, one duplicate");
    let messages = r.body["messages"].as_array().unwrap().clone();
    assert_eq!(messages.len(), 3);
    let mut counted: Vec<(String, String)> = messages
        .iter()
        .map(|m| {
            assert_eq!(m["subscriber"], "counts");
            assert_eq!(m["topic"], "counted");
            assert!(m["message_id"].as_str().is_some_and(|id| !id.is_empty()));
            (
                m["key"].as_str().unwrap().to_string(),
                m["payload"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    counted.sort();
    let want = [("o1", "1"), ("o1", "2"), ("o2", "1")];
    assert_eq!(
        counted,
        want.map(|(k, v)| (k.to_string(), v.to_string())).to_vec()
    );
    // Not acknowledged: pulled again.
    let again = api.call("GET", "/v1/outbox?limit=10", None).await;
    assert_eq!(again.body["messages"].as_array().unwrap().len(), 3);
    let ids: Vec<Value> = messages[..2].iter().map(|m| m["id"].clone()).collect();
    let r = api
        .call("POST", "/v1/outbox/ack", Some(json!({ "ids": ids })))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.body["pending"], 1);
    let left = api.call("GET", "/v1/outbox", None).await;
    let left = left.body["messages"].as_array().unwrap().clone();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["id"], messages[2]["id"]);
    // Acknowledging again is not an error.
    let r = api
        .call("POST", "/v1/outbox/ack", Some(json!({ "ids": ids })))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let metrics = api.call("GET", "/metrics", None).await;
    assert!(
        metrics.text.contains("dedupd_outbox_rows 1"),
        "{}",
        metrics.text
    );
    // Bad input.
    for uri in [
        "/v1/outbox?limit=0",
        "/v1/outbox?limit=1001",
        "/v1/outbox?limit=x",
    ] {
        assert_error(
            &api.call("GET", uri, None).await,
            StatusCode::BAD_REQUEST,
            "bad_request",
        );
    }
    for body in [
        json!({"ids": ["nope"]}),
        json!({"id": []}),
        json!({"ids": "0-1"}),
    ] {
        let r = api.call("POST", "/v1/outbox/ack", Some(body)).await;
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    }
    // The token is needed.
    let anonymous = Request::builder()
        .uri("/v1/outbox")
        .body(Body::empty())
        .unwrap();
    assert_eq!(api.send(anonymous).await.status, StatusCode::UNAUTHORIZED);
    // A Kafka relay consumes the outbox: nobody else may.
    let ledger = api.state.ledger().clone();
    {
        let _relay = ledger.attach_outbox_relay();
        let r = api.call("GET", "/v1/outbox", None).await;
        assert_error(&r, StatusCode::CONFLICT, "relayed_to_kafka");
        let r = api
            .call(
                "POST",
                "/v1/outbox/ack",
                Some(json!({"ids": [left[0]["id"]]})),
            )
            .await;
        assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.text);
    }
    let r = api.call("GET", "/v1/outbox", None).await;
    assert_eq!(r.body["pending"], 1, "{}", r.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_are_prometheus_text() {
    let api = Api::open();
    api.ingest("metered", Some("a"), "{}").await;
    api.ingest("metered", Some("a"), "{}").await;
    // Other parts (the Kafka source) record through the `metrics` facade.
    metrics::gauge!("dedupd_kafka_consumer_lag", "topic" => "orders", "partition" => "3").set(17.0);
    let r = api.call("GET", "/metrics", None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    for needle in [
        "dedupd_messages_processed_total{subscriber=\"metered\"} 1",
        "dedupd_duplicates_skipped_total{subscriber=\"metered\"} 1",
        "dedupd_claims_stored{subscriber=\"metered\"}",
        "dedupd_filter_false_positive_ratio{subscriber=\"metered\"}",
        "dedupd_commits_total{shard=\"0\"}",
        "dedupd_handler_failures_total{subscriber=\"metered\",kind=\"trap\"} 0",
        "dedupd_commit_duration_seconds_bucket{shard=\"0\"",
        "dedupd_batch_duration_seconds_bucket{shard=\"0\"",
        "dedupd_disk_bytes",
        "# HELP dedupd_messages_processed_total Messages whose handler ran",
        "# HELP dedupd_commit_duration_seconds Each durable commit",
        "dedupd_build_info{version=\"",
        "revision=\"",
        "dedupd_http_ingest_duration_seconds",
        "dedupd_kafka_consumer_lag{topic=\"orders\",partition=\"3\"} 17",
    ] {
        assert!(r.text.contains(needle), "missing {needle} in:\n{}", r.text);
    }
}

/// The process metrics every Prometheus client exports, so the usual "CPU, memory, file
/// descriptors" panels work without a node exporter per host.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_include_the_process_cpu_memory_and_descriptors() {
    let api = Api::open();
    let r = api.call("GET", "/metrics", None).await;
    assert_eq!(r.status, StatusCode::OK);
    let value = |name: &str| -> f64 {
        let line = r
            .text
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{}", r.text));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("process_resident_memory_bytes") > 1e6);
    assert!(value("process_cpu_seconds_total") > 0.0);
    assert!(value("process_open_fds") >= 3.0);
    assert!(value("process_max_fds") >= value("process_open_fds"));
    assert!(value("process_threads") >= 1.0);
    assert!(value("process_start_time_seconds") > 1.7e9);
    for (name, _) in dedupd::telemetry::process::HELP {
        assert!(r.text.contains(&format!("# HELP {name} ")), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_exported_metric_name_is_listed_in_telemetry() {
    let api = Api::open();
    api.ingest("listed", Some("a"), "{}").await;
    let r = api.call("GET", "/metrics", None).await;
    assert_eq!(r.status, StatusCode::OK);
    let mut seen = 0;
    for line in r.text.lines().filter(|l| l.starts_with("dedupd_")) {
        let family = line.split(['{', ' ']).next().unwrap();
        let name = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| family.strip_suffix(s))
            .filter(|base| dedupd::telemetry::metric::ALL.contains(base))
            .unwrap_or(family);
        assert!(
            dedupd::telemetry::metric::ALL.contains(&name),
            "{name} is exported but not a constant in telemetry::metric"
        );
        assert!(
            r.text.contains(&format!("# HELP {name} ")),
            "{name} is exported without HELP text"
        );
        seen += 1;
    }
    assert!(seen > 20, "too few metrics in:\n{}", r.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn dashboard_assets_are_served_without_external_references() {
    let api = Api::open();
    for (uri, kind) in [
        ("/", "text/html"),
        ("/assets/app.js", "text/javascript"),
        ("/assets/app.css", "text/css"),
    ] {
        let r = api.call("GET", uri, None).await;
        assert_eq!(r.status, StatusCode::OK, "{uri}");
        assert!(
            r.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with(kind),
            "{uri}"
        );
        assert!(
            !r.text.contains("http://") && !r.text.contains("https://"),
            "{uri} must not load anything external"
        );
        assert_eq!(r.headers["x-content-type-options"], "nosniff", "{uri}");
        assert_eq!(r.headers["x-frame-options"], "DENY", "{uri}");
        let csp = r.headers["content-security-policy"].to_str().unwrap();
        for directive in [
            "default-src 'none'",
            "script-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(csp.contains(directive), "{uri}: {csp}");
        }
    }
}

/// The path of a route with its parameters filled in.
fn concrete(path: &str) -> String {
    path.replace("{s}", "s")
        .replace("{id}", "k")
        .replace("{rid}", "0-1")
}

/// Every operation of the generated document: `(method, path template, operation)`.
fn documented() -> Vec<(&'static str, &'static str, &'static Value)> {
    let mut ops = Vec::new();
    for (path, item) in openapi()["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            ops.push((method.as_str(), path.as_str(), op));
        }
    }
    ops
}

#[tokio::test(flavor = "multi_thread")]
async fn openapi_lists_every_route_and_every_listed_route_is_served() {
    let api = Api::open();
    let doc = api.call("GET", "/openapi.json", None).await;
    assert_eq!(doc.status, StatusCode::OK);
    assert_eq!(doc.body["openapi"], "3.1.0");
    assert_eq!(&doc.body, openapi());
    let ops = documented();
    let mut ids = std::collections::BTreeSet::new();
    // Every documented operation reaches a handler (the fallback answers "no route").
    for (method, path, op) in &ops {
        let r = api
            .call(&method.to_uppercase(), &concrete(path), None)
            .await;
        assert!(
            !r.text.contains("no route"),
            "{method} {path} is documented but not served: {}",
            r.text
        );
        let id = op["operationId"].as_str().unwrap_or_default();
        assert!(
            !id.is_empty() && !id.contains(' ') && ids.insert(id),
            "{method} {path}: operationId {id:?} missing, not readable or taken"
        );
        assert!(op["summary"].as_str().is_some_and(|s| !s.is_empty()));
        // Each path parameter is described, and each response has a described body.
        for name in path.split('/').filter_map(|s| s.strip_prefix('{')) {
            let name = name.trim_end_matches('}');
            assert!(
                op["parameters"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().any(|p| p["name"] == name && p["in"] == "path")),
                "{method} {path} does not describe its parameter {name}"
            );
        }
        let responses = op["responses"].as_object().unwrap();
        assert!(responses.contains_key("200") || responses.contains_key("201"));
        for (status, response) in responses {
            assert!(
                response["content"].is_object(),
                "{method} {path} {status} has no body schema"
            );
        }
    }
    // Every route these tests exercise is documented.
    let exercised = [
        ("get", "/"),
        ("get", "/assets/app.js"),
        ("get", "/assets/app.css"),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
        ("get", "/v1/subscribers"),
        ("get", "/v1/subscribers/{s}"),
        ("get", "/v1/subscribers/{s}/config"),
        ("put", "/v1/subscribers/{s}/config"),
        ("get", "/v1/subscribers/{s}/stats"),
        ("post", "/v1/subscribers/{s}/messages"),
        ("get", "/v1/subscribers/{s}/messages/{id}"),
        ("delete", "/v1/subscribers/{s}/messages/{id}"),
        ("get", "/v1/subscribers/{s}/quarantine"),
        ("get", "/v1/subscribers/{s}/quarantine/{rid}"),
        ("delete", "/v1/subscribers/{s}/quarantine/{rid}"),
        ("post", "/v1/subscribers/{s}/quarantine/{rid}/replay"),
        ("get", "/v1/subscribers/{s}/deadletters"),
        ("get", "/v1/subscribers/{s}/deadletters/{rid}"),
        ("delete", "/v1/subscribers/{s}/deadletters/{rid}"),
        ("post", "/v1/subscribers/{s}/deadletters/{rid}/replay"),
        ("get", "/v1/subscribers/{s}/handler"),
        ("put", "/v1/subscribers/{s}/handler"),
        ("post", "/v1/subscribers/{s}/handler/rollback"),
        ("post", "/v1/maintenance/compact"),
        ("post", "/v1/maintenance/backup"),
        ("get", "/v1/audit"),
        ("get", "/v1/outbox"),
        ("post", "/v1/outbox/ack"),
    ];
    assert_eq!(
        exercised.len(),
        ops.len(),
        "a route was added without a test"
    );
    for (m, p) in exercised {
        assert!(
            doc.body["paths"][p][m].is_object(),
            "{m} {p} is not documented"
        );
    }
    // A known path with another method is a JSON 405.
    let r = api.call("POST", "/healthz", None).await;
    assert_error(&r, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    // Anything else is a JSON 404 that points at the document.
    let r = api.call("GET", "/v2/nothing", None).await;
    assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    assert!(r.text.contains("openapi.json"));
}

#[tokio::test(flavor = "multi_thread")]
async fn changed_handler_limits_take_effect() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[[subscriber]]\nname = \"spin\"\nmax_attempts = 1\nhandler_cpu_budget = \"5ms\"\n",
        None,
    );
    assert_eq!(
        api.upload("spin", "fixture_loop").await.status,
        StatusCode::OK
    );
    let r = api.ingest("spin", Some("l1"), "{}").await;
    assert_error(&r, StatusCode::INTERNAL_SERVER_ERROR, "dead_lettered");
    let r = api
        .call(
            "PUT",
            "/v1/subscribers/spin/config",
            Some(json!({"handler_cpu_budget": "30ms"})),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let r = api.ingest("spin", Some("l2"), "{}").await;
    assert_error(&r, StatusCode::INTERNAL_SERVER_ERROR, "dead_lettered");
    let list = api
        .call("GET", "/v1/subscribers/spin/deadletters", None)
        .await;
    let reasons: Vec<String> = list.body["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(reasons.len(), 2, "{}", list.text);
    assert!(reasons[0].contains("5 ms"), "{reasons:?}");
    assert!(reasons[1].contains("30 ms"), "{reasons:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrency_limit_is_obeyed_across_routes() {
    // One request at a time; the first is held by a retry backoff, so the second waits
    // for its slot instead of being served.
    let api = Api::new(
        "[ledger]\nshards = 1\n[http]\nmax_concurrency = 1\n[[subscriber]]\nname = \"slow\"\nmax_attempts = 2\nretry_backoff = \"1500ms\"\n",
        None,
    );
    assert_eq!(
        api.upload("slow", "fixture_errors").await.status,
        StatusCode::OK
    );
    let app = api.router.clone();
    let first = tokio::spawn(async move {
        let req = Request::post("/v1/subscribers/slow/messages")
            .header("content-type", "application/json")
            .header("idempotency-key", "held")
            .body(Body::from(r#"{"please": "retry"}"#))
            .unwrap();
        app.oneshot(req).await.unwrap().status()
    });
    api.wait_for_waiting(1).await;
    let app = api.router.clone();
    let second = tokio::spawn(async move {
        let req = Request::get("/healthz").body(Body::empty()).unwrap();
        app.oneshot(req).await.unwrap().status()
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "a second request was served beyond max_concurrency = 1"
    );
    assert_eq!(first.await.unwrap(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(second.await.unwrap(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_the_header_the_subscribers_key_source_applies() {
    let api = Api::new(
        r#"
[ledger]
shards = 2
[[subscriber]]
name = "ce"
key = { source = "cloudevents" }
[[subscriber]]
name = "hdr"
key = { source = "header", name = "X-Event-Id" }
[[subscriber]]
name = "ptr"
key = { source = "json_pointer", pointer = "/order/id" }
partition_key = { source = "json_pointer", pointer = "/order/id" }
"#,
        None,
    );
    let r = api
        .ingest("ce", None, r#"{"source": "shop", "id": "e1", "data": {}}"#)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    assert_eq!(r.body["key"], "shop#e1");
    let req = Request::post("/v1/subscribers/hdr/messages")
        .header("x-event-id", "evt-9")
        .header("content-type", "application/octet-stream")
        .body(Body::from("not json at all"))
        .unwrap();
    let r = api.send(req).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    assert_eq!(r.body["key"], "evt-9");
    let r = api.ingest("hdr", None, "{}").await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    // Named as configured (HTTP matched it in any case).
    assert!(
        r.body["message"].as_str().unwrap().contains("X-Event-Id"),
        "{}",
        r.text
    );
    let r = api.ingest("ptr", None, r#"{"order": {"id": 77}}"#).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    assert_eq!(r.body["key"], "77");
    let again = api.ingest("ptr", None, r#"{"order": {"id": 77}}"#).await;
    assert_eq!(again.headers["idempotent-replayed"], "true");
    let r = api.ingest("ptr", None, r#"{"order": {}}"#).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
}

// ---------------------------------------------------------------------------------------
// DNS rebinding, cross-site writes, admission, implicit subscribers, redaction, JSON

/// Config of a server with one request slot and a subscriber whose "retry" payload holds
/// its request (a retry backoff of 1.5 s) until its second attempt fails it for good.
fn one_slot(http: &str) -> String {
    format!(
        "[ledger]\nshards = 1\n[http]\nmax_concurrency = 1\n{http}\n[[subscriber]]\nname = \"slow\"\nmax_attempts = 2\nretry_backoff = \"1500ms\"\n"
    )
}

/// Starts a request that holds the only slot and returns once it does.
async fn hold_the_slot(api: &Api) -> tokio::task::JoinHandle<StatusCode> {
    assert_eq!(
        api.upload("slow", "fixture_errors").await.status,
        StatusCode::OK
    );
    let app = api.router.clone();
    let held = tokio::spawn(async move {
        let req = Request::post("/v1/subscribers/slow/messages")
            .header("content-type", "application/json")
            .header("idempotency-key", "held")
            .body(Body::from(r#"{"please": "retry"}"#))
            .unwrap();
        app.oneshot(req).await.unwrap().status()
    });
    api.wait_for_waiting(1).await;
    held
}

fn with_host(method: &str, uri: &str, host: &str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("host", host)
        .body(Body::empty())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn host_of_another_name_is_refused_with_421() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[http]\nallowed_hosts = [\"dedupd.internal\"]\n",
        None,
    );
    // A rebinding page's own name, on a read and on a write.
    for (method, uri) in [
        ("GET", "/v1/subscribers"),
        ("POST", "/v1/maintenance/compact"),
    ] {
        let r = api.send(with_host(method, uri, "evil.example")).await;
        assert_error(&r, StatusCode::MISDIRECTED_REQUEST, "misdirected_host");
        assert!(r.text.contains("allowed_hosts"), "{}", r.text);
        let r = api.send(with_host(method, uri, "evil.example:8080")).await;
        assert_eq!(r.status, StatusCode::MISDIRECTED_REQUEST, "{}", r.text);
    }
    // Nothing ran: the compaction was never audited.
    let audit = api.call("GET", "/v1/audit", None).await;
    assert_eq!(audit.body["entries"], json!([]), "{}", audit.text);
    // The loopback names, with and without port, and the configured one.
    for host in [
        "127.0.0.1:8080",
        "127.0.0.1",
        "localhost",
        "localhost:1234",
        "[::1]:8080",
        "dedupd.internal",
        "DEDUPD.internal:443",
    ] {
        let r = api.send(with_host("GET", "/v1/subscribers", host)).await;
        assert_eq!(r.status, StatusCode::OK, "{host}: {}", r.text);
    }
    // No Host at all (HTTP/1.0 tools): not a browser, so not a rebinding page.
    let r = api.call("GET", "/v1/subscribers", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn cross_origin_text_plain_post_is_refused() {
    let api = Api::open();
    let post = |origin: Option<&str>, content_type: &str, key: &str| {
        let mut b = Request::post("/v1/subscribers/s/messages")
            .header("host", "127.0.0.1:8080")
            .header("content-type", content_type)
            .header("idempotency-key", key);
        if let Some(o) = origin {
            b = b.header("origin", o);
        }
        b.body(Body::from(r#"{"total": 5}"#)).unwrap()
    };
    // The form a hostile page can send without a CORS preflight.
    let r = api
        .send(post(Some("http://evil.example"), "text/plain", "csrf-1"))
        .await;
    assert_error(&r, StatusCode::FORBIDDEN, "cross_origin");
    // Another origin is refused whatever the type; so is an opaque ("null") origin.
    let r = api
        .send(post(
            Some("http://evil.example:8080"),
            "application/json",
            "csrf-2",
        ))
        .await;
    assert_error(&r, StatusCode::FORBIDDEN, "cross_origin");
    let r = api
        .send(post(Some("null"), "application/json", "csrf-3"))
        .await;
    assert_error(&r, StatusCode::FORBIDDEN, "cross_origin");
    // A browser that omits Origin: without a token the form types are refused.
    for t in [
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let r = api.send(post(None, t, "csrf-4")).await;
        assert_error(
            &r,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        );
    }
    // No claim was taken by any of them.
    for key in ["csrf-1", "csrf-2", "csrf-3", "csrf-4"] {
        let r = api
            .call("GET", &format!("/v1/subscribers/s/messages/{key}"), None)
            .await;
        assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    }
    // The dashboard's own origin and plain clients (curl: no Origin) still write.
    let r = api
        .send(post(
            Some("http://127.0.0.1:8080"),
            "application/json",
            "ok-1",
        ))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    let r = api
        .send(post(
            Some("http://localhost:8080"),
            "application/json",
            "ok-2",
        ))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    let r = api.call("POST", "/v1/maintenance/compact", None).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn form_types_are_accepted_with_a_token() {
    // A token already stops cross-site writes (a page cannot attach it without a preflight
    // this server never grants), so a text/plain payload is the client's business.
    let api = Api::new("[ledger]\nshards = 1\n", Some(TOKEN));
    let req = api
        .req("POST", "/v1/subscribers/s/messages")
        .header("content-type", "text/plain")
        .header("idempotency-key", "plain-1")
        .body(Body::from("hello"))
        .unwrap();
    let r = api.send(req).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn every_write_route_needs_the_token() {
    let api = Api::new("[ledger]\nshards = 1\n", Some(TOKEN));
    let writes: Vec<_> = documented()
        .into_iter()
        .filter(|(method, _, _)| *method != "get")
        .collect();
    assert!(writes.len() >= 11, "the document lost its write routes");
    for (method, path, op) in writes {
        assert_eq!(
            op["security"],
            json!([{"bearer": []}]),
            "{method} {path} is documented without auth"
        );
        let uri = concrete(path);
        let method = method.to_uppercase();
        // Without a body, with a JSON body, and with a body of the route's own type.
        for (content_type, body) in [
            (None, ""),
            (Some("application/json"), "{}"),
            (Some("application/octet-stream"), "x"),
        ] {
            let mut b = Request::builder().method(method.as_str()).uri(&uri);
            if let Some(t) = content_type {
                b = b.header("content-type", t);
            }
            let r = api.send(b.body(Body::from(body)).unwrap()).await;
            assert_error(&r, StatusCode::UNAUTHORIZED, "unauthorized");
        }
    }
    // A method no route takes is refused before routing, too.
    let r = api
        .send(
            Request::builder()
                .method("PATCH")
                .uri("/v1/subscribers/s/config")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_error(&r, StatusCode::UNAUTHORIZED, "unauthorized");
}

#[tokio::test(flavor = "multi_thread")]
async fn admission_queue_bound_violated_is_503_with_retry_after() {
    // One slot, no waiting room: while the slot is held the next request is refused at
    // once (the obeyed side is `concurrency_limit_is_obeyed_across_routes`).
    let api = Api::new(&one_slot("max_queued = 0"), None);
    let held = hold_the_slot(&api).await;
    let started = Instant::now();
    let r = api.call("GET", "/healthz", None).await;
    assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, "busy");
    assert_eq!(r.headers["retry-after"], "1");
    assert!(r.text.contains("max_queued"), "{}", r.text);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "a full queue must answer at once, not wait for the slot"
    );
    assert_eq!(held.await.unwrap(), StatusCode::INTERNAL_SERVER_ERROR);
    // The slot is free again: served.
    assert_eq!(
        api.call("GET", "/healthz", None).await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn admission_queue_timeout_violated_is_503_with_retry_after() {
    // Room to wait, but not for long: the held request keeps the slot for 1.5 s.
    let api = Api::new(&one_slot("max_queued = 4\nqueue_timeout = \"100ms\""), None);
    let held = hold_the_slot(&api).await;
    let r = api.call("GET", "/healthz", None).await;
    assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, "busy");
    assert_eq!(r.headers["retry-after"], "1");
    assert!(r.text.contains("queue_timeout"), "{}", r.text);
    assert!(!held.is_finished(), "the slot was free after all");
    assert_eq!(held.await.unwrap(), StatusCode::INTERNAL_SERVER_ERROR);
}

#[tokio::test(flavor = "multi_thread")]
async fn request_timeout_violated_is_503_and_the_work_still_completes() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[http]\nrequest_timeout = \"200ms\"\n[[subscriber]]\nname = \"slow\"\nmax_attempts = 2\nretry_backoff = \"1500ms\"\n",
        None,
    );
    // Installed directly: compiling a component through the API can itself take longer
    // than this test's 200 ms request timeout on a busy machine.
    let f = dedupd::handler::load_factory(
        &component("fixture_errors"),
        dedupd::handler::Limits::default(),
    )
    .unwrap();
    api.state.ledger().set_handler("slow", Some(f)).unwrap();
    let r = api
        .ingest("slow", Some("late"), r#"{"please": "retry"}"#)
        .await;
    assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, "timeout");
    assert_eq!(r.headers["retry-after"], "1");
    // The message was handed to the engine before the answer: it is still decided (here:
    // dead-lettered after its second attempt).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let dl = api
            .call("GET", "/v1/subscribers/slow/deadletters", None)
            .await;
        if dl.body["records"].as_array().is_some_and(|r| r.len() == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "never decided: {}", dl.text);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_request_headers_violated_close_the_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let config =
        Config::parse("[ledger]\nshards = 1\n[http]\nheader_timeout = \"200ms\"\n").unwrap();
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap());
    let state = AdminState::new(ledger, &config, None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(dedupd::admin::serve(listener, state, async move {
        let _ = stopped.await;
    }));
    // Complete headers are answered (obeyed).
    let mut ok = tokio::net::TcpStream::connect(addr).await.unwrap();
    ok.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    ok.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // Headers that never end: the server hangs up instead of keeping the socket forever.
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), slow.read_to_end(&mut rest)).await;
    assert!(
        read.is_ok(),
        "the connection was kept open past header_timeout"
    );
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        !rest.contains(" 200 "),
        "a partial request was served: {rest}"
    );
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn implicit_subscriber_limit_obeyed() {
    let api = Api::new(
        "[ledger]\nshards = 1\nmax_implicit_subscribers = 2\n[[subscriber]]\nname = \"configured\"\n",
        None,
    );
    for sub in ["first", "second", "configured", "first"] {
        let r = api.ingest(sub, Some("k"), "{}").await;
        assert_eq!(r.status, StatusCode::CREATED, "{sub}: {}", r.text);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn implicit_subscriber_limit_violated_is_403() {
    let api = Api::new(
        "[ledger]\nshards = 1\nmax_implicit_subscribers = 2\n[[subscriber]]\nname = \"configured\"\n",
        None,
    );
    for sub in ["first", "second"] {
        assert_eq!(
            api.ingest(sub, Some("k"), "{}").await.status,
            StatusCode::CREATED
        );
    }
    let r = api.ingest("third", Some("k"), "{}").await;
    assert_error(&r, StatusCode::FORBIDDEN, "subscriber_limit");
    assert!(r.text.contains("max_implicit_subscribers"), "{}", r.text);
    // Not registered; the others (and configured ones) still take messages.
    let list = api.call("GET", "/v1/subscribers", None).await;
    let names: Vec<&str> = list.body["subscribers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["subscriber"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["configured", "first", "second"]);
    assert_eq!(
        api.ingest("configured", Some("k2"), "{}").await.status,
        StatusCode::CREATED
    );
    // Other routes that would create one are refused the same way.
    let r = api
        .call(
            "PUT",
            "/v1/subscribers/fourth/config",
            Some(json!({"ttl": "1h"})),
        )
        .await;
    assert_error(&r, StatusCode::FORBIDDEN, "subscriber_limit");
}

#[tokio::test(flavor = "multi_thread")]
async fn claim_lookups_and_payload_data_in_lists_need_the_token_when_one_is_configured() {
    let api = Api::new("[ledger]\nshards = 1\n", Some(TOKEN));
    assert_eq!(
        api.ingest("s", Some("k1"), r#"{"card": "4111"}"#)
            .await
            .status,
        StatusCode::CREATED
    );
    // Same key, another payload: quarantined with both fingerprints and a reason.
    assert_eq!(
        api.ingest("s", Some("k1"), r#"{"card": "4222"}"#)
            .await
            .status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let anon = |uri: &str| Request::get(uri).body(Body::empty()).unwrap();
    // A claim lookup needs the token: its 200 or 404 would confirm a guessed id.
    for id in ["k1", "never-seen"] {
        let r = api
            .send(anon(&format!("/v1/subscribers/s/messages/{id}")))
            .await;
        assert_error(&r, StatusCode::UNAUTHORIZED, "unauthorized");
    }
    let full = api.call("GET", "/v1/subscribers/s/messages/k1", None).await;
    assert_eq!(full.body["fingerprint"].as_str().unwrap().len(), 16);
    // The list: record ids stay; message ids (payload data under JSON-pointer keys), key
    // hashes, reasons and fingerprints go.
    let r = api.send(anon("/v1/subscribers/s/quarantine")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let rec = &r.body["records"][0];
    assert!(rec["id"].is_string(), "{}", r.text);
    for field in [
        "reason",
        "fingerprint",
        "stored_fingerprint",
        "key",
        "message_id",
        "key_hash",
    ] {
        assert!(rec.get(field).is_none(), "{field} shown: {}", r.text);
    }
    assert!(!r.text.contains("k1"), "{}", r.text);
    let full = api.call("GET", "/v1/subscribers/s/quarantine", None).await;
    let rec = &full.body["records"][0];
    assert_eq!(rec["message_id"], "k1", "{}", full.text);
    assert!(rec["reason"].is_string(), "{}", full.text);
    assert!(rec["fingerprint"].is_string(), "{}", full.text);
    assert!(rec.get("redacted").is_none(), "{}", full.text);
    // A wrong token is refused rather than quietly redacted.
    let wrong = Request::get("/v1/subscribers/s/quarantine")
        .header("authorization", "Bearer not-the-token-at-all")
        .body(Body::empty())
        .unwrap();
    assert_error(&api.send(wrong).await, StatusCode::FORBIDDEN, "forbidden");
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_configured_token_nothing_is_redacted() {
    let api = Api::open();
    api.ingest("s", Some("k1"), r#"{"a": 1}"#).await;
    let r = api.call("GET", "/v1/subscribers/s/messages/k1", None).await;
    assert!(r.body["fingerprint"].is_string(), "{}", r.text);
    assert!(r.body.get("redacted").is_none(), "{}", r.text);
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_json_body_is_400() {
    let api = Api::open();
    let post = |content_type: Option<&str>, key: &str, body: &'static str| {
        let mut b = Request::post("/v1/subscribers/s/messages").header("idempotency-key", key);
        if let Some(t) = content_type {
            b = b.header("content-type", t);
        }
        b.body(Body::from(body)).unwrap()
    };
    for (content_type, key) in [
        (Some("application/json"), "bad-1"),
        (Some("application/json; charset=utf-8"), "bad-2"),
        (Some("application/cloudevents+json"), "bad-3"),
    ] {
        let r = api.send(post(content_type, key, "{not json")).await;
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
        assert_eq!(r.body["field"], "body", "{}", r.text);
        let r = api
            .call("GET", &format!("/v1/subscribers/s/messages/{key}"), None)
            .await;
        assert_error(&r, StatusCode::NOT_FOUND, "not_found");
    }
    // Under its own content type an opaque payload is taken as it is.
    let r = api
        .send(post(
            Some("application/octet-stream"),
            "opaque-1",
            "{not json",
        ))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
}

/// Without a token, a write whose body has no `Content-Type` is refused (415) like the
/// form types a web page may send cross-site: a page can send such a body without
/// `Origin` in old browsers. With a type, or without a body, it goes through.
#[tokio::test(flavor = "multi_thread")]
async fn a_body_without_content_type_is_refused_without_a_token() {
    let api = Api::open();
    let untyped = Request::post("/v1/subscribers/s/messages")
        .header("idempotency-key", "k-untyped")
        .body(Body::from(r#"{"a": 1}"#))
        .unwrap();
    let r = api.send(untyped).await;
    assert_error(
        &r,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
    );
    assert!(r.text.contains("Content-Type"), "{}", r.text);
    let r = api.ingest("s", Some("k-typed"), r#"{"a": 1}"#).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    let r = api
        .send(
            Request::delete("/v1/subscribers/s/messages/k-typed")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
}

/// A key source change while the subscriber has live claims is refused (409), naming the
/// subscriber and both sources: with it the same message would get another key and be
/// processed a second time (G2).
#[tokio::test(flavor = "multi_thread")]
async fn key_source_change_with_live_claims_is_refused() {
    let api = Api::new(
        "[ledger]\nshards = 2\n[[subscriber]]\nname = \"orders\"\nkey = { source = \"json_pointer\", pointer = \"/event\" }\n",
        None,
    );
    let body = r#"{"event": "e-1", "order_id": "o-1"}"#;
    let first = api.ingest("orders", None, body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text);
    let r = api
        .call(
            "PUT",
            "/v1/subscribers/orders/config",
            Some(json!({"key": {"source": "json_pointer", "pointer": "/order_id"}})),
        )
        .await;
    assert_error(&r, StatusCode::CONFLICT, "live_claims");
    for needle in ["orders", "/event", "/order_id", "new subscriber name"] {
        assert!(r.text.contains(needle), "{needle:?} in {}", r.text);
    }
    let again = api.ingest("orders", None, body).await;
    assert_eq!(
        again.headers["idempotent-replayed"], "true",
        "{}",
        again.text
    );
}

/// The pair of the above: a subscriber without claims may change its key source.
#[tokio::test(flavor = "multi_thread")]
async fn key_source_change_without_claims_is_accepted() {
    let api = Api::new(
        "[ledger]\nshards = 2\n[[subscriber]]\nname = \"orders\"\n",
        None,
    );
    let r = api
        .call(
            "PUT",
            "/v1/subscribers/orders/config",
            Some(json!({"key": {"source": "json_pointer", "pointer": "/order_id"}})),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
}

/// A settings change whose handler cannot be loaded again under the new limits answers an
/// error and changes nothing: all or nothing.
#[tokio::test(flavor = "multi_thread")]
async fn config_change_whose_handler_reload_fails_keeps_the_old_settings() {
    let api = Api::new(
        "[ledger]\nshards = 1\n[[subscriber]]\nname = \"spin\"\nhandler_cpu_budget = \"5ms\"\n",
        None,
    );
    let up = api.upload("spin", "fixture_loop").await;
    assert_eq!(up.status, StatusCode::OK, "{}", up.text);
    let version = up.body["current"].as_str().unwrap().to_string();
    let stored = api
        .state
        .ledger()
        .data_dir()
        .join(format!("handlers/spin/{version}.wasm"));
    std::fs::remove_file(&stored).unwrap();
    let r = api
        .call(
            "PUT",
            "/v1/subscribers/spin/config",
            Some(json!({"handler_cpu_budget": "30ms", "max_attempts": 7})),
        )
        .await;
    assert!(
        r.status.is_client_error() || r.status.is_server_error(),
        "{}",
        r.text
    );
    let now = api.call("GET", "/v1/subscribers/spin/config", None).await;
    assert_eq!(
        now.body["config"]["handler_cpu_budget"], "5ms",
        "{}",
        now.text
    );
    assert_ne!(now.body["config"]["max_attempts"], 7, "{}", now.text);
}

/// Requests refused as malformed (400) register no subscriber, so they do not use up
/// `max_implicit_subscribers`: a valid message to a new name still gets in.
#[tokio::test(flavor = "multi_thread")]
async fn refused_requests_do_not_use_up_implicit_subscribers() {
    let api = Api::new("[ledger]\nshards = 1\nmax_implicit_subscribers = 3\n", None);
    for sub in ["bad-json", "no-key", "bad-config"] {
        let r = match sub {
            "bad-json" => api.ingest(sub, Some("k"), "{not json").await,
            "no-key" => api.ingest(sub, None, r#"{"total": 5}"#).await,
            _ => {
                api.call(
                    "PUT",
                    &format!("/v1/subscribers/{sub}/config"),
                    Some(json!({"ttl": "0s"})),
                )
                .await
            }
        };
        assert_error(&r, StatusCode::BAD_REQUEST, "bad_request");
    }
    let bad_upload = api
        .send(
            api.req("PUT", "/v1/subscribers/bad-upload/handler")
                .header("content-type", "application/wasm")
                .body(Body::from(b"not a component".to_vec()))
                .unwrap(),
        )
        .await;
    assert_error(&bad_upload, StatusCode::BAD_REQUEST, "bad_request");
    let r = api.ingest("fourth", Some("k"), "{}").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text);
    let list = api.call("GET", "/v1/subscribers", None).await;
    let names: Vec<&str> = list.body["subscribers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["subscriber"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["fourth"], "{}", list.text);
}

/// A list of large records is paged by the bytes it reads as well as by count (lists show
/// no payloads, but the records are read whole): `limit=1000` over ten records of ~300 KB
/// answers a few of them and a `next` that reaches the rest.
#[tokio::test(flavor = "multi_thread")]
async fn record_lists_are_bounded_by_bytes_and_continue_with_next() {
    let api = Api::new("[ledger]\nshards = 2\n", None);
    let big = "x".repeat(300_000);
    for i in 0..10 {
        api.state
            .ledger()
            .add_dead_letter(
                "big",
                json!({"id": format!("b-{i}"), "payload": big, "reason": "too big"}),
            )
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let uri = match &after {
            None => "/v1/subscribers/big/deadletters?limit=1000".to_string(),
            Some(a) => format!("/v1/subscribers/big/deadletters?limit=1000&after={a}"),
        };
        let r = api.call("GET", &uri, None).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text);
        pages += 1;
        for rec in r.body["records"].as_array().unwrap() {
            seen.push(rec["id"].as_str().unwrap().to_string());
        }
        match r.body["next"].as_str() {
            Some(n) => after = Some(n.to_string()),
            None => break,
        }
        assert!(pages < 20, "no end");
    }
    assert!(pages >= 3, "{pages} pages");
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 10, "{seen:?}");
}

/// `Idempotency-Key: "k-1"` (an RFC 8941 string, as the IETF draft writes it) and
/// `Idempotency-Key: k-1` name one key: the second is a replay, not a second message.
#[tokio::test(flavor = "multi_thread")]
async fn quoted_and_bare_idempotency_keys_are_one_key() {
    let api = Api::open();
    let first = api.ingest("orders", Some("\"k-1\""), r#"{"n": 1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text);
    assert_eq!(first.body["key"], "k-1", "{}", first.text);
    let bare = api.ingest("orders", Some("k-1"), r#"{"n": 1}"#).await;
    assert_eq!(bare.headers["idempotent-replayed"], "true", "{}", bare.text);
    let broken = api.ingest("orders", Some("\"k-2"), r#"{"n": 1}"#).await;
    assert_error(&broken, StatusCode::BAD_REQUEST, "bad_request");
    assert_eq!(broken.body["field"], "idempotency-key");
}

/// The `[metrics]` listener serves three routes; its 404 names them instead of pointing at
/// an API description it does not serve.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_listener_404_names_its_own_routes() {
    let dir = tempfile::tempdir().unwrap();
    let ledger =
        Arc::new(Ledger::open(dir.path(), &Config::default(), Arc::new(SystemClock)).unwrap());
    let app = dedupd::admin::metrics_router(AdminState::metrics_only(ledger).unwrap());
    let resp = app
        .oneshot(Request::get("/v1/subscribers").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes);
    assert!(!text.contains("openapi"), "{text}");
    assert!(
        text.contains("/metrics") && text.contains("/readyz"),
        "{text}"
    );
}

/// `dedupd_disk_bytes` counts every file under the data directory, a backup kept inside
/// it (`DATA_DIR/backups/`) included.
#[tokio::test(flavor = "multi_thread")]
async fn disk_bytes_count_backups_inside_the_data_directory() {
    let api = Api::open();
    let metric = |text: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix("dedupd_disk_bytes "))
            .unwrap_or_else(|| panic!("no dedupd_disk_bytes in:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    };
    let before = metric(&api.call("GET", "/metrics", None).await.text);
    let backups = api.state.ledger().data_dir().join("backups/b1");
    std::fs::create_dir_all(&backups).unwrap();
    std::fs::write(backups.join("shard-000.redb"), vec![7u8; 3 << 20]).unwrap();
    let after = metric(&api.call("GET", "/metrics", None).await.text);
    assert!(after - before >= (3 << 20) as f64, "{before} -> {after}");
}
