//! What the ledger reports about itself: per-subscriber counts for `inspect` and the admin
//! API ([`LedgerReport`], summed over shards), and each shard's commit measurements
//! ([`ShardMetrics`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::format::datadir::dir_bytes;
use super::shard::Control;
use super::{DiskUsage, Ledger, LedgerError, FORMAT_VERSION};

/// What `inspect` shows of one subscriber.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SubscriberReport {
    pub subscriber: String,
    /// Claims stored (including expired ones not yet dropped).
    pub claims: u64,
    pub active_claims: u64,
    pub sealed_generations: u64,
    /// Messages quarantined (outcomes counted, repeats included).
    pub quarantined: u64,
    /// Quarantine records stored (one per message id and payload, within retention and cap).
    #[serde(default)]
    pub quarantine_records: u64,
    /// Messages dead-lettered (outcomes counted, repeats included).
    pub dead_lettered: u64,
    /// Dead-letter records stored.
    #[serde(default)]
    pub dead_letter_records: u64,
    pub filter_bytes: u64,
    pub index_bytes: u64,
    /// Handler state: sorted runs (all shards).
    #[serde(default)]
    pub state_runs: u64,
    /// Entries in those runs (overwritten keys and tombstones count until merged away).
    #[serde(default)]
    pub state_run_entries: u64,
    /// Handler state entries buffered, not yet written as a run.
    #[serde(default)]
    pub state_buffered: u64,
    /// Runs replaced by a merge and still being emptied.
    #[serde(default)]
    pub(crate) state_retired_runs: u64,
}

/// Each subscriber's rows of every shard summed into one, by name.
pub(crate) fn summed(rows: impl IntoIterator<Item = SubscriberReport>) -> Vec<SubscriberReport> {
    let mut by_name: std::collections::BTreeMap<String, SubscriberReport> = Default::default();
    for r in rows {
        by_name
            .entry(r.subscriber.clone())
            .or_insert_with(|| SubscriberReport {
                subscriber: r.subscriber.clone(),
                ..Default::default()
            })
            .add(&r);
    }
    by_name.into_values().collect()
}

impl SubscriberReport {
    /// Adds another shard's counts of the same subscriber.
    fn add(&mut self, r: &SubscriberReport) {
        self.claims += r.claims;
        self.active_claims += r.active_claims;
        self.sealed_generations += r.sealed_generations;
        self.quarantined += r.quarantined;
        self.quarantine_records += r.quarantine_records;
        self.dead_lettered += r.dead_lettered;
        self.dead_letter_records += r.dead_letter_records;
        self.filter_bytes += r.filter_bytes;
        self.index_bytes += r.index_bytes;
        self.state_runs += r.state_runs;
        self.state_run_entries += r.state_run_entries;
        self.state_buffered += r.state_buffered;
        self.state_retired_runs += r.state_retired_runs;
    }
}

/// What `inspect` shows of the whole data directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LedgerReport {
    pub(crate) data_dir: PathBuf,
    pub(crate) format_version: u64,
    pub(crate) shards: usize,
    pub(crate) file_bytes: u64,
    pub subscribers: Vec<SubscriberReport>,
    /// Where the bytes go, per kind of table: only from `dedupd inspect`, which reads it
    /// from the closed files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) disk: Option<DiskUsage>,
    /// Read from the closed files without opening the engine (`dedupd inspect`): the
    /// in-memory index sizes are not known (`index_bytes` 0).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offline: bool,
}

/// Commit-level measurements of one shard.
#[derive(Debug, Clone, Default)]
pub struct ShardMetrics {
    pub(crate) batches: u64,
    pub(crate) messages: u64,
    pub(crate) commits: u64,
    /// Longest batch (decide + maintenance + commit) with and without sealing/merging work.
    pub(crate) max_batch_us_maintenance: u64,
    pub(crate) max_batch_us_plain: u64,
    /// Longest durable commit (the fsync part of a batch).
    pub(crate) max_commit_us: u64,
    pub seals: u64,
    pub merges: u64,
    pub dropped_generations: u64,
    /// Keys asked of the other shards (a probe round trip, `placement.rs`), and keys that
    /// needed none because every other shard's presence ruled them out (`presence.rs`).
    pub probed_keys: u64,
    pub unprobed_keys: u64,
    /// Emptied full-size indexes kept for the next active generation (at most one).
    pub spare_index_bytes: u64,
}

impl Ledger {
    /// Per-subscriber counts summed over shards.
    pub fn report(&self) -> Result<LedgerReport, LedgerError> {
        let rows = self.ask_all(|reply| Control::Report { reply })?;
        Ok(LedgerReport {
            data_dir: self.data_dir.clone(),
            format_version: FORMAT_VERSION,
            shards: self.shards.len(),
            file_bytes: dir_bytes(&self.data_dir),
            disk: None,
            offline: false,
            subscribers: summed(rows.into_iter().flatten()),
        })
    }

    /// Snapshot of each shard's commit metrics.
    pub fn metrics(&self) -> Vec<ShardMetrics> {
        self.metrics
            .iter()
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .collect()
    }
}
