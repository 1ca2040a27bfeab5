//! Backups of a data directory and restoring them, one layout for both routes: offline
//! (`dedupd backup`, a stopped engine's directory) and online (`POST
//! /v1/maintenance/backup`, each shard copied between two of its commits).
//!
//! A backup directory holds the data directory's manifest, every shard file, the uploaded
//! handler components (`handlers/`) and the audit log (`audit.jsonl`) when the data
//! directory has them, and `backup.json`: the backup format, the dedupd version, when it
//! was taken, and per file its relative path, size and xxh3-128 checksum. Every file and
//! directory is fsync'd before `backup.json` is written (temporary name, fsync, rename,
//! fsync), so a backup without `backup.json` is an interrupted one and is refused.
//!
//! A restore checks `backup.json` and every file against it (missing, extra, other size,
//! other checksum: the file is named) before it writes anything, copies into an empty
//! data directory with the data directory's manifest last (an engine refuses shard files
//! without a manifest, so an interrupted restore cannot be mistaken for a data
//! directory), fsyncs, and opens the result read-only to confirm that it loads.

use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::ledger::{
    self, create_private_dir_all, hold_closed_shards, offline_report, private_file, sync_dir,
    Ledger, LedgerError, LedgerReport, AUDIT_LOG, FORMAT_VERSION, HANDLERS_DIR, MANIFEST,
};

/// The file that describes a backup, written last.
pub const BACKUP_MANIFEST: &str = "backup.json";

/// The layout of backup directories this build writes and reads.
pub(crate) const BACKUP_FORMAT: u64 = 1;

/// What a backup holds (`backup.json`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BackupManifest {
    /// Layout of the backup directory ([`BACKUP_FORMAT`]).
    pub(crate) backup_format: u64,
    /// The dedupd that wrote it.
    pub dedupd_version: String,
    /// Milliseconds since the Unix epoch.
    pub(crate) created_at_ms: u64,
    /// `true`: taken from a running engine (all shards at one common commit boundary).
    pub online: bool,
    /// The data directory's format and shard count (from its manifest).
    pub(crate) data_format_version: u64,
    pub shards: usize,
    /// Every file of the backup but `backup.json`, sorted by path.
    pub files: Vec<BackupFile>,
}

/// One file of a backup.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BackupFile {
    /// Relative to the backup directory, `/`-separated.
    pub(crate) path: String,
    pub(crate) bytes: u64,
    /// xxh3-128 of the contents, 32 hex digits.
    pub(crate) xxh3_128: String,
}

/// A backup taken: its manifest, and for an online one how long each shard's writer was
/// paused while its file was copied.
#[derive(Debug, Clone, Serialize)]
pub struct BackupReport {
    pub(crate) dir: PathBuf,
    pub manifest: BackupManifest,
    pub bytes: u64,
    pub shard_copies: Vec<ledger::ShardCopy>,
}

impl BackupReport {
    /// The longest pause of one shard's writer (online backups), in milliseconds.
    pub fn longest_writer_pause_ms(&self) -> f64 {
        self.shard_copies
            .iter()
            .map(|c| c.writer_paused_us)
            .max()
            .unwrap_or(0) as f64
            / 1e3
    }
}

