//! Fuzz targets of the handler-state decoders (see `crate::fuzzing`): state log rows
//! (`log_row.rs`), stored run blocks, raw or zstd-compressed (`run.rs`), and the blocks of
//! the format-2 layout read once by the upgrade (`blocks.rs`). What a damaged row or block
//! may do is be refused; it may not panic, loop, or allocate from a length it carries.

use proptest::prelude::*;
use redb::{Database, ReadableTable, TableDefinition};

use super::blocks::Block;
use super::log_row::{decode_effects, encode_effects};
use super::run::{block_bytes, find_in_block, BlockCursor, Entry, RunWriter};
use crate::effects::Effects;
use crate::fuzzing;

fn effects() -> impl Strategy<Value = Effects> {
    let key = || fuzzing::bytes(12);
    (
        prop::collection::btree_map(key(), prop::option::of(fuzzing::bytes(40)), 0..8),
        prop::collection::btree_set(key(), 0..4),
        prop::collection::btree_map(".{0,8}", any::<u64>(), 0..4),
    )
        .prop_map(|(state, uniques, versions)| Effects {
            state,
            uniques,
            versions,
            outbox: Vec::new(),
        })
}

#[test]
fn fuzz_state_log_rows_round_trip() {
    fuzzing::run("state_log_row_round_trip", 500, effects(), |e| {
        prop_assert_eq!(decode_effects(&encode_effects(&e)), Some(e));
        Ok(())
    });
}

/// A row that decodes is stable (it re-encodes to a row that decodes to itself) and is no
/// bigger re-encoded than it was read: nothing was made up from a count or a length.
#[test]
fn fuzz_state_log_row_decode_refuses_or_is_stable() {
    let valid = effects().prop_map(|e| encode_effects(&e));
    fuzzing::run("state_log_row", 3000, fuzzing::hostile(300, valid), |b| {
        if let Some(e) = decode_effects(&b) {
            fuzzing::decoded();
            let again = encode_effects(&e);
            prop_assert!(again.len() <= b.len());
            prop_assert_eq!(decode_effects(&again), Some(e));
        }
        Ok(())
    });
}

const RUN: TableDefinition<&[u8], &[u8]> = TableDefinition::new("run");

/// Sorted distinct keys with values or tombstones, long shared prefixes likely.
fn run_entries() -> impl Strategy<Value = Vec<Entry>> {
    let key = prop::collection::vec(prop::sample::select(vec![0u8, 1, b'a', b'b', 0xff]), 0..24);
    let value = prop::option::of(fuzzing::bytes(300));
    prop::collection::btree_map(key, value, 0..80).prop_map(|m| m.into_iter().collect())
}

/// The stored blocks (last key, bytes) the real writer makes of `entries`.
fn write_run(entries: &[Entry], compress: bool) -> Vec<(Vec<u8>, Vec<u8>)> {
    let db = Database::builder()
        .create_with_backend(redb::backends::InMemoryBackend::new())
        .expect("in-memory database");
    let txn = db.begin_write().expect("write");
    {
        let mut t = txn.open_table(RUN).expect("table");
        let mut w = RunWriter::new(entries.len() as u64, compress);
        for (k, v) in entries {
            w.push(&mut t, k, v.as_deref()).expect("push");
        }
        w.finish(&mut t).expect("finish");
    }
    let t = txn.open_table(RUN).expect("table");
    let blocks = t
        .iter()
        .expect("iter")
        .map(|row| {
            let (k, v) = row.expect("row");
            (k.value().to_vec(), v.value().to_vec())
        })
        .collect();
    drop(t);
    txn.abort().expect("abort");
    blocks
}

/// Every entry of a raw block, or the reason it is refused; at most one entry per three
/// bytes, and no key longer than the block.
fn walk(raw: &[u8]) -> Result<Vec<Entry>, TestCaseError> {
    let mut cursor = BlockCursor::new(raw);
    let mut out = Vec::new();
    while let Ok(Some((k, v))) = cursor.next_entry() {
        prop_assert!(k.len() <= raw.len(), "a key longer than its block");
        out.push((k.to_vec(), v.map(<[u8]>::to_vec)));
        prop_assert!(out.len() <= raw.len() / 3, "more entries than bytes allow");
    }
    Ok(out)
}

