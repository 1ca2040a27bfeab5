//! Fair shares of a shard's time between the subscribers whose handlers run on it.
//!
//! Subscribers share a shard's thread, and every message of a batch waits for the batch's
//! commit. The circuit breaker (`breaker.rs`) stops handlers that fail; a handler that
//! succeeds slowly — one that logs thousands of lines per message, say
//! (`fixture-log-flood`, ~5 ms a message) — stays within its budget, and every message of
//! another subscriber in the same batch waited for it: with five hostile subscribers next
//! to fifteen good ones, the good ones kept 0.55-0.79 of their throughput (`dedupd bench
//! adversarial`, three runs).
//!
//! The rule: while other subscribers have messages in the batch, a subscriber whose handler
//! calls took more than its share of the recent time — [`TAU`] over the number of
//! subscribers with messages in the batch, against its handler time decaying with time
//! constant [`TAU`] — has its next messages set aside instead of called. Set-aside messages
//! come back at the front of later batches, in order: all of them once the subscriber is
//! under its share again, and a slice of about [`SLICE`] of its calls (at least one) per
//! batch when nobody else has a message waiting, so a slow subscriber still uses a shard's idle time
//! without holding anyone's messages for long. A subscriber alone on its shard is never
//! held back, and duplicates and claims cost no handler time. Nothing is lost or reordered
//! within a subscriber: a set-aside message has no claim and no attempt used, and while a
//! subscriber has messages set aside its new ones wait behind them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::ledger::Job;

/// Time constant of the decaying measures, and the period a share is a fraction of.
pub(crate) const TAU: Duration = Duration::from_secs(1);
/// Handler time of set-aside calls given back per batch when nobody else is waiting: what
/// a message arriving meanwhile waits for at most, besides the commit; and long enough
/// next to a commit that a subscriber left alone with a backlog keeps most of its rate.
pub(crate) const SLICE: Duration = Duration::from_millis(20);
/// How soon set-aside messages are looked at again when nothing else wakes the shard.
pub(crate) const RECHECK: Duration = Duration::from_millis(5);

/// A quantity that decays exponentially with time constant [`TAU`].
#[derive(Debug, Clone, Copy)]
struct Decayed {
    value_us: f64,
    at: Instant,
}

impl Decayed {
    fn new(at: Instant) -> Self {
        Decayed { value_us: 0.0, at }
    }

    fn at(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.value_us * (-dt / TAU.as_secs_f64()).exp()
    }

    fn add(&mut self, us: f64, now: Instant) {
        self.value_us = self.at(now) + us;
        self.at = self.at.max(now);
    }
}

#[derive(Debug, Clone, Copy)]
struct Meter {
    used: Decayed,
    /// Mean handler time of its recent calls (an exponential average).
    mean_us: f64,
    /// One of its messages is set aside in the current batch: its later ones wait too.
    blocked: bool,
}

/// One shard's handler time per subscriber (by index) and its set-aside messages.
#[derive(Debug)]
pub(crate) struct Shares {
    meters: Vec<Option<Meter>>,
    /// Messages set aside, oldest first.
    deferred: VecDeque<Job>,
    /// Subscribers with messages in the current batch.
    active: usize,
    /// Per subscriber index, the last batch it was counted in (`epoch`).
    seen: Vec<u64>,
    epoch: u64,
}

impl Shares {
    pub(crate) fn new() -> Self {
        Shares {
            meters: Vec::new(),
            deferred: VecDeque::new(),
            active: 0,
            seen: Vec::new(),
            epoch: 0,
        }
    }

