//! The data directory: its manifest (format version and shard count), the shard files it
//! names, and the durable writes that create or upgrade it. The manifest is read before any
//! shard file is opened; a directory written by a newer dedupd, a shard count that differs
//! from the config, or a shard file missing after creation stops the open with a reason.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::LedgerConfig;
use crate::ledger::{LedgerError, FORMAT_VERSION};

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format_version: u64,
    shards: usize,
}

/// The manifest file that marks a directory as a dedupd data directory.
pub(crate) const MANIFEST: &str = "dedupd.manifest.json";

/// Uploaded handler components, one directory per subscriber (`admin::UploadStore`).
pub(crate) const HANDLERS_DIR: &str = "handlers";

/// The operators' audit log (`admin::Audit`), one JSON line per action.
pub(crate) const AUDIT_LOG: &str = "audit.jsonl";

/// Reads an existing directory's manifest without changing anything: its format version
/// and shard count.
pub(crate) fn read_manifest(dir: &Path) -> Result<(u64, usize), LedgerError> {
    let path = dir.join(MANIFEST);
    let bytes = std::fs::read(&path).map_err(|e| data_dir_error(dir, e))?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| LedgerError::Corrupt {
        path: path.clone(),
        detail: format!("manifest is not readable: {e}"),
    })?;
    if m.shards == 0 || m.shards > 256 {
        return Err(LedgerError::Corrupt {
            path,
            detail: format!("manifest names {} shards", m.shards),
        });
    }
    Ok((m.format_version, m.shards))
}

/// The file of shard `index` inside `dir`. Part of the on-disk format.
pub(crate) fn shard_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("shard-{index:03}.redb"))
}

/// Creates the directory and manifest on first use; checks them afterwards (upgrading an
/// older format's manifest). Returns the shard count that is in force for this directory,
/// and whether this call created the manifest (only then may shard files be created).
pub(in crate::ledger) fn prepare_data_dir(
    dir: &Path,
    cfg: &LedgerConfig,
) -> Result<(usize, bool), LedgerError> {
    ensure_dir(dir)?;
    let path = dir.join(MANIFEST);
    match std::fs::read(&path) {
        Ok(bytes) => Ok((check_manifest(dir, &bytes, cfg)?, false)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok((create_manifest(dir, cfg)?, true))
        }
        Err(e) => Err(data_dir_error(dir, e)),
    }
}

fn data_dir_error(dir: &Path, e: impl std::fmt::Display) -> LedgerError {
    LedgerError::DataDir {
        path: dir.to_path_buf(),
        detail: e.to_string(),
    }
}

/// Creates `dir` when it is absent, with its own entry durable in the parent.
fn ensure_dir(dir: &Path) -> Result<(), LedgerError> {
    if dir.exists() {
        return Ok(());
    }
    create_private_dir_all(dir).map_err(|e| data_dir_error(dir, e))?;
    // The new directory's own entry, durable with the files about to go in it.
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent).map_err(|e| data_dir_error(dir, e))?;
    }
    Ok(())
}

/// Checks an existing manifest against this build and the config; returns its shard count.
fn check_manifest(dir: &Path, bytes: &[u8], cfg: &LedgerConfig) -> Result<usize, LedgerError> {
    let path = dir.join(MANIFEST);
    let m: Manifest = serde_json::from_slice(bytes).map_err(|e| LedgerError::Corrupt {
        path: path.clone(),
        detail: format!("manifest is not readable: {e}"),
    })?;
    if m.format_version > FORMAT_VERSION {
        return Err(LedgerError::NewerFormat {
            path: dir.to_path_buf(),
            found: m.format_version,
            supported: FORMAT_VERSION,
        });
    }
    if let Some(want) = cfg.shards {
        if want.get() != m.shards {
            return Err(LedgerError::ShardCountMismatch {
                path: dir.to_path_buf(),
                found: m.shards,
                configured: want.get(),
            });
        }
    }
    if m.shards == 0 || m.shards > 256 {
        return Err(LedgerError::Corrupt {
            path,
            detail: format!("manifest names {} shards", m.shards),
        });
    }
    if m.format_version < FORMAT_VERSION {
        upgrade_manifest(dir, &m)?;
    }
    Ok(m.shards)
}

