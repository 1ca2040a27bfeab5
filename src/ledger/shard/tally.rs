//! What a batch did so far, counted per subscriber and added to its counters once the
//! batch committed.

use super::*;
use crate::ledger::SubscriberCounters;

/// One subscriber's outcomes in one batch, added to its counters once the batch
/// committed (`SubscriberCounters` has the meaning of each).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct BatchCounts {
    pub(super) processed: u64,
    pub(super) duplicates: u64,
    pub(super) quarantined: u64,
    pub(super) filter_probes: u64,
    pub(super) filter_false_positives: u64,
    pub(super) sliding_refreshes: u64,
    pub(super) dead_lettered: u64,
    pub(super) retries: u64,
    pub(super) calls_skipped: u64,
    pub(super) calls_deferred: u64,
    pub(super) circuits_opened: u64,
}

impl BatchCounts {
    pub(super) fn publish(&self, k: &SubscriberCounters) {
        k.processed.fetch_add(self.processed, Ordering::Relaxed);
        k.duplicates.fetch_add(self.duplicates, Ordering::Relaxed);
        k.quarantined.fetch_add(self.quarantined, Ordering::Relaxed);
        k.filter_probes
            .fetch_add(self.filter_probes, Ordering::Relaxed);
        k.filter_false_positives
            .fetch_add(self.filter_false_positives, Ordering::Relaxed);
        k.sliding_refreshes
            .fetch_add(self.sliding_refreshes, Ordering::Relaxed);
        k.dead_lettered
            .fetch_add(self.dead_lettered, Ordering::Relaxed);
        k.retries.fetch_add(self.retries, Ordering::Relaxed);
        k.handler_calls_skipped
            .fetch_add(self.calls_skipped, Ordering::Relaxed);
        k.handler_calls_deferred
            .fetch_add(self.calls_deferred, Ordering::Relaxed);
        k.handler_circuits_opened
            .fetch_add(self.circuits_opened, Ordering::Relaxed);
    }
}

/// What a batch did so far: counts per subscriber (by id) and whether it has anything
/// to write.
#[derive(Default)]
pub(super) struct Tally {
    counts: Vec<BatchCounts>,
    pub(super) wrote: bool,
}

impl Tally {
    pub(super) fn of(&mut self, idx: usize) -> &mut BatchCounts {
        if self.counts.len() <= idx {
            self.counts.resize(idx + 1, BatchCounts::default());
        }
        &mut self.counts[idx]
    }

    pub(super) fn publish(&self, registry: &Registry) {
        for (id, c) in self.counts.iter().enumerate() {
            if *c == BatchCounts::default() {
                continue;
            }
            if let Some(spec) = registry.get(SubscriberId(id as u32)) {
                c.publish(&spec.counters);
            }
        }
    }
}
