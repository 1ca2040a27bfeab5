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
pub enum FilterBuilder {
    /// Fewer than 64 keys at most: an exact list, as `from_halves` makes.
    Halves(Vec<u64>),
    Blocked(Box<[Block]>),
}

impl FilterBuilder {
    pub fn for_at_most(keys: usize) -> FilterBuilder {
        if keys < 64 {
            FilterBuilder::Halves(Vec::with_capacity(keys))
        } else {
            FilterBuilder::Blocked(empty_blocks(keys))
        }
    }

    #[inline]
    pub fn insert(&mut self, key: u128) {
        match self {
            FilterBuilder::Halves(v) => v.push(half(key)),
            FilterBuilder::Blocked(blocks) => set_blocked(blocks, half(key)),
        }
    }

    pub fn finish(self) -> GenFilter {
        match self {
            FilterBuilder::Halves(v) => GenFilter::from_halves(v),
            FilterBuilder::Blocked(blocks) => GenFilter::Blocked(blocks),
        }
    }

    /// Heap bytes held.
    pub fn memory_bytes(&self) -> usize {
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
    #[allow(unsafe_code)]
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
    pub fn from_halves(mut halves: Vec<u64>) -> GenFilter {
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
    pub fn prefetch(&self, key: u128) {
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
    pub fn memory_bytes(&self) -> usize {
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
    pub fn encode(&self) -> Vec<u8> {
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
    pub fn decode(b: &[u8]) -> Result<GenFilter, String> {
        match b.first() {
            Some(&FILTER_VERSION) => {
                let body_len = b
                    .len()
                    .checked_sub(CHECKSUM_BYTES)
                    .ok_or("filter record is truncated")?;
                let (body, sum) = b.split_at(body_len);
                let mut stored = [0u8; CHECKSUM_BYTES];
                stored.copy_from_slice(sum);
                if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(stored) {
                    return Err("filter record fails its checksum".into());
                }
                Self::decode_body(body)
            }
            // Written before checksums: taken as it is (its structure is still checked).
            Some(&FILTER_VERSION_UNCHECKED) => Self::decode_body(b),
            _ => Err("filter record has an unknown version".into()),
        }
    }

    /// Decodes `version u8 | kind u8 | payload` without a checksum.
    fn decode_body(b: &[u8]) -> Result<GenFilter, String> {
        let take = |at: usize, n: usize| -> Result<&[u8], String> {
            b.get(at..at + n)
                .ok_or_else(|| "filter record is truncated".to_string())
        };
        let u64_at = |at: usize| -> Result<u64, String> {
            let mut x = [0u8; 8];
            x.copy_from_slice(take(at, 8)?);
            Ok(u64::from_le_bytes(x))
        };
        let u32_at = |at: usize| -> Result<u32, String> {
            let mut x = [0u8; 4];
            x.copy_from_slice(take(at, 4)?);
            Ok(u32::from_le_bytes(x))
        };
        if b.len() < 2 {
            return Err("filter record is truncated".into());
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
                let body = take(30, n.checked_mul(2).ok_or("filter length overflows")?)?;
                if b.len() != 30 + n * 2 {
                    return Err("filter record has trailing bytes".into());
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
                    return Err("filter record has an inconsistent descriptor".into());
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
                let body = take(10, n.checked_mul(8).ok_or("filter length overflows")?)?;
                if b.len() != 10 + body.len() {
                    return Err("filter record has trailing bytes".into());
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
                    return Err("filter record lists its keys out of order".into());
                }
                Ok(GenFilter::Exact(halves))
            }
            KIND_BLOCKED => {
                let n = u64_at(2)? as usize;
                let body = take(10, n.checked_mul(32).ok_or("filter length overflows")?)?;
                if b.len() != 10 + body.len() {
                    return Err("filter record has trailing bytes".into());
                }
                // A probe indexes a block: a filter without one has nothing to read.
                if n == 0 {
                    return Err("blocked filter record has no blocks".into());
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
            k => Err(format!("filter kind {k} is unknown")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing;
    use proptest::prelude::*;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    #[test]
    fn no_false_negatives_and_low_false_positive_rate() {
        let mut rng = SmallRng::seed_from_u64(7);
        let keys: Vec<u128> = (0..100_000).map(|_| rng.random()).collect();
        let f = GenFilter::build(keys.iter().copied());
        assert!(matches!(f, GenFilter::Blocked(_)));
        let mut halves: Vec<u64> = keys.iter().map(|k| half(*k)).collect();
        halves.sort_unstable();
        let fuse = GenFilter::fuse(&halves);
        assert!(matches!(fuse, GenFilter::Fuse(_)));
        let probes = 2_000_000;
        let absent: Vec<u128> = (0..probes).map(|_| rng.random()).collect();
        for (f, rate, bytes_per_key) in [(&f, 0.003, 2.0), (&fuse, 0.0001, 2.5)] {
            assert!(keys.iter().all(|k| f.may_contain(*k)));
            let fp = absent.iter().filter(|k| f.may_contain(**k)).count();
            eprintln!(
                "{fp} false positives of {probes}, {} bytes",
                f.memory_bytes()
            );
            assert!(
                (fp as f64) < probes as f64 * rate,
                "false positives: {fp} of {probes}"
            );
            assert!(f.memory_bytes() as f64 <= keys.len() as f64 * bytes_per_key + 32.0);
        }
    }

    /// A merge's filter, built key by key, is the filter of its keys built at once (same
    /// encoding, so same answers), for exact lists and blocked filters; with keys dropped
    /// it keeps its inputs' size and still says "maybe" for every key it holds (G3).
    #[test]
    fn a_filter_built_key_by_key_is_the_one_built_at_once() {
        let mut rng = SmallRng::seed_from_u64(11);
        for n in [0usize, 1, 63, 64, 1_000, 100_000] {
            let keys: Vec<u128> = (0..n).map(|_| rng.random()).collect();
            let mut b = FilterBuilder::for_at_most(n);
            for k in &keys {
                b.insert(*k);
            }
            let built = b.finish();
            let at_once = GenFilter::build(keys.iter().copied());
            assert_eq!(built.encode(), at_once.encode(), "{n} keys");
        }
        let keys: Vec<u128> = (0..50_000).map(|_| rng.random()).collect();
        let mut b = FilterBuilder::for_at_most(80_000);
        let bytes = b.memory_bytes();
        for k in &keys {
            b.insert(*k);
        }
        let f = b.finish();
        assert_eq!(f.memory_bytes(), bytes);
        assert!(keys.iter().all(|k| f.may_contain(*k)));
    }

    #[test]
    fn fuse_slots_are_the_ones_contains_reads() {
        let keys: Vec<u128> = (0..200_000u128)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
            .collect();
        let mut halves: Vec<u64> = keys.iter().map(|k| half(*k)).collect();
        halves.sort_unstable();
        let GenFilter::Fuse(mut f) = GenFilter::fuse(&halves) else {
            panic!("a fuse filter for 200k keys");
        };
        // Changing any one of a key's three slots changes what `contains` computes for it:
        // a key of the filter then reads as absent, so the slots are exactly its reads.
        for (n, &key) in keys.iter().step_by(997).enumerate() {
            let slot = fuse_slots(&f, key)[n % 3];
            assert!(f.contains(&half(key)));
            f.fingerprints[slot] ^= 1;
            assert!(!f.contains(&half(key)), "slot {slot} of key {key:x}");
            f.fingerprints[slot] ^= 1;
        }
    }

    #[test]
    fn encode_decode_round_trip() {
        let mut rng = SmallRng::seed_from_u64(8);
        for n in [0usize, 5, 63, 64, 5000] {
            let keys: Vec<u128> = (0..n).map(|_| rng.random()).collect();
            let f = GenFilter::build(keys.iter().copied());
            let g = GenFilter::decode(&f.encode()).expect("decode");
            assert!(keys.iter().all(|k| g.may_contain(*k)));
            assert_eq!(f.memory_bytes(), g.memory_bytes());
        }
    }

    /// A fuse filter over `keys`, as data directories written before blocked filters hold.
    fn fuse_of(keys: impl Iterator<Item = u128>) -> GenFilter {
        let mut halves: Vec<u64> = keys.map(half).collect();
        halves.sort_unstable();
        halves.dedup();
        GenFilter::fuse(&halves)
    }

    /// Every field of a fuse descriptor changed alone: the record either decodes to a
    /// filter that answers lookups without panicking, or is refused (then rebuilt).
    #[test]
    fn a_decodable_but_inconsistent_descriptor_is_refused_not_a_panic() {
        let keys: Vec<u128> = (0..5000u128)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let good = fuse_of(keys.iter().copied()).encode();
        // seed 2..10, segment_length 10..14, mask 14..18, segment_count_length 18..22.
        let mut refused = 0;
        for (at, value) in [
            (18, u32::MAX),
            (18, 1 << 30),
            (10, 1 << 20),
            (10, 3),
            (14, u32::MAX),
            (10, 0),
        ] {
            let mut bytes = good.clone();
            bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
            match GenFilter::decode(&resealed(bytes)) {
                Ok(f) => {
                    for k in &keys {
                        f.may_contain(*k);
                    }
                }
                Err(e) => {
                    assert!(e.contains("inconsistent"), "{e}");
                    refused += 1;
                }
            }
        }
        assert_eq!(refused, 6);
        // Real filters of every size and kind still decode and keep every key.
        for n in [64usize, 65, 100, 1000, 4096, 70_000, 300_000] {
            let keys: Vec<u128> = (0..n as u128).map(|i| i * 7919 + 3).collect();
            for f in [
                GenFilter::build(keys.iter().copied()),
                fuse_of(keys.iter().copied()),
            ] {
                let f = GenFilter::decode(&f.encode()).expect("a real filter decodes");
                assert!(keys.iter().all(|k| f.may_contain(*k)), "n = {n}");
            }
        }
    }

    /// `b` with its checksum made right again, so a change reaches the structure checks.
    fn resealed(mut b: Vec<u8>) -> Vec<u8> {
        if b.len() >= CHECKSUM_BYTES {
            let at = b.len() - CHECKSUM_BYTES;
            let sum = xxhash_rust::xxh3::xxh3_64(&b[..at]);
            b[at..].copy_from_slice(&sum.to_le_bytes());
        }
        b
    }

    /// A version-1 record (no checksum) with the same body.
    fn unchecked(b: &[u8]) -> Vec<u8> {
        let mut v = b[..b.len() - CHECKSUM_BYTES].to_vec();
        v[0] = FILTER_VERSION_UNCHECKED;
        v
    }

    /// A valid record: a filter over up to 300 keys (an exact list below 64), blocked as
    /// built today or fuse as older data directories hold.
    fn valid_record() -> impl Strategy<Value = Vec<u8>> {
        (prop::collection::vec(any::<u128>(), 0..300), any::<bool>()).prop_map(|(keys, fuse)| {
            if fuse {
                fuse_of(keys.into_iter()).encode()
            } else {
                GenFilter::build(keys.into_iter()).encode()
            }
        })
    }

    /// A valid record as version 1 wrote it: without a checksum, so byte changes reach
    /// the structure checks.
    fn valid_unchecked_record() -> impl Strategy<Value = Vec<u8>> {
        valid_record().prop_map(|b| unchecked(&b))
    }

    /// A valid fuse record with one descriptor field (seed 2..10, segment_length 10..14,
    /// mask 14..18, segment_count_length 18..22) or the fingerprint count (22..30) set.
    fn descriptor_changed() -> impl Strategy<Value = Vec<u8>> {
        let value = prop_oneof![
            any::<u32>(),
            (0u32..32).prop_map(|s| 1u32 << s),
            (0u32..32).prop_map(|s| (1u32 << s) - 1),
            0u32..1024,
        ];
        (
            prop::collection::vec(any::<u128>(), 64..400),
            prop::sample::select(vec![2usize, 6, 10, 14, 18, 22, 26]),
            value,
        )
            .prop_map(|(keys, at, value)| {
                let mut b = fuse_of(keys.into_iter()).encode();
                b[at..at + 4].copy_from_slice(&value.to_le_bytes());
                resealed(b)
            })
    }

    /// What a decoded filter must do whatever bytes it came from: answer lookups without
    /// panicking, hold no more than the record's bytes, re-encode to the record (nothing
    /// ignored), and find every key an exact list holds (a "no" for a stored key would
    /// process a message twice).
    fn check_decoded(bytes: &[u8]) -> Result<(), TestCaseError> {
        let Ok(f) = GenFilter::decode(bytes) else {
            return Ok(());
        };
        fuzzing::decoded();
        let encoded = f.encode();
        if bytes[0] == FILTER_VERSION {
            prop_assert_eq!(&encoded[..], bytes, "re-encoded differently");
        } else {
            prop_assert_eq!(unchecked(&encoded), bytes, "re-encoded differently");
        }
        prop_assert!(f.memory_bytes() <= bytes.len());
        let mut probe = 0x9E37_79B9_7F4A_7C15_u128;
        for _ in 0..256 {
            probe = probe.wrapping_mul(0x2545_F491_4F6C_DD1D).wrapping_add(1);
            f.may_contain(probe);
        }
        if let GenFilter::Exact(v) = &f {
            for k in v {
                prop_assert!(f.may_contain(u128::from(*k)), "listed key {k} not found");
            }
        }
        Ok(())
    }

    #[test]
    fn fuzz_filter_decode_of_hostile_bytes_refuses_or_answers() {
        fuzzing::run(
            "filter_decode",
            3000,
            fuzzing::hostile(600, valid_record()),
            |b| check_decoded(&b),
        );
    }

    /// The same on version-1 records, which have no checksum to stop changed bytes.
    #[test]
    fn fuzz_unchecked_filter_decode_of_hostile_bytes_refuses_or_answers() {
        fuzzing::run(
            "filter_decode_unchecked",
            3000,
            fuzzing::hostile(600, valid_unchecked_record()),
            |b| check_decoded(&b),
        );
    }

    #[test]
    fn fuzz_filter_decode_of_changed_descriptors_refuses_or_answers() {
        fuzzing::run("filter_descriptor", 1500, descriptor_changed(), |b| {
            check_decoded(&b)
        });
    }

    #[test]
    fn fuzz_filter_round_trip_keeps_every_key() {
        let keys = prop::collection::vec(any::<u128>(), 0..3000);
        fuzzing::run("filter_round_trip", 300, keys, |keys| {
            for f in [
                GenFilter::build(keys.iter().copied()),
                fuse_of(keys.iter().copied()),
            ] {
                let bytes = f.encode();
                let g = GenFilter::decode(&bytes).map_err(TestCaseError::fail)?;
                fuzzing::decoded();
                prop_assert_eq!(g.encode(), bytes);
                prop_assert!(keys.iter().all(|k| g.may_contain(*k)));
            }
            Ok(())
        });
    }

    /// A probe picks one of a blocked filter's blocks: a record with none would index an
    /// empty slice on the first lookup, so it is refused (and rebuilt).
    #[test]
    fn a_blocked_filter_without_blocks_is_refused_not_a_panic() {
        let mut bytes = vec![FILTER_VERSION, KIND_BLOCKED];
        bytes.extend_from_slice(&0u64.to_le_bytes());
        let e = GenFilter::decode(&resealed([bytes, vec![0; CHECKSUM_BYTES]].concat()))
            .expect_err("no blocks");
        assert!(e.contains("no blocks"), "{e}");
    }

    /// The block a prefetch loads is the one `may_contain` reads: clearing one bit of that
    /// block in a key's mask makes the key read as absent.
    #[test]
    fn the_prefetched_block_is_the_one_a_probe_reads() {
        let keys: Vec<u128> = (0..50_000u128)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
            .collect();
        let GenFilter::Blocked(mut blocks) = GenFilter::build(keys.iter().copied()) else {
            panic!("a blocked filter for 50k keys");
        };
        for &key in keys.iter().step_by(499) {
            let h = blocked_hash(key);
            let (b, mask) = blocked_slot(h, blocks.len());
            assert_eq!(b, blocked_block(h, blocks.len()));
            let saved = blocks[b];
            blocks[b].0[3] &= !mask[3];
            let f = GenFilter::Blocked(blocks.clone());
            assert!(!f.may_contain(key), "key {key:x}");
            blocks[b] = saved;
        }
    }

    /// Found by `fuzz_filter_decode_of_hostile_bytes_refuses_or_answers`: an exact list
    /// out of order decoded, and its binary search then answered "certainly absent" for
    /// a key it holds (here 256), so a redelivery would skip the store and run again (G2).
    #[test]
    fn an_exact_list_out_of_order_is_refused_not_a_false_no() {
        let mut bytes = vec![1, 2, 4, 0, 0, 0, 0, 0, 0, 0];
        for k in [256u64, 1, 2, 3] {
            bytes.extend_from_slice(&k.to_le_bytes());
        }
        let e = GenFilter::decode(&bytes).expect_err("an unsorted list is refused");
        assert!(e.contains("out of order"), "{e}");
        // A repeated key is out of order too (`build` dedups).
        let repeated = GenFilter::Exact(vec![5, 5]).encode();
        assert!(GenFilter::decode(&repeated).is_err());
        let mut empty = unchecked(&repeated);
        empty.truncate(10);
        empty[2] = 0;
        assert!(matches!(GenFilter::decode(&empty), Ok(GenFilter::Exact(v)) if v.is_empty()));
    }

    /// Found by the same target: bytes after an exact list were ignored, so a record cut
    /// or overwritten past its count still decoded.
    #[test]
    fn an_exact_list_with_trailing_bytes_is_refused() {
        let checked = GenFilter::build((0..10u128).map(|i| i * 7919)).encode();
        let mut bytes = unchecked(&checked);
        assert!(GenFilter::decode(&bytes).is_ok());
        bytes.push(0);
        let e = GenFilter::decode(&bytes).expect_err("trailing bytes are refused");
        assert!(e.contains("trailing"), "{e}");
        let mut bytes = checked;
        bytes.push(0);
        assert!(GenFilter::decode(&bytes).is_err());
        assert!(GenFilter::decode(&resealed(bytes)).is_err());
    }

    /// A flipped bit in a stored filter (a disk that lost it, a stray write): in an exact
    /// list it can move a key so that the list stays sorted and says "certainly absent"
    /// for the key it lost; in a fuse filter it breaks the fingerprints of keys that map to
    /// it. Either way a redelivery of such a key would run again (G2). The checksum refuses
    /// every single-bit change of a record, so the filter is rebuilt from the table instead.
    #[test]
    fn every_flipped_bit_fails_the_checksum() {
        let small: Vec<u128> = (1..=40u128).map(|i| i << 20).collect();
        let large: Vec<u128> = (0..2000u128).map(|i| i * 7919 + 3).collect();
        for (keys, fuse) in [(&small, false), (&large, false), (&large, true)] {
            let good = if fuse {
                fuse_of(keys.iter().copied()).encode()
            } else {
                GenFilter::build(keys.iter().copied()).encode()
            };
            let mut lost_a_key = 0;
            for bit in 0..good.len() * 8 {
                let mut bytes = good.clone();
                bytes[bit / 8] ^= 1 << (bit % 8);
                let e = GenFilter::decode(&bytes).expect_err("a flipped bit is refused");
                assert!(
                    e.contains("checksum") || e.contains("version"),
                    "bit {bit}: {e}"
                );
                // What the bit would have done without the checksum.
                if let Ok(f) = GenFilter::decode(&unchecked(&bytes)) {
                    if !keys.iter().all(|k| f.may_contain(*k)) {
                        lost_a_key += 1;
                    }
                }
            }
            assert!(
                lost_a_key > 0,
                "no flipped bit lost a key: the test shows nothing"
            );
        }
    }

    #[test]
    fn corrupt_filter_is_an_error() {
        let f = GenFilter::build((0..1000u128).map(|i| i * 7919));
        let bytes = f.encode();
        assert!(GenFilter::decode(&bytes[..bytes.len() - 3]).is_err());
        assert!(GenFilter::decode(&[9, 9]).is_err());
    }
}
