//! What `/readyz` asks of the running sources: a broker source registers a probe while it
//! runs (the NATS connection, say), and `/readyz` answers 503 with the probe's reason
//! while any probe has one.
//!
//! Process-wide, like the metrics recorder: the HTTP server and the sources are started
//! separately by `crate::pipeline` and share nothing else but the ledger.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// A probe: `None` while the source can take messages, else why not (for operators).
pub(crate) type Probe = Arc<dyn Fn() -> Option<String> + Send + Sync>;

fn probes() -> &'static Mutex<BTreeMap<u64, (String, Probe)>> {
    static PROBES: OnceLock<Mutex<BTreeMap<u64, (String, Probe)>>> = OnceLock::new();
    PROBES.get_or_init(Default::default)
}

/// Removes its probe when dropped (the source stopped).
#[derive(Debug)]
#[must_use = "the probe is removed when the registration is dropped"]
pub(crate) struct Registration(u64);

impl Drop for Registration {
    fn drop(&mut self) {
        probes()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.0);
    }
}

/// Adds a probe named `source` (`nats`) until the registration is dropped.
pub(crate) fn register(source: &str, probe: Probe) -> Registration {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    probes()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, (source.to_string(), probe));
    Registration(id)
}

/// Why a running source cannot take messages now (`source: reason`), if one cannot.
pub(crate) fn unready() -> Option<String> {
    let list: Vec<(String, Probe)> = probes()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .cloned()
        .collect();
    // Probes run outside the lock: one may take its own locks.
    list.into_iter()
        .find_map(|(name, probe)| probe().map(|reason| format!("{name}: {reason}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn a_probe_counts_until_its_registration_is_dropped() {
        let down = Arc::new(AtomicBool::new(true));
        let d = down.clone();
        let reg = register(
            "test-source",
            Arc::new(move || {
                d.load(Ordering::Relaxed)
                    .then(|| "disconnected".to_string())
            }),
        );
        assert!(unready().is_some_and(|r| r.contains("test-source: disconnected")));
        down.store(false, Ordering::Relaxed);
        assert!(unready().is_none_or(|r| !r.contains("test-source")));
        down.store(true, Ordering::Relaxed);
        drop(reg);
        assert!(unready().is_none_or(|r| !r.contains("test-source")));
    }
}
