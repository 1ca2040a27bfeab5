//! One shutdown token per process: SIGINT/SIGTERM, a ledger failure (G7), a source's
//! failure and an explicit request all trigger it, and every part of a run waits on it
//! (threads block on it, async tasks await it, rdkafka poll loops read its flag). The
//! first cause wins and is kept, so the process can say why it stopped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Why a run is stopping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// SIGINT or SIGTERM.
    Signal,
    /// The ledger or a source failed; nothing more is acknowledged (G7).
    Failed(String),
    /// The caller asked (tests, an input that ended).
    Requested,
}

/// A cloneable handle; every clone sees the same trigger.
#[derive(Clone, Default)]
pub struct Shutdown(Arc<Inner>);

#[derive(Default)]
struct Inner {
    flag: AtomicBool,
    cause: Mutex<Option<Cause>>,
    changed: Condvar,
    notify: tokio::sync::Notify,
}

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Triggers on SIGINT or SIGTERM (from then on the signals no longer end the process
    /// by themselves: the run drains and returns).
    pub fn on_signals(&self) -> std::io::Result<()> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
        let me = self.clone();
        std::thread::Builder::new()
            .name("dedupd-signals".into())
            .spawn(move || {
                if signals.forever().next().is_some() {
                    notify_service_manager(&[sd_notify::NotifyState::Stopping], "stopping");
                    me.trigger(Cause::Signal);
                }
            })?;
        Ok(())
    }

    /// Triggers when `ledger` fails (a storage error or a shard writer's panic).
    pub fn on_ledger_failure(&self, ledger: &crate::ledger::Ledger) {
        let me = self.clone();
        ledger.on_poison(Box::new(move |reason: &str| {
            me.trigger(Cause::Failed(format!("the ledger stopped: {reason}")))
        }));
    }

    /// Triggers the shutdown; the first cause is kept.
    pub fn trigger(&self, cause: Cause) {
        let mut c = self.0.cause.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_none() {
            *c = Some(cause);
        }
        self.0.flag.store(true, Ordering::Release);
        self.0.changed.notify_all();
        self.0.notify.notify_waiters();
    }

    pub fn is_triggered(&self) -> bool {
        self.0.flag.load(Ordering::Acquire)
    }

    /// The flag polling loops read (rdkafka consumers check it between polls).
    pub(crate) fn flag(&self) -> &AtomicBool {
        &self.0.flag
    }

    /// The first cause, once triggered.
    pub fn cause(&self) -> Option<Cause> {
        self.0
            .cause
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Blocks until triggered.
    pub fn wait(&self) -> Cause {
        let mut c = self.0.cause.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(cause) = c.as_ref() {
                return cause.clone();
            }
            c = self.0.changed.wait(c).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Blocks until triggered or `timeout` passes; `None` on timeout.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Cause> {
        let c = self.0.cause.lock().unwrap_or_else(|p| p.into_inner());
        let (c, _) = self
            .0
            .changed
            .wait_timeout_while(c, timeout, |c| c.is_none())
            .unwrap_or_else(|p| p.into_inner());
        c.clone()
    }

    /// Resolves once triggered (for async servers' graceful shutdown).
    pub(crate) async fn triggered(&self) {
        loop {
            let notified = self.0.notify.notified();
            tokio::pin!(notified);
            // Register before checking, so a trigger between the check and the await is
            // not missed.
            notified.as_mut().enable();
            if self.is_triggered() {
                return;
            }
            notified.await;
        }
    }
}

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Shutdown").field(&self.cause()).finish()
    }
}

/// Tells the service manager what the process is doing (`sd_notify`: the unit's
/// `Type=notify` waits for `READY=1` before it counts the start as done); nothing when
/// `NOTIFY_SOCKET` is unset. A failure is logged: systemd's start timeout then says the rest.
pub(crate) fn notify_service_manager(state: &[sd_notify::NotifyState], what: &str) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!(error = %e, "could not tell the service manager (NOTIFY_SOCKET) that dedupd is {what}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_cause_is_kept_and_every_clone_sees_it() {
        let s = Shutdown::new();
        let other = s.clone();
        assert_eq!(s.wait_timeout(Duration::from_millis(1)), None);
        other.trigger(Cause::Failed("disk full".into()));
        s.trigger(Cause::Signal);
        assert!(s.is_triggered());
        assert_eq!(s.wait(), Cause::Failed("disk full".into()));
        assert_eq!(other.cause(), Some(Cause::Failed("disk full".into())));
    }

    #[test]
    fn a_waiting_thread_and_an_async_task_wake_on_trigger() {
        let s = Shutdown::new();
        let waiter = {
            let s = s.clone();
            std::thread::spawn(move || s.wait())
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let task = {
            let s = s.clone();
            rt.spawn(async move { s.triggered().await })
        };
        s.trigger(Cause::Requested);
        assert_eq!(waiter.join().unwrap(), Cause::Requested);
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .expect("the task wakes")
                .unwrap()
        });
        // Already triggered: resolves at once.
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), s.triggered())
                .await
                .expect("resolves at once")
        });
    }
}
