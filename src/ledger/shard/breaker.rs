//! A subscriber's circuit breaker on one shard: the bulkhead between subscribers that share
//! a shard's thread. A handler that traps, runs out of its CPU budget or hits its memory
//! cap costs its shard up to the whole budget per attempt, and every message of a broken
//! handler takes `max_attempts` of them: with five such subscribers next to fifteen good
//! ones, the good ones kept 0.10-0.13 of their throughput (`dedupd bench adversarial`).
//!
//! After `failures` such calls in a row the breaker opens: for `cooldown` the handler is
//! not called. A message that would have called it uses up an attempt without the call
//! and waits until the cool-down ends (with the shard's other retries); once its attempts
//! are used up it is dead-lettered with the last failure in its reason (replayable once
//! the handler is fixed; a new handler starts with a closed breaker). After the cool-down
//! the next message is called: a call that completes closes the breaker, a failure opens
//! it again. Waiting rather than dead-lettering at once means a breaker opened by a
//! handler that is only slow for a while (a wall-clock budget on a busy machine) delays
//! its messages instead of dead-lettering them. A call that completes —
//! with success, or with an error the handler returned itself (retryable or permanent) —
//! resets the count: those cost no more than a good call and say nothing about the sandbox.

use crate::effects::Failure;

/// What a call's result did to the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    None,
    Opened,
    Closed,
}

#[derive(Debug, Default)]
pub(crate) struct Breaker {
    /// Sandbox failures in a row since the last completed call.
    failures: u32,
    /// Set while open, and after the cool-down until the next call decides (half-open).
    open_until_ms: Option<u64>,
    last: Option<Failure>,
}

/// Whether a failure counts against the breaker: the sandbox stopped the call.
fn counts(f: &Failure) -> bool {
    matches!(
        f,
        Failure::Timeout { .. } | Failure::MemoryLimit { .. } | Failure::Trap(_)
    )
}

impl Breaker {
    /// `Some(failure)` while the breaker is open: the message is not given to the handler.
    pub(crate) fn refuses(&self, now_ms: u64) -> Option<Failure> {
        match (self.open_until_ms, &self.last) {
            (Some(until), Some(last)) if now_ms < until => Some(Failure::CircuitOpen {
                failures: self.failures,
                last: last.to_string(),
                retry_in_ms: until - now_ms,
            }),
            _ => None,
        }
    }

    /// Takes a call's result into account. `threshold` 0: never opens.
    pub(crate) fn record(
        &mut self,
        result: Result<(), &Failure>,
        now_ms: u64,
        threshold: u32,
        cooldown_ms: u64,
    ) -> Transition {
        match result {
            Err(f) if counts(f) => {
                self.failures = self.failures.saturating_add(1);
                self.last = Some(f.clone());
                let half_open = self.open_until_ms.is_some();
                if threshold > 0 && (half_open || self.failures >= threshold) {
                    self.open_until_ms = Some(now_ms.saturating_add(cooldown_ms));
                    return Transition::Opened;
                }
                Transition::None
            }
            _ => {
                self.failures = 0;
                if self.open_until_ms.take().is_some() {
                    return Transition::Closed;
                }
                Transition::None
            }
        }
    }

    /// Sandbox failures in a row so far.
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trap() -> Failure {
        Failure::Trap("unreachable".into())
    }

    #[test]
    fn opens_after_the_threshold_of_sandbox_failures_in_a_row() {
        let mut b = Breaker::default();
        for i in 0..4 {
            assert_eq!(b.record(Err(&trap()), i, 5, 1_000), Transition::None);
            assert!(b.refuses(i).is_none());
        }
        assert_eq!(b.record(Err(&trap()), 4, 5, 1_000), Transition::Opened);
        let refused = b.refuses(5).unwrap();
        assert_eq!(refused.kind(), "circuit_open");
        let text = refused.to_string();
        assert!(
            text.contains("5 ") && text.contains("unreachable"),
            "{text}"
        );
        // Refused for the whole cool-down, from the moment it opened.
        assert!(b.refuses(1_003).is_some());
        assert!(b.refuses(1_004).is_none());
    }

    #[test]
    fn a_completed_call_resets_the_count() {
        let mut b = Breaker::default();
        for _ in 0..4 {
            b.record(Err(&trap()), 0, 5, 1_000);
        }
        // The handler's own errors are completed calls.
        let permanent = Failure::Permanent("bad input".into());
        assert_eq!(b.record(Err(&permanent), 0, 5, 1_000), Transition::None);
        assert_eq!(b.failures(), 0);
        for _ in 0..4 {
            assert_eq!(b.record(Err(&trap()), 0, 5, 1_000), Transition::None);
        }
        assert_eq!(b.record(Ok(()), 0, 5, 1_000), Transition::None);
        assert_eq!(b.failures(), 0);
        assert!(b.refuses(0).is_none());
    }

    #[test]
    fn after_the_cooldown_one_call_decides() {
        let timeout = Failure::Timeout { budget_ms: 10 };
        let mut b = Breaker::default();
        for _ in 0..3 {
            b.record(Err(&timeout), 0, 3, 100);
        }
        assert!(b.refuses(99).is_some());
        // Half-open: the next call runs; one failure opens it again at once.
        assert!(b.refuses(100).is_none());
        assert_eq!(b.record(Err(&timeout), 100, 3, 100), Transition::Opened);
        assert!(b.refuses(150).is_some());
        assert!(b.refuses(200).is_none());
        // A completed call closes it.
        assert_eq!(b.record(Ok(()), 200, 3, 100), Transition::Closed);
        assert!(b.refuses(201).is_none());
        assert_eq!(b.record(Err(&timeout), 201, 3, 100), Transition::None);
    }

    #[test]
    fn a_zero_threshold_never_opens() {
        let mut b = Breaker::default();
        for i in 0..1_000 {
            assert_eq!(b.record(Err(&trap()), i, 0, 100), Transition::None);
            assert!(b.refuses(i).is_none());
        }
    }
}
