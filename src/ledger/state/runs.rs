//! The sorted runs of a subscriber's handler state on one shard, and how they merge.
//!
//! Each frozen state buffer becomes one new run (`buffer.rs`), so a batch never rewrites
//! older data: a run is written once, in key order, and then only read, until a merge
//! replaces it. Runs are kept newest first; a key's current entry is in the newest run
//! that has it (a tombstone says "deleted").
//!
//! **Merge policy (size tiers).** A run's tier is how many times it is [`FANOUT`] times
//! larger than a flushed buffer (`ledger.state_buffer_entries`): flushed runs are tier 0,
//! and [`FANOUT`] runs of one tier merge into one of the next. So an entry is rewritten
//! about once per tier (log8 of the state size over the buffer size: 2-3 times at 10M
//! entries), never once per batch, and a lookup probes at most about
//! `(FANOUT - 1) x tiers` filters (most keys a handler asks for are new, and a cover
//! answers for many runs at once: `cover.rs`). Fanout 8 against 4 (2026-12-07, six
//! alternating pairs of 10M random-id shipping-label runs): 0.92-0.94x the CPU, 1.05-1.11x
//! the messages, 0.92x the allocated disk; and 0.90x the CPU with the counter handler
//! updating 1M orders (`docs/bench-history.md`). The runs merged are always adjacent in age, so the
//! newest-first order still holds after the merge; a merge that reaches the oldest run
//! drops tombstones. At most [`MAX_RUNS`] runs are kept: past that the adjacent runs with
//! the fewest entries merge whatever their tiers.
//!
//! **Bounded slices.** A merge writes at most the batch's maintenance budget of entries
//! per transaction, reading its inputs through a read snapshot (they are committed and
//! immutable) from where the last slice stopped. Until its last slice commits, readers
//! use the inputs; the last slice writes the output's metadata row and deletes the
//! inputs' tables and rows in the same transaction, so a crash leaves either the inputs
//! (and a partial output table without a metadata row, deleted on the next maintenance)
//! or the output. Claims and state commit together in every batch either way (G2, G6).
//!
//! Each run's metadata row holds its Bloom filter, so a restart loads the filters without
//! reading the runs.

use std::collections::VecDeque;
use std::sync::Arc;

use fastbloom::BloomFilter;
use redb::{
    Database, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableHandle,
};
use redb::{StorageError, WriteTransaction};

use super::cover::{CoverBits, CoverView, Covers};
use super::run::{self, Merge, RunScan, RunWriter, Written};
use crate::ledger::format::tables::{
    missing_is_none, state_run_name, state_runs_name, BlockDef, StateRunsDef, STATE_RUN_PREFIX,
};

/// Runs of one tier that merge into one of the next (4 until 2026-12-07; see above).
pub(crate) const FANOUT: usize = 8;
/// Most runs kept before adjacent small ones merge regardless of tier.
pub(crate) const MAX_RUNS: usize = 16;
/// Merge outputs of this tier and above store compressed blocks (`run.rs`); flushed runs
/// stay raw (a flush is the commit path's own work, and they are merged again soonest).
/// From tier 2 until 2026-12-03: up to three raw tier-1 runs per shard (each up to 16x a
/// buffer) then held a fifth of a 10M-label state at ~3x the bytes, and the bench's disk
/// per message was 141-142 B against 120-121 B compressing tier 1 too, for 0.95-1.02x the
/// throughput in three alternating pairs (`docs/bench-history.md`).
pub(crate) const COMPRESS_FROM_TIER: u32 = 1;
/// About how many entries one block of a shipping-label run holds: removing a block of a
/// retired table counts as this many entries of a slice's budget.
const ENTRIES_PER_BLOCK: usize = 16;

/// Most hash functions a stored run filter may name (runs are written with
/// `run::FILTER_HASHES`).
const MAX_FILTER_HASHES: u32 = 32;

