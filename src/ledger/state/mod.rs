//! Handler state in redb: the writes that commit with the claims, the buffers they go
//! through, the sorted runs they end in, and the view a handler reads during a batch.
//!
//! A handler reads the subscriber's state in layers, newest first: its own writes (the host,
//! read-your-writes), the shard's *buffered* effects (earlier batches' and this batch's
//! earlier successful messages'), and the sorted runs as of the batch's start (a read
//! transaction), newest first.
//!
//! Writes are buffered like claims are: each successful call's effects go into an
//! in-memory buffer at once and into the batch's row of a per-subscriber log
//! (`statelog_v1/<sub>`, one sequential write) that commits with its claims. When the buffer holds `ledger.state_buffer_entries` entries it is
//! frozen and written as a new sorted run (an immutable table of prefix-compressed blocks
//! with a Bloom filter, `run.rs`), a slice per batch; the transaction of the last slice
//! registers the run and deletes the log rows it covered. Runs merge by size tiers in
//! bounded slices (`runs.rs`), so no batch ever rewrites older state: with random keys a
//! big B-tree dirtied one leaf per key per commit, while a run is written once, in order.
//! A crash leaves the log: the buffer is rebuilt from it when the subscriber is next used
//! on the shard (replaying rows in order is idempotent, later rows win). Everything
//! commits with the claims or not at all (G2, G6).
//!
//! - `buffer.rs`: the per-subscriber buffer of committed effects, its log rows, and writing
//!   a frozen buffer as a run;
//! - `state_map.rs`: a buffer's state entries, hashed until a handler scans them;
//! - `log_row.rs`: the encoding of one batch's effects as a log row, written call by call;
//! - `run.rs`: the block format of one run, its writer, lookups and scans;
//! - `runs.rs`: the run list, its metadata and filters, and the merge policy;
//! - `cover.rs`: filters over the keys of many runs, so a key no run holds costs one probe;
//! - `view.rs`: the layered read view a handler gets during a batch ([`BatchView`]);
//! - `blocks.rs`, `upgrade.rs`: the earlier layouts, read once to rewrite them as runs.
//!
//! Table names are in `tables.rs`.

mod blocks;
mod buffer;
mod cover;
#[cfg(test)]
mod fuzz;
mod log_row;
mod run;
mod runs;
mod state_map;
mod upgrade;
mod view;

use std::sync::Arc;

use redb::Database;

use crate::effects::{HandlerFactory, MessageHandler, StateEntry};
pub(crate) use buffer::StateBuffer;
pub(crate) use upgrade::upgrade_old_tables;
pub(crate) use view::BatchView;
use view::RunTables;

/// A subscriber's handler on one shard: the instance, its retry policy and circuit
/// breaker (`shard/breaker.rs`), the current batch's view and the state buffer.
pub(crate) struct SubHandling {
    pub(crate) max_attempts: u32,
    pub(crate) retry_backoff: std::time::Duration,
    pub(crate) max_backoff: std::time::Duration,
    /// `handler_breaker_failures` and `_cooldown` in ms (see `shard/breaker.rs`).
    pub(crate) breaker_threshold: u32,
    pub(crate) breaker_cooldown_ms: u64,
    /// The handler's circuit breaker on this shard; a new handler starts closed.
    pub(crate) breaker: crate::ledger::shard::breaker::Breaker,
    /// The handler instance of this shard, if the subscriber has one.
    pub(crate) handler: Option<ShardHandler>,
    /// What handlers read during the current batch (opened on first use); it collects
    /// the effects of the batch's successful messages, written at commit.
    pub(crate) view: Option<Box<dyn crate::effects::StateReader>>,
    /// Handler effects committed (in the state log) but not yet in the sorted tables.
    pub(crate) state_buf: StateBuffer,
}

impl SubHandling {
    /// No handler yet; `state_buf` as loaded.
    pub(crate) fn new(state_buf: StateBuffer) -> SubHandling {
        SubHandling {
            max_attempts: 1,
            retry_backoff: std::time::Duration::ZERO,
            max_backoff: std::time::Duration::ZERO,
            breaker_threshold: 0,
            breaker_cooldown_ms: 0,
            breaker: Default::default(),
            handler: None,
            view: None,
            state_buf,
        }
    }
}

/// A subscriber's handler as instantiated on one shard.
pub(crate) struct ShardHandler {
    pub(crate) factory: Arc<dyn HandlerFactory>,
    pub(crate) instance: Box<dyn MessageHandler>,
}

/// All state entries of a subscriber in one shard file, in key order. The buffer must be
/// flushed (everything in runs).
pub(crate) fn state_entries(
    db: &Database,
    sub: &str,
    buffer: &StateBuffer,
) -> Result<Vec<StateEntry>, redb::Error> {
    debug_assert!(buffer.is_empty());
    let mut out = Vec::new();
    RunTables::open(db, sub, buffer)?.for_each_from(b"", |k, v| {
        out.push((k.to_vec(), v.to_vec()));
        true
    })?;
    Ok(out)
}

/// Number of state entries of a subscriber in one shard file (the buffer flushed).
pub(crate) fn state_len(
    db: &Database,
    sub: &str,
    buffer: &StateBuffer,
) -> Result<u64, redb::Error> {
    debug_assert!(buffer.is_empty());
    let mut n = 0u64;
    RunTables::open(db, sub, buffer)?.for_each_from(b"", |_, _| {
        n += 1;
        true
    })?;
    Ok(n)
}

#[cfg(test)]
mod testing {
    use redb::{Database, WriteTransaction};

    use crate::effects::Effects;

    pub(super) fn put(e: &mut Effects, k: &str, v: Option<&str>) {
        e.state
            .insert(k.as_bytes().to_vec(), v.map(|v| v.as_bytes().to_vec()));
    }

    pub(super) fn commit(db: &Database, f: impl FnOnce(&WriteTransaction)) {
        let txn = db.begin_write().unwrap();
        f(&txn);
        txn.commit().unwrap();
    }
}