/// Why a backup or restore failed; the text says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackupError {
    #[error("{} is not a dedupd data directory (no {MANIFEST})", .0.display())]
    NotADataDir(PathBuf),
    #[error("{} is in use by a running dedupd: back it up online instead with `POST /v1/maintenance/backup` (admin API), which copies each shard between two of its commits, or stop the engine first", .0.display())]
    Running(PathBuf),
    #[error("{} is not empty: {what} goes into a new or empty directory", .path.display())]
    NotEmpty { path: PathBuf, what: &'static str },
    #[error("{} is not a complete backup: it has no {BACKUP_MANIFEST} (the backup was interrupted, or this is not a backup directory); take a new backup", .0.display())]
    Incomplete(PathBuf),
    #[error("backup {}: {file} {problem}; the backup cannot be trusted, nothing was restored", .dir.display())]
    Damaged {
        dir: PathBuf,
        file: String,
        problem: String,
    },
    #[error("backup {} has backup format {found} (data format {data_format}); this build reads backup format {BACKUP_FORMAT}, data format up to {FORMAT_VERSION}: restore it with a newer dedupd", .dir.display())]
    NewerFormat {
        dir: PathBuf,
        found: u64,
        data_format: u64,
    },
    #[error("{}: {detail}", .path.display())]
    Io { path: PathBuf, detail: String },
    #[error("restored into {}, but it does not load: {source}. Nothing uses it yet: remove it and restore again, or restore another backup", .dir.display())]
    DoesNotLoad { dir: PathBuf, source: LedgerError },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// What a backup, a restore or a check reports as it goes, for a progress bar: a step and
/// the bytes it reads in all, then the bytes read, a chunk at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Progress {
    Step { what: &'static str, bytes: u64 },
    Read(u64),
}

/// Receives [`Progress`]; `&mut |_| {}` when nobody watches.
pub(crate) type Observer<'a> = &'a mut dyn FnMut(Progress);

fn io(path: &Path) -> impl Fn(std::io::Error) -> BackupError + '_ {
    move |e| BackupError::Io {
        path: path.to_path_buf(),
        detail: e.to_string(),
    }
}

/// Backs up a stopped engine's data directory into `to` (absent or empty), reporting its
/// progress to `observe` (one step: the shard files). The shard files are held open
/// read-only for the whole copy, so an engine cannot start on the directory meanwhile; one
/// running already is [`BackupError::Running`].
pub fn backup_offline(
    data_dir: &Path,
    to: &Path,
    observe: Observer,
) -> Result<BackupReport, BackupError> {
    if !data_dir.join(MANIFEST).is_file() {
        return Err(BackupError::NotADataDir(data_dir.to_path_buf()));
    }
    let held = hold_closed_shards(data_dir).map_err(|e| match e {
        LedgerError::InUse { .. } => BackupError::Running(data_dir.to_path_buf()),
        e => e.into(),
    })?;
    prepare_empty(to, "a backup")?;
    let bytes = held
        .paths
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).map_err(io(p)))
        .sum::<Result<u64, _>>()?;
    observe(Progress::Step {
        what: "copying shard files",
        bytes,
    });
    let mut files = vec![copy_hashed(data_dir, to, MANIFEST, &mut |_| {})?];
    for path in &held.paths {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| BackupError::NotADataDir(data_dir.to_path_buf()))?;
        files.push(copy_hashed(data_dir, to, name, observe)?);
    }
    files.extend(copy_side_files(data_dir, to)?);
    drop(held);
    finish(to, files, false, Vec::new())
}

/// Backs up a running engine's data directory into `to` (absent or empty): every shard is
/// cut while all writers are paused at one common batch boundary ([`Ledger::backup`]),
/// then the handlers and the audit log as they are at that moment.
pub fn backup_online(ledger: &Ledger, to: &Path) -> Result<BackupReport, BackupError> {
    prepare_empty(to, "a backup")?;
    let copies = ledger.backup(to)?;
    let mut files = vec![hash_in_place(to, MANIFEST)?];
    for copy in &copies {
        files.push(hash_in_place(to, &copy.file)?);
    }
    files.extend(copy_side_files(ledger.data_dir(), to)?);
    finish(to, files, true, copies)
}

/// Checks a backup against its `backup.json` without writing anything: the format, and
/// that exactly the files it lists are there with their sizes and checksums.
pub fn verify(dir: &Path) -> Result<BackupManifest, BackupError> {
    verify_observed(dir, &mut |_| {})
}

