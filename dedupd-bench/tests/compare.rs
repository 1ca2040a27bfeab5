//! `dedupd-bench compare --quick --json` with tiny sizes: every system has a row, each one
//! either measured with figures that add up (and match the generated traffic) or skipped
//! with a reason; dedupd's ratios follow from the rows; the plots are PNG files. Nothing
//! here depends on how fast the machine is.
#![allow(
    clippy::unwrap_used,
    reason = "helpers outside #[test]: a failed unwrap is a failed test"
)]

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The shipping-label component built by `plugins/build.sh` (scripts/test runs it).
fn component(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/target/wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    assert!(
        p.exists(),
        "{} is missing: run plugins/build.sh (scripts/test does)",
        p.display()
    );
    p
}

/// What a `dedupd-bench` run printed.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn assert_success(&self) {
        assert_eq!(
            self.code,
            Some(0),
            "exit code; stderr:\n{}\nstdout:\n{}",
            self.stderr,
            self.stdout
        );
    }
}

fn dedupd_bench(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_dedupd-bench"))
        .args(args)
        .output()
        .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

const SYSTEMS: &[&str] = &[
    "dedupd_claim",
    "dedupd_label_seq",
    "dedupd_label_random",
    "naive_redb",
    "postgres_txn",
    "postgres_batch",
    "redis_everysec",
    "redis_everysec_pipelined",
    "redis_always",
    "redis_always_pipelined",
    "sqlite_batch",
];

#[test]
fn quick_compare_reports_every_system_measured_and_verified_or_skipped_with_a_reason() {
    let handler = component("shipping_label");
    let tmp = tempfile::tempdir().unwrap();
    let plots = tmp.path().join("plots");
    let run = dedupd_bench(&[
        "compare",
        "--quick",
        "--json",
        "--messages",
        "3000",
        "--request-messages",
        "200",
        "--naive-messages",
        "1000",
        "--naive-stored",
        "500",
        "--series-step",
        "1000",
        "--batch",
        "100",
        "--clients",
        "2",
        "--handler",
        handler.to_str().unwrap(),
        "--dir",
        tmp.path().to_str().unwrap(),
        "--plots",
        plots.to_str().unwrap(),
    ]);
    run.assert_success();
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, SYSTEMS);

    let rate = |key: &str| {
        rows.iter().find(|r| r["key"] == key).unwrap()["msgs_per_sec"]
            .as_f64()
            .unwrap()
    };
    // dedupd itself must always be measured: it needs nothing outside this repository.
    for key in [
        "dedupd_claim",
        "dedupd_label_seq",
        "dedupd_label_random",
        "naive_redb",
        "sqlite_batch",
    ] {
        let row = rows.iter().find(|r| r["key"] == key).unwrap();
        assert!(
            row["skipped"].is_null(),
            "{key} skipped: {}",
            row["skipped"]
        );
    }
    let claim = rate("dedupd_claim");
    for r in rows {
        let key = r["key"].as_str().unwrap();
        assert!(!r["durability"].as_str().unwrap().is_empty(), "{key}");
        if let Some(reason) = r["skipped"].as_str() {
            assert!(!reason.trim().is_empty(), "{key} skipped without a reason");
            eprintln!("{key} skipped: {reason}");
            continue;
        }
        let n = |f: &str| {
            r[f].as_u64()
                .unwrap_or_else(|| panic!("{key}.{f}: {}", r[f]))
        };
        let x = |f: &str| {
            r[f].as_f64()
                .unwrap_or_else(|| panic!("{key}.{f}: {}", r[f]))
        };
        assert_eq!(n("processed") + n("duplicates"), n("messages"), "{key}");
        assert_eq!(n("processed"), n("expected_processed"), "{key}");
        assert_eq!(n("duplicates"), n("expected_duplicates"), "{key}");
        // The naive table holds the 500 keys stored before its measured messages too.
        let preloaded = if key == "naive_redb" { 500 } else { 0 };
        assert_eq!(
            n("stored_keys"),
            n("expected_processed") + preloaded,
            "{key}"
        );
        assert!(n("duplicates") > 0 && n("processed") > 0, "{key}");
        assert_eq!(r["verified"], true, "{key}");
        assert!(x("msgs_per_sec") > 0.0, "{key}");
        assert!(x("p99_ms") >= x("p50_ms") && x("p50_ms") >= 0.0, "{key}");
        assert!(x("memory_bytes_per_key") >= 0.0, "{key}");
        assert!(x("disk_bytes_per_key") > 0.0, "{key}");
        let ratio = x("dedupd_ratio");
        assert!(
            (ratio - claim / x("msgs_per_sec")).abs() <= 1e-9 * ratio.abs().max(1.0),
            "{key}: ratio {ratio} vs {claim} / {}",
            x("msgs_per_sec")
        );
    }
    // The targets are computed from the same rows (met or not is the machine's
    // business, not this test's).
    let targets = report["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 4);
    let naive = &targets[2];
    let expected = claim / rate("naive_redb");
    assert!((naive["ratio"].as_f64().unwrap() - expected).abs() <= 1e-9 * expected);
    assert!(!report["series"].as_array().unwrap().is_empty());
    assert!(report["machine"]["cores"].as_u64().unwrap() >= 1);

    let files = report["plots"].as_array().unwrap();
    assert_eq!(files.len(), 3, "{}", run.stderr);
    for f in files {
        let bytes = std::fs::read(f.as_str().unwrap()).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{f}");
        // IHDR: width and height are big-endian u32s after the chunk's length and type.
        let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert!(width >= 600 && height >= 300, "{f}: {width}x{height}");
        assert!(
            bytes.len() > 5_000,
            "{f}: {} bytes, an empty picture?",
            bytes.len()
        );
    }
}

/// `dedupd-bench soak --plot` draws the soak's curves whatever its verdict (a short soak
/// may fail a criterion; a machine without a font says so instead of drawing).
#[test]
fn soak_draws_its_curves() {
    let tmp = tempfile::tempdir().unwrap();
    let plot = tmp.path().join("soak.png");
    let run = dedupd_bench(&[
        "soak",
        "--minutes",
        "0.15",
        "--capacity-secs",
        "2",
        "--sample-secs",
        "1",
        "--ttl-secs",
        "2",
        "--generation-claims",
        "2048",
        "--dir",
        tmp.path().to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(run.code == Some(0) || run.code == Some(1), "{}", run.stderr);
    match std::fs::metadata(&plot) {
        Ok(m) => assert!(m.len() > 10_000, "{} bytes", m.len()),
        Err(_) => assert!(run.stderr.contains("font"), "no plot: {}", run.stderr),
    }
}
