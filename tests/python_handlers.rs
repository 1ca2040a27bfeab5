//! Python handlers (componentize-py, `plugins/examples/python-shipping-label`, built by
//! `plugins/build-python.sh`): the component passes `dedupd handler check` although its
//! toolchain imports WASI's random, filesystem and sockets interfaces, and it makes the
//! decisions and writes the bytes the Rust `shipping-label` does, message for message.
//!
//! Compiling the 18 MB component is the slow part (seconds, more in the test profile), so
//! each component is compiled once per test binary and every test shares it.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dedupd::effects::{EmptyState, Failure, HandlerMessage, MessageHandler};
use dedupd::handler::{Component, Limits};
use serde_json::{json, Value};

use common::{component, dedupd};

const PYTHON: &str = "python_shipping_label";
const RUST: &str = "shipping_label";
const PROBE: &str = "python_fixture_sandbox";

/// Room for a loaded CI machine: these tests are about what the handlers do, not time.
fn limits() -> Limits {
    Limits {
        cpu_budget: Duration::from_secs(2),
        memory_bytes: 64 << 20,
        ..Limits::default()
    }
}

fn loaded(name: &'static str) -> &'static Component {
    static PY: OnceLock<Component> = OnceLock::new();
    static RS: OnceLock<Component> = OnceLock::new();
    static PROBED: OnceLock<Component> = OnceLock::new();
    let cell = match name {
        PYTHON => &PY,
        PROBE => &PROBED,
        _ => &RS,
    };
    cell.get_or_init(|| {
        let start = Instant::now();
        let c = Component::load(&component(name), limits()).unwrap();
        eprintln!("compiled {name} in {:?}", start.elapsed());
        c
    })
}

fn msg(id: &str, payload: &Value) -> HandlerMessage {
    HandlerMessage {
        subscriber: "orders".into(),
        id: id.into(),
        key_hash: dedupd::envelope::key_hash(id.as_bytes()),
        key: None,
        headers: vec![],
        payload: payload.to_string().into_bytes(),
        attempt: 1,
        received_at_ms: 1_700_000_000_000,
    }
}

/// Payloads that take every path of the handler: a label, other events, each kind of
/// refusal, and an order id that needs escaping in the label's JSON.
fn payloads() -> Vec<Value> {
    vec![
        json!({"type": "OrderPlaced", "order_id": "o-1"}),
        json!({"type": "OrderPlaced", "order_id": "o-\"é\u{1}✓\\/", "total": 12.5}),
        json!({"type": "OrderPaid", "order_id": "o-1"}),
        json!({"type": "OrderPlaced"}),
        json!({"type": "OrderPlaced", "order_id": ""}),
        json!({"type": "OrderPlaced", "order_id": null}),
        json!({"type": "OrderPaid", "order_id": 5}),
        json!({"order_id": "o-3"}),
        json!({"type": 7}),
        json!("OrderPlaced"),
        json!(["OrderPlaced", "o-4"]),
    ]
}

/// The same failure kind; the reason too, except the parser's own wording after
/// `invalid payload:` (serde_json's and Python's `json` differ).
fn same_failure(rust: &Failure, python: &Failure) -> bool {
    let reason = |m: &str| match m.strip_prefix("invalid payload:") {
        Some(_) => "invalid payload:".to_string(),
        None => m.to_string(),
    };
    match (rust, python) {
        (Failure::Permanent(a), Failure::Permanent(b)) => reason(a) == reason(b),
        _ => false,
    }
}

/// Every payload alone, through the engine's host: byte-identical writes and guards, or
/// the same failure.
#[test]
fn python_shipping_label_writes_the_bytes_the_rust_one_writes() {
    let (rust, python) = (loaded(RUST), loaded(PYTHON));
    let (mut r, mut p) = (rust.handler(), python.handler());
    for (n, payload) in payloads().iter().enumerate() {
        let m = msg(&format!("e-{n}"), payload);
        let a = r.handle(&m, Box::new(EmptyState)).1;
        let b = p.handle(&m, Box::new(EmptyState)).1;
        match (&a, &b) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{payload}"),
            (Err(x), Err(y)) => assert!(same_failure(x, y), "{payload}: {x:?} vs {y:?}"),
            _ => panic!("{payload}: rust {a:?}, python {b:?}"),
        }
    }
    // The label itself, byte for byte: the one JSON both write.
    let m = msg("e-1", &payloads()[1]);
    let label = p.handle(&m, Box::new(EmptyState)).1.unwrap();
    let (key, value) = label.state.iter().next().unwrap();
    assert_eq!(key.as_slice(), "label/o-\"é\u{1}✓\\/".as_bytes());
    let value = String::from_utf8(value.clone().unwrap()).unwrap();
    assert!(
        value.starts_with(r#"{"label_id":""#)
            && value.ends_with(r#"","order_id":"o-\"é\u0001✓\\/"}"#),
        "{value}"
    );
}

fn handler_test(name: &str, input: &Path) -> Vec<Value> {
    let c = component(name);
    let run = dedupd(&[
        "handler",
        "test",
        c.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--cpu-budget",
        "2s",
        "--json",
    ]);
    run.assert_success();
    common::json_lines(run.stdout.into_bytes())
}

/// `invalid payload: <parser's words>` -> `invalid payload: ...`, wherever it appears.
fn without_parser_wording(v: &mut Value) {
    match v {
        Value::String(s) if s.contains("invalid payload:") => {
            let head = s.split("invalid payload:").next().unwrap_or("").to_string();
            *s = format!("{head}invalid payload: ...");
        }
        Value::Array(a) => a.iter_mut().for_each(without_parser_wording),
        Value::Object(o) => o.values_mut().for_each(without_parser_wording),
        _ => {}
    }
}

/// `handler check` accepts the Python component, and `handler test` over a run with
/// redeliveries, a fresh id for a labelled order, refusals and a reused id reports the
/// same outcomes, labels, marks and guard answers for both.
#[test]
fn python_shipping_label_passes_check_and_handler_test_like_the_rust_one() {
    let c = component(PYTHON);
    let checked = dedupd(&["handler", "check", c.to_str().unwrap(), "--json"]);
    checked.assert_success();
    let report: Value = serde_json::from_str(&checked.stdout).unwrap();
    let imports = report["imports"].to_string();
    for i in [
        "wasi:random/random",
        "wasi:filesystem/preopens",
        "wasi:sockets/tcp",
    ] {
        assert!(imports.contains(i), "{i} not in {imports}");
    }
    assert!(report["exports"]
        .to_string()
        .contains("dedupd:handler/handler@0.1.0"));

    let tmp = tempfile::tempdir().unwrap();
    let mut lines: Vec<Value> = payloads()
        .into_iter()
        .enumerate()
        .map(|(n, p)| json!({"id": format!("e-{n}"), "payload": p}))
        .collect();
    lines.insert(1, lines[0].clone()); // a redelivery
    lines.push(json!({"id": "e-x", "payload": {"type": "OrderPlaced", "order_id": "o-1"}}));
    lines.push(json!({"id": "e-0", "payload": {"type": "OrderPlaced", "order_id": "o-9"}}));
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let input = tmp.path().join("events.jsonl");
    std::fs::write(&input, text).unwrap();

    let mut rust = handler_test(RUST, &input);
    let mut python = handler_test(PYTHON, &input);
    assert_eq!(rust.len(), lines.len());
    let outcomes = common::outcomes(&rust);
    assert_eq!(
        outcomes,
        [
            "processed",
            "duplicate",
            "processed",
            "processed",
            "dead_lettered",
            "dead_lettered",
            "dead_lettered",
            "dead_lettered",
            "dead_lettered",
            "dead_lettered",
            "dead_lettered",
            "processed",
            "processed",
            "quarantined"
        ]
    );
    rust.iter_mut().for_each(without_parser_wording);
    python.iter_mut().for_each(without_parser_wording);
    for (r, p) in rust.iter().zip(&python) {
        assert_eq!(r, p, "line {}", r["line"]);
    }
    // Three labels (o-1, the escaped one, o-4 from the array form), none for the fresh id.
    let labels: Vec<&Value> = python
        .iter()
        .filter_map(|r| r.get("state"))
        .flat_map(|s| s.as_array().unwrap())
        .collect();
    assert_eq!(labels.len(), 3, "{labels:?}");
    assert_eq!(
        python[12]["calls"][0]["guards"][0]["inserted"],
        json!(false),
        "{}",
        python[12]
    );
}

fn written(e: &dedupd::effects::Effects) -> std::collections::BTreeMap<String, String> {
    e.state
        .iter()
        .map(|(k, v)| {
            let v = v.clone().unwrap();
            (
                String::from_utf8(k.clone()).unwrap(),
                String::from_utf8(v).unwrap(),
            )
        })
        .collect()
}

/// `random` and `time.time()` in a Python handler are the message's: the same on a retry,
/// on the same or a fresh instance, others for another message; the environment is empty,
/// `open` finds nothing and a socket cannot connect.
#[test]
fn python_sees_a_deterministic_sandbox() {
    let c = loaded(PROBE);
    let m1 = HandlerMessage {
        received_at_ms: 1_234_567_890_123,
        ..msg("m1", &json!({}))
    };
    let mut h = c.handler();
    let first = written(&h.handle(&m1, Box::new(EmptyState)).1.unwrap());
    let other = written(
        &h.handle(&msg("m2", &json!({})), Box::new(EmptyState))
            .1
            .unwrap(),
    );
    let again = HandlerMessage {
        attempt: 2,
        ..m1.clone()
    };
    let same_instance = written(&h.handle(&again, Box::new(EmptyState)).1.unwrap());
    let fresh = written(&c.handler().handle(&again, Box::new(EmptyState)).1.unwrap());
    assert_eq!(first["py/random"], same_instance["py/random"]);
    assert_eq!(first["py/random"], fresh["py/random"]);
    assert_ne!(first["py/random"], other["py/random"]);
    // os.urandom reads the host's per-message stream, but the runtime under it keeps
    // unread bytes across calls: only a fresh instance reads the message's own bytes.
    assert_eq!(first["py/urandom"], fresh["py/urandom"]);
    assert_ne!(first["py/urandom"], other["py/urandom"]);
    assert_eq!(first["py/time"], "1234567890123");
    assert_eq!(first["py/env"], "0");
    assert!(
        first["py/open"].starts_with("FileNotFoundError") || first["py/open"].contains("denied"),
        "{first:?}"
    );
    assert_ne!(first["py/socket"], "ALLOWED", "{first:?}");

    // A failed attempt draws what its retry draws.
    let retry = msg("m3", &json!({"retry": true}));
    let failed = match h.handle(&retry, Box::new(EmptyState)).1 {
        Err(Failure::Retryable(draws)) => draws,
        other => panic!("expected the fixture's retryable error, got {other:?}"),
    };
    let second = HandlerMessage {
        attempt: 2,
        ..retry
    };
    let second = written(&c.handler().handle(&second, Box::new(EmptyState)).1.unwrap());
    assert_eq!(second["py/random"], failed);
}
