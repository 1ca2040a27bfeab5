//! `dedupd handler new` as a process: the generated project is built for real (offline, from
//! the local cargo registry, inside a directory that has a cargo workspace of its own, which
//! the project must not join), and the component it produces passes `dedupd handler check`
//! and `dedupd handler test` on the generated `events.jsonl`. Plus the refusals: an existing
//! non-empty directory, bad names and languages without a template.

#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

mod common;

use common::{dedupd, Run};

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

fn new_handler(name: &str, dir: &Path, extra: &[&str]) -> Run {
    let mut args = vec!["handler", "new", name, "--dir", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    dedupd(&args)
}

/// Where generated projects are built: shared across runs so the dependencies
/// (wit-bindgen, serde) compile once; the project's own crates are rebuilt every time,
/// since their sources are in a fresh directory.
fn build_cache() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("handler-new-target")
}

#[test]
fn generated_project_builds_and_passes_check_and_test() {
    let tmp = tempfile::tempdir().unwrap();
    // A parent directory that is a cargo workspace: a project without a [workspace] of its
    // own would fail to build here ("believes it's in a workspace when it's not").
    let parent = tmp.path().join("monorepo");
    std::fs::create_dir(&parent).unwrap();
    std::fs::write(parent.join("Cargo.toml"), "[workspace]\nmembers = []\n").unwrap();

    let created = new_handler("demo-handler", &parent, &[]);
    created.assert_success();
    let project = parent.join("demo-handler");
    for step in [
        "cargo build --release --target wasm32-wasip2",
        "dedupd handler check target/wasm32-wasip2/release/demo_handler.wasm",
        "dedupd handler test target/wasm32-wasip2/release/demo_handler.wasm --input events.jsonl --expect expected.jsonl",
    ] {
        assert!(created.stdout.contains(step), "{}", created.stdout);
    }
    for file in [
        "Cargo.toml",
        "Cargo.lock",
        "src/lib.rs",
        "sdk/Cargo.toml",
        "sdk/src/lib.rs",
        "wit/handler.wit",
        "events.jsonl",
        "expected.jsonl",
        "README.md",
        ".gitignore",
    ] {
        assert!(project.join(file).is_file(), "{file} missing");
    }

    // The documented build, offline: only the local registry cache.
    let target = build_cache();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Run::of(
        Command::new(cargo)
            .args([
                "build",
                "--release",
                "--target",
                "wasm32-wasip2",
                "--offline",
            ])
            .current_dir(&project)
            .env("CARGO_TARGET_DIR", &target)
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_BUILD_TARGET")
            .env_remove("CARGO_ENCODED_RUSTFLAGS"),
    );
    built.assert_success();
    assert!(
        built.stderr.contains("Compiling demo-handler v0.1.0"),
        "the generated crate itself was not built:\n{}",
        built.stderr
    );
    let wasm = target.join("wasm32-wasip2/release/demo_handler.wasm");
    let wasm = wasm.to_str().unwrap();

    let checked = dedupd(&["handler", "check", wasm, "--json"]);
    checked.assert_success();
    let report: Value = serde_json::from_str(&checked.stdout).unwrap();
    assert!(
        report.to_string().contains("dedupd:handler/handler@0.1.0"),
        "{report}"
    );

    let events = project.join("events.jsonl");
    let tested = dedupd(&[
        "handler",
        "test",
        wasm,
        "--input",
        events.to_str().unwrap(),
        "--json",
        "--cpu-budget",
        "2s",
    ]);
    tested.assert_success();
    let reports = common::json_lines(tested.stdout.into_bytes());
    let outcomes = common::outcomes(&reports);
    assert_eq!(
        outcomes,
        [
            "processed",
            "duplicate",
            "processed",
            "processed",
            "dead_lettered"
        ]
    );
    let state: Vec<&Value> = reports.iter().map(|r| &r["state"]).collect();
    assert_eq!(state[0], &json!([{"key": "count/o-1", "value": 1}]));
    assert_eq!(state[2], &json!([{"key": "count/o-1", "value": 2}]));
    assert_eq!(state[3], &json!([{"key": "count/o-2", "value": 1}]));

    // The shipped expectation is this component's behaviour.
    let expected = project.join("expected.jsonl");
    dedupd(&[
        "handler",
        "test",
        wasm,
        "--input",
        events.to_str().unwrap(),
        "--cpu-budget",
        "2s",
        "--expect",
        expected.to_str().unwrap(),
    ])
    .assert_success();
}

