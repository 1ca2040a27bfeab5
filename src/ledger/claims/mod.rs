//! Claims: what a shard remembers of each `(subscriber, key)` it decided, by generation.
//!
//! - `record.rs`: the stored claim ([`record::ClaimRecord`]: expiry, fingerprint, outcome)
//!   and the format version;
//! - `generation.rs`: the active generation (exact in-memory index + append-only log
//!   table), sealing ones, sealed ones, and the builder thread that sorts and seals them
//!   (`SubClaims`, here, is a subscriber's claims on one shard, a part of
//!   `shard::SubState`);
//! - `block.rs`: the sorted blocks of a sealed generation and their lookup;
//! - `filter.rs`: the static filter of a sealed generation (and the halves other shards
//!   probe for presence).
//!
//! Sealing, merging and expiring generations run on the shard (`shard/maintain.rs`,
//! `shard/merge.rs`), which owns the transaction they write in.

pub(crate) mod block;
pub mod filter;
pub(crate) mod generation;
pub mod record;

use std::sync::Arc;

use filter::GenFilter;
use generation::{map_bytes, ActiveGen, Found, MergeJob, SealedGen, SealingGen};

/// A subscriber's claims on one shard: its generations, the merge in progress and the
/// current batch's log row.
pub(crate) struct SubClaims {
    pub(crate) ttl_ms: u64,
    pub(crate) sliding: bool,
    pub(crate) active: Option<ActiveGen>,
    pub(crate) sealing: Option<SealingGen>,
    /// Ascending by `order`.
    pub(crate) sealed: Vec<SealedGen>,
    pub(crate) merging: Option<MergeJob>,
    pub(crate) next_order: u64,
    /// Claims of the current batch, as a log row being built.
    pub(crate) pending_log: Vec<u8>,
}

impl SubClaims {
    /// No generation yet; `pending_log` is an empty log row.
    pub(crate) fn new(pending_log: Vec<u8>) -> SubClaims {
        SubClaims {
            ttl_ms: 0,
            sliding: false,
            active: None,
            sealing: None,
            sealed: Vec::new(),
            merging: None,
            next_order: 1,
            pending_log,
        }
    }

    /// Memory lookups, newest generation first.
    #[inline]
    pub(crate) fn find_in_memory(&self, key: u128) -> Found {
        if let Some(a) = &self.active {
            if let Some(r) = a.map.get(&key) {
                return Found::Active(*r);
            }
        }
        if let Some(s) = &self.sealing {
            if let Some(r) = s.map.get(&key) {
                return Found::Older(*r);
            }
        }
        Found::AskSealed
    }

    /// (claims stored, of them in the active generation).
    pub(crate) fn count(&self) -> (u64, u64) {
        let active = self.active.as_ref().map_or(0, |a| a.map.len() as u64);
        let sealing = self.sealing.as_ref().map_or(0, |s| s.map.len() as u64);
        let sealed: u64 = self.sealed.iter().map(|g| g.count).sum();
        (active + sealing + sealed, active)
    }

    /// Filters of sealed generations and of a merge in progress.
    pub(crate) fn filter_bytes(&self) -> u64 {
        self.sealed
            .iter()
            .map(|g| g.filter.memory_bytes() as u64)
            .sum::<u64>()
            + self
                .merging
                .as_ref()
                .and_then(|m| m.filter_builder.as_ref())
                .map_or(0, |f| f.memory_bytes() as u64)
    }

    /// The sealed generations' filters, for the published presence.
    pub(crate) fn sealed_filters(
        sealed: &[SealedGen],
    ) -> impl Iterator<Item = Arc<GenFilter>> + '_ {
        sealed.iter().map(|g| g.filter.clone())
    }

    pub(crate) fn index_bytes(&self) -> u64 {
        let a = self.active.as_ref().map_or(0, |a| map_bytes(&a.map));
        let s = self.sealing.as_ref().map_or(0, |s| {
            map_bytes(&s.map) + s.built.as_ref().map_or(0, |(v, _)| v.capacity() * 48)
        });
        (a + s) as u64
    }
}