/// One run: its table, its age and its filter.
pub(crate) struct Run {
    pub(crate) table_id: u64,
    /// Higher is newer: the flush that wrote it, or the newest of the runs merged into it.
    pub(crate) order: u64,
    pub(crate) entries: u64,
    /// Bytes of its blocks and block keys.
    pub(crate) bytes: u64,
    filter: BloomFilter,
}

impl Run {
    /// `false`: the key is certainly not in this run.
    #[inline]
    pub(crate) fn may_contain(&self, hash: u64) -> bool {
        self.filter.contains_hash(hash)
    }

    pub(crate) fn filter_bytes(&self) -> u64 {
        (self.filter.num_bits() / 8) as u64
    }

    /// Row format (v1): `order u64, entries u64, bytes u64, hashes u32, words u64`, then
    /// the filter's words; little endian.
    fn encode(&self) -> Vec<u8> {
        let words = self.filter.as_slice();
        let mut out = Vec::with_capacity(36 + words.len() * 8);
        for n in [self.order, self.entries, self.bytes] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&self.filter.num_hashes().to_le_bytes());
        out.extend_from_slice(&(words.len() as u64).to_le_bytes());
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out
    }

    fn decode(table_id: u64, b: &[u8]) -> Option<Run> {
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
        };
        let hashes = u32::from_le_bytes(b.get(24..28)?.try_into().ok()?);
        let n = usize::try_from(u64_at(28)?).ok()?;
        let body = b.get(36..)?;
        // A damaged hash count would make every probe loop billions of times.
        if n == 0 || !(1..=MAX_FILTER_HASHES).contains(&hashes) || body.len() != n.checked_mul(8)? {
            return None;
        }
        let words = body
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
            .collect();
        Some(Run {
            table_id,
            order: u64_at(0)?,
            entries: u64_at(8)?,
            bytes: u64_at(16)?,
            filter: BloomFilter::from_vec(words).hashes(hashes),
        })
    }
}

/// The key of the merge-progress row in a subscriber's run list table (no run has it:
/// table ids count up from 0).
const MERGE_ROW: u64 = u64::MAX;
/// The row of the metadata table holding the first state log row no run covers
/// (`StateBuffer::live_from`; format 8). Absent: every row left in the log is live.
const LOG_FROM_ROW: u64 = u64::MAX - 1;

/// A merge in progress: `inputs` are adjacent in the run list.
struct Merging {
    inputs: Vec<Arc<Run>>,
    /// Whether the inputs include the oldest run (tombstones are dropped).
    bottom: bool,
    out_id: u64,
    compress: bool,
    writer: RunWriter,
    /// The cover (id) of every input, which the output joins as it is (its keys are
    /// theirs); `None` when the writer inserts into a cover of its own, or none.
    inherit: Option<u64>,
    /// Run key the next slice starts at. Every key before it is in the output table (and
    /// gone from the inputs' tables); readers take keys before it from the output.
    resume: Vec<u8>,
}

impl Merging {
    /// Progress row (v1): `out_id u64, bottom u8, compress u8, inputs u32, input table
    /// ids u64 each, resume key`; little endian.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(14 + 8 * self.inputs.len() + self.resume.len());
        out.extend_from_slice(&self.out_id.to_le_bytes());
        out.push(u8::from(self.bottom));
        out.push(u8::from(self.compress));
        out.extend_from_slice(&(self.inputs.len() as u32).to_le_bytes());
        for r in &self.inputs {
            out.extend_from_slice(&r.table_id.to_le_bytes());
        }
        out.extend_from_slice(&self.resume);
        out
    }
}

/// A decoded progress row: output table id, bottom, compress, input table ids, resume key.
type Progress = (u64, bool, bool, Vec<u64>, Vec<u8>);

fn decode_progress(b: &[u8]) -> Option<Progress> {
    let out_id = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let bottom = *b.get(8)? == 1;
    let compress = *b.get(9)? == 1;
    let n = u32::from_le_bytes(b.get(10..14)?.try_into().ok()?) as usize;
    let ids_end = 14usize.checked_add(n.checked_mul(8)?)?;
    let inputs = b
        .get(14..ids_end)?
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    Some((out_id, bottom, compress, inputs, b.get(ids_end..)?.to_vec()))
}

