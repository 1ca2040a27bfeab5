//! Handler state in redb: the read view a handler sees during a batch, and the writes that
//! commit with the claims.
//!
//! A handler reads the subscriber's state as of the last commit (a read transaction taken
//! when the batch starts) overlaid with the effects of earlier successful messages of the
//! same batch; its own writes are overlaid by the host (read-your-writes). The effects of
//! successful messages are written into the batch's write transaction, so they commit with
//! the claims or not at all (G2, G6).

use std::collections::BTreeMap;
use std::sync::Arc;

use redb::{
    Database, ReadOnlyTable, ReadTransaction, ReadableDatabase, ReadableTable, TableDefinition,
    TableError, WriteTransaction,
};

use crate::effects::{Effects, HandlerFactory, MessageHandler, StateEntry, StateReader};

/// Handler key-value state: key -> value.
pub fn state_name(sub: &str) -> String {
    format!("state_v1/{sub}")
}
/// `insert-unique`: marks encoded by [`crate::effects::unique_key`] -> (). One byte-string
/// key compares with a single memcmp, where a tuple key compared field by field (measured:
/// 2 % of a shipping-label run).
pub fn unique_name(sub: &str) -> String {
    format!("unique_v1/{sub}")
}
/// `advance-version`: key -> version.
pub fn versions_name(sub: &str) -> String {
    format!("versions_v1/{sub}")
}

type StateDef<'a> = TableDefinition<'a, &'static [u8], &'static [u8]>;
type UniqueDef<'a> = TableDefinition<'a, &'static [u8], ()>;

type VersionDef<'a> = TableDefinition<'a, &'static str, u64>;

/// Outbox rows: seq -> JSON, relayed after commit (see the Kafka source).
pub const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("outbox_v1");
/// Dead letters: (subscriber, seq) -> JSON record with the reason and the message.
pub const DEAD_LETTERS: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("deadletters_v1");

/// A subscriber's handler as instantiated on one shard.
pub(crate) struct ShardHandler {
    pub factory: Arc<dyn HandlerFactory>,
    pub instance: Box<dyn MessageHandler>,
}

