//! Routing is a performance choice, never a correctness one (`src/ledger/placement.rs`):
//! a subscriber's handler state behaves as one store (or one per entity when a partition
//! key is configured) under every configuration, and one `(subscriber, id)` is decided
//! exactly once whatever partition key its deliveries carry.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::envelope::key_hash;
use dedupd::ledger::{Done, Job, Ledger};
use dedupd::source::stdin::run_pipe;
use serde_json::{json, Value};

use common::component;

const BIN: &str = env!("CARGO_BIN_EXE_dedupd");

fn config_text(handler: &str, partition_key: Option<&str>) -> String {
    let mut text = format!(
        "[ledger]\nshards = 2\n\n[[subscriber]]\nname = \"orders\"\nhandler = {:?}\nretry_backoff = \"1ms\"\n",
        component(handler).display().to_string()
    );
    if let Some(p) = partition_key {
        text.push_str(&format!(
            "partition_key = {{ source = \"json_pointer\", pointer = {p:?} }}\n"
        ));
    }
    text
}

fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("dedupd.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `dedupd pipe` as a user would; returns the outcome names in input order.
fn pipe(data: &Path, config: &Path, lines: &[Value]) -> Vec<String> {
    let input: String = lines.iter().map(|v| format!("{v}\n")).collect();
    let mut child = Command::new(BIN)
        .arg("pipe")
        .arg("--data-dir")
        .arg(data)
        .arg("--config")
        .arg(config)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        use std::io::Write;
        let _ = stdin.write_all(input.as_bytes());
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    assert!(
        out.status.success(),
        "pipe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::outcome_names(out.stdout)
}

/// `dedupd state dump` lines as JSON.
fn dump(data: &Path, config: &Path) -> Vec<Value> {
    let out = Command::new(BIN)
        .args(["state", "dump", "--subscriber", "orders", "--data-dir"])
        .arg(data)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::json_lines(out.stdout)
}

fn order_events(n: usize, order: &str, prefix: &str) -> Vec<Value> {
    (0..n)
        .map(|i| {
            json!({"subscriber": "orders", "id": format!("{prefix}-{i}"),
                   "payload": {"type": "OrderPlaced", "order_id": order}})
        })
        .collect()
}

#[test]
fn default_config_gives_one_label_per_order_across_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), &config_text("shipping_label", None));
    let data = tmp.path().join("data");
    let outcomes = pipe(&data, &cfg, &order_events(20, "o-1", "e"));
    assert_eq!(outcomes, vec!["processed"; 20]);
    let state = dump(&data, &cfg);
    let labels: Vec<_> = state
        .iter()
        .filter(|e| e["key"].as_str().is_some_and(|k| k.starts_with("label/")))
        .collect();
    assert_eq!(labels.len(), 1, "one order, one label: {state:?}");
    assert_eq!(labels[0]["key"], "label/o-1");
}

#[test]
fn default_config_counter_sees_every_event_of_its_order() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), &config_text("fixture_counter", None));
    let data = tmp.path().join("data");
    let outcomes = pipe(&data, &cfg, &order_events(40, "o-1", "e"));
    assert_eq!(outcomes, vec!["processed"; 40]);
    // A restart and more events: the count goes on from the stored value.
    let outcomes = pipe(&data, &cfg, &order_events(5, "o-1", "late"));
    assert_eq!(outcomes, vec!["processed"; 5]);
    let state = dump(&data, &cfg);
    assert_eq!(state.len(), 1, "{state:?}");
    assert_eq!(state[0]["key"], "count/o-1");
    assert_eq!(state[0]["value"], 45);
}

#[test]
fn entity_partition_key_scopes_state_to_the_entity() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        &config_text("fixture_counter", Some("/order_id")),
    );
    let data = tmp.path().join("data");
    let mut events = Vec::new();
    for order in ["o-1", "o-2", "o-3"] {
        events.extend(order_events(30, order, order));
    }
    let outcomes = pipe(&data, &cfg, &events);
    assert_eq!(outcomes, vec!["processed"; 90]);
    let state = dump(&data, &cfg);
    let counts: BTreeMap<String, String> = state
        .iter()
        .map(|e| {
            assert_eq!(e["key"], format!("count/{}", e["entity"].as_str().unwrap()));
            (
                e["entity"].as_str().unwrap().to_string(),
                e["value"].to_string(),
            )
        })
        .collect();
    assert_eq!(
        counts,
        BTreeMap::from([
            ("o-1".to_string(), "30".to_string()),
            ("o-2".to_string(), "30".to_string()),
            ("o-3".to_string(), "30".to_string()),
        ])
    );
}

