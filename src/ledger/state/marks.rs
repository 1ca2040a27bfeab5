//! An in-memory Bloom filter over a subscriber's `insert-unique` marks on one shard.
//!
//! Most marks a handler checks are new (a new order gets its first label), and a new mark
//! was a B-tree descent into the unique table that finds nothing: 11 % of a shipping-label
//! run's CPU. The filter answers "certainly absent" from memory; "maybe" is looked up in
//! the table, so a false positive costs a lookup and never a wrong answer.
//!
//! The filter is built on a thread from a read snapshot of the table, when the subscriber
//! is first used on the shard and again each time its marks outgrow it (twice the marks
//! it was built for), so neither startup nor the batch loop waits for a scan of the
//! table. Until the first build lands, every check goes to the buffers and the table. A
//! build covers the marks in its snapshot; marks committed to the state buffer while it
//! runs, and the buffered ones not yet applied when it starts, are kept as hashes and added
//! when it lands. Once built, the filter holds every committed mark, so a "no" also skips
//! the buffers' hash sets. Marks are never removed, so a Bloom filter (which cannot delete)
//! fits.

use std::sync::Arc;

use crossbeam_channel::{bounded, Receiver, TryRecvError};
use fastbloom::AtomicBloomFilter;
use redb::{Database, ReadableDatabase};
use xxhash_rust::xxh3::xxh3_64;

use super::blocks;
use crate::ledger::tables::{missing_is_none, rows_name, unique_name, BlockDef};

/// About 10 bits per mark.
const FALSE_POSITIVE_RATE: f64 = 0.01;
/// Marks the smallest filter is sized for (80 KiB).
const MIN_CAPACITY: u64 = 65_536;

pub(crate) fn hash(mark: &[u8]) -> u64 {
    xxh3_64(mark)
}

type Built = Result<(AtomicBloomFilter, u64, u64), redb::Error>;

#[derive(Default)]
pub(crate) struct MarkFilter {
    /// Holds every committed mark (applied or buffered), once the first build lands.
    bloom: Option<Arc<AtomicBloomFilter>>,
    /// Marks the filter was sized for.
    capacity: u64,
    /// Marks added to it (re-inserts counted: an upper bound).
    count: u64,
    building: Option<Building>,
}

struct Building {
    rx: Receiver<Built>,
    /// Marks committed since the build started, and the unapplied ones when it started.
    since: Vec<u64>,
}

impl MarkFilter {
    /// The filter to probe, once built.
    pub fn bloom(&self) -> Option<Arc<AtomicBloomFilter>> {
        self.bloom.clone()
    }

    /// Heap bytes of the filter.
    pub fn memory_bytes(&self) -> u64 {
        self.bloom.as_ref().map_or(0, |b| b.num_bits() as u64 / 8)
    }

    /// Marks committed to the state buffer (on their way to the table).
    pub fn add<'a>(&mut self, marks: impl Iterator<Item = &'a [u8]>) {
        for m in marks {
            let h = hash(m);
            if let Some(b) = &self.bloom {
                b.insert_hash(h);
            }
            if let Some(p) = &mut self.building {
                p.since.push(h);
            }
            self.count += 1;
        }
    }

    /// Takes a finished build, and starts one when there is no filter yet or the marks have
    /// outgrown it. `unapplied` are the buffered marks not yet applied to the table (not in
    /// the snapshot a new build reads).
    pub fn tend<'a>(
        &mut self,
        db: &Arc<Database>,
        sub: &str,
        unapplied: impl Iterator<Item = &'a [u8]>,
    ) {
        if let Some(p) = &mut self.building {
            match p.rx.try_recv() {
                Err(TryRecvError::Empty) => return,
                Ok(Ok((bloom, marks, capacity))) => {
                    for h in &p.since {
                        bloom.insert_hash(*h);
                    }
                    self.count = marks + p.since.len() as u64;
                    self.capacity = capacity;
                    self.bloom = Some(Arc::new(bloom));
                    self.building = None;
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(subscriber = %sub, error = %e, "building the uniqueness filter failed; checks read the table");
                    self.building = None;
                    return;
                }
                Err(TryRecvError::Disconnected) => {
                    self.building = None;
                    return;
                }
            }
        }
        if self.bloom.is_some() && self.count <= self.capacity {
            return;
        }
        let (tx, rx) = bounded(1);
        let (db, name) = (db.clone(), unique_name(sub));
        let known = self.count;
        let spawned = std::thread::Builder::new()
            .name("dedupd-marks".into())
            .spawn(move || {
                let _ = tx.send(build(&db, &name, known));
            });
        if spawned.is_ok() {
            self.building = Some(Building {
                rx,
                since: unapplied.map(hash).collect(),
            });
        }
    }
}

