//! Membership filters of sealed generations.
//!
//! A sealed generation never changes, so its filter is built once. Built today: a
//! split-block Bloom filter (as Parquet's; 16 bits per key, false positives ~0.13 %), whose
//! probe reads **one** cache line. Until 2026-12-02 generations got a static binary fuse
//! filter (xorf `BinaryFuse16`: ~18 bits per key, false positives ~0.0015 %, but three
//! reads on three pages per probe); those are still read, and rebuilt as blocked filters
//! when their generations merge. A new key is probed in every sealed generation of its
//! shard (~11 at 100M claims), so the lines per probe decide the claim path's speed there:
//! 1.05-1.17x at 100M in three alternating pairs (`docs/bench-history.md`), for ~85x the false
//! positives, each a block read in the store that finds nothing. The active generation
//! needs no filter: its exact index is in memory.
//!
//! A filter may only say "no" or "maybe" (G3): a "maybe" is always confirmed in the store.

use xorf::{BinaryFuse16, Descriptor, Filter};

/// The filter of one sealed generation.
#[derive(Debug, Clone)]
pub enum GenFilter {
    Fuse(BinaryFuse16),
    /// Small or degenerate key sets: a sorted list of the 64-bit key halves.
    Exact(Vec<u64>),
    /// A split-block Bloom filter (as Parquet's): every key sets one bit in each of the
    /// eight 32-bit words of one 32-byte block, so a probe reads one cache line.
    Blocked(Box<[Block]>),
}

/// One block of a [`GenFilter::Blocked`]: aligned so it never straddles two cache lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(32))]
pub struct Block([u32; 8]);

/// Bits of a blocked filter per key.
const BLOCKED_BITS_PER_KEY: usize = 16;
/// The odd constants that pick a key's bit in each word (Parquet's).
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

