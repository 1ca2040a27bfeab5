//! Fault injection for crash-consistency tests: a redb storage backend over a real file
//! that, once a shared budget of fsyncs is used up, either fails every write and fsync
//! the way a disk that dies or fills up would (what was written stays, as in the page
//! cache), or loses power: every write since the file's last completed fsync is undone
//! except a seeded random half of them (a disk persists some unsynced writes, in any
//! order, and loses the others), and then nothing answers.
//!
//! A kill -9 keeps the page cache, so a missing or misplaced fsync passes every kill test;
//! the power cut is what shows it.
//!
//! Three more faults: a full disk (writes that need new blocks fail with `ENOSPC`, as on a
//! filesystem without free ones, while writes in place and fsyncs still work), a torn
//! write (the power cut keeps only the first half of the newest unsynced write, as a disk
//! that lost power in the middle of a sector run), and failing reads (an unreadable
//! sector: after a budget of reads every read fails with `EIO`; the budget counts reads,
//! so it can land inside opening and recovery).

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redb::backends::FileBackend;
use redb::StorageBackend;

/// What a used-up budget does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FaultKind {
    /// Every later write and fsync fails; what was written stays.
    FailDisk,
    /// Every write since a file's last fsync is lost but a random half; nothing answers.
    PowerCut,
    /// The power cut, and the newest unsynced write is kept half-written.
    TornWrite,
    /// Writes that need new blocks (past the end of what was ever written: the file's
    /// end, or a hole `set_len` left) fail with `ENOSPC`; the rest works.
    DiskFull,
}

/// What happens when the budget runs out, shared by every shard file of a ledger.
#[derive(Debug)]
pub(crate) struct FaultPlan {
    syncs_left: AtomicI64,
    /// Reads that succeed before every read fails (`i64::MAX`: reads never fail).
    reads_left: AtomicI64,
    power_loss: AtomicBool,
    torn: AtomicBool,
    disk_full: AtomicBool,
    seed: AtomicU64,
    /// Unsynced writes a power cut undid (and did not let through), over all files.
    lost_writes: AtomicU64,
    /// Completed fsyncs over all files, so a test can place faults across a stream.
    synced: AtomicU64,
    /// Reads that reached the files (failed ones included), so a test can place read
    /// faults across a stream.
    reads: AtomicU64,
}

impl FaultPlan {
    pub(crate) fn new() -> FaultPlan {
        FaultPlan {
            syncs_left: AtomicI64::new(i64::MAX),
            reads_left: AtomicI64::new(i64::MAX),
            power_loss: AtomicBool::new(false),
            torn: AtomicBool::new(false),
            disk_full: AtomicBool::new(false),
            seed: AtomicU64::new(1),
            lost_writes: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        }
    }

    /// `fsyncs` more fsyncs succeed; then `kind` happens. A power cut keeps each unsynced
    /// write with probability 1/2 drawn from `seed`.
    pub(crate) fn arm(&self, fsyncs: u64, kind: FaultKind, seed: u64) {
        self.power_loss.store(
            matches!(kind, FaultKind::PowerCut | FaultKind::TornWrite),
            Ordering::SeqCst,
        );
        self.torn
            .store(kind == FaultKind::TornWrite, Ordering::SeqCst);
        self.disk_full
            .store(kind == FaultKind::DiskFull, Ordering::SeqCst);
        self.seed.store(seed.max(1), Ordering::SeqCst);
        self.syncs_left
            .store(i64::try_from(fsyncs).unwrap_or(i64::MAX), Ordering::SeqCst);
    }

    /// `reads` more reads succeed (across all files); then every read fails.
    pub(crate) fn fail_reads_after(&self, reads: u64) {
        self.reads_left
            .store(i64::try_from(reads).unwrap_or(i64::MAX), Ordering::SeqCst);
    }

    /// Counts a read, and says whether it fails (using up one of the budget's reads).
    fn read_fails(&self) -> bool {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.reads_left.load(Ordering::SeqCst) != i64::MAX
            && self.reads_left.fetch_sub(1, Ordering::SeqCst) <= 0
    }

