//! The baseline the bench measures the engine against (`dedupd bench`): what a careful user
//! would write first. One redb table keyed by the 128-bit id hash, get-then-insert per
//! message, one durable commit per batch. No generations, filters, shards or handlers. It
//! lives here because redb is used only inside the ledger; the traffic and the timing are
//! the bench's.

use std::path::Path;

use redb::{Database, Durability, ReadableTable};

use crate::ledger::format::tables::NAIVE;

/// A storage failure of the baseline's scratch file (redb's own text).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NaiveError(String);

fn naive_error(e: impl std::fmt::Display) -> NaiveError {
    NaiveError(e.to_string())
}

/// The baseline's one table, in a file of its own.
pub(crate) struct NaiveBaseline {
    db: Database,
}

impl NaiveBaseline {
    /// Creates (or opens) the file at `path` with a page cache of `cache_mib` MiB.
    pub(crate) fn create(path: &Path, cache_mib: usize) -> Result<NaiveBaseline, NaiveError> {
        let db = Database::builder()
            .set_cache_size(cache_mib << 20)
            .create(path)
            .map_err(naive_error)?;
        Ok(NaiveBaseline { db })
    }

    /// Stores `count` keys that no traffic uses (hashes of `stored-<seed>-<i>`) before a
    /// measured run, so the run meets a table of that size, as a store that has been in use
    /// for a while would. Sorted and inserted a million at a time without fsync, then made
    /// durable by one empty durable commit: filling is not what is measured.
    pub(crate) fn preload(&self, count: u64, seed: u64) -> Result<(), NaiveError> {
        const CHUNK: u64 = 1 << 20;
        let mut keys: Vec<u128> = (0..count)
            .map(|i| crate::envelope::key_hash(format!("stored-{seed}-{i}").as_bytes()))
            .collect();
        keys.sort_unstable();
        for chunk in keys.chunks(CHUNK as usize) {
            let mut txn = self.db.begin_write().map_err(naive_error)?;
            txn.set_durability(Durability::None).map_err(naive_error)?;
            {
                let mut t = txn.open_table(NAIVE).map_err(naive_error)?;
                for key in chunk {
                    t.insert(*key, [0u8; 32]).map_err(naive_error)?;
                }
            }
            txn.commit().map_err(naive_error)?;
        }
        let mut txn = self.db.begin_write().map_err(naive_error)?;
        txn.set_durability(Durability::Immediate)
            .map_err(naive_error)?;
        txn.commit().map_err(naive_error)
    }

    /// Keys in the table.
    pub(crate) fn stored_keys(&self) -> Result<u64, NaiveError> {
        use redb::{ReadableDatabase, ReadableTableMetadata};
        let txn = self.db.begin_read().map_err(naive_error)?;
        match txn.open_table(NAIVE) {
            Ok(t) => t.len().map_err(naive_error),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
            Err(e) => Err(naive_error(e)),
        }
    }

    /// Claims a batch of `(key hash, payload fingerprint)`: each key not stored yet is
    /// inserted with its fingerprint, and the batch is committed durably before this
    /// returns. Returns how many keys were new (the rest were duplicates), so a run can be
    /// checked against what its traffic must give.
    pub(crate) fn claim_batch(&self, batch: &[(u128, u64)]) -> Result<u64, NaiveError> {
        let mut txn = self.db.begin_write().map_err(naive_error)?;
        txn.set_durability(Durability::Immediate)
            .map_err(naive_error)?;
        let mut new = 0;
        {
            let mut t = txn.open_table(NAIVE).map_err(naive_error)?;
            for (key, fp) in batch {
                if t.get(*key).map_err(naive_error)?.is_none() {
                    let mut rec = [0u8; 32];
                    rec[..8].copy_from_slice(&fp.to_le_bytes());
                    t.insert(*key, rec).map_err(naive_error)?;
                    new += 1;
                }
            }
        }
        txn.commit().map_err(naive_error)?;
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::{ReadableDatabase, ReadableTableMetadata};

    #[test]
    fn a_key_claimed_again_keeps_its_first_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("naive.redb");
        let naive = NaiveBaseline::create(&path, 1).unwrap();
        assert_eq!(naive.claim_batch(&[(1, 10), (2, 20)]).unwrap(), 2);
        assert_eq!(naive.claim_batch(&[(1, 11), (3, 30)]).unwrap(), 1);
        drop(naive);
        let db = Database::open(&path).unwrap();
        let txn = db.begin_read().unwrap();
        let t = txn.open_table(NAIVE).unwrap();
        let fp = |k: u128| {
            let rec = t.get(k).unwrap().unwrap().value();
            u64::from_le_bytes(rec[..8].try_into().unwrap())
        };
        assert_eq!((fp(1), fp(2), fp(3)), (10, 20, 30));
        assert_eq!(t.len().unwrap(), 3);
    }

    #[test]
    fn preloaded_keys_are_stored_durably_and_never_meet_the_traffic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("naive.redb");
        let naive = NaiveBaseline::create(&path, 1).unwrap();
        naive.preload(5_000, 42).unwrap();
        assert_eq!(naive.stored_keys().unwrap(), 5_000);
        let traffic: Vec<(u128, u64)> = (0..100)
            .map(|i| (crate::envelope::key_hash(format!("m-{i}").as_bytes()), 1))
            .collect();
        assert_eq!(naive.claim_batch(&traffic).unwrap(), 100, "all new");
        drop(naive);
        // Durable: a reopen finds them all.
        let naive = NaiveBaseline::create(&path, 1).unwrap();
        assert_eq!(naive.stored_keys().unwrap(), 5_100);
    }
}
