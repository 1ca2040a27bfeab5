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
                assert!(e.to_string().contains("inconsistent"), "{e}");
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
            let g = GenFilter::decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
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
    assert!(e.to_string().contains("no blocks"), "{e}");
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
    assert!(e.to_string().contains("out of order"), "{e}");
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
    assert!(e.to_string().contains("trailing"), "{e}");
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
                e.to_string().contains("checksum") || e.to_string().contains("version"),
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
