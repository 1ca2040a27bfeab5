//! The filter of one sorted run: which keys the run certainly does not hold.
//!
//! Every key a run writer pushes goes into its run's filter, and a lookup probes the
//! filters of the runs a cover does not rule out (`cover.rs`) before it reads a block. Runs
//! written since format 9 get a **split-block** Bloom filter (as Parquet's, and as the
//! claims' sealed filters and the covers): a key sets one bit in each of the eight 32-bit
//! words of one 32-byte block, so an insert or a probe touches one cache line. Before,
//! runs had a classic Bloom filter (`fastbloom`, seven bits anywhere in the whole filter):
//! seven cache misses per key written, and a merge writes every key of its inputs again,
//! so the inserts of a merge's output were most of the merge's own time beside zstd
//! (`RunWriter::push`, ~0.8 core-µs per message in the CPU budget of `docs/design.md`).
//! Classic filters of older runs are still read, and replaced as their runs merge.
//!
//! Stored in the run's row of the run list (`runs.rs`): `hashes: u32, words: u64`, then
//! the words; `hashes` is 0 for a split-block filter (its words are the blocks, four a
//! block), else the classic filter's hash count.
//!
//! A filter may only say "no" or "maybe" (G3): a "maybe" is confirmed in the run's block.

use fastbloom::BloomFilter;

use crate::ledger::claims::filter::prefetch_read;

/// Bits per entry of a split-block filter: ~1 % false positives (measured in the tests
/// below), against ~0.8 % for the classic filter at the same size.
const BITS_PER_ENTRY: u64 = 10;
/// Most hash functions a stored classic filter may name.
const MAX_CLASSIC_HASHES: u32 = 32;
/// `hashes` of a stored split-block filter.
const SPLIT_BLOCK: u32 = 0;

/// The odd constants that pick a key's bit in each word (Parquet's, as `cover.rs` and the
/// claims' `filter.rs`).
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
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub(crate) struct Block([u32; 8]);

/// The block of hash `h` among `n` blocks, and the mask of its bit in each word. The
/// block comes from the high half of `h` and the bits from the low half; `h` is a run
/// key's xxh3 (`run::key_hash`), uniform enough as it is. (Covers mix it again first, so
/// they and the runs' filters do not pick the same bits.)
#[inline]
fn slot(h: u64, n: usize) -> (usize, [u32; 8]) {
    let block = (((h >> 32) * n as u64) >> 32) as usize;
    let low = h as u32;
    let mut mask = [0u32; 8];
    for (m, salt) in mask.iter_mut().zip(SALT) {
        *m = 1 << (low.wrapping_mul(salt) >> 27);
    }
    (block, mask)
}

/// A run's filter.
pub(crate) enum RunFilter {
    SplitBlock(Box<[Block]>),
    /// Runs written before format 9.
    Classic(BloomFilter),
}

impl RunFilter {
    /// An empty filter sized for about `entries` keys.
    pub fn for_entries(entries: u64) -> RunFilter {
        let n = entries
            .saturating_mul(BITS_PER_ENTRY)
            .div_ceil(256)
            .clamp(4, 1 << 40) as usize;
        RunFilter::SplitBlock(vec![Block::default(); n].into_boxed_slice())
    }

    #[inline]
    pub fn insert_hash(&mut self, h: u64) {
        match self {
            RunFilter::SplitBlock(blocks) => {
                let (b, mask) = slot(h, blocks.len());
                for (w, m) in blocks[b].0.iter_mut().zip(mask) {
                    *w |= m;
                }
            }
            RunFilter::Classic(f) => {
                f.insert_hash(h);
            }
        }
    }

    /// Brings the cache line an insert of `h` will write: a writer that inserts a few keys
    /// later overlaps the miss with its own work instead of waiting on it.
    #[inline]
    pub fn prefetch(&self, h: u64) {
        if let RunFilter::SplitBlock(blocks) = self {
            let (b, _) = slot(h, blocks.len());
            prefetch_read(&blocks[b]);
        }
    }

    /// `false`: no key of this hash was inserted.
    #[inline]
    pub fn contains_hash(&self, h: u64) -> bool {
        match self {
            RunFilter::SplitBlock(blocks) => {
                let (b, mask) = slot(h, blocks.len());
                blocks[b].0.iter().zip(mask).all(|(w, m)| w & m != 0)
            }
            RunFilter::Classic(f) => f.contains_hash(h),
        }
    }

    /// Heap bytes of the filter.
    pub fn bytes(&self) -> u64 {
        match self {
            RunFilter::SplitBlock(blocks) => blocks.len() as u64 * 32,
            RunFilter::Classic(f) => (f.num_bits() / 8) as u64,
        }
    }

