//! One sorted run of handler state: an immutable redb table of prefix-compressed blocks,
//! written once in key order and read through its filter.
//!
//! A run table maps *the last key of a block* -> block, so the block that holds or would
//! hold a key is the first one whose last key is at or after it: one B-tree descent
//! (`range(key..)`), then a walk through one block. Runs are written only by appending in
//! key order (a flushed buffer, a merge), so redb fills its leaves in order and a run costs
//! about its own bytes on disk, where random keys inserted into one big table rewrote a
//! leaf per key per commit (see `runs.rs` and the design notes).
//!
//! Keys in a run carry their kind as a first byte ([`KIND_STATE`], [`KIND_MARK`],
//! [`KIND_VERSION`]), so one run holds a flushed buffer's state entries, `insert-unique`
//! marks and versions in one key order. A deleted key is kept as a tombstone until a merge
//! reaches the oldest run.
//!
//! Block format (v3): entries back to back, each
//! `shared: varint, suffix_len: varint, suffix, tag: varint, value`, where `shared` is the
//! length of the prefix shared with the previous key of the block (0 for the first) and
//! `tag` is 0 for a tombstone or `value_len + 1`. Varints are LEB128. A raw block so
//! starts with byte 0 (its first entry shares nothing). Blocks of the bigger runs
//! (format 4, see [`RunWriter::new`]) are stored zstd-compressed instead:
//! `1, raw_len: varint, zstd frame of the raw block`; a block that would not shrink is
//! stored raw. Each block is compressed alone, so a lookup still decodes one block.

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;

use fastbloom::BloomFilter;
use redb::{ReadOnlyTable, ReadableTable, StorageError, Table};

use super::cover::CoverBits;

/// Handler state entries (`state::put`).
pub(crate) const KIND_STATE: u8 = b's';
/// `insert-unique` marks (empty values).
pub(crate) const KIND_MARK: u8 = b'u';
/// `advance-version` versions (`u64`, little endian).
pub(crate) const KIND_VERSION: u8 = b'v';

/// Bytes a raw block is filled to before the next one starts: one block and its key fill
/// one 4 KiB redb leaf page (compressed blocks aim at a third of a page instead, see
/// `RunWriter::write_block`). A block past the page (4,096 bytes measured) made redb give each
/// leaf two pages, half of them empty: 142 MB of fragmentation beside 143 MB stored on a
/// 1M-message shipping-label run. One lookup reads one block, so smaller is cheaper to
/// search; larger shares redb's per-row overhead among more entries.
const BLOCK_TARGET: usize = 3800;

/// A leaf page's room for three rows of a run table: redb's leaf header (4 bytes) and
/// each row's key and value lengths (8) out of 4,096.
const LEAF_ROOM_FOR_THREE: usize = 4096 - 4 - 3 * 8;
/// Bytes kept free of the three rows' share of a leaf, so that three blocks a little over
/// their goal (the compressed size varies from block to block) still share one page.
const LEAF_MARGIN: usize = 32;

/// Most raw bytes of a compressed block: a read that hits decompresses its whole block, so
/// data that compresses far better than labels gets blocks short of a third of a page
/// rather than reads that cost more (uncapped, the state-read benchmark's blocks grew
/// until a hit cost 10.5 µs instead of 6.8). Shipping labels stay under it (~4.2 KB).
const MAX_COMPRESSED_RAW: usize = 4800;

/// First byte of a zstd-compressed block (a raw block starts with 0).
pub(crate) const BLOCK_ZSTD: u8 = 1;
/// zstd level of compressed blocks. Measured on blocks of a 2M-message shipping-label run
/// (random order ids) on this project's 2-core test machine: level 1 stored them in 0.30
/// of their bytes at 180-310 MB/s, level 3 in 0.30 at 190-250 MB/s, lz4 in 0.54 at
/// 380-590 MB/s (label JSON: field names repeat, hex ids compress only by entropy coding).
const ZSTD_LEVEL: i32 = 1;
/// Largest raw block a reader decompresses: one entry over the block target plus the
/// target; a damaged length must not allocate more.
const MAX_RAW_BLOCK: usize = 1 << 28;