/// A merge in progress as readers see it: the runs at `at..at + inputs` of the list are
/// its inputs, and keys before `resume` are read from the output table `out_id` instead.
#[derive(Clone)]
pub(crate) struct Partial {
    pub(crate) at: usize,
    pub(crate) inputs: usize,
    pub(crate) out_id: u64,
    pub(crate) resume: Vec<u8>,
}

/// The runs of a subscriber on one shard.
#[derive(Default)]
pub(crate) struct Runs {
    /// Newest first.
    pub(crate) list: Vec<Arc<Run>>,
    next_id: u64,
    next_order: u64,
    /// Tables no longer read: a merge's inputs, and partial runs of an interrupted flush or
    /// merge. Emptied a slice at a time by later maintenance, then deleted: deleting a
    /// table of millions of entries at once stalled its batch (54-69 ms at 530k entries,
    /// growing with the run).
    retired: VecDeque<String>,
    merging: Option<Merging>,
    /// The first state log row no run covers, as stored ([`LOG_FROM_ROW`]).
    pub(crate) log_from: u64,
    /// Filters over the keys of many runs (`cover.rs`), in memory only.
    pub(crate) covers: Covers,
}

fn corrupt(what: String) -> redb::Error {
    redb::Error::Corrupted(what)
}

impl Runs {
    /// Loads the run list and filters from the metadata table, and notes run tables no
    /// metadata row names (left by a crash mid-write).
    pub(crate) fn load(txn: &ReadTransaction, sub: &str) -> Result<Runs, redb::Error> {
        let mut runs = Runs::default();
        let mut progress = None;
        if let Some(t) = missing_is_none(txn.open_table(StateRunsDef::new(&state_runs_name(sub))))?
        {
            for row in t.iter()? {
                let (k, v) = row?;
                if k.value() == LOG_FROM_ROW {
                    let v = v.value();
                    runs.log_from = v.try_into().map(u64::from_le_bytes).map_err(|_| {
                        corrupt(format!("{} log row watermark", state_runs_name(sub)))
                    })?;
                    continue;
                }
                if k.value() == MERGE_ROW {
                    progress = Some(decode_progress(v.value()).ok_or_else(|| {
                        corrupt(format!(
                            "{} merge progress does not decode",
                            state_runs_name(sub)
                        ))
                    })?);
                    continue;
                }
                let run = Run::decode(k.value(), v.value()).ok_or_else(|| {
                    corrupt(format!(
                        "{} row {} does not decode",
                        state_runs_name(sub),
                        k.value()
                    ))
                })?;
                runs.next_order = runs.next_order.max(run.order + 1);
                runs.list.push(Arc::new(run));
            }
        }
        runs.list.sort_by_key(|r| std::cmp::Reverse(r.order));
        runs.next_id = runs.list.iter().map(|r| r.table_id + 1).max().unwrap_or(0);
        if let Some((out_id, bottom, compress, ids, resume)) = progress {
            runs.merging =
                Some(runs.resume_merge(txn, sub, out_id, bottom, compress, &ids, resume)?);
            runs.next_id = runs.next_id.max(out_id + 1);
        }
        let prefix = format!("{STATE_RUN_PREFIX}{sub}/");
        for table in txn.list_tables()? {
            let name = table.name();
            let Some(id) = name
                .strip_prefix(&prefix)
                .and_then(|i| i.parse::<u64>().ok())
            else {
                continue;
            };
            runs.next_id = runs.next_id.max(id + 1);
            let merge_output = runs.merging.as_ref().is_some_and(|m| m.out_id == id);
            if !merge_output && !runs.list.iter().any(|r| r.table_id == id) {
                runs.retired.push_back(name.to_string());
            }
        }
        Ok(runs)
    }

