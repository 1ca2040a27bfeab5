//! Backup and restore as one story, with the real binary: `dedupd backup` of a stopped
//! engine and `POST /v1/maintenance/backup` of a running one write the same layout
//! (shards, manifest, `handlers/`, `audit.jsonl`, `backup.json` with checksums);
//! `dedupd restore` refuses a damaged backup before it writes anything, and a restored
//! directory answers every claimed id as a duplicate with the handler state as it was.
//!
//! The state is the `fixture-counter` component's (`count/<order>` = get + 1 per event,
//! not idempotent), so an effect applied twice or lost changes a count. Under load, the
//! backup is taken while messages flow, restored, and the whole stream is replayed into
//! the restored engine from the start, as a broker would redeliver after losing the
//! original disk: everything acknowledged before the backup is a duplicate, and every
//! count ends exact.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Two distinct events per order, plus a redelivery of an earlier line every 7th.
fn stream(events: u64) -> Vec<(String, String)> {
    let mut lines = Vec::new();
    for i in 0..events {
        let line = format!(
            "{{\"id\":\"e-{i}\",\"payload\":{{\"order_id\":\"o-{}\",\"type\":\"OrderPlaced\"}}}}",
            i / 2
        );
        lines.push((format!("e-{i}"), line));
        if i % 7 == 6 {
            let j = ((i * 31) % (i + 1)) as usize;
            lines.push(lines[j].clone());
        }
    }
    lines
}

