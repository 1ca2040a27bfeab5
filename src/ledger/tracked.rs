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

use std::ops::Bound;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use redb::{BackendError, StorageBackend};

/// The ranges written to one shard file while a backup copies it.
#[derive(Debug, Default)]
pub(crate) struct WriteLog {
    on: AtomicBool,
    ranges: Mutex<Vec<(u64, u64)>>,
}

impl WriteLog {
    /// Starts recording (forgetting anything recorded before).
    pub fn start(&self) {
        let mut r = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        r.clear();
        self.on.store(true, Ordering::SeqCst);
    }

    /// Stops recording; returns the ranges written since [`WriteLog::start`], sorted and
    /// merged.
    pub fn stop(&self) -> Vec<(u64, u64)> {
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

/// A storage backend that records writes into a [`WriteLog`] while it is on.
#[derive(Debug)]
pub(crate) struct TrackedBackend<B> {
    inner: B,
    log: std::sync::Arc<WriteLog>,
}

impl<B> TrackedBackend<B> {
    pub fn new(inner: B, log: std::sync::Arc<WriteLog>) -> Self {
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
