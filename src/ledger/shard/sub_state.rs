//! `SubState`: everything a shard knows about one subscriber — its claim generations
//! (`claims/`), quarantine and dead-letter records (`records/`), handler, breaker and
//! state buffer (`state/`), placement bits, changelog sink and published presence — and
//! the few questions asked of all of them together (memory lookups, sizes).

use std::sync::Arc;

use crate::ledger::claims::filter::GenFilter;
use crate::ledger::claims::generation::{
    map_bytes, ActiveGen, Found, MergeJob, SealedGen, SealingGen,
};
use crate::ledger::SubscriberId;

/// Everything a shard knows about one subscriber.
pub(crate) struct SubState {
    pub id: SubscriberId,
    pub name: Arc<str>,
    pub ttl_ms: u64,
    pub sliding: bool,
    pub active: Option<ActiveGen>,
    pub sealing: Option<SealingGen>,
    /// Ascending by `order`.
    pub sealed: Vec<SealedGen>,
    pub merging: Option<MergeJob>,
    pub next_order: u64,
    /// Claims of the current batch, as a log row being built.
    pub pending_log: Vec<u8>,
    /// Outcomes counted (persisted with the records, see `records/`).
    pub quarantined: u64,
    pub dead_lettered: u64,
    /// Quarantine and dead-letter records stored on this shard.
    pub records: crate::ledger::records::SubRecords,
    pub max_attempts: u32,
    pub retry_backoff: std::time::Duration,
    pub max_backoff: std::time::Duration,
    /// `handler_breaker_failures` and `_cooldown` in ms (see `shard/breaker.rs`).
    pub breaker_threshold: u32,
    pub breaker_cooldown_ms: u64,
    /// The handler's circuit breaker on this shard; a new handler starts closed.
    pub breaker: crate::ledger::shard::breaker::Breaker,
    /// The subscriber's settings epoch these values were taken from.
    pub settings_epoch: u64,
    /// The handler instance of this shard, if the subscriber has one.
    pub handler: Option<crate::ledger::state::ShardHandler>,
    /// What handlers read during the current batch (opened on first use); it collects
    /// the effects of the batch's successful messages, written at commit.
    pub view: Option<Box<dyn crate::effects::StateReader>>,
    /// Handler effects committed (in the state log) but not yet in the sorted tables.
    pub state_buf: crate::ledger::state::StateBuffer,
    /// Whether this batch asks the other shards before deciding "new" (`placement.rs`).
    pub probe: bool,
    /// Placement bits recorded for this subscriber in this shard's `placements_v1`.
    pub disk_mask: u8,
    /// Bits of claims written in the current batch, recorded with its commit.
    pub mask_pending: u8,
    /// The key source in force ([`crate::ledger::key_source_text`]), and the one this
    /// shard's `key_sources_v1` records for the subscriber's claims.
    pub key_source: Arc<str>,
    pub key_source_on_disk: Option<Arc<str>>,
    /// Where this batch's changes are published before it commits (`changelog.rs`).
    pub changelog: Option<std::sync::Arc<dyn crate::ledger::changelog::ChangelogSink>>,
    /// This batch's processed messages, for `changelog`.
    pub changes: Vec<crate::ledger::changelog::Change>,
    /// Quarantine and dead-letter records stored or removed by the current transaction,
    /// for `changelog` (`Some` exactly while it has one; `records/`).
    pub record_copies: Option<Vec<crate::ledger::changelog::RecordCopy>>,
    /// What this shard publishes of the subscriber's records for the other shards, while
    /// they probe for its claims (`presence.rs`).
    pub presence: Option<crate::ledger::placement::presence::PresenceWriter>,
}

impl SubState {
    /// Sets where the subscriber's changes and record copies are published (`None`: it
    /// has no changelog).
    pub fn set_changelog(
        &mut self,
        sink: Option<std::sync::Arc<dyn crate::ledger::changelog::ChangelogSink>>,
    ) {
        match (&sink, &self.record_copies) {
            (Some(_), None) => self.record_copies = Some(Vec::new()),
            (None, Some(_)) => self.record_copies = None,
            _ => {}
        }
        self.changelog = sink;
    }

    /// Memory lookups, newest generation first.
    #[inline]
    pub fn find_in_memory(&self, key: u128) -> Found {
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

    pub fn claims(&self) -> (u64, u64) {
        let active = self.active.as_ref().map_or(0, |a| a.map.len() as u64);
        let sealing = self.sealing.as_ref().map_or(0, |s| s.map.len() as u64);
        let sealed: u64 = self.sealed.iter().map(|g| g.count).sum();
        (active + sealing + sealed, active)
    }

    /// Filters of sealed generations and of handler state runs.
    pub fn filter_bytes(&self) -> u64 {
        self.sealed
            .iter()
            .map(|g| g.filter.memory_bytes() as u64)
            .sum::<u64>()
            + self.state_buf.filter_bytes()
            + self
                .merging
                .as_ref()
                .and_then(|m| m.filter_builder.as_ref())
                .map_or(0, |f| f.memory_bytes() as u64)
            + self
                .presence
                .as_ref()
                .map_or(0, |p| p.memory_bytes() as u64)
    }

    /// The sealed generations' filters, for the published presence.
    pub fn sealed_filters(sealed: &[SealedGen]) -> impl Iterator<Item = Arc<GenFilter>> + '_ {
        sealed.iter().map(|g| g.filter.clone())
    }

    pub fn index_bytes(&self) -> u64 {
        let a = self.active.as_ref().map_or(0, |a| map_bytes(&a.map));
        let s = self.sealing.as_ref().map_or(0, |s| {
            map_bytes(&s.map) + s.built.as_ref().map_or(0, |(v, _)| v.capacity() * 48)
        });
        (a + s) as u64
    }
}