#[test]
fn changing_the_state_scope_of_a_subscriber_with_state_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let one_store = write_config(tmp.path(), &config_text("shipping_label", None));
    pipe(&data, &one_store, &order_events(3, "o-1", "e"));
    let per_entity = write_config(
        tmp.path(),
        &config_text("shipping_label", Some("/order_id")),
    );
    let out = Command::new(BIN)
        .arg("pipe")
        .arg("--data-dir")
        .arg(&data)
        .arg("--config")
        .arg(&per_entity)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("orders") && err.contains("partition_key"),
        "{err}"
    );
}

// Library-level scenarios: two shards, entity keys chosen so deliveries meet other shards.

fn two_shard_config(partition_pointer: Option<&str>) -> Config {
    let text = match partition_pointer {
        Some(p) => format!(
            "[ledger]\nshards = 2\n[[subscriber]]\nname = \"orders\"\nretry_backoff = \"1ms\"\npartition_key = {{ source = \"json_pointer\", pointer = {p:?} }}\n"
        ),
        None => "[ledger]\nshards = 2\n[[subscriber]]\nname = \"orders\"\n".to_string(),
    };
    toml::from_str::<Config>(&text).unwrap()
}

/// The non-idempotent counting handler (`plugins/fixtures/fixture-counter`).
fn counter() -> Arc<dyn dedupd::effects::HandlerFactory> {
    dedupd::handler::load_factory(
        &component("fixture_counter"),
        dedupd::handler::Limits::default(),
    )
    .unwrap()
}

fn open_with_counter(dir: &Path, config: &Config) -> Ledger {
    let ledger = Ledger::open(dir, config, Arc::new(SystemClock)).unwrap();
    let f = counter();
    ledger.set_handler("orders", Some(f)).unwrap();
    ledger
}

fn run_lines(ledger: &Ledger, config: &Config, lines: &[Value]) -> Vec<String> {
    let input: String = lines.iter().map(|v| format!("{v}\n")).collect();
    let mut out = Vec::new();
    run_pipe(ledger, config, input.as_bytes(), &mut out).unwrap();
    common::outcome_names(out)
}

/// The counter handler's counts summed over every store of `orders`.
fn counted(ledger: &Ledger) -> u64 {
    ledger
        .state_entries("orders")
        .unwrap()
        .iter()
        .map(|(_, v)| std::str::from_utf8(v).unwrap().parse::<u64>().unwrap())
        .sum()
}

/// Decisions of `orders` that were taken again later: a handler call set aside for the
/// subscriber's fair share of the thread (on a busy machine the counter handler can go
/// past it), or a retry. Each is checked against the other shard again, so it counts again
/// among the probed or unprobed keys.
fn redecided(ledger: &Ledger) -> u64 {
    let c = &ledger.subscriber("orders").unwrap().counters;
    c.handler_calls_deferred
        .load(std::sync::atomic::Ordering::Relaxed)
        + c.retries.load(std::sync::atomic::Ordering::Relaxed)
}

/// An entity text that routes to `shard` of 2.
fn entity_on(shard: usize, salt: &str) -> String {
    (0..)
        .map(|i| format!("{salt}-{i}"))
        .find(|e| ((key_hash(e.as_bytes()) >> 64) as u64 % 2) as usize == shard)
        .unwrap()
}

#[test]
fn same_id_with_another_entity_is_quarantined_and_its_claim_is_found() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_shard_config(Some("/order_id"));
    let ledger = open_with_counter(tmp.path(), &config);
    let (a, b) = (entity_on(0, "a"), entity_on(1, "b"));
    // An id whose own hash routes to `b`'s shard, so a lookup by the key's hash alone
    // would miss the claim written on `a`'s shard.
    let id = (0..)
        .map(|i| format!("m-{i}"))
        .find(|m| ((key_hash(m.as_bytes()) >> 64) as u64 % 2) == 1)
        .unwrap();
    let first = json!({"subscriber": "orders", "id": id, "payload": {"order_id": a}});
    let moved = json!({"subscriber": "orders", "id": id, "payload": {"order_id": b}});
    // One after the other (sent together, the two shards race; the next test covers that).
    assert_eq!(
        run_lines(&ledger, &config, std::slice::from_ref(&first)),
        ["processed"]
    );
    assert_eq!(
        run_lines(&ledger, &config, std::slice::from_ref(&moved)),
        ["quarantined"]
    );
    let out = run_lines(&ledger, &config, &[first, moved]);
    assert_eq!(out, ["duplicate", "quarantined"]);
    let claim = ledger.lookup("orders", key_hash(id.as_bytes())).unwrap();
    assert!(
        claim.is_some(),
        "the claim is found whatever shard holds it"
    );
    assert!(ledger.forget("orders", key_hash(id.as_bytes())).unwrap());
    assert!(ledger
        .lookup("orders", key_hash(id.as_bytes()))
        .unwrap()
        .is_none());
    let state = ledger.state_entries("orders").unwrap();
    assert_eq!(state.len(), 1, "only the first delivery ran the handler");
    ledger.close().unwrap();
}

