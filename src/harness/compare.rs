//! `--expect`: the reports against an expected `--json` output, the first difference told
//! by JSON pointer.

use serde_json::Value;

use super::input::{json_reason, numbered};
use super::report::Report;

/// Compares the reports with an expected `--json` output (`file` names it). `Ok` with the
/// number of messages when equal; else a readable account of the first difference.
pub fn compare(file: &str, expected: &str, reports: &[Report]) -> Result<usize, String> {
    let mut want = Vec::new();
    for (line, text) in numbered(expected) {
        match serde_json::from_str::<Value>(text) {
            Ok(v) => want.push((line, v, text)),
            Err(e) => return Err(format!("{file}:{line}: not JSON: {}", json_reason(&e))),
        }
    }
    let got: Vec<Value> = reports
        .iter()
        .map(|r| serde_json::to_value(r).unwrap_or_default())
        .collect();
    for (i, ((line, w, text_w), g)) in want.iter().zip(&got).enumerate() {
        if w == g {
            continue;
        }
        let mut diffs = Vec::new();
        diff("", w, g, &mut diffs);
        let input_line = reports[i].line;
        let mut text = format!(
            "message {} (input line {input_line}) differs from {file}:{line}:\n",
            i + 1
        );
        for d in diffs.iter().take(20) {
            text.push_str(&format!("  {d}\n"));
        }
        if diffs.len() > 20 {
            text.push_str(&format!(
                "  ... and {} more differences\n",
                diffs.len() - 20
            ));
        }
        // As written and as `--json` prints it, not re-ordered.
        let actual = serde_json::to_string(&reports[i]).unwrap_or_default();
        text.push_str(&format!("expected: {text_w}\nactual:   {actual}\n"));
        return Err(text);
    }
    match want.len().cmp(&got.len()) {
        std::cmp::Ordering::Equal => Ok(got.len()),
        std::cmp::Ordering::Less => Err(format!(
            "{file} expects {} messages, the run gave {}; the first unexpected one:\nactual:   {}\n",
            want.len(),
            got.len(),
            serde_json::to_string(&reports[want.len()]).unwrap_or_default()
        )),
        std::cmp::Ordering::Greater => Err(format!(
            "{file} expects {} messages, the run gave {}; the first missing one ({file}:{}):\nexpected: {}\n",
            want.len(),
            got.len(),
            want[got.len()].0,
            want[got.len()].2
        )),
    }
}

/// The differences between two JSON values, one line each, named by JSON pointer.
fn diff(path: &str, want: &Value, got: &Value, out: &mut Vec<String>) {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            let keys: std::collections::BTreeSet<&String> = w.keys().chain(g.keys()).collect();
            for k in keys {
                let p = format!("{path}/{}", k.replace('~', "~0").replace('/', "~1"));
                match (w.get(k), g.get(k)) {
                    (Some(a), Some(b)) => diff(&p, a, b, out),
                    (Some(a), None) => out.push(format!("{p}: expected {a}, missing")),
                    (None, Some(b)) => out.push(format!("{p}: not expected, got {b}")),
                    (None, None) => {}
                }
            }
        }
        (Value::Array(w), Value::Array(g)) => {
            for i in 0..w.len().max(g.len()) {
                let p = format!("{path}/{i}");
                match (w.get(i), g.get(i)) {
                    (Some(a), Some(b)) => diff(&p, a, b, out),
                    (Some(a), None) => out.push(format!("{p}: expected {a}, missing")),
                    (None, Some(b)) => out.push(format!("{p}: not expected, got {b}")),
                    (None, None) => {}
                }
            }
        }
        (w, g) if w != g => {
            let p = if path.is_empty() { "/" } else { path };
            out.push(format!("{p}: expected {w}, got {g}"));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::json_lines;
    use crate::harness::report::StateWrite;

    #[test]
    fn compare_names_the_first_difference_by_pointer() {
        let report = Report {
            line: 4,
            id: Some("e-1".into()),
            entity: None,
            outcome: "processed",
            reason: None,
            state: vec![StateWrite {
                key: Value::String("k".into()),
                value: Some(serde_json::json!({"n": 2})),
                deleted: false,
            }],
            uniques: Vec::new(),
            versions: Vec::new(),
            emitted: Vec::new(),
            calls: Vec::new(),
        };
        let same = json_lines(std::slice::from_ref(&report));
        assert_eq!(compare("x", &same, std::slice::from_ref(&report)), Ok(1));
        let changed = same.replace(r#""n":2"#, r#""n":3"#);
        let err = compare("x", &changed, std::slice::from_ref(&report)).unwrap_err();
        assert!(
            err.contains("message 1 (input line 4) differs from x:1"),
            "{err}"
        );
        assert!(err.contains("/state/0/value/n: expected 3, got 2"), "{err}");
        // Both shown as written and as `--json` prints them.
        assert!(
            err.contains(&format!("expected: {}\n", changed.trim())),
            "{err}"
        );
        assert!(
            err.contains("actual:   {\"line\":4,\"id\":\"e-1\""),
            "{err}"
        );
        let err =
            compare("x", &format!("{same}{same}"), std::slice::from_ref(&report)).unwrap_err();
        assert!(
            err.contains("x expects 2 messages, the run gave 1"),
            "{err}"
        );
    }
}
