//! The state a handler reads during one batch ([`BatchView`]), in layers, newest first:
//! the call's own writes (the host), the batch's earlier successful messages, the shard's
//! buffered effects of earlier batches (`buffer.rs`), and the sorted runs as of the
//! batch's start (a read transaction), newest first, each behind its filter. Kept apart
//! from the buffer and its writes because it only reads.

use std::collections::BTreeMap;
use std::sync::Arc;

use redb::{Database, ReadTransaction, ReadableDatabase, StorageError};

use super::buffer::{Buffered, StateBuffer};
use super::cover::CoverView;
use super::run::{run_key, Entry, Merge, RunScan, KIND_MARK, KIND_STATE, KIND_VERSION};
use super::runs::{self, Partial, Run, RunTable};
use crate::effects::{Effects, StateEntry, StateReader};
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

/// The state a handler reads during one batch.
pub(crate) struct BatchView {
    runs: RunTables,
    /// Buffered effects of earlier batches, newest first (active, then frozen).
    buffered: Vec<Arc<Buffered>>,
    /// Effects of this batch's earlier successful messages.
    overlay: Effects,
    /// The current call's entity scope (empty: the subscriber's whole store).
    scope: Vec<u8>,
}

impl BatchView {
    pub fn open(db: &Database, sub: &str, buffer: &StateBuffer) -> Result<BatchView, redb::Error> {
        let mut buffered = vec![buffer.active.clone()];
        buffered.extend(buffer.frozen.as_ref().map(|f| f.effects.clone()));
        Ok(BatchView {
            runs: RunTables::open(db, sub, buffer)?,
            buffered,
            overlay: Effects::default(),
            scope: Vec::new(),
        })
    }

    /// The in-memory state layers, newest first.
    fn state_layers(&self) -> impl Iterator<Item = &BTreeMap<Vec<u8>, Option<Vec<u8>>>> {
        std::iter::once(&self.overlay.state).chain(self.buffered.iter().map(|b| &b.state))
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

/// Keys from `prefix` on (a borrowed range over `Vec<u8>` keys).
fn from_prefix(prefix: &[u8]) -> (std::ops::Bound<&[u8]>, std::ops::Bound<&[u8]>) {
    (
        std::ops::Bound::Included(prefix),
        std::ops::Bound::Unbounded,
    )
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
        for layer in self.state_layers() {
            if let Some(v) = layer.get(key) {
                return v.clone();
            }
        }
        logged(self.runs.lookup(KIND_STATE, key))??
    }

    fn scan_raw(&self, prefix: &[u8], limit: usize) -> Vec<StateEntry> {
        type Source<'a> = Box<dyn Iterator<Item = Result<Entry, StorageError>> + 'a>;
        let mut sources: Vec<Source> = self
            .state_layers()
            .map(|l| -> Source {
                Box::new(
                    l.range::<[u8], _>(from_prefix(prefix))
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
        if self.overlay.uniques.contains(mark) {
            return true;
        }
        if self.buffered.iter().any(|b| b.uniques.contains(mark)) {
            return true;
        }
        // Marks are never deleted: any entry is the mark.
        logged(self.runs.lookup(KIND_MARK, mark)).is_some_and(|e| e.is_some())
    }

    fn version_raw(&self, key: &str) -> Option<u64> {
        if let Some(v) = self.overlay.versions.get(key) {
            return Some(*v);
        }
        for b in &self.buffered {
            if let Some(v) = b.versions.get(key) {
                return Some(*v);
            }
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
        if self.scope.is_empty() {
            self.overlay.merge(effects);
            return;
        }
        // Straight into the overlay, later wins as in `Effects::merge`: no scoped copy of
        // the collections in between.
        let scope = &self.scope;
        let overlay = &mut self.overlay;
        for (k, v) in effects.state {
            overlay.state.insert([&scope[..], &k].concat(), v);
        }
        for m in effects.uniques {
            overlay.uniques.insert([&scope[..], &m].concat());
        }
        if !effects.versions.is_empty() {
            let text = scope_text(scope).unwrap_or_default();
            for (k, v) in effects.versions {
                overlay.versions.insert(format!("{text}{k}"), v);
            }
        }
        overlay.outbox.extend(effects.outbox);
    }

    fn set_scope(&mut self, entity: Option<&str>) {
        self.scope.clear();
        if let Some(e) = entity {
            self.scope
                .extend_from_slice(&crate::ledger::entity_scope(e));
        }
    }

    fn into_effects(self: Box<Self>) -> Effects {
        self.overlay
    }
}
