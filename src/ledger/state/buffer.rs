//! The buffer of a subscriber's committed handler effects on one shard: each batch's
//! effects are one row of the subscriber's state log and join the active buffer; a full
//! buffer is frozen and written as a new sorted run, a slice per batch, and the runs
//! merge by size tiers (see the module docs of `state` and `runs.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use foldhash::fast::RandomState;

use redb::{Database, ReadTransaction, ReadableDatabase, ReadableTable, WriteTransaction};

use super::log_row::decode_effects;
#[cfg(test)]
use super::log_row::encode_effects;
use super::run::{run_key, RunWriter, KIND_MARK, KIND_STATE, KIND_VERSION};
use super::runs::Runs;
use super::state_map::{key_prefix, sorted_order, StateMap};
use crate::effects::Effects;
use crate::ledger::format::tables::{
    missing_is_none, state_log_name, state_run_name, BlockDef, StateLogDef,
};

/// Buffered effects, merged (later wins). Marks and versions are only ever looked up by key,
/// so they live in hash tables (two of a new order's three lookups); state is hashed too
/// until a handler scans it (`state_map.rs`). foldhash, not the streaming xxh3 hasher: for
/// keys of a few dozen bytes it measured 7-8 % less CPU on a shipping-label run.
#[derive(Default, Clone)]
pub(crate) struct Buffered {
    pub(super) state: StateMap,
    pub(super) uniques: HashSet<Vec<u8>, RandomState>,
    pub(super) versions: HashMap<String, u64, RandomState>,
}

impl Buffered {
    fn merge(&mut self, e: Effects) {
        self.state.extend(e.state);
        self.uniques.extend(e.uniques);
        self.versions.extend(e.versions);
    }

    /// An empty buffer whose state is kept like this one's (ordered once scanned).
    fn empty_like(&self) -> Buffered {
        Buffered {
            state: self.state.empty_like(),
            ..Buffered::default()
        }
    }

    /// Entries (what the freeze threshold counts).
    pub(crate) fn len(&self) -> usize {
        self.state.len() + self.uniques.len() + self.versions.len()
    }
}

/// The active buffer, through a lock that a panic while holding it does not poison: every
/// change to it is a single insert, so a buffer left behind by one is whole.
pub(super) fn lock(active: &Mutex<Buffered>) -> MutexGuard<'_, Buffered> {
    active.lock().unwrap_or_else(|p| p.into_inner())
}

/// What [`StateBuffer::stats`] counts.
pub(crate) struct StateStats {
    pub(crate) runs: u64,
    pub(crate) run_entries: u64,
    pub(crate) buffered: u64,
    pub(crate) retired_runs: u64,
}

/// A subscriber's handler state on one shard: effects not yet in a run, and the runs.
#[derive(Default)]
pub(crate) struct StateBuffer {
    /// Effects of batches committed since the last freeze, and of the current batch's
    /// calls so far: shared with the batch's view, which writes each call's effects into
    /// it as the call succeeds (`view.rs`). Locked only by the shard's own thread.
    pub(crate) active: Arc<Mutex<Buffered>>,
    /// A frozen buffer being written as a run, a slice per batch.
    pub(crate) frozen: Option<Frozen>,
    /// First log row not yet deleted.
    pub(crate) first_row: u64,
    /// First log row not covered by a run: rows before it are deleted a few at a time by
    /// later maintenance (deleting a whole buffer's rows with its run's registration held
    /// that transaction for 10-30 ms), and a restart replays only rows from here on. Kept
    /// in the run list (`Runs::log_from`), in the transaction that registers the run.
    pub(crate) live_from: u64,
    /// Next log row to write.
    pub(crate) next_row: u64,
    /// The sorted runs, newest first.
    pub(crate) runs: Runs,
}

