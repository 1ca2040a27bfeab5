use super::*;

fn runs(sizes: &[u64]) -> Vec<Arc<Run>> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &entries)| {
            Arc::new(Run {
                table_id: i as u64,
                order: 100 - i as u64,
                entries,
                bytes: 0,
                filter: run::new_filter(1),
            })
        })
        .collect()
}

#[test]
fn runs_merge_by_tier_oldest_first() {
    let base = 100;
    let (f, t1) = (FANOUT, FANOUT as u64 * 100);
    assert_eq!(tier(1, base), 0);
    assert_eq!(tier(t1 - 1, base), 0);
    assert_eq!(tier(t1, base), 1);
    assert_eq!(tier(t1 * FANOUT as u64, base), 2);
    assert_eq!(pick(&runs(&vec![100; f - 1]), base), None);
    assert_eq!(pick(&runs(&vec![100; f]), base), Some(0..f));
    // FANOUT flushed runs newer than a tier-1 run: the flushed ones merge.
    let mut newer = vec![90];
    newer.extend(vec![100; f - 1]);
    newer.push(t1);
    assert_eq!(pick(&runs(&newer), base), Some(0..f));
    // The oldest qualifying window first.
    let mut two = vec![100; f];
    two.extend(vec![t1 + 100; f]);
    assert_eq!(pick(&runs(&two), base), Some(f..2 * f));
    // Tiers that alternate make no window.
    let mut alternating = Vec::new();
    for i in 0..f as u64 {
        alternating.push(if i % 2 == 0 { 100 } else { t1 + i });
    }
    assert_eq!(pick(&runs(&alternating), base), None);
    // Past MAX_RUNS the smallest adjacent window merges whatever the tiers.
    let mut mixed = Vec::new();
    for i in 0..(MAX_RUNS as u64 + 1) {
        mixed.push(if i % 2 == 0 { 100 } else { t1 + i });
    }
    let w = pick(&runs(&mixed), base).unwrap();
    assert_eq!(w.len(), FANOUT);
}

/// Writes keys `keys` as a flushed run.
fn flush(db: &Database, runs: &mut Runs, keys: std::ops::Range<u64>) {
    let txn = db.begin_write().unwrap();
    let (id, order) = runs.next_flush();
    let written = {
        let mut t = txn
            .open_table(BlockDef::new(&state_run_name("s", id)))
            .unwrap();
        let mut w = runs.flush_writer(keys.end - keys.start);
        for i in keys {
            let k = run::run_key(run::KIND_STATE, format!("k{i:08}").as_bytes());
            w.push(&mut t, &k, Some(format!("{{\"n\":{i}}}").as_bytes()))
                .unwrap();
        }
        w.finish(&mut t).unwrap()
    };
    runs.add_flushed(&txn, "s", id, order, written).unwrap();
    txn.commit().unwrap();
}

/// Runs maintenance until no merge or retired table is left.
fn settle(db: &Database, runs: &mut Runs, base: usize) {
    while runs.has_work(base) {
        let txn = db.begin_write().unwrap();
        runs.maintain(db, &txn, "s", base, 100).unwrap();
        txn.commit().unwrap();
    }
}

/// Whether every block of a run is stored compressed (`None`: some are, some not).
fn compressed(db: &Database, run: &Run) -> Option<bool> {
    let txn = db.begin_read().unwrap();
    let t = txn
        .open_table(BlockDef::new(&state_run_name("s", run.table_id)))
        .unwrap();
    let flags: Vec<bool> = t
        .iter()
        .unwrap()
        .map(|r| r.unwrap().1.value().first() == Some(&run::BLOCK_ZSTD))
        .collect();
    let all = flags.iter().all(|c| *c);
    (all || !flags.iter().any(|c| *c)).then_some(all)
}

