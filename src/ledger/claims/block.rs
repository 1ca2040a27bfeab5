//! Sealed claims in blocks: a sealed generation's table holds one row per block of sorted
//! claims (keyed by the block's last key, as much as fits one 4 KiB leaf page with that
//! key) instead of one row per claim.
//!
//! One row per claim cost 48 stored bytes plus redb's per-entry overhead, and every seal,
//! merge and retirement was one B-tree insert or delete per claim: at 100M claims those row
//! operations were most of the writers' time. A block is written, read and deleted as one
//! value, and stores a claim in about 27-30 bytes: the 16-byte key and 8-byte fingerprint
//! as they are (random, so incompressible), the times and handler version as small deltas.
//!
//! Layout (little-endian):
//!
//! ```text
//! u8 version (1) | varint n | u64 base processed_at | u64 base life (expires - processed)
//! | n x 16-byte keys, strictly ascending | n x 8-byte fingerprints
//! | n x (varint zigzag(processed - base), varint zigzag(life - base life), varint handler version)
//! ```
//!
//! Keys and fingerprints have fixed widths so a lookup binary-searches the keys in place
//! and decodes the variable part only up to the entry it found. A block that is out of
//! order, cut or padded is refused with a reason, never read as "absent".

use redb::ReadableTable;

use crate::ledger::claims::record::ClaimRecord;

/// Why a block table could not be read.
#[derive(Debug)]
pub(crate) enum BlockError {
    Storage(redb::StorageError),
    Damaged(BlockDamage),
}

/// What is wrong with a stored claim block: damage, refused with the reason, never read
/// as "absent".
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BlockDamage {
    #[error("empty claim block")]
    Empty,
    #[error("claim block version {0} (expected {VERSION})")]
    Version(u8),
    #[error("claim block count is cut")]
    CountCut,
    #[error("claim block holds {0} entries (1 to {MAX_ENTRIES})")]
    Count(u64),
    #[error("claim block of {entries} entries is cut at {bytes} bytes")]
    Cut { entries: usize, bytes: usize },
    #[error("claim block keys out of order at entry {0}")]
    Order(usize),
    /// A block moved to another row (or swapped): a lookup by the row's key would miss
    /// claims.
    #[error("claim block stored under key {row_key:032x} ends with key {last:032x}")]
    Row { row_key: u128, last: u128 },
    #[error("claim block has {extra} bytes after its {entries} entries")]
    Trailing { extra: usize, entries: usize },
    #[error("claim block is cut in entry {0}")]
    EntryCut(usize),
}

impl From<redb::StorageError> for BlockError {
    fn from(e: redb::StorageError) -> Self {
        BlockError::Storage(e)
    }
}

/// The record of `key` in a sealed generation's block table: the first block whose last
/// key is not below `key` is the only one that can hold it.
pub(crate) fn lookup(
    t: &impl ReadableTable<u128, &'static [u8]>,
    key: u128,
) -> Result<Option<ClaimRecord>, BlockError> {
    let Some(row) = t.range::<u128>(key..)?.next() else {
        return Ok(None);
    };
    let (k, v) = row?;
    let block = ClaimBlock::parse_row(k.value(), v.value()).map_err(BlockError::Damaged)?;
    block.find(key).map_err(BlockError::Damaged)
}

/// Up to `limit` claims after `cursor` (from the first when `None`) in key order, and
/// whether the table is exhausted with them.
pub(crate) fn read_after(
    t: &impl ReadableTable<u128, &'static [u8]>,
    cursor: Option<u128>,
    limit: usize,
) -> Result<(Vec<(u128, ClaimRecord)>, bool), BlockError> {
    let iter = match cursor {
        None => t.range::<u128>(..)?,
        Some(u128::MAX) => return Ok((Vec::new(), true)),
        Some(c) => t.range::<u128>(c + 1..)?,
    };
    let mut out = Vec::with_capacity(limit.min(1 << 16));
    for row in iter {
        let (k, v) = row?;
        let block = ClaimBlock::parse_row(k.value(), v.value()).map_err(BlockError::Damaged)?;
        let entries = block.entries().map_err(BlockError::Damaged)?;
        out.extend(
            entries
                .into_iter()
                .filter(|e| cursor.is_none_or(|c| e.0 > c)),
        );
        if out.len() >= limit {
            out.truncate(limit);
            return Ok((out, false));
        }
    }
    Ok((out, true))
}

