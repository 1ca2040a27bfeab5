//! Fault injection for crash-consistency tests: a redb storage backend over a real file
//! that fails every write and fsync once a shared budget of fsyncs is used up, the way a
//! disk that dies or fills up would.

use std::fs::File;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use redb::backends::FileBackend;
use redb::StorageBackend;

#[derive(Debug)]
pub(crate) struct FaultyBackend {
    inner: FileBackend,
    syncs_left: Arc<AtomicI64>,
}

impl FaultyBackend {
    pub fn new(file: File, syncs_left: Arc<AtomicI64>) -> Result<Self, redb::DatabaseError> {
        Ok(FaultyBackend {
            inner: FileBackend::new(file)?,
            syncs_left,
        })
    }

    fn dead(&self) -> bool {
        self.syncs_left.load(Ordering::SeqCst) <= 0
    }
}

fn injected() -> std::io::Error {
    std::io::Error::other("injected storage fault")
}

impl StorageBackend for FaultyBackend {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        if self.dead() {
            return Err(injected());
        }
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        if self.syncs_left.fetch_sub(1, Ordering::SeqCst) <= 0 {
            return Err(injected());
        }
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        if self.dead() {
            return Err(injected());
        }
        self.inner.write(offset, data)
    }

    fn close(&self) -> Result<(), std::io::Error> {
        self.inner.close()
    }
}