    /// Picks up a merge a restart interrupted: its inputs must still be listed, adjacent,
    /// and its output's written blocks are read once to rebuild the writer.
    #[allow(
        clippy::too_many_arguments,
        reason = "the parts of one run, passed once"
    )]
    fn resume_merge(
        &self,
        txn: &ReadTransaction,
        sub: &str,
        out_id: u64,
        bottom: bool,
        compress: bool,
        ids: &[u64],
        resume: Vec<u8>,
    ) -> Result<Merging, redb::Error> {
        let at = ids
            .first()
            .and_then(|first| self.list.iter().position(|r| r.table_id == *first));
        let inputs: Option<Vec<Arc<Run>>> = at.and_then(|at| {
            let window = self.list.get(at..at + ids.len())?;
            window
                .iter()
                .zip(ids)
                .all(|(r, id)| r.table_id == *id)
                .then(|| window.to_vec())
        });
        let Some(inputs) = inputs else {
            return Err(corrupt(format!(
                "{}: the merge in progress names runs {ids:?} that are not listed together",
                state_runs_name(sub)
            )));
        };
        let expected = inputs.iter().map(|r| r.entries).sum();
        let writer =
            match missing_is_none(txn.open_table(BlockDef::new(&state_run_name(sub, out_id))))? {
                Some(t) => RunWriter::resume(&t, expected, compress)?,
                None => RunWriter::new(expected, compress),
            };
        // Its written part went through no cover: the output joins none.
        Ok(Merging {
            inputs,
            bottom,
            out_id,
            compress,
            writer,
            inherit: None,
            resume,
        })
    }

    /// The merge in progress as readers of the last commit see it.
    pub(crate) fn partial(&self) -> Option<Partial> {
        let m = self.merging.as_ref()?;
        if m.resume.is_empty() {
            return None;
        }
        let at = self
            .list
            .iter()
            .position(|r| r.table_id == m.inputs[0].table_id)?;
        Some(Partial {
            at,
            inputs: m.inputs.len(),
            out_id: m.out_id,
            resume: m.resume.clone(),
        })
    }

    /// Retired tables not yet deleted.
    pub(crate) fn retired_len(&self) -> usize {
        self.retired.len()
    }

    pub(crate) fn filter_bytes(&self) -> u64 {
        self.list.iter().map(|r| r.filter_bytes()).sum::<u64>()
            + self.merging.as_ref().map_or(0, |m| m.writer.filter_bytes())
            + self.covers.heap_bytes()
    }

    /// A fresh table id and the order of a new flush (newer than every run).
    pub(crate) fn next_flush(&mut self) -> (u64, u64) {
        let ids = (self.next_id, self.next_order);
        self.next_id += 1;
        self.next_order += 1;
        ids
    }

    /// Whether maintenance has run work to do.
    pub(crate) fn has_work(&self, base: usize) -> bool {
        !self.retired.is_empty() || self.merging.is_some() || pick(&self.list, base).is_some()
    }

    /// Registers a finished run as the newest (or deletes its table when it holds
    /// nothing), writing its metadata row in `txn`.
    /// Records the first state log row no run covers, in the transaction that registers
    /// the run covering the rows before it.
    pub(crate) fn set_log_from(
        &mut self,
        txn: &WriteTransaction,
        sub: &str,
        row: u64,
    ) -> Result<(), redb::Error> {
        txn.open_table(StateRunsDef::new(&state_runs_name(sub)))?
            .insert(LOG_FROM_ROW, row.to_le_bytes().as_slice())?;
        self.log_from = row;
        Ok(())
    }

    pub(crate) fn add_flushed(
        &mut self,
        txn: &WriteTransaction,
        sub: &str,
        table_id: u64,
        order: u64,
        mut written: Written,
    ) -> Result<(), redb::Error> {
        let cover = written.cover.take();
        if let Some(run) = register(txn, sub, table_id, order, written)? {
            if let Some(c) = &cover {
                self.covers.add_written(c, table_id);
            }
            self.list.insert(0, run);
        }
        Ok(())
    }

    /// A writer for a flushed run of about `expected` entries, inserting into the newest
    /// cover.
    pub(crate) fn flush_writer(&mut self, expected: u64) -> RunWriter {
        RunWriter::new(expected, false).covered_by(self.cover_for(expected, expected))
    }

    /// The cover a writer of about `expected` keys inserts into, when its run adds `adds`
    /// entries to those of the list.
    fn cover_for(&mut self, expected: u64, adds: u64) -> Option<Arc<CoverBits>> {
        let total = self.list.iter().map(|r| r.entries).sum::<u64>() + adds;
        let list = &self.list;
        let entries = |id: u64| {
            list.iter()
                .find(|r| r.table_id == id)
                .map_or(0, |r| r.entries)
        };
        self.covers.for_writer(expected, total, entries)
    }

    /// The covers as of the current run list, for a reader that snapshots it.
    pub(crate) fn cover_view(&self) -> CoverView {
        self.covers.view(&self.list)
    }

    /// Empties retired tables by a slice, starts a merge when the policy asks for one, and
    /// writes one slice of it (at most `budget` entries). Returns the work done, in entries
    /// (a block removed from a retired table counts as [`ENTRIES_PER_BLOCK`]); 0 when it
    /// wrote nothing.
    pub(crate) fn maintain(
        &mut self,
        db: &Database,
        txn: &WriteTransaction,
        sub: &str,
        base: usize,
        budget: usize,
    ) -> Result<usize, redb::Error> {
        let mut used = self.drop_retired(txn, budget)?;
        if self.merging.is_none() {
            if let Some(window) = pick(&self.list, base) {
                let inputs: Vec<Arc<Run>> = self.list[window.clone()].to_vec();
                let expected = inputs.iter().map(|r| r.entries).sum();
                let compress = compress_tier(expected, base);
                // Inputs of one cover: the output is covered as it is. Otherwise its keys
                // go into the newest cover as they are written (once per key and cover).
                let inherit = self.covers.shared_by(&inputs);
                let mut writer = RunWriter::new(expected, compress);
                if inherit.is_none() {
                    writer = writer.covered_by(self.cover_for(expected, 0));
                }
                self.merging = Some(Merging {
                    bottom: window.end == self.list.len(),
                    inputs,
                    out_id: self.next_id,
                    compress,
                    writer,
                    inherit,
                    resume: Vec::new(),
                });
                self.next_id += 1;
            }
        }
        if self.merging.is_some() {
            used += self.merge_slice(db, txn, sub, budget.saturating_sub(used).max(1))?;
        }
        Ok(used)
    }

    /// Removes up to a block per [`ENTRIES_PER_BLOCK`] of `budget` from the oldest retired
    /// table, deleting it once empty.
    fn drop_retired(
        &mut self,
        txn: &WriteTransaction,
        budget: usize,
    ) -> Result<usize, redb::Error> {
        let Some(name) = self.retired.front() else {
            return Ok(0);
        };
        let mut t = txn.open_table(BlockDef::new(name))?;
        let mut used = 0;
        for _ in 0..(budget / ENTRIES_PER_BLOCK).max(1) {
            used += ENTRIES_PER_BLOCK;
            if t.pop_first()?.is_none() {
                break;
            }
        }
        if t.is_empty()? {
            drop(t);
            txn.delete_table(BlockDef::new(name))?;
            self.retired.pop_front();
        }
        Ok(used)
    }

    fn merge_slice(
        &mut self,
        db: &Database,
        txn: &WriteTransaction,
        sub: &str,
        budget: usize,
    ) -> Result<usize, redb::Error> {
        let Some(m) = self.merging.as_mut() else {
            return Ok(0);
        };
        let read = db.begin_read()?;
        let mut scans = Vec::with_capacity(m.inputs.len());
        for r in &m.inputs {
            let t = read.open_table(BlockDef::new(&state_run_name(sub, r.table_id)))?;
            scans.push(RunScan::all(&t, &m.resume)?);
        }
        let mut out = txn.open_table(BlockDef::new(&state_run_name(sub, m.out_id)))?;
        let mut written = 0;
        let mut finished = true;
        for entry in Merge::new(scans)? {
            let (k, v) = entry?;
            if v.is_some() || !m.bottom {
                m.writer.push(&mut out, &k, v.as_deref())?;
            }
            written += 1;
            if written >= budget {
                // The next slice starts just after this key.
                m.resume = k;
                m.resume.push(0);
                finished = false;
                break;
            }
        }
        if !finished {
            // Everything before `resume` is now in the output's table: its inputs' blocks
            // that end before it are read by nobody after this commit (readers of earlier
            // snapshots keep theirs), so they go now and the merge never holds the state
            // twice over. The progress row lets a restart carry on from here.
            m.writer.flush_block(&mut out)?;
            drop(out);
            for r in &m.inputs {
                let mut t = txn.open_table(BlockDef::new(&state_run_name(sub, r.table_id)))?;
                while t
                    .first()?
                    .is_some_and(|(last, _)| last.value() < m.resume.as_slice())
                {
                    t.pop_first()?;
                }
            }
            txn.open_table(StateRunsDef::new(&state_runs_name(sub)))?
                .insert(MERGE_ROW, m.encode().as_slice())?;
            return Ok(written);
        }
        let Some(m) = self.merging.take() else {
            return Ok(written);
        };
        let started = std::time::Instant::now();
        let mut done = m.writer.finish(&mut out)?;
        let written_cover = done.cover.take();
        drop(out);
        let mut meta = txn.open_table(StateRunsDef::new(&state_runs_name(sub)))?;
        meta.remove(MERGE_ROW)?;
        for r in &m.inputs {
            meta.remove(r.table_id)?;
            self.retired.push_back(state_run_name(sub, r.table_id));
        }
        drop(meta);
        let order = m.inputs.iter().map(|r| r.order).max().unwrap_or(0);
        let merged = register(txn, sub, m.out_id, order, done)?;
        let Some(at) = self
            .list
            .iter()
            .position(|r| r.table_id == m.inputs[0].table_id)
        else {
            return Err(corrupt(format!("{sub}: merged runs are no longer listed")));
        };
        tracing::info!(subscriber = %sub, runs = m.inputs.len(), entries = self.list[at..at + m.inputs.len()].iter().map(|r| r.entries).sum::<u64>(),
            finish_ms = started.elapsed().as_millis() as u64, "handler state runs merged");
        // The output joins its cover before the inputs leave theirs, so a cover that held
        // only the inputs is not dropped in between.
        if let Some(run) = &merged {
            if let Some(c) = &written_cover {
                self.covers.add_written(c, run.table_id);
            } else if let Some(id) = m.inherit {
                self.covers.add_merged(id, run.table_id);
            }
        }
        self.covers.remove(m.inputs.iter().map(|r| r.table_id));
        self.list.splice(at..at + m.inputs.len(), merged);
        Ok(written.max(1))
    }
}