/// [`verify`], reporting its progress to `observe` (one step: checking every file).
pub fn verify_observed(dir: &Path, observe: Observer) -> Result<BackupManifest, BackupError> {
    let damaged = |file: &str, problem: String| BackupError::Damaged {
        dir: dir.to_path_buf(),
        file: file.to_string(),
        problem,
    };
    let text = match std::fs::read(dir.join(BACKUP_MANIFEST)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(BackupError::Incomplete(dir.to_path_buf()))
        }
        Err(e) => return Err(io(&dir.join(BACKUP_MANIFEST))(e)),
    };
    let manifest: BackupManifest = serde_json::from_slice(&text)
        .map_err(|e| damaged(BACKUP_MANIFEST, format!("is not readable: {e}")))?;
    if manifest.backup_format > BACKUP_FORMAT || manifest.data_format_version > FORMAT_VERSION {
        return Err(BackupError::NewerFormat {
            dir: dir.to_path_buf(),
            found: manifest.backup_format,
            data_format: manifest.data_format_version,
        });
    }
    let mut listed = std::collections::BTreeSet::new();
    for f in &manifest.files {
        if !is_plain_relative(&f.path) || f.path == BACKUP_MANIFEST {
            return Err(damaged(
                &f.path,
                "is not a plain relative path inside the backup".into(),
            ));
        }
        if !listed.insert(f.path.as_str()) {
            return Err(damaged(&f.path, "is listed twice in backup.json".into()));
        }
    }
    if !listed.contains(MANIFEST) {
        return Err(damaged(MANIFEST, "is not listed in backup.json".into()));
    }
    let present = list_files(dir)?;
    if let Some(extra) = present
        .iter()
        .find(|p| p.as_str() != BACKUP_MANIFEST && !listed.contains(p.as_str()))
    {
        return Err(damaged(
            extra,
            "is not listed in backup.json (an extra file)".into(),
        ));
    }
    observe(Progress::Step {
        what: "checking the backup",
        bytes: manifest.files.iter().map(|f| f.bytes).sum(),
    });
    for f in &manifest.files {
        let path = dir.join(&f.path);
        let bytes = match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => m.len(),
            Ok(_) => return Err(damaged(&f.path, "is not a regular file".into())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(damaged(&f.path, "is missing".into()))
            }
            Err(e) => return Err(io(&path)(e)),
        };
        if bytes != f.bytes {
            return Err(damaged(
                &f.path,
                format!("has {bytes} bytes, backup.json says {}", f.bytes),
            ));
        }
        let (sum, _) = hash_file(&path, None, observe)?;
        if sum != f.xxh3_128 {
            return Err(damaged(
                &f.path,
                "differs from its checksum in backup.json (changed or corrupt)".into(),
            ));
        }
    }
    Ok(manifest)
}

/// Restores the backup `from` into `data_dir` (absent or empty): verifies it first
/// ([`verify`]; nothing is written on a failure), copies every file checking its checksum
/// again on the way, the data directory's manifest last, fsyncs them, and opens the result
/// read-only. Returns the backup's manifest and the restored directory's report.
pub fn restore(
    from: &Path,
    data_dir: &Path,
) -> Result<(BackupManifest, LedgerReport), BackupError> {
    restore_observed(from, data_dir, &mut |_| {})
}

/// [`restore`], reporting its progress to `observe` (two steps: checking the backup, then
/// copying it).
pub fn restore_observed(
    from: &Path,
    data_dir: &Path,
    observe: Observer,
) -> Result<(BackupManifest, LedgerReport), BackupError> {
    check_empty(data_dir, "a restore")?;
    let manifest = verify_observed(from, observe)?;
    prepare_empty(data_dir, "a restore")?;
    observe(Progress::Step {
        what: "restoring",
        bytes: manifest.files.iter().map(|f| f.bytes).sum(),
    });
    let mut dirs = std::collections::BTreeSet::new();
    let ordered = manifest
        .files
        .iter()
        .filter(|f| f.path != MANIFEST)
        .chain(manifest.files.iter().filter(|f| f.path == MANIFEST));
    for f in ordered {
        let copied = copy_hashed(from, data_dir, &f.path, observe)?;
        if copied.xxh3_128 != f.xxh3_128 || copied.bytes != f.bytes {
            return Err(BackupError::Damaged {
                dir: from.to_path_buf(),
                file: f.path.clone(),
                problem: format!(
                    "changed while it was restored; {} is incomplete (no {MANIFEST}, an engine refuses it): empty it and restore again",
                    data_dir.display()
                ),
            });
        }
        if let Some(parent) = Path::new(&f.path).parent() {
            dirs.extend(parent.ancestors().map(Path::to_path_buf));
        }
    }
    // Subdirectories deepest first, then the data directory itself (its manifest's entry).
    for d in dirs.iter().rev().filter(|d| !d.as_os_str().is_empty()) {
        let path = data_dir.join(d);
        sync_dir(&path).map_err(io(&path))?;
    }
    sync_dir(data_dir).map_err(io(data_dir))?;
    sync_parent(data_dir)?;
    let report = offline_report(data_dir).map_err(|source| BackupError::DoesNotLoad {
        dir: data_dir.to_path_buf(),
        source,
    })?;
    Ok((manifest, report))
}

