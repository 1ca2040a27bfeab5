//! The second layout of the handler state tables (`state_v2/` and its row tables), kept to
//! read them once when a shard file is upgraded to sorted runs (`upgrade.rs`); the writing
//! half is kept for tests, which build files of this layout to upgrade.
//!
//! Sorted key-value entries packed into blocks.
//!
//! A block table is one redb table: *last key of a block* -> block. Block `i` holds the keys
//! in `(last[i-1], last[i]]`, so the block that holds or would hold a key is the first one
//! whose last key is at or after it: one B-tree descent (`range(key..)`), then a binary
//! search inside the block.
//!
//! Why blocks and not one redb row per entry: a frozen state buffer is applied in key order,
//! and redb charges every row insert a descent from the root and a leaf update (about 1 us).
//! A block is rewritten once for all the buffered keys that fall into it, so keys that
//! arrive in order (order ids, timestamps) cost a share of one block write each. Measured
//! on a shipping-label run: applying the buffer was 16 % of the CPU and stalled the
//! shard's batches (see the design notes).
//!
//! Block format (v1): `n: u32`, then `n` offsets (`u32`, into the entries), then the
//! entries, each `key_len: u32, key, value_len: u32, value`. Little endian.

use redb::{ReadableTable, StorageError};
#[cfg(test)]
use redb::{ReadableTableMetadata, Table};

#[cfg(test)]
/// Entry bytes a block is filled to before the next one starts. Measured on shipping-label
/// runs (alternating, 2M messages): 3 KiB blocks gave a median of ~261k msgs/s against
/// ~229k with 1 KiB, and random keys were no slower (189k/205k vs 182k/202k at 1M). A key
/// landing alone in a block rewrites the whole block, so much larger is not better.
const BLOCK_TARGET: usize = 3072;

fn corrupt(what: &str) -> StorageError {
    StorageError::Corrupted(format!("handler state block: {what}"))
}

fn u32_at(b: &[u8], at: usize) -> Option<usize> {
    let bytes = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?) as usize)
}

/// One block's bytes, read in place.
#[derive(Clone, Copy)]
pub(crate) struct Block<'a> {
    n: usize,
    offsets: &'a [u8],
    data: &'a [u8],
}

