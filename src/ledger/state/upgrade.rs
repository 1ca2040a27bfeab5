//! Rewrites handler state tables of the first layout (one redb row per entry:
//! `state_v1/`, `unique_v1/`, `versions_v1/`) into block tables, inside the shard's opening
//! transaction, and deletes them.

use redb::{ReadableTable, WriteTransaction};

use super::blocks;
use crate::ledger::tables::{
    state_name, unique_name, versions_name, BlockDef, FirstLayoutStateDef, FirstLayoutUniqueDef,
    FirstLayoutVersionsDef,
};

/// Rows copied per step when upgrading a table of one row per entry.
const UPGRADE_CHUNK: usize = 65_536;

/// Upgrades every first-layout table among `tables` (the file's tables).
pub(crate) fn upgrade_v1_tables(
    txn: &WriteTransaction,
    tables: &[String],
) -> Result<(), redb::Error> {
    for name in tables {
        let Some((kind, sub)) = name.split_once("_v1/") else {
            continue;
        };
        let (target, deleted) = match kind {
            "state" => {
                let def = FirstLayoutStateDef::new(name);
                let target = state_name(sub);
                let n = upgrade_table(txn, def, &target, |k, v| (k.to_vec(), v.to_vec()))?;
                (target, n)
            }
            "unique" => {
                let def = FirstLayoutUniqueDef::new(name);
                let target = unique_name(sub);
                let n = upgrade_table(txn, def, &target, |k, ()| (k.to_vec(), Vec::new()))?;
                (target, n)
            }
            "versions" => {
                let def = FirstLayoutVersionsDef::new(name);
                let target = versions_name(sub);
                let n = upgrade_table(txn, def, &target, |k, v| {
                    (k.as_bytes().to_vec(), v.to_le_bytes().to_vec())
                })?;
                (target, n)
            }
            _ => continue,
        };
        tracing::info!(table = %name, into = %target, entries = deleted, "handler state table upgraded to blocks");
    }
    Ok(())
}

/// Copies one first-layout table into a block table, `UPGRADE_CHUNK` rows at a time (its
/// keys are already in order), deletes it and returns how many entries it held.
fn upgrade_table<K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &WriteTransaction,
    def: redb::TableDefinition<K, V>,
    target: &str,
    entry: impl for<'a> Fn(K::SelfType<'a>, V::SelfType<'a>) -> (Vec<u8>, Vec<u8>),
) -> Result<u64, redb::Error> {
    let mut copied = 0;
    {
        let old = txn.open_table(def)?;
        let mut new = txn.open_table(BlockDef::new(target))?;
        let mut chunk = Vec::with_capacity(UPGRADE_CHUNK);
        let mut rows = old.iter()?;
        loop {
            let row = rows.next().transpose()?;
            let done = row.is_none();
            if let Some((k, v)) = row {
                chunk.push(entry(k.value(), v.value()));
            }
            if chunk.len() == UPGRADE_CHUNK || (done && !chunk.is_empty()) {
                let updates: Vec<(&[u8], Option<&[u8]>)> = chunk
                    .iter()
                    .map(|(k, v)| (k.as_slice(), Some(v.as_slice())))
                    .collect();
                blocks::apply(&mut new, &updates)?;
                copied += chunk.len() as u64;
                chunk.clear();
            }
            if done {
                break;
            }
        }
    }
    txn.delete_table(def)?;
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use redb::{Database, ReadableDatabase, TableHandle};

    use super::super::testing::commit;
    use super::super::{state_entries, state_len, BatchView, StateBuffer};
    use super::*;
    use crate::effects::{unique_key, StateReader};

    /// A shard file written by the first layout (one row per entry) reads the same after
    /// the upgrade, and the old tables are gone.
    #[test]
    fn first_layout_tables_are_upgraded_to_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("s.redb")).unwrap();
        let mut want = Vec::new();
        commit(&db, |txn| {
            let mut state = txn
                .open_table(FirstLayoutStateDef::new("state_v1/s"))
                .unwrap();
            for i in 0..(UPGRADE_CHUNK + 10) {
                let (k, v) = (format!("label/{i:07}"), format!("{{\"n\":{i}}}"));
                state.insert(k.as_bytes(), v.as_bytes()).unwrap();
                want.push((k.into_bytes(), v.into_bytes()));
            }
            let mut uniques = txn
                .open_table(FirstLayoutUniqueDef::new("unique_v1/s"))
                .unwrap();
            uniques
                .insert(unique_key("label", "o-1").as_slice(), ())
                .unwrap();
            let mut versions = txn
                .open_table(FirstLayoutVersionsDef::new("versions_v1/s"))
                .unwrap();
            versions.insert("order/1", 42).unwrap();
        });
        want.sort();
        let names: Vec<String> = db
            .begin_read()
            .unwrap()
            .list_tables()
            .unwrap()
            .map(|h| h.name().to_string())
            .collect();
        commit(&db, |txn| upgrade_v1_tables(txn, &names).unwrap());
        let left: Vec<String> = db
            .begin_read()
            .unwrap()
            .list_tables()
            .unwrap()
            .map(|h| h.name().to_string())
            .filter(|n| n.contains("_v1/"))
            .collect();
        assert_eq!(left, Vec::<String>::new());
        assert_eq!(state_entries(&db, "s").unwrap(), want);
        assert_eq!(state_len(&db, "s").unwrap(), want.len() as u64);
        let view = BatchView::open(&db, "s", &StateBuffer::default()).unwrap();
        assert!(view.unique_exists(&unique_key("label", "o-1")));
        assert!(!view.unique_exists(&unique_key("label", "o-2")));
        assert_eq!(view.version("order/1"), Some(42));
        assert_eq!(view.get(b"label/0000007"), Some(b"{\"n\":7}".to_vec()));
    }
}
