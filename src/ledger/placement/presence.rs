//! What each shard holds of a probing subscriber's claims, published for the other shards
//! to read without a probe round trip (invariant I6 in `docs/design.md`).
//!
//! Under entity placement a shard that finds no live claim of a key asks every other
//! shard for its newest record (a probe, `placement.rs`). The answer is almost always
//! "none", but it costs the asking message a round trip: the other shard answers between
//! its batches, and the job is decided in the asker's next batch. So each shard also
//! publishes a *presence* per probing subscriber: a summary that may say "maybe" for a
//! key the shard has no record of, and never says "no" for a key it has one of (G3). A
//! shard that holds `(subscriber, key)` in the [`crate::ledger::placement::InFlight`] set and
//! finds "no" in every other shard's presence decides without asking; a "maybe" (or a
//! shard that published none) still probes.
//!
//! Why "no" is safe. A presence covers every record its shard has written, committed or
//! not: the sealed generations' filters (the same ones the shard's own lookups trust),
//! and for the in-memory generations (active and sealing) Bloom filters that the shard
//! fills as it inserts each record, before the batch commits and before it gives the key
//! back to the in-flight set. A key that another shard is deciding right now is held in
//! that set, so the asker waits for it (`Busy`); once the asker holds the key, any record
//! of it is already in the owner's presence (the set's mutex orders the two). A snapshot
//! read while the owner seals, merges or drops generations is at worst a superset of
//! what the owner holds: filters leave a snapshot only after their replacement is in it,
//! and Bloom filters for new generations are published before their first insert.
//!
//! Memory grows with the claims: a generation's Bloom filters start at a few kilobytes
//! and each next one is four times larger, so a quiet subscriber costs little and a busy
//! one ~1.8 bytes per in-memory claim; only subscribers that probe publish one.

use std::sync::{Arc, RwLock};

use fastbloom::AtomicBloomFilter;

use crate::ledger::claims::filter::{half, GenFilter};
use crate::ledger::SubscriberId;

/// False-positive rate of each in-memory Bloom filter (a "maybe" costs one probe).
const BLOOM_FALSE_POSITIVES: f64 = 0.002;
/// Keys the first Bloom filter of a generation is sized for.
const FIRST_BLOOM_KEYS: usize = 4_096;
/// Each next Bloom filter of a generation is this many times larger.
const BLOOM_GROWTH: usize = 4;

/// One shard's published summary of one subscriber's records.
#[derive(Debug, Default)]
pub(crate) struct Presence {
    snap: RwLock<Arc<Snapshot>>,
}

#[derive(Debug, Default)]
struct Snapshot {
    blooms: Vec<Arc<AtomicBloomFilter>>,
    filters: Vec<Arc<GenFilter>>,
}

impl Presence {
    /// `false` means the shard certainly holds no record of `key`; `true` means ask it.
    pub(crate) fn may_contain(&self, key: u128) -> bool {
        let snap = self.snap.read().unwrap_or_else(|p| p.into_inner()).clone();
        let h = half(key);
        snap.blooms.iter().any(|b| b.contains_hash(h))
            || snap.filters.iter().any(|f| f.may_contain(key))
    }
}

/// Every shard's presences, by shard and subscriber id.
#[derive(Debug)]
pub(crate) struct Presences {
    shards: Vec<RwLock<Vec<Option<Arc<Presence>>>>>,
}

impl Presences {
    pub(crate) fn new(shards: usize) -> Presences {
        Presences {
            shards: (0..shards).map(|_| RwLock::new(Vec::new())).collect(),
        }
    }

    fn get(&self, shard: usize, sub: SubscriberId) -> Option<Arc<Presence>> {
        let slots = self
            .shards
            .get(shard)?
            .read()
            .unwrap_or_else(|p| p.into_inner());
        slots.get(sub.0 as usize).cloned().flatten()
    }

    fn set(&self, shard: usize, sub: SubscriberId, presence: Arc<Presence>) {
        let Some(slots) = self.shards.get(shard) else {
            return;
        };
        let mut slots = slots.write().unwrap_or_else(|p| p.into_inner());
        let i = sub.0 as usize;
        if slots.len() <= i {
            slots.resize(i + 1, None);
        }
        slots[i] = Some(presence);
    }

