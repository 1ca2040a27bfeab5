//! Filters over the keys of many runs at once ("covers"), so that a key held by none of a
//! subscriber's runs costs one probe instead of one per run.
//!
//! Most `insert-unique` checks are for marks no run holds. Each run has its own filter
//! (`runs.rs`), and a lookup used to probe every one of them, newest first: with a dozen
//! runs, a dozen probes of seven random bits each, and a block read for each false
//! positive (~0.8 % per run). The CPU budget (`docs/design.md`) gave these lookups 2.0-2.7
//! core-µs of a message's 20-23, against 0.3 for the target.
//!
//! A cover is a split-block Bloom filter (one 32-byte block, one cache line, per probe;
//! the layout of the claims' sealed filters, `ledger/filter.rs`) holding the keys of a set
//! of runs. It is filled as runs are written: a flushed run's writer inserts every key it
//! writes into the newest cover, and a merge's output joins the cover of its inputs when
//! they all share one (its keys are theirs) or is inserted key by key into the newest one
//! otherwise. A lookup probes each cover once; the runs of a cover that says "no" are
//! skipped, the others are probed as before.
//!
//! Covers live in memory only: nothing of them is stored, so they change no durable state
//! (G1, G2, G6). After a restart no run is covered, and runs join covers as they are
//! merged again. A cover that says "no" must be right (G3): a run joins a cover only when
//! every key written to it (tombstones included: a skipped tombstone would uncover an older
//! value) went through that cover, and keys are only ever added to a filter.
//!
//! The newest cover is sized for twice the entries of all runs when it starts; when a
//! writer would fill it past its capacity, a new one starts and the older covers keep
//! their runs until merges move them on (an older cover is dropped once it has none).
//! An older cover takes no more keys, so it is **folded** to the size its runs need: with
//! the block chosen as `(h >> 32) * n >> 32`, halving an even block count `n` sends block
//! `b` to `b / 2`, so OR-ing blocks pairwise gives exactly the filter the same keys would
//! have set in half the blocks (the memory of the headroom it was sized with comes back).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::runs::Run;

/// Bits per key of the capacity a cover is sized for (~1 % false positives at capacity).
const BITS_PER_KEY: u64 = 10;
/// Block counts are a multiple of this, so a cover can be halved this many times over.
const FOLDS: usize = 64;
/// Capacity of a new cover over the entries it starts with.
const GROWTH: u64 = 2;
/// Smallest capacity of a cover, in keys.
const MIN_CAPACITY: u64 = 1 << 16;
/// Most covers of a subscriber: a writer that would need another gets none (its run is
/// simply not covered).
const MAX_COVERS: usize = 32;

/// The odd constants that pick a key's bit in each word (Parquet's, as `filter.rs`).
const SALT: [u32; 8] = [
    0x47b6_137b,
    0x4497_4d91,
    0x8824_ad5b,
    0xa2b7_289d,
    0x7054_95c7,
    0x2df1_424b,
    0x9efc_4947,
    0x5c6b_fb31,
];

/// One block: aligned so it never straddles two cache lines.
#[derive(Default)]
#[repr(C, align(32))]
struct Block([AtomicU32; 8]);

/// The bits of one cover. Written by the shard's writer thread while batch views read it:
/// a bit once set stays set, so a reader sees a superset of what it needs.
pub(crate) struct CoverBits {
    blocks: Box<[Block]>,
    capacity: u64,
    inserted: AtomicU64,
    /// The cover's identity, kept by a folded copy.
    id: u64,
}

