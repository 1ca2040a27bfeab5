//! Online backups without pausing a shard's writer for the whole copy: a redb storage
//! backend that, while a backup copies the shard file, records the byte ranges the writer
//! writes. The backup copies the whole file while the writer goes on (a torn copy), then,
//! between two of the writer's commits, copies again only the ranges written meanwhile
//! and truncates to the file's length: the copy is then byte for byte the file at that
//! commit boundary. The writer pauses for those ranges, not for the file.
//!
//! Outside a backup the cost is one atomic load per write. Every change to the file goes
//! through `write` or `set_len` (redb has no other way to change it), and only the shard's
//! writer thread writes, so the ranges are complete once that thread takes them.
//!
//! All shards take that last step at one instant of the whole engine: each writer, at its
//! next batch boundary, waits at a [`Rendezvous`] until every writer is at one, and only
//! then copies its ranges again and goes on. While the rendezvous is open no shard commits,
//! so every shard's copy ends at the same engine-wide commit
//! ([`crate::ledger::ShardCopy::engine_commits`]). The price is that a writer also waits for
//! the slowest shard to finish its current batch.

use std::ops::Bound;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use redb::{BackendError, StorageBackend};

/// The ranges written to one shard file while a backup copies it.
#[derive(Debug, Default)]
pub(crate) struct WriteLog {
    on: AtomicBool,
    ranges: Mutex<Vec<(u64, u64)>>,
}

impl WriteLog {
    /// Starts recording (forgetting anything recorded before).
    pub(crate) fn start(&self) {
        let mut r = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        r.clear();
        self.on.store(true, Ordering::SeqCst);
    }

