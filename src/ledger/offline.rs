//! `dedupd inspect` without writing: the per-subscriber report read from the shard files
//! through redb read-only handles, so the files (bytes and times) are left as they were.
//!
//! The engine's own report ([`Ledger::report`](super::Ledger::report)) comes from its
//! in-memory state after the shards have opened, and opening a shard writes (format
//! check, recovery of interrupted seals and merges, upgrades). Here the same counts are
//! read from the tables the engine rebuilds that state from: generation metadata and the
//! logs of unsealed generations (claims), the record tables and outcome counters
//! (quarantine, dead letters), stored filters, and the state runs and state log. What
//! only exists in memory — the size of the active generations' indexes — is not
//! reported (`index_bytes` is 0 and `offline` is set).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use redb::{ReadOnlyDatabase, ReadTransaction, ReadableDatabase, ReadableTable, TableHandle};

use super::claims::filter::GenFilter;
use super::claims::record::{GenMeta, GenState, LogRow};
use super::format::datadir::{dir_bytes, read_manifest, shard_path};
use super::format::tables::{self, missing_is_none};
use super::report::summed;
use super::shard::storage;
use super::state::StateBuffer;
use super::{records, LedgerError, LedgerReport, SubscriberReport, FORMAT_VERSION};

/// Oldest format read here: state runs came with format 3. Older directories are upgraded
/// by the engine when it opens them, which writes.
const OLDEST_READABLE: u64 = 3;

/// Read-only handles on every shard file of a data directory. While they are held, no
/// engine can open the directory (redb's file lock), so the files can be copied as they
/// are: closed cleanly, and unchanging.
pub struct ClosedShards {
    /// The shard files, in shard order.
    pub(crate) paths: Vec<PathBuf>,
    _handles: Vec<ReadOnlyDatabase>,
}

/// Opens every shard of `dir` read-only and keeps it open (see [`ClosedShards`]). A shard
/// held by a running engine is [`LedgerError::InUse`]; one not closed cleanly is
/// [`LedgerError::NeedsRepair`]; a directory of a newer format is refused.
pub fn hold_closed_shards(dir: &Path) -> Result<ClosedShards, LedgerError> {
    let (format, shards) = read_manifest(dir)?;
    if format > FORMAT_VERSION {
        return Err(LedgerError::NewerFormat {
            path: dir.to_path_buf(),
            found: format,
            supported: FORMAT_VERSION,
        });
    }
    let mut held = ClosedShards {
        paths: Vec::with_capacity(shards),
        _handles: Vec::with_capacity(shards),
    };
    for index in 0..shards {
        let path = shard_path(dir, index);
        held._handles.push(open_read_only(&path)?);
        held.paths.push(path);
    }
    Ok(held)
}

/// Closes a copy of a shard file taken while its engine had it open (between two
/// commits): the copy carries redb's "open, repair on next open" mark, which a read-only
/// open refuses. Opening it for writing once and closing it checks the last commit,
/// rebuilds the free-page state from it and clears the mark; no table is changed. Run it
/// on the copy only, never on a file an engine uses.
pub fn close_copied_shard(path: &Path) -> Result<(), LedgerError> {
    let db = redb::Database::create(path).map_err(|e| storage(path, e))?;
    drop(db);
    Ok(())
}

fn open_read_only(path: &Path) -> Result<ReadOnlyDatabase, LedgerError> {
    ReadOnlyDatabase::open(path).map_err(|e| match redb::Error::from(e) {
        redb::Error::RepairAborted => LedgerError::NeedsRepair {
            path: path.to_path_buf(),
            detail: "it was not closed cleanly (the engine was killed, or crashed)".into(),
        },
        e => storage(path, e),
    })
}

/// Reads the report of an existing data directory, opening every shard file read-only.
/// A shard held by a running engine is [`LedgerError::InUse`]; one not closed cleanly, or
/// of a format older than state runs, is [`LedgerError::NeedsRepair`].
pub fn offline_report(dir: &Path) -> Result<LedgerReport, LedgerError> {
    let (format, shards) = read_manifest(dir)?;
    if format > FORMAT_VERSION {
        return Err(LedgerError::NewerFormat {
            path: dir.to_path_buf(),
            found: format,
            supported: FORMAT_VERSION,
        });
    }
    if format < OLDEST_READABLE {
        return Err(LedgerError::NeedsRepair {
            path: dir.to_path_buf(),
            detail: format!(
                "it is in format {format}, which `dedupd run` upgrades to {FORMAT_VERSION} when it opens it"
            ),
        });
    }
    let mut rows = Vec::new();
    for index in 0..shards {
        let path = shard_path(dir, index);
        let db = open_read_only(&path)?;
        let txn = db.begin_read().map_err(|e| storage(&path, e))?;
        rows.extend(shard_report(&txn).map_err(|e| storage(&path, e))?);
    }
    Ok(LedgerReport {
        data_dir: dir.to_path_buf(),
        format_version: format,
        shards,
        file_bytes: dir_bytes(dir),
        subscribers: summed(rows),
        disk: None,
        offline: true,
    })
}

