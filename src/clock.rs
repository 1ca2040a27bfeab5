//! Time as the engine sees it. Claims expire by this clock, so tests drive a manual one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> u64;
}

/// The wall clock, read once, then advanced by the monotonic clock (see [`GuardedClock`]):
/// a system clock that jumps while the engine runs does not move the engine's time.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        static GUARD: OnceLock<SystemGuard> = OnceLock::new();
        GUARD
            .get_or_init(|| GuardedClock::new(wall_ms as fn() -> u64, monotonic_ms as fn() -> u64))
            .now_ms()
    }
}

/// The process-wide guard behind [`SystemClock`].
type SystemGuard = GuardedClock<fn() -> u64, fn() -> u64>;

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn monotonic_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// How far the wall clock may drift from the engine's time before it is logged as a jump.
const JUMP_MS: u64 = 2_000;
/// At most one jump warning per this many milliseconds of engine time.
const WARN_EVERY_MS: u64 = 60_000;

/// Engine time from two readings: the wall clock at the first call, plus the monotonic
/// clock since. Claims expire and generations are dropped by this time, so a wall clock
/// stepped forward by days (a bad NTP server, an operator) cannot expire everything at
/// once, and one stepped back cannot make time run backwards. The jump is logged (at most
/// once a minute); the engine keeps its own time until it restarts and reads the wall
/// clock again. While the machine is suspended the monotonic clock stops, so claims live
/// longer, never shorter.
pub struct GuardedClock<W, M> {
    wall: W,
    mono: M,
    /// (wall, monotonic) at the first reading.
    anchor: OnceLock<(u64, u64)>,
    last_warned: AtomicU64,
}

impl<W: Fn() -> u64, M: Fn() -> u64> GuardedClock<W, M> {
    pub fn new(wall: W, mono: M) -> Self {
        GuardedClock {
            wall,
            mono,
            anchor: OnceLock::new(),
            last_warned: AtomicU64::new(0),
        }
    }

    pub(crate) fn now_ms(&self) -> u64 {
        let (wall0, mono0) = *self.anchor.get_or_init(|| ((self.wall)(), (self.mono)()));
        let now = wall0 + (self.mono)().saturating_sub(mono0);
        let wall = (self.wall)();
        if wall.abs_diff(now) > JUMP_MS {
            let last = self.last_warned.load(Ordering::Relaxed);
            let due = last == 0 || now.saturating_sub(last) >= WARN_EVERY_MS;
            if due
                && self
                    .last_warned
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                tracing::warn!(
                    wall_ms = wall,
                    engine_ms = now,
                    jump_ms = wall as i64 - now as i64,
                    "the system clock jumped; dedupd keeps time from the monotonic clock until restart (claims expire by it)"
                );
            }
        }
        now
    }
}

impl<W, M> std::fmt::Debug for GuardedClock<W, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedClock")
            .field("anchor", &self.anchor.get())
            .finish()
    }
}

impl<W, M> Clock for GuardedClock<W, M>
where
    W: Fn() -> u64 + Send + Sync + 'static,
    M: Fn() -> u64 + Send + Sync + 'static,
{
    fn now_ms(&self) -> u64 {
        GuardedClock::now_ms(self)
    }
}

/// Engine time that never starts below a floor: the engine time a data directory last
/// committed ([`crate::ledger::Ledger::open`] raises it once its shards are open). A wall
/// clock that is behind at start (a machine whose RTC lost days, an NTP step not yet made)
/// would otherwise give every claim of the run an expiry that much too early, and their
/// redeliveries would be processed again as soon as the clock is right.
pub(crate) struct FloorClock {
    inner: Arc<dyn Clock>,
    /// Added to the inner clock's time; set once at open.
    offset_ms: AtomicU64,
}

impl FloorClock {
    pub(crate) fn new(inner: Arc<dyn Clock>) -> FloorClock {
        FloorClock {
            inner,
            offset_ms: AtomicU64::new(0),
        }
    }

    /// Moves the engine's time up to `floor_ms` if it is below it, from now on (it then
    /// advances with the inner clock). Returns how far behind the inner clock was.
    pub(crate) fn raise_to(&self, floor_ms: u64) -> Option<u64> {
        let now = self.now_ms();
        let behind = floor_ms.checked_sub(now).filter(|b| *b > 0)?;
        self.offset_ms.fetch_add(behind, Ordering::SeqCst);
        Some(behind)
    }
}

impl std::fmt::Debug for FloorClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FloorClock")
            .field("offset_ms", &self.offset_ms.load(Ordering::Relaxed))
            .finish()
    }
}

impl Clock for FloorClock {
    fn now_ms(&self) -> u64 {
        self.inner.now_ms() + self.offset_ms.load(Ordering::Relaxed)
    }
}

/// A clock that only moves when told to; shared by clones.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    pub fn new(start_ms: u64) -> Self {
        ManualClock(Arc::new(AtomicU64::new(start_ms)))
    }

    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake() -> (
        Arc<AtomicU64>,
        Arc<AtomicU64>,
        GuardedClock<impl Fn() -> u64, impl Fn() -> u64>,
    ) {
        let wall = Arc::new(AtomicU64::new(1_700_000_000_000));
        let mono = Arc::new(AtomicU64::new(5_000));
        let (w, m) = (wall.clone(), mono.clone());
        let clock = GuardedClock::new(
            move || w.load(Ordering::SeqCst),
            move || m.load(Ordering::SeqCst),
        );
        (wall, mono, clock)
    }

    #[test]
    fn engine_time_follows_the_monotonic_clock_not_wall_jumps() {
        let (wall, mono, clock) = fake();
        assert_eq!(clock.now_ms(), 1_700_000_000_000);
        mono.fetch_add(1_000, Ordering::SeqCst);
        wall.fetch_add(1_000, Ordering::SeqCst);
        assert_eq!(clock.now_ms(), 1_700_000_001_000);
        // Three days forward on the wall: the engine's time moves by the 10 ms that passed.
        wall.fetch_add(3 * 86_400_000, Ordering::SeqCst);
        mono.fetch_add(10, Ordering::SeqCst);
        assert_eq!(clock.now_ms(), 1_700_000_001_010);
        // A day back: time does not run backwards.
        wall.store(1_700_000_000_000 - 86_400_000, Ordering::SeqCst);
        mono.fetch_add(10, Ordering::SeqCst);
        assert_eq!(clock.now_ms(), 1_700_000_001_020);
    }

    #[test]
    fn floor_clock_starts_at_the_floor_and_advances_with_its_clock() {
        let inner = ManualClock::new(1_000);
        let floor = FloorClock::new(Arc::new(inner.clone()));
        assert_eq!(floor.raise_to(500), None, "not behind: unchanged");
        assert_eq!(floor.now_ms(), 1_000);
        assert_eq!(floor.raise_to(5_000), Some(4_000));
        assert_eq!(floor.now_ms(), 5_000);
        inner.advance_ms(10);
        assert_eq!(floor.now_ms(), 5_010);
    }

    #[test]
    fn system_clock_is_close_to_the_wall_clock() {
        let now = SystemClock.now_ms();
        assert!(now.abs_diff(wall_ms()) < JUMP_MS, "{now} vs {}", wall_ms());
        assert!(SystemClock.now_ms() >= now);
    }
}
