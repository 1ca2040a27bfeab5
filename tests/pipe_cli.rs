//! Behaviour of `dedupd pipe` as a process: JSON lines in, one outcome line per input line
//! out (in input order, after durable commit), exit codes and error messages.
//!
//! Every test runs the real binary on its own temporary data directory.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_dedupd");

/// What one `dedupd` invocation produced.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    /// Outcome lines parsed as JSON. Panics on a line that is not a JSON object with exactly
    /// the documented fields.
    fn lines(&self) -> Vec<Value> {
        self.stdout
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("outcome line is not JSON ({e}): {l:?}"));
                let obj = v
                    .as_object()
                    .unwrap_or_else(|| panic!("not an object: {l}"));
                let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
                keys.sort_unstable();
                assert_eq!(
                    keys,
                    ["id", "key", "outcome", "reason", "seq", "subscriber"],
                    "fields of {l}"
                );
                v
            })
            .collect()
    }

    /// `outcome` of each line, after checking that `seq` counts 1, 2, 3...
    fn outcomes(&self) -> Vec<String> {
        self.lines()
            .iter()
            .enumerate()
            .map(|(i, v)| {
                assert_eq!(v["seq"], json!(i as u64 + 1), "seq of line {i}: {v}");
                v["outcome"]
                    .as_str()
                    .expect("outcome is a string")
                    .to_string()
            })
            .collect()
    }

    fn assert_success(&self) {
        assert_eq!(
            self.code,
            Some(0),
            "exit code; stderr:\n{}\nstdout:\n{}",
            self.stderr,
            self.stdout
        );
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
    }

    /// A refusal: exit code 1, no outcome printed, no panic, and stderr names the problem.
    fn assert_refused(&self, needles: &[&str]) {
        assert_eq!(
            self.code,
            Some(1),
            "exit code; stderr:\n{}\nstdout:\n{}",
            self.stderr,
            self.stdout
        );
        assert!(
            self.stdout.is_empty(),
            "nothing may be acked: {}",
            self.stdout
        );
        assert!(
            !self.stderr.contains("panicked"),
            "an error, not a panic:\n{}",
            self.stderr
        );
        for n in needles {
            assert!(
                self.stderr.contains(n),
                "stderr should mention {n:?}:\n{}",
                self.stderr
            );
        }
    }
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Runs `dedupd <args>` with `input` on stdin (written from its own thread so a full stdout
/// pipe cannot deadlock us).
fn dedupd(args: &[&std::ffi::OsStr], input: &[u8]) -> Run {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dedupd");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_vec();
    // A refused start closes stdin early; a broken pipe here is expected then.
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().expect("wait for dedupd");
    feeder.join().expect("feeder thread");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn pipe_cfg(dir: &Path, config: Option<&Path>, input: impl AsRef<[u8]>) -> Run {
    let mut args: Vec<&std::ffi::OsStr> =
        vec!["pipe".as_ref(), "--data-dir".as_ref(), dir.as_os_str()];
    if let Some(c) = config {
        args.push("--config".as_ref());
        args.push(c.as_os_str());
    }
    dedupd(&args, input.as_ref())
}

fn pipe(dir: &Path, input: impl AsRef<[u8]>) -> Run {
    pipe_cfg(dir, None, input)
}

/// JSON lines, one per value, each ending in a newline.
fn jsonl(values: &[Value]) -> String {
    values.iter().map(|v| format!("{v}\n")).collect()
}

fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

fn read_manifest(dir: &Path) -> Value {
    let bytes = std::fs::read(dir.join("dedupd.manifest.json")).expect("manifest exists");
    serde_json::from_slice(&bytes).expect("manifest is JSON")
}

/// A data directory holding a few claims, made by a clean run with two shards.
fn populated_dir(tmp: &Path) -> PathBuf {
    let dir = tmp.join("data");
    let cfg = write_config(tmp, "two-shards.toml", "[ledger]\nshards = 2\n");
    let input: Vec<Value> = (0..2000)
        .map(|i| json!({"id": format!("evt-{i}"), "payload": {"n": i}}))
        .collect();
    let run = pipe_cfg(&dir, Some(&cfg), jsonl(&input));
    run.assert_success();
    assert_eq!(run.outcomes().len(), 2000);
    dir
}

#[test]
fn first_delivery_is_processed_and_redelivery_is_duplicate() {
    let tmp = tempfile::tempdir().unwrap();
    let run = pipe(
        tmp.path(),
        jsonl(&[
            json!({"id": "a", "payload": {"x": 1}}),
            json!({"id": "b", "payload": {"x": 1}}),
            json!({"id": "a", "payload": {"x": 1}}),
            json!({"id": "a", "payload": {"x": 1}}),
        ]),
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["processed", "processed", "duplicate", "duplicate"]
    );
    for line in run.lines() {
        assert_eq!(line["reason"], Value::Null, "{line}");
    }
}

#[test]
fn duplicate_after_restart_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let first: Vec<Value> = (0..50)
        .map(|i| json!({"id": format!("order-{i}"), "payload": {"amount": i * 10}}))
        .collect();
    let run = pipe(tmp.path(), jsonl(&first));
    run.assert_success();
    assert!(run.outcomes().iter().all(|o| o == "processed"));

    // The broker redelivers everything after a restart, plus 50 new messages.
    let second: Vec<Value> = (0..100)
        .map(|i| json!({"id": format!("order-{i}"), "payload": {"amount": i * 10}}))
        .collect();
    let run = pipe(tmp.path(), jsonl(&second));
    run.assert_success();
    let outcomes = run.outcomes();
    assert_eq!(outcomes.len(), 100);
    for (i, o) in outcomes.iter().enumerate() {
        let want = if i < 50 { "duplicate" } else { "processed" };
        assert_eq!(o, want, "line {}", i + 1);
    }

    // And a third start still knows all of them.
    let run = pipe(tmp.path(), jsonl(&second));
    run.assert_success();
    assert!(run.outcomes().iter().all(|o| o == "duplicate"));
}

#[test]
fn malformed_lines_are_rejected_and_stream_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let mut input: Vec<u8> = Vec::new();
    let cases: &[(&[u8], &str, Option<&str>)] = &[
        (br#"{"id":"ok-1","payload":{}}"#, "processed", None),
        (b"this is not json", "rejected", Some("malformed JSON")),
        (
            br#"{"id":"ok-2","payload":"#,
            "rejected",
            Some("malformed JSON"),
        ),
        (b"", "rejected", Some("empty line")),
        (b"   \t ", "rejected", Some("empty line")),
        (br#"["id","x"]"#, "rejected", Some("malformed JSON")),
        (
            br#"{"payload":{"a":1}}"#,
            "rejected",
            Some("`id` is missing"),
        ),
        (
            br#"{"id":"","payload":{}}"#,
            "rejected",
            Some("`id` is empty"),
        ),
        (br#"{"id":7}"#, "rejected", Some("malformed JSON")),
        (
            br#"{"id":"ok-3","paylod":{}}"#,
            "rejected",
            Some("unknown field `paylod`"),
        ),
        (
            b"{\"id\":\"bad-\xff\xfe\"}",
            "rejected",
            Some("malformed JSON"),
        ),
        (br#"{"id":"ok-1","payload":{}}"#, "duplicate", None),
        (br#"{"id":"ok-2","payload":{}}"#, "processed", None),
    ];
    for (line, _, _) in cases {
        input.extend_from_slice(line);
        input.push(b'\n');
    }
    let run = pipe(tmp.path(), &input);
    run.assert_success();
    let lines = run.lines();
    assert_eq!(lines.len(), cases.len(), "one outcome per input line");
    for (i, ((line, want, reason), got)) in cases.iter().zip(&lines).enumerate() {
        let ctx = format!("line {} {:?}: {got}", i + 1, String::from_utf8_lossy(line));
        assert_eq!(got["seq"], json!(i as u64 + 1), "{ctx}");
        assert_eq!(got["outcome"], json!(want), "{ctx}");
        match reason {
            Some(r) => {
                let text = got["reason"].as_str().unwrap_or_else(|| panic!("{ctx}"));
                assert!(text.contains(r), "reason should mention {r:?}: {ctx}");
            }
            None => assert_eq!(got["reason"], Value::Null, "{ctx}"),
        }
    }
}

#[test]
fn oversized_key_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let at_limit = "k".repeat(1024);
    let over = "k".repeat(1025);
    // 342 three-byte characters: 342 chars but 1026 bytes; the limit counts bytes.
    let wide = "€".repeat(342);
    let run = pipe(
        tmp.path(),
        jsonl(&[
            json!({ "id": over }),
            json!({ "id": at_limit }),
            json!({ "id": wide }),
            json!({ "id": at_limit }),
            json!({ "id": "after" }),
        ]),
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        [
            "rejected",
            "processed",
            "rejected",
            "duplicate",
            "processed"
        ]
    );
    let lines = run.lines();
    let reason = lines[0]["reason"].as_str().expect("reason");
    assert!(
        reason.contains("1025") && reason.contains("1024"),
        "reason names the size and the limit: {reason}"
    );
    let reason = lines[2]["reason"].as_str().expect("reason");
    assert!(reason.contains("1026"), "bytes, not chars: {reason}");
    // The rejected key is never echoed back in full.
    for i in [0, 2] {
        if let Some(id) = lines[i]["id"].as_str() {
            assert!(
                id.chars().count() <= 128,
                "echoed id is cut: {} chars",
                id.len()
            );
        }
    }
}

#[test]
fn empty_input_exits_cleanly_with_no_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fresh");
    let run = pipe(&dir, "");
    run.assert_success();
    assert_eq!(run.stdout, "");
    // The directory is initialised, and a second empty run is just as quiet.
    assert_eq!(
        read_manifest(&dir)["format_version"],
        json!(dedupd::ledger::FORMAT_VERSION)
    );
    let run = pipe(&dir, "");
    run.assert_success();
    assert_eq!(run.stdout, "");
}

#[test]
fn data_dir_gets_manifest_and_shard_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let cfg = write_config(tmp.path(), "c.toml", "[ledger]\nshards = 3\n");
    let run = pipe_cfg(&dir, Some(&cfg), jsonl(&[json!({"id": "a"})]));
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["processed"]);
    assert_eq!(
        read_manifest(&dir),
        json!({"format_version": dedupd::ledger::FORMAT_VERSION, "shards": 3})
    );
    for i in 0..3 {
        let shard = dir.join(format!("shard-{i:03}.redb"));
        assert!(shard.is_file(), "{} exists", shard.display());
    }
    assert!(!dir.join("shard-003.redb").exists());
    // Without a shard setting, the directory keeps the count it was created with.
    let run = pipe(&dir, jsonl(&[json!({"id": "a"})]));
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["duplicate"]);
    assert_eq!(read_manifest(&dir)["shards"], json!(3));
}