/// The subscribers of one shard, as the engine would report them after opening it.
fn shard_report(txn: &ReadTransaction) -> Result<Vec<SubscriberReport>, redb::Error> {
    let mut gens: BTreeMap<String, Vec<(u64, GenMeta)>> = BTreeMap::new();
    if let Some(t) = missing_is_none(txn.open_table(tables::GENERATIONS))? {
        for row in t.iter()? {
            let (k, v) = row?;
            let (sub, id) = k.value();
            let m = GenMeta::decode(v.value())
                .map_err(|d| redb::Error::Corrupted(format!("generation {sub}/{id}: {d}")))?;
            gens.entry(sub.to_string()).or_default().push((id, m));
        }
    }
    // A subscriber the engine loads has a generation; one with only handler state or
    // records left (its claims all expired and dropped) is reported too.
    let mut names: HashSet<String> = gens.keys().cloned().collect();
    for table in txn.list_tables()? {
        if let Some(sub) = tables::state_run_subscriber(table.name()) {
            names.insert(sub.to_string());
        }
    }
    for kind in [tables::QUARANTINE, tables::DEAD_LETTERS] {
        if let Some(t) = missing_is_none(txn.open_table(kind))? {
            for row in t.iter()? {
                names.insert(row?.0.value().0.to_string());
            }
        }
    }
    let filters = missing_is_none(txn.open_table(tables::FILTERS))?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let mut r = SubscriberReport {
            subscriber: name.clone(),
            ..Default::default()
        };
        let mut gens = gens.remove(&name).unwrap_or_default();
        gens.sort_by_key(|(_, m)| m.order);
        let mut logs = Vec::new();
        for (id, m) in gens {
            match m.state {
                GenState::Sealed => {
                    r.sealed_generations += 1;
                    r.claims += m.count;
                    // Decoded, to count what the engine holds in memory for it.
                    if let Some(row) = filters.as_ref().map(|f| f.get((name.as_str(), id))) {
                        if let Some(v) = row? {
                            let f = GenFilter::decode(v.value()).map_err(|d| {
                                redb::Error::Corrupted(format!("filter of {name}/{id}: {d}"))
                            })?;
                            r.filter_bytes += f.memory_bytes() as u64;
                        }
                    }
                }
                GenState::Active | GenState::Sealing => logs.push(id),
            }
        }
        // The newest unsealed generation is the active one; older ones are sealed again
        // as one when the engine opens the shard. Each counts the distinct keys of its log.
        if let Some(active) = logs.pop() {
            r.active_claims = log_claims(txn, &name, &[active])?;
            r.claims += r.active_claims + log_claims(txn, &name, &logs)?;
        }
        let loaded = records::load_from(txn, &name)?;
        r.quarantined = loaded.quarantined;
        r.quarantine_records = loaded.records.quarantine.stored;
        r.dead_lettered = loaded.dead_lettered;
        r.dead_letter_records = loaded.records.dead_letter.stored;
        let state = StateBuffer::load_from(txn, &name)?;
        let stats = state.stats();
        r.state_runs = stats.runs;
        r.state_run_entries = stats.run_entries;
        r.state_buffered = stats.buffered;
        r.state_retired_runs = stats.retired_runs;
        r.filter_bytes += state.filter_bytes();
        out.push(r);
    }
    Ok(out)
}

/// Distinct claim keys in the logs of generations `ids` (a key logged twice counts once,
/// as when the engine replays them).
fn log_claims(txn: &ReadTransaction, sub: &str, ids: &[u64]) -> Result<u64, redb::Error> {
    let mut keys = HashSet::new();
    for id in ids {
        let name = tables::log_name(sub, *id);
        let Some(t) = missing_is_none(txn.open_table(tables::log_def(&name)))? else {
            continue;
        };
        for row in t.iter()? {
            let (_, v) = row?;
            let claims = LogRow::decode(v.value())
                .map_err(|d| redb::Error::Corrupted(format!("{name}: {d}")))?;
            keys.extend(claims.into_iter().map(|(k, _)| k));
        }
    }
    Ok(keys.len() as u64)
}
