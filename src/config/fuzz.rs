//! Fuzz target of config parsing (see `crate::fuzzing`): the sample file with values,
//! lines and bytes changed, and TOML-ish text built from its keys. A config either loads
//! or is refused with an error; one that loads passes validation again and reads back as
//! itself when written out.

use proptest::prelude::*;

use super::Config;
use crate::fuzzing;

const SAMPLE: &str = include_str!("../../dedupd.example.toml");

/// The environment the targets see: `X` is set, nothing else is.
fn lookup(name: &str) -> Option<String> {
    (name == "X").then(|| "10s".to_string())
}

/// Values a config field is most likely to break on.
fn edge_value() -> impl Strategy<Value = String> {
    let fixed: Vec<&str> = vec![
        "0",
        "-1",
        "1",
        "65536",
        "4294967296",
        "9223372036854775807",
        "18446744073709551615",
        "18446744073709551616",
        "1e309",
        "nan",
        "-inf",
        "0.5",
        "true",
        "\"\"",
        "\"0ms\"",
        "\"1ns\"",
        "\"999ms\"",
        "\"1s\"",
        "\"10y\"",
        "\"584942417355y\"",
        "\"99999999999999999999d\"",
        "\"-1s\"",
        "\"${X}\"",
        "\"${UNSET}\"",
        "\"${\"",
        "\"$${X}\"",
        "\"${X\"",
        "\"..\"",
        "\"a b\"",
        "[]",
        "[\"\", \"/\"]",
        "{}",
        "{ source = \"json_pointer\" }",
        "{ source = \"json_pointer\", pointer = \"\" }",
        "{ source = \"json_pointer\", pointers = [\"/a\", \"/a\"] }",
        "{ source = \"header\", name = \"\" }",
        "{ source = \"header\" }",
        "{ source = \"nope\" }",
        "{ ignore = [\"\"] }",
        "{ ignore = [\"/\"] }",
        "\"0.0.0.0:0\"",
        "\"[::1]:65536\"",
    ];
    prop_oneof![
        3 => prop::sample::select(fixed).prop_map(str::to_string),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => "\"[0-9]{1,12}(ns|ms|s|m|h|d|w|y)\"",
        1 => "\".{0,8}\"",
    ]
}

/// One change to the lines of a config.
#[derive(Debug, Clone)]
enum LineChange {
    /// The value of a `key = value` line replaced.
    Value(fuzzing::At, String),
    Delete(fuzzing::At),
    Duplicate(fuzzing::At),
    /// A line uncommented (the sample has commented-out settings).
    Uncomment(fuzzing::At),
}

fn line_change() -> impl Strategy<Value = LineChange> {
    let at = || (0usize..1 << 16).prop_map(fuzzing::At);
    prop_oneof![
        4 => (at(), edge_value()).prop_map(|(a, v)| LineChange::Value(a, v)),
        1 => at().prop_map(LineChange::Delete),
        1 => at().prop_map(LineChange::Duplicate),
        1 => at().prop_map(LineChange::Uncomment),
    ]
}

fn changed_lines(base: &str, changes: &[LineChange]) -> String {
    let mut lines: Vec<String> = base.lines().map(str::to_string).collect();
    for c in changes {
        if lines.is_empty() {
            break;
        }
        let n = lines.len();
        match c {
            LineChange::Value(at, v) => {
                // The n-th line with a value, counted from the picked one.
                let i = (0..n)
                    .map(|d| (at.0 + d) % n)
                    .find(|i| lines[*i].contains(" = "))
                    .unwrap_or(at.0 % n);
                if let Some((key, _)) = lines[i].split_once(" = ") {
                    lines[i] = format!("{key} = {v}");
                }
            }
            LineChange::Delete(at) => {
                lines.remove(at.0 % n);
            }
            LineChange::Duplicate(at) => {
                let l = lines[at.0 % n].clone();
                lines.insert(at.0 % n, l);
            }
            LineChange::Uncomment(at) => {
                let i = at.0 % n;
                if let Some(rest) = lines[i].strip_prefix("# ") {
                    lines[i] = rest.to_string();
                }
            }
        }
    }
    lines.join("\n")
}

/// TOML-ish text from the sample's section headers, keys and edge values.
fn toml_ish() -> impl Strategy<Value = String> {
    let mut keys: Vec<String> = SAMPLE
        .lines()
        .filter_map(|l| l.trim_start_matches("# ").split_once(" = "))
        .map(|(k, _)| k.trim().to_string())
        .collect();
    keys.sort();
    keys.dedup();
    let header = prop::sample::select(vec![
        "[ledger]",
        "[pipe]",
        "[defaults]",
        "[[subscriber]]",
        "[http]",
        "[kafka]",
        "[kafka.outbox]",
        "[[kafka.subscription]]",
        "[nope]",
    ])
    .prop_map(str::to_string);
    let setting =
        (prop::sample::select(keys), edge_value()).prop_map(|(k, v)| format!("{k} = {v}"));
    prop::collection::vec(prop_oneof![1 => header, 4 => setting], 0..24).prop_map(|l| l.join("\n"))
}

/// Loads `text`; a config that loads must validate again and read back as itself.
fn check(text: &str) -> Result<(), TestCaseError> {
    let Ok(config) = Config::parse_with_env(text, &lookup) else {
        return Ok(());
    };
    fuzzing::decoded();
    prop_assert!(config.validate().is_ok());
    for s in &config.subscribers {
        prop_assert!(config.settings_for(&s.name).is_some());
    }
    let written = toml::to_string(&config).map_err(|e| TestCaseError::fail(e.to_string()))?;
    if !written.contains('$') {
        let again = Config::parse_with_env(&written, &lookup)
            .map_err(|e| TestCaseError::fail(format!("{e}\nwritten as:\n{written}")))?;
        prop_assert_eq!(
            toml::to_string(&again).map_err(|e| TestCaseError::fail(e.to_string()))?,
            written
        );
    }
    Ok(())
}

#[test]
fn fuzz_config_sample_with_changed_lines_loads_or_is_refused() {
    let input = prop::collection::vec(line_change(), 1..6).prop_map(|c| changed_lines(SAMPLE, &c));
    fuzzing::run("config_lines", 1500, input, |text| check(&text));
}

#[test]
fn fuzz_config_sample_with_changed_bytes_loads_or_is_refused() {
    let input = fuzzing::mutated(Just(SAMPLE.as_bytes().to_vec()))
        .prop_map(|b| String::from_utf8_lossy(&b).into_owned());
    fuzzing::run("config_bytes", 1000, input, |text| check(&text));
}

#[test]
fn fuzz_config_toml_ish_text_loads_or_is_refused() {
    let input = prop_oneof![3 => toml_ish(), 1 => ".{0,200}"];
    fuzzing::run("config_text", 2000, input, |text| check(&text));
}

/// Nesting deeper than any config needs is a parse error, not a stack overflow.
#[test]
fn deeply_nested_values_are_refused_not_a_stack_overflow() {
    for depth in [1_000usize, 100_000] {
        let arrays = format!(
            "[pipe]\nwindow = {}1{}\n",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        let tables = format!(
            "[pipe]\nwindow = {}1{}\n",
            "{a = ".repeat(depth),
            "}".repeat(depth)
        );
        for text in [arrays, tables] {
            let e = Config::parse_with_env(&text, &lookup).expect_err("too deep");
            assert!(e.to_string().contains("parse"), "{e}");
        }
    }
}