#[test]
fn newer_format_version_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    pipe(&dir, jsonl(&[json!({"id": "a"})])).assert_success();

    let mut manifest = read_manifest(&dir);
    manifest["format_version"] = json!(99);
    std::fs::write(
        dir.join("dedupd.manifest.json"),
        serde_json::to_vec_pretty(&manifest).unwrap(),
    )
    .unwrap();

    let run = pipe(&dir, jsonl(&[json!({"id": "a"}), json!({"id": "b"})]));
    run.assert_refused(&["newer", "format 99"]);
    // The refusal leaves the directory as it found it.
    assert_eq!(read_manifest(&dir)["format_version"], json!(99));
}

#[test]
fn same_id_other_payload_is_quarantined() {
    let tmp = tempfile::tempdir().unwrap();
    let original = json!({"id": "pay-1", "payload": {"amount": 100}});
    let changed = json!({"id": "pay-1", "payload": {"amount": 999}});
    let run = pipe(
        tmp.path(),
        jsonl(&[
            original.clone(),
            changed.clone(),
            original.clone(),
            changed.clone(),
            json!({"id": "pay-1"}),
        ]),
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        [
            "processed",
            "quarantined",
            "duplicate",
            "quarantined",
            "quarantined"
        ]
    );
    let lines = run.lines();
    let reason = lines[1]["reason"]
        .as_str()
        .expect("quarantine has a reason");
    assert!(reason.contains("different payload"), "{reason}");

    // The claim keeps the first payload across a restart; the mismatch stays visible.
    let run = pipe(tmp.path(), jsonl(&[changed, original]));
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["quarantined", "duplicate"]);
}

