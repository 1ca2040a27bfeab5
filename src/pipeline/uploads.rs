//! Uploaded handler components: validated, stored under `DATA_DIR/handlers/<subscriber>/`
//! by content hash, installed between batches, with the previous one kept for rollback.
//! Every run mode installs the current uploads at start ([`super::install_handlers`]), with
//! or without the API.
//!
//! Layout per subscriber: `<version>.wasm` files plus two pointer files, `current` and
//! `previous`, each holding a version. Pointers are replaced atomically (write, fsync,
//! rename), so a crash leaves either the old or the new pointer. Subscriber names are
//! restricted to `[A-Za-z0-9._-]` by the ledger and versions are hex, so no path built here
//! leaves the data directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use super::limits_of;
use crate::handler::{Component, HandlerError};
use crate::ledger::{Ledger, LedgerError};

/// Errors of storing or installing an uploaded component.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UploadError {
    #[error("{0}")]
    Invalid(HandlerError),
    #[error("no previous handler to roll back to")]
    NoPrevious,
    #[error("cannot store the handler: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// A stored upload that cannot be installed at start: the run refuses to start rather
    /// than claim the subscriber's messages without its handler.
    #[error("cannot install the handler uploaded for subscriber {subscriber:?} ({path}): {detail}. It is part of what the subscriber's claims mean, so dedupd will not run without it: fix the cause, or remove {dir} to run the subscriber without it")]
    Stored {
        subscriber: String,
        path: PathBuf,
        dir: PathBuf,
        detail: String,
    },
}

/// What the handler routes show of a subscriber's handlers.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct HandlerInfo {
    pub(crate) subscriber: String,
    /// Version (xxh3-64 of the component, hex) of the handler in force, if any.
    pub(crate) active_version: Option<String>,
    /// Uploaded versions: the one installed and the one a rollback returns to.
    pub(crate) current: Option<String>,
    pub(crate) previous: Option<String>,
}

/// The uploaded handler components of every subscriber, under `DATA_DIR/handlers/`.
#[derive(Debug, Clone)]
pub struct UploadStore {
    root: PathBuf,
}

fn valid_version(v: &str) -> bool {
    v.len() == 16 && v.bytes().all(|b| b.is_ascii_hexdigit())
}

impl UploadStore {
    pub fn new(data_dir: &Path) -> UploadStore {
        UploadStore {
            root: data_dir.join(crate::ledger::HANDLERS_DIR),
        }
    }

    /// `subscriber` was checked by the ledger (`[A-Za-z0-9._-]`); dot-only names would
    /// leave `handlers/`, so they get a directory that can never be a subscriber's.
    fn dir(&self, subscriber: &str) -> PathBuf {
        if subscriber.bytes().all(|b| b == b'.') {
            return self.root.join("invalid-name");
        }
        self.root.join(subscriber)
    }

