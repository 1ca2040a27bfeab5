//! Fault injection for crash-consistency tests: a redb storage backend over a real file
//! that, once a shared budget of fsyncs is used up, either fails every write and fsync
//! the way a disk that dies or fills up would (what was written stays, as in the page
//! cache), or loses power: every write since the file's last completed fsync is undone
//! except a seeded random half of them (a disk persists some unsynced writes, in any
//! order, and loses the others), and then nothing answers.
//!
//! A kill -9 keeps the page cache, so a missing or misplaced fsync passes every kill test;
//! the power cut is what shows it.

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redb::backends::FileBackend;
use redb::StorageBackend;

/// What happens when the budget runs out, shared by every shard file of a ledger.
#[derive(Debug)]
pub(crate) struct FaultPlan {
    syncs_left: AtomicI64,
    power_loss: AtomicBool,
    seed: AtomicU64,
    /// Unsynced writes a power cut undid (and did not let through), over all files.
    lost_writes: AtomicU64,
}

impl FaultPlan {
    pub fn new() -> FaultPlan {
        FaultPlan {
            syncs_left: AtomicI64::new(i64::MAX),
            power_loss: AtomicBool::new(false),
            seed: AtomicU64::new(1),
            lost_writes: AtomicU64::new(0),
        }
    }

    /// `fsyncs` more fsyncs succeed; then the disk fails (`power_loss` false) or the power
    /// is cut, keeping each unsynced write with probability 1/2 drawn from `seed`.
    pub fn arm(&self, fsyncs: u64, power_loss: bool, seed: u64) {
        self.power_loss.store(power_loss, Ordering::SeqCst);
        self.seed.store(seed.max(1), Ordering::SeqCst);
        self.syncs_left
            .store(i64::try_from(fsyncs).unwrap_or(i64::MAX), Ordering::SeqCst);
    }

    pub fn lost_writes(&self) -> u64 {
        self.lost_writes.load(Ordering::SeqCst)
    }

    fn dead(&self) -> bool {
        self.syncs_left.load(Ordering::SeqCst) <= 0
    }

    fn power_loss(&self) -> bool {
        self.power_loss.load(Ordering::SeqCst)
    }

    /// Whether writes fail now: a failed disk fails them once the budget is used up; with
    /// a power loss writes go on (into the "page cache") until a file's next fsync cuts it.
    fn writes_fail(&self) -> bool {
        self.dead() && !self.power_loss()
    }
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
}

impl FaultyBackend {
    pub fn new(file: File, plan: Arc<FaultPlan>) -> Result<Self, redb::DatabaseError> {
        let synced_len = file.metadata()?.len();
        Ok(FaultyBackend {
            inner: FileBackend::new(file)?,
            plan,
            unsynced: Mutex::new(Unsynced {
                synced_len,
                ..Unsynced::default()
            }),
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
        for c in changes.drain(..) {
            let Change::Write { offset, new, .. } = c else {
                continue;
            };
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
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        let mut u = self.unsynced();
        if u.cut || self.plan.writes_fail() {
            return Err(self.failed(&mut u));
        }
        let old_len = self.inner.len()?;
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
        if u.cut || self.plan.syncs_left.fetch_sub(1, Ordering::SeqCst) <= 0 {
            return Err(self.failed(&mut u));
        }
        self.inner.sync_data()?;
        u.changes.clear();
        u.synced_len = self.inner.len()?;
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        let mut u = self.unsynced();
        if u.cut || self.plan.writes_fail() {
            return Err(self.failed(&mut u));
        }
        let len = self.inner.len()?;
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
