//! The test files: messages (`dedupd pipe` lines) and the initial state (`dedupd state
//! dump` lines), each line checked and numbered for errors.

use std::path::Path;

use serde_json::Value;

use super::HarnessError;
use crate::source::pipe_line::PipeLine;

/// The messages of an input file.
#[derive(Debug, Clone, Default)]
pub struct Messages {
    /// The file's name, for errors.
    pub(crate) file: String,
    pub(crate) lines: Vec<InputLine>,
}

/// The entries of a state file.
#[derive(Debug, Clone, Default)]
pub struct Seed {
    /// The file's name, for errors.
    pub(crate) file: String,
    pub(crate) lines: Vec<SeedLine>,
}

/// One message of the input: its line number and the `dedupd pipe` line.
#[derive(Debug, Clone)]
pub(crate) struct InputLine {
    pub(crate) line: usize,
    pub(crate) message: PipeLine,
}

/// One entry of the initial state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SeedEntry {
    /// A state entry, as `dedupd state dump` prints it.
    State { key: Vec<u8>, value: Vec<u8> },
    /// An `insert-unique` mark.
    Unique { namespace: String, key: String },
    /// An `advance-version` version.
    Version { key: String, version: u64 },
}

/// A seed entry and the entity whose store it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedLine {
    pub(crate) line: usize,
    pub(crate) entity: Option<String>,
    pub(crate) entry: SeedEntry,
}

fn read_text(path: &Path) -> Result<String, HarnessError> {
    std::fs::read_to_string(path).map_err(|source| HarnessError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A JSON error without serde's "at line 1 column N" (the line is the file's), with the
/// column kept.
pub(super) fn json_reason(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&suffix) {
        Some(t) if e.column() > 0 => format!("{t} (column {})", e.column()),
        Some(t) => t.to_string(),
        None => text,
    }
}

/// The non-blank lines of a file with their numbers (from 1).
pub(super) fn numbered(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty())
}

/// Reads messages: one `dedupd pipe` line each (`{"id":..., "key":..., "headers":{...},
/// "payload":...}`; `subscriber` may name the subscriber under test). Blank lines are
/// skipped; a line that is not such an object is an error naming its number.
pub fn read_messages(path: &Path) -> Result<Messages, HarnessError> {
    let text = read_text(path)?;
    parse_messages(&path.display().to_string(), &text)
}

/// [`read_messages`] over text; `file` names it in errors.
pub(crate) fn parse_messages(file: &str, text: &str) -> Result<Messages, HarnessError> {
    let lines = numbered(text)
        .map(|(line, l)| match serde_json::from_str::<PipeLine>(l) {
            Ok(message) => Ok(InputLine { line, message }),
            Err(e) => Err(HarnessError::Line {
                file: file.to_string(),
                line,
                reason: format!("not a message: {}", json_reason(&e)),
            }),
        })
        .collect::<Result<_, _>>()?;
    Ok(Messages {
        file: file.to_string(),
        lines,
    })
}

/// Reads the initial state: JSON lines as `dedupd state dump` prints them,
/// `{"key": K, "value": V}` (with `"entity": E` under a partition key), plus
/// `{"unique": {"namespace": N, "key": K}}` for a mark and
/// `{"version": {"key": K, "version": N}}` for a version, each with an optional `entity`.
/// Keys and values are bytes written as `state dump` shows them: a JSON string is its
/// UTF-8 text, `{"hex": "..."}` is those bytes, any other JSON value is its compact text.
pub fn read_state(path: &Path) -> Result<Seed, HarnessError> {
    let text = read_text(path)?;
    parse_state(&path.display().to_string(), &text)
}

/// [`read_state`] over text; `file` names it in errors.
pub fn parse_state(file: &str, text: &str) -> Result<Seed, HarnessError> {
    let lines = numbered(text)
        .map(|(line, l)| match seed_line(l) {
            Ok((entity, entry)) => Ok(SeedLine {
                line,
                entity,
                entry,
            }),
            Err(reason) => Err(HarnessError::Line {
                file: file.to_string(),
                line,
                reason,
            }),
        })
        .collect::<Result<_, _>>()?;
    Ok(Seed {
        file: file.to_string(),
        lines,
    })
}