pub(crate) struct Frozen {
    pub(crate) effects: Arc<Buffered>,
    /// Marks, versions and hashed state in key order, for writing: sorted on a thread of
    /// their own (the state entries of an ordered buffer are written meanwhile), since
    /// sorting a buffer's marks held the writer for 15-30 ms.
    sorted: Sorted,
    /// Log rows `..=last_row` are covered by this buffer.
    last_row: u64,
    /// Where writing resumes.
    cursor: Cursor,
    table_id: u64,
    order: u64,
    writer: RunWriter,
    /// No older run exists: deletes need no tombstone.
    drop_tombstones: bool,
}

/// Hashed state entries (by index), marks and versions of a frozen buffer in key order,
/// sorted off the writer thread.
enum Sorted {
    Pending(crossbeam_channel::Receiver<SortedKeys>),
    Ready(SortedKeys),
}

type SortedKeys = (Vec<u32>, Vec<Vec<u8>>, Vec<(String, [u8; 8])>);

impl Sorted {
    /// Starts sorting the marks and versions of `effects` on a thread of their own (in
    /// place if no thread can be started).
    fn start(effects: &Arc<Buffered>) -> Sorted {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let of = effects.clone();
        let spawned = std::thread::Builder::new()
            .name("dedupd-state-sort".into())
            .spawn(move || {
                let _ = tx.send(sort_keys(&of));
            });
        match spawned {
            Ok(_) => Sorted::Pending(rx),
            Err(_) => Sorted::Ready(sort_keys(effects)),
        }
    }

    /// The sorted keys; `None` while still sorting, unless `wait`.
    fn get(&mut self, wait: bool) -> Option<&SortedKeys> {
        if let Sorted::Pending(rx) = self {
            let got = if wait {
                rx.recv().ok()
            } else {
                match rx.try_recv() {
                    Ok(k) => Some(k),
                    Err(crossbeam_channel::TryRecvError::Empty) => return None,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => None,
                }
            };
            // A sorting thread that died (it cannot, short of running out of memory) is
            // made up for in place.
            *self = Sorted::Ready(got.unwrap_or_default());
        }
        match self {
            Sorted::Ready(k) => Some(k),
            Sorted::Pending(_) => None,
        }
    }
}

fn sort_keys(effects: &Buffered) -> SortedKeys {
    let mut uniques: Vec<Vec<u8>> = effects.uniques.iter().cloned().collect();
    // The inline prefix first: most comparisons then touch no key.
    uniques.sort_unstable_by(|a, b| key_prefix(a).cmp(&key_prefix(b)).then_with(|| a.cmp(b)));
    let mut versions: Vec<(String, [u8; 8])> = effects
        .versions
        .iter()
        .map(|(k, v)| (k.clone(), v.to_le_bytes()))
        .collect();
    versions.sort_unstable();
    (sorted_order(&effects.state), uniques, versions)
}