#[test]
fn concurrent_deliveries_with_two_entities_are_decided_once() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_shard_config(Some("/order_id"));
    let ledger = open_with_counter(tmp.path(), &config);
    let (a, b) = (entity_on(0, "a"), entity_on(1, "b"));
    // Each id arrives twice in a row, once per entity: the two deliveries are decided by
    // different shards in the same moment, so either may win; exactly one must.
    let ids = 3000;
    let mut lines = Vec::new();
    for i in 0..ids {
        let (first, second) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        for e in [first, second] {
            lines.push(
                json!({"subscriber": "orders", "id": format!("m-{i}"), "payload": {"order_id": e}}),
            );
        }
    }
    let out = run_lines(&ledger, &config, &lines);
    for i in 0..ids {
        let mut pair = [out[2 * i].as_str(), out[2 * i + 1].as_str()];
        pair.sort_unstable();
        assert_eq!(pair, ["processed", "quarantined"], "id m-{i}");
    }
    // Each processed message counted once, in its entity's store.
    assert_eq!(counted(&ledger), ids as u64);
    ledger.close().unwrap();
}

/// Keys asked of the other shard (a probe round trip) and keys decided without one, summed
/// over shards.
fn probe_counts(ledger: &Ledger) -> (u64, u64) {
    let m = ledger.metrics();
    (
        m.iter().map(|s| s.probed_keys).sum(),
        m.iter().map(|s| s.unprobed_keys).sum(),
    )
}

#[test]
fn new_ids_skip_the_probe_and_moved_redeliveries_are_still_found() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = two_shard_config(Some("/order_id"));
    // Small generations: the run seals and merges, so the other shard's published claims
    // move from in-memory generations to sealed filters while it goes on.
    config.ledger.generation_max_claims = std::num::NonZeroUsize::new(200).unwrap();
    config.ledger.merge_trigger_generations = std::num::NonZeroUsize::new(2).unwrap();
    let ledger = open_with_counter(tmp.path(), &config);
    let entities: Vec<[String; 2]> = (0..20)
        .map(|i| {
            [
                entity_on(0, &format!("a{i}")),
                entity_on(1, &format!("b{i}")),
            ]
        })
        .collect();
    let ids = 4000;
    let line = |i: usize, side: usize| {
        json!({"subscriber": "orders", "id": format!("m-{i}"),
            "payload": {"order_id": entities[i % entities.len()][side]}})
    };
    // The first batch of each shard probes: the other shard may not have published yet.
    let warm = 400;
    let first: Vec<Value> = (0..warm).map(|i| line(i, i % 2)).collect();
    assert_eq!(run_lines(&ledger, &config, &first), vec!["processed"; warm]);
    let (probed_warm, unprobed_warm) = probe_counts(&ledger);
    assert_eq!(
        probed_warm + unprobed_warm,
        warm as u64 + redecided(&ledger)
    );
    let redecided_warm = redecided(&ledger);
    // In two halves, with the generations sealed and merged in between (and while the
    // run goes on): the other shard's claims move from Bloom filters to sealed filters.
    let mid = (warm + ids) / 2;
    for range in [warm..mid, mid..ids] {
        let next: Vec<Value> = range.clone().map(|i| line(i, i % 2)).collect();
        assert_eq!(
            run_lines(&ledger, &config, &next),
            vec!["processed"; range.len()]
        );
        ledger.maintain(range.start == warm).unwrap();
    }
    let (probed, unprobed) = probe_counts(&ledger);
    let (new_probed, new_unprobed) = (probed - probed_warm, unprobed - unprobed_warm);
    assert_eq!(
        new_probed + new_unprobed,
        (ids - warm) as u64 + redecided(&ledger) - redecided_warm,
        "every new id was checked on the other shard"
    );
    // Once both shards published, only a "maybe" of a Bloom filter (0.2 % each) probes.
    assert!(
        new_unprobed >= (ids - warm) as u64 * 97 / 100,
        "only {new_unprobed} of {} new ids skipped the probe ({new_probed} probed)",
        ids - warm
    );
    let seals: u64 = ledger.metrics().iter().map(|m| m.seals).sum();
    let merges: u64 = ledger.metrics().iter().map(|m| m.merges).sum();
    assert!(
        seals > 0 && merges > 0,
        "the run sealed ({seals}) and merged ({merges}) generations"
    );
    ledger.maintain(true).unwrap();
    // Every id again, its entity now on the other shard: the published claims say
    // "maybe", the probe finds the claim, and the changed payload is quarantined.
    let moved: Vec<Value> = (0..ids).map(|i| line(i, 1 - i % 2)).collect();
    let out = run_lines(&ledger, &config, &moved);
    assert_eq!(out, vec!["quarantined"; ids]);
    let (probed_after, _) = probe_counts(&ledger);
    assert!(
        probed_after - probed >= ids as u64,
        "every moved id was asked for"
    );
    assert_eq!(counted(&ledger), ids as u64, "each id counted once");
    ledger.close().unwrap();
}