    /// Appends the stored form: `hashes u32, words u64`, then the words (little endian).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            RunFilter::SplitBlock(blocks) => {
                out.reserve(12 + blocks.len() * 32);
                out.extend_from_slice(&SPLIT_BLOCK.to_le_bytes());
                out.extend_from_slice(&(blocks.len() as u64 * 4).to_le_bytes());
                for block in blocks.iter() {
                    for w in block.0 {
                        out.extend_from_slice(&w.to_le_bytes());
                    }
                }
            }
            RunFilter::Classic(f) => {
                let words = f.as_slice();
                out.reserve(12 + words.len() * 8);
                out.extend_from_slice(&f.num_hashes().to_le_bytes());
                out.extend_from_slice(&(words.len() as u64).to_le_bytes());
                for w in words {
                    out.extend_from_slice(&w.to_le_bytes());
                }
            }
        }
    }

    /// Reads what [`RunFilter::encode_into`] wrote, the whole of `b`; `None` when it is
    /// not one filter (damage: the caller reports the run row as corrupt).
    pub fn decode(b: &[u8]) -> Option<RunFilter> {
        let hashes = u32::from_le_bytes(b.get(..4)?.try_into().ok()?);
        let n = usize::try_from(u64::from_le_bytes(b.get(4..12)?.try_into().ok()?)).ok()?;
        let body = b.get(12..)?;
        if n == 0 || body.len() != n.checked_mul(8)? {
            return None;
        }
        let words = body
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()));
        match hashes {
            SPLIT_BLOCK => {
                if n % 4 != 0 {
                    return None;
                }
                let blocks = body
                    .chunks_exact(32)
                    .map(|c| {
                        let mut block = Block::default();
                        for (w, bytes) in block.0.iter_mut().zip(c.chunks_exact(4)) {
                            *w = u32::from_le_bytes(bytes.try_into().unwrap_or_default());
                        }
                        block
                    })
                    .collect();
                Some(RunFilter::SplitBlock(blocks))
            }
            // A damaged hash count would make every probe loop billions of times.
            h if h <= MAX_CLASSIC_HASHES => Some(RunFilter::Classic(
                BloomFilter::from_vec(words.collect()).hashes(h),
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::state::run::key_hash;

    fn keys(from: u64, n: u64) -> impl Iterator<Item = u64> {
        (from..from + n).map(|i| key_hash(format!("uorder-{i:016x}").as_bytes()))
    }

    #[test]
    fn a_split_block_filter_holds_every_key_and_rules_out_about_99_in_100_others() {
        let mut f = RunFilter::for_entries(100_000);
        for h in keys(0, 100_000) {
            f.insert_hash(h);
        }
        assert!(keys(0, 100_000).all(|h| f.contains_hash(h)));
        let false_positives = keys(1 << 40, 200_000)
            .filter(|h| f.contains_hash(*h))
            .count();
        let rate = false_positives as f64 / 200_000.0;
        assert!(rate < 0.015, "false positives {rate}");
        assert!(
            rate > 0.0,
            "a filter of 10 bits a key that never errs is not one"
        );
        assert_eq!(f.bytes(), 100_000 * 10 / 256 * 32 + 32);
    }

    #[test]
    fn both_kinds_read_back_as_written() {
        let mut split = RunFilter::for_entries(5_000);
        let mut classic = RunFilter::Classic(BloomFilter::with_num_bits(50_000).hashes(7));
        for h in keys(0, 5_000) {
            split.insert_hash(h);
            classic.insert_hash(h);
        }
        for f in [split, classic] {
            let mut stored = Vec::new();
            f.encode_into(&mut stored);
            let back = RunFilter::decode(&stored).expect("decodes");
            assert_eq!(back.bytes(), f.bytes());
            assert!(keys(0, 5_000).all(|h| back.contains_hash(h)));
            let agree = keys(1 << 40, 20_000).all(|h| back.contains_hash(h) == f.contains_hash(h));
            assert!(agree, "the read filter answers as the written one");
            assert!(matches!(
                (&f, &back),
                (RunFilter::SplitBlock(_), RunFilter::SplitBlock(_))
                    | (RunFilter::Classic(_), RunFilter::Classic(_))
            ));
        }
    }

    #[test]
    fn damaged_filters_are_refused() {
        let mut stored = Vec::new();
        RunFilter::for_entries(1_000).encode_into(&mut stored);
        assert!(RunFilter::decode(&stored[..stored.len() - 1]).is_none());
        let mut odd = stored.clone();
        // Six words: not whole blocks.
        odd[4..12].copy_from_slice(&6u64.to_le_bytes());
        odd.truncate(12 + 48);
        assert!(RunFilter::decode(&odd).is_none());
        let mut hashes = stored.clone();
        hashes[..4].copy_from_slice(&1_000_000u32.to_le_bytes());
        assert!(RunFilter::decode(&hashes).is_none());
        assert!(RunFilter::decode(&[]).is_none());
    }
}
