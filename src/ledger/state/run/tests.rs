use redb::{Database, ReadableDatabase, TableDefinition};

use super::*;

const T: TableDefinition<&[u8], &[u8]> = TableDefinition::new("run");

/// Compressed blocks aim at a third of a leaf page each, so three share a page with
/// little left over: runs of shipping-label-like entries that compress to different
/// ratios leave 5-6 % of their pages empty (22-36 % with blocks filled to 3,800 raw
/// bytes, which compress to just over a third of a page here: two a page), and every
/// key reads back.
#[test]
fn compressed_blocks_share_leaf_pages_by_three() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    // What the shipping-label handler writes per order: the label under its order id,
    // and the `insert-unique` mark of the order id; labels with ids of 4 to 64 hex
    // digits, so blocks compress to sizes on both sides of a third of a page.
    for id_hex in [4, 12, 20, 28, 36, 48, 64] {
        let mut entries: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
        for _ in 0..15_000 {
            let (a, b) = (next(), next());
            let order = format!("{a:016x}{b:016x}");
            let id: String = format!(
                "{:016x}{:016x}{:016x}{:016x}",
                next(),
                next(),
                next(),
                next()
            )
            .chars()
            .take(id_hex)
            .collect();
            let label = format!("{{\"label_id\":\"{id}\",\"order_id\":\"{order}\"}}");
            let state = run_key(KIND_STATE, format!("label/{order}").as_bytes());
            entries.push((state, Some(label.into_bytes())));
            let mark = run_key(KIND_MARK, format!("label\u{0}{order}").as_bytes());
            entries.push((mark, Some(Vec::new())));
        }
        entries.sort();
        entries.dedup_by(|a, b| a.0 == b.0);
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("r.redb")).unwrap();
        write(&db, &entries, true);
        let txn = db.begin_read().unwrap();
        let t = txn.open_table(T).unwrap();
        let stats = redb::ReadableTableMetadata::stats(&t).unwrap();
        let pages = stats.stored_bytes() + stats.metadata_bytes() + stats.fragmented_bytes();
        let empty = stats.fragmented_bytes() as f64 / pages as f64;
        let rows = redb::ReadableTableMetadata::len(&t).unwrap();
        let per_leaf = rows as f64 / stats.leaf_pages() as f64;
        assert!(per_leaf > 2.8, "{per_leaf:.2} blocks a leaf page");
        assert!(
            empty < 0.07,
            "ids of {id_hex} hex digits: {:.1} % of the run's pages empty",
            empty * 100.0
        );
        for (k, v) in entries.iter().step_by(7) {
            assert_eq!(get(&t, k).unwrap(), Some(v.clone()));
        }
    }
}

fn write(db: &Database, entries: &[(Vec<u8>, Option<Vec<u8>>)], compress: bool) -> Written {
    let txn = db.begin_write().unwrap();
    let out = {
        let mut t = txn.open_table(T).unwrap();
        let mut w = RunWriter::new(entries.len() as u64, compress);
        for (k, v) in entries {
            w.push(&mut t, k, v.as_deref()).unwrap();
        }
        w.finish(&mut t).unwrap()
    };
    txn.commit().unwrap();
    out
}

/// Keys sharing long prefixes, tombstones and values of many sizes read back exactly,
/// one by one and scanned per kind; absent keys between and around them read absent;
/// raw and compressed alike, and compressed blocks take fewer bytes.
#[test]
fn a_run_reads_back_what_was_written() {
    let raw = reads_back(false);
    let compressed = reads_back(true);
    assert!(
        compressed * 3 < raw,
        "compressed {compressed} bytes, raw {raw}"
    );
}

/// Writes and checks a run; returns its bytes.
fn reads_back(compress: bool) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let db = Database::create(dir.path().join("r.redb")).unwrap();
    let mut entries = Vec::new();
    for i in 0..5000u32 {
        let key = run_key(KIND_STATE, format!("label/{:08}", i * 2).as_bytes());
        let value = (i % 7 != 3).then(|| vec![b'x'; (i % 300) as usize]);
        entries.push((key, value));
    }
    for i in 0..100u32 {
        entries.push((
            run_key(KIND_MARK, format!("m\0{i:03}").as_bytes()),
            Some(vec![]),
        ));
    }
    let written = write(&db, &entries, compress);
    assert_eq!(written.entries, entries.len() as u64);
    assert!(written.bytes > 0);
    assert!(entries
        .iter()
        .all(|(k, _)| written.filter.contains_hash(key_hash(k))));
    let txn = db.begin_read().unwrap();
    let t = txn.open_table(T).unwrap();
    for (k, v) in &entries {
        assert_eq!(get(&t, k).unwrap(), Some(v.clone()));
    }
    for i in [1u32, 77, 9999, 10001] {
        let k = run_key(KIND_STATE, format!("label/{i:08}").as_bytes());
        assert_eq!(get(&t, &k).unwrap(), None);
    }
    assert_eq!(get(&t, b"zzz").unwrap(), None);
    let scanned: Vec<Entry> = RunScan::new(&t, KIND_STATE, b"label/00000100")
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let want: Vec<Entry> = entries
        .iter()
        .filter(|(k, _)| k[0] == KIND_STATE && &k[1..] >= b"label/00000100".as_slice())
        .map(|(k, v)| (k[1..].to_vec(), v.clone()))
        .collect();
    assert_eq!(scanned, want);
    let marks = RunScan::new(&t, KIND_MARK, b"").unwrap().count();
    assert_eq!(marks, 100);
    let all: Vec<Entry> = RunScan::all(&t, b"")
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(all, entries);
    written.bytes
}

#[test]
fn a_damaged_block_is_an_error_not_a_panic() {
    // Compressed: a length past the cap, a frame that is not zstd, a frame shorter
    // than its length, an unknown encoding byte.
    for stored in [
        vec![BLOCK_ZSTD, 0xff, 0xff, 0xff, 0xff, 0x7f],
        vec![BLOCK_ZSTD, 4, 1, 2, 3, 4],
        {
            let mut b = vec![BLOCK_ZSTD, 100];
            b.extend(zstd::bulk::compress(&[0u8; 10], 1).unwrap());
            b
        },
        vec![7, 0, 0],
    ] {
        assert!(block_bytes(&stored).is_err(), "{stored:?}");
    }
    let mut cursor = BlockCursor::new(&[0, 200, 1]);
    assert!(cursor.next_entry().is_err());
    let mut cursor = BlockCursor::new(&[5, 1, b'a', 0]);
    assert!(
        cursor.next_entry().is_err(),
        "shares more than the previous key"
    );
    let mut cursor = BlockCursor::new(&[0xff; 12]);
    assert!(cursor.next_entry().is_err());
}

#[test]
fn merging_takes_the_newest_source_per_key() {
    let e = |k: &str, v: Option<&str>| -> Result<Entry, StorageError> {
        Ok((k.as_bytes().to_vec(), v.map(|v| v.as_bytes().to_vec())))
    };
    let newest = vec![e("b", None), e("d", Some("new"))];
    let oldest = vec![e("a", Some("1")), e("b", Some("2")), e("d", Some("old"))];
    let merged: Vec<Entry> = Merge::new(vec![newest.into_iter(), oldest.into_iter()])
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let want: Vec<Entry> = vec![
        e("a", Some("1")).unwrap(),
        e("b", None).unwrap(),
        e("d", Some("new")).unwrap(),
    ];
    assert_eq!(merged, want);
}