    pub(crate) fn lost_writes(&self) -> u64 {
        self.lost_writes.load(Ordering::SeqCst)
    }

    pub(crate) fn fsyncs(&self) -> u64 {
        self.synced.load(Ordering::SeqCst)
    }

    pub(crate) fn reads(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }

    fn dead(&self) -> bool {
        self.syncs_left.load(Ordering::SeqCst) <= 0
    }

    fn power_loss(&self) -> bool {
        self.power_loss.load(Ordering::SeqCst)
    }

    /// Whether writes fail now: a failed disk fails them once the budget is used up; with
    /// a power loss writes go on (into the "page cache") until a file's next fsync cuts it;
    /// a full disk fails only the writes that need new blocks (`grows`).
    fn writes_fail(&self, grows: bool) -> bool {
        if self.disk_full.load(Ordering::SeqCst) {
            return self.syncs_left.load(Ordering::SeqCst) <= 0 && grows;
        }
        self.dead() && !self.power_loss()
    }

    /// Whether fsyncs and the rest stop answering once the budget is used up (a full disk
    /// still syncs what fits).
    fn syncs_fail(&self) -> bool {
        !self.disk_full.load(Ordering::SeqCst)
    }
}

/// The error of a write that needs blocks a full disk does not have.
fn no_space() -> std::io::Error {
    std::io::Error::from_raw_os_error(28)
}

/// A change since the last completed fsync, with what it replaced.
#[derive(Debug)]
enum Change {
    Write {
        offset: u64,
        /// The bytes it overwrote (shorter than `new` where it wrote past the end).
        old: Vec<u8>,
        new: Vec<u8>,
    },
    SetLen {
        old_len: u64,
        /// The bytes a shrink cut off (from the new length on).
        tail: Vec<u8>,
    },
}

#[derive(Debug, Default)]
struct Unsynced {
    changes: Vec<Change>,
    /// The file's length at the last completed fsync.
    synced_len: u64,
    /// The power was cut: nothing answers any more.
    cut: bool,
}

#[derive(Debug)]
pub(crate) struct FaultyBackend {
    inner: FileBackend,
    plan: Arc<FaultPlan>,
    unsynced: Mutex<Unsynced>,
    /// End of the bytes ever written: beyond it a file grown by `set_len` is a hole, and
    /// writing there needs blocks a full disk does not have.
    written_end: AtomicU64,
}

impl FaultyBackend {
    pub(crate) fn new(file: File, plan: Arc<FaultPlan>) -> Result<Self, redb::DatabaseError> {
        let synced_len = file.metadata()?.len();
        Ok(FaultyBackend {
            inner: FileBackend::new(file)?,
            plan,
            unsynced: Mutex::new(Unsynced {
                synced_len,
                ..Unsynced::default()
            }),
            written_end: AtomicU64::new(synced_len),
        })
    }

    fn unsynced(&self) -> std::sync::MutexGuard<'_, Unsynced> {
        self.unsynced.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The error of a dead disk; with a power loss, first brings the file back to what
    /// the disk would hold (once).
    fn failed(&self, u: &mut Unsynced) -> std::io::Error {
        if self.plan.power_loss() && !u.cut {
            u.cut = true;
            let synced_len = u.synced_len;
            if let Err(e) = self.cut_power(&mut u.changes, synced_len) {
                return e;
            }
        }
        std::io::Error::other("injected storage fault")
    }