thread_local! {
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// A stored block's raw bytes: itself, or decompressed.
pub(crate) fn block_bytes(stored: &[u8]) -> Result<Cow<'_, [u8]>, StorageError> {
    match stored.first() {
        Some(&BLOCK_ZSTD) => {
            let mut at = 1;
            let raw_len = varint(stored, &mut at)
                .filter(|n| *n <= MAX_RAW_BLOCK)
                .ok_or_else(|| corrupt("compressed block length"))?;
            let frame = &stored[at..];
            let raw = DECOMPRESSOR.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = Some(zstd::bulk::Decompressor::new()?);
                }
                match d.as_mut() {
                    Some(d) => d.decompress(frame, raw_len),
                    None => Err(std::io::Error::other("no decompressor")),
                }
            });
            match raw {
                Ok(raw) if raw.len() == raw_len => Ok(Cow::Owned(raw)),
                Ok(_) => Err(corrupt("compressed block is shorter than its length")),
                Err(e) => Err(corrupt(&format!("compressed block: {e}"))),
            }
        }
        Some(0) | None => Ok(Cow::Borrowed(stored)),
        Some(b) => Err(corrupt(&format!("unknown block encoding {b}"))),
    }
}

/// An entry as read from a run: `None` is a tombstone.
pub(crate) type Entry = (Vec<u8>, Option<Vec<u8>>);

fn corrupt(what: &str) -> StorageError {
    StorageError::Corrupted(format!("handler state run: {what}"))
}

fn put_varint(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

#[inline]
fn varint(b: &[u8], at: &mut usize) -> Option<usize> {
    // One byte: every length and shared prefix under 128, nearly all of them.
    let first = *b.get(*at)?;
    if first < 0x80 {
        *at += 1;
        return Some(usize::from(first));
    }
    let mut n = 0usize;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        n |= usize::from(byte & 0x7f).checked_shl(shift)?;
        if byte < 0x80 {
            return Some(n);
        }
    }
    None
}

/// How many leading bytes `a` and `b` share.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The key of `kind` and `key` in a run.
pub(crate) fn run_key(kind: u8, key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + key.len());
    k.push(kind);
    k.extend_from_slice(key);
    k
}

/// The filter hash of a run key.
pub(crate) fn key_hash(run_key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(run_key)
}

/// Filter bits per entry: with [`FILTER_HASHES`] probes about 0.8 % false positives.
const FILTER_BITS_PER_ENTRY: usize = 10;
pub(crate) const FILTER_HASHES: u32 = 7;

/// An empty filter sized for `entries` keys.
pub(crate) fn new_filter(entries: u64) -> BloomFilter {
    let bits = (entries as usize)
        .saturating_mul(FILTER_BITS_PER_ENTRY)
        .max(1024);
    BloomFilter::with_num_bits(bits).hashes(FILTER_HASHES)
}

/// Walks the entries of one block, rebuilding each key from its shared prefix.
pub(crate) struct BlockCursor<'a> {
    data: &'a [u8],
    at: usize,
    key: Vec<u8>,
}

impl<'a> BlockCursor<'a> {
    pub(crate) fn new(data: &'a [u8]) -> BlockCursor<'a> {
        BlockCursor {
            data,
            at: 0,
            key: Vec::new(),
        }
    }

    /// The next entry: its key (valid until the next call) and value (`None`: tombstone).
    #[allow(
        clippy::type_complexity,
        reason = "used once; a named type would only move it"
    )]
    pub(crate) fn next_entry(&mut self) -> Result<Option<(&[u8], Option<&'a [u8]>)>, StorageError> {
        if self.at >= self.data.len() {
            return Ok(None);
        }
        let e = BlockEntry::parse(self.data, &mut self.at, self.key.len())?;
        self.key.truncate(e.shared);
        self.key.extend_from_slice(e.suffix);
        Ok(Some((&self.key, e.value)))
    }
}