#[test]
fn subscribers_are_isolated() {
    let tmp = tempfile::tempdir().unwrap();
    let run = pipe(
        tmp.path(),
        jsonl(&[
            json!({"subscriber": "billing", "id": "e1", "payload": {"v": 1}}),
            json!({"subscriber": "shipping", "id": "e1", "payload": {"v": 1}}),
            // Another payload under another subscriber is not a mismatch.
            json!({"subscriber": "audit", "id": "e1", "payload": {"v": 2}}),
            // No subscriber: the default one, which is yet another scope.
            json!({"id": "e1", "payload": {"v": 3}}),
            json!({"subscriber": "default", "id": "e1", "payload": {"v": 3}}),
            json!({"subscriber": "billing", "id": "e1", "payload": {"v": 1}}),
            json!({"subscriber": "shipping", "id": "e1", "payload": {"v": 9}}),
        ]),
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        [
            "processed",
            "processed",
            "processed",
            "processed",
            "duplicate",
            "duplicate",
            "quarantined"
        ]
    );
    // Still isolated after a restart, and a new subscriber starts empty.
    let run = pipe(
        tmp.path(),
        jsonl(&[
            json!({"subscriber": "audit", "id": "e1", "payload": {"v": 2}}),
            json!({"subscriber": "billing", "id": "e1", "payload": {"v": 2}}),
            json!({"subscriber": "newcomer", "id": "e1", "payload": {"v": 1}}),
        ]),
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["duplicate", "quarantined", "processed"]
    );
}

#[test]
fn payload_key_order_does_not_make_a_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let input = concat!(
        r#"{"id":"o1","payload":{"a":1,"b":{"x":[1,2],"y":"z"}}}"#,
        "\n",
        r#"{"payload":{"b":{"y":"z","x":[1,2]},"a":1},"id":"o1"}"#,
        "\n",
        r#"{ "id" : "o1" , "payload" : { "b" : { "y" : "z" , "x" : [ 1 , 2 ] } , "a" : 1 } }"#,
        "\n",
        // Array order is content: this one is another payload.
        r#"{"id":"o1","payload":{"a":1,"b":{"x":[2,1],"y":"z"}}}"#,
        "\n",
        // No payload and an explicit null are the same payload.
        r#"{"id":"o2"}"#,
        "\n",
        r#"{"id":"o2","payload":null}"#,
        "\n",
    );
    let run = pipe(tmp.path(), input);
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        [
            "processed",
            "duplicate",
            "duplicate",
            "quarantined",
            "processed",
            "duplicate"
        ]
    );
}

/// `fingerprint = { ignore = [...] }`: a producer retry that re-stamps `sent_at` is a
/// duplicate, not a quarantined mismatch; any other difference still is one. Without the
/// setting the same retry is quarantined.
#[test]
fn ignored_fields_do_not_make_a_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    let input = jsonl(&[
        json!({"id": "o1", "payload": {"total": 5, "sent_at": "10:00:00", "meta": {"trace": "a"}}}),
        json!({"id": "o1", "payload": {"total": 5, "sent_at": "10:00:07", "meta": {"trace": "b"}}}),
        json!({"id": "o1", "payload": {"total": 6, "sent_at": "10:00:09", "meta": {"trace": "c"}}}),
    ]);
    let config = write_config(
        tmp.path(),
        "fp.toml",
        "[defaults]\nfingerprint = { ignore = [\"/sent_at\", \"/meta/trace\"] }\n",
    );
    let run = pipe_cfg(&tmp.path().join("with"), Some(&config), &input);
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["processed", "duplicate", "quarantined"]
    );
    let run = pipe(&tmp.path().join("without"), &input);
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["processed", "quarantined", "quarantined"]
    );
    // Not a JSON pointer: refused at start, naming the field.
    let bad = write_config(
        tmp.path(),
        "bad.toml",
        "[defaults]\nfingerprint = { ignore = [\"sent_at\"] }\n",
    );
    pipe_cfg(&tmp.path().join("bad"), Some(&bad), "")
        .assert_refused(&["defaults.fingerprint.ignore[0]", "JSON pointer"]);
}

