//! The audit log: one JSON line per operator action (forget, replay, discard, config and
//! handler changes, maintenance) in `DATA_DIR/audit.jsonl`. Each line is flushed and
//! fsync'd before the action's response, so an acknowledged action is on record.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use serde_json::{json, Value};

/// Appends and reads operator actions.
#[derive(Debug)]
pub(crate) struct Audit {
    path: PathBuf,
    lock: Mutex<()>,
}

impl Audit {
    pub(crate) fn new(path: PathBuf) -> Audit {
        Audit {
            path,
            lock: Mutex::new(()),
        }
    }

    /// Records an action; `detail` is merged into the line. Blocking (fsync).
    pub(crate) fn record(
        &self,
        action: &str,
        subscriber: Option<&str>,
        detail: Value,
    ) -> std::io::Result<()> {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut line = json!({"at_ms": at_ms, "action": action, "subscriber": subscriber});
        if let (Some(obj), Value::Object(more)) = (line.as_object_mut(), detail) {
            obj.extend(more);
        }
        let mut text = line.to_string();
        text.push('\n');
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut f = crate::ledger::private_file()
            .create(true)
            .append(true)
            .open(&self.path)?;
        f.write_all(text.as_bytes())?;
        f.sync_data()
    }

    /// The newest `limit` entries, oldest first.
    pub(crate) fn tail(&self, limit: usize) -> std::io::Result<Vec<Value>> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let start = lines.len().saturating_sub(limit);
        Ok(lines[start..]
            .iter()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }
}