impl<'a> Block<'a> {
    pub(crate) fn parse(b: &'a [u8]) -> Result<Block<'a>, StorageError> {
        let n = u32_at(b, 0).ok_or_else(|| corrupt("no header"))?;
        let end = n
            .checked_mul(4)
            .and_then(|x| x.checked_add(4))
            .filter(|e| *e <= b.len())
            .ok_or_else(|| corrupt("offsets past the end"))?;
        Ok(Block {
            n,
            offsets: &b[4..end],
            data: &b[end..],
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.n
    }

    pub(crate) fn entry(&self, i: usize) -> Result<(&'a [u8], &'a [u8]), StorageError> {
        let read = || -> Option<(&'a [u8], &'a [u8])> {
            let at = u32_at(self.offsets, i * 4)?;
            let klen = u32_at(self.data, at)?;
            let k_end = (at + 4).checked_add(klen)?;
            let key = self.data.get(at + 4..k_end)?;
            let vlen = u32_at(self.data, k_end)?;
            let value = self.data.get(k_end + 4..(k_end + 4).checked_add(vlen)?)?;
            Some((key, value))
        };
        read().ok_or_else(|| corrupt("entry out of bounds"))
    }

    /// Index of `key`, or where it would go (binary search: entries are sorted).
    pub(crate) fn find(&self, key: &[u8]) -> Result<Result<usize, usize>, StorageError> {
        let (mut lo, mut hi) = (0, self.n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.entry(mid)?.0.cmp(key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Ok(Ok(mid)),
            }
        }
        Ok(Err(lo))
    }

    #[cfg(test)]
    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<&'a [u8]>, StorageError> {
        match self.find(key)? {
            Ok(i) => Ok(Some(self.entry(i)?.1)),
            Err(_) => Ok(None),
        }
    }

    #[cfg(test)]
    pub(crate) fn entries(
        self,
    ) -> impl Iterator<Item = Result<(&'a [u8], &'a [u8]), StorageError>> {
        (0..self.n).map(move |i| self.entry(i))
    }
}

#[cfg(test)]
/// Packs sorted entries into blocks of about [`BLOCK_TARGET`] bytes.
#[derive(Default)]
struct Packer {
    offsets: Vec<u8>,
    data: Vec<u8>,
    n: u32,
    last_key: Vec<u8>,
    /// Finished blocks: (last key, bytes).
    done: Vec<OwnedBlock>,
}

#[cfg(test)]
impl Packer {
    fn push(&mut self, key: &[u8], value: &[u8]) {
        if self.n > 0 && self.data.len() + 8 + key.len() + value.len() > BLOCK_TARGET {
            self.seal();
        }
        self.offsets
            .extend_from_slice(&(self.data.len() as u32).to_le_bytes());
        self.data
            .extend_from_slice(&(key.len() as u32).to_le_bytes());
        self.data.extend_from_slice(key);
        self.data
            .extend_from_slice(&(value.len() as u32).to_le_bytes());
        self.data.extend_from_slice(value);
        self.n += 1;
        self.last_key.clear();
        self.last_key.extend_from_slice(key);
    }

    fn seal(&mut self) {
        if self.n == 0 {
            return;
        }
        let mut b = Vec::with_capacity(4 + self.offsets.len() + self.data.len());
        b.extend_from_slice(&self.n.to_le_bytes());
        b.extend_from_slice(&self.offsets);
        b.extend_from_slice(&self.data);
        self.done.push((std::mem::take(&mut self.last_key), b));
        self.offsets.clear();
        self.data.clear();
        self.n = 0;
    }

    fn finish(mut self) -> Vec<OwnedBlock> {
        self.seal();
        self.done
    }
}

#[cfg(test)]
/// A block as (its last key, its bytes).
type OwnedBlock = (Vec<u8>, Vec<u8>);

#[cfg(test)]
/// The block that holds or would hold `key`.
fn block_for<T: ReadableTable<&'static [u8], &'static [u8]>>(
    t: &T,
    key: &[u8],
) -> Result<Option<OwnedBlock>, StorageError> {
    match t.range::<&[u8]>(key..)?.next() {
        Some(row) => {
            let (k, v) = row?;
            Ok(Some((k.value().to_vec(), v.value().to_vec())))
        }
        None => Ok(None),
    }
}

#[cfg(test)]
/// The value stored under `key`.
pub(crate) fn get<T: ReadableTable<&'static [u8], &'static [u8]>>(
    t: &T,
    key: &[u8],
) -> Result<Option<Vec<u8>>, StorageError> {
    let Some(row) = t.range::<&[u8]>(key..)?.next() else {
        return Ok(None);
    };
    let (_, v) = row?;
    let bytes = v.value();
    Ok(Block::parse(bytes)?.get(key)?.map(<[u8]>::to_vec))
}

#[cfg(test)]
/// Whether `key` is stored (no copy of the value).
pub(crate) fn contains<T: ReadableTable<&'static [u8], &'static [u8]>>(
    t: &T,
    key: &[u8],
) -> Result<bool, StorageError> {
    let Some(row) = t.range::<&[u8]>(key..)?.next() else {
        return Ok(false);
    };
    let (_, v) = row?;
    Ok(Block::parse(v.value())?.find(key)?.is_ok())
}

/// Calls `f` for every entry from `from` on, in key order, until it returns `false`.
pub(crate) fn for_each_from<T: ReadableTable<&'static [u8], &'static [u8]>>(
    t: &T,
    from: &[u8],
    mut f: impl FnMut(&[u8], &[u8]) -> bool,
) -> Result<(), StorageError> {
    for row in t.range::<&[u8]>(from..)? {
        let (_, v) = row?;
        let block = Block::parse(v.value())?;
        let start = match block.find(from)? {
            Ok(i) | Err(i) => i,
        };
        for i in start..block.len() {
            let (k, v) = block.entry(i)?;
            if !f(k, v) {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Number of entries (reads every block's header).
#[cfg(test)]
pub(crate) fn len<T: ReadableTable<&'static [u8], &'static [u8]>>(
    t: &T,
) -> Result<u64, StorageError> {
    let mut n = 0u64;
    for row in t.iter()? {
        let (_, v) = row?;
        n += Block::parse(v.value())?.len() as u64;
    }
    Ok(n)
}

#[cfg(test)]
/// Applies `updates` (in strictly ascending key order; `None` deletes) to a block table.
/// Each block the updates touch is read once, merged with its updates and written back,
/// split into blocks of about [`BLOCK_TARGET`] bytes (or removed when nothing is left).
pub(crate) fn apply(
    t: &mut Table<&'static [u8], &'static [u8]>,
    updates: &[(&[u8], Option<&[u8]>)],
) -> Result<(), StorageError> {
    debug_assert!(updates.windows(2).all(|w| w[0].0 < w[1].0));
    let mut i = 0;
    while i < updates.len() {
        let key = updates[i].0;
        // The block whose range holds `key`; past the last block, the last block (keys
        // appended in order then extend it and start new ones).
        let found = match block_for(t, key)? {
            Some(b) => Some(b),
            None => match t.iter()?.next_back() {
                Some(row) => {
                    let (k, v) = row?;
                    Some((k.value().to_vec(), v.value().to_vec()))
                }
                None => None,
            },
        };
        let (old_last, old) = match &found {
            Some((k, v)) => (Some(k.as_slice()), Some(Block::parse(v)?)),
            None => (None, None),
        };
        // Updates up to the block's last key belong to it; past the last block, all of them.
        let end = match old_last {
            Some(last) if last >= key => i + updates[i..].partition_point(|u| u.0 <= last),
            _ => updates.len(),
        };
        let olds: Vec<(&[u8], &[u8])> = match old {
            Some(b) => b.entries().collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        let news = &updates[i..end];
        let mut packer = Packer::default();
        let (mut o, mut n) = (0, 0);
        while o < olds.len() || n < news.len() {
            let order = match (olds.get(o), news.get(n)) {
                (Some(old), Some(new)) => old.0.cmp(new.0),
                (Some(_), None) => std::cmp::Ordering::Less,
                _ => std::cmp::Ordering::Greater,
            };
            if order == std::cmp::Ordering::Less {
                packer.push(olds[o].0, olds[o].1);
                o += 1;
                continue;
            }
            if order == std::cmp::Ordering::Equal {
                o += 1; // replaced or deleted by the update
            }
            if let (k, Some(v)) = news[n] {
                packer.push(k, v);
            }
            n += 1;
        }
        let blocks = packer.finish();
        if let Some(last) = old_last {
            if blocks.last().is_none_or(|(k, _)| k.as_slice() != last) {
                t.remove(last)?;
            }
        }
        for (last, bytes) in &blocks {
            t.insert(last.as_slice(), bytes.as_slice())?;
        }
        i = end;
    }
    Ok(())
}

#[cfg(test)]
/// Updates that land inside the blocks' key range are written as rows of their own (the
/// *row table*) when there are fewer than one per this many blocks: a block rewritten for a
/// single key costs two B-tree descents and a few KiB, where a row costs one descent.
/// Measured with random order ids at 4M messages: rewriting blocks for sparse keys made
/// the run ~30 % slower than one row per entry; keys in order still go to blocks.
const SPARSE_BLOCKS: u64 = 2;

#[cfg(test)]
/// Applies `updates` (strictly ascending keys; `None` deletes) to a block table and its row
/// table. Keys past the last block, and keys dense enough inside the blocks' range, go to
/// blocks; sparse keys inside the range go to rows. A row shadows a block entry with the
/// same key, so a key written to blocks is removed from the rows (when there are any), and
/// a delete removes the key from both.
pub(crate) fn apply_mixed(
    blocks: &mut Table<&'static [u8], &'static [u8]>,
    rows: &mut Table<&'static [u8], &'static [u8]>,
    updates: &[(&[u8], Option<&[u8]>)],
) -> Result<(), StorageError> {
    let last: Option<Vec<u8>> = match blocks.iter()?.next_back() {
        Some(row) => Some(row?.0.value().to_vec()),
        None => None,
    };
    let split = last
        .as_deref()
        .map_or(0, |l| updates.partition_point(|u| u.0 <= l));
    let (inside, beyond) = updates.split_at(split);
    let rows_used = !rows.is_empty()?;
    let sparse =
        !inside.is_empty() && (inside.len() as u64).saturating_mul(SPARSE_BLOCKS) < blocks.len()?;
    if sparse {
        let mut deletes = Vec::new();
        for &(k, v) in inside {
            match v {
                Some(v) => {
                    rows.insert(k, v)?;
                }
                None => {
                    rows.remove(k)?;
                    deletes.push((k, None));
                }
            }
        }
        apply(blocks, &deletes)?;
    } else {
        if rows_used {
            for &(k, _) in inside {
                rows.remove(k)?;
            }
        }
        apply(blocks, inside)?;
    }
    if rows_used {
        for &(k, _) in beyond {
            rows.remove(k)?;
        }
    }
    apply(blocks, beyond)
}

#[cfg(test)]
/// The value of `key` in a block table and its row table (rows win).
pub(crate) fn get_mixed<T: ReadableTable<&'static [u8], &'static [u8]>>(
    blocks: Option<&T>,
    rows: Option<&T>,
    key: &[u8],
) -> Result<Option<Vec<u8>>, StorageError> {
    if let Some(r) = rows {
        if let Some(v) = r.get(key)? {
            return Ok(Some(v.value().to_vec()));
        }
    }
    match blocks {
        Some(b) => get(b, key),
        None => Ok(None),
    }
}

#[cfg(test)]
/// Whether `key` is in a block table or its row table.
pub(crate) fn contains_mixed<T: ReadableTable<&'static [u8], &'static [u8]>>(
    blocks: Option<&T>,
    rows: Option<&T>,
    key: &[u8],
) -> Result<bool, StorageError> {
    if let Some(r) = rows {
        if r.get(key)?.is_some() {
            return Ok(true);
        }
    }
    match blocks {
        Some(b) => contains(b, key),
        None => Ok(false),
    }
}

/// Calls `f` for every entry of a block table and its row table from `from` on, in key
/// order (a row wins over a block entry with the same key), until it returns `false`.
pub(crate) fn for_each_mixed<T: ReadableTable<&'static [u8], &'static [u8]>>(
    blocks: Option<&T>,
    rows: Option<&T>,
    from: &[u8],
    mut f: impl FnMut(&[u8], &[u8]) -> bool,
) -> Result<(), StorageError> {
    let mut pending = match rows {
        Some(r) => Some(r.range::<&[u8]>(from..)?.peekable()),
        None => None,
    };
    let mut failed: Option<StorageError> = None;
    let mut stopped = false;
    // Emits rows before `key` (all of them when `None`); true when one equals `key`.
    let mut drain = |key: Option<&[u8]>,
                     f: &mut dyn FnMut(&[u8], &[u8]) -> bool,
                     failed: &mut Option<StorageError>,
                     stopped: &mut bool|
     -> bool {
        let Some(it) = pending.as_mut() else {
            return false;
        };
        while let Some(row) = it.peek() {
            let (k, v) = match row {
                Ok((k, v)) => (k, v),
                Err(_) => {
                    if let Some(Err(e)) = it.next() {
                        *failed = Some(e);
                    }
                    *stopped = true;
                    return false;
                }
            };
            let order = key.map(|key| k.value().cmp(key));
            if order == Some(std::cmp::Ordering::Greater) {
                return false;
            }
            if !f(k.value(), v.value()) {
                *stopped = true;
                return false;
            }
            it.next();
            if order == Some(std::cmp::Ordering::Equal) {
                return true;
            }
        }
        false
    };
    if let Some(b) = blocks {
        for_each_from(b, from, |k, v| {
            if drain(Some(k), &mut f, &mut failed, &mut stopped) {
                return !stopped; // the row with this key was emitted instead
            }
            if stopped {
                return false;
            }
            stopped = !f(k, v);
            !stopped
        })?;
    }
    if !stopped {
        drain(None, &mut f, &mut failed, &mut stopped);
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::format::tables::BlockDef;
    use redb::{Database, ReadableDatabase};
    use std::collections::BTreeMap;

    const T: BlockDef = BlockDef::new("t");
    const R: BlockDef = BlockDef::new("t_rows");

    /// Pseudo-random updates (puts, deletes, in-order appends, values of all sizes) applied
    /// in slices: every lookup, scan and count matches a BTreeMap, and every block stays
    /// within its key range.
    #[test]
    fn blocks_match_a_reference_map_through_random_updates() {
        random_updates(false);
    }

    /// The same with a row table beside the blocks: small slices of keys inside the blocks'
    /// range go to rows, and reads that merge both still match the reference.
    #[test]
    fn blocks_and_rows_match_a_reference_map_through_random_updates() {
        random_updates(true);
    }

    /// A xorshift generator: `rand(m)` is in `0..m`.
    fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        }
    }

    type Batch = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

    /// One round's updates: every fourth round appends keys in order, the others hit
    /// random keys; a quarter are deletes, values of all sizes.
    fn random_batch(round: u64, rand: &mut impl FnMut(u64) -> u64) -> Batch {
        let mut batch = Batch::new();
        for j in 0..rand(300) {
            let key = if round.is_multiple_of(4) {
                format!("k/{:06}", 100_000 + round * 1000 + j) // appended in order
            } else {
                format!("k/{:06}", rand(2000))
            };
            let value = if rand(4) == 0 {
                None
            } else {
                let max = if rand(20) == 0 { 3000 } else { 60 };
                Some(vec![b'v'; rand(max) as usize])
            };
            batch.insert(key.into_bytes(), value);
        }
        batch
    }

    /// Applies a batch in chunks of random size, in one transaction.
    fn write_batch(db: &Database, batch: &Batch, mixed: bool, rand: &mut impl FnMut(u64) -> u64) {
        let updates: Vec<(&[u8], Option<&[u8]>)> = batch
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_deref()))
            .collect();
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn.open_table(T).unwrap();
            let mut r = txn.open_table(R).unwrap();
            for chunk in updates.chunks(1 + rand(120) as usize) {
                if mixed {
                    apply_mixed(&mut t, &mut r, chunk).unwrap();
                } else {
                    apply(&mut t, chunk).unwrap();
                }
            }
        }
        txn.commit().unwrap();
    }

    /// Point reads and a scan from a random key answer what the reference holds.
    fn check_reads<Tab: ReadableTable<&'static [u8], &'static [u8]>>(
        t: &Tab,
        rows: Option<&Tab>,
        reference: &BTreeMap<Vec<u8>, Vec<u8>>,
        round: u64,
        rand: &mut impl FnMut(u64) -> u64,
    ) {
        for probe in 0..200 {
            let k = format!(
                "k/{:06}",
                rand(2000)
                    + if probe % 2 == 0 {
                        0
                    } else {
                        100_000 + rand(60_000)
                    }
            );
            assert_eq!(
                get_mixed(Some(t), rows, k.as_bytes()).unwrap(),
                reference.get(k.as_bytes()).cloned()
            );
            assert_eq!(
                contains_mixed(Some(t), rows, k.as_bytes()).unwrap(),
                reference.contains_key(k.as_bytes())
            );
        }
        let from = format!("k/{:06}", rand(2000));
        let mut seen = Vec::new();
        for_each_mixed(Some(t), rows, from.as_bytes(), |k, v| {
            seen.push((k.to_vec(), v.to_vec()));
            seen.len() < 50
        })
        .unwrap();
        let want: Vec<_> = reference
            .range(from.clone().into_bytes()..)
            .take(50)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(seen, want, "round {round}");
    }

    /// Every block's entries are sorted and end exactly at its table key; returns the
    /// number of blocks.
    fn check_block_layout(t: &impl ReadableTable<&'static [u8], &'static [u8]>) -> usize {
        let mut prev_last: Option<Vec<u8>> = None;
        let mut blocks = 0;
        for row in t.iter().unwrap() {
            blocks += 1;
            let (last, v) = row.unwrap();
            let block = Block::parse(v.value()).unwrap();
            assert!(block.len() > 0);
            let keys: Vec<&[u8]> = block.entries().map(|e| e.unwrap().0).collect();
            assert!(keys.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(*keys.last().unwrap(), last.value());
            if let Some(p) = &prev_last {
                assert!(keys[0] > p.as_slice());
            }
            prev_last = Some(last.value().to_vec());
        }
        blocks
    }

    fn random_updates(mixed: bool) {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("b.redb")).unwrap();
        let mut reference: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let mut rand = xorshift(7);
        for round in 0..60u64 {
            let batch = random_batch(round, &mut rand);
            write_batch(&db, &batch, mixed, &mut rand);
            for (k, v) in batch {
                match v {
                    Some(v) => reference.insert(k, v),
                    None => reference.remove(&k),
                };
            }

            let txn = db.begin_read().unwrap();
            let t = txn.open_table(T).unwrap();
            let r = txn.open_table(R).unwrap();
            let rows = mixed.then_some(&r);
            let mut n = 0;
            for_each_mixed(Some(&t), rows, b"", |_, _| {
                n += 1;
                true
            })
            .unwrap();
            assert_eq!(n, reference.len(), "round {round}");
            if !mixed {
                assert_eq!(len(&t).unwrap(), reference.len() as u64, "round {round}");
            }
            check_reads(&t, rows, &reference, round, &mut rand);
            let blocks = check_block_layout(&t);
            if round == 59 {
                let wanted = if mixed { 10 } else { 50 };
                assert!(
                    blocks > wanted,
                    "the test should split into many blocks: {blocks}"
                );
                if mixed {
                    assert!(r.len().unwrap() > 100, "sparse keys should go to rows");
                }
            }
        }
    }

    #[test]
    fn damaged_blocks_are_reported_not_trusted() {
        assert!(Block::parse(&[1, 0]).is_err());
        assert!(Block::parse(&[9, 0, 0, 0, 0, 0, 0, 0]).is_err());
        // One entry whose key length runs past the end.
        let bad = [1, 0, 0, 0, 0, 0, 0, 0, 200, 0, 0, 0, b'k'];
        let b = Block::parse(&bad).unwrap();
        assert!(b.entry(0).is_err());
        assert!(b.get(b"k").is_err());
    }
}
