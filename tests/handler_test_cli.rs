//! `dedupd handler test` as a process: a component from `plugins/` (built by
//! `plugins/build.sh`) run over message files as the engine would, with the outcome and
//! effects of every message, `--state` seeding, `--expect` comparison, subscriber settings
//! from `--config`, and errors that name the file and line.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use common::{component, dedupd, Run};

const BIN: &str = env!("CARGO_BIN_EXE_dedupd");

/// The `--json` reports of a run.
trait Reports {
    fn reports(&self) -> Vec<Value>;
}

impl Reports for Run {
    fn reports(&self) -> Vec<Value> {
        self.assert_success();
        common::json_lines(self.stdout.clone().into_bytes())
    }
}

/// A budget no loaded CI machine runs out of: these tests are about outcomes, not time.
const BUDGET: &str = "2s";

/// `dedupd handler test COMPONENT --input INPUT --cpu-budget 2s ARGS...`.
fn handler_test(name: &str, input: &Path, args: &[&str]) -> Run {
    let c = component(name);
    let mut all = vec![
        "handler",
        "test",
        c.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--cpu-budget",
        BUDGET,
    ];
    all.extend_from_slice(args);
    dedupd(&all)
}

fn write(dir: &Path, name: &str, lines: &[Value]) -> PathBuf {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    write_text(dir, name, &text)
}