#[test]
fn refuses_an_existing_non_empty_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mine");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "keep me").unwrap();

    new_handler("mine", tmp.path(), &[]).assert_refused(&["exists and is not empty"]);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "keep me"
    );

    // An empty directory is fine.
    std::fs::create_dir(tmp.path().join("empty")).unwrap();
    new_handler("empty", tmp.path(), &[]).assert_success();
    assert!(tmp.path().join("empty/src/lib.rs").is_file());
}

#[test]
fn refuses_bad_names_and_languages_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, why) in [
        ("1st-handler", "must start with a letter"),
        ("my handler", "' ' is not allowed"),
        ("../escape", "'.' is not allowed"),
        ("fn", "keyword"),
    ] {
        new_handler(name, tmp.path(), &[]).assert_refused(&[why]);
    }
    new_handler("go", tmp.path(), &["--lang", "go"])
        .assert_refused(&["unknown language \"go\"; choose rust or python"]);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    assert!(!tmp.path().parent().unwrap().join("escape").exists());
}

/// componentize-py as `plugins/build-python.sh` installs it (scripts/test runs it first).
fn componentize_py() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("plugins/target/python-venv/bin/componentize-py");
    assert!(
        p.exists(),
        "{} is missing: run plugins/build-python.sh (scripts/test does)",
        p.display()
    );
    p
}

/// `handler new --lang python`, then the project README's build, check and test commands
/// (with the repository's pinned componentize-py instead of a fresh virtualenv): the
/// component passes `check`, and `test --expect expected.jsonl` agrees with the recorded
/// output the template ships.
#[test]
fn generated_python_project_builds_and_passes_check_and_test() {
    let tmp = tempfile::tempdir().unwrap();
    let created = new_handler("demo-py", tmp.path(), &["--lang", "python"]);
    created.assert_success();
    let project = tmp.path().join("demo-py");
    let build =
        ".venv/bin/componentize-py -d wit -w dedupd-handler componentize app -o demo_py.wasm";
    for step in [
        "pip install componentize-py==0.25.1",
        build,
        "dedupd handler check demo_py.wasm",
        "dedupd handler test demo_py.wasm --input events.jsonl --cpu-budget 100ms --expect expected.jsonl",
    ] {
        assert!(created.stdout.contains(step), "{}", created.stdout);
    }
    let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
    for step in [
        "pip install componentize-py==0.25.1",
        build,
        "dedupd handler check demo_py.wasm",
        "dedupd handler test demo_py.wasm --input events.jsonl --cpu-budget 100ms --expect expected.jsonl",
    ] {
        assert!(readme.contains(step), "{step} not in the README");
    }
    for file in [
        "app.py",
        "dedupd_sdk.py",
        "wit/handler.wit",
        "events.jsonl",
        "expected.jsonl",
        "README.md",
        ".gitignore",
    ] {
        assert!(project.join(file).is_file(), "{file} missing");
    }

    let built = Run::of(
        Command::new(componentize_py())
            .args([
                "-d",
                "wit",
                "-w",
                "dedupd-handler",
                "componentize",
                "app",
                "-o",
                "demo_py.wasm",
            ])
            .current_dir(&project),
    );
    built.assert_success();
    let wasm = project.join("demo_py.wasm");
    let wasm = wasm.to_str().unwrap();
    dedupd(&["handler", "check", wasm]).assert_success();

    // The budget of the README, raised for a loaded CI machine: this is about outcomes.
    let test = |extra: &[&str]| {
        let mut args = vec![
            "handler",
            "test",
            wasm,
            "--input",
            "events.jsonl",
            "--cpu-budget",
            "2s",
        ];
        args.extend_from_slice(extra);
        Run::of(
            Command::new(env!("CARGO_BIN_EXE_dedupd"))
                .args(&args)
                .current_dir(&project),
        )
    };
    let expected = test(&["--expect", "expected.jsonl"]);
    expected.assert_success();
    let tested = test(&["--json"]);
    tested.assert_success();
    let reports = common::json_lines(tested.stdout.into_bytes());
    let outcomes = common::outcomes(&reports);
    assert_eq!(
        outcomes,
        [
            "processed",
            "duplicate",
            "processed",
            "processed",
            "dead_lettered"
        ]
    );
    assert_eq!(
        reports[2]["state"],
        json!([{"key": "count/o-1", "value": 2}])
    );
}
