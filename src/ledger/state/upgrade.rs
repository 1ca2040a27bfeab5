//! Rewrites handler state of the earlier layouts into one sorted run per subscriber,
//! inside the shard's opening transaction, and deletes the old tables:
//!
//! - the first layout, one redb row per entry (`state_v1/`, `unique_v1/`, `versions_v1/`);
//! - the second, block tables with a row table beside each (`state_v2/`, `unique_v2/`,
//!   `versions_v2/` and their `_v2_rows/` tables, see `blocks.rs`).
//!
//! A subscriber with old tables has no runs yet, so its upgraded state becomes run 0, the
//! oldest; buffered effects still in its log are newer and flush after it.

use std::collections::BTreeSet;

use redb::{ReadableTable, StorageError, Table, WriteTransaction};

use super::blocks;
use super::run::{RunWriter, KIND_MARK, KIND_STATE, KIND_VERSION};
use super::runs;
use crate::ledger::format::tables::{
    missing_is_none, rows_name, state_name, state_run_name, unique_name, versions_name, BlockDef,
    FirstLayoutStateDef, FirstLayoutUniqueDef, FirstLayoutVersionsDef,
};

const FIRST_LAYOUT: [&str; 3] = ["state_v1/", "unique_v1/", "versions_v1/"];
const SECOND_LAYOUT: [&str; 3] = ["state_v2/", "unique_v2/", "versions_v2/"];

/// Upgrades the handler state of every subscriber with tables of an earlier layout among
/// `tables` (the file's tables).
pub(crate) fn upgrade_old_tables(
    txn: &WriteTransaction,
    tables: &[String],
) -> Result<(), redb::Error> {
    let subs: BTreeSet<&str> = tables
        .iter()
        .filter_map(|name| {
            FIRST_LAYOUT
                .iter()
                .chain(&SECOND_LAYOUT)
                .find_map(|p| name.strip_prefix(p))
        })
        .collect();
    for sub in subs {
        let entries = upgrade_sub(txn, sub)?;
        tracing::info!(subscriber = %sub, entries, "handler state upgraded to sorted runs");
    }
    Ok(())
}