fn write_bytes(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn write_text(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn order_placed(id: &str, order: &str) -> Value {
    json!({"id": id, "payload": {"type": "OrderPlaced", "order_id": order}})
}

/// Redeliveries, a producer retry with a fresh id, another order and a reused id with
/// another payload: one label per order, and each message decided as the engine decides.
#[test]
fn shipping_label_gives_one_label_per_order_for_duplicates_and_fresh_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let lines = [
        order_placed("e-1", "o-1").to_string(),
        order_placed("e-1", "o-1").to_string(),
        // Same event re-encoded (key order, whitespace): still the same payload.
        r#"{"payload": { "order_id": "o-1",  "type": "OrderPlaced" }, "id": "e-1"}"#.to_string(),
        order_placed("e-2", "o-1").to_string(),
        order_placed("e-3", "o-2").to_string(),
        order_placed("e-1", "o-9").to_string(),
    ];
    let input = write_text(tmp.path(), "events.jsonl", &(lines.join("\n") + "\n"));
    let run = handler_test("shipping_label", &input, &["--json"]);
    let r = run.reports();
    assert_eq!(
        common::outcomes(&r),
        [
            "processed",
            "duplicate",
            "duplicate",
            "processed",
            "processed",
            "quarantined"
        ]
    );
    assert_eq!(
        r.iter()
            .map(|r| r["line"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    // The first event of o-1 writes its label and mark; the label id is the operation key.
    let label = &r[0]["state"];
    assert_eq!(label.as_array().unwrap().len(), 1, "{}", r[0]);
    assert_eq!(label[0]["key"], "label/o-1");
    assert_eq!(label[0]["value"]["order_id"], "o-1");
    let label_id = label[0]["value"]["label_id"].as_str().unwrap();
    assert_eq!(label_id.len(), 32, "{label_id}");
    assert!(
        label_id.chars().all(|c| c.is_ascii_hexdigit()),
        "{label_id}"
    );
    assert_eq!(
        r[0]["uniques"],
        json!([{"namespace": "label", "key": "o-1"}])
    );
    assert_eq!(
        r[0]["calls"],
        json!([{"attempt": 1, "result": "ok", "guards": [
            {"call": "insert_unique", "namespace": "label", "key": "o-1", "inserted": true}
        ]}])
    );
    // Redeliveries never reach the handler.
    for d in [&r[1], &r[2]] {
        assert_eq!(d["id"], "e-1");
        assert!(d.get("calls").is_none() && d.get("state").is_none(), "{d}");
    }
    // A fresh id for the same order: processed, but the mark exists and nothing is written.
    assert_eq!(
        r[3]["calls"][0]["guards"],
        json!([{"call": "insert_unique", "namespace": "label", "key": "o-1", "inserted": false}])
    );
    assert!(
        r[3].get("state").is_none() && r[3].get("uniques").is_none(),
        "{}",
        r[3]
    );
    // Another order gets a label of its own, with another operation key.
    assert_eq!(r[4]["state"][0]["key"], "label/o-2");
    assert_ne!(r[4]["state"][0]["value"]["label_id"], label_id);
    // A reused id with another payload is quarantined, and the handler is not called.
    assert!(
        r[5]["reason"]
            .as_str()
            .unwrap()
            .starts_with("same id, different payload"),
        "{}",
        r[5]
    );
    assert!(r[5].get("calls").is_none(), "{}", r[5]);
    let labels: usize = r
        .iter()
        .map(|m| m.get("state").and_then(Value::as_array).map_or(0, Vec::len))
        .sum();
    assert_eq!(labels, 2);

    // The text form says the same.
    let text = handler_test("shipping_label", &input, &[]);
    text.assert_success();
    assert!(
        text.stdout.contains(
            "line 4: e-2 processed\n  call 1: ok\n    insert-unique label o-1 -> exists\n"
        ),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout
            .contains("6 messages: 2 duplicate, 3 processed, 1 quarantined"),
        "{}",
        text.stdout
    );
}

/// Initial state changes what the handler does: a `state dump` of a real data directory
/// continues a non-idempotent counter, and a seeded mark stops a label.
#[test]
fn state_seeding_changes_the_outcome() {
    let tmp = tempfile::tempdir().unwrap();
    let counter = component("fixture_counter");
    // Production: two events for o-1 through `dedupd pipe`, then a dump of its state.
    let data = tmp.path().join("data");
    let mut pipe = Command::new(BIN)
        .args(["pipe", "--data-dir", data.to_str().unwrap(), "--config"])
        .arg(write_text(
            tmp.path(),
            "prod.toml",
            &format!(
                "[[subscriber]]\nname = \"default\"\nhandler = {:?}\nhandler_cpu_budget = \"2s\"\n",
                counter.to_str().unwrap()
            ),
        ))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = pipe.stdin.take().unwrap();
        for id in ["p-1", "p-2"] {
            writeln!(
                stdin,
                "{}",
                json!({"id": id, "payload": {"order_id": "o-1"}})
            )
            .unwrap();
        }
    }
    let out = pipe.wait_with_output().unwrap();
    assert!(out.status.success());
    let dump = dedupd(&[
        "state",
        "dump",
        "--data-dir",
        data.to_str().unwrap(),
        "--subscriber",
        "default",
    ]);
    dump.assert_success();
    let dump_text = dump.stdout;
    assert_eq!(dump_text.trim(), r#"{"key":"count/o-1","value":2}"#);
    let state = write_text(tmp.path(), "state.jsonl", &dump_text);

    let input = write(
        tmp.path(),
        "events.jsonl",
        &[json!({"id": "t-1", "payload": {"order_id": "o-1"}})],
    );
    let fresh = handler_test("fixture_counter", &input, &["--json"]).reports();
    assert_eq!(fresh[0]["state"], json!([{"key": "count/o-1", "value": 1}]));
    let seeded = handler_test(
        "fixture_counter",
        &input,
        &["--json", "--state", state.to_str().unwrap()],
    )
    .reports();
    assert_eq!(seeded[0]["outcome"], "processed");
    assert_eq!(
        seeded[0]["state"],
        json!([{"key": "count/o-1", "value": 3}])
    );
    assert_eq!(seeded[0]["emitted"][0]["payload"], json!(3));

    // A seeded mark: the order already has its label.
    let marks = write(
        tmp.path(),
        "marks.jsonl",
        &[json!({"unique": {"namespace": "label", "key": "o-1"}})],
    );
    let orders = write(tmp.path(), "orders.jsonl", &[order_placed("e-1", "o-1")]);
    let without = handler_test("shipping_label", &orders, &["--json"]).reports();
    assert_eq!(without[0]["state"][0]["key"], "label/o-1");
    let with = handler_test(
        "shipping_label",
        &orders,
        &["--json", "--state", marks.to_str().unwrap()],
    )
    .reports();
    assert!(with[0].get("state").is_none(), "{}", with[0]);
    assert_eq!(with[0]["calls"][0]["guards"][0]["inserted"], false);
}

/// Under a partition key the state is per entity: a seeded entry is seen only by its own
/// entity's messages, and an entry without an entity is refused with its line.
#[test]
fn config_settings_and_entity_scoped_state_apply() {
    let tmp = tempfile::tempdir().unwrap();
    let config = write_text(
        tmp.path(),
        "dedupd.toml",
        concat!(
            "[[subscriber]]\n",
            "name = \"counts\"\n",
            "key = { source = \"json_pointer\", pointer = \"/event_id\" }\n",
            "partition_key = { source = \"json_pointer\", pointer = \"/order_id\" }\n",
        ),
    );
    let state = write(
        tmp.path(),
        "state.jsonl",
        &[json!({"entity": "o-1", "key": "count/o-1", "value": 10})],
    );
    let input = write(
        tmp.path(),
        "events.jsonl",
        &[
            json!({"payload": {"event_id": "a", "order_id": "o-1"}}),
            json!({"payload": {"event_id": "b", "order_id": "o-2"}}),
            json!({"subscriber": "counts", "payload": {"event_id": "a", "order_id": "o-1"}}),
            json!({"payload": {"order_id": "o-3"}}),
            json!({"payload": {"event_id": "c"}}),
        ],
    );
    let cfg = config.to_str().unwrap();
    let st = state.to_str().unwrap();
    let r = handler_test(
        "fixture_counter",
        &input,
        &[
            "--json",
            "--config",
            cfg,
            "--subscriber",
            "counts",
            "--state",
            st,
        ],
    )
    .reports();
    assert_eq!(
        common::outcomes(&r),
        [
            "processed",
            "processed",
            "duplicate",
            "rejected",
            "rejected"
        ]
    );
    assert_eq!((&r[0]["id"], &r[0]["entity"]), (&json!("a"), &json!("o-1")));
    assert_eq!(r[0]["state"], json!([{"key": "count/o-1", "value": 11}]));
    assert_eq!(r[1]["state"], json!([{"key": "count/o-2", "value": 1}]));
    assert_eq!(
        r[3]["reason"],
        "no idempotency key: payload has nothing at `/event_id`"
    );
    assert!(r[3].get("id").is_none(), "{}", r[3]);
    // Keyed, but without an entity: refused, with the key it had (as pipe mode answers).
    assert_eq!(r[4]["id"], "c");
    assert!(
        r[4]["reason"]
            .as_str()
            .unwrap()
            .starts_with("no idempotency key: no partition key"),
        "{}",
        r[4]
    );

    // Without an entity the entry cannot be placed in any store.
    let flat = write(
        tmp.path(),
        "flat.jsonl",
        &[json!({"key": "count/o-1", "value": 10})],
    );
    handler_test(
        "fixture_counter",
        &input,
        &[
            "--config",
            cfg,
            "--subscriber",
            "counts",
            "--state",
            flat.to_str().unwrap(),
        ],
    )
    .assert_refused(&["flat.jsonl:1:", "has a partition_key", "`entity`"]);
    // A subscriber the config does not have, and a line for another subscriber.
    handler_test(
        "fixture_counter",
        &input,
        &["--config", cfg, "--subscriber", "nope"],
    )
    .assert_refused(&["no [[subscriber]] named \"nope\""]);
    handler_test("fixture_counter", &input, &[])
        .assert_refused(&["events.jsonl:3:", "subscriber \"counts\""]);
}

/// A retryable failure is retried up to the subscriber's attempts and then dead-lettered, a
/// permanent one at once; every attempt's logs and printed lines are shown.
#[test]
fn failures_are_retried_and_dead_lettered_with_their_logs() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(
        tmp.path(),
        "events.jsonl",
        &[
            json!({"id": "r-1", "payload": "retry"}),
            json!({"id": "p-1", "payload": "permanent"}),
            json!({"id": "k-1", "payload": "fine"}),
        ],
    );
    let r = handler_test("fixture_errors", &input, &["--json"]).reports();
    assert_eq!(
        common::outcomes(&r),
        ["dead_lettered", "dead_lettered", "processed"]
    );
    assert_eq!(
        r[0]["reason"],
        "handler returned a retryable error: fixture-errors: retry requested by r-1 (attempt 3 of 3)"
    );
    let calls = r[0]["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 3);
    for (i, c) in calls.iter().enumerate() {
        assert_eq!(c["attempt"], i + 1);
        assert_eq!(c["result"], "retryable");
        assert_eq!(
            c["logs"],
            json!([{"level": "warn", "text": format!("fixture-errors: attempt {} of r-1 asks for a retry", i + 1)}])
        );
    }
    assert_eq!(
        r[1]["calls"],
        json!([{
            "attempt": 1,
            "result": "permanent",
            "error": "handler returned a permanent error: fixture-errors: permanent failure for p-1",
            "logs": [{"level": "stdout", "text": "fixture-errors: giving up on p-1"}]
        }])
    );
    assert_eq!(r[2]["calls"], json!([{"attempt": 1, "result": "ok"}]));

    // `max_attempts` of the config applies.
    let config = write_text(tmp.path(), "one.toml", "[defaults]\nmax_attempts = 1\n");
    let r = handler_test(
        "fixture_errors",
        &input,
        &["--json", "--config", config.to_str().unwrap()],
    )
    .reports();
    assert_eq!(r[0]["calls"].as_array().unwrap().len(), 1);
    assert!(
        r[0]["reason"]
            .as_str()
            .unwrap()
            .ends_with("(attempt 1 of 1)"),
        "{}",
        r[0]
    );
}

/// `--json` output is reproducible, so it can be kept as the expected output of a handler's
/// CI: `--expect` passes on it and fails, with the first difference, on a changed one.
#[test]
fn expect_passes_on_equal_output_and_fails_with_a_diff_on_a_changed_one() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(
        tmp.path(),
        "events.jsonl",
        &[
            json!({"id": "c-1", "payload": {"payment_id": "pay-1", "amount_cents": 1999}}),
            json!({"id": "c-1", "payload": {"payment_id": "pay-1", "amount_cents": 1999}}),
            json!({"id": "c-2", "payload": {"payment_id": "pay-2", "amount_cents": 500}}),
        ],
    );
    let first = handler_test("payment_capture", &input, &["--json"]);
    let again = handler_test("payment_capture", &input, &["--json", "--now-ms", "5"]);
    assert_eq!(first.stdout, again.stdout, "not reproducible");
    let r = first.reports();
    // The outbox message: its id, key, header and payload carry the operation key.
    let emitted = &r[0]["emitted"][0];
    let op = r[0]["state"][0]["value"]["operation_key"].as_str().unwrap();
    assert_eq!(emitted["topic"], "payments.captured");
    assert_eq!(emitted["key"], "pay-1");
    assert_eq!(emitted["headers"], json!([["operation-key", op]]));
    assert_eq!(emitted["payload"]["operation_key"], op);
    assert_eq!(emitted["id"].as_str().unwrap().len(), 32);

    let expected = write_text(tmp.path(), "expected.jsonl", &first.stdout);
    let ok = handler_test(
        "payment_capture",
        &input,
        &["--expect", expected.to_str().unwrap()],
    );
    ok.assert_success();
    assert!(
        ok.stdout.contains("ok: 3 messages as expected in"),
        "{}",
        ok.stdout
    );

    // A changed amount in the third message's expected output.
    let changed = first
        .stdout
        .replace(r#""amount_cents":500"#, r#""amount_cents":501"#);
    assert_ne!(changed, first.stdout);
    let changed = write_text(tmp.path(), "changed.jsonl", &changed);
    handler_test(
        "payment_capture",
        &input,
        &["--expect", changed.to_str().unwrap()],
    )
    .assert_refused(&[
        "message 3 (input line 3) differs from",
        "changed.jsonl:3",
        "/emitted/0/payload/amount_cents: expected 501, got 500",
        "the output differs from",
    ]);
    // A message too many in the input.
    let one = write_text(
        tmp.path(),
        "one.jsonl",
        first.stdout.lines().next().unwrap(),
    );
    handler_test(
        "payment_capture",
        &input,
        &["--expect", one.to_str().unwrap()],
    )
    .assert_refused(&["expects 1 messages, the run gave 3"]);
}

/// Unusable inputs are refused before anything runs, naming the file and line (or the
/// component and the capability it lacks).
#[test]
fn bad_input_is_refused_with_its_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write_text(
        tmp.path(),
        "events.jsonl",
        "{\"id\":\"e-1\",\"payload\":{}}\n\n{\"id\":\"e-2\",\"payload\":{\"type\":\n",
    );
    handler_test("shipping_label", &input, &[])
        .assert_refused(&["events.jsonl:3: not a message: EOF while parsing"]);
    let misspelt = write_text(tmp.path(), "typo.jsonl", "{\"id\":\"e-1\",\"paylod\":{}}\n");
    handler_test("shipping_label", &misspelt, &[])
        .assert_refused(&["typo.jsonl:1: not a message: unknown field `paylod`"]);
    let good = write(tmp.path(), "good.jsonl", &[order_placed("e-1", "o-1")]);
    let state = write_text(
        tmp.path(),
        "state.jsonl",
        "{\"key\":\"k\",\"value\":1}\n{\"key\":\"k\"}\n",
    );
    handler_test(
        "shipping_label",
        &good,
        &["--state", state.to_str().unwrap()],
    )
    .assert_refused(&["state.jsonl:2: expected {\"key\": ..., \"value\": ...}"]);
    let missing = tmp.path().join("missing.jsonl");
    handler_test("shipping_label", &missing, &[]).assert_refused(&["cannot read", "missing.jsonl"]);
    let net = write_bytes(
        tmp.path(),
        "net.wasm",
        &common::component_importing("wasi:http/outgoing-handler@0.2.0"),
    );
    dedupd(&[
        "handler",
        "test",
        net.to_str().unwrap(),
        "--input",
        good.to_str().unwrap(),
    ])
    .assert_refused(&[
        "imports `wasi:http/outgoing-handler@0.2.0`",
        "does not grant",
    ]);
    dedupd(&[
        "handler",
        "test",
        tmp.path().join("nope.wasm").to_str().unwrap(),
        "--input",
        good.to_str().unwrap(),
    ])
    .assert_refused(&["nope.wasm not found"]);
}

/// The state a test shows is the state the engine keeps: the same messages through
/// `dedupd pipe` with the same component leave exactly the writes the test reports.
#[test]
fn the_test_shows_the_writes_the_engine_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write(
        tmp.path(),
        "events.jsonl",
        &[
            order_placed("e-1", "o-1"),
            order_placed("e-2", "o-1"),
            order_placed("e-3", "o-2"),
            order_placed("e-3", "o-2"),
        ],
    );
    let labels = component("shipping_label");
    let config = write_text(
        tmp.path(),
        "prod.toml",
        &format!(
            "[defaults]\nhandler = {:?}\nhandler_cpu_budget = \"2s\"\n",
            labels.to_str().unwrap()
        ),
    );
    let data = tmp.path().join("data");
    let pipe = Command::new(BIN)
        .args(["pipe", "--data-dir", data.to_str().unwrap(), "--config"])
        .arg(&config)
        .stdin(std::fs::File::open(&input).unwrap())
        .output()
        .unwrap();
    assert!(
        pipe.status.success(),
        "{}",
        String::from_utf8_lossy(&pipe.stderr)
    );
    let dump = Command::new(BIN)
        .args(["state", "dump", "--data-dir", data.to_str().unwrap()])
        .args(["--subscriber", "default"])
        .output()
        .unwrap();
    assert!(dump.status.success());
    let stored = common::json_lines(dump.stdout);

    let reports = handler_test("shipping_label", &input, &["--json"]).reports();
    let shown: Vec<Value> = reports
        .iter()
        .flat_map(|r| {
            r.get("state")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(shown.len(), 2, "{reports:?}");
    assert_eq!(shown, stored);
}
