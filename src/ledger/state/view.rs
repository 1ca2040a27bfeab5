//! The state a handler reads during one batch ([`BatchView`]), in layers, newest first:
//! the call's own writes (the host), the batch's earlier successful messages, the shard's
//! buffered effects of earlier batches (`buffer.rs`), and the sorted block tables as of
//! the batch's start (a read transaction). Kept apart from the buffer and its writes
//! because it only reads.

use std::collections::BTreeMap;
use std::sync::Arc;

use fastbloom::AtomicBloomFilter;
use redb::{Database, ReadOnlyTable, ReadTransaction, ReadableDatabase};

use super::blocks;
use super::buffer::{Buffered, StateBuffer};
use super::marks;
use crate::effects::{Effects, StateEntry, StateReader};
use crate::ledger::tables::{
    missing_is_none, rows_name, state_name, unique_name, versions_name, BlockDef,
};

type BlockTable = ReadOnlyTable<&'static [u8], &'static [u8]>;

/// A block table and its row table, each absent until first written.
#[derive(Default)]
pub(super) struct Tables {
    blocks: Option<BlockTable>,
    rows: Option<BlockTable>,
}

impl Tables {
    pub(super) fn open(txn: &ReadTransaction, name: &str) -> Result<Tables, redb::Error> {
        Ok(Tables {
            blocks: missing_is_none(txn.open_table(BlockDef::new(name)))?,
            rows: missing_is_none(txn.open_table(BlockDef::new(&rows_name(name))))?,
        })
    }

    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, redb::StorageError> {
        blocks::get_mixed(self.blocks.as_ref(), self.rows.as_ref(), key)
    }

    fn contains(&self, key: &[u8]) -> Result<bool, redb::StorageError> {
        blocks::contains_mixed(self.blocks.as_ref(), self.rows.as_ref(), key)
    }

    pub(super) fn for_each_from(
        &self,
        from: &[u8],
        f: impl FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), redb::StorageError> {
        blocks::for_each_mixed(self.blocks.as_ref(), self.rows.as_ref(), from, f)
    }
}

/// The state a handler reads during one batch.
pub(crate) struct BatchView {
    _txn: ReadTransaction,
    /// Each kind as (block table, row table).
    state: Tables,
    uniques: Tables,
    versions: Tables,
    /// Buffered effects of earlier batches, newest first (active, then frozen).
    buffered: Vec<Arc<Buffered>>,
    /// Effects of this batch's earlier successful messages.
    overlay: Effects,
    /// Says "certainly absent" for most new marks (once built).
    marks: Option<Arc<AtomicBloomFilter>>,
    /// The current call's entity scope (empty: the subscriber's whole store).
    scope: Vec<u8>,
}

impl BatchView {
    pub fn open(db: &Database, sub: &str, buffer: &StateBuffer) -> Result<BatchView, redb::Error> {
        let txn = db.begin_read()?;
        let state = Tables::open(&txn, &state_name(sub))?;
        let uniques = Tables::open(&txn, &unique_name(sub))?;
        let versions = Tables::open(&txn, &versions_name(sub))?;
        let mut buffered = vec![buffer.active.clone()];
        buffered.extend(buffer.frozen.as_ref().map(|f| f.effects.clone()));
        Ok(BatchView {
            _txn: txn,
            state,
            uniques,
            versions,
            buffered,
            overlay: Effects::default(),
            marks: buffer.marks.bloom(),
            scope: Vec::new(),
        })
    }

    /// The scope as text (entities are UTF-8 and end with NUL), for version keys.
    fn scope_text(&self) -> Option<&str> {
        if self.scope.is_empty() {
            return None;
        }
        std::str::from_utf8(&self.scope).ok()
    }

    /// The in-memory state layers, newest first.
    fn state_layers(&self) -> impl Iterator<Item = &BTreeMap<Vec<u8>, Option<Vec<u8>>>> {
        std::iter::once(&self.overlay.state).chain(self.buffered.iter().map(|b| &b.state))
    }
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
        logged(self.state.get(key))?
    }

    fn scan_raw(&self, prefix: &[u8], limit: usize) -> Vec<StateEntry> {
        // Each in-memory entry under the prefix can hide at most one table row.
        let shadowing: usize = self
            .state_layers()
            .map(|l| {
                l.range::<[u8], _>(from_prefix(prefix))
                    .take_while(|(k, _)| k.starts_with(prefix))
                    .count()
            })
            .sum();
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        logged(self.state.for_each_from(prefix, |k, v| {
            if !k.starts_with(prefix) {
                return false;
            }
            merged.insert(k.to_vec(), v.to_vec());
            merged.len() < limit + shadowing
        }));
        // Oldest layer first, so newer writes win.
        let layers: Vec<_> = self.state_layers().collect();
        for layer in layers.into_iter().rev() {
            for (k, v) in layer.range::<[u8], _>(from_prefix(prefix)) {
                if !k.starts_with(prefix) {
                    break;
                }
                match v {
                    Some(v) => merged.insert(k.clone(), v.clone()),
                    None => merged.remove(k),
                };
            }
        }
        merged.into_iter().take(limit).collect()
    }

    fn unique_raw(&self, mark: &[u8]) -> bool {
        if self.overlay.uniques.contains(mark) {
            return true;
        }
        // The filter holds every committed mark, buffered or applied: most new marks stop
        // here without touching the buffers' hash sets or the table.
        if let Some(f) = &self.marks {
            if !f.contains_hash(marks::hash(mark)) {
                return false;
            }
        }
        if self.buffered.iter().any(|b| b.uniques.contains(mark)) {
            return true;
        }
        logged(self.uniques.contains(mark)).unwrap_or(false)
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
        let v = logged(self.versions.get(key.as_bytes()))??;
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
        match self.scope_text() {
            None => self.version_raw(key),
            Some(scope) => self.version_raw(&format!("{scope}{key}")),
        }
    }

    fn absorb(&mut self, effects: Effects) {
        if self.scope.is_empty() {
            self.overlay.merge(effects);
            return;
        }
        let scope = &self.scope;
        let text = self.scope_text().unwrap_or_default().to_string();
        let scoped = Effects {
            state: effects
                .state
                .into_iter()
                .map(|(k, v)| ([&scope[..], &k].concat(), v))
                .collect(),
            uniques: effects
                .uniques
                .into_iter()
                .map(|m| [&scope[..], &m].concat())
                .collect(),
            versions: effects
                .versions
                .into_iter()
                .map(|(k, v)| (format!("{text}{k}"), v))
                .collect(),
            outbox: effects.outbox,
        };
        self.overlay.merge(scoped);
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
