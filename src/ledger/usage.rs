//! Where a data directory's bytes go: every table of every shard file, grouped by kind
//! (the name up to its first `/`), with redb's own accounting of the pages each uses.
//! Read from a closed data directory (`dedupd inspect`), through read-only handles.

use std::collections::BTreeMap;
use std::path::Path;

use redb::{ReadOnlyDatabase, ReadableDatabase, ReadableTableMetadata, TableHandle};
use serde::{Deserialize, Serialize};

use super::format::datadir::shard_path;
use super::shard::storage;
use super::LedgerError;

/// The tables of one kind across all shard files.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct TableGroup {
    /// The table names up to their first `/` (`claimblk_v1`, `staterun_v1`, ...), or the
    /// whole name of a shard-wide table.
    pub(crate) kind: String,
    pub(crate) tables: u64,
    pub(crate) entries: u64,
    /// Key and value bytes.
    pub(crate) stored_bytes: u64,
    /// Page headers, offsets and branch pages.
    pub(crate) metadata_bytes: u64,
    /// Unused bytes inside the table's pages.
    pub(crate) fragmented_bytes: u64,
}

impl TableGroup {
    /// Bytes of the pages the tables occupy.
    pub(crate) fn page_bytes(&self) -> u64 {
        self.stored_bytes + self.metadata_bytes + self.fragmented_bytes
    }
}

/// Disk use of a data directory.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct DiskUsage {
    /// Largest first.
    pub(crate) groups: Vec<TableGroup>,
    /// Sum of the shard files' sizes.
    pub(crate) file_bytes: u64,
    /// File bytes no table page accounts for: free pages kept for reuse, redb's own
    /// tables and headers.
    pub(crate) other_bytes: u64,
}

/// Reads the table statistics of every shard file of a closed data directory.
pub(crate) fn disk_usage(dir: &Path, shards: usize) -> Result<DiskUsage, LedgerError> {
    let mut groups: BTreeMap<String, TableGroup> = BTreeMap::new();
    let mut file_bytes = 0;
    for index in 0..shards {
        let path = shard_path(dir, index);
        let err = |e: redb::Error| storage(&path, e);
        file_bytes += std::fs::metadata(&path).map_or(0, |m| m.len());
        let db = ReadOnlyDatabase::open(&path).map_err(|e| err(e.into()))?;
        let txn = db.begin_read().map_err(|e| err(e.into()))?;
        for handle in txn.list_tables().map_err(|e| err(e.into()))? {
            let name = handle.name().to_string();
            let kind = name.split('/').next().unwrap_or(&name).to_string();
            let table = txn.open_untyped_table(handle).map_err(|e| err(e.into()))?;
            let stats = table.stats().map_err(|e| err(e.into()))?;
            let g = groups.entry(kind.clone()).or_insert_with(|| TableGroup {
                kind,
                ..TableGroup::default()
            });
            g.tables += 1;
            g.entries += table.len().map_err(|e| err(e.into()))?;
            g.stored_bytes += stats.stored_bytes();
            g.metadata_bytes += stats.metadata_bytes();
            g.fragmented_bytes += stats.fragmented_bytes();
        }
    }
    let mut groups: Vec<TableGroup> = groups.into_values().collect();
    groups.sort_by_key(|g| std::cmp::Reverse(g.page_bytes()));
    let pages: u64 = groups.iter().map(TableGroup::page_bytes).sum();
    Ok(DiskUsage {
        groups,
        file_bytes,
        other_bytes: file_bytes.saturating_sub(pages),
    })
}
