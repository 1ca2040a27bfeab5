//! `SubState`: everything a shard knows about one subscriber, one part per product — its
//! claim generations ([`SubClaims`], `claims/`), quarantine and dead-letter records
//! ([`SubRecords`], `records/`), handler, retries, breaker and state buffer
//! ([`SubHandling`], `state/`), placement bits, key source and published presence
//! ([`SubPlacement`], `placement/`) and changelog sink ([`SubChangelog`], `changelog.rs`)
//! — and the few questions asked of several of them together (sizes).

use std::sync::Arc;

use crate::ledger::changelog::SubChangelog;
use crate::ledger::claims::SubClaims;
use crate::ledger::placement::SubPlacement;
use crate::ledger::records::SubRecords;
use crate::ledger::state::SubHandling;
use crate::ledger::SubscriberId;

/// Everything a shard knows about one subscriber.
pub(crate) struct SubState {
    pub(crate) id: SubscriberId,
    pub(crate) name: Arc<str>,
    /// The subscriber's settings epoch these values were taken from.
    pub(crate) settings_epoch: u64,
    pub(crate) claims: SubClaims,
    pub(crate) records: SubRecords,
    pub(crate) handling: SubHandling,
    pub(crate) placement: SubPlacement,
    pub(crate) changelog: SubChangelog,
}

impl SubState {
    /// Filters of sealed generations, of a merge in progress, of handler state runs and
    /// of the published presence.
    pub(crate) fn filter_bytes(&self) -> u64 {
        self.claims.filter_bytes()
            + self.handling.state_buf.filter_bytes()
            + self
                .placement
                .presence
                .as_ref()
                .map_or(0, |p| p.memory_bytes() as u64)
    }
}