/// Merges write compressed blocks, flushed runs stay raw, and both read back every key.
#[test]
fn merges_store_compressed_blocks_and_flushed_runs_raw() {
    let dir = tempfile::tempdir().unwrap();
    let db = Database::create(dir.path().join("r.redb")).unwrap();
    let base = 16;
    let (f, b) = (FANOUT as u64, 16u64);
    let mut runs = Runs::default();
    // FANOUT flushed (raw) runs of tier 1 (FANOUT x base entries each) merge into one
    // of tier 2; FANOUT of those (read compressed) into one of tier 3.
    for set in 0..f {
        for i in 0..f {
            let from = (set * f + i) * f * b;
            flush(&db, &mut runs, from..from + f * b);
        }
        assert!(runs.list[..FANOUT]
            .iter()
            .all(|r| tier(r.entries, base) == 1));
        assert!(runs.list[..FANOUT]
            .iter()
            .all(|r| compressed(&db, r) == Some(false)));
        settle(&db, &mut runs, base);
        assert!(tier(runs.list[0].entries, base) >= 2);
        assert_eq!(compressed(&db, &runs.list[0]), Some(true));
    }
    assert_eq!(runs.list.len(), 1);
    assert_eq!(tier(runs.list[0].entries, base), 3);
    assert_eq!(compressed(&db, &runs.list[0]), Some(true));
    // Flushed runs are raw; FANOUT of them merge into a compressed tier-1 run.
    let top = f * f * f * b;
    for i in 0..f {
        flush(&db, &mut runs, top + i * b..top + (i + 1) * b);
        assert_eq!(compressed(&db, &runs.list[0]), Some(false));
    }
    let raw = runs.list[0].clone();
    settle(&db, &mut runs, base);
    assert_eq!(runs.list.len(), 2);
    assert_eq!(tier(runs.list[0].entries, base), 1);
    assert_eq!(compressed(&db, &runs.list[0]), Some(true));
    let per_entry = |r: &Run| r.bytes as f64 / r.entries as f64;
    assert!(
        per_entry(&runs.list[1]) * 2.0 < per_entry(&raw),
        "compressed blocks take less than half the bytes per entry"
    );
    let txn = db.begin_read().unwrap();
    for i in 0..top + f * b {
        let k = run::run_key(run::KIND_STATE, format!("k{i:08}").as_bytes());
        let holder = runs.list.iter().find(|r| {
            let t = txn
                .open_table(BlockDef::new(&state_run_name("s", r.table_id)))
                .unwrap();
            run::get(&t, &k).unwrap().is_some()
        });
        assert!(holder.is_some(), "key {i}");
    }
}

/// Blocks of a run's table.
fn blocks(db: &Database, id: u64) -> usize {
    let txn = db.begin_read().unwrap();
    missing_is_none(txn.open_table(BlockDef::new(&state_run_name("s", id))))
        .unwrap()
        .map_or(0, |t| t.len().unwrap() as usize)
}

/// Every key as a reader of the last commit finds it, and a prefix scan.
fn check_reads(db: &Database, runs: &Runs, keys: u64, value: &dyn Fn(u64) -> Vec<u8>) {
    let txn = db.begin_read().unwrap();
    let tables: Vec<RunTable> = runs
        .list
        .iter()
        .map(|r| open_run(&txn, "s", r).unwrap())
        .collect();
    let partial = runs.partial().map(|p| {
        let t = txn
            .open_table(BlockDef::new(&state_run_name("s", p.out_id)))
            .unwrap();
        (p, t)
    });
    for i in 0..keys {
        let k = run::run_key(run::KIND_STATE, format!("k{i:08}").as_bytes());
        assert_eq!(
            lookup(
                &runs.list,
                &tables,
                partial.as_ref(),
                &runs.cover_view(),
                &k
            )
            .unwrap(),
            Some(Some(value(i))),
            "key {i}"
        );
    }
    // Every key from k00000010 on, each with its value.
    let scanned: Vec<(String, bool)> =
        Merge::new(scans(&tables, partial.as_ref(), run::KIND_STATE, b"k0000001").unwrap())
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                let k = String::from_utf8(k).unwrap();
                let i: u64 = k[1..].parse().unwrap();
                (k, v == Some(value(i)))
            })
            .collect();
    let want: Vec<(String, bool)> = (10..keys).map(|i| (format!("k{i:08}"), true)).collect();
    assert_eq!(scanned, want);
}