#[test]
fn handler_added_later_still_finds_claims_made_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_shard_config(None);
    let ledger = Ledger::open(tmp.path(), &config, Arc::new(SystemClock)).unwrap();
    let lines: Vec<Value> = (0..500)
        .map(|i| json!({"subscriber": "orders", "id": format!("m-{i}"), "payload": {"order_id": "o-1"}}))
        .collect();
    assert_eq!(run_lines(&ledger, &config, &lines), vec!["processed"; 500]);
    // Now a handler: its messages run on one shard, but the claims are on both.
    let f = counter();
    ledger.set_handler("orders", Some(f)).unwrap();
    assert_eq!(run_lines(&ledger, &config, &lines), vec!["duplicate"; 500]);
    assert!(ledger.state_entries("orders").unwrap().is_empty());
    ledger.close().unwrap();
    // And after a restart (the placements were recorded).
    let ledger = open_with_counter(tmp.path(), &config);
    assert_eq!(run_lines(&ledger, &config, &lines), vec!["duplicate"; 500]);
    ledger.close().unwrap();
}

#[test]
fn format_1_directory_is_upgraded_and_older_binaries_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_shard_config(None);
    let ledger = Ledger::open(tmp.path(), &config, Arc::new(SystemClock)).unwrap();
    let lines: Vec<Value> = (0..300)
        .map(|i| json!({"subscriber": "orders", "id": format!("m-{i}"), "payload": {"n": i}}))
        .collect();
    assert_eq!(run_lines(&ledger, &config, &lines), vec!["processed"; 300]);
    ledger.close().unwrap();
    // Make it a format-1 directory, as an older dedupd left it.
    let manifest = tmp.path().join("dedupd.manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(m["format_version"], dedupd::ledger::FORMAT_VERSION);
    m["format_version"] = json!(1);
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    for shard in 0..2 {
        let db = redb::Database::open(tmp.path().join(format!("shard-{shard:03}.redb"))).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn
                .open_table(redb::TableDefinition::<&str, u64>::new("meta_v1"))
                .unwrap();
            meta.insert("format_version", 1).unwrap();
        }
        let _ = txn.delete_table(redb::TableDefinition::<&str, u8>::new("placements_v1"));
        txn.commit().unwrap();
    }
    // Format 1 routed by whatever partition key was configured then: claims can be on
    // any shard. Deliveries of the old ids under a new placement are still duplicates.
    let ledger = open_with_counter(tmp.path(), &config);
    m = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(
        m["format_version"],
        dedupd::ledger::FORMAT_VERSION,
        "the manifest now refuses older binaries"
    );
    assert_eq!(run_lines(&ledger, &config, &lines), vec!["duplicate"; 300]);
    ledger.close().unwrap();
}

#[test]
fn jobs_placed_by_entity_carry_it_and_by_key_do_not() {
    let tmp = tempfile::tempdir().unwrap();
    let config = two_shard_config(Some("/order_id"));
    let ledger = Ledger::open(tmp.path(), &config, Arc::new(SystemClock)).unwrap();
    let sub = ledger.subscriber("orders").unwrap();
    let (ack, _rx) = crossbeam_channel::unbounded::<Vec<Done>>();
    let mut job = Job::new(1, sub.id, key_hash(b"m"), 1, "m", b"{}", ack.clone());
    // Without a handler the partition key is not used: the id's hash picks the shard.
    let shard = ledger.place(&sub, &mut job, Some("o-1".into()));
    assert_eq!(shard, ledger.route(key_hash(b"m")));
    assert!(job.entity.is_none());
    let f = counter();
    ledger.set_handler("orders", Some(f)).unwrap();
    let mut job = Job::new(2, sub.id, key_hash(b"m"), 1, "m", b"{}", ack);
    let shard = ledger.place(&sub, &mut job, Some("o-1".into()));
    assert_eq!(shard, ledger.route(key_hash(b"o-1")));
    assert_eq!(job.entity.as_deref(), Some("o-1"));
    ledger.close().unwrap();
}
