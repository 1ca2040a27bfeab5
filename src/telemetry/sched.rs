//! Time on a CPU and time spent waiting for one, per thread, from Linux's scheduler
//! statistics (`/proc/<pid>/task/<tid>/schedstat`: nanoseconds running, nanoseconds
//! runnable but waiting in a run queue, timeslices). A thread waits while every core is
//! held, by the process's other threads or by other work on the machine: a batch that
//! took 20 ms of which 15 were spent waiting for a core was not slow because of anything
//! it did. `dedupd bench` prints the whole process's figures, and the shard's "slow batch"
//! debug line its thread's.

use std::collections::HashMap;

/// One reading of one thread, or a sum or difference of readings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Sched {
    /// Nanoseconds on a CPU.
    pub(crate) running_ns: u64,
    /// Nanoseconds runnable, waiting in a run queue for a CPU.
    pub(crate) waiting_ns: u64,
}

impl Sched {
    /// What happened between `earlier` and this reading of the same thread.
    pub(crate) fn since(self, earlier: Sched) -> Sched {
        Sched {
            running_ns: self.running_ns.saturating_sub(earlier.running_ns),
            waiting_ns: self.waiting_ns.saturating_sub(earlier.waiting_ns),
        }
    }

    fn add(self, other: Sched) -> Sched {
        Sched {
            running_ns: self.running_ns + other.running_ns,
            waiting_ns: self.waiting_ns + other.waiting_ns,
        }
    }
}

/// The calling thread now; `None` off Linux or without `/proc`.
pub(crate) fn thread() -> Option<Sched> {
    parse(&std::fs::read_to_string("/proc/thread-self/schedstat").ok()?)
}

/// What the calling thread did since `start` (its [`thread`] reading); nothing when either
/// reading is missing.
pub(crate) fn thread_since(start: Option<Sched>) -> Sched {
    start
        .zip(thread())
        .map(|(a, b)| b.since(a))
        .unwrap_or_default()
}

/// Every live thread of this process now, by thread id.
pub(crate) fn threads() -> Option<Threads> {
    let mut by_tid = HashMap::new();
    for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        // A thread that ended between the listing and the read is skipped.
        if let Some(s) = std::fs::read_to_string(entry.path().join("schedstat"))
            .ok()
            .and_then(|t| parse(&t))
        {
            by_tid.insert(tid, s);
        }
    }
    Some(Threads(by_tid))
}

/// A reading of a process's threads, by thread id.
#[derive(Debug, Clone, Default)]
pub(crate) struct Threads(HashMap<u32, Sched>);

impl Threads {
    /// What the threads of `self` did since `earlier`: a thread in both counts its
    /// difference, a thread started since counts whole. A thread that ended in between is
    /// not in `self`, so the sum is a lower bound.
    pub(crate) fn since(&self, earlier: &Threads) -> Sched {
        self.0.iter().fold(Sched::default(), |sum, (tid, now)| {
            let was = earlier.0.get(tid).copied().unwrap_or_default();
            sum.add(now.since(was))
        })
    }
}

/// Parses a `schedstat` text: three numbers, of which the first two are used.
fn parse(text: &str) -> Option<Sched> {
    let mut f = text.split_whitespace().map(|n| n.parse::<u64>());
    Some(Sched {
        running_ns: f.next()?.ok()?,
        waiting_ns: f.next()?.ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_text_and_rejects_other_text() {
        let s = parse("404965 1200 3\n").unwrap();
        assert_eq!((s.running_ns, s.waiting_ns), (404_965, 1200));
        assert_eq!(parse("404965\n"), None);
        assert_eq!(parse("a b c"), None);
    }

    #[test]
    fn a_threads_difference_counts_new_threads_whole_and_never_goes_below_zero() {
        let at = |pairs: &[(u32, u64, u64)]| {
            Threads(
                pairs
                    .iter()
                    .map(|&(t, r, w)| {
                        let s = Sched {
                            running_ns: r,
                            waiting_ns: w,
                        };
                        (t, s)
                    })
                    .collect(),
            )
        };
        let before = at(&[(1, 100, 10), (2, 50, 5), (3, 70, 7)]);
        // Thread 1 ran 20 more and waited 3 more, 2 ended, 4 is new; a counter that went
        // back (thread 3, a reused id) counts nothing rather than a negative figure.
        let after = at(&[(1, 120, 13), (3, 60, 2), (4, 30, 4)]);
        let d = after.since(&before);
        assert_eq!((d.running_ns, d.waiting_ns), (50, 7));
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn this_thread_running_grows_with_work() {
        let before = thread().unwrap();
        let mut x = 0u64;
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(30) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let d = thread().unwrap().since(before);
        // 30 ms of spinning, some of which may have been spent waiting on a busy machine.
        assert!(d.running_ns + d.waiting_ns >= 25_000_000, "{d:?}");
        assert!(d.running_ns > 0, "{d:?}");
        let all = threads().unwrap();
        assert!(!all.0.is_empty());
    }
}