#[test]
fn numbers_differing_past_f64_precision_are_a_mismatch() {
    let tmp = tempfile::tempdir().unwrap();
    // Both numbers round to the same f64; the payloads still differ.
    let input = concat!(
        r#"{"id":"big","payload":{"n":12345678901234567890123}}"#,
        "\n",
        r#"{"id":"big","payload":{"n":12345678901234567890124}}"#,
        "\n",
        r#"{"id":"big","payload":{ "n" : 12345678901234567890123 }}"#,
        "\n",
    );
    let run = pipe(tmp.path(), input);
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["processed", "quarantined", "duplicate"]
    );
}

#[test]
fn bad_config_is_refused_with_field_name() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str])] = &[
        ("[ledger]\nmax_bach = 3\n", &["max_bach"]),
        ("[ledger]\nshards = 0\n", &["shards"]),
        ("[ledger]\nshards = 300\n", &["ledger.shards"]),
        ("[ledger]\nmax_linger = \"5s\"\n", &["ledger.max_linger"]),
        ("[defaults]\nttl = \"10ms\"\n", &["defaults.ttl"]),
        ("[defaults]\nttl = \"soon\"\n", &["ttl"]),
        (
            "[defaults]\nmax_key_bytes = 0\n",
            &["defaults.max_key_bytes"],
        ),
        ("[[subscriber]]\nname = \"a/b\"\n", &["subscriber[0].name"]),
        (
            "[[subscriber]]\nname = \"a\"\n[[subscriber]]\nname = \"a\"\n",
            &["subscriber[1].name"],
        ),
        (
            "[[subscriber]]\nname = \"a\"\nkey = { source = \"json_pointer\", pointer = \"x\" }\n",
            &["subscriber[0].key.pointer"],
        ),
        ("default_subscriber = \"\"\n", &["default_subscriber"]),
        ("this is = not toml\n", &["not valid"]),
    ];
    for (i, (text, needles)) in cases.iter().enumerate() {
        let cfg = write_config(tmp.path(), &format!("bad-{i}.toml"), text);
        let dir = tmp.path().join(format!("data-{i}"));
        let run = pipe_cfg(&dir, Some(&cfg), jsonl(&[json!({"id": "a"})]));
        let mut all = vec!["config"];
        all.extend_from_slice(needles);
        run.assert_refused(&all);
        assert!(
            !dir.exists(),
            "a refused config must not create the data directory ({text:?})"
        );
    }
    // A config file that does not exist is named.
    let missing = tmp.path().join("nope.toml");
    let run = pipe_cfg(&tmp.path().join("d"), Some(&missing), "");
    run.assert_refused(&["nope.toml"]);
}

#[test]
fn shard_count_mismatch_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let two = write_config(tmp.path(), "two.toml", "[ledger]\nshards = 2\n");
    let three = write_config(tmp.path(), "three.toml", "[ledger]\nshards = 3\n");
    pipe_cfg(&dir, Some(&two), jsonl(&[json!({"id": "a"})])).assert_success();

    let run = pipe_cfg(&dir, Some(&three), jsonl(&[json!({"id": "b"})]));
    run.assert_refused(&["2 shards", "asks for 3", "ledger.shards"]);
    assert_eq!(read_manifest(&dir)["shards"], json!(2));
    assert!(!dir.join("shard-002.redb").exists());

    // The matching count still works, and nothing of the refused run was claimed.
    let run = pipe_cfg(
        &dir,
        Some(&two),
        jsonl(&[json!({"id": "a"}), json!({"id": "b"})]),
    );
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["duplicate", "processed"]);
}

#[test]
fn unreadable_manifest_is_reported_as_corrupt() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    std::fs::write(dir.join("dedupd.manifest.json"), b"{\"format_ver").unwrap();
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"})]));
    run.assert_refused(&[
        "dedupd.manifest.json",
        "corrupt",
        "manifest is not readable",
    ]);
}

#[test]
fn missing_manifest_with_shard_files_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    std::fs::remove_file(dir.join("dedupd.manifest.json")).unwrap();
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"})]));
    run.assert_refused(&["manifest is missing"]);
    // It did not start over with a fresh (empty) manifest.
    assert!(!dir.join("dedupd.manifest.json").exists());
}

#[test]
fn missing_shard_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let shard = dir.join("shard-001.redb");
    std::fs::remove_file(&shard).unwrap();
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"})]));
    run.assert_refused(&["shard-001.redb", "missing"]);
    // It did not start over with an empty shard (forgetting every claim that was in it).
    assert!(!shard.exists());
}

/// A shard file truncated to zero bytes is refused, not initialised as a new empty shard
/// (which would answer its claimed ids `processed` again).
#[test]
fn zero_length_shard_file_is_refused_not_used_as_empty() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let shard = dir.join("shard-001.redb");
    std::fs::File::create(&shard).unwrap();
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"})]));
    run.assert_refused(&["shard-001.redb", "is empty", "Restore it from a backup"]);
    assert_eq!(
        std::fs::metadata(&shard).unwrap().len(),
        0,
        "left as it was"
    );
}