/// Writes a finished run's metadata row and returns it, or deletes its table when it holds
/// no entry.
pub(crate) fn register(
    txn: &WriteTransaction,
    sub: &str,
    table_id: u64,
    order: u64,
    written: Written,
) -> Result<Option<Arc<Run>>, redb::Error> {
    if written.entries == 0 {
        txn.delete_table(BlockDef::new(&state_run_name(sub, table_id)))?;
        return Ok(None);
    }
    let run = Run {
        table_id,
        order,
        entries: written.entries,
        bytes: written.bytes,
        filter: written.filter,
    };
    txn.open_table(StateRunsDef::new(&state_runs_name(sub)))?
        .insert(table_id, run.encode().as_slice())?;
    Ok(Some(Arc::new(run)))
}

/// Whether a merge output of `entries` stores compressed blocks.
fn compress_tier(entries: u64, base: usize) -> bool {
    tier(entries, base) >= COMPRESS_FROM_TIER
}

/// A run's tier: 0 below `FANOUT x base` entries, then one more per factor of `FANOUT`.
fn tier(entries: u64, base: usize) -> u32 {
    let mut cap = (base as u64).max(1).saturating_mul(FANOUT as u64);
    let mut t = 0;
    while entries >= cap && cap < u64::MAX {
        t += 1;
        cap = cap.saturating_mul(FANOUT as u64);
    }
    t
}

