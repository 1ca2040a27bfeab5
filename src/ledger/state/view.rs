//! The state a handler reads during one batch ([`BatchView`]), in layers, newest first:
//! the call's own writes (the host), the shard's active buffer (earlier batches' effects
//! and this batch's earlier successful messages), the frozen buffer being written as a
//! run (`buffer.rs`), and the sorted runs as of the batch's start (a read transaction),
//! newest first, each behind its filter.
//!
//! A call that succeeds is absorbed once: its writes go straight into the active buffer
//! and are encoded into the batch's log row as they come (`log_row.rs`). Until
//! 2026-12-06 they went into a per-batch overlay (ordered maps) that was encoded and
//! merged into the buffer at commit: every effect was inserted into two ordered maps. A
//! batch that does not commit leaves its effects in the buffer, which is harmless only
//! because a shard whose commit failed never decides again (I4).

use std::sync::{Arc, Mutex};

use redb::{Database, ReadTransaction, ReadableDatabase, StorageError};

use super::buffer::{lock, Buffered, StateBuffer};
use super::cover::CoverView;
use super::log_row::RowWriter;
use super::run::{run_key, Entry, Merge, RunScan, KIND_MARK, KIND_STATE, KIND_VERSION};
use super::runs::{self, Partial, Run, RunTable};
use crate::effects::{Absorbed, Effects, OutboxMessage, StateEntry, StateReader};
use crate::ledger::format::tables::{state_run_name, BlockDef};

/// The runs of a subscriber as of one read transaction, newest first, and the merge in
/// progress as of the same commit with its output's table.
pub(super) struct RunTables {
    _txn: ReadTransaction,
    runs: Vec<Arc<Run>>,
    tables: Vec<RunTable>,
    partial: Option<(Partial, RunTable)>,
    covers: CoverView,
}

impl RunTables {
    pub(super) fn open(
        db: &Database,
        sub: &str,
        buffer: &StateBuffer,
    ) -> Result<RunTables, redb::Error> {
        let txn = db.begin_read()?;
        let runs = buffer.runs.list.clone();
        let tables = runs
            .iter()
            .map(|r| runs::open_run(&txn, sub, r))
            .collect::<Result<_, _>>()?;
        let partial = match buffer.runs.partial() {
            Some(p) => Some((
                p.clone(),
                txn.open_table(BlockDef::new(&state_run_name(sub, p.out_id)))?,
            )),
            None => None,
        };
        Ok(RunTables {
            _txn: txn,
            covers: buffer.runs.cover_view(),
            runs,
            tables,
            partial,
        })
    }

    /// The newest entry of `kind`/`key` in the runs (`Some(None)`: deleted).
    fn lookup(&self, kind: u8, key: &[u8]) -> Result<Option<Option<Vec<u8>>>, StorageError> {
        if self.runs.is_empty() {
            return Ok(None);
        }
        runs::lookup(
            &self.runs,
            &self.tables,
            self.partial.as_ref(),
            &self.covers,
            &run_key(kind, key),
        )
    }

    /// Scans of `kind` from `from` on, newest first.
    fn scans(&self, kind: u8, from: &[u8]) -> Result<Vec<RunScan>, StorageError> {
        runs::scans(&self.tables, self.partial.as_ref(), kind, from)
    }

    /// Calls `f` for every live state entry from `from` on, in key order, until it returns
    /// `false`.
    pub(super) fn for_each_from(
        &self,
        from: &[u8],
        mut f: impl FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StorageError> {
        for entry in Merge::new(self.scans(KIND_STATE, from)?)? {
            let (k, v) = entry?;
            if let Some(v) = v {
                if !f(&k, &v) {
                    break;
                }
            }
        }
        Ok(())
    }
}

/// The state a handler reads during one batch, and what the batch's calls wrote.
pub(crate) struct BatchView {
    runs: RunTables,
    /// The shard's active buffer, shared: calls that succeed write into it.
    active: Arc<Mutex<Buffered>>,
    /// The frozen buffer being written as a run.
    frozen: Option<Arc<Buffered>>,
    /// This batch's log row, as its calls succeeded.
    row: RowWriter,
    outbox: Vec<OutboxMessage>,
    /// The current call's entity scope (empty: the subscriber's whole store).
    scope: Vec<u8>,
}

impl BatchView {
    pub(crate) fn open(
        db: &Database,
        sub: &str,
        buffer: &StateBuffer,
    ) -> Result<BatchView, redb::Error> {
        Ok(BatchView {
            runs: RunTables::open(db, sub, buffer)?,
            active: buffer.active.clone(),
            frozen: buffer.frozen.as_ref().map(|f| f.effects.clone()),
            row: RowWriter::default(),
            outbox: Vec::new(),
            scope: Vec::new(),
        })
    }
}

/// A scope as text (entities are UTF-8 and end with NUL), for version keys; `None` for the
/// empty scope.
fn scope_text(scope: &[u8]) -> Option<&str> {
    if scope.is_empty() {
        return None;
    }
    std::str::from_utf8(scope).ok()
}

/// Storage errors while a handler reads are reported to the log and read as "absent"; the
/// commit that follows hits the same storage and fails the shard if it is really broken.
fn logged<T>(r: Result<T, redb::StorageError>) -> Option<T> {
    r.map_err(|e| tracing::error!(error = %e, "handler state read failed"))
        .ok()
}

/// Reads and writes in the stored key space (scopes already applied).
impl BatchView {
    fn get_raw(&self, key: &[u8]) -> Option<Vec<u8>> {
        if let Some(v) = lock(&self.active).state.get(key) {
            return v.clone();
        }
        if let Some(v) = self.frozen.as_ref().and_then(|f| f.state.get(key)) {
            return v.clone();
        }
        logged(self.runs.lookup(KIND_STATE, key))??
    }

