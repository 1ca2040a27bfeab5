//! Generations of claims and the background builder that sorts them and builds filters.
//!
//! Lifecycle of one generation of one subscriber in one shard:
//!
//! ```text
//! Active  --full or old-->  Sealing  --all slices written-->  Sealed  --expired--> dropped
//!   (map + log table)        (map kept for lookups;             (sorted table      (table
//!                              sorted slices appended            + filter)          deleted)
//!                              to a fresh table per batch)            \--small--> merged
//! ```
//!
//! Sorting and filter construction run on the builder thread so the writer never stalls
//! on them; the writer only appends bounded slices inside its normal batch transactions.
//! What survives a crash at any point: the log stays until the sealed table and filter are
//! committed in the same transaction that deletes it, so a restart replays the log and
//! seals again; a half-written sealed or merged table has no `Sealed` row and is deleted.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crossbeam_channel::{unbounded, Sender};

use crate::ledger::claims::block::BlockWriter;
use crate::ledger::claims::filter::{FilterBuilder, GenFilter};
use crate::ledger::claims::record::ClaimRecord;
use crate::ledger::SubscriberId;

/// Keys are already xxh3-128 hashes: folding them is a perfect hash for the index.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut x = [0u8; 8];
            x[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(x);
        }
    }

    #[inline]
    fn write_u128(&mut self, i: u128) {
        self.0 = (i as u64) ^ ((i >> 64) as u64);
    }
}

pub(crate) type KeyMap = HashMap<u128, ClaimRecord, BuildHasherDefault<KeyHasher>>;

