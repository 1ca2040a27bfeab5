//! `wasi:clocks/monotonic-clock` for handlers: no wait outlasts the call's budget.
//!
//! Epoch interruption stops guest *code*, not a host call. wasmtime-wasi's clock turns
//! `subscribe-duration`/`subscribe-instant` into a real timer that `wasi:io/poll` blocks
//! on, so a guest `std::thread::sleep(5 s)` held its shard thread for five seconds whatever
//! its budget, and every message batched with it waited too. This module shadows the four
//! functions of that interface in the linker (`now`, `resolution` and the two
//! `subscribe-*`) with pollables whose wait ends at the latest when the running call's
//! budget does:
//!
//! - A wait that ends within the budget is real: the guest sleeps as long as it asked, as
//!   on any WASI host, and the time counts against the budget like CPU does (the epoch
//!   deadline is wall time).
//! - A wait that would end after it lasts until the budget runs out, then marks the call
//!   *out of time* and returns. [`super::WasmHandler`] reports such a call as
//!   [`Failure::Timeout`](crate::effects::Failure::Timeout) whatever the guest does next,
//!   and a guest that subscribes again after that traps at once, so a sleeping handler is
//!   a timeout in about its budget, like one that spins.
//!
//! Why this and not the alternatives: refusing the clock at load would reject every
//! handler that reads `Instant::now()` or pauses for a millisecond; a virtual clock that
//! returns at once would tell the guest that time passed when it did not. Only clock
//! pollables are bounded because only they can block here: stdin is closed, stdout and
//! stderr are always ready (`output.rs`), and no other pollable source is granted
//! (`ALLOWED_IMPORT_PREFIXES`). `wasi:io/poll` itself stays wasmtime-wasi's: its pollables
//! are opaque outside that crate, and a poll returns as soon as any pollable is ready, so
//! bounding each clock pollable bounds the poll.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::component::{Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::clocks::monotonic_clock;
use wasmtime_wasi::p2::{subscribe, DynPollable, Pollable};

use super::host::HostState;

/// The monotonic clock of one handler instance and the wait deadline of its running call.
/// Shared with the instance's pollables, which live in its resource table.
pub(crate) struct CallClock {
    /// Zero of the guest's monotonic clock.
    origin: Instant,
    /// Nanoseconds after `origin` at which the running call's budget ends; 0 between
    /// calls, so nothing waits then.
    deadline_ns: AtomicU64,
    /// Whether a wait of the running call reached the deadline.
    out_of_time: AtomicBool,
}

impl CallClock {
    pub(crate) fn new() -> Arc<CallClock> {
        Arc::new(CallClock {
            origin: Instant::now(),
            deadline_ns: AtomicU64::new(0),
            out_of_time: AtomicBool::new(false),
        })
    }

    /// Starts a call that may wait until `budget` from now.
    pub(crate) fn start(&self, budget: Duration) {
        let end = self.since_origin(Instant::now()).saturating_add(budget);
        let end_ns = u64::try_from(end.as_nanos()).unwrap_or(u64::MAX);
        self.deadline_ns.store(end_ns, Ordering::Relaxed);
        self.out_of_time.store(false, Ordering::Relaxed);
    }

    /// Ends a call; returns whether one of its waits ran out of budget.
    pub(crate) fn stop(&self) -> bool {
        self.deadline_ns.store(0, Ordering::Relaxed);
        self.out_of_time.swap(false, Ordering::Relaxed)
    }

    fn since_origin(&self, t: Instant) -> Duration {
        t.saturating_duration_since(self.origin)
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.since_origin(Instant::now()).as_nanos()).unwrap_or(u64::MAX)
    }

    fn deadline(&self) -> Instant {
        let ns = self.deadline_ns.load(Ordering::Relaxed);
        self.origin
            .checked_add(Duration::from_nanos(ns))
            .unwrap_or(self.origin)
    }

    /// A pollable that is ready at `wake` (`None`: never), or when the budget ends.
    fn subscribe(
        self: &Arc<Self>,
        table: &mut ResourceTable,
        wake: Option<Instant>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        if self.out_of_time.load(Ordering::Relaxed) {
            wasmtime::bail!("the handler's budget ran out while it waited");
        }
        let wait = table.push(BoundedWait {
            wake,
            clock: Arc::clone(self),
        })?;
        subscribe(table, wait)
    }
}

/// A clock pollable bounded by the running call's budget.
struct BoundedWait {
    wake: Option<Instant>,
    clock: Arc<CallClock>,
}

#[wasmtime_wasi::async_trait]
impl Pollable for BoundedWait {
    async fn ready(&mut self) {
        let deadline = self.clock.deadline();
        match self.wake {
            Some(wake) if wake <= deadline => {
                if wake > Instant::now() {
                    tokio::time::sleep_until(wake.into()).await;
                }
            }
            // The wait would outlast the budget: wait for the budget only. Dropped before
            // then (another pollable of the same poll was ready first), it marks nothing.
            _ => {
                if deadline > Instant::now() {
                    tokio::time::sleep_until(deadline.into()).await;
                }
                self.clock.out_of_time.store(true, Ordering::Relaxed);
            }
        }
    }
}

impl monotonic_clock::Host for HostState {
    fn now(&mut self) -> wasmtime::Result<monotonic_clock::Instant> {
        Ok(self.clock.now_ns())
    }

    fn resolution(&mut self) -> wasmtime::Result<monotonic_clock::Duration> {
        Ok(1)
    }

    fn subscribe_instant(
        &mut self,
        when: monotonic_clock::Instant,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let wake = self.clock.origin.checked_add(Duration::from_nanos(when));
        self.clock.subscribe(&mut self.table, wake)
    }

    fn subscribe_duration(
        &mut self,
        duration: monotonic_clock::Duration,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let wake = Instant::now().checked_add(Duration::from_nanos(duration));
        self.clock.subscribe(&mut self.table, wake)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn between_calls_the_deadline_is_the_origin_and_nothing_is_out_of_time() {
        let c = CallClock::new();
        assert_eq!(c.deadline(), c.origin);
        c.start(Duration::from_millis(10));
        assert!(c.deadline() > c.origin);
        c.out_of_time.store(true, Ordering::Relaxed);
        assert!(c.stop());
        assert_eq!(c.deadline(), c.origin);
        assert!(!c.stop());
    }
}