/// `path` is absent or an empty directory.
fn check_empty(path: &Path, what: &'static str) -> Result<(), BackupError> {
    match std::fs::read_dir(path) {
        Ok(mut entries) => match entries.next() {
            None => Ok(()),
            Some(_) => Err(BackupError::NotEmpty {
                path: path.to_path_buf(),
                what,
            }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(path)(e)),
    }
}

/// Creates `path` (absent or empty), with its own entry durable in its parent.
fn prepare_empty(path: &Path, what: &'static str) -> Result<(), BackupError> {
    check_empty(path, what)?;
    create_private_dir_all(path).map_err(io(path))?;
    sync_parent(path)
}

fn sync_parent(path: &Path) -> Result<(), BackupError> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => sync_dir(parent).map_err(io(parent)),
        None => Ok(()),
    }
}

/// The handlers and the audit log of `data_dir`, copied into `to`. Files being written
/// (`*.tmp`: an upload or pointer change under way) are left out; of the audit log only
/// whole lines are copied (an action may be recorded while the backup runs).
fn copy_side_files(data_dir: &Path, to: &Path) -> Result<Vec<BackupFile>, BackupError> {
    let mut files = Vec::new();
    if data_dir.join(HANDLERS_DIR).is_dir() {
        for rel in list_files(&data_dir.join(HANDLERS_DIR))? {
            if !rel.ends_with(".tmp") {
                files.push(copy_hashed(
                    data_dir,
                    to,
                    &format!("{HANDLERS_DIR}/{rel}"),
                    &mut |_| {},
                )?);
            }
        }
    }
    let audit = data_dir.join(AUDIT_LOG);
    match std::fs::read(&audit) {
        Ok(mut text) => {
            let whole = text.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            text.truncate(whole);
            files.push(write_new(to, AUDIT_LOG, &text)?);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&audit)(e)),
    }
    Ok(files)
}

/// Fsyncs every directory of the backup and writes `backup.json` last (temporary name,
/// fsync, rename, fsync): only a backup whose files are all durable has one.
fn finish(
    to: &Path,
    mut files: Vec<BackupFile>,
    online: bool,
    shard_copies: Vec<ledger::ShardCopy>,
) -> Result<BackupReport, BackupError> {
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let (data_format_version, shards) = ledger::read_manifest(to)?;
    let mut dirs: Vec<PathBuf> = files
        .iter()
        .filter_map(|f| Path::new(&f.path).parent().map(Path::to_path_buf))
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    dirs.sort();
    dirs.dedup();
    for d in dirs.iter().rev() {
        let path = to.join(d);
        sync_dir(&path).map_err(io(&path))?;
    }
    let manifest = BackupManifest {
        backup_format: BACKUP_FORMAT,
        dedupd_version: env!("CARGO_PKG_VERSION").to_string(),
        created_at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        online,
        data_format_version,
        shards,
        files,
    };
    let body = serde_json::to_vec_pretty(&manifest).map_err(|e| BackupError::Io {
        path: to.join(BACKUP_MANIFEST),
        detail: e.to_string(),
    })?;
    let tmp = format!("{BACKUP_MANIFEST}.tmp");
    write_new(to, &tmp, &body)?;
    std::fs::rename(to.join(&tmp), to.join(BACKUP_MANIFEST)).map_err(io(to))?;
    sync_dir(to).map_err(io(to))?;
    Ok(BackupReport {
        dir: to.to_path_buf(),
        bytes: manifest.files.iter().map(|f| f.bytes).sum(),
        manifest,
        shard_copies,
    })
}

