//! Helpers shared by the integration tests (each test binary compiles its own copy, and
//! uses only some of them).
#![allow(dead_code)]

use std::path::PathBuf;

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
    json_lines(out)
        .iter()
        .map(|v| v["outcome"].as_str().unwrap().to_string())
        .collect()
}