fn seed_line(text: &str) -> Result<(Option<String>, SeedEntry), String> {
    let value: Value = serde_json::from_str(text).map_err(|e| json_reason(&e))?;
    let Value::Object(mut obj) = value else {
        return Err("expected a JSON object".into());
    };
    let entity = match obj.remove("entity") {
        None => None,
        Some(Value::String(e)) if !e.is_empty() && !e.contains('\0') => Some(e),
        Some(_) => return Err("`entity` must be a non-empty string without NUL".into()),
    };
    let entry = if let Some(u) = obj.remove("unique") {
        let (namespace, key) = match &u {
            Value::Object(m) if m.len() == 2 => (
                m.get("namespace").and_then(Value::as_str),
                m.get("key").and_then(Value::as_str),
            ),
            _ => (None, None),
        };
        match (namespace, key) {
            (Some(n), Some(k)) if !n.is_empty() && !n.contains('\0') => SeedEntry::Unique {
                namespace: n.into(),
                key: k.into(),
            },
            _ => return Err(
                "`unique` must be {\"namespace\": \"...\", \"key\": \"...\"} (namespace non-empty, without NUL)".into(),
            ),
        }
    } else if let Some(v) = obj.remove("version") {
        let (key, version) = match &v {
            Value::Object(m) if m.len() == 2 => (
                m.get("key").and_then(Value::as_str),
                m.get("version").and_then(Value::as_u64),
            ),
            _ => (None, None),
        };
        match (key, version) {
            (Some(k), Some(n)) if !k.is_empty() => SeedEntry::Version {
                key: k.into(),
                version: n,
            },
            _ => {
                return Err(
                    "`version` must be {\"key\": \"...\", \"version\": N} (key non-empty, N an unsigned integer)"
                        .into(),
                )
            }
        }
    } else {
        match (obj.remove("key"), obj.remove("value")) {
            (Some(k), Some(v)) => {
                let key = bytes_of(&k).map_err(|e| format!("`key`: {e}"))?;
                if key.is_empty() {
                    return Err("`key` is empty".into());
                }
                SeedEntry::State {
                    key,
                    value: bytes_of(&v).map_err(|e| format!("`value`: {e}"))?,
                }
            }
            _ => return Err(
                "expected {\"key\": ..., \"value\": ...} (as `dedupd state dump` prints), {\"unique\": ...} or {\"version\": ...}"
                    .into(),
            ),
        }
    };
    if let Some(field) = obj.keys().next() {
        return Err(format!("unknown field `{field}`"));
    }
    Ok((entity, entry))
}

/// The bytes a key or value of `state dump` stands for (the inverse of [`readable`]).
///
/// [`readable`]: crate::inspect::readable
fn bytes_of(v: &Value) -> Result<Vec<u8>, String> {
    match v {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Object(m) if m.len() == 1 && m.contains_key("hex") => {
            let hex = m["hex"].as_str().ok_or("`hex` must be a string")?;
            if hex.len() % 2 != 0 {
                return Err("`hex` must have an even number of digits".into());
            }
            (0..hex.len())
                .step_by(2)
                .map(|i| {
                    u8::from_str_radix(&hex[i..i + 2], 16)
                        .map_err(|_| format!("`hex` is not hexadecimal: {hex:?}"))
                })
                .collect()
        }
        other => Ok(serde_json::to_vec(other).unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspect::readable;

    #[test]
    fn state_lines_read_back_what_state_dump_prints() {
        let seed = parse_state(
            "s.jsonl",
            concat!(
                r#"{"key":"label/o-1","value":{"label_id":"x","order_id":"o-1"}}"#,
                "\n\n",
                r#"{"key":{"hex":"ff00"},"value":"plain","entity":"o-1"}"#,
                "\n",
                r#"{"unique":{"namespace":"label","key":"o-1"}}"#,
                "\n",
                r#"{"version":{"key":"order/o-1","version":3}}"#,
            ),
        )
        .unwrap();
        let entries: Vec<(usize, Option<&str>, &SeedEntry)> = seed
            .lines
            .iter()
            .map(|l| (l.line, l.entity.as_deref(), &l.entry))
            .collect();
        assert_eq!(
            entries,
            vec![
                (
                    1,
                    None,
                    &SeedEntry::State {
                        key: b"label/o-1".to_vec(),
                        value: br#"{"label_id":"x","order_id":"o-1"}"#.to_vec()
                    }
                ),
                (
                    3,
                    Some("o-1"),
                    &SeedEntry::State {
                        key: vec![0xff, 0],
                        value: b"plain".to_vec()
                    }
                ),
                (
                    4,
                    None,
                    &SeedEntry::Unique {
                        namespace: "label".into(),
                        key: "o-1".into()
                    }
                ),
                (
                    5,
                    None,
                    &SeedEntry::Version {
                        key: "order/o-1".into(),
                        version: 3
                    }
                ),
            ]
        );
        // What `readable` shows, `bytes_of` reads back.
        for bytes in [&b"text"[..], br#"{"a":1}"#, &[0xff, 0x01]] {
            assert_eq!(bytes_of(&readable(bytes)).unwrap(), bytes);
        }
    }

    #[test]
    fn bad_state_lines_name_their_line_and_reason() {
        for (text, reason) in [
            ("{\"key\":\"k\"}", "expected {\"key\": ..., \"value\": ...}"),
            (
                "{\"key\":\"k\",\"value\":1,\"extra\":2}",
                "unknown field `extra`",
            ),
            ("{\"key\":{\"hex\":\"zz\"},\"value\":1}", "not hexadecimal"),
            (
                "{\"unique\":{\"namespace\":\"\",\"key\":\"k\"}}",
                "namespace non-empty",
            ),
            ("[1]", "expected a JSON object"),
            ("{\"key\": ", "EOF"),
        ] {
            let text = format!("\n{{\"key\":\"a\",\"value\":\"b\"}}\n{text}\n");
            match parse_state("s.jsonl", &text) {
                Err(HarnessError::Line {
                    file,
                    line,
                    reason: r,
                }) => {
                    assert_eq!((file.as_str(), line), ("s.jsonl", 3), "{text}");
                    assert!(r.contains(reason), "{r:?} should contain {reason:?}");
                }
                other => panic!("{text}: expected a line error, got {other:?}"),
            }
        }
    }

    #[test]
    fn bad_message_lines_name_their_line_and_column() {
        let err = parse_messages("in.jsonl", "{\"id\":\"a\"}\n{\"id\":\"b\",\"paylod\":{}}\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("in.jsonl:2: not a message: unknown field `paylod`"),
            "{err}"
        );
        assert!(!err.contains("line 1 column"), "{err}");
    }
}