/// Bumps an older format's manifest. The shards upgrade themselves on open (their own
/// meta says which format they hold); the manifest is bumped first so an older binary
/// refuses the directory from now on.
fn upgrade_manifest(dir: &Path, m: &Manifest) -> Result<(), LedgerError> {
    tracing::warn!(data_dir = %dir.display(), from = m.format_version, to = FORMAT_VERSION,
        "upgrading the data directory's format; older dedupd binaries will refuse it");
    write_manifest(
        dir,
        &Manifest {
            format_version: FORMAT_VERSION,
            shards: m.shards,
        },
    )
    .map_err(|e| data_dir_error(dir, e))
}

/// Writes the manifest of a new data directory; returns its shard count. Refuses a
/// directory that holds shard files without a manifest.
fn create_manifest(dir: &Path, cfg: &LedgerConfig) -> Result<usize, LedgerError> {
    let has_shards = std::fs::read_dir(dir)
        .map_err(|e| data_dir_error(dir, e))?
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().starts_with("shard-"));
    if has_shards {
        return Err(LedgerError::Corrupt {
            path: dir.join(MANIFEST),
            detail: "shard files exist but the manifest is missing".into(),
        });
    }
    let shards = cfg.shards.map(|n| n.get()).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let m = Manifest {
        format_version: FORMAT_VERSION,
        shards,
    };
    write_manifest(dir, &m).map_err(|e| data_dir_error(dir, e))?;
    Ok(shards)
}

/// A shard file may only be created in the open that creates the manifest: one missing
/// later is a lost file, and recreating it empty would forget its claims without a word.
/// A symlink counts by its target (a shard on a disk that is not mounted is missing), and
/// an empty file is refused too: redb would initialise it as a new store.
pub(in crate::ledger) fn require_shard_files(dir: &Path, shards: usize) -> Result<(), LedgerError> {
    for index in 0..shards {
        let path = shard_path(dir, index);
        match std::fs::metadata(&path) {
            Ok(m) if m.is_file() && m.len() == 0 => {
                return Err(LedgerError::EmptyShard {
                    path,
                    detail: "is empty (0 bytes)".into(),
                })
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LedgerError::MissingShard { path })
            }
            Err(e) => {
                return Err(LedgerError::DataDir {
                    path: dir.to_path_buf(),
                    detail: format!("cannot check {}: {e}", path.display()),
                })
            }
        }
    }
    Ok(())
}

/// Creates `dir` and its missing parents readable by the owner only (0700): data
/// directories, handler uploads and backups hold payloads.
pub(crate) fn create_private_dir_all(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Options that create a file readable by the owner only (0600; an existing file keeps
/// its mode): shard files, manifests, uploads, the audit log and backups hold payloads.
pub(crate) fn private_file() -> std::fs::OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.mode(0o600);
    o
}

/// Makes the entries of `dir` (files created, renamed or removed in it) durable.
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Replaces the manifest atomically and durably (temporary file, fsync, rename, fsync of
/// the directory).
fn write_manifest(dir: &Path, m: &Manifest) -> std::io::Result<()> {
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let body = serde_json::to_vec_pretty(m).map_err(std::io::Error::other)?;
    write_durably(&tmp, &body)?;
    std::fs::rename(&tmp, dir.join(MANIFEST))?;
    sync_dir(dir)
}

fn write_durably(path: &Path, body: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = private_file()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.write_all(body)?;
    f.sync_all()
}

/// Sum of the sizes of the files in `dir` and every directory below it (uploaded handlers,
/// backups kept inside it), not following symlinks.
pub(crate) fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.path(), e.file_type().ok()?)))
        .map(|(path, kind)| {
            if kind.is_dir() {
                tree_bytes(&path)
            } else if kind.is_file() {
                std::fs::symlink_metadata(&path).map_or(0, |m| m.len())
            } else {
                0
            }
        })
        .sum()
}

/// Sum of the sizes of the files in a directory (not recursive).
/// Bytes the files of `dir` take on the disk (allocated blocks, as `du` counts them):
/// less than [`dir_bytes`] where a file has holes, e.g. the part of a shard file redb has
/// grown but not yet written.
pub(crate) fn dir_allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

pub(crate) fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