/// A shard file that is a store but holds no dedupd data (a fresh redb file put in its
/// place) is refused as well.
#[test]
fn shard_file_without_dedupd_data_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let shard = dir.join("shard-001.redb");
    std::fs::remove_file(&shard).unwrap();
    dedupd::ledger::close_copied_shard(&shard).unwrap();
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"})]));
    run.assert_refused(&["shard-001.redb", "holds no dedupd data"]);
}

/// A shard file that is a symlink to a file on a disk that is not there (not mounted) is
/// missing: the target is not created.
#[test]
fn shard_symlink_to_a_missing_target_is_refused_and_nothing_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let disk = tmp.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let shard = dir.join("shard-001.redb");
    std::fs::remove_file(&shard).unwrap();
    let target = disk.join("shard-001.redb");
    std::os::unix::fs::symlink(&target, &shard).unwrap();
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"})]));
    run.assert_refused(&["shard-001.redb", "missing"]);
    assert!(!target.exists(), "the symlink's target was created");
}

/// Overwrites `len` bytes of `path` at `at` with a fixed non-zero pattern.
fn clobber(path: &Path, at: u64, len: usize) {
    use std::io::{Seek, SeekFrom};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open shard file");
    f.seek(SeekFrom::Start(at)).expect("seek");
    f.write_all(&vec![0xA5; len]).expect("overwrite");
    f.sync_all().expect("sync");
}

#[test]
fn corrupt_shard_header_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let shard = dir.join("shard-000.redb");
    clobber(&shard, 0, 512);
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"}), json!({"id": "new"})]));
    run.assert_refused(&["shard-000.redb"]);
}

#[test]
fn corrupt_shard_body_is_reported_without_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let shard = dir.join("shard-000.redb");
    let len = std::fs::metadata(&shard).unwrap().len();
    // Everything after the header: every table page of the shard is garbage now.
    clobber(&shard, 4096, (len - 4096) as usize);
    let run = pipe(&dir, jsonl(&[json!({"id": "evt-1"}), json!({"id": "new"})]));
    run.assert_refused(&["shard-000.redb", "corrupt"]);
}

#[test]
fn outcome_lines_name_subscriber_and_id() {
    // Many short runs: a line whose outcome is ready before the printer has seen the line
    // itself must still carry its subscriber and id.
    let tmp = tempfile::tempdir().unwrap();
    let input = jsonl(&[
        json!({"subscriber": "s1", "id": "a", "payload": 1}),
        json!({"subscriber": "s2", "id": "b", "payload": 2}),
        json!({"subscriber": "s1", "id": "a", "payload": 1}),
        json!({"subscriber": "s1", "payload": 1}),
        json!({"subscriber": "s2", "id": "x".repeat(2000)}),
    ]);
    let expected = [
        ("s1", Some("a")),
        ("s2", Some("b")),
        ("s1", Some("a")),
        ("s1", None),
        ("s2", Some(&"x".repeat(128)[..])),
    ];
    for attempt in 0..10 {
        let run = pipe(tmp.path(), &input);
        run.assert_success();
        let lines = run.lines();
        assert_eq!(lines.len(), expected.len());
        for (line, (sub, id)) in lines.iter().zip(expected) {
            assert_eq!(line["subscriber"], json!(sub), "run {attempt}: {line}");
            assert_eq!(line["id"], json!(id), "run {attempt}: {line}");
        }
    }
}

#[test]
fn outcomes_follow_input_order_against_a_model() {
    // A deterministic mix of new ids, redeliveries, mismatches and bad lines over three
    // subscribers, checked line by line against a simple in-memory model.
    let tmp = tempfile::tempdir().unwrap();
    let mut state: u64 = 0x5EED;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let subs = ["s-a", "s-b", "s-c"];
    let mut claims: std::collections::HashMap<(usize, u64), u64> = Default::default();
    let mut input = String::new();
    let mut want = Vec::new();
    for _ in 0..6000 {
        let r = next();
        let sub = (r % 3) as usize;
        let id = (r >> 8) % 1500;
        let payload = if r >> 40 & 31 == 0 { 7 } else { id * 3 };
        if r >> 50 & 63 == 0 {
            input.push_str("{\"id\": oops}\n");
            want.push("rejected");
            continue;
        }
        input.push_str(&format!(
            "{}\n",
            json!({"subscriber": subs[sub], "id": format!("m{id}"), "payload": {"p": payload}})
        ));
        want.push(match claims.get(&(sub, id)) {
            None => {
                claims.insert((sub, id), payload);
                "processed"
            }
            Some(&p) if p == payload => "duplicate",
            Some(_) => "quarantined",
        });
    }
    let run = pipe(tmp.path(), &input);
    run.assert_success();
    let got = run.outcomes();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "line {}", i + 1);
    }
}

#[test]
fn unknown_subscriber_is_rejected_when_not_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "c.toml",
        "allow_unknown_subscribers = false\ndefault_subscriber = \"known\"\n[[subscriber]]\nname = \"known\"\n",
    );
    let dir = tmp.path().join("data");
    let run = pipe_cfg(
        &dir,
        Some(&cfg),
        jsonl(&[
            json!({"subscriber": "stranger", "id": "x"}),
            json!({"id": "x"}),
            json!({"subscriber": "known", "id": "x"}),
            json!({"subscriber": "bad/name", "id": "y"}),
        ]),
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["rejected", "processed", "duplicate", "rejected"]
    );
    let lines = run.lines();
    let reason = lines[0]["reason"].as_str().expect("reason");
    assert!(
        reason.contains("stranger") && reason.contains("allow_unknown_subscribers"),
        "{reason}"
    );
    let reason = lines[3]["reason"].as_str().expect("reason");
    assert!(reason.contains("bad/name"), "{reason}");
}

