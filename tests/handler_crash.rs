//! Effectively-once handler state under `kill -9`: the real binary in pipe mode runs the
//! `shipping-label` component; it is killed mid-stream several times and the whole stream
//! is redelivered from the start each time, as a broker would. Afterwards there must be
//! exactly one label per order — none doubled, none lost — no event may have been printed
//! `processed` twice, and everything acknowledged before a kill must be a `duplicate` after.
//!
//! Shipping-label is idempotent by construction (`insert-unique`), so a doubled effect could
//! hide there. The kill loop at the end runs the `fixture-counter` component instead
//! (`count/<order>` = get + 1 per event, not idempotent) through ten seeded kills with a
//! tiny state buffer, so runs are flushed and merged across the kills: any effect applied
//! twice or lost changes a count.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const EVENTS: u64 = 6_000;
/// The stream's and the kill points' seed (`DEDUPD_RELIABILITY_SEED` varies it).
fn seed() -> u64 {
    common::seed(0x5eed_1abe1)
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Two distinct events per order (a producer retry with a fresh id), plus redeliveries of
/// earlier lines.
fn stream() -> Vec<(String, String)> {
    let seed = seed();
    let mut lines = Vec::new();
    let mut sent: Vec<(String, String)> = Vec::new();
    for i in 0..EVENTS {
        let ev = (
            format!("e-{i}"),
            format!(
                "{{\"id\":\"e-{i}\",\"payload\":{{\"order_id\":\"o-{}\",\"type\":\"OrderPlaced\"}}}}",
                i / 2
            ),
        );
        sent.push(ev.clone());
        lines.push(ev);
        if mix(seed ^ i).is_multiple_of(10) {
            let j = (mix(seed ^ i ^ 1) % sent.len() as u64) as usize;
            lines.push(sent[j].clone());
        }
    }
    lines
}

fn write_config_for(dir: &Path, ledger: &str, component: &str) -> PathBuf {
    let path = dir.join("dedupd.toml");
    let text = format!(
        "{ledger}[defaults]\nhandler = {:?}\nhandler_cpu_budget = \"2s\"\npartition_key = {{ source = \"json_pointer\", pointer = \"/order_id\" }}\n",
        common::component(component).display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs pipe mode over the whole stream; kills it after `kill_after` outcome lines.
/// Returns the outcome lines read (id, outcome) and whether it exited by itself with 0.
fn run(
    data: &Path,
    config: &Path,
    lines: &[(String, String)],
    kill_after: Option<usize>,
) -> (Vec<(String, String)>, bool) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .args(["pipe", "--data-dir"])
        .arg(data)
        .arg("--config")
        .arg(config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // A run that will be killed is fed a little past its kill point and its stdin is held
    // open, so the kill lands while those last batches (claims + labels) are committing.
    let fed = kill_after.map_or(lines.len(), |k| (k + 400).min(lines.len()));
    let input: Vec<String> = lines[..fed].iter().map(|(_, l)| l.clone()).collect();
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    let feeder = std::thread::spawn(move || {
        for l in input {
            if writeln!(stdin, "{l}").is_err() {
                return; // killed
            }
        }
        if kill_after.is_some() {
            let _ = hold_rx.recv();
        }
        drop(stdin);
    });
    let mut got = Vec::new();
    let reader = BufReader::new(child.stdout.take().unwrap());
    for line in reader.lines() {
        let Ok(line) = line else { break };
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        got.push((
            v["id"].as_str().unwrap().to_string(),
            v["outcome"].as_str().unwrap().to_string(),
        ));
        if Some(got.len()) == kill_after {
            child.kill().unwrap();
            break;
        }
    }
    let status = child.wait().unwrap();
    drop(hold_tx);
    let _ = feeder.join();
    (got, kill_after.is_none() && status.success())
}

#[test]
fn one_label_per_order_after_repeated_kill_9_and_full_redelivery() {
    kill_9_rounds("");
}

/// The same with a tiny handler state buffer: kills land while buffers are frozen, applied
/// slice by slice and their log rows deleted, and restarts rebuild buffers from the log.
#[test]
fn one_label_per_order_with_state_buffers_applied_between_kills() {
    kill_9_rounds("[ledger]\nstate_buffer_entries = 64\n");
}

fn kill_9_rounds(ledger: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (data, config) = kill_rounds_then_finish(
        dir.path(),
        ledger,
        "shipping_label",
        &[900, 2_500, 4_100, 5_300],
    );
    // Exactly one label per order.
    let labels = common::state_dump(&data, &config);
    let orders: BTreeSet<String> = labels
        .iter()
        .map(|l| l["value"]["order_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(labels.len() as u64, EVENTS / 2, "labels doubled or lost");
    assert_eq!(orders.len() as u64, EVENTS / 2);
    for l in &labels {
        let order = l["value"]["order_id"].as_str().unwrap();
        assert_eq!(l["key"], format!("label/{order}"));
    }
}

/// Runs pipe mode with `component` over the stream, killed after each of `kills` outcome
/// lines and redelivered from the start each time, then once to the end. Asserts that
/// nothing acknowledged before a kill is processed after it, that no event is printed
/// `processed` twice and that the final run answers every line in order. Returns the data
/// directory and the config file.
fn kill_rounds_then_finish(
    dir: &Path,
    ledger: &str,
    component: &str,
    kills: &[usize],
) -> (PathBuf, PathBuf) {
    let data = dir.join("data");
    let config = write_config_for(dir, ledger, component);
    let lines = stream();
    let mut processed: BTreeMap<String, usize> = BTreeMap::new();
    let mut acked_processed: BTreeSet<String> = BTreeSet::new();
    for (round, &kill_after) in kills.iter().enumerate() {
        let (got, _) = run(&data, &config, &lines, Some(kill_after));
        assert_eq!(
            got.len(),
            kill_after,
            "round {round}: too few lines before the kill"
        );
        for (id, outcome) in &got {
            if acked_processed.contains(id) {
                assert_eq!(
                    outcome, "duplicate",
                    "round {round}: {id} acked earlier, now {outcome}"
                );
            }
            if outcome == "processed" {
                *processed.entry(id.clone()).or_default() += 1;
            }
        }
        acked_processed.extend(
            got.iter()
                .filter(|(_, o)| o == "processed")
                .map(|(id, _)| id.clone()),
        );
    }
    let (got, clean) = run(&data, &config, &lines, None);
    assert!(clean, "the final run must exit 0");
    assert_eq!(got.len(), lines.len(), "one outcome line per input line");
    for ((id, outcome), (want_id, _)) in got.iter().zip(&lines) {
        assert_eq!(id, want_id, "outcomes in input order");
        if acked_processed.contains(id) {
            assert_eq!(outcome, "duplicate");
        }
        if outcome == "processed" {
            *processed.entry(id.clone()).or_default() += 1;
        }
    }
    // No event was printed `processed` twice. (An event whose commit raced a kill was
    // processed but never printed; it reads `duplicate` afterwards, so the union of
    // `processed` lines may be smaller than the event count. The state the caller checks
    // proves that its effects were kept exactly once.)
    assert!(
        processed.values().all(|n| *n == 1),
        "an event was processed twice"
    );
    assert!(got
        .iter()
        .all(|(_, o)| o == "processed" || o == "duplicate"));

    (data, config)
}

/// Ten seeded kill points, spread over the stream.
fn kill_points(n: usize, len: usize) -> Vec<usize> {
    let mut points: Vec<usize> = (0..n as u64)
        .map(|i| 200 + (mix(seed() ^ 0xc0_0000 ^ i) % (len as u64 - 600)) as usize)
        .collect();
    points.sort_unstable();
    points.dedup();
    points
}

#[test]
fn counts_are_exact_after_ten_kill_9_rounds_with_state_runs_merging() {
    let dir = tempfile::tempdir().unwrap();
    let points = kill_points(10, stream().len());
    assert_eq!(points.len(), 10);
    let (data, config) = kill_rounds_then_finish(
        dir.path(),
        "[ledger]\nstate_buffer_entries = 64\n",
        "fixture_counter",
        &points,
    );
    let counts: BTreeMap<String, String> = common::state_dump(&data, &config)
        .iter()
        .map(|l| {
            (
                l["key"].as_str().unwrap().to_string(),
                l["value"].to_string(),
            )
        })
        .collect();
    // Two distinct events per order: each order's count is exactly 2.
    assert_eq!(counts.len() as u64, EVENTS / 2, "orders lost or split");
    let wrong: Vec<_> = counts.iter().filter(|(_, v)| *v != "2").take(5).collect();
    assert!(wrong.is_empty(), "counts doubled or lost: {wrong:?}");
}