#[test]
fn fuzz_runs_read_back_what_the_writer_wrote() {
    fuzzing::run(
        "run_block_round_trip",
        200,
        (run_entries(), any::<bool>()),
        |(entries, compress)| {
            let mut read = Vec::new();
            for (last, stored) in write_run(&entries, compress) {
                let raw = block_bytes(&stored).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let block = walk(&raw)?;
                prop_assert_eq!(block.last().map(|(k, _)| k), Some(&last));
                read.extend(block);
            }
            prop_assert_eq!(read, entries);
            Ok(())
        },
    );
}

/// A block search finds what a walk of the rebuilt keys finds, for every key the block
/// holds and for keys around, between and inside them (prefixes and extensions of keys
/// the block holds, from the same small alphabet).
#[test]
fn fuzz_block_search_answers_as_a_walk() {
    let probe = prop::collection::vec(prop::sample::select(vec![0u8, 1, b'a', b'b', 0xff]), 0..24);
    fuzzing::run(
        "run_block_search",
        300,
        (run_entries(), prop::collection::vec(probe, 0..40)),
        |(entries, probes)| {
            for (_, stored) in write_run(&entries, false) {
                let block = walk(&stored)?;
                let keys = block.iter().map(|(k, _)| k.clone());
                let around = keys.clone().flat_map(|k| {
                    let mut longer = k.clone();
                    longer.push(0);
                    let shorter = k[..k.len().saturating_sub(1)].to_vec();
                    [k, longer, shorter]
                });
                for key in around.chain(probes.iter().cloned()) {
                    let want = block
                        .iter()
                        .find(|(k, _)| *k == key)
                        .map(|(_, v)| v.as_deref());
                    let got = find_in_block(&stored, &key)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(got, want, "key {:?}", key);
                }
            }
            Ok(())
        },
    );
}

/// Stored blocks of real runs, raw or compressed, to mutate.
fn stored_block() -> impl Strategy<Value = Vec<u8>> {
    (run_entries(), any::<bool>(), any::<prop::sample::Index>()).prop_map(
        |(entries, compress, pick)| {
            let blocks = write_run(&entries, compress);
            if blocks.is_empty() {
                return Vec::new();
            }
            blocks[pick.index(blocks.len())].1.clone()
        },
    )
}

/// A damaged stored block: refused, or read into at most 256 MiB (the cap on a
/// compressed block's length) and walked entry by entry to its end or first bad entry.
#[test]
fn fuzz_stored_block_decode_refuses_or_walks() {
    fuzzing::run(
        "run_block",
        1500,
        fuzzing::hostile(400, stored_block()),
        |b| {
            if let Ok(raw) = block_bytes(&b) {
                prop_assert!(raw.len() <= 1 << 28);
                if !walk(&raw)?.is_empty() {
                    fuzzing::decoded();
                }
                let _ = find_in_block(&raw, b"a\x01b");
            }
            Ok(())
        },
    );
}

/// A block of the format-2 layout (`n u32, n offsets u32, entries`).
fn legacy_block(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut offsets = Vec::new();
    let mut data = Vec::new();
    for (k, v) in entries {
        offsets.extend_from_slice(&(data.len() as u32).to_le_bytes());
        for part in [k, v] {
            data.extend_from_slice(&(part.len() as u32).to_le_bytes());
            data.extend_from_slice(part);
        }
    }
    let mut b = (entries.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&offsets);
    b.extend_from_slice(&data);
    b
}

#[test]
fn fuzz_legacy_block_decode_refuses_or_reads_in_bounds() {
    let valid = prop::collection::btree_map(fuzzing::bytes(10), fuzzing::bytes(30), 0..20)
        .prop_map(|m| {
            let entries: Vec<_> = m.into_iter().collect();
            legacy_block(&entries)
        });
    fuzzing::run("legacy_block", 2000, fuzzing::hostile(300, valid), |b| {
        if let Ok(block) = Block::parse(&b) {
            fuzzing::decoded();
            prop_assert!(block.len() <= b.len() / 4);
            for (k, v) in block.entries().flatten() {
                prop_assert!(k.len() + v.len() <= b.len());
            }
            let _ = block.find(b"key");
        }
        Ok(())
    });
    let entries = prop::collection::btree_map(fuzzing::bytes(10), fuzzing::bytes(30), 0..20);
    fuzzing::run("legacy_block_round_trip", 300, entries, |m| {
        let entries: Vec<_> = m.into_iter().collect();
        let b = legacy_block(&entries);
        let block = Block::parse(&b).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, (k, v)) in entries.iter().enumerate() {
            prop_assert_eq!(
                block
                    .find(k)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?,
                Ok(i)
            );
            prop_assert_eq!(block.get(k).ok().flatten(), Some(&v[..]));
        }
        Ok(())
    });
}