/// A key's half mixed (murmur3's finalizer), so keys that are not uniform hashes still
/// spread over the blocks and bits.
#[inline]
fn blocked_hash(key: u128) -> u64 {
    let mut k = half(key);
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The block of hash `h` among `n` blocks.
#[inline]
fn blocked_block(h: u64, n: usize) -> usize {
    (((h >> 32) * n as u64) >> 32) as usize
}

/// The block of hash `h` among `n` blocks, and the mask of its bit in each word.
#[inline]
fn blocked_slot(h: u64, n: usize) -> (usize, [u32; 8]) {
    let block = blocked_block(h, n);
    let low = h as u32;
    let mut mask = [0u32; 8];
    for (m, salt) in mask.iter_mut().zip(SALT) {
        *m = 1 << (low.wrapping_mul(salt) >> 27);
    }
    (block, mask)
}

/// The zeroed blocks of a blocked filter for `keys` keys (at least one block).
fn empty_blocks(keys: usize) -> Box<[Block]> {
    let n = (keys * BLOCKED_BITS_PER_KEY).div_ceil(256).max(1);
    vec![Block::default(); n].into_boxed_slice()
}

/// Sets the bits of a key's half `h` in a blocked filter.
#[inline]
fn set_blocked(blocks: &mut [Block], h: u64) {
    let (b, mask) = blocked_slot(blocked_hash(u128::from(h)), blocks.len());
    for (w, m) in blocks[b].0.iter_mut().zip(mask) {
        *w |= m;
    }
}

/// A filter built key by key while a merge writes its output in slices, sized up front for
/// the most keys the output can hold (the inputs' counts). It replaces a list of every
/// merged key's half (8 bytes a claim, 64 MB per 8M-claim merge, held until the merge
/// ended and then sorted on the builder thread) by the filter itself (2 bytes a claim).
/// The result is the filter [`GenFilter::from_halves`] builds for the same keys, when
/// none was dropped; a merge that drops expired claims keeps the size of its inputs.
#[derive(Debug)]
pub(crate) enum FilterBuilder {
    /// Fewer than 64 keys at most: an exact list, as `from_halves` makes.
    Halves(Vec<u64>),
    Blocked(Box<[Block]>),
}

impl FilterBuilder {
    pub(crate) fn for_at_most(keys: usize) -> FilterBuilder {
        if keys < 64 {
            FilterBuilder::Halves(Vec::with_capacity(keys))
        } else {
            FilterBuilder::Blocked(empty_blocks(keys))
        }
    }

    #[inline]
    pub(crate) fn insert(&mut self, key: u128) {
        match self {
            FilterBuilder::Halves(v) => v.push(half(key)),
            FilterBuilder::Blocked(blocks) => set_blocked(blocks, half(key)),
        }
    }

    pub(crate) fn finish(self) -> GenFilter {
        match self {
            FilterBuilder::Halves(v) => GenFilter::from_halves(v),
            FilterBuilder::Blocked(blocks) => GenFilter::Blocked(blocks),
        }
    }

    /// Heap bytes held.
    pub(crate) fn memory_bytes(&self) -> usize {
        match self {
            FilterBuilder::Halves(v) => v.capacity() * 8,
            FilterBuilder::Blocked(b) => b.len() * 32,
        }
    }
}

/// Version 1 had no checksum; version 2 ends with the xxh3-64 of everything before it.
const FILTER_VERSION_UNCHECKED: u8 = 1;
const FILTER_VERSION: u8 = 2;
const CHECKSUM_BYTES: usize = 8;
const KIND_FUSE: u8 = 1;
const KIND_EXACT: u8 = 2;
const KIND_BLOCKED: u8 = 3;

/// The part of a key a filter holds.
#[inline]
pub(crate) fn half(key: u128) -> u64 {
    key as u64
}

/// The three fingerprint slots a `BinaryFuse16` probe of `key` reads: xorf 0.13's
/// `mix` (murmur3's finalizer over key + seed) and `hash_of_hash`, which its crate keeps
/// private. `fuse_slots_are_the_ones_contains_reads` fails if a new xorf hashes otherwise.
#[inline]
fn fuse_slots(f: &BinaryFuse16, key: u128) -> [usize; 3] {
    let d = &f.descriptor;
    let mut k = half(key).wrapping_add(d.seed);
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    let h0 = ((k as u128 * d.segment_count_length as u128) >> 64) as u32;
    let h1 = (h0 + d.segment_length) ^ (((k >> 18) as u32) & d.segment_length_mask);
    let h2 = (h0 + 2 * d.segment_length) ^ ((k as u32) & d.segment_length_mask);
    [h0 as usize, h1 as usize, h2 as usize]
}

#[inline]
fn prefetch_read<T>(p: *const T) {
    // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has; a prefetch is a hint
    // that never faults and reads nothing into the program, whatever the address.
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code, reason = "a prefetch hint; see SAFETY")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

impl GenFilter {
    /// Builds a filter over the keys of a generation.
    pub fn build(keys: impl Iterator<Item = u128>) -> GenFilter {
        Self::from_halves(keys.map(half).collect())
    }

    /// Builds a filter from the keys' low 64-bit halves (`half`), in any order (sorted in
    /// place: a merge of 8M claims hands over 64 MB, not a 128 MB list of whole keys and a
    /// copy).
    pub(crate) fn from_halves(mut halves: Vec<u64>) -> GenFilter {
        halves.sort_unstable();
        halves.dedup();
        if halves.len() < 64 {
            return GenFilter::Exact(halves);
        }
        Self::blocked(&halves)
    }

    /// A blocked filter over the halves (at least one block).
    fn blocked(halves: &[u64]) -> GenFilter {
        let mut blocks = empty_blocks(halves.len());
        for &h in halves {
            set_blocked(&mut blocks, h);
        }
        GenFilter::Blocked(blocks)
    }

    /// A binary fuse filter over the halves (sorted, without repeats).
    #[cfg(test)]
    fn fuse(halves: &[u64]) -> GenFilter {
        match BinaryFuse16::try_from(halves) {
            Ok(f) => GenFilter::Fuse(f),
            // Construction can fail only on pathological input; an exact list is always right.
            Err(_) => GenFilter::Exact(halves.to_vec()),
        }
    }

    /// `false` means certainly absent; `true` means "look it up".
    #[inline]
    pub fn may_contain(&self, key: u128) -> bool {
        match self {
            GenFilter::Fuse(f) => f.contains(&half(key)),
            GenFilter::Exact(v) => v.binary_search(&half(key)).is_ok(),
            GenFilter::Blocked(blocks) => {
                let (b, mask) = blocked_slot(blocked_hash(key), blocks.len());
                let words = &blocks[b].0;
                words.iter().zip(mask).all(|(w, m)| w & m != 0)
            }
        }
    }

    /// Starts loading the memory `may_contain(key)` will read. A probe of a large filter is
    /// three cache misses (one per segment, each on its own page); a batch that prefetches
    /// its next keys' slots overlaps those misses with the work on the current key. Only a
    /// hint: it reads nothing and changes nothing.
    #[inline]
    pub(crate) fn prefetch(&self, key: u128) {
        match self {
            GenFilter::Fuse(f) => {
                let base = f.fingerprints.as_ptr();
                for slot in fuse_slots(f, key) {
                    prefetch_read(base.wrapping_add(slot));
                }
            }
            GenFilter::Blocked(blocks) => {
                let b = blocked_block(blocked_hash(key), blocks.len());
                prefetch_read(blocks.as_ptr().wrapping_add(b));
            }
            GenFilter::Exact(_) => {}
        }
    }

    /// Heap bytes held.
    pub(crate) fn memory_bytes(&self) -> usize {
        match self {
            GenFilter::Fuse(f) => f.fingerprints.len() * 2,
            GenFilter::Exact(v) => v.len() * 8,
            GenFilter::Blocked(b) => b.len() * 32,
        }
    }

    /// Layout: `version u8 | kind u8 | payload | xxh3-64 of the bytes before it (LE)`; the
    /// fuse payload is the descriptor then LE u16s. The checksum is what catches a flipped
    /// bit: a filter that decodes but lost a key would say "certainly absent" for it, and
    /// a redelivery of that key would run again (G2).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = vec![FILTER_VERSION];
        match self {
            GenFilter::Fuse(f) => {
                out.push(KIND_FUSE);
                let d = &f.descriptor;
                out.extend_from_slice(&d.seed.to_le_bytes());
                out.extend_from_slice(&d.segment_length.to_le_bytes());
                out.extend_from_slice(&d.segment_length_mask.to_le_bytes());
                out.extend_from_slice(&d.segment_count_length.to_le_bytes());
                out.extend_from_slice(&(f.fingerprints.len() as u64).to_le_bytes());
                out.reserve(f.fingerprints.len() * 2);
                for fp in f.fingerprints.iter() {
                    out.extend_from_slice(&fp.to_le_bytes());
                }
            }
            GenFilter::Exact(v) => {
                out.push(KIND_EXACT);
                out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                for k in v {
                    out.extend_from_slice(&k.to_le_bytes());
                }
            }
            GenFilter::Blocked(blocks) => {
                out.push(KIND_BLOCKED);
                out.extend_from_slice(&(blocks.len() as u64).to_le_bytes());
                out.reserve(blocks.len() * 32);
                for w in blocks.iter().flat_map(|b| b.0) {
                    out.extend_from_slice(&w.to_le_bytes());
                }
            }
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Decodes a persisted filter; `Err` means "rebuild it from the table".
    pub(crate) fn decode(b: &[u8]) -> Result<GenFilter, FilterDecodeError> {
        match b.first() {
            Some(&FILTER_VERSION) => {
                let body_len = b
                    .len()
                    .checked_sub(CHECKSUM_BYTES)
                    .ok_or(FilterDecodeError::Truncated)?;
                let (body, sum) = b.split_at(body_len);
                let mut stored = [0u8; CHECKSUM_BYTES];
                stored.copy_from_slice(sum);
                if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(stored) {
                    return Err(FilterDecodeError::Checksum);
                }
                Self::decode_body(body)
            }
            // Written before checksums: taken as it is (its structure is still checked).
            Some(&FILTER_VERSION_UNCHECKED) => Self::decode_body(b),
            _ => Err(FilterDecodeError::UnknownVersion),
        }
    }

    /// Decodes `version u8 | kind u8 | payload` without a checksum.
    fn decode_body(b: &[u8]) -> Result<GenFilter, FilterDecodeError> {
        let take = |at: usize, n: usize| -> Result<&[u8], FilterDecodeError> {
            b.get(at..at + n).ok_or(FilterDecodeError::Truncated)
        };
        let u64_at = |at: usize| -> Result<u64, FilterDecodeError> {
            let mut x = [0u8; 8];
            x.copy_from_slice(take(at, 8)?);
            Ok(u64::from_le_bytes(x))
        };
        let u32_at = |at: usize| -> Result<u32, FilterDecodeError> {
            let mut x = [0u8; 4];
            x.copy_from_slice(take(at, 4)?);
            Ok(u32::from_le_bytes(x))
        };
        if b.len() < 2 {
            return Err(FilterDecodeError::Truncated);
        }
        match b[1] {
            KIND_FUSE => {
                let descriptor = Descriptor {
                    seed: u64_at(2)?,
                    segment_length: u32_at(10)?,
                    segment_length_mask: u32_at(14)?,
                    segment_count_length: u32_at(18)?,
                };
                let n = u64_at(22)? as usize;
                let body = take(30, n.checked_mul(2).ok_or(FilterDecodeError::Overflow)?)?;
                if b.len() != 30 + n * 2 {
                    return Err(FilterDecodeError::Trailing);
                }
                // `may_contain` indexes the fingerprints with positions the descriptor
                // yields (up to `segment_count_length + 2 * segment_length`), unchecked
                // by xorf: a record that decodes but disagrees with itself would panic
                // the shard on its first lookup. Such a record is rebuilt instead.
                let l = u64::from(descriptor.segment_length);
                let consistent = l.is_power_of_two()
                    && u64::from(descriptor.segment_length_mask) == l - 1
                    && u64::from(descriptor.segment_count_length) % l == 0
                    && u64::from(descriptor.segment_count_length) + 2 * l <= n as u64;
                if !consistent {
                    return Err(FilterDecodeError::Inconsistent);
                }
                let fingerprints: Box<[u16]> = body
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect();
                Ok(GenFilter::Fuse(BinaryFuse16 {
                    descriptor,
                    fingerprints,
                }))
            }
            KIND_EXACT => {
                let n = u64_at(2)? as usize;
                let body = take(10, n.checked_mul(8).ok_or(FilterDecodeError::Overflow)?)?;
                if b.len() != 10 + body.len() {
                    return Err(FilterDecodeError::Trailing);
                }
                let halves: Vec<u64> = body
                    .chunks_exact(8)
                    .map(|c| {
                        let mut x = [0u8; 8];
                        x.copy_from_slice(c);
                        u64::from_le_bytes(x)
                    })
                    .collect();
                // `may_contain` binary-searches the list: out of order, it would say
                // "certainly absent" for keys it holds, and a redelivery of one would
                // skip the store and run again (G2). `build` writes it sorted and
                // without repeats, so anything else is damage: rebuild it.
                if halves.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(FilterDecodeError::Unsorted);
                }
                Ok(GenFilter::Exact(halves))
            }
            KIND_BLOCKED => {
                let n = u64_at(2)? as usize;
                let body = take(10, n.checked_mul(32).ok_or(FilterDecodeError::Overflow)?)?;
                if b.len() != 10 + body.len() {
                    return Err(FilterDecodeError::Trailing);
                }
                // A probe indexes a block: a filter without one has nothing to read.
                if n == 0 {
                    return Err(FilterDecodeError::NoBlocks);
                }
                let blocks: Box<[Block]> = body
                    .chunks_exact(32)
                    .map(|c| {
                        let mut words = [0u32; 8];
                        for (w, b) in words.iter_mut().zip(c.chunks_exact(4)) {
                            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        }
                        Block(words)
                    })
                    .collect();
                Ok(GenFilter::Blocked(blocks))
            }
            k => Err(FilterDecodeError::UnknownKind(k)),
        }
    }
}

/// Why a persisted filter cannot be used as it is: the shard rebuilds it from its
/// generation's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum FilterDecodeError {
    #[error("filter record is truncated")]
    Truncated,
    #[error("filter record fails its checksum")]
    Checksum,
    #[error("filter record has an unknown version")]
    UnknownVersion,
    #[error("filter kind {0} is unknown")]
    UnknownKind(u8),
    #[error("filter length overflows")]
    Overflow,
    #[error("filter record has trailing bytes")]
    Trailing,
    /// A fuse filter whose descriptor disagrees with its length: a lookup would index
    /// past its fingerprints.
    #[error("filter record has an inconsistent descriptor")]
    Inconsistent,
    /// An exact filter's keys are not sorted without repeats.
    #[error("filter record lists its keys out of order")]
    Unsorted,
    #[error("blocked filter record has no blocks")]
    NoBlocks,
}

#[cfg(test)]
mod tests;