/// Frees a written buffer on a thread of its own: dropping a buffer of 131,072 entries
/// held the writer for 5-10 ms.
fn drop_elsewhere(effects: Arc<Buffered>) {
    if Arc::strong_count(&effects) > 1 {
        return;
    }
    let mut held = Some(effects);
    let _ = std::thread::Builder::new()
        .name("dedupd-state-drop".into())
        .spawn({
            let effects = held.take();
            move || drop(effects)
        });
    drop(held);
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Cursor {
    /// After this state key of an ordered buffer (from the first when `None`).
    State(Option<Vec<u8>>),
    /// From this position of a hashed buffer's sorted state entries.
    StateAt(usize),
    /// From this index of the sorted marks / versions.
    Uniques(usize),
    Versions(usize),
    Done,
}

impl StateBuffer {
    /// Rebuilds the buffer from the subscriber's log (rows left by a crash or a stop) and
    /// loads its runs.
    pub(crate) fn load(db: &Database, sub: &str) -> Result<StateBuffer, redb::Error> {
        StateBuffer::load_from(&db.begin_read()?, sub)
    }

    /// [`StateBuffer::load`] through a read transaction (also of a read-only handle).
    pub(crate) fn load_from(txn: &ReadTransaction, sub: &str) -> Result<StateBuffer, redb::Error> {
        let runs = Runs::load(txn, sub)?;
        let mut buf = StateBuffer {
            live_from: runs.log_from,
            runs,
            ..StateBuffer::default()
        };
        let Some(t) = missing_is_none(txn.open_table(StateLogDef::new(&state_log_name(sub))))?
        else {
            return Ok(buf);
        };
        let mut active = Buffered::default();
        let mut first = None;
        for row in t.iter()? {
            let (k, v) = row?;
            first.get_or_insert(k.value());
            buf.next_row = k.value() + 1;
            if k.value() < buf.live_from {
                // In a run already; deleted by later maintenance.
                continue;
            }
            let effects = decode_effects(v.value()).ok_or_else(|| {
                redb::Error::Corrupted(format!(
                    "{} row {} does not decode",
                    state_log_name(sub),
                    k.value()
                ))
            })?;
            active.merge(effects);
        }
        buf.first_row = first.unwrap_or(buf.live_from);
        buf.next_row = buf.next_row.max(buf.live_from);
        buf.active = Arc::new(Mutex::new(active));
        Ok(buf)
    }

    /// Whether nothing is buffered.
    pub(crate) fn is_empty(&self) -> bool {
        self.frozen.is_none() && self.active_len() == 0
    }

    /// Entries in the active buffer.
    pub(crate) fn active_len(&self) -> usize {
        lock(&self.active).len()
    }

    /// Whether maintenance has work: a frozen buffer, a full active one, or runs to merge.
    pub(crate) fn has_work(&self, threshold: usize) -> bool {
        self.frozen.is_some() || self.active_len() >= threshold || self.runs.has_work(threshold)
    }

    /// Runs, their entries, buffered entries and retired runs, for reports.
    pub(crate) fn stats(&self) -> StateStats {
        StateStats {
            runs: self.runs.list.len() as u64,
            run_entries: self.runs.list.iter().map(|r| r.entries).sum(),
            buffered: (self.active_len() + self.frozen.as_ref().map_or(0, |f| f.effects.len()))
                as u64,
            retired_runs: self.runs.retired_len() as u64,
        }
    }

    /// Heap bytes of the runs' filters.
    pub(crate) fn filter_bytes(&self) -> u64 {
        self.runs.filter_bytes() + self.frozen.as_ref().map_or(0, |f| f.writer.filter_bytes())
    }

    /// Writes one batch's log row, whose effects its view already wrote into the active
    /// buffer.
    pub(crate) fn append_row(
        &mut self,
        txn: &WriteTransaction,
        sub: &str,
        row: &[u8],
    ) -> Result<(), redb::Error> {
        let mut t = txn.open_table(StateLogDef::new(&state_log_name(sub)))?;
        t.insert(self.next_row, row)?;
        self.next_row += 1;
        Ok(())
    }

    /// Writes one batch's effects as a log row and adds them to the active buffer (what a
    /// view and [`StateBuffer::append_row`] do call by call).
    #[cfg(test)]
    pub(crate) fn append(
        &mut self,
        txn: &WriteTransaction,
        sub: &str,
        effects: Effects,
    ) -> Result<(), redb::Error> {
        self.append_row(txn, sub, &encode_effects(&effects))?;
        lock(&self.active).merge(effects);
        Ok(())
    }

    /// Writes the whole buffer as a run in `txn` and does no merge work: a state read
    /// (dump, count) calls this before it reads; a merge due goes on in later slices.
    pub(crate) fn flush_all(
        &mut self,
        db: &Database,
        txn: &WriteTransaction,
        sub: &str,
        threshold: usize,
    ) -> Result<bool, redb::Error> {
        self.maintain(db, txn, sub, threshold, &mut 0, true)
    }

    /// One slice of run maintenance (a merge, retired runs), then: freezes a full active
    /// buffer (or any non-empty one when `all`) when none is being written, and writes
    /// entries of the frozen one as a new run (all of it when `all`). Takes what it uses
    /// from `budget` (entries; shared with the other subscribers of the transaction) and
    /// does nothing when it is spent, unless `all`. Returns whether it wrote anything.
    ///
    /// `all` only lifts the budget of the flush: merges and retired runs stay within
    /// `budget` (none at 0). A state read flushes with `all` before it reads; when that
    /// also finished any merge due, one transaction merged millions of entries (the shard
    /// stalled for the whole merge, and the merge's inputs stayed on disk beside its
    /// output, since only a sliced merge frees them behind its cursor).
    ///
    /// The merge goes first: it reads its inputs through a read snapshot, so it must only
    /// ever see runs committed by earlier transactions, never one this call just finished.
    pub(crate) fn maintain(
        &mut self,
        db: &Database,
        txn: &WriteTransaction,
        sub: &str,
        threshold: usize,
        budget: &mut usize,
        all: bool,
    ) -> Result<bool, redb::Error> {
        if *budget == 0 && !all {
            return Ok(false);
        }
        // A flush pending takes half, so neither starves the other.
        let flushing = self.frozen.is_some() || self.active_len() >= threshold;
        let merge_budget = if flushing && !all {
            *budget / 2 + 1
        } else {
            *budget
        };
        let used = if merge_budget > 0 {
            self.runs.maintain(db, txn, sub, threshold, merge_budget)?
                + self.trim_log(txn, sub, merge_budget)?
        } else {
            0
        };
        *budget = budget.saturating_sub(used);
        let mut wrote = used > 0;
        loop {
            if self.frozen.is_none() {
                let n = self.active_len();
                if n == 0 || (n < threshold && !all) {
                    return Ok(wrote);
                }
                self.freeze();
            }
            let Some(f) = self.frozen.as_mut() else {
                return Ok(wrote);
            };
            let limit = if all { usize::MAX } else { (*budget).max(1) };
            let before = (f.writer.entries(), f.cursor.clone());
            write_slice(txn, sub, f, limit, all)?;
            *budget = budget.saturating_sub((f.writer.entries() - before.0) as usize);
            // Nothing written while the marks are still being sorted.
            wrote |= (f.writer.entries(), &f.cursor) != (before.0, &before.1);
            if f.cursor != Cursor::Done {
                return Ok(wrote);
            }
            // Written in full: the run is registered and the log rows it covers go, in the
            // same transaction.
            let Some(f) = self.frozen.take() else {
                return Ok(wrote);
            };
            let mut run = txn.open_table(BlockDef::new(&state_run_name(sub, f.table_id)))?;
            let written = f.writer.finish(&mut run)?;
            drop(run);
            self.runs
                .add_flushed(txn, sub, f.table_id, f.order, written)?;
            // The log rows the run covers stop counting in this transaction; they are
            // deleted later, a slice at a time (`trim_log`).
            self.live_from = f.last_row + 1;
            self.runs.set_log_from(txn, sub, self.live_from)?;
            drop_elsewhere(f.effects);
            if !all {
                return Ok(wrote);
            }
        }
    }

    /// Deletes up to a row per 64 entries of `budget` (at least one) of the log rows runs
    /// cover already. Returns the work done, in entries.
    fn trim_log(
        &mut self,
        txn: &WriteTransaction,
        sub: &str,
        budget: usize,
    ) -> Result<usize, redb::Error> {
        if self.first_row >= self.live_from {
            return Ok(0);
        }
        let mut t = txn.open_table(StateLogDef::new(&state_log_name(sub)))?;
        let end = self
            .live_from
            .min(self.first_row + (budget as u64 / 64).max(1));
        for row in self.first_row..end {
            t.remove(row)?;
        }
        let rows = end - self.first_row;
        self.first_row = end;
        Ok(rows as usize * 64)
    }

    /// Waits for a frozen buffer's sort, as if the sorting thread had been instant: the
    /// models below then flush at the same batches however busy the machine is.
    #[cfg(test)]
    fn wait_sorted(&mut self) {
        if let Some(f) = self.frozen.as_mut() {
            f.sorted.get(true);
        }
    }

    fn freeze(&mut self) {
        let effects = {
            let mut active = lock(&self.active);
            let empty = active.empty_like();
            Arc::new(std::mem::replace(&mut *active, empty))
        };
        let cursor = if effects.state.is_ordered() {
            Cursor::State(None)
        } else {
            Cursor::StateAt(0)
        };
        let sorted = Sorted::start(&effects);
        let (table_id, order) = self.runs.next_flush();
        self.frozen = Some(Frozen {
            writer: self.runs.flush_writer(effects.len() as u64),
            effects,
            sorted,
            last_row: self.next_row.saturating_sub(1),
            cursor,
            table_id,
            order,
            drop_tombstones: self.runs.list.is_empty(),
        });
    }
}

/// Writes one state entry of a frozen buffer into its run: a delete as a tombstone, unless
/// no older run exists. `key` is scratch space.
fn push_state(
    writer: &mut RunWriter,
    drop_tombstones: bool,
    t: &mut redb::Table<&'static [u8], &'static [u8]>,
    key: &mut Vec<u8>,
    (k, v): (&[u8], Option<&[u8]>),
) -> Result<(), redb::Error> {
    if v.is_none() && drop_tombstones {
        return Ok(());
    }
    key.clear();
    key.push(KIND_STATE);
    key.extend_from_slice(k);
    writer.push(t, key, v)?;
    Ok(())
}

/// Writes up to `limit` entries of a frozen buffer from its cursor on into its run, in run
/// key order: state entries, then marks, then versions. Hashed state waits for its sort
/// like the marks.
fn write_slice(
    txn: &WriteTransaction,
    sub: &str,
    f: &mut Frozen,
    mut limit: usize,
    all: bool,
) -> Result<(), redb::Error> {
    let mut t = txn.open_table(BlockDef::new(&state_run_name(sub, f.table_id)))?;
    let mut key = Vec::new();
    if let Cursor::State(start) = &f.cursor {
        let mut last = None;
        for (k, v) in f.effects.state.ordered_after(start.as_deref()).take(limit) {
            limit -= 1;
            last = Some(k);
            push_state(
                &mut f.writer,
                f.drop_tombstones,
                &mut t,
                &mut key,
                (k, v.as_deref()),
            )?;
        }
        if limit == 0 {
            if let Some(last) = last {
                f.cursor = Cursor::State(Some(last.clone()));
                return Ok(());
            }
        }
        f.cursor = Cursor::Uniques(0);
    }
    // The rest once its sort is done (at once when everything must be written now).
    let Some((order, uniques, versions)) = f.sorted.get(all) else {
        return Ok(());
    };
    if let Cursor::StateAt(from) = f.cursor {
        let n = order.len().saturating_sub(from).min(limit);
        for &i in &order[from..from + n] {
            if let Some((k, v)) = f.effects.state.at(i as usize) {
                push_state(
                    &mut f.writer,
                    f.drop_tombstones,
                    &mut t,
                    &mut key,
                    (k, v.as_deref()),
                )?;
            }
        }
        limit -= n;
        if limit == 0 && from + n < order.len() {
            f.cursor = Cursor::StateAt(from + n);
            return Ok(());
        }
        f.cursor = Cursor::Uniques(0);
    }
    if let Cursor::Uniques(from) = f.cursor {
        let n = uniques.len().saturating_sub(from).min(limit);
        for m in &uniques[from..from + n] {
            f.writer.push(&mut t, &run_key(KIND_MARK, m), Some(&[]))?;
        }
        limit -= n;
        if limit == 0 && from + n < uniques.len() {
            f.cursor = Cursor::Uniques(from + n);
            return Ok(());
        }
        f.cursor = Cursor::Versions(0);
    }
    if let Cursor::Versions(from) = f.cursor {
        let n = versions.len().saturating_sub(from).min(limit);
        for (k, v) in &versions[from..from + n] {
            f.writer
                .push(&mut t, &run_key(KIND_VERSION, k.as_bytes()), Some(&v[..]))?;
        }
        if from + n < versions.len() {
            f.cursor = Cursor::Versions(from + n);
            return Ok(());
        }
        f.cursor = Cursor::Done;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