/// Copies `from/rel` to `to/rel` (creating parents), hashing on the way, and fsyncs it.
fn copy_hashed(
    from: &Path,
    to: &Path,
    rel: &str,
    observe: Observer,
) -> Result<BackupFile, BackupError> {
    let src = from.join(rel);
    let dst = to.join(rel);
    if let Some(parent) = dst.parent() {
        create_private_dir_all(parent).map_err(io(parent))?;
    }
    let mut out = private_file()
        .write(true)
        .create_new(true)
        .open(&dst)
        .map_err(io(&dst))?;
    let (sum, bytes) = hash_file(&src, Some(&mut out), observe)?;
    out.sync_all().map_err(io(&dst))?;
    Ok(BackupFile {
        path: rel.to_string(),
        bytes,
        xxh3_128: sum,
    })
}

/// Hashes a file already copied into the backup, and fsyncs it.
fn hash_in_place(dir: &Path, rel: &str) -> Result<BackupFile, BackupError> {
    let path = dir.join(rel);
    let (sum, bytes) = hash_file(&path, None, &mut |_| {})?;
    std::fs::File::open(&path)
        .and_then(|f| f.sync_all())
        .map_err(io(&path))?;
    Ok(BackupFile {
        path: rel.to_string(),
        bytes,
        xxh3_128: sum,
    })
}

/// Writes a new file `dir/rel` durably.
fn write_new(dir: &Path, rel: &str, body: &[u8]) -> Result<BackupFile, BackupError> {
    let path = dir.join(rel);
    let mut f = private_file()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(io(&path))?;
    f.write_all(body)
        .and_then(|_| f.sync_all())
        .map_err(io(&path))?;
    let mut h = Xxh3::new();
    h.update(body);
    Ok(BackupFile {
        path: rel.to_string(),
        bytes: body.len() as u64,
        xxh3_128: format!("{:032x}", h.digest128()),
    })
}

/// The xxh3-128 (hex) and length of a file, copying it to `copy` on the way.
fn hash_file(
    path: &Path,
    mut copy: Option<&mut std::fs::File>,
    observe: Observer,
) -> Result<(String, u64), BackupError> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        if let Some(out) = copy.as_deref_mut() {
            out.write_all(&buf[..n]).map_err(io(path))?;
        }
        total += n as u64;
        observe(Progress::Read(n as u64));
    }
    Ok((format!("{:032x}", h.digest128()), total))
}

/// Every file under `dir`, as sorted `/`-separated relative paths. Anything that is
/// neither a file nor a directory (a symlink, say) is listed too, so that verification
/// names it as an extra file rather than following it.
fn list_files(dir: &Path) -> Result<Vec<String>, BackupError> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = dir.join(&rel);
        for entry in std::fs::read_dir(&abs).map_err(io(&abs))? {
            let entry = entry.map_err(io(&abs))?;
            let name = entry.file_name();
            let child = rel.join(&name);
            let kind = entry.file_type().map_err(io(&abs))?;
            if kind.is_dir() {
                stack.push(child);
            } else {
                out.push(
                    child
                        .components()
                        .map(|c| c.as_os_str().to_string_lossy())
                        .collect::<Vec<_>>()
                        .join("/"),
                );
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `a/b/c` with only plain names: no root, no `.` or `..`, nothing empty.
fn is_plain_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.contains('\\')
        && Path::new(path)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
        && path.split('/').all(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_relative_paths_are_accepted() {
        for ok in ["shard-000.redb", "handlers/s/current", "audit.jsonl"] {
            assert!(is_plain_relative(ok), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "./a",
            "a//b",
            "a\\b",
            "a/",
        ] {
            assert!(!is_plain_relative(bad), "{bad}");
        }
    }
}