const VERSION: u8 = 1;
/// Room for a block in a 4 KiB leaf page that holds only it: redb's leaf header (4 bytes),
/// the value's length (4) and the row's `u128` key (16).
const LEAF_ROOM: usize = 4096 - 4 - 4 - 16;
/// Most bytes one claim adds to a block: key, fingerprint, three varints of at most 10
/// bytes, and one more byte of the entry count's varint.
const MAX_CLAIM_BYTES: usize = 16 + 8 + 3 * 10 + 1;
/// A block is closed once its encoding reaches this size, so with the claim that crossed
/// it, it still fits one leaf page. (It was 3,800 until 2026-12-03: blocks filled ~93 % of
/// their pages, and claim tables were 7 % fragmentation.)
pub(crate) const BLOCK_TARGET: usize = LEAF_ROOM - MAX_CLAIM_BYTES + 1;
const _: () = assert!(BLOCK_TARGET - 1 + MAX_CLAIM_BYTES <= LEAF_ROOM);
/// Most entries a block may claim to hold (a damaged count is refused, not allocated).
const MAX_ENTRIES: usize = 4_096;
const HEADER_FIXED: usize = 1 + 8 + 8;

/// Builds blocks from claims pushed in ascending key order.
#[derive(Default)]
pub(crate) struct BlockWriter {
    keys: Vec<u8>,
    fingerprints: Vec<u8>,
    vars: Vec<u8>,
    n: usize,
    base_processed: u64,
    base_life: u64,
    last_key: u128,
}

impl BlockWriter {
    /// Adds a claim; keys must ascend strictly across pushes of one block.
    pub(crate) fn push(&mut self, key: u128, r: &ClaimRecord) {
        let life = r.expires_at_ms.wrapping_sub(r.processed_at_ms);
        if self.n == 0 {
            self.base_processed = r.processed_at_ms;
            self.base_life = life;
        } else {
            debug_assert!(key > self.last_key, "block keys must ascend");
        }
        self.keys.extend_from_slice(&key.to_le_bytes());
        self.fingerprints
            .extend_from_slice(&r.fingerprint.to_le_bytes());
        put_varint(
            &mut self.vars,
            zigzag(r.processed_at_ms.wrapping_sub(self.base_processed)),
        );
        put_varint(&mut self.vars, zigzag(life.wrapping_sub(self.base_life)));
        put_varint(&mut self.vars, r.handler_version);
        self.n += 1;
        self.last_key = key;
    }

    /// Whether the block reached its size and should be written.
    pub(crate) fn is_full(&self) -> bool {
        self.encoded_len() >= BLOCK_TARGET || self.n >= MAX_ENTRIES
    }

    fn encoded_len(&self) -> usize {
        HEADER_FIXED
            + varint_len(self.n as u64)
            + self.keys.len()
            + self.fingerprints.len()
            + self.vars.len()
    }

    /// The block's last key and its encoding; the writer starts a new block.
    pub(crate) fn take(&mut self) -> Option<(u128, Vec<u8>)> {
        if self.n == 0 {
            return None;
        }
        let mut out = Vec::with_capacity(self.encoded_len());
        out.push(VERSION);
        put_varint(&mut out, self.n as u64);
        out.extend_from_slice(&self.base_processed.to_le_bytes());
        out.extend_from_slice(&self.base_life.to_le_bytes());
        out.extend_from_slice(&self.keys);
        out.extend_from_slice(&self.fingerprints);
        out.extend_from_slice(&self.vars);
        let last = self.last_key;
        self.keys.clear();
        self.fingerprints.clear();
        self.vars.clear();
        self.n = 0;
        Some((last, out))
    }
}