/// The config of these tests; `handler`: the fixture-counter component from the config
/// (else it is uploaded over HTTP); `http`: an `[http]` section on a free loopback port.
fn write_config(dir: &Path, handler: bool, http: bool) -> PathBuf {
    let mut text = String::from(
        "[ledger]\nstate_buffer_entries = 64\n\n[defaults]\nhandler_cpu_budget = \"2s\"\npartition_key = { source = \"json_pointer\", pointer = \"/order_id\" }\n",
    );
    if handler {
        text.push_str(&format!(
            "handler = {:?}\n",
            common::component("fixture_counter").display().to_string()
        ));
    }
    text.push_str("\n[[subscriber]]\nname = \"default\"\n");
    if http {
        text.push_str("\n[http]\nbind = \"127.0.0.1:0\"\n");
    }
    let path = dir.join("dedupd.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `dedupd pipe` over `lines` to the end; the (id, outcome) of every line.
fn pipe(data: &Path, config: &Path, lines: &[(String, String)]) -> Vec<(String, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .args(["pipe", "--data-dir"])
        .arg(data)
        .arg("--config")
        .arg(config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input: Vec<String> = lines.iter().map(|(_, l)| l.clone()).collect();
    let feeder = std::thread::spawn(move || {
        for l in input {
            writeln!(stdin, "{l}").unwrap();
        }
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ids_and_outcomes(&common::json_lines(out.stdout))
}

fn ids_and_outcomes(lines: &[Value]) -> Vec<(String, String)> {
    lines
        .iter()
        .map(|v| {
            (
                v["id"].as_str().unwrap().to_string(),
                v["outcome"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// `count/<order>` -> count, from `dedupd state dump`.
fn counts(data: &Path, config: &Path) -> BTreeMap<String, String> {
    common::state_dump(data, config)
        .iter()
        .map(|l| {
            (
                l["key"].as_str().unwrap().to_string(),
                l["value"].to_string(),
            )
        })
        .collect()
}

/// Every order counted exactly twice (two distinct events per order).
fn assert_exact(counts: &BTreeMap<String, String>, events: u64) {
    assert_eq!(counts.len() as u64, events / 2, "orders lost or split");
    let wrong: Vec<_> = counts.iter().filter(|(_, v)| *v != "2").take(5).collect();
    assert!(wrong.is_empty(), "counts doubled or lost: {wrong:?}");
}

fn claims(data: &Path) -> u64 {
    let run = common::dedupd(&["inspect", "--json", "--data-dir", &data.to_string_lossy()]);
    run.assert_success();
    let report: Value = serde_json::from_str(&run.stdout).unwrap();
    report["subscribers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["claims"].as_u64().unwrap())
        .sum()
}

fn backup_files(dir: &Path) -> BTreeSet<String> {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("backup.json")).unwrap()).unwrap();
    manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn offline_backup_restores_every_claim_and_the_handler_state() {
    const EVENTS: u64 = 1_000;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = write_config(dir.path(), true, false);
    let lines = stream(EVENTS);
    let first = pipe(&data, &config, &lines);
    assert!(first.iter().any(|(_, o)| o == "processed"));
    assert_exact(&counts(&data, &config), EVENTS);

    let backup = dir.path().join("backup");
    let run = common::dedupd(&[
        "backup",
        "--data-dir",
        &data.to_string_lossy(),
        "--to",
        &backup.to_string_lossy(),
    ]);
    run.assert_success();
    assert!(run.stdout.contains("backup.json"), "{}", run.stdout);
    let files = backup_files(&backup);
    assert!(files.contains("dedupd.manifest.json") && files.contains("shard-000.redb"));
    // Progress, with stderr not a terminal: plain lines, no escapes; the step's bytes are
    // the shard files' and all of them were read.
    let shard_bytes: u64 = files
        .iter()
        .filter(|f| f.starts_with("shard-"))
        .map(|f| std::fs::metadata(backup.join(f)).unwrap().len())
        .sum();
    assert!(shard_bytes > 0);
    for line in [
        format!("copying shard files: {shard_bytes} bytes"),
        format!("copying shard files: done, {shard_bytes} bytes"),
    ] {
        assert!(run.stderr.contains(&line), "no {line:?} in {}", run.stderr);
    }
    assert!(!run.stderr.contains('\x1b'), "{:?}", run.stderr);
    // A non-empty target is refused.
    common::dedupd(&[
        "backup",
        "--data-dir",
        &data.to_string_lossy(),
        "--to",
        &backup.to_string_lossy(),
    ])
    .assert_refused(&["not empty"]);

    let restored = dir.path().join("restored");
    let run = common::dedupd(&[
        "restore",
        "--from",
        &backup.to_string_lossy(),
        "--data-dir",
        &restored.to_string_lossy(),
    ]);
    run.assert_success();
    assert!(run.stdout.contains("opens read-only"), "{}", run.stdout);
    // Both steps said, each with every byte of the backup read.
    let backup_bytes: u64 = files
        .iter()
        .filter(|f| *f != "backup.json")
        .map(|f| std::fs::metadata(backup.join(f)).unwrap().len())
        .sum();
    for line in [
        format!("checking the backup: done, {backup_bytes} bytes"),
        format!("restoring: done, {backup_bytes} bytes"),
    ] {
        assert!(run.stderr.contains(&line), "no {line:?} in {}", run.stderr);
    }
    assert_eq!(claims(&restored), claims(&data));
    assert_eq!(counts(&restored, &config), counts(&data, &config));

    // The whole stream again: every line is a duplicate, no count moves.
    let replay = pipe(&restored, &config, &lines);
    assert_eq!(replay.len(), lines.len());
    let not_dup: Vec<_> = replay
        .iter()
        .filter(|(_, o)| o != "duplicate")
        .take(5)
        .collect();
    assert!(
        not_dup.is_empty(),
        "not duplicates after restore: {not_dup:?}"
    );
    assert_exact(&counts(&restored, &config), EVENTS);
}

/// Copies the files of `from` into a new directory `to` (one level deep is enough here).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn restore_refuses_a_damaged_backup_naming_the_file_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = write_config(dir.path(), true, false);
    pipe(&data, &config, &stream(200));
    let good = dir.path().join("good");
    common::dedupd(&[
        "backup",
        "--data-dir",
        &data.to_string_lossy(),
        "--to",
        &good.to_string_lossy(),
    ])
    .assert_success();
    common::dedupd(&["restore", "--check", "--from", &good.to_string_lossy()]).assert_success();

    type Damage = fn(&Path);
    let cases: [(&str, Damage, &[&str]); 7] = [
        (
            "appended",
            |b| {
                let mut f = std::fs::OpenOptions::new()
                    .append(true)
                    .open(b.join("shard-001.redb"))
                    .unwrap();
                f.write_all(b"x").unwrap();
            },
            &["shard-001.redb", "bytes"],
        ),
        (
            "flipped",
            |b| {
                let p = b.join("shard-000.redb");
                let mut bytes = std::fs::read(&p).unwrap();
                let mid = bytes.len() / 2;
                bytes[mid] ^= 0x5a;
                std::fs::write(&p, bytes).unwrap();
            },
            &["shard-000.redb", "checksum"],
        ),
        (
            "missing",
            |b| std::fs::remove_file(b.join("shard-000.redb")).unwrap(),
            &["shard-000.redb", "missing"],
        ),
        (
            "extra",
            |b| std::fs::write(b.join("stray.txt"), "?").unwrap(),
            &["stray.txt", "extra file"],
        ),
        (
            "manifest changed",
            |b| {
                let p = b.join("dedupd.manifest.json");
                let text = std::fs::read_to_string(&p).unwrap();
                std::fs::write(&p, text.replace("\"shards\": 2", "\"shards\": 3")).unwrap();
            },
            &["dedupd.manifest.json"],
        ),
        (
            "interrupted",
            |b| std::fs::remove_file(b.join("backup.json")).unwrap(),
            &["not a complete backup", "backup.json"],
        ),
        (
            "newer",
            |b| {
                let p = b.join("backup.json");
                let text = std::fs::read_to_string(&p).unwrap();
                std::fs::write(
                    &p,
                    text.replace("\"backup_format\": 1", "\"backup_format\": 99"),
                )
                .unwrap();
            },
            &["backup format 99", "newer dedupd"],
        ),
    ];
    for (i, (name, damage, needles)) in cases.iter().enumerate() {
        let bad = dir.path().join(format!("bad-{i}"));
        copy_dir(&good, &bad);
        damage(&bad);
        let target = dir.path().join(format!("target-{i}"));
        let run = common::dedupd(&[
            "restore",
            "--from",
            &bad.to_string_lossy(),
            "--data-dir",
            &target.to_string_lossy(),
        ]);
        run.assert_refused(needles);
        run.assert_refused(&["nothing was restored"]);
        assert!(!target.exists(), "{name}: the restore wrote {target:?}");
        let check = common::dedupd(&["restore", "--check", "--from", &bad.to_string_lossy()]);
        check.assert_refused(needles);
        check.assert_refused(&["nothing would be restored"]);
    }

    // A non-empty data directory is refused and left as it was.
    let occupied = dir.path().join("occupied");
    std::fs::create_dir_all(&occupied).unwrap();
    std::fs::write(occupied.join("keep.txt"), "mine").unwrap();
    common::dedupd(&[
        "restore",
        "--from",
        &good.to_string_lossy(),
        "--data-dir",
        &occupied.to_string_lossy(),
    ])
    .assert_refused(&["not empty"]);
    let left: Vec<_> = std::fs::read_dir(&occupied).unwrap().collect();
    assert_eq!(left.len(), 1);
    assert_eq!(
        std::fs::read_to_string(occupied.join("keep.txt")).unwrap(),
        "mine"
    );
}

/// One HTTP/1.1 request on a new connection: status code and body.
fn http(addr: &str, method: &str, path: &str, content_type: &str, body: &[u8]) -> (u16, String) {
    let mut conn = TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    conn.write_all(body).unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).unwrap();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}

/// `dedupd run` with stdin and the HTTP API; its address, once it listens.
fn start_run(data: &Path, config: &Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .args(["run", "--config"])
        .arg(config)
        .arg("--data-dir")
        .arg(data)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "run exited");
        if let Some(a) = line.split("http://").nth(1) {
            break a.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
    (child, addr)
}

/// Lines written ahead of the outcome lines read, like a consumer's window: the stream
/// keeps flowing while the backup runs instead of being all in the engine already.
const WINDOW: usize = 64;

/// Feeds `lines` to the engine's stdin (at most [`WINDOW`] ahead of the answers, then
/// closes it) while a reader collects the outcome lines; `read` counts them as they
/// arrive. Returns the feeder's and the reader's handles.
fn stream_through(
    child: &mut Child,
    lines: &[(String, String)],
    read: Arc<AtomicUsize>,
    got: Arc<Mutex<Vec<(String, String)>>>,
) -> (std::thread::JoinHandle<()>, std::thread::JoinHandle<()>) {
    let mut stdin = child.stdin.take().unwrap();
    let input: Vec<String> = lines.iter().map(|(_, l)| l.clone()).collect();
    let answered = read.clone();
    let feeder = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(300);
        for (sent, l) in input.into_iter().enumerate() {
            while sent >= answered.load(Ordering::SeqCst) + WINDOW {
                assert!(Instant::now() < deadline, "no answers");
                std::thread::sleep(Duration::from_micros(200));
            }
            writeln!(stdin, "{l}").unwrap();
            stdin.flush().unwrap();
        }
    });
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let reader = std::thread::spawn(move || {
        for line in stdout.lines() {
            let v: Value = serde_json::from_str(&line.unwrap()).unwrap();
            got.lock().unwrap().push((
                v["id"].as_str().unwrap().to_string(),
                v["outcome"].as_str().unwrap().to_string(),
            ));
            read.fetch_add(1, Ordering::SeqCst);
        }
    });
    (feeder, reader)
}

/// SIGTERM, and a clean exit within 60 s.
fn stop(mut child: Child) {
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "dedupd run did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

/// Runs the whole stream through a running engine (stdin + HTTP API) until every line is
/// answered, taking an online backup named `backup` once `at` lines were answered.
/// Returns the outcomes and how many were answered before the backup was asked for.
fn run_with_backup_at(
    data: &Path,
    config: &Path,
    lines: &[(String, String)],
    at: usize,
    backup: &str,
) -> (Vec<(String, String)>, usize, Value) {
    let (mut child, addr) = start_run(data, config);
    // The handler is uploaded, so it lives in DATA_DIR/handlers/ (the backup must carry it).
    let wasm = std::fs::read(common::component("fixture_counter")).unwrap();
    let (code, body) = http(
        &addr,
        "PUT",
        "/v1/subscribers/default/handler",
        "application/wasm",
        &wasm,
    );
    assert_eq!(code, 200, "{body}");
    let read = Arc::new(AtomicUsize::new(0));
    let got = Arc::new(Mutex::new(Vec::new()));
    let (feeder, reader) = stream_through(&mut child, lines, read.clone(), got.clone());
    let deadline = Instant::now() + Duration::from_secs(300);
    while read.load(Ordering::SeqCst) < at {
        assert!(Instant::now() < deadline, "the stream stalled");
        std::thread::sleep(Duration::from_millis(2));
    }
    let before = read.load(Ordering::SeqCst);
    let request = format!("{{\"name\":\"{backup}\"}}");
    let (code, body) = http(
        &addr,
        "POST",
        "/v1/maintenance/backup",
        "application/json",
        request.as_bytes(),
    );
    assert_eq!(code, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    eprintln!(
        "online backup after {before} answers, {} answered when it returned: {answer}",
        read.load(Ordering::SeqCst)
    );
    // While the engine runs, the offline route refuses and points at the online one.
    let offline_target = data.with_file_name("offline-while-running");
    common::dedupd(&[
        "backup",
        "--data-dir",
        &data.to_string_lossy(),
        "--to",
        &offline_target.to_string_lossy(),
    ])
    .assert_refused(&["in use by a running dedupd", "POST /v1/maintenance/backup"]);
    assert!(!offline_target.exists());
    feeder.join().unwrap();
    while read.load(Ordering::SeqCst) < lines.len() {
        assert!(
            Instant::now() < deadline,
            "the stream stalled after the backup"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    stop(child);
    reader.join().unwrap();
    let got = got.lock().unwrap().clone();
    (got, before, answer)
}

/// Replays the whole stream into `data` through `dedupd run` (the uploaded handler is
/// installed from `handlers/` at start).
fn replay(data: &Path, config: &Path, lines: &[(String, String)]) -> Vec<(String, String)> {
    let (mut child, _addr) = start_run(data, config);
    let read = Arc::new(AtomicUsize::new(0));
    let got = Arc::new(Mutex::new(Vec::new()));
    let (feeder, reader) = stream_through(&mut child, lines, read.clone(), got.clone());
    feeder.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    while read.load(Ordering::SeqCst) < lines.len() {
        assert!(Instant::now() < deadline, "the replay stalled");
        std::thread::sleep(Duration::from_millis(5));
    }
    stop(child);
    reader.join().unwrap();
    let got = got.lock().unwrap().clone();
    got
}

#[test]
fn online_backup_under_load_restores_and_replays_with_no_duplicate_effect() {
    const EVENTS: u64 = 4_000;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = write_config(dir.path(), false, true);
    let lines = stream(EVENTS);
    let (first, before, answer) =
        run_with_backup_at(&data, &config, &lines, lines.len() / 2, "mid");
    assert_eq!(first.len(), lines.len());
    assert!(
        answer["longest_writer_pause_ms"].as_f64().is_some(),
        "{answer}"
    );
    assert_exact(&counts(&data, &config), EVENTS);

    // The online backup has the offline layout: shards, manifest, handler, audit log.
    let backup = data.join("backups/mid");
    let files = backup_files(&backup);
    for f in [
        "dedupd.manifest.json",
        "shard-000.redb",
        "audit.jsonl",
        "handlers/default/current",
    ] {
        assert!(files.contains(f), "{f} missing from {files:?}");
    }
    assert!(files.iter().any(|f| f.ends_with(".wasm")), "{files:?}");

    let restored = dir.path().join("restored");
    common::dedupd(&[
        "restore",
        "--from",
        &backup.to_string_lossy(),
        "--data-dir",
        &restored.to_string_lossy(),
    ])
    .assert_success();
    let at_backup = claims(&restored);
    assert!(
        at_backup > 0 && at_backup < EVENTS,
        "the backup is not mid-stream: {at_backup} claims"
    );

    let again = replay(&restored, &config, &lines);
    assert_eq!(again.len(), lines.len(), "one outcome line per input line");
    // Everything acknowledged before the backup was asked for is in it.
    let acked_before: BTreeSet<&String> = first[..before]
        .iter()
        .filter(|(_, o)| o == "processed")
        .map(|(id, _)| id)
        .collect();
    let mut processed_again: BTreeMap<&String, usize> = BTreeMap::new();
    for ((id, outcome), (want, _)) in again.iter().zip(&lines) {
        assert_eq!(id, want, "outcomes in input order");
        assert!(
            outcome == "processed" || outcome == "duplicate",
            "{id}: {outcome}"
        );
        if acked_before.contains(id) {
            assert_eq!(
                outcome, "duplicate",
                "{id} was acknowledged before the backup"
            );
        }
        if outcome == "processed" {
            *processed_again.entry(id).or_default() += 1;
        }
    }
    assert!(
        processed_again.values().all(|n| *n == 1),
        "processed twice in the replay"
    );
    assert!(
        !processed_again.is_empty(),
        "the messages after the backup were not replayed"
    );
    // No doubled or lost effect: the restored engine ends where the original did.
    let restored_counts = counts(&restored, &config);
    assert_exact(&restored_counts, EVENTS);
    assert_eq!(restored_counts, counts(&data, &config));
    assert_eq!(claims(&restored), claims(&data));

    // The stopped original, backed up offline, restores the handler and the audit log too.
    let offline = dir.path().join("offline");
    common::dedupd(&[
        "backup",
        "--data-dir",
        &data.to_string_lossy(),
        "--to",
        &offline.to_string_lossy(),
    ])
    .assert_success();
    let offline_files = backup_files(&offline);
    assert!(
        offline_files.contains("audit.jsonl") && offline_files.contains("handlers/default/current")
    );
    assert!(
        !offline_files.iter().any(|f| f.starts_with("backups/")),
        "{offline_files:?}"
    );
    let second = dir.path().join("second");
    common::dedupd(&[
        "restore",
        "--from",
        &offline.to_string_lossy(),
        "--data-dir",
        &second.to_string_lossy(),
    ])
    .assert_success();
    for f in ["audit.jsonl", "handlers/default/current"] {
        assert_eq!(
            std::fs::read(second.join(f)).unwrap(),
            std::fs::read(data.join(f)).unwrap(),
            "{f}"
        );
    }
    assert_eq!(counts(&second, &config), counts(&data, &config));
}

/// Submits one message to the ledger and waits for its durable outcome (`failed` when the
/// ledger has stopped and refuses it).
fn submit_one(ledger: &dedupd::ledger::Ledger, sub: &str, id: &str) -> String {
    use dedupd::envelope::{fingerprint, key_hash};
    let s = ledger.subscriber(sub).unwrap();
    let (ack, rx) = crossbeam_channel::unbounded();
    let key = key_hash(id.as_bytes());
    let job = dedupd::ledger::Job::new(0, s.id, key, fingerprint(b"{}"), id, b"{}", ack);
    if ledger.submit(ledger.route(key), vec![job]).is_err() {
        return "failed".into();
    }
    rx.recv()
        .map_or_else(|_| "failed".into(), |o| o[0].outcome.name().to_string())
}

/// One writer per shard, each committing one message after another (the shards commit
/// all the time, independently of each other), until stopped or until the ledger answers
/// anything but `processed`. Records what was acknowledged as processed.
struct Writers {
    running: Arc<std::sync::atomic::AtomicBool>,
    committed: Arc<AtomicUsize>,
    acked: Arc<Mutex<Vec<String>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Writers {
    fn start(ledger: &Arc<dedupd::ledger::Ledger>, sub: &'static str) -> Writers {
        let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let committed = Arc::new(AtomicUsize::new(0));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..ledger.shard_count())
            .map(|shard| {
                let (ledger, running, committed, acked) = (
                    ledger.clone(),
                    running.clone(),
                    committed.clone(),
                    acked.clone(),
                );
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while running.load(Ordering::Relaxed) {
                        n += 1;
                        let id = format!("w{shard}-{n}");
                        if ledger.route(dedupd::envelope::key_hash(id.as_bytes())) != shard {
                            continue;
                        }
                        if submit_one(&ledger, sub, &id) != "processed" {
                            return;
                        }
                        acked.lock().unwrap().push(id);
                        committed.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Writers {
            running,
            committed,
            acked,
            threads,
        }
    }

    fn committed(&self) -> usize {
        self.committed.load(Ordering::Relaxed)
    }

    /// Waits until `more` further messages are acknowledged (at most 60 s).
    fn wait_for(&self, more: usize) {
        let target = self.committed() + more;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.committed() < target {
            assert!(
                Instant::now() < deadline,
                "the writers stopped acknowledging at {} messages",
                self.committed()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn acked(&self) -> Vec<String> {
        self.acked.lock().unwrap().clone()
    }

    /// Stops the writers; returns every id acknowledged as processed.
    fn stop(self) -> Vec<String> {
        self.running.store(false, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        let acked = self.acked.lock().unwrap();
        acked.clone()
    }
}

fn two_shards() -> dedupd::config::Config {
    dedupd::config::Config::parse("[ledger]\nshards = 2\n").unwrap()
}

#[test]
fn online_backup_cuts_every_shard_at_one_engine_wide_commit() {
    use dedupd::ledger::Ledger;
    let dir = tempfile::tempdir().unwrap();
    let config = two_shards();
    let ledger = Arc::new(
        Ledger::open(
            &dir.path().join("data"),
            &config,
            Arc::new(dedupd::clock::SystemClock),
        )
        .unwrap(),
    );
    let writers = Writers::start(&ledger, "cut");
    let mut pauses = Vec::new();
    let mut acked_before_last = Vec::new();
    for i in 0..8 {
        writers.wait_for(20);
        acked_before_last = writers.acked();
        let report =
            dedupd::backup::backup_online(&ledger, &dir.path().join(format!("b{i}"))).unwrap();
        let cuts: Vec<u64> = report
            .shard_copies
            .iter()
            .map(|c| c.engine_commits)
            .collect();
        assert_eq!(report.shard_copies.len(), 2);
        assert!(
            cuts.iter().all(|c| *c == cuts[0]),
            "backup {i}: the shards' copies end at different engine-wide commits {cuts:?} \
             (copied at different instants): {:?}",
            report.shard_copies
        );
        pauses.push(report.longest_writer_pause_ms());
    }
    let committed = writers.stop().len();
    eprintln!("longest writer pause per backup (ms): {pauses:?}; {committed} messages committed");
    // The last backup restores and holds everything acknowledged before it began.
    drop(ledger);
    let restored = dir.path().join("restored");
    dedupd::backup::restore(&dir.path().join("b7"), &restored).unwrap();
    let ledger = Ledger::open(&restored, &config, Arc::new(dedupd::clock::SystemClock)).unwrap();
    for id in &acked_before_last {
        assert_eq!(submit_one(&ledger, "cut", id), "duplicate", "{id}");
    }
}

/// The backup's target fails while the writers bring their copies up to date (the first
/// shard's copy is replaced by a directory, so it cannot be written): the backup fails
/// naming the shard file, leaves nothing a restore would take, and the engine goes on
/// acknowledging; the next backup succeeds and restores everything acknowledged before it.
#[test]
fn a_backup_whose_target_fails_is_refused_and_the_engine_goes_on() {
    use dedupd::ledger::Ledger;
    let dir = tempfile::tempdir().unwrap();
    let config = two_shards();
    let clock = Arc::new(dedupd::clock::SystemClock);
    let ledger = Arc::new(Ledger::open(&dir.path().join("data"), &config, clock.clone()).unwrap());
    let writers = Writers::start(&ledger, "bk");
    writers.wait_for(20);
    let broken = dir.path().join("broken");
    let err = ledger
        .backup_after_copy(&broken, || {
            let copy = broken.join("shard-000.redb");
            std::fs::remove_file(&copy).unwrap();
            std::fs::create_dir(&copy).unwrap();
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("backup of") && err.contains("shard-000.redb"),
        "the error names the shard whose copy failed: {err}"
    );
    assert!(
        ledger.poison_reason().is_none(),
        "a failed backup stops nothing"
    );
    writers.wait_for(50);
    assert!(
        dedupd::backup::verify(&broken).is_err(),
        "the failed backup has no backup.json"
    );
    assert!(dedupd::backup::restore(&broken, &dir.path().join("from-broken")).is_err());
    let acked_before = writers.acked();
    dedupd::backup::backup_online(&ledger, &dir.path().join("good")).unwrap();
    writers.stop();
    drop(ledger);
    let restored = dir.path().join("restored");
    dedupd::backup::restore(&dir.path().join("good"), &restored).unwrap();
    let ledger = Ledger::open(&restored, &config, clock).unwrap();
    for id in &acked_before {
        assert_eq!(submit_one(&ledger, "bk", id), "duplicate", "{id}");
    }
}

/// The engine's own disk fails (or loses power) while a backup copies it: the backup fails
/// with the storage error and writes no `backup.json`, nothing is acknowledged after the
/// failure, and the data directory reopened on a healthy disk holds every acknowledged
/// message.
#[test]
fn a_storage_fault_during_a_backup_fails_it_and_loses_nothing() {
    use dedupd::ledger::{FaultSwitch, Ledger};
    type Arm = fn(&FaultSwitch);
    let faults: [(&str, Arm); 2] = [
        ("failing disk", |f| f.fail_after_fsyncs(0)),
        ("power cut", |f| f.cut_power_after_fsyncs(0, 7)),
    ];
    for (what, arm) in faults {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let config = two_shards();
        let clock = Arc::new(dedupd::clock::SystemClock);
        let (ledger, fault) =
            Ledger::open_with_fault_switch(&data, &config, clock.clone()).unwrap();
        let ledger = Arc::new(ledger);
        let writers = Writers::start(&ledger, "bk");
        writers.wait_for(20);
        let target = dir.path().join("backup");
        let result = ledger.backup_after_copy(&target, || {
            // Fails the next fsync of either shard, and waits until a commit met it, so
            // the fault lands between the copy and the cut.
            arm(&fault);
            let deadline = Instant::now() + Duration::from_secs(60);
            while ledger.poison_reason().is_none() {
                assert!(Instant::now() < deadline, "{what}: no commit met the fault");
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let err = result.expect_err(what).to_string();
        assert!(err.contains("injected"), "{what}: {err}");
        let acked = writers.stop();
        assert!(acked.len() >= 20, "{what}");
        assert!(
            dedupd::backup::verify(&target).is_err(),
            "{what}: a failed backup has no backup.json"
        );
        drop(ledger);
        let ledger = Ledger::open(&data, &config, clock).unwrap();
        for id in &acked {
            assert_eq!(submit_one(&ledger, "bk", id), "duplicate", "{what}: {id}");
        }
    }
}