    /// Undoes every unsynced change, newest first, then lets a random half of the writes
    /// through again in their order.
    fn cut_power(&self, changes: &mut Vec<Change>, synced_len: u64) -> Result<(), std::io::Error> {
        for c in changes.iter().rev() {
            match c {
                Change::Write { offset, old, .. } => self.inner.write(*offset, old)?,
                Change::SetLen { old_len, tail } => {
                    let shrunk_to = old_len - tail.len() as u64;
                    self.inner.set_len(*old_len)?;
                    self.inner.write(shrunk_to, tail)?;
                }
            }
        }
        // Writes past the synced length go with it (a let-through one brings its bytes).
        self.inner.set_len(synced_len)?;
        let mut x = self.plan.seed.load(Ordering::SeqCst);
        let torn = self.plan.torn.load(Ordering::SeqCst);
        let newest = changes
            .iter()
            .rposition(|c| matches!(c, Change::Write { .. }));
        for (i, c) in changes.drain(..).enumerate() {
            let Change::Write { offset, new, .. } = c else {
                continue;
            };
            if torn && Some(i) == newest {
                // The write the power cut interrupted: its first half reached the disk.
                self.inner.write(offset, &new[..new.len() / 2])?;
                self.plan.lost_writes.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x & 1 == 0 {
                self.inner.write(offset, &new)?;
            } else {
                self.plan.lost_writes.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.inner.sync_data()
    }
}

impl StorageBackend for FaultyBackend {
    fn len(&self) -> Result<u64, std::io::Error> {
        let mut u = self.unsynced();
        if u.cut {
            return Err(self.failed(&mut u));
        }
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        let mut u = self.unsynced();
        if u.cut {
            return Err(self.failed(&mut u));
        }
        if self.plan.read_fails() {
            return Err(std::io::Error::from_raw_os_error(5));
        }
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        let mut u = self.unsynced();
        let old_len = self.inner.len()?;
        if u.cut {
            return Err(self.failed(&mut u));
        }
        // Growing a file makes a hole and needs no blocks yet, even on a full disk.
        if self.plan.writes_fail(false) {
            return Err(self.failed(&mut u));
        }
        self.written_end.fetch_min(len, Ordering::SeqCst);
        let mut tail = vec![0; old_len.saturating_sub(len) as usize];
        if !tail.is_empty() {
            self.inner.read(len, &mut tail)?;
        }
        self.inner.set_len(len)?;
        u.changes.push(Change::SetLen { old_len, tail });
        Ok(())
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        let mut u = self.unsynced();
        if u.cut
            || (self.plan.syncs_left.fetch_sub(1, Ordering::SeqCst) <= 0 && self.plan.syncs_fail())
        {
            return Err(self.failed(&mut u));
        }
        self.inner.sync_data()?;
        self.plan.synced.fetch_add(1, Ordering::SeqCst);
        u.changes.clear();
        u.synced_len = self.inner.len()?;
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        let mut u = self.unsynced();
        let len = self.inner.len()?;
        if u.cut {
            return Err(self.failed(&mut u));
        }
        let end = offset + data.len() as u64;
        if self
            .plan
            .writes_fail(end > self.written_end.load(Ordering::SeqCst))
        {
            if self.plan.disk_full.load(Ordering::SeqCst) {
                return Err(no_space());
            }
            return Err(self.failed(&mut u));
        }
        self.written_end.fetch_max(end, Ordering::SeqCst);
        let overlap = len.saturating_sub(offset).min(data.len() as u64) as usize;
        let mut old = vec![0; overlap];
        if overlap > 0 {
            self.inner.read(offset, &mut old)?;
        }
        self.inner.write(offset, data)?;
        u.changes.push(Change::Write {
            offset,
            old,
            new: data.to_vec(),
        });
        Ok(())
    }

    fn close(&self) -> Result<(), std::io::Error> {
        let mut u = self.unsynced();
        if u.cut || (self.plan.dead() && self.plan.power_loss()) {
            // The process "died" with the power: leave the file as the disk holds it.
            let _ = self.failed(&mut u);
            return Ok(());
        }
        self.inner.close()
    }
}

impl Drop for FaultyBackend {
    fn drop(&mut self) {
        let mut u = self.unsynced();
        if self.plan.dead() && self.plan.power_loss() && !u.cut {
            let _ = self.failed(&mut u);
        }
    }
}
