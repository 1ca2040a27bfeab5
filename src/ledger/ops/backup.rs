//! Online backups: every shard file copied at one common batch boundary of the whole
//! engine (`backends/tracked.rs` records what a writer writes meanwhile).

use super::*;

/// How long an online backup waits for every shard's writer to reach a batch boundary
/// (the longest batch, a slow handler's included, must fit) before it gives up.
const BACKUP_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(30);

/// One shard file copied for a backup, and how long its writer was paused for the copy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct ShardCopy {
    /// The file name (`shard-NNN.redb`).
    pub(crate) file: String,
    pub bytes: u64,
    /// Bytes written to the shard while it was copied, copied again with its writer
    /// paused.
    pub recopied_bytes: u64,
    /// How long the shard's writer paused for the backup (microseconds): waiting for the
    /// other writers to reach a batch boundary, then copying its ranges again.
    pub(crate) writer_paused_us: u64,
    /// The part of `writer_paused_us` spent waiting for the other writers.
    #[serde(default)]
    pub(crate) waited_for_shards_us: u64,
    /// Durable commits of the whole engine (all shards) when this copy was cut: the same
    /// in every shard's copy of one backup, which is what makes it one instant.
    #[serde(default)]
    pub engine_commits: u64,
}

impl Ledger {
    /// Copies every shard file and the manifest into `dir`, which must be absent or
    /// empty; all copies are the files at one instant of the engine. The writers go on
    /// while their files are copied; each then pauses at its next batch boundary until
    /// every writer is paused, copies again the ranges written meanwhile (`backends/tracked.rs`)
    /// and goes on. Afterwards, off the writer threads, each copy is closed the way redb
    /// closes a file ([`close_copied_shard`]) and fsync'd, so the copy opens as a data
    /// directory of its own, read-only too. The directory entries are not fsync'd here: the caller adds files and
    /// syncs them. One backup runs at a time; a second waits.
    pub fn backup(&self, dir: &Path) -> Result<Vec<ShardCopy>, LedgerError> {
        self.backup_after_copy(dir, || {})
    }

    /// [`Ledger::backup`], running `after_copy` once the files are copied and before the
    /// writers bring the copies up to date: what it commits must be in the backup. For tests.
    #[doc(hidden)]
    pub fn backup_after_copy(
        &self,
        dir: &Path,
        after_copy: impl FnOnce(),
    ) -> Result<Vec<ShardCopy>, LedgerError> {
        let bad = |detail: String| LedgerError::DataDir {
            path: dir.to_path_buf(),
            detail,
        };
        let _one_at_a_time = self.backup.lock().unwrap_or_else(|p| p.into_inner());
        if dir.exists() {
            let mut entries = std::fs::read_dir(dir).map_err(|e| bad(e.to_string()))?;
            if entries.next().is_some() {
                return Err(bad("backup directory is not empty".into()));
            }
        }
        crate::ledger::create_private_dir_all(dir).map_err(|e| bad(e.to_string()))?;
        std::fs::copy(self.data_dir.join(MANIFEST), dir.join(MANIFEST))
            .map_err(|e| bad(format!("cannot copy the manifest: {e}")))?;
        let sources = match self.ask_all(|reply| Control::BackupBegin { reply }) {
            Ok(s) => s,
            Err(e) => {
                let meeting = Arc::new(Rendezvous::new(self.shards.len(), Duration::ZERO));
                let _ = self.ask_all(|reply| Control::BackupFinish {
                    dest: None,
                    meeting: meeting.clone(),
                    reply,
                });
                return Err(e);
            }
        };
        let mut copied = Ok(());
        for src in &sources {
            let name = src.file_name().unwrap_or_default();
            if let Err(e) = std::fs::copy(src, dir.join(name)) {
                copied = Err(bad(format!("backup of {} failed: {e}", src.display())));
                break;
            }
        }
        if copied.is_ok() {
            after_copy();
        }
        let dest = copied.is_ok().then(|| dir.to_path_buf());
        // Every writer pauses at its next batch boundary until all are paused, then each
        // brings its copy up to that one instant (`backends/tracked.rs`).
        let meeting = Arc::new(Rendezvous::new(
            self.shards.len(),
            BACKUP_RENDEZVOUS_TIMEOUT,
        ));
        let finished = self.ask_all(|reply| Control::BackupFinish {
            dest: dest.clone(),
            meeting: meeting.clone(),
            reply,
        });
        copied?;
        let copies = finished?;
        for copy in &copies {
            close_copied_shard(&dir.join(&copy.file))?;
        }
        Ok(copies)
    }
}
