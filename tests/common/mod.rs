//! Helpers shared by the integration tests (each test binary compiles its own copy, and
//! uses only some of them); `broker.rs` has those of the broker sources' tests, `tls.rs` the
//! certificates of their TLS listeners, `stall.rs` a TCP relay that can go silent.
#![allow(dead_code, reason = "each test binary uses only some of the helpers")]

pub mod broker;
pub mod stall;
pub mod tls;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The handler component `NAME.wasm` built by `plugins/build.sh` (scripts/test runs it).
pub fn component(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("plugins/target/wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    assert!(
        p.exists(),
        "{} is missing: run plugins/build.sh (scripts/test does)",
        p.display()
    );
    p
}

/// A component that imports one empty instance named `name` and nothing else: enough for
/// the capability check at load, which runs before the contract check.
pub fn component_importing(name: &str) -> Vec<u8> {
    use wasm_encoder::{
        ComponentImportSection, ComponentTypeRef, ComponentTypeSection, InstanceType,
    };
    let mut types = ComponentTypeSection::new();
    types.instance(&InstanceType::new());
    let mut imports = ComponentImportSection::new();
    imports.import(name, ComponentTypeRef::Instance(0));
    let mut component = wasm_encoder::Component::new();
    component.section(&types);
    component.section(&imports);
    component.finish()
}

/// Output of one JSON value per line (outcome lines, `state dump`), parsed.
pub fn json_lines(out: Vec<u8>) -> Vec<Value> {
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The `outcome` of each outcome line.
pub fn outcome_names(out: Vec<u8>) -> Vec<String> {
    outcomes(&json_lines(out))
        .into_iter()
        .map(str::to_string)
        .collect()
}

/// The `outcome` field of each parsed line (outcome lines, `handler test --json` reports).
pub fn outcomes(lines: &[Value]) -> Vec<&str> {
    lines
        .iter()
        .map(|v| v["outcome"].as_str().unwrap())
        .collect()
}

/// The seed of a seeded reliability test: `base`, mixed with `DEDUPD_RELIABILITY_SEED`
/// when it is set to a number other than 0 (`scripts/reliability` runs the suite once per
/// seed; a failure is replayed by setting the same value).
pub fn seed(base: u64) -> u64 {
    match std::env::var("DEDUPD_RELIABILITY_SEED")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
    {
        Some(s) if s != 0 => base ^ s.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        _ => base,
    }
}

/// What one process run produced.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Runs `cmd` to its end.
    pub fn of(cmd: &mut Command) -> Run {
        let out = cmd.output().unwrap();
        Run {
            code: out.status.code(),
            stdout: String::from_utf8(out.stdout).unwrap(),
            stderr: String::from_utf8(out.stderr).unwrap(),
        }
    }

    pub fn assert_success(&self) {
        assert_eq!(
            self.code,
            Some(0),
            "exit code; stderr:\n{}\nstdout:\n{}",
            self.stderr,
            self.stdout
        );
    }

    /// Exit 1, no panic, and stderr holds every needle.
    pub fn assert_refused(&self, needles: &[&str]) {
        assert_eq!(
            self.code,
            Some(1),
            "stderr:\n{}\nstdout:\n{}",
            self.stderr,
            self.stdout
        );
        assert!(!self.stderr.contains("panicked"), "{}", self.stderr);
        for n in needles {
            assert!(
                self.stderr.contains(n),
                "stderr lacks {n:?}:\n{}",
                self.stderr
            );
        }
    }
}

/// `dedupd ARGS` (engine logs at `warn`).
pub fn dedupd(args: &[&str]) -> Run {
    Run::of(
        Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .args(args)
            .env("RUST_LOG", "warn"),
    )
}

/// `dedupd state dump` of the `default` subscriber (subscriber settings from `config`), as
/// JSON values.
pub fn state_dump(data: &std::path::Path, config: &std::path::Path) -> Vec<Value> {
    let dump = Run::of(
        Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .args(["state", "dump", "--subscriber", "default", "--data-dir"])
            .arg(data)
            .arg("--config")
            .arg(config),
    );
    dump.assert_success();
    json_lines(dump.stdout.into_bytes())
}