/// A parsed block borrowing its bytes.
pub(crate) struct ClaimBlock<'a> {
    n: usize,
    base_processed: u64,
    base_life: u64,
    keys: &'a [u8],
    fingerprints: &'a [u8],
    vars: &'a [u8],
}

impl<'a> ClaimBlock<'a> {
    /// Checks the header, the sizes and the key order (lookups binary-search the keys, so a
    /// block out of order must not be read).
    pub(crate) fn parse(b: &'a [u8]) -> Result<ClaimBlock<'a>, BlockDamage> {
        let (&version, rest) = b.split_first().ok_or(BlockDamage::Empty)?;
        if version != VERSION {
            return Err(BlockDamage::Version(version));
        }
        let mut pos = 0;
        let n = get_varint(rest, &mut pos).ok_or(BlockDamage::CountCut)?;
        if n == 0 || n > MAX_ENTRIES as u64 {
            return Err(BlockDamage::Count(n));
        }
        let n = n as usize;
        let rest = &rest[pos..];
        if rest.len() < 16 + n * 24 + n * 3 {
            return Err(BlockDamage::Cut {
                entries: n,
                bytes: b.len(),
            });
        }
        let base_processed = read_u64(rest, 0);
        let base_life = read_u64(rest, 8);
        let keys = &rest[16..16 + n * 16];
        let fingerprints = &rest[16 + n * 16..16 + n * 24];
        let vars = &rest[16 + n * 24..];
        let block = ClaimBlock {
            n,
            base_processed,
            base_life,
            keys,
            fingerprints,
            vars,
        };
        for i in 1..n {
            if block.key(i) <= block.key(i - 1) {
                return Err(BlockDamage::Order(i));
            }
        }
        Ok(block)
    }

    /// A block as stored: its row key must be its last key, or a lookup that picked the
    /// row by that key would miss claims (a row moved or a block swapped is damage).
    pub(crate) fn parse_row(row_key: u128, b: &'a [u8]) -> Result<ClaimBlock<'a>, BlockDamage> {
        let block = Self::parse(b)?;
        let last = block.key(block.n - 1);
        if last != row_key {
            return Err(BlockDamage::Row { row_key, last });
        }
        Ok(block)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.n
    }

    pub(crate) fn key(&self, i: usize) -> u128 {
        let mut k = [0u8; 16];
        k.copy_from_slice(&self.keys[i * 16..i * 16 + 16]);
        u128::from_le_bytes(k)
    }

    /// The record of `key`, if the block holds it.
    pub(crate) fn find(&self, key: u128) -> Result<Option<ClaimRecord>, BlockDamage> {
        let (mut lo, mut hi) = (0, self.n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.key(mid).cmp(&key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => {
                    let mut pos = 0;
                    for j in 0..mid {
                        self.record_at(j, &mut pos, true)?;
                    }
                    return self.record_at(mid, &mut pos, false).map(Some);
                }
            }
        }
        Ok(None)
    }

    /// Every entry, in key order; the variable part must be exactly as long as its entries.
    pub(crate) fn entries(&self) -> Result<Vec<(u128, ClaimRecord)>, BlockDamage> {
        let mut out = Vec::with_capacity(self.n);
        let mut pos = 0;
        for i in 0..self.n {
            out.push((self.key(i), self.record_at(i, &mut pos, false)?));
        }
        if pos != self.vars.len() {
            return Err(BlockDamage::Trailing {
                extra: self.vars.len() - pos,
                entries: self.n,
            });
        }
        Ok(out)
    }

    /// Decodes the variable part at `pos` as entry `i`'s (or only skips it).
    fn record_at(&self, i: usize, pos: &mut usize, skip: bool) -> Result<ClaimRecord, BlockDamage> {
        let cut = BlockDamage::EntryCut(i);
        let d_processed = get_varint(self.vars, pos).ok_or(cut)?;
        let d_life = get_varint(self.vars, pos).ok_or(cut)?;
        let handler_version = get_varint(self.vars, pos).ok_or(cut)?;
        if skip {
            return Ok(ClaimRecord {
                fingerprint: 0,
                processed_at_ms: 0,
                expires_at_ms: 0,
                handler_version: 0,
            });
        }
        let processed_at_ms = self.base_processed.wrapping_add(unzigzag(d_processed));
        let life = self.base_life.wrapping_add(unzigzag(d_life));
        Ok(ClaimRecord {
            fingerprint: read_u64(self.fingerprints, i * 8),
            processed_at_ms,
            expires_at_ms: processed_at_ms.wrapping_add(life),
            handler_version,
        })
    }
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn zigzag(d: u64) -> u64 {
    let s = d as i64;
    ((s << 1) ^ (s >> 63)) as u64
}

fn unzigzag(z: u64) -> u64 {
    (z >> 1) ^ (z & 1).wrapping_neg()
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// A minimally encoded varint of at most 10 bytes; `None` when cut, overlong or too big.
fn get_varint(b: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v: u64 = 0;
    for i in 0..10 {
        let byte = *b.get(*pos + i)?;
        if i == 9 && byte > 1 {
            return None;
        }
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            if i > 0 && byte == 0 {
                return None;
            }
            *pos += i + 1;
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing;
    use proptest::prelude::*;

    fn rec(fp: u64, at: u64, life: u64, v: u64) -> ClaimRecord {
        ClaimRecord {
            fingerprint: fp,
            processed_at_ms: at,
            expires_at_ms: at.wrapping_add(life),
            handler_version: v,
        }
    }

    fn blocks_of(entries: &[(u128, ClaimRecord)]) -> Vec<(u128, Vec<u8>)> {
        let mut w = BlockWriter::default();
        let mut out = Vec::new();
        for (k, r) in entries {
            w.push(*k, r);
            if w.is_full() {
                out.extend(w.take());
            }
        }
        out.extend(w.take());
        out
    }

    #[test]
    fn blocks_read_back_every_claim_and_nothing_else() {
        let mut x: u128 = 7;
        let mut entries = Vec::new();
        for i in 0..10_000u64 {
            x = x
                .wrapping_mul(0x2545_f491_4f6c_dd1d_9e37_79b9_7f4a_7c15)
                .wrapping_add(1);
            // Times around now, a 7-day TTL, a few handler versions and a tombstone.
            let v = if i % 997 == 0 { u64::MAX } else { i % 3 };
            entries.push((
                x,
                rec(
                    i.wrapping_mul(0x9e37),
                    1_800_000_000_000 + i * 3,
                    604_800_000,
                    v,
                ),
            ));
        }
        entries.sort_by_key(|e| e.0);
        entries.dedup_by_key(|e| e.0);
        let blocks = blocks_of(&entries);
        let mut read = Vec::new();
        for (last, b) in &blocks {
            assert!(b.len() <= BLOCK_TARGET + 64, "block of {} bytes", b.len());
            let block = ClaimBlock::parse(b).unwrap();
            assert_eq!(block.key(block.len() - 1), *last);
            read.extend(block.entries().unwrap());
        }
        assert_eq!(read, entries);
        let stored: usize = blocks.iter().map(|b| b.1.len()).sum();
        let per_claim = stored as f64 / entries.len() as f64;
        assert!(per_claim < 31.0, "{per_claim:.1} bytes per claim");
        // Every key is found in the block that the table's range lookup picks (the first
        // block whose last key is not below it); keys in between are absent.
        for (k, r) in entries.iter().step_by(7) {
            let (_, b) = blocks.iter().find(|(last, _)| last >= k).unwrap();
            assert_eq!(ClaimBlock::parse(b).unwrap().find(*k).unwrap(), Some(*r));
            let (_, b) = blocks.iter().find(|(last, _)| *last > k + 1).unwrap();
            let absent = ClaimBlock::parse(b).unwrap().find(k + 1).unwrap();
            assert!(absent.is_none() || entries.binary_search_by_key(&(k + 1), |e| e.0).is_ok());
        }
    }

    /// Through a real redb table: paging with a cursor that falls inside a block returns
    /// every claim once in order, an unbounded read (the filter rebuild's) returns them
    /// all, and `lookup` finds each stored key and nothing else.
    #[test]
    fn a_block_table_pages_and_looks_up_every_claim() {
        const T: redb::TableDefinition<u128, &[u8]> = redb::TableDefinition::new("blocks");
        let entries: Vec<_> = (1..5_000u128)
            .map(|k| (k * 3, rec(k as u64, 1_000 + k as u64, 60_000, 1)))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let db = redb::Database::create(dir.path().join("b.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn.open_table(T).unwrap();
            let blocks = blocks_of(&entries);
            assert!(blocks.len() > 10, "{} blocks", blocks.len());
            for (last, b) in &blocks {
                t.insert(*last, b.as_slice()).unwrap();
            }
        }
        txn.commit().unwrap();
        let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
        let t = txn.open_table(T).unwrap();
        let (all, done) = read_after(&t, None, usize::MAX).unwrap();
        assert!(done);
        assert_eq!(all, entries);
        let mut paged = Vec::new();
        let mut cursor = None;
        loop {
            let (page, done) = read_after(&t, cursor, 77).unwrap();
            assert!(page.len() <= 77);
            cursor = page.last().map(|e| e.0).or(cursor);
            paged.extend(page);
            if done {
                break;
            }
        }
        assert_eq!(paged, entries);
        for (k, r) in entries.iter().step_by(13) {
            assert_eq!(lookup(&t, *k).unwrap(), Some(*r));
            assert_eq!(lookup(&t, k + 1).unwrap(), None);
        }
        assert_eq!(lookup(&t, u128::MAX).unwrap(), None);
        assert_eq!(lookup(&t, 0).unwrap(), None);
    }

    /// Blocks fill their leaf pages: one page per block, at least 97 % of it used, also
    /// when every claim needs its widest encoding (it fits, never spilling into a second
    /// page). At 3,800 bytes the pages were ~93 % used.
    #[test]
    fn blocks_fill_one_leaf_page_each() {
        const T: redb::TableDefinition<u128, &[u8]> = redb::TableDefinition::new("blocks");
        let mut x: u128 = 11;
        let mut typical = Vec::new();
        let mut widest = Vec::new();
        for i in 0..40_000u64 {
            x = x
                .wrapping_mul(0x2545_f491_4f6c_dd1d_9e37_79b9_7f4a_7c15)
                .wrapping_add(1);
            typical.push((x, rec(i, 1_800_000_000_000 + i * 3, 604_800_000, 1)));
            // Deltas that need 10-byte varints either way from the block's first claim.
            let far = if i % 2 == 0 { 0 } else { u64::MAX / 2 };
            widest.push((x, rec(i, far, far ^ u64::MAX, u64::MAX)));
        }
        for entries in [&mut typical, &mut widest] {
            entries.sort_by_key(|e| e.0);
            entries.dedup_by_key(|e| e.0);
            let blocks = blocks_of(entries);
            assert!(blocks.iter().all(|(_, b)| b.len() <= LEAF_ROOM));
            let dir = tempfile::tempdir().unwrap();
            let db = redb::Database::create(dir.path().join("b.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            let stats = {
                let mut t = txn.open_table(T).unwrap();
                for (last, b) in &blocks {
                    t.insert(*last, b.as_slice()).unwrap();
                }
                redb::ReadableTableMetadata::stats(&t).unwrap()
            };
            txn.commit().unwrap();
            assert_eq!(
                stats.leaf_pages(),
                blocks.len() as u64,
                "one page per block"
            );
            let full: usize = blocks[..blocks.len() - 1].iter().map(|b| b.1.len()).sum();
            let fill = full as f64 / ((blocks.len() - 1) * 4096) as f64;
            assert!(fill >= 0.97, "pages {:.1} % used", fill * 100.0);
        }
    }

    #[test]
    fn a_damaged_block_is_refused_with_a_reason() {
        let entries: Vec<_> = (1..50u128)
            .map(|k| (k * 1000, rec(k as u64, 5, 10, 0)))
            .collect();
        let (_, good) = blocks_of(&entries).remove(0);
        let mut swapped = good.clone();
        // Swap the first two keys: out of order.
        let at = 1 + 1 + 16;
        let (a, b) = (
            swapped[at..at + 16].to_vec(),
            swapped[at + 16..at + 32].to_vec(),
        );
        swapped[at..at + 16].copy_from_slice(&b);
        swapped[at + 16..at + 32].copy_from_slice(&a);
        let err = |b: &[u8]| match ClaimBlock::parse(b).and_then(|k| k.entries()) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("damaged block accepted"),
        };
        assert!(err(&swapped).contains("out of order"));
        assert!(err(&good[..good.len() - 1]).contains("cut"));
        let mut padded = good.clone();
        padded.push(0);
        assert!(err(&padded).contains("after its"));
        let mut version = good.clone();
        version[0] = 2;
        assert!(err(&version).contains("version"));
        assert!(err(&[]).contains("empty"));
        // Stored under another key than its last: a lookup by that key would miss claims.
        let last = entries.last().unwrap().0;
        assert!(ClaimBlock::parse_row(last, &good).is_ok());
        let moved = ClaimBlock::parse_row(last + 1, &good)
            .err()
            .unwrap()
            .to_string();
        assert!(moved.contains("stored under key"), "{moved}");
    }

    fn valid_block() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::btree_map(
            any::<u128>(),
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
            1..200,
        )
        .prop_map(|m| {
            let entries: Vec<_> = m
                .into_iter()
                .map(|(k, (f, a, l, v))| (k, rec(f, a, l, v)))
                .collect();
            blocks_of(&entries).remove(0).1
        })
    }

    /// Any bytes: a block that parses reads back entries that encode to a block reading the
    /// same entries, with ascending keys; lookups agree with the entries. No panic.
    #[test]
    fn fuzz_claim_blocks_refuse_or_read_consistently() {
        fuzzing::run(
            "claim_block",
            3000,
            fuzzing::hostile(4200, valid_block()),
            |b| {
                if let Ok(entries) = ClaimBlock::parse(&b).and_then(|k| k.entries()) {
                    fuzzing::decoded();
                    prop_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
                    let again = blocks_of(&entries);
                    let mut read = Vec::new();
                    for (_, blk) in &again {
                        read.extend(ClaimBlock::parse(blk).unwrap().entries().unwrap());
                    }
                    prop_assert_eq!(&read, &entries);
                    let block = ClaimBlock::parse(&b).unwrap();
                    for (k, r) in entries.iter().take(20) {
                        prop_assert_eq!(block.find(*k).unwrap(), Some(*r));
                    }
                }
                Ok(())
            },
        );
        fuzzing::run("claim_block_round_trip", 300, valid_block(), |b| {
            let block = ClaimBlock::parse(&b).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(block.entries().is_ok());
            Ok(())
        });
    }

    #[test]
    fn varints_round_trip_and_refuse_overlong() {
        for v in [0, 1, 127, 128, 300, u32::MAX as u64, u64::MAX - 1, u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            assert_eq!(b.len(), varint_len(v));
            let mut pos = 0;
            assert_eq!(get_varint(&b, &mut pos), Some(v));
            assert_eq!(pos, b.len());
        }
        for d in [0u64, 1, u64::MAX, 1 << 63, 12345] {
            assert_eq!(unzigzag(zigzag(d)), d);
        }
        assert_eq!(get_varint(&[0x80, 0x00], &mut 0), None);
        assert_eq!(get_varint(&[0xff; 10], &mut 0), None);
    }
}
