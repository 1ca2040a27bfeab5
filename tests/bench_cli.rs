//! `dedupd bench` as a process: the engine alone (with the naive redb baseline), paced or
//! not. The comparisons with other stores are the `dedupd-bench` crate's.
#![allow(
    clippy::unwrap_used,
    reason = "helpers outside #[test]: a failed unwrap is a failed test"
)]

mod common;

use serde_json::Value;

#[test]
fn bench_without_a_subcommand_still_runs_the_engine_bench() {
    let tmp = tempfile::tempdir().unwrap();
    let run = common::dedupd(&[
        "bench",
        "--messages",
        "2000",
        "--naive-messages",
        "500",
        "--json",
        "--dir",
        tmp.path().to_str().unwrap(),
    ]);
    run.assert_success();
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["verified"], true);
    assert!(report["naive_msgs_per_sec"].as_f64().unwrap() > 0.0);
    // stderr is a pipe here: progress comes as whole lines, never `\r` updates that pile
    // onto one line of a log file.
    assert!(!run.stderr.contains('\r'), "{:?}", run.stderr);
    assert!(
        run.stderr.lines().count() >= 1,
        "no progress line: {:?}",
        run.stderr
    );
}

/// `--rate` offers the load at that rate: 3,000 messages at 10,000 msgs/s take at least
/// 0.3 s however fast the engine is, and every outcome is still checked.
#[test]
fn bench_rate_paces_the_offered_load() {
    let tmp = tempfile::tempdir().unwrap();
    let run = common::dedupd(&[
        "bench",
        "--messages",
        "3000",
        "--naive-messages",
        "0",
        "--rate",
        "10000",
        "--json",
        "--dir",
        tmp.path().to_str().unwrap(),
    ]);
    run.assert_success();
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["verified"], true);
    assert_eq!(report["params"]["rate"], 10000);
    let rate = report["msgs_per_sec"].as_f64().unwrap();
    assert!(rate <= 10_000.0 * 1.05, "paced at {rate} msgs/s");
    assert!(report["elapsed_s"].as_f64().unwrap() >= 0.29, "{report}");
    let refused = common::dedupd(&["bench", "--rate", "0"]);
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
}

/// Parameters a bench cannot use are refused before it starts, by the library's check,
/// naming the flag: the engine bench and a broker bench (which would otherwise connect).
#[test]
fn benches_refuse_bad_parameters_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    common::dedupd(&["bench", "--dup-rate", "1.5", "--dir", dir])
        .assert_refused(&["dedupd: dup_rate (--dup-rate) must be in [0, 1), got 1.5"]);
    common::dedupd(&[
        "bench",
        "--dup-rate",
        "0.6",
        "--mismatch-rate",
        "0.4",
        "--dir",
        dir,
    ])
    .assert_refused(&["(--dup-rate + --mismatch-rate) must be less than 1"]);
    common::dedupd(&["bench", "adversarial", "--orders", "0", "--dir", dir])
        .assert_refused(&["orders (--orders) must be at least 1, got 0"]);
    common::dedupd(&[
        "nats-bench",
        "--server",
        "nats://127.0.0.1:9",
        "--batch",
        "5000",
        "--dir",
        dir,
    ])
    .assert_refused(&["batch (--batch) must be at most the window, got 5000 with window 4096"]);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

/// `dedupd demo` started outside the repository finds its handler beside the checkout the
/// binary was built in (it used to look only under the current directory); a handler that
/// is nowhere says where it looked and how to build it.
#[test]
fn demo_finds_its_handler_from_any_directory_and_says_where_it_looked() {
    let built = common::component("shipping_label");
    let elsewhere = tempfile::tempdir().unwrap();
    let run = common::Run::of(
        std::process::Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .args(["demo", "--messages", "3000"])
            .current_dir(elsewhere.path()),
    );
    run.assert_success();
    let said = run
        .stderr
        .lines()
        .find(|l| l.starts_with("handler:"))
        .unwrap_or_else(|| panic!("no handler line:\n{}", run.stderr));
    assert!(said.contains("shipping_label.wasm"), "{said}");
    let found = said
        .trim_start_matches("handler: ")
        .split(" (")
        .next()
        .unwrap();
    assert_eq!(
        std::fs::canonicalize(found).unwrap(),
        std::fs::canonicalize(&built).unwrap()
    );
    // The disk figure is explained: its parts add up to it, and claims and labels both
    // take some.
    let mib = |line: &str| -> f64 {
        line.split(" MiB")
            .next()
            .unwrap()
            .split_whitespace()
            .last()
            .unwrap()
            .parse()
            .unwrap()
    };
    let out: Vec<&str> = run.stdout.lines().collect();
    let at = out
        .iter()
        .position(|l| l.starts_with("on disk"))
        .unwrap_or_else(|| panic!("no disk line:\n{}", run.stdout));
    let total = mib(out[at]);
    let parts: Vec<f64> = out[at + 1..at + 5].iter().map(|l| mib(l)).collect();
    assert!(
        out[at + 1].contains("claims") && out[at + 2].contains("handler state"),
        "{}",
        run.stdout
    );
    assert!(parts[0] > 0.0 && parts[1] > 0.0, "{}", run.stdout);
    let sum: f64 = parts.iter().sum();
    assert!(
        (sum - total).abs() <= 0.25,
        "{sum} != {total}:\n{}",
        run.stdout
    );

    let missing = common::Run::of(
        std::process::Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .args(["demo", "--messages", "10", "--handler", "nowhere.wasm"])
            .current_dir(elsewhere.path()),
    );
    missing.assert_refused(&[
        "looked in nowhere.wasm",
        "plugins/build.sh",
        "--handler none",
    ]);
}