fn missing_is_none<T>(r: Result<T, TableError>) -> Result<Option<T>, redb::Error> {
    match r {
        Ok(t) => Ok(Some(t)),
        Err(TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The state a handler reads during one batch.
pub(crate) struct BatchView {
    _txn: ReadTransaction,
    state: Option<ReadOnlyTable<&'static [u8], &'static [u8]>>,
    uniques: Option<ReadOnlyTable<&'static [u8], ()>>,
    versions: Option<ReadOnlyTable<&'static str, u64>>,
    overlay: Effects,
}

impl BatchView {
    pub fn open(db: &Database, sub: &str) -> Result<BatchView, redb::Error> {
        let txn = db.begin_read()?;
        let state = missing_is_none(txn.open_table(StateDef::new(&state_name(sub))))?;
        let uniques = missing_is_none(txn.open_table(UniqueDef::new(&unique_name(sub))))?;
        let versions = missing_is_none(txn.open_table(VersionDef::new(&versions_name(sub))))?;
        Ok(BatchView {
            _txn: txn,
            state,
            uniques,
            versions,
            overlay: Effects::default(),
        })
    }
}

/// Storage errors while a handler reads are reported to the log and read as "absent"; the
/// commit that follows hits the same storage and fails the shard if it is really broken.
fn logged<T>(r: Result<T, redb::StorageError>) -> Option<T> {
    r.map_err(|e| tracing::error!(error = %e, "handler state read failed"))
        .ok()
}

impl StateReader for BatchView {
    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        if let Some(v) = self.overlay.state.get(key) {
            return v.clone();
        }
        let t = self.state.as_ref()?;
        logged(t.get(key))?.map(|v| v.value().to_vec())
    }

    fn scan(&self, prefix: &[u8], limit: usize) -> Vec<StateEntry> {
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        if let Some(t) = &self.state {
            if let Some(range) = logged(t.range::<&[u8]>(prefix..)) {
                for row in range {
                    let Some((k, v)) = logged(row) else { break };
                    if !k.value().starts_with(prefix) {
                        break;
                    }
                    merged.insert(k.value().to_vec(), v.value().to_vec());
                    if merged.len() >= limit + self.overlay.state.len() {
                        break;
                    }
                }
            }
        }
        for (k, v) in self.overlay.state.range(prefix.to_vec()..) {
            if !k.starts_with(prefix) {
                break;
            }
            match v {
                Some(v) => merged.insert(k.clone(), v.clone()),
                None => merged.remove(k),
            };
        }
        merged.into_iter().take(limit).collect()
    }

    fn unique_exists(&self, mark: &[u8]) -> bool {
        if self.overlay.uniques.contains(mark) {
            return true;
        }
        self.uniques
            .as_ref()
            .and_then(|t| logged(t.get(mark)))
            .is_some_and(|v| v.is_some())
    }

    fn version(&self, key: &str) -> Option<u64> {
        if let Some(v) = self.overlay.versions.get(key) {
            return Some(*v);
        }
        let t = self.versions.as_ref()?;
        logged(t.get(key))?.map(|v| v.value())
    }

    fn absorb(&mut self, effects: Effects) {
        self.overlay.merge(effects);
    }

    fn into_effects(self: Box<Self>) -> Effects {
        self.overlay
    }
}

/// Writes the effects of a batch's successful messages into its write transaction.
pub(crate) fn apply(
    txn: &WriteTransaction,
    sub: &str,
    effects: &Effects,
    next_outbox_seq: &mut u64,
    now_ms: u64,
) -> Result<(), redb::Error> {
    if !effects.state.is_empty() {
        let name = state_name(sub);
        let mut t = txn.open_table(StateDef::new(&name))?;
        for (k, v) in &effects.state {
            match v {
                Some(v) => {
                    t.insert(k.as_slice(), v.as_slice())?;
                }
                None => {
                    t.remove(k.as_slice())?;
                }
            }
        }
    }
    if !effects.uniques.is_empty() {
        let name = unique_name(sub);
        let mut t = txn.open_table(UniqueDef::new(&name))?;
        for mark in &effects.uniques {
            t.insert(mark.as_slice(), ())?;
        }
    }
    if !effects.versions.is_empty() {
        let name = versions_name(sub);
        let mut t = txn.open_table(VersionDef::new(&name))?;
        for (k, v) in &effects.versions {
            t.insert(k.as_str(), *v)?;
        }
    }
    if !effects.outbox.is_empty() {
        let mut t = txn.open_table(OUTBOX)?;
        for m in &effects.outbox {
            let row = serde_json::json!({
                "v": 1,
                "subscriber": sub,
                "id": m.id,
                "topic": m.topic,
                "key": m.key,
                "headers": m.headers,
                "written_at_ms": now_ms,
                "payload": String::from_utf8_lossy(&m.payload),
            });
            t.insert(
                *next_outbox_seq,
                serde_json::to_vec(&row).unwrap_or_default().as_slice(),
            )?;
            *next_outbox_seq += 1;
        }
    }
    Ok(())
}

/// All state entries of a subscriber in one shard file, in key order.
pub(crate) fn state_entries(db: &Database, sub: &str) -> Result<Vec<StateEntry>, redb::Error> {
    let txn = db.begin_read()?;
    let Some(t) = missing_is_none(txn.open_table(StateDef::new(&state_name(sub))))? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for row in t.iter()? {
        let (k, v) = row?;
        out.push((k.value().to_vec(), v.value().to_vec()));
    }
    Ok(out)
}

/// Number of state entries of a subscriber in one shard file.
pub(crate) fn state_len(db: &Database, sub: &str) -> Result<u64, redb::Error> {
    use redb::ReadableTableMetadata;
    let txn = db.begin_read()?;
    match missing_is_none(txn.open_table(StateDef::new(&state_name(sub))))? {
        Some(t) => Ok(t.len()?),
        None => Ok(0),
    }
}