    /// Stops recording; returns the ranges written since [`WriteLog::start`], sorted and
    /// merged.
    pub(crate) fn stop(&self) -> Vec<(u64, u64)> {
        self.on.store(false, Ordering::SeqCst);
        let mut r = std::mem::take(&mut *self.ranges.lock().unwrap_or_else(|p| p.into_inner()));
        r.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(r.len());
        for (start, end) in r {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        merged
    }

    fn recording(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    fn record(&self, start: u64, end: u64) {
        if start < end {
            self.ranges
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((start, end));
        }
    }
}

/// Where every shard's writer waits until all of them are between two batches: the point
/// in time an online backup copies. All or none: if one writer does not arrive within the
/// timeout (a shard stuck in a long batch, or stopped), every writer goes on without
/// copying and the backup fails.
#[derive(Debug)]
pub(crate) struct Rendezvous {
    shards: usize,
    timeout: Duration,
    state: Mutex<Meeting>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Meeting {
    arrived: usize,
    /// The engine-wide commit count when the last writer arrived (set when it opens).
    cut: Option<u64>,
    abandoned: bool,
}

impl Rendezvous {
    pub(crate) fn new(shards: usize, timeout: Duration) -> Rendezvous {
        Rendezvous {
            shards,
            timeout,
            state: Mutex::new(Meeting::default()),
            changed: Condvar::new(),
        }
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Called by a writer between two of its batches: blocks until every writer has
    /// called it (`Some`: they were all paused at that moment, and `commits` read then) or
    /// the timeout passed (`None`: copy nothing). The count is read by the last writer to
    /// arrive, while every writer is paused: a writer that reads it after waking up may
    /// already see another shard's next commit.
    pub(crate) fn meet(&self, commits: &std::sync::atomic::AtomicU64) -> Option<u64> {
        let deadline = Instant::now() + self.timeout;
        let mut m = self.state.lock().unwrap_or_else(|p| p.into_inner());
        m.arrived += 1;
        if m.arrived >= self.shards && !m.abandoned {
            m.cut = Some(commits.load(Ordering::SeqCst));
            self.changed.notify_all();
        }
        loop {
            if let Some(cut) = m.cut {
                return Some(cut);
            }
            if m.abandoned {
                return None;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                m.abandoned = true;
                self.changed.notify_all();
                return None;
            }
            m = self
                .changed
                .wait_timeout(m, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A storage backend that records writes into a [`WriteLog`] while it is on.
#[derive(Debug)]
pub(crate) struct TrackedBackend<B> {
    inner: B,
    log: std::sync::Arc<WriteLog>,
}

impl<B> TrackedBackend<B> {
    pub(crate) fn new(inner: B, log: std::sync::Arc<WriteLog>) -> Self {
        TrackedBackend { inner, log }
    }
}

impl<B: StorageBackend> StorageBackend for TrackedBackend<B> {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        if self.log.recording() {
            // A shrink and a later growth leave zeros where the copy may hold old bytes.
            let old = self.inner.len()?;
            self.log.record(old.min(len), old.max(len));
        }
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        if self.log.recording() {
            self.log.record(offset, offset + data.len() as u64);
        }
        self.inner.write(offset, data)
    }

    fn close(&self) -> Result<(), std::io::Error> {
        self.inner.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

/// Brings `dest`, a copy of `src` taken while `ranges` were being written, up to `src` as
/// it is now: copies those ranges again and sets the length. Returns the bytes copied.
pub(crate) fn recopy(
    src: &std::path::Path,
    dest: &std::path::Path,
    ranges: &[(u64, u64)],
) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let from = std::fs::File::open(src)?;
    let to = std::fs::OpenOptions::new().write(true).open(dest)?;
    let len = from.metadata()?.len();
    let mut buf = Vec::new();
    let mut copied = 0;
    for &(start, end) in ranges {
        let end = end.min(len);
        if start >= end {
            continue;
        }
        buf.resize((end - start) as usize, 0);
        from.read_exact_at(&mut buf, start)?;
        to.write_all_at(&buf, start)?;
        copied += end - start;
    }
    to.set_len(len)?;
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_recorded_only_while_on_and_come_back_merged() {
        let log = WriteLog::default();
        assert!(!log.recording());
        log.start();
        assert!(log.recording());
        for (s, e) in [(40, 50), (0, 8), (8, 12), (45, 60), (100, 101)] {
            log.record(s, e);
        }
        assert_eq!(log.stop(), vec![(0, 12), (40, 60), (100, 101)]);
        assert!(!log.recording());
        assert!(log.stop().is_empty());
    }

    #[test]
    fn rendezvous_opens_only_when_every_writer_arrived() {
        let r = std::sync::Arc::new(Rendezvous::new(3, Duration::from_secs(30)));
        let commits = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(7));
        let arrived = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let (r, arrived, commits) = (r.clone(), arrived.clone(), commits.clone());
                std::thread::spawn(move || {
                    arrived.fetch_add(1, Ordering::SeqCst);
                    r.meet(&commits)
                })
            })
            .collect();
        while arrived.load(Ordering::SeqCst) < 2 {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(waiting.iter().all(|t| !t.is_finished()), "opened early");
        commits.store(9, Ordering::SeqCst);
        assert_eq!(r.meet(&commits), Some(9));
        // A commit after the meeting opened (the last writer went on) does not change the
        // cut the others report, however late they wake up.
        commits.store(10, Ordering::SeqCst);
        assert!(waiting.into_iter().all(|t| t.join().unwrap() == Some(9)));
    }

    #[test]
    fn rendezvous_without_every_writer_gives_up_for_all() {
        let r = std::sync::Arc::new(Rendezvous::new(3, Duration::from_millis(50)));
        let commits = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let other = {
            let (r, commits) = (r.clone(), commits.clone());
            std::thread::spawn(move || r.meet(&commits))
        };
        assert_eq!(r.meet(&commits), None);
        assert_eq!(other.join().unwrap(), None);
        // A writer that arrives after the others gave up does not copy either.
        assert_eq!(r.meet(&commits), None);
    }

    #[test]
    fn a_torn_copy_is_repaired_from_the_recorded_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dest) = (dir.path().join("src"), dir.path().join("dest"));
        std::fs::write(&src, vec![1u8; 1000]).unwrap();
        std::fs::copy(&src, &dest).unwrap();
        // Written after the copy: a range inside, and a shrink below the copy's length.
        let mut now = vec![1u8; 900];
        now[100..200].fill(7);
        std::fs::write(&src, &now).unwrap();
        let copied = recopy(&src, &dest, &[(100, 200), (900, 1000)]).unwrap();
        assert_eq!(copied, 100);
        assert_eq!(std::fs::read(&dest).unwrap(), now);
    }
}