/// A run key's hash (`run::key_hash`) mixed again (murmur3's finalizer), so the block
/// and the bits do not reuse the bits the runs' own filters take from it.
#[inline]
fn mix(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

impl CoverBits {
    fn with_capacity(id: u64, keys: u64) -> CoverBits {
        let keys = keys.max(1);
        let n = ((keys * BITS_PER_KEY).div_ceil(256) as usize).next_multiple_of(FOLDS);
        CoverBits {
            blocks: (0..n).map(|_| Block::default()).collect(),
            capacity: keys,
            inserted: AtomicU64::new(0),
            id,
        }
    }

    /// A copy halved as often as it stays even and large enough for `keys` keys: every
    /// key inserted so far still says "maybe". Keys inserted into `self` after this are not
    /// in the copy (so a writer's run joins a cover only through the copy it wrote into).
    fn folded(&self, keys: u64) -> Option<CoverBits> {
        let want = ((keys.max(1) * BITS_PER_KEY).div_ceil(256) as usize).max(1);
        let mut n = self.blocks.len();
        while n.is_multiple_of(2) && n / 2 >= want {
            n /= 2;
        }
        if n == self.blocks.len() {
            return None;
        }
        let per = self.blocks.len() / n;
        let blocks = (0..n)
            .map(|i| {
                let b = Block::default();
                for old in &self.blocks[i * per..(i + 1) * per] {
                    for (w, o) in b.0.iter().zip(&old.0) {
                        w.fetch_or(o.load(Ordering::Relaxed), Ordering::Relaxed);
                    }
                }
                b
            })
            .collect();
        Some(CoverBits {
            blocks,
            capacity: 0,
            inserted: AtomicU64::new(self.inserted.load(Ordering::Relaxed)),
            id: self.id,
        })
    }

    #[inline]
    fn slot(&self, hash: u64) -> (&Block, [u32; 8]) {
        let h = mix(hash);
        let block = (((h >> 32) * self.blocks.len() as u64) >> 32) as usize;
        let low = h as u32;
        let mut mask = [0u32; 8];
        for (m, salt) in mask.iter_mut().zip(SALT) {
            *m = 1 << (low.wrapping_mul(salt) >> 27);
        }
        (&self.blocks[block], mask)
    }

    /// Adds the key of run-key hash `hash`.
    #[inline]
    pub(crate) fn insert(&self, hash: u64) {
        let (block, mask) = self.slot(hash);
        for (w, m) in block.0.iter().zip(mask) {
            w.fetch_or(m, Ordering::Relaxed);
        }
        self.inserted.fetch_add(1, Ordering::Relaxed);
    }

    /// `false`: no run of this cover holds the key.
    #[inline]
    pub(crate) fn may_contain(&self, hash: u64) -> bool {
        let (block, mask) = self.slot(hash);
        block
            .0
            .iter()
            .zip(mask)
            .all(|(w, m)| w.load(Ordering::Relaxed) & m != 0)
    }

    /// Keys it can take before its false positives pass what it was sized for.
    fn room(&self) -> u64 {
        self.capacity
            .saturating_sub(self.inserted.load(Ordering::Relaxed))
    }

    fn heap_bytes(&self) -> u64 {
        (self.blocks.len() * std::mem::size_of::<Block>()) as u64
    }
}

/// A cover and the runs (table ids) whose every key it holds.
struct Cover {
    bits: Arc<CoverBits>,
    runs: HashSet<u64>,
}

/// The covers of a subscriber's runs on one shard, oldest first.
pub(crate) struct Covers {
    list: Vec<Cover>,
    next_id: u64,
    /// Smallest capacity of a new cover ([`MIN_CAPACITY`]; tests make it small).
    min_capacity: u64,
}

impl Default for Covers {
    fn default() -> Covers {
        Covers {
            list: Vec::new(),
            next_id: 0,
            min_capacity: MIN_CAPACITY,
        }
    }
}

impl Covers {
    /// Covers whose new members start at `keys` keys of capacity, so tests see them fill.
    #[cfg(test)]
    pub(crate) fn with_min_capacity(keys: u64) -> Covers {
        Covers {
            list: Vec::new(),
            next_id: 0,
            min_capacity: keys,
        }
    }

    /// The cover a writer of about `expected` keys inserts into: the newest one if it has
    /// room, else a new one sized for [`GROWTH`] times the entries the runs will hold
    /// (`total`: a merge's output replaces its inputs, a flush adds its entries), the one
    /// it replaces folded to what its runs hold (`entries` of a run's table id). `None`
    /// past [`MAX_COVERS`].
    pub(crate) fn for_writer(
        &mut self,
        expected: u64,
        total: u64,
        entries: impl Fn(u64) -> u64,
    ) -> Option<Arc<CoverBits>> {
        if let Some(c) = self.list.last() {
            if c.bits.room() >= expected {
                return Some(c.bits.clone());
            }
        }
        if self.list.len() >= MAX_COVERS {
            return None;
        }
        if let Some(c) = self.list.last_mut() {
            let keys = c.runs.iter().map(|id| entries(*id)).sum();
            if let Some(folded) = c.bits.folded(keys) {
                c.bits = Arc::new(folded);
            }
        }
        self.next_id += 1;
        let bits = Arc::new(CoverBits::with_capacity(
            self.next_id,
            total
                .max(expected)
                .saturating_mul(GROWTH)
                .max(self.min_capacity),
        ));
        self.list.push(Cover {
            bits: bits.clone(),
            runs: HashSet::new(),
        });
        Some(bits)
    }

    /// The cover holding every key of all `runs`, if one does (its id: a merge of them
    /// inserts nothing, so its output may join a folded copy).
    pub(crate) fn shared_by(&self, runs: &[Arc<Run>]) -> Option<u64> {
        let first = runs.first()?;
        let c = self
            .list
            .iter()
            .find(|c| c.runs.contains(&first.table_id))?;
        runs.iter()
            .all(|r| c.runs.contains(&r.table_id))
            .then_some(c.bits.id)
    }

    /// Records that `bits` holds every key of run `table_id`, written through it. Nothing
    /// when the cover was dropped or folded meanwhile (a folded copy lacks what was
    /// inserted after the fold).
    pub(crate) fn add_written(&mut self, bits: &Arc<CoverBits>, table_id: u64) {
        if let Some(c) = self.list.iter_mut().find(|c| Arc::ptr_eq(&c.bits, bits)) {
            c.runs.insert(table_id);
        }
    }

    /// Records that cover `id` holds every key of run `table_id`, a merge of runs it held.
    pub(crate) fn add_merged(&mut self, id: u64, table_id: u64) {
        if let Some(c) = self.list.iter_mut().find(|c| c.bits.id == id) {
            c.runs.insert(table_id);
        }
    }

    /// Forgets runs that are gone (merged into another), dropping every cover left without
    /// runs but the newest (a writer may be filling it).
    pub(crate) fn remove(&mut self, table_ids: impl IntoIterator<Item = u64>) {
        for id in table_ids {
            for c in &mut self.list {
                c.runs.remove(&id);
            }
        }
        let newest = self.list.len().saturating_sub(1);
        let mut i = 0;
        self.list.retain(|c| {
            i += 1;
            i - 1 == newest || !c.runs.is_empty()
        });
    }

    /// What a reader of `runs` (a snapshot of the list, taken with this) needs.
    /// Only covers that hold a run of the snapshot are in it: each costs a probe.
    pub(crate) fn view(&self, runs: &[Arc<Run>]) -> CoverView {
        let mut view = CoverView::default();
        let mut index = [u8::MAX; MAX_COVERS];
        for r in runs {
            let at = self.list.iter().position(|c| c.runs.contains(&r.table_id));
            view.of_run.push(at.map(|i| {
                if index[i] == u8::MAX {
                    index[i] = view.bits.len() as u8;
                    view.bits.push(self.list[i].bits.clone());
                }
                index[i]
            }));
        }
        view
    }

    /// Heap bytes of the covers' bits.
    pub(crate) fn heap_bytes(&self) -> u64 {
        self.list.iter().map(|c| c.bits.heap_bytes()).sum()
    }

    /// Runs covered.
    #[cfg(test)]
    pub(crate) fn covered(&self) -> usize {
        self.list.iter().map(|c| c.runs.len()).sum()
    }
}

/// The covers as of one snapshot of the run list.
#[derive(Default)]
pub(crate) struct CoverView {
    bits: Vec<Arc<CoverBits>>,
    /// For each run of the snapshot, in list order: the cover holding its keys.
    of_run: Vec<Option<u8>>,
}

impl CoverView {
    /// Which runs of the snapshot certainly do not hold the key of run-key hash `hash`:
    /// call the result with a run's position in the list.
    pub(crate) fn absent(&self, hash: u64) -> impl Fn(usize) -> bool + '_ {
        let mut no = 0u64;
        for (i, b) in self.bits.iter().enumerate() {
            if !b.may_contain(hash) {
                no |= 1 << i;
            }
        }
        move |run: usize| {
            self.of_run
                .get(run)
                .copied()
                .flatten()
                .is_some_and(|c| no & (1 << c) != 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cover_says_no_only_for_keys_never_inserted() {
        let bits = CoverBits::with_capacity(0, 100_000);
        for h in 0..100_000u64 {
            bits.insert(h.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        }
        assert!((0..100_000u64).all(|h| bits.may_contain(h.wrapping_mul(0x9e37_79b9_7f4a_7c15))));
        let false_positives = (100_000..300_000u64)
            .filter(|h| bits.may_contain(h.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .count();
        // ~1 % at capacity; a filter that said "maybe" to everything would fail this.
        assert!(
            false_positives < 200_000 / 40,
            "{false_positives} false positives"
        );
        // Folded for a tenth of the keys: halved while it still holds 10 bits a key (an
        // eighth of the blocks), the same keys, more false positives.
        let small = bits.folded(10_000).unwrap();
        assert_eq!(small.blocks.len() * 8, bits.blocks.len());
        assert!(small.blocks.len() * 256 >= 10_000 * BITS_PER_KEY as usize);
        assert!((0..100_000u64).all(|h| small.may_contain(h.wrapping_mul(0x9e37_79b9_7f4a_7c15))));
        let folded_false = (100_000..300_000u64)
            .filter(|h| small.may_contain(h.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .count();
        assert!(folded_false > false_positives, "{folded_false}");
    }

    #[test]
    fn a_full_cover_makes_writers_start_a_new_one_and_empty_old_ones_go() {
        let mut covers = Covers::default();
        let first = covers.for_writer(10, 0, |_| 0).unwrap();
        assert!(Arc::ptr_eq(
            &first,
            &covers.for_writer(10, 0, |_| 0).unwrap()
        ));
        covers.add_written(&first, 1);
        for h in 0..MIN_CAPACITY {
            first.insert(h);
        }
        let second = covers.for_writer(10, 5, |_| MIN_CAPACITY / 8).unwrap();
        assert!(!Arc::ptr_eq(&first, &second));
        // The first was folded for its one run's keys, and a writer still holding the
        // unfolded bits can no longer add a run to it.
        assert!(covers.list[0].bits.blocks.len() * 8 <= first.blocks.len());
        covers.add_written(&first, 3);
        assert!(!covers.list[0].runs.contains(&3));
        covers.add_merged(first.id, 4);
        assert!(covers.list[0].runs.contains(&4));
        covers.remove([4]);
        covers.add_written(&second, 2);
        assert_eq!(covers.covered(), 2);
        covers.remove([1]);
        assert_eq!(covers.list.len(), 1, "the emptied older cover is dropped");
        covers.remove([2]);
        assert_eq!(covers.list.len(), 1, "the newest stays for its writers");
    }
}