/// A merge deletes its inputs' blocks behind its cursor slice by slice, so the state
/// is never held twice over, readers see every key throughout (output before the
/// cursor, inputs after it), and a restart mid-merge carries on where it stopped.
#[test]
fn a_merge_frees_its_inputs_behind_its_cursor_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.redb");
    let mut db = Database::create(&path).unwrap();
    let base = 16;
    let mut runs = Runs::default();
    let value = |i: u64| format!("{i:0200}").into_bytes();
    let (f, total) = (FANOUT as u64, 64 * FANOUT as u64);
    // FANOUT runs of 64 interleaved keys (run j holds keys j, j + FANOUT, ...),
    // ~200-byte values: about 18 entries a block, 4 blocks a run.
    for j in 0..f {
        let txn = db.begin_write().unwrap();
        let (id, order) = runs.next_flush();
        let written = {
            let mut t = txn
                .open_table(BlockDef::new(&state_run_name("s", id)))
                .unwrap();
            let mut w = runs.flush_writer(64);
            for i in (j..total).step_by(FANOUT) {
                let k = run::run_key(run::KIND_STATE, format!("k{i:08}").as_bytes());
                w.push(&mut t, &k, Some(&value(i))).unwrap();
            }
            w.finish(&mut t).unwrap()
        };
        runs.add_flushed(&txn, "s", id, order, written).unwrap();
        txn.commit().unwrap();
    }
    let inputs: Vec<u64> = runs.list.iter().map(|r| r.table_id).collect();
    let input_blocks = |db: &Database| inputs.iter().map(|id| blocks(db, *id)).sum::<usize>();
    let before = input_blocks(&db);
    assert!(before >= 3 * FANOUT, "{before} blocks");
    let mut slices = 0;
    // A first block of each input spans 16 of its keys, 16 x FANOUT of the merged order:
    // at 24 entries a slice, every input has freed one by this slice.
    let check_at = (16 * FANOUT).div_ceil(24) + 1;
    let mut restarted = false;
    let mut out_id = None;
    while runs.merging.is_some() || slices == 0 {
        let txn = db.begin_write().unwrap();
        runs.maintain(&db, &txn, "s", base, 24).unwrap();
        txn.commit().unwrap();
        slices += 1;
        let Some(m) = runs.merging.as_ref() else {
            break;
        };
        out_id = Some(m.out_id);
        let (left, written) = (input_blocks(&db), blocks(&db, m.out_id));
        // Never much more than the state once over: a block per input may be half
        // consumed, and each slice's last output block may be short.
        assert!(
            left + written <= before + FANOUT + slices,
            "slice {slices}: {left} input blocks left, {written} written, {before} before"
        );
        check_reads(&db, &runs, total, &value);
        if slices == check_at {
            assert!(
                left <= before - FANOUT,
                "slice {check_at}: {left} of {before} input blocks left"
            );
            // A restart: the merge is picked up from its progress row.
            drop(runs);
            drop(db);
            db = Database::open(&path).unwrap();
            runs = Runs::load(&db.begin_read().unwrap(), "s").unwrap();
            assert!(runs.partial().is_some(), "the merge resumes");
            assert_eq!(runs.retired_len(), 0, "its output is not an orphan");
            check_reads(&db, &runs, total, &value);
            restarted = true;
        }
    }
    assert!(restarted && slices > check_at + 1, "{slices} slices");
    settle(&db, &mut runs, base);
    assert_eq!(runs.list.len(), 1);
    assert_eq!(Some(runs.list[0].table_id), out_id);
    assert_eq!(runs.list[0].entries, total);
    assert_eq!(input_blocks(&db), 0);
    check_reads(&db, &runs, total, &value);
    // The progress row is gone with the merge.
    let txn = db.begin_read().unwrap();
    let meta = txn
        .open_table(StateRunsDef::new(&state_runs_name("s")))
        .unwrap();
    assert!(meta.get(MERGE_ROW).unwrap().is_none());
}