    fn pointer(&self, subscriber: &str, name: &str) -> Option<String> {
        std::fs::read_to_string(self.dir(subscriber).join(name))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| valid_version(s))
    }

    fn set_pointer(&self, subscriber: &str, name: &str, version: &str) -> std::io::Result<()> {
        let dir = self.dir(subscriber);
        let tmp = dir.join(format!("{name}.tmp"));
        write_synced(&tmp, version.as_bytes())?;
        std::fs::rename(&tmp, dir.join(name))?;
        std::fs::File::open(&dir)?.sync_all()
    }

    pub(crate) fn info(&self, ledger: &Ledger, subscriber: &str) -> HandlerInfo {
        let active = ledger
            .subscribers()
            .into_iter()
            .find(|s| &*s.name == subscriber)
            .and_then(|s| s.handler())
            .map(|h| format!("{:016x}", h.version()));
        HandlerInfo {
            subscriber: subscriber.to_string(),
            active_version: active,
            current: self.pointer(subscriber, "current"),
            previous: self.pointer(subscriber, "previous"),
        }
    }

    fn load(
        &self,
        ledger: &Ledger,
        subscriber: &str,
        version: &str,
    ) -> Result<Component, UploadError> {
        let sub = ledger.subscriber(subscriber)?;
        let path = self.dir(subscriber).join(format!("{version}.wasm"));
        Component::load(&path, limits_of(&sub.settings())).map_err(UploadError::Invalid)
    }

    /// Validates `bytes` as a handler for `subscriber` (WIT contract, capabilities, its
    /// limits), stores it, makes it current (the old current becomes previous) and installs
    /// it; shards switch between batches. Blocking: compiles the component.
    pub fn upload(
        &self,
        ledger: &Ledger,
        subscriber: &str,
        bytes: &[u8],
    ) -> Result<HandlerInfo, UploadError> {
        // Checked before the subscriber is registered: a refused upload uses up no
        // implicit subscriber.
        let settings = ledger.settings_of(subscriber)?;
        let label = PathBuf::from(format!("uploaded handler for {subscriber}"));
        let component = Component::from_bytes(&label, bytes, limits_of(&settings))
            .map_err(UploadError::Invalid)?;
        let sub = ledger.subscriber(subscriber)?;
        let version = component.report().version.clone();
        let dir = self.dir(&sub.name);
        crate::ledger::create_private_dir_all(&dir)?;
        let file = dir.join(format!("{version}.wasm"));
        if !file.exists() {
            let tmp = dir.join(format!("{version}.wasm.tmp"));
            write_synced(&tmp, bytes)?;
            std::fs::rename(&tmp, &file)?;
        }
        let old = self.pointer(&sub.name, "current");
        if old.as_deref() != Some(version.as_str()) {
            if let Some(old) = &old {
                self.set_pointer(&sub.name, "previous", old)?;
            }
            self.set_pointer(&sub.name, "current", &version)?;
        }
        ledger.set_handler(&sub.name, Some(Arc::new(component)))?;
        Ok(self.info(ledger, &sub.name))
    }

    /// Swaps `current` and `previous` and installs the previous component again.
    pub(crate) fn rollback(
        &self,
        ledger: &Ledger,
        subscriber: &str,
    ) -> Result<HandlerInfo, UploadError> {
        let previous = self
            .pointer(subscriber, "previous")
            .ok_or(UploadError::NoPrevious)?;
        let component = self.load(ledger, subscriber, &previous)?;
        if let Some(cur) = self.pointer(subscriber, "current") {
            self.set_pointer(subscriber, "previous", &cur)?;
        }
        self.set_pointer(subscriber, "current", &previous)?;
        ledger.set_handler(subscriber, Some(Arc::new(component)))?;
        Ok(self.info(ledger, subscriber))
    }

    /// Loads the subscriber's handler again under `settings` (their limits), without
    /// installing it: the uploaded current one, else the one `settings` name. `Ok(None)`:
    /// it has none. A settings change loads first, so a failure changes nothing.
    pub(crate) fn load_under(
        &self,
        subscriber: &str,
        settings: &crate::config::SubscriberSettings,
    ) -> Result<Option<Arc<dyn crate::effects::HandlerFactory>>, UploadError> {
        let limits = limits_of(settings);
        Ok(Some(match self.pointer(subscriber, "current") {
            Some(version) => {
                let path = self.dir(subscriber).join(format!("{version}.wasm"));
                Arc::new(Component::load(&path, limits).map_err(UploadError::Invalid)?)
            }
            None => match &settings.handler {
                Some(path) => {
                    crate::handler::load_factory(path, limits).map_err(UploadError::Invalid)?
                }
                None => return Ok(None),
            },
        }))
    }

    /// Installs every uploaded current handler (at start-up, after the config's handlers:
    /// an upload outlives a restart; [`super::install_handlers`] calls it for every run
    /// mode). A subscriber whose handler in force is that version already is left as it is.
    /// Returns the subscribers it installed.
    pub(crate) fn install_all(&self, ledger: &Ledger) -> Result<Vec<String>, UploadError> {
        let mut installed = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Ok(installed);
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        names.sort();
        for name in names {
            if let Some(version) = self.pointer(&name, "current") {
                if self.info(ledger, &name).active_version.as_deref() == Some(version.as_str()) {
                    continue;
                }
                let installed_one = self.load(ledger, &name, &version).and_then(|component| {
                    Ok(ledger.set_handler(&name, Some(Arc::new(component)))?)
                });
                if let Err(e) = installed_one {
                    return Err(UploadError::Stored {
                        path: self.dir(&name).join(format!("{version}.wasm")),
                        dir: self.dir(&name),
                        subscriber: name,
                        detail: e.to_string(),
                    });
                }
                installed.push(name);
            }
        }
        Ok(installed)
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = crate::ledger::private_file()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}