/// The entries of one kind of a subscriber in the earlier layouts, in key order, handed
/// to `f` (run key, value).
fn each_old_entry(
    txn: &WriteTransaction,
    sub: &str,
    kind: u8,
    mut f: impl FnMut(&[u8], &[u8]) -> Result<(), StorageError>,
) -> Result<(), redb::Error> {
    let mut key = Vec::new();
    let mut emit = |k: &[u8], v: &[u8]| {
        key.clear();
        key.push(kind);
        key.extend_from_slice(k);
        f(&key, v)
    };
    match kind {
        KIND_STATE => {
            if let Some(t) = missing_is_none(
                txn.open_table(FirstLayoutStateDef::new(&format!("state_v1/{sub}"))),
            )? {
                for row in t.iter()? {
                    let (k, v) = row?;
                    emit(k.value(), v.value())?;
                }
            }
        }
        KIND_MARK => {
            if let Some(t) = missing_is_none(
                txn.open_table(FirstLayoutUniqueDef::new(&format!("unique_v1/{sub}"))),
            )? {
                for row in t.iter()? {
                    emit(row?.0.value(), &[])?;
                }
            }
        }
        _ => {
            if let Some(t) = missing_is_none(
                txn.open_table(FirstLayoutVersionsDef::new(&format!("versions_v1/{sub}"))),
            )? {
                for row in t.iter()? {
                    let (k, v) = row?;
                    emit(k.value().as_bytes(), &v.value().to_le_bytes())?;
                }
            }
        }
    }
    let second = match kind {
        KIND_STATE => state_name(sub),
        KIND_MARK => unique_name(sub),
        _ => versions_name(sub),
    };
    let blocks = missing_is_none(txn.open_table(BlockDef::new(&second)))?;
    let rows = missing_is_none(txn.open_table(BlockDef::new(&rows_name(&second))))?;
    let mut failed = None;
    blocks::for_each_mixed(blocks.as_ref(), rows.as_ref(), b"", |k, v| {
        match emit(k, v) {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        }
    })?;
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Writes a subscriber's old tables as run 0 and deletes them; returns the entries.
fn upgrade_sub(txn: &WriteTransaction, sub: &str) -> Result<u64, redb::Error> {
    let kinds = [KIND_STATE, KIND_MARK, KIND_VERSION];
    let mut expected = 0u64;
    for kind in kinds {
        each_old_entry(txn, sub, kind, |_, _| {
            expected += 1;
            Ok(())
        })?;
    }
    let mut out: Table<&'static [u8], &'static [u8]> =
        txn.open_table(BlockDef::new(&state_run_name(sub, 0)))?;
    let mut writer = RunWriter::new(expected, true);
    for kind in kinds {
        each_old_entry(txn, sub, kind, |k, v| writer.push(&mut out, k, Some(v)))?;
    }
    let written = writer.finish(&mut out)?;
    drop(out);
    let entries = written.entries;
    runs::register(txn, sub, 0, 0, written)?;
    for name in FIRST_LAYOUT.iter().chain(&SECOND_LAYOUT) {
        let old = format!("{name}{sub}");
        txn.delete_table(BlockDef::new(&old))?;
        txn.delete_table(BlockDef::new(&rows_name(&old)))?;
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use redb::{Database, ReadableDatabase, TableHandle};

    use super::super::testing::commit;
    use super::super::{state_entries, state_len, BatchView, StateBuffer};
    use super::*;
    use crate::effects::{unique_key, StateReader};

    fn table_names(db: &Database) -> Vec<String> {
        db.begin_read()
            .unwrap()
            .list_tables()
            .unwrap()
            .map(|h| h.name().to_string())
            .collect()
    }

    /// Shard files written by the first layout (one row per entry, subscriber `s`) and the
    /// second (blocks and row tables, subscriber `t`) read the same after the upgrade to
    /// runs, and the old tables are gone.
    #[test]
    fn tables_of_both_earlier_layouts_are_upgraded_to_runs() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("s.redb")).unwrap();
        let mut want = Vec::new();
        commit(&db, |txn| {
            let mut state = txn
                .open_table(FirstLayoutStateDef::new("state_v1/s"))
                .unwrap();
            for i in 0..70_000 {
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
        // Second layout: in-order keys go to blocks, a sparse one to the row table.
        let second: Vec<(Vec<u8>, Vec<u8>)> = (0..500)
            .map(|i| (format!("k/{:04}", i * 2).into_bytes(), vec![b'v'; i % 50]))
            .collect();
        commit(&db, |txn| {
            let mut b = txn.open_table(BlockDef::new(&state_name("t"))).unwrap();
            let mut r = txn
                .open_table(BlockDef::new(&rows_name(&state_name("t"))))
                .unwrap();
            let updates: Vec<(&[u8], Option<&[u8]>)> = second
                .iter()
                .map(|(k, v)| (k.as_slice(), Some(v.as_slice())))
                .collect();
            blocks::apply_mixed(&mut b, &mut r, &updates).unwrap();
            blocks::apply_mixed(
                &mut b,
                &mut r,
                &[(b"k/0003".as_slice(), Some(b"row".as_slice()))],
            )
            .unwrap();
            let mut m = txn.open_table(BlockDef::new(&unique_name("t"))).unwrap();
            let mark = unique_key("n", "1");
            blocks::apply(&mut m, &[(mark.as_slice(), Some(&[][..]))]).unwrap();
            let mut v = txn.open_table(BlockDef::new(&versions_name("t"))).unwrap();
            blocks::apply(
                &mut v,
                &[(b"ver".as_slice(), Some(&7u64.to_le_bytes()[..]))],
            )
            .unwrap();
        });
        let mut second_want = second.clone();
        second_want.push((b"k/0003".to_vec(), b"row".to_vec()));
        second_want.sort();
        want.sort();
        commit(&db, |txn| {
            upgrade_old_tables(txn, &table_names(&db)).unwrap()
        });
        let left: Vec<String> = table_names(&db)
            .into_iter()
            .filter(|n| n.contains("_v1/") || n.contains("_v2/") || n.contains("_v2_rows/"))
            .filter(|n| !n.starts_with("staterun"))
            .collect();
        assert_eq!(left, Vec::<String>::new());

        let s = StateBuffer::load(&db, "s").unwrap();
        assert_eq!(state_entries(&db, "s", &s).unwrap(), want);
        assert_eq!(state_len(&db, "s", &s).unwrap(), want.len() as u64);
        let view = BatchView::open(&db, "s", &s).unwrap();
        assert!(view.unique_exists(&unique_key("label", "o-1")));
        assert!(!view.unique_exists(&unique_key("label", "o-2")));
        assert_eq!(view.version("order/1"), Some(42));
        assert_eq!(view.get(b"label/0000007"), Some(b"{\"n\":7}".to_vec()));

        let t = StateBuffer::load(&db, "t").unwrap();
        assert_eq!(state_entries(&db, "t", &t).unwrap(), second_want);
        let view = BatchView::open(&db, "t", &t).unwrap();
        assert!(view.unique_exists(&unique_key("n", "1")));
        assert_eq!(view.version("ver"), Some(7));
        assert_eq!(view.get(b"k/0003"), Some(b"row".to_vec()));
    }
}