/// The runs to merge next, if any: the oldest `FANOUT` adjacent runs of one tier, or past
/// [`MAX_RUNS`] the `FANOUT` adjacent runs with the fewest entries.
fn pick(list: &[Arc<Run>], base: usize) -> Option<std::ops::Range<usize>> {
    if list.len() < FANOUT {
        return None;
    }
    let tiers: Vec<u32> = list.iter().map(|r| tier(r.entries, base)).collect();
    for start in (0..=list.len() - FANOUT).rev() {
        let w = &tiers[start..start + FANOUT];
        if w.iter().all(|t| *t == w[0]) {
            return Some(start..start + FANOUT);
        }
    }
    if list.len() <= MAX_RUNS {
        return None;
    }
    (0..=list.len() - FANOUT)
        .min_by_key(|s| list[*s..*s + FANOUT].iter().map(|r| r.entries).sum::<u64>())
        .map(|s| s..s + FANOUT)
}

/// A run's table as of a read transaction.
pub(crate) fn open_run(
    txn: &ReadTransaction,
    sub: &str,
    run: &Run,
) -> Result<RunTable, redb::Error> {
    Ok(txn.open_table(BlockDef::new(&state_run_name(sub, run.table_id)))?)
}

/// The entry of `key` (a run key) in the newest run that has it: `Some(None)` is a
/// tombstone. `tables` are the runs' tables, in the same order; `partial` is a merge in
/// progress and its output's table.
pub(crate) fn lookup(
    runs: &[Arc<Run>],
    tables: &[RunTable],
    partial: Option<&(Partial, RunTable)>,
    covers: &CoverView,
    key: &[u8],
) -> Result<Option<Option<Vec<u8>>>, StorageError> {
    let hash = run::key_hash(key);
    // One probe per cover first: the runs of a cover that says "no" are skipped.
    let absent = covers.absent(hash);
    let mut i = 0;
    while i < runs.len() {
        if let Some((p, out)) = partial.filter(|(p, _)| p.at == i && key < p.resume.as_slice()) {
            // Merged already: the output holds the newest entry of the inputs (no filter
            // of its own yet, but it holds only keys of theirs).
            let inputs = i..(i + p.inputs).min(runs.len());
            if inputs
                .clone()
                .any(|j| !absent(j) && runs[j].may_contain(hash))
            {
                if let Some(found) = run::get(out, key)? {
                    return Ok(Some(found));
                }
            }
            i += p.inputs;
            continue;
        }
        if !absent(i) && runs[i].may_contain(hash) {
            if let Some(found) = run::get(&tables[i], key)? {
                return Ok(Some(found));
            }
        }
        i += 1;
    }
    Ok(None)
}

/// A run's table as read.
pub(crate) type RunTable = redb::ReadOnlyTable<&'static [u8], &'static [u8]>;

/// Scans of `kind` from `from` (a key without its kind byte) on, one per source newest
/// first: a run's table, or for a merge in progress its output up to the resume key
/// followed by its inputs from there on.
pub(crate) fn scans(
    tables: &[RunTable],
    partial: Option<&(Partial, RunTable)>,
    kind: u8,
    from: &[u8],
) -> Result<Vec<RunScan>, StorageError> {
    let start = run::run_key(kind, from);
    let mut out = Vec::with_capacity(tables.len() + 1);
    let mut i = 0;
    while i < tables.len() {
        if let Some((p, table)) = partial.filter(|(p, _)| p.at == i) {
            out.push(RunScan::between(
                table,
                Some(kind),
                start.clone(),
                Some(p.resume.clone()),
            )?);
            let rest = start.clone().max(p.resume.clone());
            for t in &tables[i..(i + p.inputs).min(tables.len())] {
                out.push(RunScan::between(t, Some(kind), rest.clone(), None)?);
            }
            i += p.inputs;
            continue;
        }
        out.push(RunScan::between(
            &tables[i],
            Some(kind),
            start.clone(),
            None,
        )?);
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
