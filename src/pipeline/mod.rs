//! The one place that knows the whole flow: decode, key, route, wait for durable outcomes,
//! and release them in source order; and the run modes that compose sources, the ledger
//! and the HTTP API into a process ([`run`], stopped by one [`Shutdown`]); [`check`]
//! validates a config the way `run` would, without a data directory or a connection.

mod check;
mod run;
mod sequencer;
mod serve;
mod shutdown;
mod uploads;

pub use check::check;

pub use check::check_file;

pub use check::SubscriberReport;
pub use run::{run, Mode, RunError, Summary};
pub use serve::HttpServer;
pub use shutdown::{Cause, Shutdown};
pub use uploads::UploadStore;
pub(crate) use uploads::{HandlerInfo, UploadError};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::config::{Config, SubscriberSettings};
use crate::effects::HandlerFactory;
use crate::handler::{self, HandlerError, Limits};
use crate::ledger::Ledger;

/// Handler limits a subscriber's settings ask for.
pub(crate) fn limits_of(s: &SubscriberSettings) -> Limits {
    Limits {
        cpu_budget: s.handler_cpu_budget,
        memory_bytes: s.handler_memory_mib << 20,
        max_writes: s.handler_max_writes,
        max_write_bytes: s.handler_max_write_mib << 20,
    }
}

/// Installs every subscriber's handler before any message is accepted: those the config
/// names (each file loaded once per set of limits), then the ones uploaded through the API
/// (`DATA_DIR/handlers/`), which replace the config's as they do while the API runs. Every
/// run mode calls this, with or without the API: the handler a subscriber has is part of
/// what its claims mean, so a mode that skipped an upload would claim its messages without
/// running it (G2).
pub fn install_handlers(ledger: &Ledger, config: &Config) -> Result<(), RunError> {
    let mut loaded: HashMap<(PathBuf, Limits), Arc<dyn HandlerFactory>> = HashMap::new();
    let mut load =
        |path: &PathBuf, limits: Limits| -> Result<Arc<dyn HandlerFactory>, HandlerError> {
            if let Some(f) = loaded.get(&(path.clone(), limits)) {
                return Ok(f.clone());
            }
            let f = handler::load_factory(path, limits)?;
            loaded.insert((path.clone(), limits), f.clone());
            Ok(f)
        };
    for sub in &config.subscribers {
        let settings = sub.resolve(&config.defaults);
        if let Some(path) = &settings.handler {
            let f = load(path, limits_of(&settings))?;
            ledger
                .set_handler(&sub.name, Some(f))
                .map_err(|e| HandlerError::Instantiate(e.to_string()))?;
        }
    }
    if let Some(path) = &config.defaults.handler {
        ledger.set_default_handler(Some(load(path, limits_of(&config.defaults))?));
    }
    let uploaded = UploadStore::new(ledger.data_dir()).install_all(ledger)?;
    if !uploaded.is_empty() {
        tracing::info!(subscribers = ?uploaded, "uploaded handlers installed");
    }
    Ok(())
}
pub(crate) use sequencer::Sequencer;