/// What the lookup of state key `i` finds, and in how many runs a cover let it skip the
/// run's own filter.
fn lookup_counting(db: &Database, runs: &Runs, i: u64) -> (Option<Option<Vec<u8>>>, usize) {
    let txn = db.begin_read().unwrap();
    let tables: Vec<RunTable> = runs
        .list
        .iter()
        .map(|r| open_run(&txn, "s", r).unwrap())
        .collect();
    let partial = runs.partial().map(|p| {
        let t = txn
            .open_table(BlockDef::new(&state_run_name("s", p.out_id)))
            .unwrap();
        (p, t)
    });
    let k = run::run_key(run::KIND_STATE, format!("k{i:08}").as_bytes());
    let view = runs.cover_view();
    let found = lookup(&runs.list, &tables, partial.as_ref(), &view, &k).unwrap();
    let absent = view.absent(run::key_hash(&k));
    (found, (0..runs.list.len()).filter(|j| absent(*j)).count())
}

/// Covers never hide a key (every written key is found through flushes, merges within one
/// cover and across covers, covers filling up, and a restart that forgets them all), and
/// they do their work: once the runs are covered, a key no run holds skips nearly every
/// run's own filter.
#[test]
fn covers_skip_runs_for_absent_keys_and_never_hide_a_written_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.redb");
    let mut db = Database::create(&path).unwrap();
    let base = 40;
    let mut runs = Runs {
        covers: Covers::with_min_capacity(100),
        ..Runs::default()
    };
    let check = |db: &Database, runs: &Runs, written: u64| {
        for i in 0..written {
            assert!(lookup_counting(db, runs, i).0.is_some(), "key {i} hidden");
        }
    };
    let mut written = 0;
    for round in 0..24u64 {
        flush(&db, &mut runs, written..written + 40);
        written += 40;
        if round % 3 == 2 {
            settle(&db, &mut runs, base);
        }
        check(&db, &runs, written);
    }
    settle(&db, &mut runs, base);
    assert!(runs.list.len() > 1, "{} runs", runs.list.len());
    assert_eq!(runs.covers.covered(), runs.list.len(), "every run covered");
    let skipped = |db: &Database, runs: &Runs| -> usize {
        (100_000..101_000)
            .map(|i| {
                let (found, skipped) = lookup_counting(db, runs, i);
                assert_eq!(found, None);
                skipped
            })
            .sum()
    };
    let possible = 1000 * runs.list.len();
    let before_restart = skipped(&db, &runs);
    assert!(
        before_restart * 100 >= possible * 95,
        "{before_restart} of {possible} run probes skipped"
    );
    // A restart forgets the covers: nothing is skipped, nothing is hidden, and runs join
    // covers again as they are flushed and merged.
    drop(runs);
    drop(db);
    db = Database::open(&path).unwrap();
    runs = Runs::load(&db.begin_read().unwrap(), "s").unwrap();
    runs.covers = Covers::with_min_capacity(100);
    assert_eq!(skipped(&db, &runs), 0);
    check(&db, &runs, written);
    for _ in 0..8 {
        flush(&db, &mut runs, written..written + 40);
        written += 40;
        settle(&db, &mut runs, base);
        check(&db, &runs, written);
    }
    assert!(runs.covers.covered() > 0);
    assert!(skipped(&db, &runs) > 0);
}

#[test]
fn run_metadata_round_trips_and_damage_is_refused() {
    let mut filter = run::new_filter(100);
    filter.insert_hash(7);
    let r = Run {
        table_id: 3,
        order: 9,
        entries: 100,
        bytes: 4096,
        filter,
    };
    let b = r.encode();
    let back = Run::decode(3, &b).unwrap();
    assert_eq!((back.order, back.entries, back.bytes), (9, 100, 4096));
    assert!(back.may_contain(7));
    assert!(Run::decode(3, &b[..b.len() - 1]).is_none());
    assert!(Run::decode(3, &b[..20]).is_none());
    // A hash count no writer uses (found by fuzzing: u32::MAX hashes stalled a probe
    // for 32 s) is refused, not probed.
    for hashes in [0u32, 33, u32::MAX] {
        let mut bad = b.clone();
        bad[24..28].copy_from_slice(&hashes.to_le_bytes());
        assert!(Run::decode(3, &bad).is_none(), "{hashes} hashes");
    }
}
