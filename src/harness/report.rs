//! What a run reports per message, and the two ways it is printed: `--json` lines and a
//! report for people.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Its line in the input file.
    pub(crate) line: usize,
    /// The idempotency key's text (absent when none could be derived).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) id: Option<String>,
    /// The entity whose state the handler saw (with a partition key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) entity: Option<String>,
    /// `processed`, `duplicate`, `quarantined`, `dead_lettered` or `rejected`.
    pub(crate) outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<String>,
    /// State writes committed with the claim, in key order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) state: Vec<StateWrite>,
    /// Uniqueness marks committed with the claim.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) uniques: Vec<UniqueMark>,
    /// Versions committed with the claim.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) versions: Vec<VersionSet>,
    /// Outbox messages committed with the claim (relayed to Kafka by the engine).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) emitted: Vec<Emitted>,
    /// Every handler call, retries included; none for a duplicate or quarantined message.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) calls: Vec<CallReport>,
}

/// A state write: `value`, or `deleted`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct StateWrite {
    pub(crate) key: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) value: Option<Value>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) deleted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct UniqueMark {
    pub(crate) namespace: String,
    pub(crate) key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionSet {
    pub(crate) key: String,
    pub(crate) version: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Emitted {
    /// Derived from the message id and the emit's position: the same on every retry.
    pub(crate) id: String,
    pub(crate) topic: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) key: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) payload: Value,
}

/// One handler call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct CallReport {
    /// 1 on the first attempt.
    pub(crate) attempt: u32,
    /// `ok`, or the failure's kind: `retryable`, `permanent`, `timeout`, `memory`, `trap`.
    pub(crate) result: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
    /// Guard calls and their answers, in call order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) guards: Vec<Guard>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) logs: Vec<LogLine>,
    /// Log lines over the per-call limit (20), dropped as the engine drops them.
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) dropped_logs: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A guard call and its answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub(crate) enum Guard {
    InsertUnique {
        namespace: String,
        key: String,
        inserted: bool,
    },
    AdvanceVersion {
        key: String,
        version: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        current: Option<u64>,
        advanced: bool,
    },
    CompareAndSet {
        key: Value,
        swapped: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct LogLine {
    pub(crate) level: &'static str,
    pub(crate) text: String,
}

/// The reports as `--json` prints them: one compact JSON object per line.
pub fn json_lines(reports: &[Report]) -> String {
    let mut out = String::new();
    for r in reports {
        out.push_str(&serde_json::to_string(r).unwrap_or_default());
        out.push('\n');
    }
    out
}

/// A byte string as the human report shows it: text as it is, anything else as JSON.
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The reports for people: one header line per message, its committed writes, then each
/// handler call with its guard answers and log lines; a count of outcomes at the end.
pub fn write_human(reports: &[Report], mut out: impl std::io::Write) -> std::io::Result<()> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for r in reports {
        *counts.entry(r.outcome).or_default() += 1;
        write!(out, "line {}: ", r.line)?;
        if let Some(id) = &r.id {
            write!(out, "{id} ")?;
        }
        write!(out, "{}", r.outcome)?;
        if let Some(e) = &r.entity {
            write!(out, " (entity {e})")?;
        }
        match &r.reason {
            Some(reason) => writeln!(out, ": {reason}")?,
            None => writeln!(out)?,
        }
        for w in &r.state {
            match &w.value {
                Some(v) => writeln!(out, "  put     {} = {}", shown(&w.key), shown(v))?,
                None => writeln!(out, "  delete  {}", shown(&w.key))?,
            }
        }
        for u in &r.uniques {
            writeln!(out, "  unique  {} {}", u.namespace, u.key)?;
        }
        for v in &r.versions {
            writeln!(out, "  version {} = {}", v.key, v.version)?;
        }
        for m in &r.emitted {
            write!(out, "  emit    {}", m.topic)?;
            if let Some(k) = &m.key {
                write!(out, " key={k}")?;
            }
            for (k, v) in &m.headers {
                write!(out, " {k}={v}")?;
            }
            writeln!(out, " id={} {}", m.id, shown(&m.payload))?;
        }
        for c in &r.calls {
            match &c.error {
                Some(e) => writeln!(out, "  call {}: {}", c.attempt, e)?,
                None => writeln!(out, "  call {}: ok", c.attempt)?,
            }
            for g in &c.guards {
                let text = match g {
                    Guard::InsertUnique {
                        namespace,
                        key,
                        inserted,
                    } => format!(
                        "insert-unique {namespace} {key} -> {}",
                        if *inserted { "inserted" } else { "exists" }
                    ),
                    Guard::AdvanceVersion {
                        key,
                        version,
                        current,
                        advanced,
                    } => format!(
                        "advance-version {key} {version} (current {}) -> {}",
                        current.map_or("none".to_string(), |c| c.to_string()),
                        if *advanced { "advanced" } else { "stale" }
                    ),
                    Guard::CompareAndSet { key, swapped } => format!(
                        "compare-and-set {} -> {}",
                        shown(key),
                        if *swapped { "swapped" } else { "not swapped" }
                    ),
                };
                writeln!(out, "    {text}")?;
            }
            for l in &c.logs {
                writeln!(out, "    log {}: {}", l.level, l.text)?;
            }
            if c.dropped_logs > 0 {
                writeln!(out, "    ({} more log lines dropped)", c.dropped_logs)?;
            }
        }
    }
    let summary: Vec<String> = counts.iter().map(|(o, n)| format!("{n} {o}")).collect();
    writeln!(
        out,
        "{} messages: {}",
        reports.len(),
        if summary.is_empty() {
            "none".to_string()
        } else {
            summary.join(", ")
        }
    )
}