    /// Starts loading the slots of the other shards' sealed filters that
    /// [`Presences::others_lack`] will read for `key` (see [`GenFilter::prefetch`]); their
    /// Bloom filters are small and recent, and mostly cached.
    pub(crate) fn prefetch_others(&self, me: usize, sub: SubscriberId, key: u128) {
        for s in (0..self.shards.len()).filter(|&s| s != me) {
            if let Some(p) = self.get(s, sub) {
                let snap = p.snap.read().unwrap_or_else(|p| p.into_inner());
                for f in &snap.filters {
                    f.prefetch(key);
                }
            }
        }
    }

    /// Whether every shard but `me` certainly holds no record of `key` for `sub`. Only
    /// meaningful while `me` holds the key in the in-flight set (see the module docs).
    pub(crate) fn others_lack(&self, me: usize, sub: SubscriberId, key: u128) -> bool {
        (0..self.shards.len())
            .filter(|&s| s != me)
            .all(|s| self.get(s, sub).is_some_and(|p| !p.may_contain(key)))
    }
}

/// The Bloom filters of one in-memory generation: grown by adding a larger one when the
/// newest is full (a filter cannot be resized in place while others read it).
#[derive(Debug, Default)]
pub(crate) struct Chain {
    blooms: Vec<Arc<AtomicBloomFilter>>,
    /// Keys the newest filter still has room for.
    room: usize,
}

/// The publishing side, kept in the shard's state of the subscriber.
#[derive(Debug)]
pub(crate) struct PresenceWriter {
    shared: Arc<Presence>,
    active: Chain,
    sealing: Chain,
}

impl PresenceWriter {
    /// Starts publishing `sub`'s records of shard `shard`: every key of the in-memory
    /// generations (active, sealing: each if there is one) and every sealed filter, before
    /// anyone may read it.
    pub(crate) fn start<I: ExactSizeIterator<Item = u128>>(
        board: &Presences,
        shard: usize,
        sub: SubscriberId,
        active: Option<I>,
        sealing: Option<I>,
        sealed: impl Iterator<Item = Arc<GenFilter>>,
    ) -> PresenceWriter {
        let mut w = PresenceWriter {
            shared: Arc::new(Presence::default()),
            active: Chain::default(),
            sealing: Chain::default(),
        };
        fill(&mut w.active, active);
        fill(&mut w.sealing, sealing);
        w.publish(sealed);
        board.set(shard, sub, w.shared.clone());
        w
    }

    /// Records a key written into the active generation. When the newest Bloom filter is
    /// full, a larger one is added and published (with `sealed`, the current filters)
    /// before the key goes into it.
    pub(crate) fn insert<I: Iterator<Item = Arc<GenFilter>>>(
        &mut self,
        key: u128,
        sealed: impl FnOnce() -> I,
    ) {
        if self.active.room == 0 {
            grow(&mut self.active, 1);
            self.publish(sealed());
        }
        if let Some(b) = self.active.blooms.last() {
            b.insert_hash(half(key));
        }
        self.active.room -= 1;
    }

    /// The active generation became the sealing one (the sealing one, if any, is sealed
    /// by then: its filter is among `sealed`).
    pub(crate) fn seal_active(&mut self, sealed: impl Iterator<Item = Arc<GenFilter>>) {
        self.sealing = std::mem::take(&mut self.active);
        self.publish(sealed);
    }

    /// The sealing generation's filter is among `sealed` now.
    pub(crate) fn sealed(&mut self, sealed: impl Iterator<Item = Arc<GenFilter>>) {
        self.sealing = Chain::default();
        self.publish(sealed);
    }

    /// Replaces the published snapshot: the in-memory filters and `sealed`.
    pub(crate) fn publish(&self, sealed: impl Iterator<Item = Arc<GenFilter>>) {
        let snap = Snapshot {
            blooms: self
                .active
                .blooms
                .iter()
                .chain(&self.sealing.blooms)
                .cloned()
                .collect(),
            filters: sealed.collect(),
        };
        *self.shared.snap.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(snap);
    }