/// One encoded entry of a block, as stored: the key is the previous key's first `shared`
/// bytes and then `suffix`.
struct BlockEntry<'a> {
    shared: usize,
    suffix: &'a [u8],
    value: Option<&'a [u8]>,
}

impl<'a> BlockEntry<'a> {
    /// Parses the entry at `*at` and moves `at` past it; `prev_len` is the previous key's
    /// length (0 for the first entry), which `shared` may not exceed.
    #[inline]
    fn parse(d: &'a [u8], at: &mut usize, prev_len: usize) -> Result<BlockEntry<'a>, StorageError> {
        let mut i = *at;
        let parsed = (|| {
            let shared = varint(d, &mut i)?;
            let suffix_len = varint(d, &mut i)?;
            let suffix = d.get(i..i.checked_add(suffix_len)?)?;
            i += suffix_len;
            let tag = varint(d, &mut i)?;
            let value = match tag {
                0 => None,
                n => {
                    let v = d.get(i..i.checked_add(n - 1)?)?;
                    i += n - 1;
                    Some(v)
                }
            };
            (shared <= prev_len).then_some(BlockEntry {
                shared,
                suffix,
                value,
            })
        })();
        let e = parsed.ok_or_else(|| corrupt("entry out of bounds"))?;
        *at = i;
        Ok(e)
    }
}

/// The entry stored under `key` in one raw block (`Some(None)`: a tombstone), found
/// without rebuilding the keys it passes: the walk keeps how many leading bytes the last
/// key before `key` shares with it (`matched`), and an entry that shares more than that
/// with its predecessor is smaller than `key` without a look at its bytes; only entries
/// sharing at most `matched` bytes compare their suffix, against `key` from where they
/// diverge. Same answers as comparing every rebuilt key (property-tested in `fuzz.rs`); a
/// `memcmp` of whole keys per entry was ~a quarter of a state read that hits.
pub(crate) fn find_in_block<'a>(
    d: &'a [u8],
    key: &[u8],
) -> Result<Option<Option<&'a [u8]>>, StorageError> {
    // Invariant: every entry passed so far is smaller than `key`, and the last one shares
    // exactly `matched` leading bytes with it (and is longer than that, or a prefix of it).
    let (mut at, mut matched, mut prev_len) = (0, 0, 0);
    while at < d.len() {
        let e = BlockEntry::parse(d, &mut at, prev_len)?;
        prev_len = e.shared + e.suffix.len();
        if e.shared > matched {
            // Equal to the previous key up to past where that one fell below `key`.
            continue;
        }
        // The entry's first `shared` bytes are `key`'s: compare the rest.
        let rest = &key[e.shared..];
        let common = common_prefix(e.suffix, rest);
        match (e.suffix.get(common), rest.get(common)) {
            (None, None) => return Ok(Some(e.value)),
            (None, Some(_)) => matched = e.shared + common,
            (Some(a), Some(b)) if a < b => matched = e.shared + common,
            // Greater than `key`: so is every entry after it.
            _ => return Ok(None),
        }
    }
    Ok(None)
}

/// Writes a run in key order, a block at a time, across as many transactions as it takes
/// (it holds no table: each call gets the run's table of the current transaction).
pub(crate) struct RunWriter {
    block: Vec<u8>,
    /// Compresses each block when set; `stored` holds the compressed bytes.
    compressor: Option<zstd::bulk::Compressor<'static>>,
    stored: Vec<u8>,
    /// The last key pushed (the key of the block being filled, once it is written).
    last: Vec<u8>,
    /// Filter over every key written, built as they are written.
    filter: BloomFilter,
    entries: u64,
    bytes: u64,
    /// Raw bytes a block is filled to: [`BLOCK_TARGET`] for raw runs; for compressed ones,
    /// what is expected to compress to a third of a leaf page (see `write_block`).
    raw_target: usize,
    /// Compressed over raw bytes of this run's blocks so far (a moving average).
    ratio: Option<f64>,
    /// The cover every key written also goes into (`cover.rs`), if any.
    cover: Option<Arc<CoverBits>>,
}