    pub(crate) fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// Every set-aside message (when the shard fails).
    pub(crate) fn take_deferred(&mut self) -> impl Iterator<Item = Job> + '_ {
        self.deferred.drain(..)
    }

    fn meter(&self, idx: usize) -> Option<Meter> {
        self.meters.get(idx).copied().flatten()
    }

    fn block(&mut self, idx: usize) {
        if let Some(Some(m)) = self.meters.get_mut(idx) {
            m.blocked = true;
        }
    }

    /// Starts a batch: set-aside messages go in front of the new ones, except those of a
    /// subscriber still over its share (and its new ones behind them); with nobody else
    /// waiting, a slice of them.
    pub(crate) fn begin_batch(&mut self, batch: &mut Vec<Job>, now: Instant) {
        for m in self.meters.iter_mut().flatten() {
            m.blocked = false;
        }
        self.epoch += 1;
        self.active = 0;
        for j in self.deferred.iter().chain(batch.iter()) {
            let idx = j.subscriber.0 as usize;
            if self.seen.len() <= idx {
                self.seen.resize(idx + 1, 0);
            }
            if self.seen[idx] != self.epoch {
                self.seen[idx] = self.epoch;
                self.active += 1;
            }
        }
        if self.deferred.is_empty() {
            return;
        }
        let waiting = self.deferred.len();
        let jobs: Vec<Job> = self.deferred.drain(..).chain(batch.drain(..)).collect();
        // With one subscriber in the batch, the calls given back: about a slice of its time.
        let mut slice_left = SLICE.as_micros() as f64;
        for (i, job) in jobs.into_iter().enumerate() {
            let idx = job.subscriber.0 as usize;
            let held = match self.meter(idx) {
                Some(m) if m.blocked => true,
                Some(m) if i < waiting && self.active == 1 => {
                    let over = slice_left <= 0.0;
                    slice_left -= m.mean_us.max(1.0);
                    over
                }
                Some(_) if i < waiting => self.is_over(idx, now),
                _ => false,
            };
            if held {
                self.block(idx);
                self.deferred.push_back(job);
            } else {
                batch.push(job);
            }
        }
        // A subscriber's messages left in the batch all come before its held ones: they
        // are called (unless it goes over its share during the batch).
        for m in self.meters.iter_mut().flatten() {
            m.blocked = false;
        }
    }

    /// Whether a subscriber used more than its share while others have messages waiting.
    fn is_over(&self, idx: usize, now: Instant) -> bool {
        if self.active < 2 {
            return false;
        }
        let share = TAU.as_micros() as f64 / self.active as f64;
        self.meter(idx).is_some_and(|m| m.used.at(now) > share)
    }

    /// Whether the subscriber's next handler call in this batch is to be set aside: it is
    /// over its share, or one of its messages already was.
    /// The clock is read only when it can matter (a subscriber whose handler ran, next to
    /// others): this is asked for every new message.
    pub(crate) fn holds_back(&mut self, idx: usize, now: impl FnOnce() -> Instant) -> bool {
        let Some(m) = self.meter(idx) else {
            return false;
        };
        let held = m.blocked || (self.active >= 2 && self.is_over(idx, now()));
        if held {
            self.block(idx);
        }
        held
    }

    /// Sets a message aside, behind the others.
    pub(crate) fn defer(&mut self, job: Job) {
        self.deferred.push_back(job);
    }

    /// Counts a handler call's time.
    pub(crate) fn record_call(&mut self, idx: usize, took: Duration, now: Instant) {
        if self.meters.len() <= idx {
            self.meters.resize(idx + 1, None);
        }
        let us = took.as_micros() as f64;
        let m = self.meters[idx].get_or_insert(Meter {
            used: Decayed::new(now),
            mean_us: us,
            blocked: false,
        });
        m.used.add(us, now);
        m.mean_us += (us - m.mean_us) * 0.2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::SubscriberId;

    fn job(sub: u32, seq: u64) -> Job {
        let (tx, _rx) = crossbeam_channel::unbounded();
        Job::new(seq, SubscriberId(sub), seq as u128, 0, "m", b"{}", tx)
    }

    /// Runs a batch's calls as `decide` does: held-back jobs are set aside, the others
    /// "called" at `cost` each (per subscriber). Returns the called jobs.
    fn run(
        s: &mut Shares,
        mut batch: Vec<Job>,
        now: &mut Instant,
        cost: &[(u32, u64)],
    ) -> Vec<(u32, u64)> {
        s.begin_batch(&mut batch, *now);
        let mut called = Vec::new();
        for j in batch {
            let idx = j.subscriber.0 as usize;
            if s.holds_back(idx, || *now) {
                s.defer(j);
                continue;
            }
            let us = cost
                .iter()
                .find(|(s, _)| *s == j.subscriber.0)
                .map_or(1, |c| c.1);
            *now += Duration::from_micros(us);
            s.record_call(idx, Duration::from_micros(us), *now);
            called.push((j.subscriber.0, j.seq));
        }
        called
    }

    #[test]
    fn a_subscriber_alone_is_never_held_back() {
        let mut s = Shares::new();
        let mut now = Instant::now();
        // 5 ms a call, 400 calls: two seconds of handler time, twice the period.
        let called = run(
            &mut s,
            (0..400).map(|i| job(3, i)).collect(),
            &mut now,
            &[(3, 5_000)],
        );
        assert_eq!(called.len(), 400);
        assert!(!s.has_deferred());
    }

    #[test]
    fn a_slow_subscriber_next_to_others_gets_its_share_then_waits_in_order() {
        let mut s = Shares::new();
        let mut now = Instant::now();
        let cost = [(1, 5_000), (2, 10)];
        // Subscriber 1 costs 5 ms a call; 2 is cheap. Share with two: 500 ms.
        let batch: Vec<Job> = (0..200)
            .map(|i| job(1, i))
            .chain((0..50).map(|i| job(2, i)))
            .collect();
        let called = run(&mut s, batch, &mut now, &cost);
        // Its decaying time passes 500 ms after ~139 calls (0.69 s of calls); then none.
        let slow = called.iter().filter(|c| c.0 == 1).count();
        assert!((130..=145).contains(&slow), "{slow}");
        assert_eq!(
            called.iter().filter(|c| c.0 == 2).count(),
            50,
            "the other is never held"
        );
        assert_eq!(s.deferred.len(), 200 - slow);
        // New messages of both: 1's stay behind its set-aside ones, 2's run.
        let called = run(&mut s, vec![job(1, 500), job(2, 500)], &mut now, &cost);
        assert_eq!(called, vec![(2, 500)]);
        assert_eq!(s.deferred.back().map(|j| j.seq), Some(500));
        // Once its time decayed under the share, its messages come back, oldest first.
        now += Duration::from_secs(2);
        let called = run(&mut s, vec![job(2, 501)], &mut now, &cost);
        let back: Vec<u64> = called.iter().filter(|c| c.0 == 1).map(|c| c.1).collect();
        assert!(back.len() > 10, "{back:?}");
        assert_eq!(back[0], slow as u64);
        assert!(back.windows(2).all(|w| w[0] < w[1]), "in order: {back:?}");
    }

    #[test]
    fn with_nobody_else_waiting_set_aside_calls_come_back_a_slice_at_a_time() {
        let mut s = Shares::new();
        let mut now = Instant::now();
        let cost = [(1, 2_000), (2, 10)];
        let batch: Vec<Job> = (0..1000).map(|i| job(1, i)).chain([job(2, 0)]).collect();
        run(&mut s, batch, &mut now, &cost);
        let waiting = s.deferred.len();
        assert!(waiting > 100, "{waiting}");
        // An empty batch (the shard's recheck): only subscriber 1 has work.
        let called = run(&mut s, Vec::new(), &mut now, &cost);
        let first = 1000 - waiting as u64;
        assert_eq!(
            called,
            (first..first + 10).map(|i| (1, i)).collect::<Vec<_>>(),
            "20 ms of 2 ms calls"
        );
        let mut total = 10;
        while s.has_deferred() {
            total += run(&mut s, Vec::new(), &mut now, &cost).len();
        }
        assert_eq!(total, waiting, "every set-aside message is called once");
    }
}