#[test]
fn configured_key_source_is_used() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "c.toml",
        "[[subscriber]]\nname = \"billing\"\nkey = { source = \"json_pointer\", pointer = \"/order_id\" }\n\
         [[subscriber]]\nname = \"events\"\nkey = { source = \"header\", name = \"msg-id\" }\n",
    );
    let dir = tmp.path().join("data");
    let run = pipe_cfg(
        &dir,
        Some(&cfg),
        jsonl(&[
            json!({"subscriber": "billing", "payload": {"order_id": 42, "total": 5}}),
            // The envelope id is not the key for billing: same order, another envelope id.
            json!({"subscriber": "billing", "id": "other", "payload": {"order_id": 42, "total": 5}}),
            json!({"subscriber": "billing", "payload": {"order_id": 42, "total": 6}}),
            json!({"subscriber": "billing", "payload": {"total": 6}}),
            json!({"subscriber": "events", "headers": {"msg-id": "m1"}}),
            json!({"subscriber": "events", "id": "m1"}),
            json!({"subscriber": "events", "headers": {"msg-id": "m1"}, "id": "zzz"}),
        ]),
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        [
            "processed",
            "duplicate",
            "quarantined",
            "rejected",
            "processed",
            "rejected",
            "duplicate"
        ]
    );
    let lines = run.lines();
    assert!(lines[3]["reason"].as_str().unwrap().contains("/order_id"));
    assert!(lines[5]["reason"].as_str().unwrap().contains("msg-id"));
}

#[test]
fn crlf_and_missing_final_newline_are_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let run = pipe(
        tmp.path(),
        "{\"id\":\"a\"}\r\n{\"id\":\"b\"}\r\n\r\n{\"id\":\"a\"}",
    );
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["processed", "processed", "rejected", "duplicate"]
    );
}

#[test]
fn missing_data_dir_is_refused() {
    let run = dedupd(&["pipe".as_ref()], b"{\"id\":\"a\"}\n");
    run.assert_refused(&["--data-dir"]);
}

#[test]
fn data_dir_from_config_is_used() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("from-config");
    let cfg = write_config(
        tmp.path(),
        "c.toml",
        &format!("data_dir = {}\n", json!(dir.to_str().unwrap())),
    );
    let args: [&std::ffi::OsStr; 3] = ["pipe".as_ref(), "--config".as_ref(), cfg.as_os_str()];
    let run = dedupd(&args, b"{\"id\":\"a\"}\n");
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["processed"]);
    assert!(dir.join("dedupd.manifest.json").is_file());
    // The flag wins over the config.
    let other = tmp.path().join("flag");
    let run = pipe_cfg(&other, Some(&cfg), "{\"id\":\"a\"}\n");
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["processed"]);
}

#[test]
fn data_dir_in_use_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let cfg = write_config(tmp.path(), "c.toml", "[ledger]\nshards = 2\n");
    let mut first = Command::new(BIN)
        .args(["pipe", "--data-dir"])
        .arg(&dir)
        .arg("--config")
        .arg(&cfg)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn first dedupd");
    let mut stdin = first.stdin.take().unwrap();
    // Enough lines that both shards get work even if small bursts are held back; the
    // first outcome proves the first process holds the directory.
    let burst: Vec<Value> = (0..3000).map(|i| json!({"id": format!("h{i}")})).collect();
    stdin.write_all(jsonl(&burst).as_bytes()).unwrap();
    stdin.flush().unwrap();
    let mut out = std::io::BufReader::new(first.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["outcome"], json!("processed"));

    let run = pipe_cfg(&dir, Some(&cfg), jsonl(&[json!({"id": "b"})]));
    run.assert_refused(&["in use"]);

    drop(stdin);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert_eq!(rest.lines().count(), 2999);
    let status = first.wait().unwrap();
    assert!(
        status.success(),
        "the first process is unaffected: {status}"
    );
    // "b" was never claimed by the refused process.
    let run = pipe_cfg(
        &dir,
        Some(&cfg),
        jsonl(&[json!({"id": "h0"}), json!({"id": "b"})]),
    );
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["duplicate", "processed"]);
}

#[test]
fn outcome_is_printed_before_more_input_arrives() {
    // A broker that waits for each ack before it sends more must not wait forever: an
    // outcome may not depend on the next input line (or EOF) arriving.
    let tmp = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["pipe", "--data-dir"])
        .arg(tmp.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn dedupd");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            if tx.send(line.expect("read stdout")).is_err() {
                break;
            }
        }
    });
    let timeout = std::time::Duration::from_secs(5);
    let mut got = Vec::new();
    for id in ["first", "second"] {
        writeln!(stdin, "{}", json!({"id": id})).unwrap();
        stdin.flush().unwrap();
        got.push(rx.recv_timeout(timeout).ok());
        if got.last() == Some(&None) {
            break;
        }
    }
    drop(stdin);
    let status = child.wait().unwrap();
    let rest: Vec<String> = rx.iter().collect();
    reader.join().unwrap();
    assert!(status.success(), "{status}");
    assert!(
        got.iter().all(Option::is_some),
        "an outcome was held back until more input came ({}s timeout); \
         before EOF: {got:?}, after EOF: {rest:?}",
        timeout.as_secs()
    );
    let outcomes: Vec<Value> = got
        .iter()
        .flatten()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(outcomes[0]["outcome"], json!("processed"));
    assert_eq!(outcomes[1]["seq"], json!(2));
}

