//! What opening a ledger reports while it works
//! ([`Ledger::open_observed`](crate::ledger::Ledger::open_observed)): each shard's file
//! open, redb's repair of a file not closed cleanly, the sealed generations it loads and
//! the logs of unsealed claims it replays. `dedupd inspect --repair` shows it.
//!
//! Shards open in parallel, each on its own writer thread, so the observer is called from
//! those threads as the steps happen; it should only record or print, never block long.

use std::sync::Arc;

/// One step of a shard's open.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum OpenProgress {
    /// Shard `shard` (of `of`) starts opening its file.
    Opening { shard: usize, of: usize },
    /// redb repairs the shard's file, which was not closed cleanly (a killed engine):
    /// `fraction` (0.0 to 1.0) of its scans of the file are done. Reported at the start
    /// of the repair and after each scan.
    Repairing { shard: usize, fraction: f64 },
    /// The sealed generations of a subscriber's claims are loaded (each generation's
    /// filter read, or rebuilt from its table if damaged).
    Loaded {
        shard: usize,
        subscriber: String,
        generations: usize,
    },
    /// The log of a subscriber's unsealed claims is being replayed into memory: `rows`
    /// rows read so far. Reported every `REPLAY_EVERY` rows and when the log ends.
    Replaying {
        shard: usize,
        subscriber: String,
        rows: u64,
    },
    /// The shard is open: repaired, loaded, leftovers removed, committed.
    Opened { shard: usize },
}

/// How many log rows a shard replays between two [`OpenProgress::Replaying`] reports.
pub(crate) const REPLAY_EVERY: u64 = 8192;

/// Called with each step of a ledger's open, from the shards' threads.
pub type OpenObserver = Arc<dyn Fn(OpenProgress) + Send + Sync>;