/// Heap bytes of a key map: its bucket array (a power of two at most 7/8 full, so
/// `capacity()` is 7/8 of it) with one control byte per bucket.
pub(crate) fn map_bytes(map: &KeyMap) -> usize {
    let cap = map.capacity();
    let buckets = if cap == 0 {
        0
    } else if cap < 8 {
        (cap + 1).next_power_of_two()
    } else {
        (cap * 8).div_ceil(7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<(u128, ClaimRecord)>() + 1)
}

/// The generation receiving new claims.
pub(crate) struct ActiveGen {
    pub(crate) table_id: u64,
    pub(crate) order: u64,
    pub(crate) map: KeyMap,
    pub(crate) next_row: u64,
    pub(crate) created_at_ms: u64,
}

/// A full generation being written into its sorted table.
pub(crate) struct SealingGen {
    pub(crate) table_id: u64,
    pub(crate) order: u64,
    pub(crate) created_at_ms: u64,
    /// Exact lookups until the sealed table and filter are committed.
    pub(crate) map: Arc<KeyMap>,
    /// Sorted live entries and filter, once the builder returns them.
    pub(crate) built: Option<(Vec<(u128, ClaimRecord)>, GenFilter)>,
    /// Entries of `built` already written.
    pub(crate) pos: usize,
    /// Older log generations folded into this one at recovery; deleted with its log.
    pub(crate) extra_logs: Vec<u64>,
}

/// A sealed generation: sorted table on disk, filter in memory.
pub(crate) struct SealedGen {
    pub(crate) table_id: u64,
    pub(crate) order: u64,
    pub(crate) count: u64,
    pub(crate) max_expires_ms: u64,
    pub(crate) created_at_ms: u64,
    /// Shared with this shard's published presence (`presence.rs`).
    pub(crate) filter: Arc<GenFilter>,
}

/// Merging two adjacent sealed generations into a fresh table, a slice per batch.
pub(crate) struct MergeJob {
    pub(crate) older: u64,
    pub(crate) newer: u64,
    pub(crate) out_table: u64,
    /// Last key consumed from each input; `None` before the first slice.
    pub(crate) cursor_older: Option<u128>,
    pub(crate) cursor_newer: Option<u128>,
    pub(crate) older_done: bool,
    pub(crate) newer_done: bool,
    /// The output's filter, built as its claims are written.
    pub(crate) filter_builder: Option<FilterBuilder>,
    /// Merged claims not yet written: the block being filled.
    pub(crate) writer: BlockWriter,
    pub(crate) count: u64,
    pub(crate) max_expires_ms: u64,
    /// The finished filter, once every claim is written: the next step records it, the
    /// one after finishes the merge.
    pub(crate) filter: Option<GenFilter>,
    /// Whether the finished filter's `filters_v1` row is written (in an earlier
    /// transaction than the finish; `recover` deletes it with an unfinished output).
    pub(crate) filter_recorded: bool,
}

/// Where a lookup found the newest record of a key.
pub(crate) enum Found {
    Active(ClaimRecord),
    Older(ClaimRecord),
    /// Not in memory: sealed generations (newest first) must be asked, by index.
    AskSealed,
}

/// Work for the builder thread.
pub(crate) enum BuildJob {
    /// Sort the live entries of a full generation and build its filter.
    Seal {
        sub: SubscriberId,
        table_id: u64,
        map: Arc<KeyMap>,
        now_ms: u64,
        reply: Sender<Built>,
    },
    /// Allocate an index and touch every page of it, off the hot path.
    PrepareMap {
        capacity: usize,
        reply: Sender<Built>,
    },
}

/// Results sent back to the shard that asked.
pub(crate) enum Built {
    Sealed {
        sub: SubscriberId,
        table_id: u64,
        entries: Vec<(u128, ClaimRecord)>,
        filter: GenFilter,
    },
    Map(KeyMap),
}

/// Handle to the background builder thread; it exits when the last handle is dropped.
#[derive(Clone)]
pub(crate) struct Builder {
    tx: Sender<BuildJob>,
}

impl Builder {
    pub(crate) fn spawn() -> Builder {
        let (tx, rx) = unbounded::<BuildJob>();
        let spawned = std::thread::Builder::new()
            .name("dedupd-builder".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        BuildJob::Seal {
                            sub,
                            table_id,
                            map,
                            now_ms,
                            reply,
                        } => {
                            let entries = sorted_live(&map, now_ms);
                            // Release the index before replying so the shard can recycle it.
                            drop(map);
                            let filter = GenFilter::build(entries.iter().map(|e| e.0));
                            let _ = reply.send(Built::Sealed {
                                sub,
                                table_id,
                                entries,
                                filter,
                            });
                        }
                        BuildJob::PrepareMap { capacity, reply } => {
                            let _ = reply.send(Built::Map(resident_map(capacity)));
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            // Without a builder thread sealing never completes; that is visible in inspect
            // (active claims keep growing) and logged here.
            tracing::error!("cannot start the generation builder thread: {e}");
        }
        Builder { tx }
    }

    pub(crate) fn send(&self, job: BuildJob) -> bool {
        self.tx.send(job).is_ok()
    }
}

/// An empty index whose memory is already faulted in: filled to capacity once, then
/// cleared (clearing keeps the allocation).
pub(crate) fn resident_map(capacity: usize) -> KeyMap {
    let mut map = KeyMap::with_capacity_and_hasher(capacity, Default::default());
    let filler = ClaimRecord {
        fingerprint: 0,
        processed_at_ms: 0,
        expires_at_ms: 0,
        handler_version: 0,
    };
    let mut k: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834;
    for _ in 0..capacity {
        k = k
            .wrapping_mul(0x2545_f491_4f6c_dd1d_9e37_79b9_7f4a_7c15)
            .wrapping_add(1);
        map.insert(k, filler);
    }
    map.clear();
    map
}

/// Entries of a map that must be kept (live claims and unexpired tombstones), sorted by key.
pub(crate) fn sorted_live(map: &KeyMap, now_ms: u64) -> Vec<(u128, ClaimRecord)> {
    let mut v: Vec<(u128, ClaimRecord)> = map
        .iter()
        .filter(|(_, r)| r.is_retained(now_ms))
        .map(|(k, r)| (*k, *r))
        .collect();
    v.sort_unstable_by_key(|e| e.0);
    v
}

/// Merges one slice of two sorted inputs. Returns the merged entries that are safe to
/// write now (every key up to the smaller of the two slices' last keys, unless an input
/// is exhausted), with the newer input winning ties and expired entries dropped, and the
/// number consumed from each input.
pub(crate) fn merge_slice(
    older: &[(u128, ClaimRecord)],
    older_exhausted: bool,
    newer: &[(u128, ClaimRecord)],
    newer_exhausted: bool,
    now_ms: u64,
) -> (Vec<(u128, ClaimRecord)>, usize, usize) {
    // Keys beyond the last key read from an unfinished input may still have a smaller
    // partner in that input's next slice, so they wait.
    let mut limit = Some(u128::MAX);
    for (side, exhausted) in [(older, older_exhausted), (newer, newer_exhausted)] {
        if !exhausted {
            limit = match (limit, side.last()) {
                (Some(l), Some(e)) => Some(l.min(e.0)),
                _ => None,
            };
        }
    }
    let Some(limit) = limit else {
        return (Vec::new(), 0, 0);
    };
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::with_capacity(older.len() + newer.len());
    loop {
        let a = older.get(i).filter(|e| e.0 <= limit);
        let b = newer.get(j).filter(|e| e.0 <= limit);
        let pick = match (a, b) {
            (None, None) => break,
            (Some(x), None) => {
                i += 1;
                *x
            }
            (None, Some(y)) => {
                j += 1;
                *y
            }
            (Some(x), Some(y)) => {
                if x.0 < y.0 {
                    i += 1;
                    *x
                } else if y.0 < x.0 {
                    j += 1;
                    *y
                } else {
                    i += 1;
                    j += 1;
                    *y
                }
            }
        };
        if pick.1.is_retained(now_ms) {
            out.push(pick);
        }
    }
    (out, i, j)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(fp: u64, exp: u64) -> ClaimRecord {
        ClaimRecord {
            fingerprint: fp,
            processed_at_ms: 0,
            expires_at_ms: exp,
            handler_version: 0,
        }
    }

    #[test]
    fn merge_prefers_newer_and_drops_expired() {
        let older = vec![(1, rec(1, 100)), (3, rec(1, 100)), (5, rec(1, 5))];
        let newer = vec![(3, rec(2, 100)), (4, rec(2, 100))];
        let (out, i, j) = merge_slice(&older, true, &newer, true, 10);
        assert_eq!(
            out,
            vec![(1, rec(1, 100)), (3, rec(2, 100)), (4, rec(2, 100))]
        );
        assert_eq!((i, j), (3, 2));
    }

    #[test]
    fn merge_stops_at_the_smaller_frontier() {
        let older = vec![(1, rec(1, 100)), (9, rec(1, 100))];
        let newer = vec![(2, rec(2, 100)), (4, rec(2, 100))];
        let (out, i, j) = merge_slice(&older, false, &newer, false, 0);
        assert_eq!(out.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 2, 4]);
        assert_eq!((i, j), (1, 2));
        // An empty, unfinished input blocks progress until it is read further.
        let (out, i, j) = merge_slice(&older, false, &[], false, 0);
        assert!(out.is_empty());
        assert_eq!((i, j), (0, 0));
    }

    #[test]
    fn sorted_live_sorts_and_filters() {
        let mut m = KeyMap::default();
        m.insert(5, rec(1, 100));
        m.insert(2, rec(1, 100));
        m.insert(7, rec(1, 1));
        let v = sorted_live(&m, 50);
        assert_eq!(v.iter().map(|e| e.0).collect::<Vec<_>>(), vec![2, 5]);
    }
}