/// What a finished run holds: its filter, entries and bytes written, and the cover that
/// holds every key of it, if any.
pub(crate) struct Written {
    pub(crate) filter: BloomFilter,
    pub(crate) entries: u64,
    pub(crate) bytes: u64,
    pub(crate) cover: Option<Arc<CoverBits>>,
}

impl RunWriter {
    /// A writer for at most about `expected` entries (the size of its filter); `compress`
    /// stores its blocks zstd-compressed. Compressing costs CPU on every write of the
    /// run and every block read, so the callers use it for the runs that hold most of
    /// the state and are rewritten least (see `runs.rs`).
    pub(crate) fn new(expected: u64, compress: bool) -> RunWriter {
        RunWriter {
            block: Vec::with_capacity(BLOCK_TARGET + 256),
            compressor: compress
                .then(|| zstd::bulk::Compressor::new(ZSTD_LEVEL).ok())
                .flatten(),
            stored: Vec::new(),
            last: Vec::new(),
            filter: new_filter(expected),
            entries: 0,
            bytes: 0,
            raw_target: BLOCK_TARGET,
            ratio: None,
            cover: None,
        }
    }

    /// The same writer inserting every key it writes into `cover` too.
    pub(crate) fn covered_by(mut self, cover: Option<Arc<CoverBits>>) -> RunWriter {
        debug_assert_eq!(self.entries, 0, "a cover must see every key of the run");
        self.cover = cover;
        self
    }

    /// Entries written so far.
    pub(crate) fn entries(&self) -> u64 {
        self.entries
    }

    /// Heap bytes of its filter.
    pub(crate) fn filter_bytes(&self) -> u64 {
        (self.filter.num_bits() / 8) as u64
    }

    /// Appends one entry; keys must come in strictly ascending order.
    pub(crate) fn push(
        &mut self,
        t: &mut Table<&'static [u8], &'static [u8]>,
        key: &[u8],
        value: Option<&[u8]>,
    ) -> Result<(), StorageError> {
        debug_assert!(self.entries == 0 || key > self.last.as_slice());
        let len = key.len() + value.map_or(0, <[u8]>::len) + 8;
        if !self.block.is_empty() && self.block.len() + len > self.raw_target {
            self.write_block(t)?;
        }
        let shared = if self.block.is_empty() {
            0
        } else {
            common_prefix(key, &self.last)
        };
        put_varint(&mut self.block, shared);
        put_varint(&mut self.block, key.len() - shared);
        self.block.extend_from_slice(&key[shared..]);
        match value {
            None => self.block.push(0),
            Some(v) => {
                put_varint(&mut self.block, v.len() + 1);
                self.block.extend_from_slice(v);
            }
        }
        self.last.clear();
        self.last.extend_from_slice(key);
        let hash = key_hash(key);
        self.filter.insert_hash(hash);
        if let Some(c) = &self.cover {
            c.insert(hash);
        }
        self.entries += 1;
        Ok(())
    }