#[test]
fn identical_mismatches_are_one_quarantine_record_in_inspect() {
    let tmp = tempfile::tempdir().unwrap();
    let mut input = vec![json!({"id": "pay-1", "payload": {"amount": 100}})];
    input.extend((0..2000).map(|_| json!({"id": "pay-1", "payload": {"amount": 999}})));
    let run = pipe(tmp.path(), jsonl(&input));
    run.assert_success();
    let outcomes = run.outcomes();
    assert_eq!(outcomes.len(), 2001);
    assert!(outcomes[1..].iter().all(|o| o == "quarantined"));

    let inspect = dedupd(
        &[
            "inspect".as_ref(),
            "--data-dir".as_ref(),
            tmp.path().as_os_str(),
            "--json".as_ref(),
        ],
        b"",
    );
    inspect.assert_success();
    let report: Value = serde_json::from_str(&inspect.stdout).expect("inspect --json");
    let sub = &report["subscribers"][0];
    assert_eq!(sub["subscriber"], "default");
    assert_eq!(sub["quarantined"], 2000, "outcomes counted: {sub}");
    assert_eq!(sub["quarantine_records"], 1, "records stored: {sub}");

    // The one record counts every delivery it stands for.
    let ledger = dedupd::ledger::Ledger::open(
        tmp.path(),
        &dedupd::config::Config::default(),
        std::sync::Arc::new(dedupd::clock::SystemClock),
    )
    .expect("open data dir");
    let records = ledger
        .records(dedupd::ledger::RecordKind::Quarantine, "default", None, 10)
        .expect("records");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].body["count"], 2000);
    assert_eq!(records[0].body["payload"], "{\"amount\":999}");
}

fn line_of(len: usize, id: &str) -> String {
    let head = format!("{{\"id\":\"{id}\",\"payload\":\"");
    let tail = "\"}";
    let fill = "x".repeat(len - head.len() - tail.len());
    format!("{head}{fill}{tail}")
}

#[test]
fn line_length_cap_obeyed() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), "cap.toml", "[pipe]\nmax_line_bytes = 64\n");
    let line = line_of(64, "a");
    assert_eq!(line.len(), 64);
    let run = pipe_cfg(&tmp.path().join("data"), Some(&cfg), format!("{line}\r\n"));
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["processed"]);
}

#[test]
fn line_length_cap_violated_rejects_the_line_and_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), "cap.toml", "[pipe]\nmax_line_bytes = 64\n");
    let input = format!(
        "{}\n{}\n{}\n",
        line_of(40, "a"),
        line_of(65, "b"),
        line_of(40, "c")
    );
    let run = pipe_cfg(&tmp.path().join("data"), Some(&cfg), input);
    run.assert_success();
    assert_eq!(
        as_strs(&run.outcomes()),
        ["processed", "rejected", "processed"]
    );
    let lines = run.lines();
    let reason = lines[1]["reason"].as_str().expect("a reason");
    assert!(
        reason.contains("65 bytes") && reason.contains("pipe.max_line_bytes (64)"),
        "{reason}"
    );
    assert_eq!(lines[1]["id"], Value::Null);
    assert_eq!(lines[2]["id"], "c");
}

/// A handler uploaded through the API (stored under `DATA_DIR/handlers/`) is installed by
/// pipe mode too, which has no API: its messages run it instead of being claimed without it.
#[test]
fn handler_uploaded_through_the_api_runs_in_pipe_mode() {
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let component = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("plugins/target/wasm32-wasip2/release/shipping_label.wasm");
    let bytes = std::fs::read(&component)
        .unwrap_or_else(|e| panic!("{}: {e}; run plugins/build.sh", component.display()));
    {
        // What `PUT /v1/subscribers/u/handler` does.
        let config = dedupd::config::Config::default();
        let clock = Arc::new(dedupd::clock::SystemClock);
        let ledger = dedupd::ledger::Ledger::open(&dir, &config, clock).unwrap();
        dedupd::pipeline::UploadStore::new(&dir)
            .upload(&ledger, "u", &bytes)
            .unwrap();
        ledger.close().unwrap();
    }
    let event = json!({"subscriber": "u", "id": "m-2",
        "payload": {"type": "OrderPlaced", "order_id": "o-2"}});
    let run = pipe(&dir, jsonl(&[event]));
    run.assert_success();
    assert_eq!(as_strs(&run.outcomes()), ["processed"]);
    let dump = dedupd(
        &[
            "state".as_ref(),
            "dump".as_ref(),
            "--subscriber".as_ref(),
            "u".as_ref(),
            "--data-dir".as_ref(),
            dir.as_os_str(),
        ],
        b"",
    );
    dump.assert_success();
    assert!(
        dump.stdout.contains("\"key\":\"label/o-2\""),
        "the uploaded handler made no label:\n{}",
        dump.stdout
    );
}