    /// Heap bytes of the in-memory Bloom filters.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.active
            .blooms
            .iter()
            .chain(&self.sealing.blooms)
            .map(|b| b.num_bits() / 8)
            .sum()
    }
}

fn bloom(keys: usize) -> AtomicBloomFilter {
    AtomicBloomFilter::with_false_pos(BLOOM_FALSE_POSITIVES).expected_items(keys.max(1))
}

/// Adds a filter with room for at least `need` more keys.
fn grow(chain: &mut Chain, need: usize) {
    let last = chain.blooms.len();
    let mut size = FIRST_BLOOM_KEYS.saturating_mul(BLOOM_GROWTH.saturating_pow(last as u32));
    size = size.max(need);
    chain.blooms.push(Arc::new(bloom(size)));
    chain.room = size;
}

fn fill(chain: &mut Chain, keys: Option<impl ExactSizeIterator<Item = u128>>) {
    let Some(keys) = keys.filter(|k| k.len() > 0) else {
        return;
    };
    grow(chain, keys.len());
    let b = chain.blooms.last().cloned();
    for key in keys {
        if let Some(b) = &b {
            b.insert_hash(half(key));
        }
        chain.room = chain.room.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard's presence of `sub` with no records.
    fn nothing_on(board: &Presences, shard: usize, sub: SubscriberId) -> PresenceWriter {
        let none: Option<std::iter::Empty<u128>> = None;
        PresenceWriter::start(board, shard, sub, none.clone(), none, std::iter::empty())
    }

    fn key(i: u64) -> u128 {
        xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes())
    }

    #[test]
    fn every_written_key_is_maybe_and_most_others_are_no() {
        let board = Presences::new(2);
        let sub = SubscriberId(3);
        let sealed_keys: Vec<u128> = (0..10_000).map(key).collect();
        let filter = Arc::new(GenFilter::build(sealed_keys.iter().copied()));
        let sealing: Vec<u128> = (10_000..12_000).map(key).collect();
        let mut w = PresenceWriter::start(
            &board,
            1,
            sub,
            None,
            Some(sealing.iter().copied()),
            std::iter::once(filter.clone()),
        );
        // Grows through several Bloom filters.
        for i in 12_000..200_000 {
            w.insert(key(i), || std::iter::once(filter.clone()));
        }
        assert!(w.active.blooms.len() >= 3, "{}", w.active.blooms.len());
        for i in (0..200_000).step_by(7) {
            assert!(!board.others_lack(0, sub, key(i)), "key {i} must be maybe");
        }
        let absent = (1_000_000..1_100_000)
            .filter(|&i| board.others_lack(0, sub, key(i)))
            .count();
        assert!(
            absent > 97_000,
            "only {absent} of 100,000 absent keys said no"
        );
        // A shard never reads its own presence (shard 0's is empty); another subscriber
        // has none published.
        let _w0 = nothing_on(&board, 0, sub);
        assert!(board.others_lack(1, sub, key(5)));
        assert!(!board.others_lack(0, SubscriberId(4), key(1_000_001)));
        // Sealing keeps the keys; a sealed filter replacing the chain keeps them too.
        w.seal_active(std::iter::once(filter.clone()));
        assert!(!board.others_lack(0, sub, key(150_000)));
        let all: Vec<u128> = (0..200_000).map(key).collect();
        w.sealed(std::iter::once(Arc::new(GenFilter::build(all.into_iter()))));
        assert!(w.memory_bytes() == 0, "no in-memory generation left");
        for i in (0..200_000).step_by(13) {
            assert!(!board.others_lack(0, sub, key(i)));
        }
    }

    #[test]
    fn a_shard_that_published_nothing_is_asked() {
        let board = Presences::new(3);
        let sub = SubscriberId(0);
        let _w = nothing_on(&board, 1, sub);
        assert!(!board.others_lack(0, sub, key(1)), "shard 2 published none");
        let _w2 = nothing_on(&board, 2, sub);
        assert!(board.others_lack(0, sub, key(1)));
    }
}
