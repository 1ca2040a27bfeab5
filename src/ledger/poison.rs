//! The ledger's stop switch (I4, G7): the first storage error or writer panic is kept, every
//! shard sees the flag before its next batch, and the hooks registered by the run (its
//! shutdown token) are told at once instead of polling.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Called once with the reason when the ledger fails.
pub(crate) type PoisonHook = Box<dyn FnOnce(&str) + Send>;

#[derive(Default)]
pub(crate) struct Poison {
    set: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    reason: Option<String>,
    hooks: Vec<PoisonHook>,
}

impl Poison {
    /// Stops the ledger; the first reason wins. Runs the registered hooks (outside the lock).
    pub(crate) fn set(&self, reason: String) {
        let hooks = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if s.reason.is_some() {
                return;
            }
            s.reason = Some(reason.clone());
            self.set.store(true, Ordering::Release);
            tracing::error!(%reason, "engine stopped: nothing more is acknowledged");
            std::mem::take(&mut s.hooks)
        };
        for hook in hooks {
            hook(&reason);
        }
    }

    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    pub(crate) fn reason(&self) -> Option<String> {
        if !self.is_set() {
            return None;
        }
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .reason
            .clone()
    }

    /// Runs `hook` when the ledger fails, or now if it already has.
    pub(crate) fn on_set(&self, hook: PoisonHook) {
        let reason = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match &s.reason {
                Some(r) => r.clone(),
                None => return s.hooks.push(hook),
            }
        };
        hook(&reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn hooks_run_once_with_the_first_reason_even_when_registered_late() {
        let p = Poison::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        p.on_set(Box::new(move |r| {
            s.lock().unwrap().push(format!("early {r}"))
        }));
        assert!(!p.is_set() && p.reason().is_none());
        p.set("disk full".into());
        p.set("second".into());
        let s = seen.clone();
        p.on_set(Box::new(move |r| {
            s.lock().unwrap().push(format!("late {r}"))
        }));
        assert_eq!(p.reason().as_deref(), Some("disk full"));
        assert_eq!(
            *seen.lock().unwrap(),
            vec!["early disk full".to_string(), "late disk full".to_string()]
        );
    }
}