/// Reads every mark of the table at a snapshot into a filter sized for twice as many (or
/// twice `known`, the marks counted so far, when that is more: some are not applied yet).
fn build(db: &Database, table: &str, known: u64) -> Built {
    let txn = db.begin_read()?;
    let open = |name: &str| missing_is_none(txn.open_table(BlockDef::new(name)));
    let blocks = open(table)?;
    let rows = open(&rows_name(table))?;
    let mut hashes = Vec::new();
    blocks::for_each_mixed(blocks.as_ref(), rows.as_ref(), b"", |k, _| {
        hashes.push(hash(k));
        true
    })?;
    let capacity = (hashes.len() as u64)
        .max(known)
        .saturating_mul(2)
        .max(MIN_CAPACITY);
    let bloom =
        AtomicBloomFilter::with_false_pos(FALSE_POSITIVE_RATE).expected_items(capacity as usize);
    for h in &hashes {
        bloom.insert_hash(*h);
    }
    Ok((bloom, hashes.len() as u64, capacity))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_built(f: &mut MarkFilter, db: &Arc<Database>) {
        for _ in 0..10_000 {
            f.tend(db, "s", std::iter::empty());
            if f.building.is_none() && f.bloom.is_some() {
                return;
            }
            std::thread::yield_now();
        }
        panic!("the filter build did not land");
    }

    /// Marks in the table, buffered ones, and ones committed while a build runs are all in the
    /// filter (no false negatives), and it grows when the marks outgrow it.
    #[test]
    fn the_filter_never_misses_a_mark() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Database::create(dir.path().join("m.redb")).unwrap());
        let mark = |i: u64| format!("label\0o-{i}").into_bytes();
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn.open_table(BlockDef::new(&unique_name("s"))).unwrap();
            let mut marks: Vec<Vec<u8>> = (0..1000).map(mark).collect();
            marks.sort();
            let rows: Vec<(&[u8], Option<&[u8]>)> = marks
                .iter()
                .map(|m| (m.as_slice(), Some(&[][..])))
                .collect();
            blocks::apply(&mut t, &rows).unwrap();
        }
        txn.commit().unwrap();

        let mut f = MarkFilter::default();
        let buffered: Vec<Vec<u8>> = (1000..1100).map(mark).collect();
        f.tend(&db, "s", buffered.iter().map(Vec::as_slice));
        // Committed while the build runs.
        let late: Vec<Vec<u8>> = (1100..1200).map(mark).collect();
        f.add(late.iter().map(Vec::as_slice));
        wait_built(&mut f, &db);
        let bloom = f.bloom().unwrap();
        for i in 0..1200 {
            assert!(bloom.contains_hash(hash(&mark(i))), "mark {i} missed");
        }
        let false_positives = (10_000..20_000)
            .filter(|i| bloom.contains_hash(hash(&mark(*i))))
            .count();
        assert!(
            false_positives < 300,
            "{false_positives} false positives in 10000"
        );

        // Outgrowing the filter starts a larger build.
        let many: Vec<Vec<u8>> = (2000..2000 + MIN_CAPACITY + 1).map(mark).collect();
        f.add(many.iter().map(Vec::as_slice));
        let before = f.memory_bytes();
        // Not in the table yet: all buffered, waiting to be applied.
        let unapplied: Vec<Vec<u8>> = (1000..1200).map(mark).chain(many.iter().cloned()).collect();
        f.tend(&db, "s", unapplied.iter().map(Vec::as_slice));
        wait_built(&mut f, &db);
        assert!(f.memory_bytes() > before);
        let bloom = f.bloom().unwrap();
        assert!(many.iter().all(|m| bloom.contains_hash(hash(m))));
        assert!((0..1200).all(|i| bloom.contains_hash(hash(&mark(i)))));
    }
}