/// A key source changed in the config file between runs while the subscriber has live
/// claims is refused at start, naming the subscriber and both sources; the same message
/// would otherwise be processed again under its new key.
#[test]
fn key_source_change_between_runs_with_live_claims_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let config = |pointer: &str| {
        write_config(
            tmp.path(),
            &format!("key{}.toml", pointer.len()),
            &format!("[[subscriber]]\nname = \"orders\"\nkey = {{ source = \"json_pointer\", pointer = \"{pointer}\" }}\n"),
        )
    };
    let event = jsonl(&[json!({"subscriber": "orders",
        "payload": {"event": "e-1", "order_id": "o-1"}})]);
    let first = pipe_cfg(&dir, Some(&config("/event")), &event);
    first.assert_success();
    assert_eq!(as_strs(&first.outcomes()), ["processed"]);
    let changed = pipe_cfg(&dir, Some(&config("/order_id")), &event);
    changed.assert_refused(&["\"orders\"", "/event", "/order_id", "new subscriber name"]);
    let same = pipe_cfg(&dir, Some(&config("/event")), &event);
    same.assert_success();
    assert_eq!(as_strs(&same.outcomes()), ["duplicate"]);
}

/// The data directory, its files and a backup of it hold payloads: they are created
/// readable by their owner only (0700 / 0600), whatever the umask lets through.
#[test]
fn data_files_and_backups_are_private_to_their_owner() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let backup = tmp.path().join("backup");
    let run = dedupd(
        &[
            "backup".as_ref(),
            "--data-dir".as_ref(),
            dir.as_os_str(),
            "--to".as_ref(),
            backup.as_os_str(),
        ],
        b"",
    );
    run.assert_success();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for d in [&dir, &backup] {
        assert_eq!(mode(d), 0o700, "{}", d.display());
        for entry in std::fs::read_dir(d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                assert_eq!(mode(&path), 0o600, "{}", path.display());
            }
        }
    }
}

/// `state dump` of a subscriber the directory does not hold (and the config does not name)
/// fails naming it, instead of printing nothing and exiting 0 as for an empty store.
#[test]
fn state_dump_of_an_unknown_subscriber_fails_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = populated_dir(tmp.path());
    let dump = dedupd(
        &[
            "state".as_ref(),
            "dump".as_ref(),
            "--subscriber".as_ref(),
            "nosuch".as_ref(),
            "--data-dir".as_ref(),
            dir.as_os_str(),
        ],
        b"",
    );
    dump.assert_refused(&["\"nosuch\"", "dedupd inspect"]);
    let known = dedupd(
        &[
            "state".as_ref(),
            "dump".as_ref(),
            "--subscriber".as_ref(),
            "default".as_ref(),
            "--data-dir".as_ref(),
            dir.as_os_str(),
        ],
        b"",
    );
    known.assert_success();
}

/// The start line counts the subscribers the config names (it said `subscribers=0` while
/// none had been used yet), and the closing summary is logged as fields, not as a Rust
/// `Debug` dump (`summary=PipeSummary { lines: 2, … }`).
#[test]
fn start_and_end_lines_count_in_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "two.toml",
        "[[subscriber]]\nname = \"orders\"\n\n[[subscriber]]\nname = \"payments\"\n",
    );
    let input = jsonl(&[
        json!({"subscriber": "orders", "id": "a", "payload": {}}),
        json!({"subscriber": "orders", "id": "a", "payload": {}}),
    ]);
    // Pipe mode logs at `warn` unless told otherwise.
    let input_file = tmp.path().join("in.jsonl");
    std::fs::write(&input_file, input).unwrap();
    let out = Command::new(BIN)
        .args(["pipe", "--data-dir"])
        .arg(tmp.path().join("data"))
        .arg("--config")
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .stdin(std::fs::File::open(&input_file).unwrap())
        .output()
        .unwrap();
    let run = Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    run.assert_success();
    let ready = run
        .stderr
        .lines()
        .find(|l| l.contains("ready:"))
        .unwrap_or_else(|| panic!("no ready line in:\n{}", run.stderr));
    assert!(ready.contains("subscribers=2"), "{ready}");
    assert!(ready.contains("handlers=0"), "{ready}");
    let end = run
        .stderr
        .lines()
        .find(|l| l.contains("input ended"))
        .unwrap_or_else(|| panic!("no summary line in:\n{}", run.stderr));
    for field in ["lines=2", "processed=1", "duplicate=1", "rejected=0"] {
        assert!(end.contains(field), "{field} missing in {end}");
    }
    assert!(!end.contains("PipeSummary"), "{end}");
}

/// Every outcome line says both what the line called itself (`id`, as sent) and the key
/// its claim is under (`key`): processed lines used to print the derived key as `id`, and
/// rejected ones the input id, so `id` meant two things.
#[test]
fn outcome_lines_carry_the_input_id_and_the_claim_key_apart() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        "keyed.toml",
        "[[subscriber]]\nname = \"orders\"\nkey = { source = \"json_pointer\", pointer = \"/order\" }\n",
    );
    let input = jsonl(&[
        json!({"subscriber": "orders", "id": "evt-1", "payload": {"order": "o-7"}}),
        json!({"subscriber": "orders", "id": "evt-2", "payload": {"order": "o-7"}}),
        json!({"subscriber": "orders", "id": "evt-3", "payload": {"no_order": 1}}),
    ]);
    let run = pipe_cfg(&tmp.path().join("data"), Some(&cfg), input);
    run.assert_success();
    let lines = run.lines();
    let fields: Vec<(&Value, &Value, &Value)> = lines
        .iter()
        .map(|l| (&l["id"], &l["key"], &l["outcome"]))
        .collect();
    assert_eq!(
        fields,
        [
            (&json!("evt-1"), &json!("o-7"), &json!("processed")),
            (&json!("evt-2"), &json!("o-7"), &json!("duplicate")),
            (&json!("evt-3"), &Value::Null, &json!("rejected")),
        ]
    );
}