    fn scan_raw(&self, prefix: &[u8], limit: usize) -> Vec<StateEntry> {
        type Source<'a> = Box<dyn Iterator<Item = Result<Entry, StorageError>> + 'a>;
        let mut active = lock(&self.active);
        // A handler that scans keeps its buffers ordered from now on (`state_map.rs`).
        active.state.make_ordered();
        let layers = [Some(&active.state), self.frozen.as_ref().map(|f| &f.state)];
        let mut sources: Vec<Source> = layers
            .into_iter()
            .flatten()
            .map(|l| -> Source {
                Box::new(
                    l.prefixed(prefix)
                        .into_iter()
                        .map(|(k, v)| Ok((k.clone(), v.clone()))),
                )
            })
            .collect();
        let Some(scans) = logged(self.runs.scans(KIND_STATE, prefix)) else {
            return Vec::new();
        };
        sources.extend(scans.into_iter().map(|s| -> Source { Box::new(s) }));
        let Some(merged) = logged(Merge::new(sources)) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in merged {
            let Some((k, v)) = logged(entry) else {
                break;
            };
            if !k.starts_with(prefix) || out.len() == limit {
                break;
            }
            if let Some(v) = v {
                out.push((k, v));
            }
        }
        out
    }

    fn unique_raw(&self, mark: &[u8]) -> bool {
        if lock(&self.active).uniques.contains(mark)
            || self
                .frozen
                .as_ref()
                .is_some_and(|f| f.uniques.contains(mark))
        {
            return true;
        }
        // Marks are never deleted: any entry is the mark.
        logged(self.runs.lookup(KIND_MARK, mark)).is_some_and(|e| e.is_some())
    }

    fn version_raw(&self, key: &str) -> Option<u64> {
        if let Some(v) = lock(&self.active).versions.get(key) {
            return Some(*v);
        }
        if let Some(v) = self.frozen.as_ref().and_then(|f| f.versions.get(key)) {
            return Some(*v);
        }
        let v = logged(self.runs.lookup(KIND_VERSION, key.as_bytes()))???;
        Some(u64::from_le_bytes(v.as_slice().try_into().ok()?))
    }
}

/// A handler's view: under an entity placement every key, mark and version is prefixed
/// with the entity's scope (`placement::entity_scope`), so each entity has a store of its
/// own and the handler never sees the prefix.
impl StateReader for BatchView {
    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        if self.scope.is_empty() {
            return self.get_raw(key);
        }
        self.get_raw(&[&self.scope[..], key].concat())
    }

    fn scan(&self, prefix: &[u8], limit: usize) -> Vec<StateEntry> {
        if self.scope.is_empty() {
            return self.scan_raw(prefix, limit);
        }
        let n = self.scope.len();
        self.scan_raw(&[&self.scope[..], prefix].concat(), limit)
            .into_iter()
            .map(|(mut k, v)| {
                k.drain(..n);
                (k, v)
            })
            .collect()
    }

    fn unique_exists(&self, mark: &[u8]) -> bool {
        if self.scope.is_empty() {
            return self.unique_raw(mark);
        }
        self.unique_raw(&[&self.scope[..], mark].concat())
    }

    fn version(&self, key: &str) -> Option<u64> {
        match scope_text(&self.scope) {
            None => self.version_raw(key),
            Some(scope) => self.version_raw(&format!("{scope}{key}")),
        }
    }