    fn write_block(
        &mut self,
        t: &mut Table<&'static [u8], &'static [u8]>,
    ) -> Result<(), StorageError> {
        if self.block.is_empty() {
            return Ok(());
        }
        let mut stored = self.block.as_slice();
        if let Some(c) = self.compressor.as_mut() {
            self.stored.clear();
            self.stored.push(BLOCK_ZSTD);
            put_varint(&mut self.stored, self.block.len());
            let head = self.stored.len();
            // At most the raw size: a block that does not shrink is stored raw.
            self.stored.resize(head + self.block.len(), 0);
            let compressed = c.compress_to_buffer(&self.block, &mut self.stored[head..]);
            let size = match compressed {
                Ok(n) => {
                    self.stored.truncate(head + n);
                    stored = self.stored.as_slice();
                    head + n
                }
                Err(_) => self.block.len() + 1,
            };
            // redb fills a leaf page with as many appended rows as fit, so a compressed
            // block of ~1.1 KB shared a page with two others and left a sixth of it empty.
            // The next block aims at a third of a page with keys like this one's.
            let r = size as f64 / self.block.len() as f64;
            let ratio = self.ratio.map_or(r, |old| 0.7 * old + 0.3 * r);
            self.ratio = Some(ratio);
            let goal = (LEAF_ROOM_FOR_THREE.saturating_sub(3 * self.last.len()) / 3)
                .saturating_sub(LEAF_MARGIN)
                .max(256);
            self.raw_target = ((goal as f64 / ratio) as usize).clamp(512, MAX_COMPRESSED_RAW);
        }
        t.insert(self.last.as_slice(), stored)?;
        self.bytes += (stored.len() + self.last.len()) as u64;
        self.block.clear();
        Ok(())
    }

    /// Writes the block being filled now, so the table holds every entry pushed so far:
    /// a merge does this at the end of each slice, before it frees what it consumed.
    pub(crate) fn flush_block(
        &mut self,
        t: &mut Table<&'static [u8], &'static [u8]>,
    ) -> Result<(), StorageError> {
        self.write_block(t)
    }

    /// A writer that carries on a run already written up to its last block (a merge
    /// interrupted by a restart): its filter, counts and last key are rebuilt by reading
    /// the table once.
    pub(crate) fn resume<T: ReadableTable<&'static [u8], &'static [u8]>>(
        t: &T,
        expected: u64,
        compress: bool,
    ) -> Result<RunWriter, StorageError> {
        let mut w = RunWriter::new(expected, compress);
        for row in t.iter()? {
            let (k, block) = row?;
            let stored = block.value();
            w.bytes += (stored.len() + k.value().len()) as u64;
            let raw = block_bytes(stored)?;
            let mut cursor = BlockCursor::new(&raw);
            while let Some((key, _)) = cursor.next_entry()? {
                w.filter.insert_hash(key_hash(key));
                w.entries += 1;
                w.last.clear();
                w.last.extend_from_slice(key);
            }
        }
        Ok(w)
    }

    /// Writes the last block.
    pub(crate) fn finish(
        mut self,
        t: &mut Table<&'static [u8], &'static [u8]>,
    ) -> Result<Written, StorageError> {
        self.write_block(t)?;
        Ok(Written {
            filter: self.filter,
            entries: self.entries,
            bytes: self.bytes,
            cover: self.cover,
        })
    }
}

/// The entry stored under `key` in a run: `Some(None)` is a tombstone.
pub(crate) fn get<T: ReadableTable<&'static [u8], &'static [u8]>>(
    t: &T,
    key: &[u8],
) -> Result<Option<Option<Vec<u8>>>, StorageError> {
    let Some(row) = t.range::<&[u8]>(key..)?.next() else {
        return Ok(None);
    };
    let (_, block) = row?;
    let raw = block_bytes(block.value())?;
    Ok(find_in_block(&raw, key)?.map(|v| v.map(<[u8]>::to_vec)))
}

/// The entries of one kind of a run from a key on, in key order, keys without their kind
/// byte. Owns its range (a read-only table's ranges hold no borrow).
pub(crate) struct RunScan {
    range: redb::Range<'static, &'static [u8], &'static [u8]>,
    /// Only this kind, returned without its byte; every entry, whole, when `None`.
    kind: Option<u8>,
    /// The current block's entries not yet returned, in reverse order.
    pending: Vec<Entry>,
    /// Entries before this run key are skipped.
    from: Vec<u8>,
    /// The scan ends before this run key.
    until: Option<Vec<u8>>,
    done: bool,
}