    fn absorb(&mut self, effects: Effects) {
        let scope = &self.scope[..];
        let row = &mut self.row;
        let mut active = lock(&self.active);
        for (k, v) in effects.state {
            row.state(&[scope, &k], v.as_deref());
            let k = if scope.is_empty() {
                k
            } else {
                [scope, &k].concat()
            };
            active.state.insert(k, v);
        }
        for m in effects.uniques {
            row.unique(&[scope, &m]);
            let m = if scope.is_empty() {
                m
            } else {
                [scope, &m].concat()
            };
            active.uniques.insert(m);
        }
        if !effects.versions.is_empty() {
            let text = scope_text(scope).unwrap_or_default();
            for (k, v) in effects.versions {
                row.version(&[text.as_bytes(), k.as_bytes()], v);
                let k = if text.is_empty() {
                    k
                } else {
                    format!("{text}{k}")
                };
                active.versions.insert(k, v);
            }
        }
        drop(active);
        self.outbox.extend(effects.outbox);
    }

    fn set_scope(&mut self, entity: Option<&str>) {
        self.scope.clear();
        if let Some(e) = entity {
            self.scope
                .extend_from_slice(&crate::ledger::entity_scope(e));
        }
    }

    fn finish(self: Box<Self>) -> Absorbed {
        Absorbed {
            log_row: self.row.finish(),
            outbox: self.outbox,
        }
    }
}

#[cfg(test)]
mod tests {
    use redb::Database;

    use super::super::testing::{commit, put};
    use super::*;
    use crate::effects::unique_key;

    /// A batch's calls, in two entity scopes and none, absorbed one by one: each later call
    /// reads the earlier ones through the view, the next batch's view reads them from the
    /// shard's buffer, and after a restart the buffer rebuilt from the one log row the
    /// batch wrote reads the same (a key written twice in the batch keeps its later value,
    /// a deleted one stays deleted).
    #[test]
    fn calls_absorbed_one_by_one_read_the_same_in_the_batch_after_it_and_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        let db = Database::create(&path).unwrap();
        let mut buf = StateBuffer::default();
        let mut view: Box<dyn StateReader> = Box::new(BatchView::open(&db, "s", &buf).unwrap());
        // (scope, key, value, mark, version) of each call.
        type Call<'a> = (Option<&'a str>, &'a str, Option<&'a str>, &'a str, u64);
        let calls: [Call; 5] = [
            (Some("a"), "k", Some("1"), "m1", 1),
            (Some("b"), "k", Some("b1"), "m1", 1),
            (None, "k", Some("top"), "m2", 7),
            (Some("a"), "k", Some("2"), "m3", 2),
            (Some("b"), "k", None, "m4", 3),
        ];
        for (scope, key, value, mark, version) in calls {
            view.set_scope(scope);
            let mut e = Effects::default();
            put(&mut e, key, value);
            e.uniques.insert(unique_key("n", mark));
            e.versions.insert("v".into(), version);
            view.absorb(e);
            assert_eq!(view.get(b"k"), value.map(|v| v.as_bytes().to_vec()));
            assert_eq!(view.version("v"), Some(version));
        }
        let check = |view: &mut Box<dyn StateReader>, when: &str| {
            view.set_scope(Some("a"));
            assert_eq!(view.get(b"k"), Some(b"2".to_vec()), "{when}");
            assert!(view.unique_exists(&unique_key("n", "m1")), "{when}");
            assert!(view.unique_exists(&unique_key("n", "m3")), "{when}");
            assert!(!view.unique_exists(&unique_key("n", "m4")), "{when}");
            assert_eq!(view.version("v"), Some(2), "{when}");
            view.set_scope(Some("b"));
            assert_eq!(view.get(b"k"), None, "{when}");
            assert_eq!(view.scan(b"", 10), Vec::new(), "{when}");
            assert_eq!(view.version("v"), Some(3), "{when}");
            view.set_scope(None);
            assert_eq!(view.get(b"k"), Some(b"top".to_vec()), "{when}");
            assert_eq!(view.version("v"), Some(7), "{when}");
            assert!(view.unique_exists(&unique_key("n", "m2")), "{when}");
            assert!(!view.unique_exists(&unique_key("n", "m1")), "{when}");
        };
        check(&mut view, "in the batch");
        let absorbed = view.finish();
        commit(&db, |txn| {
            buf.append_row(txn, "s", &absorbed.log_row.unwrap())
                .unwrap();
        });
        let mut next: Box<dyn StateReader> = Box::new(BatchView::open(&db, "s", &buf).unwrap());
        check(&mut next, "the next batch");
        drop(next);
        drop(db);
        let db = Database::open(&path).unwrap();
        let reloaded = StateBuffer::load(&db, "s").unwrap();
        assert_eq!(reloaded.active_len(), buf.active_len());
        let mut after: Box<dyn StateReader> =
            Box::new(BatchView::open(&db, "s", &reloaded).unwrap());
        check(&mut after, "after a restart");
        assert!(
            after.finish().log_row.is_none(),
            "a batch that absorbed nothing writes no row"
        );
    }
}