impl RunScan {
    #[cfg(test)]
    pub(crate) fn new(
        t: &ReadOnlyTable<&'static [u8], &'static [u8]>,
        kind: u8,
        from: &[u8],
    ) -> Result<RunScan, StorageError> {
        RunScan::open(t, Some(kind), run_key(kind, from))
    }

    /// Every entry from run key `from` on, keys whole.
    pub(crate) fn all(
        t: &ReadOnlyTable<&'static [u8], &'static [u8]>,
        from: &[u8],
    ) -> Result<RunScan, StorageError> {
        RunScan::open(t, None, from.to_vec())
    }

    /// The entries of `kind` (every entry when `None`) with run keys from `from` up to
    /// `until` (excluded; no end when `None`).
    pub(crate) fn between(
        t: &ReadOnlyTable<&'static [u8], &'static [u8]>,
        kind: Option<u8>,
        from: Vec<u8>,
        until: Option<Vec<u8>>,
    ) -> Result<RunScan, StorageError> {
        Ok(RunScan {
            range: t.range::<&[u8]>(from.as_slice()..)?,
            kind,
            pending: Vec::new(),
            from,
            until,
            done: false,
        })
    }

    fn open(
        t: &ReadOnlyTable<&'static [u8], &'static [u8]>,
        kind: Option<u8>,
        from: Vec<u8>,
    ) -> Result<RunScan, StorageError> {
        RunScan::between(t, kind, from, None)
    }

    fn fill(&mut self) -> Result<(), StorageError> {
        while self.pending.is_empty() && !self.done {
            let Some(row) = self.range.next() else {
                self.done = true;
                return Ok(());
            };
            let (_, block) = row?;
            let raw = block_bytes(block.value())?;
            let mut cursor = BlockCursor::new(&raw);
            let mut out = Vec::new();
            while let Some((k, v)) = cursor.next_entry()? {
                if k < self.from.as_slice() {
                    continue;
                }
                if self.until.as_deref().is_some_and(|u| k >= u) {
                    self.done = true;
                    break;
                }
                let key = match self.kind {
                    None => k,
                    Some(kind) if k.first() == Some(&kind) => &k[1..],
                    Some(_) => {
                        self.done = true;
                        break;
                    }
                };
                out.push((key.to_vec(), v.map(<[u8]>::to_vec)));
            }
            out.reverse();
            self.pending = out;
        }
        Ok(())
    }
}

impl Iterator for RunScan {
    type Item = Result<Entry, StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Err(e) = self.fill() {
            self.done = true;
            self.pending.clear();
            return Some(Err(e));
        }
        self.pending.pop().map(Ok)
    }
}

/// Entry sources merged newest first: for each key the first source (lowest index) that
/// has it wins, tombstones included (the caller decides whether to keep them).
pub(crate) struct Merge<I: Iterator<Item = Result<Entry, StorageError>>> {
    heads: Vec<Option<Entry>>,
    sources: Vec<I>,
}

impl<I: Iterator<Item = Result<Entry, StorageError>>> Merge<I> {
    pub(crate) fn new(mut sources: Vec<I>) -> Result<Merge<I>, StorageError> {
        let heads = sources
            .iter_mut()
            .map(|s| s.next().transpose())
            .collect::<Result<_, _>>()?;
        Ok(Merge { heads, sources })
    }

    fn step(&mut self) -> Result<Option<Entry>, StorageError> {
        let Some(min) = self.heads.iter().flatten().map(|(k, _)| k).min().cloned() else {
            return Ok(None);
        };
        let mut winner = None;
        for (head, source) in self.heads.iter_mut().zip(&mut self.sources) {
            if head.as_ref().is_some_and(|(k, _)| *k == min) {
                let taken = std::mem::replace(head, source.next().transpose()?);
                if winner.is_none() {
                    winner = taken;
                }
            }
        }
        Ok(winner)
    }
}

impl<I: Iterator<Item = Result<Entry, StorageError>>> Iterator for Merge<I> {
    type Item = Result<Entry, StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.step().transpose()
    }
}

#[cfg(test)]
mod tests;
